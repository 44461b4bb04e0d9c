"""The model shapes, the paper's optimisation recipe and each preset's run defaults; building a `DDLConfig` from
them, from a Llama config or from `--config_overrides`; the command line's parsing and DDL's environment variables.

User mistakes raise `UsageError` (a `ValueError`) with a message that says what was expected and how to fix it; the
scripts turn it into a one-line error and a non-zero exit.
"""

import contextlib
import dataclasses
import json
import os
import re

from huggingface_hub.errors import StrictDataclassError
from transformers.utils import logging

from ddl import DDLConfig
from ddl.ops import choose

from .outputs import UsageError


logger = logging.get_logger(__name__)

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
        choose()
        with contextlib.suppress(ImportError):
            from ddl_kernels.build import switched_on

            switched_on()
    except ValueError as err:
        raise UsageError(str(err)) from err
    if os.environ.get("DDL_REBUILD_STATES", "").strip().lower() not in ("", "off"):
        logger.warning("DDL_REBUILD_STATES is ignored: the expanded states are rebuilt in backward by default; "
                       "--ddl_rebuild_states False keeps them (DDLConfig.ddl_rebuild_states).")


# DDLConfig fields that switch how training runs, not what the model is: their flags apply to a loaded checkpoint
# (fine-tuning, resuming) as to a fresh model.
TRAINING_SWITCHES = ("ddl_rebuild_states", "ddl_autocast_state")


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


__all__ = [
    "PAPER_RECIPE",
    "PRESETS",
    "PRESET_RUN_DEFAULTS",
    "TRAINING_SWITCHES",
    "check_ddl_environment",
    "config_error_message",
    "ddl_config_from_llama",
    "make_config",
    "parse_config_overrides",
    "parsed_arguments",
    "preset_config",
    "variant_arguments",
]
