"""Loading checkpoints the scripts were given: the config a folder or Hub id holds (a DDL one, or a Llama to start
from), its weight files checked against it before anything loads, and DDL's own parameters told from a Llama's.
"""

import json
import os
import zipfile

import torch
from safetensors import SafetensorError
from transformers import AutoConfig
from transformers.utils import logging

from ddl import DDLConfig, DDLForCausalLM

from .outputs import UsageError, first_line
from .presets import ddl_config_from_llama


logger = logging.get_logger(__name__)


def checkpoint_config(path: str, flag: str, model_type: str = DDLConfig.model_type, trust_remote_code: bool = False,
                      fix: str = ""):
    """The config of the checkpoint that `flag` names (a folder or a Hub id), which must be a `model_type` one: one
    line otherwise, saying what it is and `fix`, what to do; a non-DDL Llama where a DDL checkpoint is expected is
    pointed to --init_from_llama. (`import ddl` registered the DDL config: it needs no remote code.)"""
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UsageError(f"{flag} {path!r}: cannot read a model config there ({err}).") from err
    if config.model_type != model_type:
        if model_type == DDLConfig.model_type and config.model_type == "llama" and not fix:
            fix = f" Build a DDL model from it with --init_from_llama {path}."
        name = "DDL" if model_type == DDLConfig.model_type else model_type.capitalize()
        raise UsageError(f"{flag} {path!r} is a {config.model_type!r} checkpoint, not {name} (model_type "
                         f"{model_type!r}).{fix}")
    return config


def load_pretrained(model_class, path: str, flag: str, **kwargs):
    """`model_class.from_pretrained(path, **kwargs)`, a file that cannot be read (a damaged download, a file system
    error) as one line naming the checkpoint."""
    try:
        return model_class.from_pretrained(path, **kwargs)
    except (OSError, SafetensorError) as err:
        raise UsageError(f"{flag} {path!r}: cannot load its weights ({first_line(err)}).") from err


def safetensors_shapes(path: str) -> dict[str, list[int]]:
    """The tensors a safetensors file holds (name -> shape), read from its header alone, after checking that the file
    is as long as its header says. A file cut short (a kill, a full disk) is a `ValueError` that says how."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("is empty" if size == 0 else "is cut short (no safetensors header)")
        length = int.from_bytes(head, "little")
        if length > size - 8:
            raise ValueError("is cut short (its header runs past the end of the file)")
        try:
            header = json.loads(f.read(length))
            tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
            end = max((entry["data_offsets"][1] for entry in tensors.values()), default=0)
            shapes = {name: list(entry["shape"]) for name, entry in tensors.items()}
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
            raise ValueError("has a safetensors header that does not parse") from err
    if 8 + length + end > size:
        raise ValueError("is cut short (its tensors run past the end of the file)")
    return shapes


def file_damage(path: str) -> str | None:
    """Why a file of a checkpoint cannot be loaded, judged cheaply from its header or its end (None: it looks whole):
    an empty file, a safetensors file whose header does not parse or whose tensors run past its end, a `torch.save`
    file (a zip) without its closing directory (the optimizer's state is not loaded to tell), a JSON file that does
    not parse. What a full disk or a power loss during a save leaves."""
    name = os.path.basename(path)
    if not name.endswith((".safetensors", ".pt", ".pth", ".bin", ".json")):
        return None  # (other files: code, templates, text; loading them fails in words of its own)
    try:
        if os.path.getsize(path) == 0:
            return "is empty"
        if name.endswith(".safetensors"):
            safetensors_shapes(path)
        elif name.endswith((".pt", ".pth", ".bin")):
            if not zipfile.is_zipfile(path):
                return "is cut short (not a complete torch file)"
        elif name.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                json.load(f)
    except ValueError as err:  # (json's errors, a file that is not UTF-8, `safetensors_shapes`)
        return str(err) if name.endswith(".safetensors") else "does not parse (cut short?)"
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    return None


def _weight_files(folder: str) -> list[str]:
    """The safetensors files of a saved model folder: `model.safetensors`, or the shards its index names."""
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return ["model.safetensors"]
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return []
    try:
        with open(index, encoding="utf-8") as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ["model.safetensors.index.json"]  # reported as damaged below


def check_weights(folder: str, model_class, config, flag: str, fit: str = "its config.json",
                  fix: str = "the config is not the weights' own: restore the checkpoint's config.json, or use another "
                             "checkpoint") -> None:
    """A local model folder's weights are whole and fit the model `config` describes: a file cut short, or weights
    of other shapes (a config.json not the weights' own), is one line naming the folder, instead of safetensors'
    traceback or Transformers' mismatch report. Read from the files' headers and a model built on the meta device:
    nothing is loaded. A Hub id is left to `from_pretrained`. `fit` names what `config` was made from and `fix` says
    what to do, in the message of weights that do not fit it."""
    if not os.path.isdir(folder):
        return
    shapes = {}
    for name in _weight_files(folder):
        path = os.path.join(folder, name)
        problem = "is missing" if not os.path.isfile(path) else file_damage(path)
        if problem is None and name.endswith(".safetensors"):
            shapes.update(safetensors_shapes(path))
        elif problem is not None:
            raise UsageError(f"{flag} {folder!r}: its {name} {problem}, so the checkpoint is damaged (a save cut "
                             "short?); use another checkpoint, or save this one again.")
    if not shapes:
        return
    with torch.device("meta"):
        expected = {key: list(value.shape) for key, value in model_class(config).state_dict().items()}
    wrong = []
    for key, shape in shapes.items():
        target = key if key in expected else f"model.{key}"  # (a base model's weights: no prefix)
        if target in expected and expected[target] != shape:
            wrong.append(f"{key} is {shape}, the config needs {expected[target]}")
    if wrong:
        raise UsageError(f"{flag} {folder!r}: its weights do not fit {fit} ({len(wrong)} tensors, e.g. {wrong[0]}); "
                         f"{fix}.")


def load_from_llama(path: str, ddl_config: DDLConfig, **kwargs) -> DDLForCausalLM:
    """A DDL model whose shared parameters (embeddings, attention, MLP, norms, LM head) are the Llama checkpoint's.

    DDL keeps Llama's parameter names, so `from_pretrained` matches them by name; the DDL-only parameters (gates,
    values, compressors, EC) are reported missing and get `DDLPreTrainedModel._init_weights`. With
    `ddl_residual="additive"` and `ddl_value_channels=1` the result computes exactly the Llama's function.
    """
    model, info = DDLForCausalLM.from_pretrained(path, config=ddl_config, output_loading_info=True, **kwargs)
    # a Llama checkpoint lacks DDL's branch, QK-norm's norms and an LM head tied to the embeddings
    ddl_only = set(ddl_branch_parameters(model))
    shared_missing = [k for k in info["missing_keys"] if k not in ddl_only and k != "lm_head.weight"
                      and ".q_norm." not in k and ".k_norm." not in k]
    if shared_missing or info["unexpected_keys"] or info["mismatched_keys"]:
        raise UsageError(
            f"--init_from_llama {path!r}: the checkpoint does not match a Llama of this shape (missing "
            f"{shared_missing[:5]}, unexpected {list(info['unexpected_keys'])[:5]}, mismatched "
            f"{list(info['mismatched_keys'])[:5]})."
        )
    logger.info("Loaded %s from Llama %s; freshly initialised: %d DDL tensors", type(model).__name__, path,
                len(info["missing_keys"]))
    return model


def check_llama_weights(path: str, llama_config, overrides: dict, ddl_flags: dict) -> None:
    """The weights of the Llama folder `path` are whole and fit the DDL model built from it (`check_weights`: DDL keeps
    Llama's parameter names and shapes), checked before anything is loaded: a config.json of another size, or
    --config_overrides that change the sizes, is one line naming the folder instead of `from_pretrained`'s
    size-mismatch traceback."""
    check_weights(path, DDLForCausalLM, ddl_config_from_llama(llama_config, None, **ddl_flags), "--init_from_llama")
    if overrides:
        check_weights(path, DDLForCausalLM, ddl_config_from_llama(llama_config, overrides, **ddl_flags),
                      "--init_from_llama", fit="the model its config.json and --config_overrides describe",
                      fix="a DDL model built from a Llama keeps the Llama's sizes: drop the overrides that change them")


# DDL's own modules (gates and values, compressors, EC), by class: everything else in a DDL model is a module a Llama
# of the same shape has (embeddings, attention, MLP, norms, LM head). By the class's name, so that a model loaded as
# remote code (its classes are copies under transformers_modules) is read the same way.
DDL_BRANCH_CLASSES = ("DDLDeltaResidual", "DDLCompressor", "DDLEmbedConv")


def ddl_branch_parameters(model) -> list[str]:
    """The names of DDL's own parameters (gates, values, compressors, EC, the readout) in `model`: the one home of
    that distinction (LoRA trains the branch in full; a model built from a Llama initialises it)."""
    return [f"{owner}.{name}" if owner else name for owner, module in model.named_modules()
            if type(module).__name__ in DDL_BRANCH_CLASSES for name, _ in module.named_parameters(recurse=False)]


__all__ = [
    "DDL_BRANCH_CLASSES",
    "check_llama_weights",
    "check_weights",
    "checkpoint_config",
    "ddl_branch_parameters",
    "file_damage",
    "load_from_llama",
    "load_pretrained",
    "safetensors_shapes",
]
