"""Resuming a run: its record, and the one comparison that says whether a resume continues it.

A run's record (`run_record`) is what its checkpoints keep beyond `TrainerState`, as JSON in their
`trainer_state.json` (`DDLRunRecord`; the checkpoint's `training_args.bin` is a pickle, which only unpickling, that
is running what it says, would read): the arguments a resume takes over (`KEPT`: each with the reason another value
is refused; `FOLLOWED`: those Trainer builds from the command line on resume), the content of its data files, its
tokenizer, and for --lora the model its adapter was trained on. A resume takes every argument it is not given from
the record (`adopt_recorded_arguments`), then compares its own record with it (`check_continues`).
"""

import enum
import hashlib
import json
import os

from transformers import TrainerCallback, TrainerState
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from .outputs import UsageError
from .presets import TRAINING_SWITCHES


logger = logging.get_logger(__name__)

_OPTIMIZER = "Trainer restores the optimizer's settings from the checkpoint: the flag would be ignored"
_POSITION = "Trainer counts the steps done in batches of this size, so the run would not resume at its next block"
_ORDER = "the seed draws the order of the blocks, so the run would not resume at its next block"
_SPLIT = "another value would move rows between training and validation"
KEPT = {
    "block_size": "the data would be re-packed under the resumed position",
    "dataset_name": "it names the run's data", "dataset_config_name": "it names the run's data",
    "text_column": "it names the run's text",
    "validation_split_percentage": _SPLIT, "streaming_validation_examples": _SPLIT,
    "learning_rate": "Trainer restores the schedule's peak from the checkpoint: the flag would be ignored",
    **dict.fromkeys(("weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon"), _OPTIMIZER),
    "optim": "the checkpoint holds that optimizer's state, which another optimizer cannot continue",
    "per_device_train_batch_size": _POSITION, "gradient_accumulation_steps": _POSITION,
    "seed": _ORDER, "data_seed": _ORDER,
}
# What Trainer builds from the command line on resume (the run's length, the schedule's shape at the checkpoint's peak,
# the clipping): given, they are what the resumed run trains with. The data files are compared by their content.
FOLLOWED = ("max_steps", "num_train_epochs", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps",
            "max_grad_norm", "train_file", "validation_file")
# Arguments that are given, or taken from the record, together: one setting each.
_TOGETHER = (("max_steps", "num_train_epochs"),
             ("dataset_name", "dataset_config_name", "train_file", "validation_file"))
_SAME_OPTIMIZER = {"adamw_torch_fused": "adamw_torch"}  # the same optimizer (and state), fused or not
# Config fields that say nothing of the model an adapter was trained on
UNRECORDED_CONFIG = ("transformers_version", "_name_or_path", "architectures", "auto_map", "use_cache", "dtype",
                     "torch_dtype", *TRAINING_SWITCHES)


class DDLRunRecord(TrainerCallback, ExportableState):
    """The run's record (`run_record`), saved with every checkpoint (transformers' stateful callbacks)."""

    def __init__(self, record: dict | None = None, **earlier):
        self.record = record if record is not None else _earlier_layout(earlier)

    def state(self) -> dict:
        return {"args": {"record": self.record}, "attributes": {}}

    def on_train_begin(self, args, state, control, **kwargs):
        # a checkpoint written before this record existed has no entry, and Trainer's save expects one
        state.stateful_callbacks.setdefault(type(self).__name__, self.state())


def _earlier_layout(args: dict) -> dict:
    """A record as ddl 0.3.0 saved it (data, training and split nested), in today's layout."""
    data = args.get("data") or {}
    record = {**(args.get("training") or {}), **(data.get("split") or {}), "block_size": args.get("block_size"),
              "text_column": data.get("text_column"), "tokenizer": args.get("tokenizer"), "model": args.get("model")}
    record.update({f"{split}_file": entry for split, entry in (data.get("files") or {}).items()})
    return {key: value for key, value in record.items() if value is not None}


def recorded(checkpoint: str) -> tuple[TrainerState, dict]:
    """The checkpoint's Trainer state and its run's record ({} if it has none)."""
    state = TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE_NAME))
    saved = state.stateful_callbacks.get(DDLRunRecord.__name__) or {}
    saved = (saved[0] if saved else {}) if isinstance(saved, list) else saved
    return state, DDLRunRecord(**saved.get("args", {})).record


def file_digest(path: str) -> str:
    """The SHA-256 of a file's content."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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


def model_record(config) -> dict:
    """A model as a record holds it: its config's fields, as JSON values."""
    return json.loads(json.dumps({k: v for k, v in config.to_dict().items() if k not in UNRECORDED_CONFIG}))


def _json_value(value):
    return value.value if isinstance(value, enum.Enum) else value


def run_record(data_args, training_args, held_out_by: str | None, tokenizer, lora_config=None) -> dict:
    """What a run's checkpoints record: its arguments of `KEPT` and `FOLLOWED` (of the two validation-split flags,
    the one that chose its rows, `held_out_by`), its data files (name, path and content), its tokenizer and, with
    --lora, its model's config (an adapter's checkpoint has no config.json)."""
    names = [n for n in (*KEPT, *FOLLOWED) if not n.endswith(("_file", "_percentage", "_examples"))]
    record = {name: _json_value(getattr(args, name)) for args in (data_args, training_args) for name in names
              if hasattr(args, name)}
    if held_out_by:
        record[held_out_by] = getattr(data_args, held_out_by)
    for key in ("train_file", "validation_file"):
        path = getattr(data_args, key)
        record[key] = path and {"file": os.path.basename(path), "path": os.path.abspath(path),
                                "sha256": file_digest(path)}
    record["tokenizer"] = tokenizer_digest(tokenizer)
    if lora_config is not None:
        record["model"] = model_record(lora_config)
    return record


def adopt_recorded_arguments(checkpoint: str, record: dict, given: set[str], *arguments) -> None:
    """A resumed run trains with its run's arguments: each one the command line does not give is set to the record's
    (the schedule then continues as it was, and the run's card and training_args.json say what Trainer does)."""
    for together in _TOGETHER:
        if given & set(together):
            given = given | set(together)
    adopted = []
    for args in arguments:
        for name, value in record.items():
            if name in given or not hasattr(args, name) or name not in (*KEPT, *FOLLOWED):
                continue
            value = value.get("path") if name.endswith("_file") and value else value
            current = getattr(args, name)
            if _json_value(current) != value:
                setattr(args, name, type(current)(value) if isinstance(current, enum.Enum) else value)
                adopted.append(f"--{name} {_shown(value)}")
    unchecked = [what for what, key in (("block size", "block_size"), ("data", "text_column"),
                                        ("tokenizer", "tokenizer"), ("training arguments", "learning_rate"),
                                        ("model", "model")) if key not in record]
    if unchecked:
        logger.warning("%s does not record its %s (saved by an earlier train.py): resuming without checking that "
                       "they are this run's.", checkpoint, ", ".join(unchecked))
    if adopted:
        logger.warning("Resuming %s with its run's %s (not given here).", checkpoint, ", ".join(adopted))


def _shown(value) -> str:
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _difference(key: str, then, now, tokenizer_source: str) -> str | None:
    """How this run's `now` differs from its checkpoint's `then` for the record's `key`, in words (None: it does
    not)."""
    if key.endswith("_file"):  # by content: a file moved or renamed is the same
        if (then and then["sha256"]) == (now and now["sha256"]):
            return None
        if not (then and now):
            return (f"--{key}: the run read {then['file'] if then else 'none'!r}, this one "
                    f"{now['file'] if now else 'none'!r}")
        return (f"{now['file']!r} has changed since the run read it" if then["file"] == now["file"] else
                f"--{key} {now['file']!r} is not the file the run read ({then['file']!r})")
    if key == "optim" and _SAME_OPTIMIZER.get(now, now) == _SAME_OPTIMIZER.get(then, then) or then == now:
        return None
    if key == "tokenizer":
        return f"the tokenizer ({tokenizer_source}) is not the one it was trained with (another vocabulary or merges)"
    if key == "model":
        return "its model has " + "; ".join(f"{k} = {now.get(k)!r} (it has {then.get(k)!r})"
                                            for k in sorted(now.keys() | then.keys()) if now.get(k) != then.get(k))
    return f"--{key} {_shown(now)} is not the checkpoint's {_shown(then)} ({KEPT[key]})"


def check_continues(checkpoint: str, then: dict, now: dict, tokenizer_source: str) -> None:
    """A resume continues its checkpoint's run: every value of its record that is not this run's is refused (those
    of `FOLLOWED` aside), in one line. Training on would silently use other data, tokens, blocks or settings than the
    checkpoint's, or arguments Trainer would not honour."""
    differ = [_difference(key, then[key], now[key], tokenizer_source) for key in then.keys() & now.keys()
              if key not in FOLLOWED or key.endswith("_file")]
    differ = [line for line in differ if line]
    if differ:
        raise UsageError(f"--resume_from_checkpoint {checkpoint!r} continues its run as it was trained, but "
                         f"{'; '.join(sorted(differ))}. Give the run's own values (or leave them out) to resume, or "
                         "start a new run in another --output_dir to train with these.")


def steps_left(state: TrainerState, max_steps: int) -> int:
    """Optimizer steps a run resumed at `state` has left: to --max_steps, else (epochs) to the total the checkpoint's
    run planned."""
    return (max_steps if max_steps > 0 else state.max_steps) - state.global_step


def tokens_seen(state, args, block_size: int) -> int:
    """Tokens trained on so far: Trainer's count, else steps x blocks per step x block size."""
    return state.num_input_tokens_seen or (state.global_step * args.per_device_train_batch_size * block_size
                                           * args.gradient_accumulation_steps * args.world_size)


__all__ = ["DDLRunRecord", "FOLLOWED", "KEPT", "adopt_recorded_arguments", "check_continues", "file_digest",
           "model_record", "recorded", "run_record", "steps_left", "tokenizer_digest", "tokens_seen"]
