"""Reusable pieces of `train.py`: presets, model building, data loading and packing, tokenizer training, model card.

Everything here uses the public 🤗 API (datasets, tokenizers, transformers) and logs instead of printing. User
mistakes raise `UsageError` (a `ValueError`) with a message that says what was expected and how to fix it; the
script turns it into a one-line error and a non-zero exit.
"""

import contextlib
import dataclasses
import enum
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
import zipfile
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from transformers import AutoConfig, PreTrainedTokenizerFast, Trainer, TrainerCallback, TrainerState
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy, SaveStrategy
from transformers.utils import PushInProgress
from transformers.utils import logging

from ddl import DDLConfig, DDLForCausalLM
from .outputs import (FolderLock, UsageError, claim_folder, folder_contents, release_folder, save_figure, write_json,
                      write_text)
from .streaming import StreamPosition, save_position, saved_position


logger = logging.get_logger(__name__)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Chat turns (ChatML): <|im_start|>role\ncontent<|im_end|>\n. The assistant's content and its <|im_end|> are marked as
# generation, so `apply_chat_template(..., return_assistant_tokens_mask=True)` (TRL's `assistant_only_loss`) trains
# the model on its replies and on ending them.
CHAT_START, CHAT_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DATA_EXTENSIONS = {"txt": "text", "text": "text", "json": "json", "jsonl": "json", "csv": "csv"}

# Model shapes. small and medium are the paper's sizes (Table 1: 12 x 768 and 24 x 1024, heads of dim 128, 124M and
# 353M parameters with GPT-2's 50k vocabulary), with the backbone of the authors' runs: tied embeddings, no biases,
# dropout 0, QK-norm, RMSNorm eps 1e-5, a SwiGLU MLP of width floor(8d/3), and DDLConfig's defaults (the authors':
# d_v = 4, CC, EC, one compressor per block, their initialisation; docs/faithfulness.md). tiny is a CPU demo.
_SHARED = dict(tie_word_embeddings=True, attention_bias=False, mlp_bias=False, attention_dropout=0.0, qk_norm=True,
               rms_norm_eps=1e-5)
PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
        max_position_embeddings=1024, **_SHARED,
    ),
    "small": dict(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=6, head_dim=128,
        max_position_embeddings=1024, **_SHARED,
    ),
    "medium": dict(
        hidden_size=1024, intermediate_size=2730, num_hidden_layers=24, num_attention_heads=8, head_dim=128,
        max_position_embeddings=1024, **_SHARED,
    ),
}
# The paper's optimisation recipe (Section 4): AdamW (0.9, 0.95), weight decay 0.1, peak lr 1e-3 with cosine decay
# after a linear warm-up (2000 of 100k steps), gradient clipping 1.0. These become train.py's defaults for
# `TrainingArguments`; any flag given on the command line wins.
PAPER_RECIPE = dict(
    learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.1, lr_scheduler_type="cosine",
    max_grad_norm=1.0,
)
# Per-preset run defaults. tiny is sized to train on the embedded corpus in about 5 minutes (275–320 s measured) on 2
# idle CPU cores (2M tokens, 1.4 epochs); small/medium use the paper's context (1024) and warm-up (2000 steps) and
# leave the length (`--max_steps` or `--num_train_epochs`) and the batch (paper: 480 x 1024 tokens per step) to the
# caller.
PRESET_RUN_DEFAULTS: dict[str, dict] = {
    "tiny": dict(
        block_size=256, per_device_train_batch_size=16, per_device_eval_batch_size=32, max_steps=500,
        warmup_steps=0.05, logging_steps=10, eval_steps=250, save_steps=250,
    ),
    "small": dict(
        block_size=1024, per_device_train_batch_size=16, per_device_eval_batch_size=16, warmup_steps=2000,
        logging_steps=50, eval_steps=2000, save_steps=2000,
    ),
    "medium": dict(
        block_size=1024, per_device_train_batch_size=8, per_device_eval_batch_size=8, warmup_steps=2000,
        logging_steps=50, eval_steps=2000, save_steps=2000,
    ),
}


def config_error_message(err: StrictDataclassError) -> str:
    """The message of the `ValueError` a `DDLConfig` validator raised (wrapped by huggingface_hub's strict check)."""
    return str(err.__cause__ or err)


def parse_config_overrides(overrides: str | None) -> dict:
    """`"hidden_size=64,ddl_beta_init=0.5,qk_norm=false"` -> a dict of `DDLConfig` fields (JSON values, else str)."""
    if not overrides:
        return {}
    fields = {f.name: f for f in dataclasses.fields(DDLConfig)}
    parsed = {}
    for item in overrides.split(","):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--config_overrides expects 'key=value,key=value', got {item!r} in {overrides!r}.")
        if key not in fields:
            raise UsageError(f"--config_overrides: {key!r} is not a DDLConfig field (see ddl/configuration_ddl.py).")
        try:
            value = json.loads(raw.strip())
        except json.JSONDecodeError:
            value = raw.strip()
        if isinstance(value, int) and not isinstance(value, bool) and isinstance(fields[key].default, float):
            value = float(value)  # `ddl_beta_init=1` means 1.0 (the strict config rejects an int for a float field)
        parsed[key] = value
    return parsed


def make_config(**kwargs) -> DDLConfig:
    """`DDLConfig(**kwargs)`, with a validation failure turned into a `UsageError` that names the field."""
    try:
        return DDLConfig(**kwargs)
    except StrictDataclassError as err:
        raise UsageError(config_error_message(err)) from err


def check_training_arguments(args) -> None:
    """Values `TrainingArguments` accepts and Trainer then misuses, refused before anything is written: a batch of 0
    or no accumulation (a late DataLoader error, a division by zero), a negative or non-finite learning rate, weight
    decay, epsilon or clipping norm (AdamW's traceback after the tokenizer is written; a negative norm silently
    turns clipping off), betas outside [0, 1), and no epochs to train (`--max_steps -1` with
    `--num_train_epochs 0`)."""
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} {getattr(args, name)}: must be at least 1.")
    for name in ("learning_rate", "weight_decay", "adam_epsilon", "max_grad_norm"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            what = " (0: no clipping)" if name == "max_grad_norm" else ""
            raise UsageError(f"--{name} {value}: must be a number >= 0{what}.")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            raise UsageError(f"--{name} {getattr(args, name)}: must be in [0, 1).")
    if args.max_steps <= 0 and not args.num_train_epochs > 0:
        raise UsageError(f"--num_train_epochs {args.num_train_epochs}: must be above 0 (or give --max_steps).")


def parsed_arguments(parser, argv):
    """`parser.parse_args_into_dataclasses(argv)` with the `ValueError`s of the dataclasses' own checks (e.g.
    `TrainingArguments`: a negative --warmup_steps) as one-line `UsageError`s."""
    try:
        return parser.parse_args_into_dataclasses(args=argv)
    except ValueError as err:
        raise UsageError(" ".join(str(err).split())) from err


def check_ddl_environment() -> None:
    """DDL's runtime choices from the environment (`DDL_IMPLEMENTATION`, `DDL_CPU_KERNEL`), read at the start: an
    invalid value would otherwise be a `ValueError` at the model's first use, after the tokenizer is written."""
    try:
        DDLConfig().ddl_implementation
        with contextlib.suppress(ImportError):
            from ddl_kernels.build import switched_on

            switched_on()
    except ValueError as err:
        raise UsageError(str(err)) from err
    if os.environ.get("DDL_REBUILD_STATES", "").strip().lower() not in ("", "off"):
        logger.warning("DDL_REBUILD_STATES is set, but DDL no longer rebuilds its states in backward (ddl 0.3): it is "
                       "ignored. For less memory, pass --gradient_checkpointing.")


def variant_arguments():
    """A dataclass of command-line flags (for `HfArgumentParser`), one per DDLConfig field that chooses the variant:
    every `ddl_*` field and QK-norm's, each unset (None: the preset's or the checkpoint's value) unless given, its
    help the first sentence of DDLConfig's documentation of the field. Derived from the config, so that every field
    has its flag and a new one gets it."""
    entries = re.findall(r"^ {8}(\w+) \(`[^\n]*\):\n((?: {12}.*\n?)+)", DDLConfig.__doc__, re.M)
    first_sentence = re.compile(r"(?<=\.)\s+(?=[A-Z`\"(])")
    helps = {name: first_sentence.split(" ".join(text.split()), maxsplit=1)[0] for name, text in entries}
    flags = []
    for config_field in dataclasses.fields(DDLConfig):
        if config_field.name.startswith(("ddl_", "qk_norm")):
            kind = config_field.type if type(None) in getattr(config_field.type, "__args__", ()) else (
                config_field.type | None)
            flags.append((config_field.name, kind, dataclasses.field(
                default=None, metadata={"help": helps.get(config_field.name, "See DDLConfig.")})))
    return dataclasses.make_dataclass("VariantArguments", flags)


def preset_config(preset: str, vocab_size: int, overrides: dict | None = None, **ddl_kwargs) -> DDLConfig:
    """A fresh `DDLConfig` from a preset, then `--config_overrides`, then the direct `--ddl_*` flags (None = unset)."""
    if preset not in PRESETS:
        raise UsageError(f"Unknown preset {preset!r}; choose one of {sorted(PRESETS)}.")
    kwargs = {**PRESETS[preset], "vocab_size": vocab_size, **(overrides or {})}
    kwargs.update({k: v for k, v in ddl_kwargs.items() if v is not None})
    return make_config(**kwargs)


def ddl_config_from_llama(llama_config, overrides: dict | None = None, **ddl_kwargs) -> DDLConfig:
    """A `DDLConfig` with every Llama field of `llama_config` plus the DDL choices (None = DDLConfig's default)."""
    if llama_config.model_type != "llama":
        raise UsageError(
            f"--init_from_llama expects a Llama checkpoint (model_type 'llama'), got model_type "
            f"{llama_config.model_type!r}."
        )
    skip = {"model_type", "architectures", "transformers_version", "auto_map", "layer_types"}
    kwargs = {k: v for k, v in llama_config.to_dict().items() if k not in skip}
    kwargs.update(overrides or {})
    kwargs.update({k: v for k, v in ddl_kwargs.items() if v is not None})
    return make_config(**kwargs)


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


def load_ddl_checkpoint(path: str, **kwargs) -> DDLForCausalLM:
    """Continue from a DDL checkpoint (a folder or a Hub id); a non-DDL checkpoint gets a pointer to the fix, and
    weights that are damaged or do not fit the config one line (`check_weights`)."""
    config = checkpoint_config(path, "--model_name_or_path")
    check_weights(path, DDLForCausalLM, config, "--model_name_or_path")
    return load_pretrained(DDLForCausalLM, path, "--model_name_or_path", **kwargs)


def load_pretrained(model_class, path: str, flag: str, **kwargs):
    """`model_class.from_pretrained(path, **kwargs)`, a file that cannot be read (a damaged download, a file system
    error) as one line naming the checkpoint."""
    try:
        return model_class.from_pretrained(path, **kwargs)
    except (OSError, SafetensorError) as err:
        raise UsageError(f"{flag} {path!r}: cannot load its weights ({_one_line(err)}).") from err


def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:300]


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


# ----------------------------------------------------------------------------------------------------------- data


def load_raw_datasets(
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    streaming: bool = False,
    cache_dir: str | None = None,
):
    """Load the raw text as a `DatasetDict` (or `IterableDatasetDict` when streaming), and say how it is organised.

    Returns `(raw, info)` with `info = {"name": ..., "documents": bool}`. Sources, in order: a 🤗 dataset, local
    files (txt: one row per line, line breaks kept; json/jsonl/csv: one row per record), or the embedded Shakespeare
    corpus with its fixed document-level validation split. `documents` says whether rows are whole documents
    (separated by an end-of-text token when packed) or consecutive lines of one running text.
    """
    if dataset_name and (train_file or validation_file):
        raise UsageError("Give either --dataset_name or --train_file/--validation_file, not both.")
    if validation_file and not train_file:
        raise UsageError("--validation_file needs --train_file (the training text).")
    if dataset_name:
        return _load_hub_dataset(dataset_name, dataset_config_name, streaming, cache_dir)
    if train_file:
        return _load_files(train_file, validation_file, streaming, cache_dir)
    return _load_embedded_corpus(streaming)


def _load_hub_dataset(name, config_name, streaming, cache_dir):
    from datasets import load_dataset

    try:
        raw = load_dataset(name, config_name, streaming=streaming, cache_dir=cache_dir)
    except Exception as err:  # datasets raises many kinds (FileNotFoundError, ConnectionError, ValueError, ...)
        raise UsageError(f"--dataset_name {name!r}: could not load it ({type(err).__name__}: {err}).")
    if not isinstance(raw, dict):
        raw = {"train": raw}
    if "train" not in raw:
        raise UsageError(f"--dataset_name {name!r} has no 'train' split (splits: {sorted(raw)}).")
    return raw, {"name": name + (f" ({config_name})" if config_name else ""), "documents": True}


def _load_files(train_file, validation_file, streaming, cache_dir):
    from datasets import load_dataset

    files = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
    extensions = set()
    for split, path in files.items():
        flag = f"--{split}_file"
        if not os.path.isfile(path):
            raise UsageError(f"{flag} {path!r} does not exist.")
        if os.path.getsize(path) == 0:
            raise UsageError(f"{flag} {path!r} is empty.")
        ext = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
        if ext not in DATA_EXTENSIONS:
            raise UsageError(f"{path!r}: unsupported file type {ext!r}; use one of {sorted(DATA_EXTENSIONS)}.")
        extensions.add(DATA_EXTENSIONS[ext])
    if len(extensions) > 1:
        raise UsageError(f"--train_file and --validation_file must have the same format, got {sorted(extensions)}.")
    builder = extensions.pop()
    kwargs = {"keep_linebreaks": True} if builder == "text" else {}
    try:
        raw = load_dataset(builder, data_files=files, streaming=streaming, cache_dir=cache_dir, **kwargs)
    except Exception as err:  # e.g. malformed json: datasets wraps the cause in DatasetGenerationError
        cause = err.__cause__ or err
        raise UsageError(f"Could not read {sorted(files.values())} as {builder}: {type(cause).__name__}: {cause}")
    return raw, {"name": ", ".join(os.path.basename(p) for p in files.values()), "documents": builder != "text"}


def _load_embedded_corpus(streaming):
    from datasets import Dataset, DatasetDict, IterableDatasetDict

    from .data import CORPUS_NAME, VALIDATION_WORKS, shakespeare_splits

    raw = DatasetDict({split: Dataset.from_dict({"text": texts}) for split, texts in shakespeare_splits().items()})
    if streaming:
        raw = IterableDatasetDict({split: dataset.to_iterable_dataset() for split, dataset in raw.items()})
    return raw, {"name": f"{CORPUS_NAME} (embedded; validation = whole works: {', '.join(VALIDATION_WORKS)})",
                 "documents": True}


def ensure_validation_split(raw, percentage: float, seed: int, documents: bool, streaming_examples: int = 1000):
    """Carve a validation split out of train when there is none (a `percentage` of rows; when streaming, the
    first `streaming_examples` rows). Rows that are lines of one running text keep their order, so the validation
    text is the held-out tail rather than lines sprinkled through the training text."""
    from datasets import DatasetDict, IterableDatasetDict

    if "validation" in raw:
        return raw
    train = raw["train"]
    if isinstance(raw, IterableDatasetDict) or not hasattr(train, "train_test_split"):
        return IterableDatasetDict({"train": train.skip(streaming_examples),
                                    "validation": train.take(streaming_examples)})
    if len(train) < 2:
        raise UsageError(
            f"The training data has {len(train)} row(s); carving a validation split needs at least 2. Add rows or "
            "give --validation_file."
        )
    split = train.train_test_split(test_size=max(percentage / 100.0, 1 / len(train)), shuffle=documents, seed=seed)
    return DatasetDict({"train": split["train"], "validation": split["test"]})


def text_batches(dataset, text_column: str, batch_size: int = 1000, max_rows: int | None = None) -> Iterator[list]:
    """Lists of strings from a (possibly streaming) dataset, for tokenizer training."""
    batch, rows = [], 0
    for row in dataset:
        text = row[text_column]
        if text is not None and not isinstance(text, str):
            raise _not_text(text_column, text)
        if text:
            batch.append(text)
        rows += 1
        if len(batch) == batch_size:
            yield batch
            batch = []
        if max_rows is not None and rows >= max_rows:
            break
    if batch:
        yield batch


def train_bpe_tokenizer(batches: Iterable[list], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) trained on the text: `<|endoftext|>` is bos/eos, `<|pad|>` pads on the left,
    and a chat template (`CHAT_TEMPLATE`, ChatML) with its two special tokens, for chat fine-tuning (SFT)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = [EOS_TOKEN, PAD_TOKEN, CHAT_START, CHAT_END]
    if vocab_size < len(alphabet) + len(specials):
        raise UsageError(f"--vocab_size must be at least {len(alphabet) + len(specials)} (256 bytes + "
                         f"{len(specials)} special tokens), got {vocab_size}.")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=specials, initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(batches, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        extra_special_tokens=[CHAT_START, CHAT_END], chat_template=CHAT_TEMPLATE, padding_side="left",
    )


def prepare_tokenizer_for_generation(tokenizer):
    """Left padding (decoder-only batched generation) and a pad token (the eos token when the tokenizer has none)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UsageError("The tokenizer has neither a pad nor an eos token; add one (e.g. '<|endoftext|>').")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _column_names(dataset) -> list[str]:
    if dataset.column_names is not None:
        return dataset.column_names
    for row in dataset:  # unknown for some streamed datasets (e.g. after skip/take): read one row
        return list(row.keys())
    raise UsageError("A streamed split is empty; check the dataset and --streaming_validation_examples.")


def check_text_column(raw, text_column: str) -> None:
    """Every split has the column `--text_column` names (a CSV or JSON file may call it otherwise), and it holds text
    (a CSV column of numbers is read as numbers, which are not text to tokenise). A streamed dataset's types are
    checked as its rows are tokenised."""
    from datasets import Dataset

    for split, dataset in raw.items():
        columns = _column_names(dataset)
        if text_column not in columns:
            raise UsageError(f"--text_column {text_column!r} is not a column of the {split} data (columns: "
                             f"{columns}); name the text column with --text_column.")
        feature = (getattr(dataset, "features", None) or {}).get(text_column)
        dtype = getattr(feature, "dtype", None)
        if feature is not None and dtype not in ("string", "large_string"):
            first = f" (row 1: {dataset[0][text_column]!r})" if isinstance(dataset, Dataset) and len(dataset) else ""
            raise UsageError(f"--text_column {text_column!r} of the {split} data holds {dtype or feature}, not "
                             f"text{first}; name the text column with --text_column.")


def _not_text(text_column: str, value) -> UsageError:
    return UsageError(f"--text_column {text_column!r} holds a {type(value).__name__} ({value!r}), not text; name the "
                      "text column with --text_column.")


def skip_rows_without_text(raw, text_column: str):
    """The rows of `raw` whose `text_column` is null (an empty CSV cell, `"text": null` in JSON lines) left out:
    they hold no text, and tokenising them fails. How many, and the first (its row number in the file, before any
    split), is a warning. A streamed dataset is filtered as it is read, without one."""
    import pyarrow.compute as pc
    from datasets import Dataset

    kept = {}
    for split, dataset in raw.items():
        if not isinstance(dataset, Dataset):  # streamed
            kept[split] = dataset.filter(lambda row: row[text_column] is not None)
            continue
        column = dataset.data.column(text_column)  # (as loaded: no indices mapping yet)
        if column.null_count:
            first = pc.index(pc.is_null(column), True).as_py()
            logger.warning("%d of the %d rows of the %s data have no text (null in column %r; the first is row %d): "
                           "they are skipped.", column.null_count, len(dataset), split, text_column, first + 1)
            dataset = dataset.filter(lambda texts: [text is not None for text in texts], input_columns=text_column,
                                     batched=True)
        kept[split] = dataset
    return type(raw)(kept)


def tokenize_and_pack(
    raw,
    tokenizer,
    text_column: str,
    block_size: int,
    add_eos: bool,
    num_proc: int | None = None,
    overwrite_cache: bool = False,
):
    """Tokenise every split and pack the token stream into `block_size` blocks (the remainder is dropped).

    `add_eos` appends the end-of-text token after every row (rows are documents). Uses `datasets.map`, so
    file-backed datasets are cached and `num_proc` parallelises; streaming datasets are mapped lazily.
    Returns the packed splits with `input_ids` and `labels` (= input_ids; the model shifts them).
    """
    from datasets import IterableDatasetDict

    streaming = isinstance(raw, IterableDatasetDict)
    check_text_column(raw, text_column)
    eos = [tokenizer.eos_token_id] if add_eos and tokenizer.eos_token_id is not None else []

    def tokenize(batch):
        texts = batch[text_column]
        for text in texts:
            if not isinstance(text, str):  # (a streamed dataset's types are unknown until read)
                raise _not_text(text_column, text)
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return {"input_ids": [row + eos for row in ids]}

    def pack(batch):
        stream = [token for row in batch["input_ids"] for token in row]
        usable = len(stream) // block_size * block_size
        blocks = [stream[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    packed = {}
    for split, dataset in raw.items():
        remove = _column_names(dataset)
        map_kwargs = {} if streaming else {
            "num_proc": num_proc, "load_from_cache_file": not overwrite_cache, "desc": f"Tokenising {split}"
        }
        tokenized = dataset.map(tokenize, batched=True, remove_columns=remove, **map_kwargs)
        if not streaming:
            map_kwargs["desc"] = f"Packing {split} into blocks of {block_size}"
        # Large map batches pack more rows into one stream, losing less text to the per-batch remainder.
        packed[split] = tokenized.map(pack, batched=True, batch_size=1000, **map_kwargs)
    if not streaming:
        for split, dataset in packed.items():
            if len(dataset) == 0:
                raise UsageError(
                    f"The {split} split has fewer than --block_size ({block_size}) tokens, so packing left nothing "
                    f"to {'train on' if split == 'train' else 'evaluate on'}. Give more text or a smaller "
                    "--block_size."
                )
    return type(raw)(packed)


def unigram_loss(train, validation, vocab_size: int, max_blocks: int = 20_000) -> float:
    """Cross-entropy (nats/token) of the validation blocks under the training unigram distribution (add-one
    smoothing): the loss of a model that ignores context, the bar a language model must clearly beat."""
    def counts(dataset):
        ids = np.asarray(dataset.select(range(min(len(dataset), max_blocks)))["input_ids"]).ravel()
        return np.bincount(ids, minlength=vocab_size)

    train_counts, val_counts = counts(train), counts(validation)
    log_p = np.log((train_counts + 1) / (train_counts.sum() + vocab_size))
    return float(-(val_counts * log_p).sum() / val_counts.sum())


# ---------------------------------------------------------------------------------------------------- results


def loss_history(log_history: list[dict]) -> tuple[list, list]:
    """[(step, train loss)], [(step, eval loss)] from `trainer.state.log_history`."""
    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e]
    evals = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e]
    return train, evals


def plot_loss_curve(log_history: list[dict], path: str, title: str = "", unigram: float | None = None) -> str | None:
    """Train and validation loss against steps (and the unigram reference), as a PNG; None when nothing was logged."""
    train, evals = loss_history(log_history)
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="validation loss")
    if unigram is not None:
        ax.axhline(unigram, color="gray", ls="--", lw=1, label="unigram (context-free) reference")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def describe_variant(config: DDLConfig) -> str:
    """A short name for the residual variant, in the paper's terms."""
    if config.ddl_residual == "additive" and config.ddl_value_channels == 1:
        return "baseline (additive residual: a Llama" + (" with QK-norm)" if config.qk_norm else ")")
    mode = {"delta": "DDL", "write_only": "write-only control", "additive": "additive control"}[config.ddl_residual]
    if config.ddl_value_channels == 1:
        return f"{mode} d_v=1"
    ec = "" if config.ddl_embed_conv else " w/o EC"
    return f"{mode}-{config.ddl_compressor.upper()}{ec} (d_v={config.ddl_value_channels})"


def _training_time(metrics, tokens_seen, steps, world_size):
    """The card's training-time line. `train_runtime` is this run's; a resumed run trained only the steps after its
    checkpoint (`resumed_at_step`), so its speed counts only their share of the tokens seen."""
    runtime, start = metrics["train_runtime"], metrics.get("resumed_at_step", 0)
    where = f"on {world_size} process(es), {metrics.get('device', 'unknown device')}"
    if start >= steps:  # resumed at (or past) the last step: this run trained nothing
        return f"- Training time: {runtime:.0f} s {where} (resumed at step {start:,}: no step left to train)."
    run_tokens = tokens_seen * (steps - start) / steps
    resumed = f"; resumed at step {start:,}, so for its last {steps - start:,} steps" if start else ""
    return f"- Training time: {runtime:.0f} s ({run_tokens / runtime:,.0f} tokens/s {where}{resumed})."


MODEL_CARD = """---
{metadata}
---

# {repo_name}

{intro}

## Model

| | |
|---|---|
| variant | {variant} (`ddl_residual={c.ddl_residual}`, `ddl_value_channels={c.ddl_value_channels}`, `ddl_compressor={c.ddl_compressor}`, `ddl_embed_conv={c.ddl_embed_conv}`) |
| parameters | {num_parameters:,} |
| layers x hidden | {c.num_hidden_layers} x {c.hidden_size} (MLP {c.intermediate_size}) |
| heads | {c.num_attention_heads} x {c.head_dim} (kv heads {c.num_key_value_heads}) |
| vocabulary | {c.vocab_size} ({tokenizer_source}) |
| context | trained on blocks of {block_size} tokens (max_position_embeddings {c.max_position_embeddings}) |
| QK-norm / tied embeddings | {c.qk_norm} ({c.qk_norm_position}) / {c.tie_word_embeddings} |
| layout and initialisation | `ddl_shared_compressor={c.ddl_shared_compressor}`, `ddl_cc_form={c.ddl_cc_form}`, `ddl_initialization={c.ddl_initialization}` (the defaults are the authors' code at d1f76215) |

## Data and training

- Data: {data_name}{train_tokens}.
- Tokens seen: {tokens_seen:,} in {steps:,} optimizer steps ({a.per_device_train_batch_size} x {a.gradient_accumulation_steps} x {a.world_size} blocks of {block_size} tokens per step).
{training_time}{finetuning}- Optimizer: AdamW (beta1 {a.adam_beta1}, beta2 {a.adam_beta2}), weight decay {a.weight_decay}, peak lr {a.learning_rate:g}, {scheduler} schedule, warm-up {warmup}, gradient clipping {a.max_grad_norm}, seed {a.seed}.

## Results

| | loss (nats/token) | perplexity |
|---|---|---|
| final train loss (last logged) | {train_loss} | {train_ppl} |
| validation | {val_loss} | {val_ppl} |
{unigram_row}{loss_curve}{sample}
## Use

The modeling code is stored next to the weights, so no package is needed; pass `trust_remote_code=True`:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

path = "{repo_name}"  # this folder, or its Hub id
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
print(generator({prompt!r}, max_new_tokens=100)[0]["generated_text"])
```

The remote code is PyTorch only (the model, its operations' specifications and their PyTorch paths): loading,
training and generating start no process and write nothing but transformers' own module cache. Faster kernels (C++
for CPU, Triton for CUDA) are the optional `ddl_kernels` package of the ddl repository; when it is installed the same
code uses them (`DDL_IMPLEMENTATION=torch`, or `ddl_implementation="torch"` in `from_pretrained`, keeps PyTorch).

Fine-tune it further with `python train.py --model_name_or_path <this folder> ...`, or as a classifier with
`python train_classifier.py --model_name_or_path <this folder>` (its `auto_map` also lists
`AutoModelForSequenceClassification`, `AutoModelForTokenClassification` and `AutoModelForQuestionAnswering`, which
load this model with a fresh head).
"""


def model_card(*, repo_name: str, config: DDLConfig, num_parameters: int, data_name: str, block_size: int,
               tokenizer_source: str, train_tokens: int | None, steps: int, metrics: dict, training_args,
               loss_curve: str | None, unigram: float | None = None, sample: str | None = None,
               prompt: str = "Romeo.\n", init_from: str | None = None, status: str | None = None,
               finetuning: str | None = None, metadata: dict | None = None) -> str:
    """The checkpoint's README.md (`MODEL_CARD` filled in): variant, sizes, data, training, results, how to load it.
    `init_from` says what the run started from (None: from scratch); `status` is a line under the introduction
    (e.g. that training is in progress); `finetuning` how the weights were adapted (e.g. LoRA), if not in full;
    `metadata` the card's metadata beyond the library, task and tags (`card_metadata`)."""
    from huggingface_hub import ModelCardData

    variant = describe_variant(config)
    header = ModelCardData(library_name="transformers", pipeline_tag="text-generation",
                           tags=["ddl", "deep-delta-learning", "custom_code"], **(metadata or {})).to_yaml()

    def loss_and_ppl(x):
        return ("n/a", "n/a") if x is None else (f"{x:.4f}", f"{math.exp(min(x, 50)):.2f}")

    train_loss, train_ppl = loss_and_ppl(metrics.get("final_train_loss"))
    val_loss, val_ppl = loss_and_ppl(metrics.get("eval_loss"))
    scheduler = getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type)
    timed = metrics.get("train_runtime") and steps
    intro = (f"A Deep Delta Learning language model (Zhang et al., 2026, arXiv 2601.00417): **{variant}**, trained "
             "from scratch with `train.py` of the `ddl` project." if not init_from else
             f"A Deep Delta Learning language model (**{variant}**), trained with `train.py` from {init_from}.")
    if status:
        intro += f"\n\n{status}"
    return MODEL_CARD.format(
        metadata=header, repo_name=repo_name, intro=intro, variant=variant, c=config, a=training_args,
        num_parameters=num_parameters,
        tokenizer_source=tokenizer_source, block_size=block_size, data_name=data_name,
        train_tokens=f"; {train_tokens:,} training tokens" if train_tokens else "",
        tokens_seen=metrics["tokens_seen"], steps=steps, scheduler=scheduler, warmup=_warmup(training_args.warmup_steps),
        training_time=_training_time(metrics, metrics["tokens_seen"], steps, training_args.world_size) + "\n"
        if timed else "",
        train_loss=train_loss, train_ppl=train_ppl, val_loss=val_loss, val_ppl=val_ppl,
        unigram_row=f"| unigram reference (context-free, validation) | {unigram:.4f} | {math.exp(unigram):.2f} |\n"
        if unigram is not None else "",
        loss_curve=f"\n![loss curve]({os.path.basename(loss_curve)})\n" if loss_curve else "",
        sample=f"\nA sample (sampling with the saved generation config):\n\n```text\n{sample.strip()}\n```\n"
        if sample is not None else "",
        prompt=prompt,
        finetuning=f"- Fine-tuning: {finetuning}.\n" if finetuning else "",
    )


def card_metadata(*, license_id: str | None, dataset_name: str | None, base: str | None) -> dict:
    """The card's metadata of a run: the license the user gave, the Hub dataset it trained on, and the model it
    started from (`base`) as a Hub id; a local folder names the base its own card names, a local file nothing."""
    from huggingface_hub import ModelCard

    metadata = {"license": license_id} if license_id else {}
    if dataset_name and not os.path.exists(dataset_name):
        metadata["datasets"] = [dataset_name]
    if base and os.path.isdir(base):
        card = os.path.join(base, "README.md")
        base = None
        with contextlib.suppress(ValueError):  # (a card whose metadata does not parse names no base)
            base = ModelCard.load(card).data.base_model if os.path.isfile(card) else None
    if base:
        metadata.update(base_model=base, base_model_relation="finetune")
    return metadata


def _warmup(warmup_steps: float) -> str:
    return f"{warmup_steps:.0%} of the steps" if 0 < warmup_steps < 1 else f"{int(warmup_steps)} steps"


# ------------------------------------------------------------------------------------ the run's output folder

# train.py's mark on an output folder from the start of a run until its final save: a folder holding it (and no
# complete checkpoint) holds only what an unfinished run left, and a new run may start over in it.
UNFINISHED_RUN = ".ddl_unfinished_run.json"
_TRAINER_STATE = "trainer_state.json"
_held_claims: list[tuple[str, FolderLock, bool]] = []  # (folder, lock, created by this run) of this process


def checkpoint_step(path: str) -> int | None:
    match = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def checkpoint_damage(path: str) -> str | None:
    """Why the checkpoint folder `path` cannot be resumed from, in words that follow "checkpoint-N is" (None: it
    can). Trainer writes `trainer_state.json` last: without it the save was interrupted. With it, every file must
    look whole (`file_damage`): a full disk or a power loss during a save leaves a 0-byte or truncated state,
    weights or optimizer file, and resuming from it would be a traceback."""
    state = os.path.join(path, _TRAINER_STATE)
    if not os.path.isfile(state):
        return f"incomplete (no {_TRAINER_STATE}: its save was interrupted)"
    names = [_TRAINER_STATE] + sorted(name for name in os.listdir(path) if name != _TRAINER_STATE)
    for name in names:
        if os.path.isfile(os.path.join(path, name)):
            problem = file_damage(os.path.join(path, name))
            if problem is not None:
                return f"damaged (its {name} {problem}: a save cut short by a full disk or a crash)"
    with open(state, encoding="utf-8") as f:
        if not isinstance(json.load(f), dict):
            return f"damaged (its {_TRAINER_STATE} is not a Trainer state)"
    return None


def is_complete_checkpoint(path: str) -> bool:
    """Whether a checkpoint folder can be resumed from (`checkpoint_damage`)."""
    return checkpoint_damage(path) is None


def checkpoints(folder: str) -> list[str]:
    """The `checkpoint-<step>` folders in `folder`, oldest step first."""
    found = [os.path.join(folder, name) for name in folder_contents(folder)
             if checkpoint_step(name) is not None and os.path.isdir(os.path.join(folder, name))]
    return sorted(found, key=checkpoint_step)


def last_complete_checkpoint(folder: str) -> str | None:
    complete = [path for path in checkpoints(folder) if is_complete_checkpoint(path)]
    return complete[-1] if complete else None


def _is_inside(path: str, folder: str) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(folder) + os.sep)


def _checkpoint_to_resume(out: str, resume: str | None) -> str | None:
    """`--resume_from_checkpoint` resolved: true/latest/last = the newest complete checkpoint in `out` (a newer one
    that is incomplete or damaged, a save interrupted by a kill or cut short by a full disk, is skipped and named),
    false/none = None, else a complete checkpoint."""
    if resume is None or resume.lower() in ("false", "none", ""):
        return None
    if resume.lower() in ("true", "latest", "last"):
        latest = last_complete_checkpoint(out)
        skipped = [f"{os.path.basename(p)} is {checkpoint_damage(p)}" for p in checkpoints(out)
                   if latest is None or checkpoint_step(p) > checkpoint_step(latest)]
        if latest is None:
            found = f" ({'; '.join(skipped)})" if skipped else ""
            raise UsageError(f"--resume_from_checkpoint {resume}: no complete checkpoint-* folder in {out!r} to "
                             f"resume from{found}.")
        if skipped:
            logger.warning("Resuming from %s, the newest complete checkpoint: %s.", os.path.basename(latest),
                           "; ".join(skipped))
        return latest
    problem = checkpoint_damage(resume) if os.path.isdir(resume) else None
    if problem is not None or not os.path.isdir(resume):
        parent = os.path.dirname(os.path.normpath(resume))
        latest = last_complete_checkpoint(parent) if os.path.isdir(parent) else None
        hint = f" The newest complete checkpoint there is {latest!r}: pass that." if latest else ""
        if not (checkpoint_step(resume) and os.path.isdir(resume)) and not os.path.isfile(
                os.path.join(resume, _TRAINER_STATE)):
            problem = f"not a Trainer checkpoint folder (no {_TRAINER_STATE})"
        raise UsageError(f"--resume_from_checkpoint {resume!r} is {problem}.{hint}")
    return resume


def claim_output_dir(out: str, resume: str | None, overwrite: bool, do_train: bool, main_process: bool = True):
    """Make `out` this run's (the rule of `ddl_tools.outputs`) and say which checkpoint to resume from (None: start
    fresh). The main process creates the folder (a file there, or no permission, is a `UsageError` now, not at the
    first save after training), takes its lock (one run at a time) and marks it as an unfinished run.

    A non-empty folder is refused unless it is resumed from (`--resume_from_checkpoint` names a checkpoint in it),
    holds only what an unfinished run left (the mark, no complete checkpoint: e.g. the tokenizer of a run that
    failed), or `overwrite` is given; in that case its old checkpoints are deleted (a later `--resume_from_checkpoint
    true` must not pick them up)."""
    if main_process:
        lock, created = claim_folder(out, "--output_dir", own_files=[UNFINISHED_RUN])
        _held_claims.append((out, lock, created))
    checkpoint = _checkpoint_to_resume(out, resume)
    if checkpoint is not None and not do_train:
        raise UsageError("--resume_from_checkpoint continues training; it cannot be combined with --do_train false.")
    contents = folder_contents(out)
    resumes_here = checkpoint is not None and _is_inside(checkpoint, out)
    if contents and not overwrite and not resumes_here:
        latest = last_complete_checkpoint(out)
        if UNFINISHED_RUN in contents and latest is None:
            if main_process:
                logger.warning("%s holds only what an unfinished train.py run left (no complete checkpoint); this "
                               "run starts over in it.", out)
        elif checkpoint is not None:
            raise UsageError(f"Output folder {out!r} is not empty; resuming {checkpoint!r} into it would overwrite "
                             "what it holds (weights, config, tokenizer, model card). Choose an empty --output_dir, or "
                             "pass --overwrite_output_dir to replace its contents.")
        else:
            hint = (f" To continue its latest run ({os.path.basename(latest)}) pass --resume_from_checkpoint true."
                    if latest else "")
            raise UsageError(f"Output folder {out!r} exists and is not empty; refusing to overwrite it.{hint} To start "
                             "over in it pass --overwrite_output_dir, or choose another --output_dir.")
    if main_process:
        if overwrite and not resumes_here:
            for path in checkpoints(out):
                shutil.rmtree(path)
        if UNFINISHED_RUN not in contents or overwrite:
            write_json(os.path.join(out, UNFINISHED_RUN), {"command": sys.argv, "started": time.ctime()})
    return checkpoint


def finish_output_dir(out: str) -> None:
    """The run saved everything: remove its unfinished-run mark and let go of the folder."""
    try:
        os.remove(os.path.join(out, UNFINISHED_RUN))
    except FileNotFoundError:
        pass
    release_output_dirs()


def interruption_note(folder: str | None = None) -> str:
    """What a user can do after this process's run into `folder` (default: the folder it holds) was interrupted
    (Ctrl-C, a save that failed)."""
    folder = folder or (_held_claims[-1][0] if _held_claims else None)
    latest = last_complete_checkpoint(folder) if folder and os.path.isdir(folder) else None
    if latest:
        return (f"its checkpoints are kept (latest: {latest}): continue with the same command plus "
                "--resume_from_checkpoint true.")
    return "no checkpoint was saved yet; the same command starts over in its output folder."


def claim_results_dir(out: str, overwrite: bool, main_process: bool = True) -> None:
    """Make `out` the folder of a run that writes its results once, at the end, and is not resumed
    (train_classifier.py), by the rule of `ddl_tools.outputs`: the main process creates it and takes its lock (and
    clears the unfinished writes a killed run left); a folder holding anything else is refused unless `overwrite`.
    Let go of by `release_output_dirs` (a folder this run created is removed if the run fails before writing)."""
    if main_process:
        lock, created = claim_folder(out, "--output_dir")
        _held_claims.append((out, lock, created))
    if folder_contents(out) and not overwrite:
        raise UsageError(f"Output folder {out!r} exists and is not empty; refusing to overwrite it. Pass "
                         "--overwrite_output_dir or choose another --output_dir.")


SAVE_ERRORS = (OSError, RuntimeError, SafetensorError)  # torch.save reports a full disk as a RuntimeError


@contextlib.contextmanager
def saving_into(folder: str, what: str, then: str | None = None):
    """Saving `what` into `folder`: a failure (a full disk, a lost permission, a file system gone) becomes one line
    that names the folder and what to do (`then`; default: how to continue the run, `interruption_note`) instead of
    a traceback. The run's unfinished-run mark stays, so the folder is resumed or rerun, never taken for finished."""
    try:
        yield
    except SAVE_ERRORS as err:
        raise UsageError(f"saving {what} into {folder!r} failed ({_one_line(err)}). Free space there (or make it "
                         f"writable); {then or interruption_note(folder)}") from err


def release_output_dirs(failed: bool = False) -> None:
    """Let go of this process's output folders (the operating system does it at exit anyway). `failed`: a folder
    this run created and left holding nothing but its mark is removed (a mistyped flag leaves no trace)."""
    while _held_claims:
        out, lock, created = _held_claims.pop()
        leftover = failed and created and set(folder_contents(out)) <= {UNFINISHED_RUN}  # (refused before the mark)
        if leftover and os.path.exists(os.path.join(out, UNFINISHED_RUN)):
            os.remove(os.path.join(out, UNFINISHED_RUN))
        release_folder(out, lock, leftover)


# ------------------------------------------------------------------------------------------------- resuming


class DDLRunRecord(TrainerCallback, ExportableState):
    """What a resumed run must keep and `TrainerState` does not record: the block size the data was packed into, the
    data (`data_record`: its source and the content of its local files), the tokenizer (`tokenizer_digest`) and the
    training arguments of the optimisation and the data order (`training_record`). Saved in every checkpoint's
    `trainer_state.json` (transformers' stateful callbacks), as JSON: the checkpoint's `training_args.bin` is a
    pickle, which only unpickling (running what it says) would read. A resume that would train on other data or
    tokens, or with arguments Trainer would not honour, is refused (`check_resumed_data`,
    `resumed_training_arguments`)."""

    def __init__(self, block_size: int | None = None, data: dict | None = None, tokenizer: str | None = None,
                 training: dict | None = None):
        self.block_size, self.data, self.tokenizer, self.training = block_size, data, tokenizer, training

    def state(self) -> dict:
        return {"args": {"block_size": self.block_size, "data": self.data, "tokenizer": self.tokenizer,
                         "training": self.training},
                "attributes": {}}

    def on_train_begin(self, args, state, control, **kwargs):
        # a checkpoint written before this record existed has no entry, and Trainer's save expects one
        state.stateful_callbacks.setdefault(type(self).__name__, self.state())


def resumed_state(checkpoint: str | None) -> TrainerState | None:
    return None if checkpoint is None else TrainerState.load_from_json(os.path.join(checkpoint, _TRAINER_STATE))


def _recorded(state: TrainerState) -> dict:
    record = state.stateful_callbacks.get(DDLRunRecord.__name__) or {}
    if isinstance(record, list):
        record = record[0] if record else {}
    return record.get("args", {})


def recorded_block_size(state: TrainerState) -> int | None:
    return _recorded(state).get("block_size")


def file_digest(path: str) -> str:
    """The SHA-256 of a file's content."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def data_record(name: str, files: dict[str, str], text_column: str) -> dict:
    """What a run trains on, as its checkpoints record it: the source's name (`load_raw_datasets`'), each local file
    by its name and the SHA-256 of its content (`files`: split -> path; a file of the same name may hold other text by
    the time the run resumes), and the column read."""
    return {"name": name, "text_column": text_column,
            "files": {split: {"file": os.path.basename(path), "sha256": file_digest(path)}
                      for split, path in files.items()}}


def tokenizer_digest(tokenizer) -> str:
    """A SHA-256 of what a tokenizer maps text to: its model (vocabulary and merges) and its added tokens, so two
    tokenizers of one size with other merges differ, and the same tokenizer saved and loaded again does not."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        what = {"model": spec.get("model"),
                "added_tokens": [[t["id"], t["content"]] for t in spec.get("added_tokens") or []]}
    else:  # a tokenizer without the tokenizers library's backend: its vocabulary
        what = {"vocab": sorted(tokenizer.get_vocab().items())}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode("utf-8")).hexdigest()


def _data_differences(then: dict, now: dict) -> list[str]:
    if then.get("files") and now.get("files"):  # local files: by content (a file moved or renamed is the same)
        differ = []
        for split in sorted(set(then["files"]) | set(now["files"])):
            old, new = then["files"].get(split), now["files"].get(split)
            if old is None or new is None:
                differ.append(f"--{split}_file: the run read {old['file'] if old else 'none'!r}, this one "
                              f"{new['file'] if new else 'none'!r}")
            elif old["sha256"] != new["sha256"]:
                differ.append(f"{new['file']!r} has changed since the run read it" if old["file"] == new["file"] else
                              f"--{split}_file {new['file']!r} is not the file the run read ({old['file']!r})")
    elif then.get("name") != now.get("name"):
        differ = [f"the data is {now.get('name')!r}, the run's was {then.get('name')!r}"]
    else:
        differ = []
    if then.get("text_column") != now.get("text_column"):
        differ.append(f"--text_column {now.get('text_column')!r} (the run read {then.get('text_column')!r})")
    return differ


def check_resumed_data(checkpoint: str, state: TrainerState, data: dict, tokenizer: str,
                       tokenizer_source: str) -> None:
    """A resumed run continues on its checkpoint's data and tokens: other data (another --train_file or dataset, a
    file whose content changed, another --text_column) or another tokenizer (another vocabulary or merges, even of
    the same size) is refused; training would continue silently on text the first part never saw, and the folder
    would ship a tokenizer the first part never used. A checkpoint saved before the record existed resumes with a
    warning (nothing to compare with)."""
    recorded = _recorded(state)
    if recorded.get("data") is None or recorded.get("tokenizer") is None:
        logger.warning("%s does not record its data and tokenizer (saved before train.py recorded them): resuming "
                       "without checking that they are this run's.", checkpoint)
        return
    differ = _data_differences(recorded["data"], data)
    if recorded["tokenizer"] != tokenizer:
        differ.append(f"the tokenizer ({tokenizer_source}) is not the one it was trained with (another vocabulary or "
                      "merges)")
    if differ:
        raise UsageError(f"--resume_from_checkpoint {checkpoint!r} continues a run on its own data and tokenizer, but "
                         f"{'; '.join(differ)}. Resume with that run's data and tokenizer (drop --tokenizer_name to "
                         "use the checkpoint's), or start a new run in another --output_dir.")


def check_resumed_model(checkpoint: str, preset: str | None, overrides: dict, flags: dict) -> None:
    """Resuming continues the checkpoint's model: a --preset, --config_overrides field or --ddl_* flag that asks for
    another architecture is refused (one that repeats the checkpoint's value is fine)."""
    try:
        config = DDLConfig.from_pretrained(checkpoint)
    except StrictDataclassError as err:
        raise UsageError(f"{checkpoint!r}: {config_error_message(err)}") from err
    asked = {}  # field -> (where it was asked for, value); later sources win, as when building a fresh model
    for key, value in (PRESETS[preset] if preset else {}).items():
        asked[key] = (f"--preset {preset} ({key})", value)
    for key, value in overrides.items():
        asked[key] = (f"--config_overrides {key}", value)
    for key, value in flags.items():
        asked[key] = (f"--{key}", value)
    differ = [f"{where} = {value!r} (it has {getattr(config, key, None)!r})" for key, (where, value) in asked.items()
              if getattr(config, key, None) != value]
    if differ:
        raise UsageError(f"--resume_from_checkpoint {checkpoint!r} continues that checkpoint's model, but "
                         f"{'; '.join(differ)} asks for another. Drop these flags to resume, or start a new run in "
                         "another --output_dir.")


def resumed_block_size(checkpoint: str, state: TrainerState, block_size: int | None, given: bool) -> int | None:
    """The block size of a resumed run: the checkpoint's (a different --block_size would re-pack the data under
    the resumed data position, so it is refused). A checkpoint without the record keeps `block_size`."""
    recorded = recorded_block_size(state)
    if recorded is None:
        logger.warning("%s does not record its block size (saved before train.py recorded it): using %s.", checkpoint,
                       block_size)
        return block_size
    if given and block_size != recorded:
        raise UsageError(f"--block_size {block_size}: {checkpoint!r} was trained on blocks of {recorded} tokens, and "
                         "resuming with another size would re-pack the data under its position. Drop --block_size to "
                         "resume, or start a new run in another --output_dir.")
    if block_size != recorded:
        logger.warning("Resuming %s with its blocks of %d tokens.", checkpoint, recorded)
    return recorded


# The training arguments a run's checkpoints record (`training_record`) and its resume keeps
# (`resumed_training_arguments`), each with the reason another value given is refused. Trainer restores the optimizer
# from the checkpoint whatever the command line says, with its settings and the schedule's peak (the scheduler's base
# rates): another learning rate, weight decay or Adam setting would be silently ignored, and another --optim would meet
# a state not its own (a KeyError, or moments misread). And Trainer finds the run's data position by skipping the
# steps done, in batches of the size given now and in the order the seed given now draws: another batch, accumulation
# or seed would resume at other blocks than the run's next ones.
KEPT_ON_RESUME = {
    "learning_rate": "Trainer restores the schedule's peak from the checkpoint: the flag would be ignored",
    **dict.fromkeys(("weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon"),
                    "Trainer restores the optimizer's settings from the checkpoint: the flag would be ignored"),
    "optim": "the checkpoint holds that optimizer's state, which another optimizer cannot continue",
    **dict.fromkeys(("per_device_train_batch_size", "gradient_accumulation_steps"),
                    "Trainer counts the steps done in batches of this size, so the run would not resume at its next "
                    "block"),
    **dict.fromkeys(("seed", "data_seed"), "the seed draws the order of the blocks, so the run would not resume at "
                                            "its next block"),
}
# What Trainer builds from the command line on resume: the learning-rate schedule's shape, from the second resumed step
# on (the first takes the rate the checkpoint's scheduler computed), at the checkpoint's peak, as for a raised
# --max_steps; and the clipping of every step. Given, they are what the resumed run trains with.
FOLLOWED_ON_RESUME = ("lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "max_grad_norm")
_OPTIMIZER_STATE = {"adamw_torch_fused": "adamw_torch"}  # the same optimizer (and state), fused or not


def _json_value(value):
    return value.value if isinstance(value, enum.Enum) else value


def training_record(args) -> dict:
    """A run's values of the training arguments its resume keeps or follows (`KEPT_ON_RESUME`,
    `FOLLOWED_ON_RESUME`), as JSON values, for `DDLRunRecord`."""
    return {name: _json_value(getattr(args, name)) for name in (*KEPT_ON_RESUME, *FOLLOWED_ON_RESUME)}


def _same_argument(name: str, value, recorded) -> bool:
    if name == "optim":
        return _OPTIMIZER_STATE.get(value, value) == _OPTIMIZER_STATE.get(recorded, recorded)
    return value == recorded


def _shown(value) -> str:
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def resumed_training_arguments(checkpoint: str, state: TrainerState, args, given: set[str]) -> None:
    """A resumed run trains on with its checkpoint's training arguments (`DDLRunRecord`'s record of them). Each one the
    command line does not give is set in `args` to the checkpoint's value: the schedule then continues as it was, and
    the run's record, card and training_args.json say what Trainer does (a default would have been reported, or
    followed, instead). A given one of `KEPT_ON_RESUME` whose value is not the checkpoint's is refused in one line that
    says why; a given one of `FOLLOWED_ON_RESUME` (and --max_steps, --num_train_epochs) is what the run trains with.
    A checkpoint saved before the record existed resumes with a warning (nothing to compare with)."""
    recorded = _recorded(state).get("training")
    if recorded is None:
        logger.warning("%s does not record its training arguments (saved before train.py recorded them): resuming "
                       "without checking that the learning rate, optimizer, batch and seed given here are its own "
                       "(Trainer continues with the checkpoint's optimizer and learning rate).", checkpoint)
        return
    differ, adopted = [], []
    for name, value in recorded.items():
        if name not in KEPT_ON_RESUME and name not in FOLLOWED_ON_RESUME:
            continue  # (recorded by a later version)
        current = getattr(args, name)
        if name in given:
            if name in KEPT_ON_RESUME and not _same_argument(name, _json_value(current), value):
                differ.append(f"--{name} {_shown(_json_value(current))} is not the checkpoint's {_shown(value)} "
                              f"({KEPT_ON_RESUME[name]})")
        elif _json_value(current) != value:
            setattr(args, name, type(current)(value) if isinstance(current, enum.Enum) else value)
            adopted.append(f"--{name} {_shown(value)}")
    if differ:
        them = "this flag" if len(differ) == 1 else "these flags"
        raise UsageError(f"--resume_from_checkpoint {checkpoint!r} continues its run as it was trained, but "
                         f"{'; '.join(differ)}. Drop {them} to resume, or start a new run in another --output_dir to "
                         f"train with {'it' if len(differ) == 1 else 'them'}.")
    if adopted:
        logger.warning("Resuming %s with its run's %s (not given here).", checkpoint, ", ".join(adopted))


def steps_left(state: TrainerState, max_steps: int) -> int:
    """Optimizer steps a run resumed at `state` has left: to --max_steps, else (epochs) to the total the checkpoint's
    run planned."""
    return (max_steps if max_steps > 0 else state.max_steps) - state.global_step


def tokens_seen(state, args, block_size: int) -> int:
    """Tokens trained on so far: Trainer's count, else steps x blocks per step x block size."""
    return state.num_input_tokens_seen or (state.global_step * args.per_device_train_batch_size * block_size
                                           * args.gradient_accumulation_steps * args.world_size)


class TrainingDiverged(UsageError):
    """The loss or the gradient norm stopped being finite: the run stops at that step, saving nothing of it."""


def shareable_arguments(args) -> str:
    """The training arguments as JSON for the output folder, which is published: the output folder named by its own
    name, not by where it lay on the machine that trained it."""
    values = args.to_dict()
    values["output_dir"] = os.path.basename(os.path.abspath(args.output_dir))
    return json.dumps(values, indent=2, sort_keys=True) + "\n"


class DDLTrainer(Trainer):
    """`Trainer` that writes our model card instead of the generic one, pushes to the Hub revisions that load, and
    stops a run that diverges.

    `ddl_model_card` is the final card (set after training). `card_inputs` (`model_card`'s description of the run:
    everything but `num_parameters`, `steps`, `metrics` and the results) lets every in-progress push carry a card.
    Pushes go through `ddl_tools.hub`: each revision holds the weights, config, the model's .py files, tokenizer and
    card, and no checkpoint, log or pickle. The output folder itself gets the training arguments as JSON instead of
    Trainer's pickled `training_args.bin` (the `checkpoint-*` folders, which resume a run, keep theirs).

    Divergence: Trainer's `logging_nan_inf_filter` replaces a NaN loss by the mean of the losses logged since the
    last log (0 right after one), so a run whose weights have become NaN logs `loss 0`, saves NaN checkpoints and a
    NaN final model, and reports success. Here every optimizer step's gradient norm (the same on every process) and
    raw losses are checked before anything of that step is logged, evaluated or saved; a non-finite one raises
    `TrainingDiverged`, leaving the last good checkpoint the newest. Steps that fp16's loss scaler skips (an overflow
    it handles by itself) are not checked. A checkpoint save that fails (a full disk) is one line (`saving_into`;
    `save_failure_note` says what to do, default: how to continue the run).

    Streamed data: each checkpoint records where the stream stood (`ddl_tools.streaming`), and a resume from such a
    checkpoint starts the stream there instead of drawing and discarding everything consumed before it.
    """

    ddl_model_card: str | None = None
    card_inputs: dict | None = None
    save_failure_note: str | None = None
    _losses_finite = None  # whether this optimizer step's raw losses were all finite (a tensor: no synchronisation)
    _stream: StreamPosition | None = None  # the streamed training set as this train() call draws it
    _stream_resume: dict | None = None  # where the checkpoint this train() call resumes left its stream
    _eval_sums: list | None = None  # during an evaluation: (summed token loss, tokens) of every row evaluated

    def _streams(self) -> bool:
        """Whether the training set is streamed through this process (not worker processes): its position can be
        kept."""
        from datasets import IterableDataset

        return isinstance(self.train_dataset, IterableDataset) and self.args.dataloader_num_workers == 0

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self._stream_resume = None
        if isinstance(resume_from_checkpoint, str) and self._streams():
            with open(os.path.join(resume_from_checkpoint, _TRAINER_STATE), encoding="utf-8") as f:
                step = json.load(f)["global_step"]
            per_step = self.get_total_train_batch_size(self.args)
            self._stream_resume = saved_position(resume_from_checkpoint, step, per_step)
        skip = self.args.ignore_data_skip
        if self._stream_resume is not None:
            self.args.ignore_data_skip = True  # the stream starts where the checkpoint stopped: nothing to skip
            if self.is_world_process_zero():
                print(f"resuming the stream where {os.path.basename(resume_from_checkpoint)} left it (after "
                      f"{self._stream_resume['drawn']:,} blocks), without reading them again")
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.args.ignore_data_skip = skip

    def get_train_dataloader(self):
        if not self._streams():
            return super().get_train_dataloader()
        dataset, resume = self.train_dataset, self._stream_resume
        if resume is not None:
            dataset.load_state_dict(resume["state"])
        self._stream = StreamPosition(dataset, drawn=resume["drawn"] if resume else 0,
                                      every=self.get_total_train_batch_size(self.args))
        self.train_dataset = self._stream
        try:
            return super().get_train_dataloader()
        finally:
            self.train_dataset = dataset

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """Trainer's loop, with the loss the mean over every evaluated token. Trainer's own weighs each batch's mean
        by the full batch size (a shorter last batch counts as a full one) and, over several processes, counts in
        the rows accelerate repeats to even out the last batch: one process and two gave different losses."""
        self._eval_sums = []
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
            if self._eval_sums:
                total, tokens = torch.cat(self._eval_sums).double().sum(0).tolist()
                output.metrics[f"{metric_key_prefix}_loss"] = total / tokens
        finally:
            self._eval_sums = None
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """A loss-only step also keeps each row's summed token loss and token count, gathered over the processes
        without the rows repeated to even out the last batch (`evaluation_loop`)."""
        labels, language_model = inputs.get("labels"), self.accelerator.unwrap_model(model)
        if (self._eval_sums is None or not prediction_loss_only or labels is None or "shift_labels" in inputs
                or not language_model.can_generate()):  # (a causal LM's shifted token loss; not a task head's)
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        labels = inputs["labels"]
        with torch.no_grad(), self.compute_loss_context_manager():
            logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        loss_function = language_model.loss_function  # transformers' causal LM loss
        sums = torch.stack([loss_function(logits[i:i + 1], labels[i:i + 1], vocab_size=logits.shape[-1],
                                          num_items_in_batch=1) for i in range(len(labels))])
        tokens = (labels[:, 1:] != -100).sum(-1)
        rows = torch.stack([sums.float(), tokens.float()], -1)
        self._eval_sums.append(self.accelerator.gather_for_metrics(rows).cpu())
        return (sums.sum() / tokens.sum()).detach(), None, None

    def create_model_card(self, *args, **kwargs):
        if self.ddl_model_card is None:
            return super().create_model_card(*args, **kwargs)
        if self.is_world_process_zero():
            write_text(os.path.join(self.args.output_dir, "README.md"), self.ddl_model_card)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        # Never a push of its own (Trainer pushes a "Model save" commit here): the final push follows the card.
        super().save_model(output_dir, _internal_call=True)
        folder = output_dir or self.args.output_dir
        if self.args.should_save and os.path.abspath(folder) == os.path.abspath(self.args.output_dir):
            pickled = os.path.join(folder, TRAINING_ARGS_NAME)
            if os.path.exists(pickled):
                os.remove(pickled)
            write_text(os.path.join(folder, "training_args.json"), shareable_arguments(self.args))

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        finite = torch.isfinite(loss).all()
        self._losses_finite = finite if self._losses_finite is None else self._losses_finite & finite
        return loss

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        self._stop_if_diverged(grad_norm)
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def _stop_if_diverged(self, grad_norm) -> None:
        losses_finite, self._losses_finite = self._losses_finite, None
        if self.accelerator.optimizer_step_was_skipped:
            return
        norm = grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm
        if norm is not None and not math.isfinite(norm):
            what = f"gradient norm is {norm}"
        elif losses_finite is not None and not bool(losses_finite):
            what = "loss is not finite"
        else:
            return
        latest = last_complete_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
        kept = (f"the last checkpoint before it, {os.path.basename(latest)}, is kept" if latest
                else "no checkpoint was saved before it")
        resume = (f" (--resume_from_checkpoint true would continue from {os.path.basename(latest)} with its own "
                  "learning-rate schedule)" if latest else "")
        # the schedule's peak: a resumed run's is its checkpoint's, whatever --learning_rate says
        peak = self.optimizer.param_groups[0].get("initial_lr", self.args.learning_rate)
        raise TrainingDiverged(
            f"training diverged at step {self.state.global_step}: the {what}; the run stopped there and saved nothing "
            f"of that step ({kept}). Lower --learning_rate (the run's peak is {peak:g}) or lengthen --warmup_steps, "
            f"and start over with --overwrite_output_dir or in another --output_dir{resume}.")

    def _save_checkpoint(self, model, trial):
        with saving_into(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}",
                         self.save_failure_note):
            super()._save_checkpoint(model, trial)
            step = self.state.global_step
            if self._stream is not None and self.args.should_save:
                checkpoint = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
                if not save_position(self._stream, checkpoint, step, self._stream.every):
                    logger.warning("The stream's position at step %d is no longer known: a resume from %s will "
                                   "read the stream again up to it.", step, checkpoint)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Trainer's push at each save (`hub_strategy` every_save), as a revision that loads (see `ddl_tools.hub`)."""
        from .hub import push_folder, stage_checkpoint

        if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:
            return
        if not self.args.hub_always_push and self.push_in_progress is not None and not self.push_in_progress.is_done():
            return  # as Trainer: skip this save while the previous push still uploads
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        if not stage_checkpoint(checkpoint_folder, self.args.output_dir):
            logger.warning("Not pushing step %d: the checkpoint holds a LoRA adapter, not a model that loads on its "
                           "own; the merged model is pushed at the end.", self.state.global_step)
            return
        if self.card_inputs is not None:
            write_text(os.path.join(self.args.output_dir, "README.md"), self.progress_card())
        at = (f"step {self.state.global_step}" if self.args.save_strategy == SaveStrategy.STEPS
              else f"epoch {int(self.state.epoch)}")
        job = push_folder(self.args.output_dir, self.hub_model_id, f"Training in progress, {at}",
                          token=self.args.hub_token, revision=self.args.hub_revision, blocking=False)
        self.push_in_progress = PushInProgress([job])

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, **kwargs):
        """Trainer's final push: save, write the card, upload the output folder through `ddl_tools.hub`."""
        from .hub import push_folder

        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        self.create_model_card(**kwargs)
        self._finish_current_push()
        return push_folder(self.args.output_dir, self.hub_model_id, commit_message, token=token,
                           revision=revision or self.args.hub_revision, blocking=blocking)

    def progress_card(self) -> str:
        """The model card of a revision pushed during training: the run as described so far, the last logged
        losses."""
        state, inputs = self.state, self.card_inputs
        last = {key: [e[key] for e in state.log_history if key in e] for key in ("loss", "eval_loss")}
        metrics = {"tokens_seen": tokens_seen(state, self.args, inputs["block_size"]),
                   "final_train_loss": (last["loss"] or [None])[-1], "eval_loss": (last["eval_loss"] or [None])[-1]}
        total = f" of {state.max_steps:,}" if state.max_steps > 0 else ""
        status = (f"**Training in progress** (step {state.global_step:,}{total}): the weights of that step and the "
                  "losses logged so far.")
        return model_card(**inputs, num_parameters=self.model.num_parameters(), steps=state.global_step,
                          metrics=metrics, loss_curve=None, status=status)


__all__ = [
    "DDLRunRecord",
    "DDLTrainer",
    "DDL_BRANCH_CLASSES",
    "FOLLOWED_ON_RESUME",
    "KEPT_ON_RESUME",
    "PAPER_RECIPE",
    "PRESETS",
    "PRESET_RUN_DEFAULTS",
    "SAVE_ERRORS",
    "TrainingDiverged",
    "UNFINISHED_RUN",
    "UsageError",
    "check_ddl_environment",
    "check_llama_weights",
    "check_resumed_data",
    "check_resumed_model",
    "check_text_column",
    "check_training_arguments",
    "check_weights",
    "checkpoint_damage",
    "checkpoint_step",
    "checkpoints",
    "claim_output_dir",
    "claim_results_dir",
    "config_error_message",
    "data_record",
    "ddl_branch_parameters",
    "ddl_config_from_llama",
    "describe_variant",
    "ensure_validation_split",
    "file_damage",
    "file_digest",
    "finish_output_dir",
    "interruption_note",
    "is_complete_checkpoint",
    "last_complete_checkpoint",
    "checkpoint_config",
    "load_ddl_checkpoint",
    "load_from_llama",
    "load_pretrained",
    "load_raw_datasets",
    "card_metadata",
    "make_config",
    "model_card",
    "parse_config_overrides",
    "parsed_arguments",
    "plot_loss_curve",
    "prepare_tokenizer_for_generation",
    "preset_config",
    "recorded_block_size",
    "release_output_dirs",
    "resumed_block_size",
    "resumed_state",
    "resumed_training_arguments",
    "safetensors_shapes",
    "saving_into",
    "skip_rows_without_text",
    "steps_left",
    "text_batches",
    "tokenize_and_pack",
    "tokenizer_digest",
    "variant_arguments",
    "tokens_seen",
    "train_bpe_tokenizer",
    "training_record",
    "unigram_loss",
]
