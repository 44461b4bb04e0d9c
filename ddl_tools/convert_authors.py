"""The authors' own checkpoints as DDL folders: `python -m ddl_tools.convert_authors SRC OUTPUT_DIR`.

SRC is what the authors' model class (`GPT`, model_type "nanogpt-pro", of github.com/yifanzhang-pro/deep-delta-learning
`model/DDL-*.py`) saves: a folder with config.json and model.safetensors (or their `save_pretrained`'s
pytorch_model.bin), or a nanoGPT-style `ckpt.pt` (`{"model": state_dict, "model_args": {...}}`, `_orig_mod.` prefixes
of a compiled model stripped), or a folder holding one. Pickles are read with `torch.load(weights_only=True)`: tensors
and plain containers only, never code.

The result is exact or refused. Every field of their config is mapped to a `DDLConfig` field, or ignored because no
forward reads it (`IGNORED`), or refused, naming it, where it changes their model in a way ddl cannot compute
(`UNSUPPORTED`), or where it contradicts the weights. Every source tensor is used exactly once and every ddl tensor
filled; the folder is built in a temporary sibling, reloaded strictly, and only then renamed into place, so a refusal
or a failure leaves nothing behind. docs/faithfulness.md ("From the authors' checkpoints") has the table.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

import torch

from .outputs import TMP_SUFFIX, UsageError


PROG = "python -m ddl_tools.convert_authors"
AUTHORS_MODEL_TYPE = "nanogpt-pro"
PREFIX = "_orig_mod."  # torch.compile's wrapper, in the state dict of a compiled model (nanoGPT saves it as is)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json")

# Their five files (the accelerated one is the Triton build of cc-ec), by what the weights show.
VARIANT_FILES = {"vdim1": "DDL-vdim1-gpt-mha-rope.py", "cc": "DDL-gpt-mha-rope-CC.py",
                 "cc-ec": "DDL-gpt-mha-rope-CC-EC.py", "tc": "DDL-gpt-mha-rope.py", "tc-ec": "DDL-gpt-mha-rope-EC.py"}

# Every config field their files read, with their default (their GPTConfig's, or getattr's where it declares none).
DEFAULTS = {
    # the shape (read on every variant)
    "vocab_size": 50304, "num_hidden_layers": 12, "num_attention_heads": 6, "hidden_size": 768, "head_dim": 128,
    "block_size": 1024,
    # mapped options
    "use_qk_rmsnorm": True, "rope_base": 10000.0, "ddl_k_eps": 1e-5, "ddl_beta_single_linear": True,
    "ddl_beta_hidden_size": 128, "ddl_v_sigmoid": True, "ddl_v_sigmoid_scale": 4.0,
    "ddl_v_dim1_constant": False, "ddl_v_dim1_constant_value": 2.0,  # (d_v = 1)
    "ddl_value_channels": 4, "ddl_state_shortconv_kernel_size": 4, "ddl_v_constant": False,  # (d_v > 1)
    "ddl_v_constant_value": 2.0,
    "input_embed_shortconv_kernel_size": 4,  # (EC)
    # options ddl does not have (UNSUPPORTED)
    "use_output_gate": False, "use_k_shift": False, "use_v_shift": False, "using_groupnorm": False,
    "q_activation": None, "k_activation": None, "v_activation": None, "rope_ratio": 1.0, "mup": False,
    "ddl_state_dv_shortconv_causal": False,  # (CC)
    # read by no forward (IGNORED)
    "bias": False, "dropout": 0.0, "scale_attn_by_inverse_layer_idx": False, "rms_norm_eps": 1e-5,
    "hidden_size_base": 1024, "hidden_init_std_factor": 0.5, "embedding_init_std": 0.02, "ddl_beta_init": 1.0,
    "ddl_state_read_init": None, "kv_cache_slot_size": 128,
}
# Fields that change their model and have no ddl equivalent: refused unless at their default.
UNSUPPORTED = {
    "use_output_gate": "a SiLU output gate on the attention (g_proj, o_norm)",
    "use_k_shift": "a token shift on the keys (ShiftLinear)",
    "use_v_shift": "a token shift on the values (ShiftLinear)",
    "using_groupnorm": "an RMSNorm on each attention head's output (subln)",
    "q_activation": "an activation on the queries", "k_activation": "an activation on the keys",
    "v_activation": "an activation on the values",
    "rope_ratio": "RoPE on part of each head (ddl rotates all of it)",
    "mup": "logits scaled by hidden_size_base / hidden_size",
    "ddl_state_dv_shortconv_causal": "CC's causal form, which the matched code reads but ignores and earlier code "
                                     "honoured: which one these weights were trained with cannot be told",
}
# Fields no forward of theirs reads: the weights carry all they did.
IGNORED = {
    "bias": "declared, never read (every projection is bias-free)",
    "dropout": "declared, never read (no dropout module)",
    "scale_attn_by_inverse_layer_idx": "declared, never read",
    "rms_norm_eps": "read only by the output gate's norm (every other RMSNorm of theirs is eps 1e-5)",
    "hidden_size_base": "read only with mup",
    "hidden_init_std_factor": "initialisation only", "embedding_init_std": "initialisation only",
    "ddl_beta_init": "initialisation only", "ddl_state_read_init": "initialisation only",
    "kv_cache_slot_size": "the generation cache's allocation step",
    "block_size": "the longest sequence (kept as max_position_embeddings; RoPE needs no table)",
}
# transformers' own config bookkeeping (PretrainedConfig's fields, 4.x and 5.x): their forward reads none of it.
# `tie_word_embeddings` too: their GPT ties the LM head to the embedding whatever it says (checked on the tensors).
TRANSFORMERS_FIELDS = {
    "architectures", "auto_map", "transformers_version", "model_type", "dtype", "torch_dtype", "use_bfloat16",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_cache", "tie_word_embeddings",
    "tie_encoder_decoder", "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "chunk_size_feed_forward", "pruned_heads", "id2label", "label2id", "num_labels", "problem_type",
    "finetuning_task", "task_specific_params", "tokenizer_class", "prefix", "bos_token_id", "eos_token_id",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "tf_legacy_loss",
}
# What each variant's file reads (the rest of DEFAULTS belongs to another file: it must be at its default there).
_COMMON = {"vocab_size", "num_hidden_layers", "num_attention_heads", "hidden_size", "head_dim", "block_size",
           "use_qk_rmsnorm", "rope_base", "ddl_k_eps", "ddl_beta_single_linear", "ddl_beta_hidden_size",
           "ddl_v_sigmoid", "ddl_v_sigmoid_scale", "use_output_gate", "use_k_shift", "use_v_shift",
           "using_groupnorm", "q_activation", "k_activation", "v_activation", "rope_ratio", "mup", "bias", "dropout",
           "scale_attn_by_inverse_layer_idx", "rms_norm_eps", "hidden_size_base", "hidden_init_std_factor",
           "embedding_init_std", "ddl_beta_init", "kv_cache_slot_size"}
_EXPANDED = _COMMON | {"ddl_value_channels", "ddl_state_shortconv_kernel_size", "ddl_state_read_init", "ddl_v_constant",
                       "ddl_v_constant_value"}
READ_BY = {"vdim1": _COMMON | {"ddl_v_dim1_constant", "ddl_v_dim1_constant_value"},
           "cc": _EXPANDED | {"ddl_state_dv_shortconv_causal"},
           "cc-ec": _EXPANDED | {"ddl_state_dv_shortconv_causal", "input_embed_shortconv_kernel_size"},
           "tc": _EXPANDED, "tc-ec": _EXPANDED | {"input_embed_shortconv_kernel_size"}}


# ------------------------------------------------------------------------------------------------ reading SRC


def _load_pickle(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # (an UnpicklingError names the global it refused, on several lines)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"{path!r} cannot be read as tensors alone (torch.load weights_only=True: {first}); this "
                         "converter never unpickles code.") from None


def _load_safetensors(path):
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as err:
        raise UsageError(f"{path!r} is not a readable safetensors file ({err}).") from None


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as err:
        raise UsageError(f"{path!r}: cannot read it as JSON ({err}).") from None
    if not isinstance(value, dict):
        raise UsageError(f"{path!r} holds no JSON object.")
    return value


def _read_checkpoint_file(path):
    """A nanoGPT `ckpt.pt`: (its model_args, its state dict)."""
    checkpoint = _load_pickle(path)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("model"), dict):
        raise UsageError(f"{path!r} is not a nanoGPT-style checkpoint (a dict with 'model', a state dict, and "
                         "'model_args'); a folder's weights go with its config.json.")
    if not isinstance(checkpoint.get("model_args"), dict):
        raise UsageError(f"{path!r} has no 'model_args' (the model's config) beside its 'model'.")
    return dict(checkpoint["model_args"]), checkpoint["model"]


def read_source(src):
    """(their config as a dict, their state dict with `_orig_mod.` stripped, the folder holding them)."""
    if os.path.isfile(src):
        if not src.endswith((".pt", ".pth", ".ckpt")):
            raise UsageError(f"SRC {src!r} is a file but not a checkpoint (.pt); give the folder holding config.json "
                             "and the weights, or a nanoGPT-style ckpt.pt.")
        config, state = _read_checkpoint_file(src)
        folder = os.path.dirname(src) or "."
    elif os.path.isdir(src):
        folder = src
        has_config = os.path.isfile(os.path.join(src, "config.json"))
        found = [name for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                                   "ckpt.pt") if os.path.isfile(os.path.join(src, name))]
        if len(found) > 1 or (found == ["ckpt.pt"] and has_config):  # (a ckpt.pt carries its own config)
            both = found + ["config.json"] * (len(found) == 1)
            raise UsageError(f"SRC {src!r} holds {' and '.join(both)}: which model to convert cannot be told; name "
                             "the file, or keep one.")
        if found == ["ckpt.pt"]:
            config, state = _read_checkpoint_file(os.path.join(src, "ckpt.pt"))
        elif has_config and found:
            config, state = _read_json(os.path.join(src, "config.json")), _read_folder_weights(src, found[0])
        elif found or has_config:
            what = "no weights (model.safetensors or pytorch_model.bin)" if has_config else "no config.json"
            raise UsageError(f"SRC {src!r} holds {what} beside its {'config.json' if has_config else found[0]}.")
        else:
            raise UsageError(f"SRC {src!r} holds neither config.json with model.safetensors (or pytorch_model.bin) "
                             "nor a ckpt.pt: not a checkpoint of the authors' GPT.")
    else:
        raise UsageError(f"SRC {src!r} does not exist.")
    if not all(isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in state.items()):
        raise UsageError(f"SRC {src!r}: the state dict holds something other than named tensors.")
    stripped = {key.removeprefix(PREFIX): value for key, value in state.items()}
    if len(stripped) != len(state):
        raise UsageError(f"SRC {src!r}: some tensors are named both with and without the {PREFIX!r} prefix.")
    return config, stripped, folder


def _read_folder_weights(src, name):
    path = os.path.join(src, name)
    if name == "pytorch_model.bin":
        state = _load_pickle(path)
        if not isinstance(state, dict):
            raise UsageError(f"{path!r} holds no state dict.")
        return state
    if name == "model.safetensors":
        return _load_safetensors(path)
    shards = sorted(set(_read_json(path).get("weight_map", {}).values()))
    state = {}
    for shard in shards:
        state.update(_load_safetensors(os.path.join(src, shard)))
    return state


# ------------------------------------------------------------------------------------------------ the config


def find_variant(state):
    """Which of their files made these weights: "vdim1", "cc", "cc-ec", "tc" or "tc-ec"."""
    if not any(key.startswith("transformer.h.0.") for key in state):
        raise UsageError("the weights hold no transformer.h.0.* tensors: not the authors' GPT (their DDL-*.py).")
    if "transformer.h.0.compress.weight" in state:
        compressor = "cc"
    elif "transformer.h.0.compress.shortconv.weight" in state:
        compressor = "tc"
    elif any(key.startswith(("readout.", "input_embed.")) or ".compress." in key for key in state):
        raise UsageError("the weights have a readout or EC but no compressor in block 0 (transformer.h.0.compress: "
                         "weight for CC, shortconv.weight for TC).")
    else:
        return "vdim1"
    return f"{compressor}-ec" if "input_embed.conv.weight" in state else compressor


def _check_fields(config, variant):
    """Refuses, naming it, a field that changes the model and that ddl cannot compute, one that contradicts the
    variant the weights show, or one unknown here; returns their values, defaults filled in."""
    for name in config:
        if name not in DEFAULTS and name not in TRANSFORMERS_FIELDS and not name.startswith("_"):
            raise UsageError(f"config field {name}={config[name]!r} is unknown to the converter (not a field of the "
                             "authors' DDL files): whether it changes the model cannot be told.")
    values = {**DEFAULTS, **{name: value for name, value in config.items() if name in DEFAULTS}}
    if variant in ("cc", "cc-ec") and "ddl_state_shortconv_kernel_size" not in config:  # (their CC config's rule)
        values["ddl_state_shortconv_kernel_size"] = values["ddl_value_channels"]
    if variant == "vdim1" and "ddl_value_channels" not in config:
        values["ddl_value_channels"] = 1
    for name, why in UNSUPPORTED.items():
        value = values[name]
        at_default = value in (None, "identity") if name.endswith("_activation") else value == DEFAULTS[name]
        if not at_default and name in READ_BY[variant]:
            raise UsageError(f"config field {name}={value!r} cannot be converted: {why}, which ddl does not have.")
    for name in DEFAULTS.keys() - READ_BY[variant] - {"ddl_value_channels"}:
        if name in config and values[name] != DEFAULTS[name]:
            raise UsageError(f"config field {name}={values[name]!r} belongs to another variant: these weights are "
                             f"{variant} ({VARIANT_FILES[variant]}), which does not read it.")
    return values


def _ddl_config(values, variant, dtype, generic):
    """The `DDLConfig` of their model (values: their fields, defaults filled in)."""
    from ddl import DDLConfig

    learned = not values["ddl_v_dim1_constant" if variant == "vdim1" else "ddl_v_constant"]
    constant = values["ddl_v_dim1_constant_value" if variant == "vdim1" else "ddl_v_constant_value"]
    expanded = variant != "vdim1"
    fields = dict(
        vocab_size=values["vocab_size"], hidden_size=values["hidden_size"],
        intermediate_size=math.floor(8 / 3 * values["hidden_size"]),  # their MLP width, as their files compute it
        num_hidden_layers=values["num_hidden_layers"], num_attention_heads=values["num_attention_heads"],
        num_key_value_heads=values["num_attention_heads"], head_dim=values["head_dim"], hidden_act="silu",
        max_position_embeddings=values["block_size"], rms_norm_eps=1e-5, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, rope_parameters={"rope_type": "default",
                                                               "rope_theta": float(values["rope_base"])},
        qk_norm=bool(values["use_qk_rmsnorm"]), qk_norm_position="after_rope",
        ddl_residual="delta", ddl_value_input="state", ddl_k_eps=values["ddl_k_eps"],
        ddl_value_channels=values["ddl_value_channels"] if expanded else 1,
        ddl_compressor="tc" if variant.startswith("tc") else "cc", ddl_shared_compressor=True, ddl_cc_form="conv",
        ddl_embed_conv=variant.endswith("-ec"), ddl_embed_kernel_size=values["input_embed_shortconv_kernel_size"],
        ddl_beta_hidden_size=None if values["ddl_beta_single_linear"] else values["ddl_beta_hidden_size"],
        ddl_beta_hidden_bias=False, ddl_v_constant=None if learned else float(constant),
        dtype=dtype, **generic)
    if variant.startswith("tc"):
        fields["ddl_state_kernel_size"] = values["ddl_state_shortconv_kernel_size"]
    if learned:
        fields["ddl_v_sigmoid_scale"] = values["ddl_v_sigmoid_scale"] if values["ddl_v_sigmoid"] else None
    try:
        return DDLConfig(**fields)
    except (ValueError, TypeError) as err:
        raise UsageError(f"their config gives no valid DDLConfig: {str(err).splitlines()[0]}") from None


# ------------------------------------------------------------------------------------------------ the tensors


def _taps(weight, d, dv):
    """Their depthwise conv weight, channel i * d_v + j, `(d * d_v, [1,] K)`, as ddl's `(K, d, d_v)`."""
    return weight.reshape(d, dv, weight.shape[-1]).permute(2, 0, 1).contiguous()


def tensor_plan(values, variant):
    """[(their name, its shape, ddl name or None = used by no forward of theirs, transform)] for every tensor."""
    d, layers, vocab = values["hidden_size"], values["num_hidden_layers"], values["vocab_size"]
    inner, heads = values["num_attention_heads"] * values["head_dim"], values["head_dim"]
    mlp, dv = math.floor(8 / 3 * d), (values["ddl_value_channels"] if variant != "vdim1" else 1)
    learned = not values["ddl_v_dim1_constant" if variant == "vdim1" else "ddl_v_constant"]
    kernel, embed_kernel = values["ddl_state_shortconv_kernel_size"], values["input_embed_shortconv_kernel_size"]
    keep = None
    plan = [("transformer.wte.weight", (vocab, d), "model.embed_tokens.weight", keep),
            ("ln_f.weight", (d,), "model.norm.weight", keep)]
    for i in range(layers):
        src, dst = f"transformer.h.{i}.", f"model.layers.{i}."
        plan += [(src + "attn.c_q.weight", (inner, d), dst + "self_attn.q_proj.weight", keep),
                 (src + "attn.c_k.weight", (inner, d), dst + "self_attn.k_proj.weight", keep),
                 (src + "attn.c_v.weight", (inner, d), dst + "self_attn.v_proj.weight", keep),
                 (src + "attn.c_proj.weight", (d, inner), dst + "self_attn.o_proj.weight", keep),
                 (src + "mlp.c_fc1.weight", (mlp, d), dst + "mlp.gate_proj.weight", keep),  # (the one under SiLU)
                 (src + "mlp.c_fc2.weight", (mlp, d), dst + "mlp.up_proj.weight", keep),
                 (src + "mlp.c_proj.weight", (d, mlp), dst + "mlp.down_proj.weight", keep),
                 (src + "ln_1.weight", (d,), dst + "input_layernorm.weight", keep),
                 (src + "ln_2.weight", (d,), dst + "post_attention_layernorm.weight", keep)]
        if values["use_qk_rmsnorm"]:
            plan += [(src + "attn.q_rms.weight", (heads,), dst + "self_attn.q_norm.weight", keep),
                     (src + "attn.k_rms.weight", (heads,), dst + "self_attn.k_norm.weight", keep)]
        for theirs, ours in (("ddl_attn", "attn_delta"), ("ddl_mlp", "mlp_delta")):
            s, o = f"{src}{theirs}.", f"{dst}{ours}."
            if values["ddl_beta_single_linear"]:
                plan += [(s + "beta.weight", (1, d), o + "beta_weight", torch.flatten),
                         (s + "beta.bias", (1,), o + "beta_bias", keep)]
            else:
                hidden = values["ddl_beta_hidden_size"]
                plan += [(s + "beta_in.weight", (hidden, d), o + "beta_hidden_weight", keep),
                         (s + "beta_out.weight", (1, hidden), o + "beta_weight", torch.flatten),
                         (s + "beta_out.bias", (1,), o + "beta_bias", keep)]
            # (a constant target: their module still holds the value projection, which no forward reads)
            plan += [(s + "v_proj.weight", (dv, d), o + "value_weight" if learned else None, keep),
                     (s + "v_proj.bias", (dv,), o + "value_bias" if learned else None, keep)]
        if variant != "vdim1":
            plan += _compressor_plan(src + "compress.", dst + "compress.", variant, d, dv, kernel)
    if variant != "vdim1":
        plan += _compressor_plan("readout.", "model.readout.", variant, d, dv, kernel)
    if variant.endswith("-ec"):
        plan.append(("input_embed.conv.weight", (d * dv, 1, embed_kernel), "model.embed_conv.weight",
                     lambda w: _taps(w, d, dv)))
    return plan


def _compressor_plan(src, dst, variant, d, dv, kernel):
    if variant.startswith("cc"):  # a depthwise conv along d_v, `(d, K)`, as ddl's conv form: taps in the same order
        weight = (src + "weight", (d, kernel), dst + "conv_weight", None)
    else:  # a causal depthwise conv over tokens of the flattened d x d_v state
        weight = (src + "shortconv.weight", (d * dv, kernel), dst + "conv_weight", lambda w: _taps(w, d, dv))
    return [weight, (src + "read", (dv,), dst + "read", None)]


def map_tensors(state, plan):
    """{ddl name: tensor} from their state dict by `plan`: every tensor of theirs used once, every one planned found
    with its shape; their tied LM head, where saved, must be the embedding."""
    state = dict(state)
    head, embedding = state.pop("lm_head.weight", None), state.get("transformer.wte.weight")
    if head is not None and embedding is not None and not torch.equal(head, embedding):
        raise UsageError("tensor lm_head.weight differs from transformer.wte.weight: the authors' GPT ties them, so "
                         "one of the two would be dropped.")
    mapped, names = {}, {}
    for name, shape, target, transform in plan:
        if name not in state:
            raise UsageError(f"tensor {name} is missing from the weights (the config asks for it).")
        tensor = state.pop(name)
        if tuple(tensor.shape) != shape:
            raise UsageError(f"tensor {name} has shape {tuple(tensor.shape)}; the config gives {shape}.")
        if target is not None:
            mapped[target], names[name] = (transform or (lambda t: t))(tensor), target
    if state:
        extra = sorted(state)
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise UsageError(f"tensor {extra[0]}{more} is not part of the model the config describes.")
    mapped["lm_head.weight"] = mapped["model.embed_tokens.weight"]  # (tied: one tensor, as in theirs)
    return mapped, names


def _dtype(state):
    dtypes = {tensor.dtype for tensor in state.values() if tensor.is_floating_point()}
    if len(dtypes) != 1:
        raise UsageError(f"the weights are of {len(dtypes)} floating dtypes ({sorted(map(str, dtypes))}); one "
                         "expected.")
    return dtypes.pop()


@dataclass
class Converted:
    """Their checkpoint in ddl's terms."""

    config: "DDLConfig"  # noqa: F821
    tensors: dict  # {ddl name: tensor}, the LM head tied to the embedding
    names: dict  # {their name: ddl name}, for the tensors a forward of theirs reads
    variant: str  # a key of VARIANT_FILES
    folder: str  # where their files are (a tokenizer is looked for there)
    pad_token_id: int | None  # (for generate only: as a model field it would freeze that embedding row in training)


def read_authors(src) -> Converted:
    """Their checkpoint at `src` in ddl's terms; a `UsageError` for anything that cannot be converted exactly."""
    config, state, folder = read_source(src)
    model_type = config.get("model_type", AUTHORS_MODEL_TYPE)  # (a ckpt.pt's model_args may not say)
    if model_type != AUTHORS_MODEL_TYPE:
        hint = " (a Llama: train.py --init_from_llama builds a DDL from one)" if model_type == "llama" else ""
        raise UsageError(f"config model_type={model_type!r} is not the authors' GPT ({AUTHORS_MODEL_TYPE!r}){hint}.")
    variant = find_variant(state)
    values = _check_fields(config, variant)
    if variant != "vdim1":
        dv = values["ddl_value_channels"]
        compressor = state.get("transformer.h.0.compress.read")
        if compressor is not None and compressor.shape != (dv,):
            raise UsageError(f"config field ddl_value_channels={dv!r}, but the weights' compressors read "
                             f"{tuple(compressor.shape)} channels.")
        if variant.startswith("cc") and values["ddl_state_shortconv_kernel_size"] != dv:
            raise UsageError(f"config field ddl_state_shortconv_kernel_size="
                             f"{values['ddl_state_shortconv_kernel_size']!r}: their CC compressor computes only "
                             f"kernel = ddl_value_channels ({dv}).")
    elif values["ddl_value_channels"] != 1:
        raise UsageError(f"config field ddl_value_channels={values['ddl_value_channels']!r}, but the weights are "
                         "d_v = 1 (no compressor).")
    plan = tensor_plan(values, variant)
    mapped, names = map_tensors(state, plan)
    generic = {name: config[name] for name in ("bos_token_id", "eos_token_id") if config.get(name) is not None}
    return Converted(_ddl_config(values, variant, _dtype(state), generic), mapped, names, variant, folder,
                     config.get("pad_token_id"))


# ------------------------------------------------------------------------------------------------ writing


def check_output_dir(output_dir, overwrite, src):
    """OUTPUT_DIR may be new, an empty folder, or (with --overwrite) a folder to replace; never SRC or above it."""
    if os.path.islink(output_dir):
        raise UsageError(f"OUTPUT_DIR {output_dir!r} is a link; name a folder.")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError(f"OUTPUT_DIR {output_dir!r} is a file; name a folder.")
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
        raise UsageError(f"OUTPUT_DIR {output_dir!r} exists and is not empty; name a new folder, or pass --overwrite "
                         "to replace it.")
    out, source = os.path.realpath(output_dir), os.path.realpath(src)
    if source == out or source.startswith(out + os.sep):
        raise UsageError(f"OUTPUT_DIR {output_dir!r} holds SRC {src!r}; name another folder.")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise UsageError(f"OUTPUT_DIR {output_dir!r}: its folder {parent!r} does not exist; create it first.")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"OUTPUT_DIR {output_dir!r}: cannot write in {parent!r}; choose a folder you can write to.")


def _build(converted):
    from ddl import DDLForCausalLM

    config, mapped = converted.config, converted.tensors
    model = DDLForCausalLM(config).to(converted.tensors["model.embed_tokens.weight"].dtype)
    expected = model.state_dict()
    missing, extra = sorted(expected.keys() - mapped.keys()), sorted(mapped.keys() - expected.keys())
    if missing or extra:  # (the plan and ddl's parameters disagree: a converter bug, not the user's)
        raise RuntimeError(f"the mapping does not fill ddl's parameters: missing {missing}, unexpected {extra}")
    model.load_state_dict(mapped, strict=True)
    if converted.pad_token_id is not None:
        model.generation_config.pad_token_id = converted.pad_token_id
    return model.eval()


def _verify(folder, mapped):
    """The written folder loads strictly, with every tensor as mapped."""
    from ddl import DDLForCausalLM

    model, info = DDLForCausalLM.from_pretrained(folder, output_loading_info=True)
    problems = {key: value for key, value in info.items() if value}
    if problems:
        raise RuntimeError(f"the written folder does not load strictly: {problems}")
    state = model.state_dict()
    for name, tensor in mapped.items():
        if not torch.equal(state[name], tensor):
            raise RuntimeError(f"the written folder's {name} differs from the converted tensor")
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("the written folder's LM head is not tied to its embedding")


def write_folder(model, mapped, tokenizer_files, output_dir):
    """Build the folder in a temporary sibling, check it, then rename it into place (replacing OUTPUT_DIR if it
    exists, which `check_output_dir` allowed); on any failure nothing is left but what was there."""
    out = os.path.abspath(output_dir)
    parent, name = os.path.split(out)
    stage = tempfile.mkdtemp(prefix=f".{name[:100]}.", suffix=TMP_SUFFIX, dir=parent)
    old = None
    try:
        model.save_pretrained(stage)
        for path in tokenizer_files:
            shutil.copy(path, os.path.join(stage, os.path.basename(path)))
        _verify(stage, mapped)
        if os.path.isdir(out):
            old = tempfile.mkdtemp(prefix=f".{name[:100]}.old.", suffix=TMP_SUFFIX, dir=parent)
            os.rename(out, os.path.join(old, "replaced"))
        os.rename(stage, out)
    except BaseException:
        if old is not None and not os.path.exists(out):
            os.rename(os.path.join(old, "replaced"), out)
        shutil.rmtree(stage, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def convert(src, output_dir, overwrite=False):
    """Convert the authors' checkpoint `src` into the DDL folder `output_dir`; returns the lines to print. A
    `UsageError` (nothing written) for anything that cannot be converted exactly."""
    from transformers.utils import logging

    check_output_dir(output_dir, overwrite, src)
    converted = read_authors(src)
    config, folder = converted.config, converted.folder
    tokenizer_files = [os.path.join(folder, name) for name in TOKENIZER_FILES
                       if os.path.isfile(os.path.join(folder, name))]
    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # (a bar per shard written and per tensor reloaded: noise here)
    try:
        write_folder(_build(converted), converted.tensors, tokenizer_files, output_dir)
    finally:
        if bars:
            logging.enable_progress_bar()
    lines = [f"wrote {output_dir}: DDL {converted.variant} ({VARIANT_FILES[converted.variant]}), "
             f"d_v={config.ddl_value_channels}, {config.num_hidden_layers} layers x {config.hidden_size}, "
             f"{len(converted.names)} tensors from {src}"]
    lines.append(f"tokenizer: copied {', '.join(map(os.path.basename, tokenizer_files))}" if tokenizer_files else
                 f"tokenizer: none found in {folder!r}; the folder has no tokenizer (add the one the model was "
                 "trained with)")
    return lines


def main(argv=None) -> int:
    """`python -m ddl_tools.convert_authors SRC OUTPUT_DIR`: a DDL folder from the authors' own checkpoint."""
    parser = argparse.ArgumentParser(prog=PROG, description=main.__doc__)
    parser.add_argument("src", metavar="SRC", help="their folder (config.json + model.safetensors or "
                                                   "pytorch_model.bin), or a nanoGPT-style ckpt.pt")
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="the DDL folder to write (new or empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT_DIR if it holds anything")
    args = parser.parse_args(argv)
    try:
        lines = convert(args.src, args.output_dir, args.overwrite)
    except UsageError as err:
        print(f"{PROG}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


__all__ = ["Converted", "convert", "main", "read_authors"]


if __name__ == "__main__":
    sys.exit(main())
