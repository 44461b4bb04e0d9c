"""Resuming a run: what its checkpoints record beyond `TrainerState` (block size, data, tokenizer, model flags,
training arguments) and the checks that a resume continues the same run.
"""

import enum
import hashlib
import json
import os

from huggingface_hub.errors import StrictDataclassError
from transformers import TrainerCallback, TrainerState
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from ddl import DDLConfig

from .outputs import UsageError
from .presets import PRESETS, TRAINING_SWITCHES, config_error_message


logger = logging.get_logger(__name__)


class DDLRunRecord(TrainerCallback, ExportableState):
    """What a resumed run must keep and `TrainerState` does not record: the block size the data was packed into, the
    data (`data_record`: its source and the content of its local files), the tokenizer (`tokenizer_digest`) and the
    training arguments of the optimisation and the data order (`training_record`). Saved in every checkpoint's
    `trainer_state.json` (transformers' stateful callbacks), as JSON: the checkpoint's `training_args.bin` is a
    pickle, which only unpickling (running what it says) would read. A resume that would train on other data or
    tokens, or with arguments Trainer would not honour, is refused (`check_resumed_data`,
    `resumed_training_arguments`)."""

    def __init__(self, block_size: int | None = None, data: dict | None = None, tokenizer: str | None = None,
                 training: dict | None = None, model: dict | None = None):
        self.block_size, self.data, self.tokenizer, self.training = block_size, data, tokenizer, training
        self.model = model

    def state(self) -> dict:
        return {"args": {"block_size": self.block_size, "data": self.data, "tokenizer": self.tokenizer,
                         "training": self.training, "model": self.model},
                "attributes": {}}

    def on_train_begin(self, args, state, control, **kwargs):
        # a checkpoint written before this record existed has no entry, and Trainer's save expects one
        state.stateful_callbacks.setdefault(type(self).__name__, self.state())


def resumed_state(checkpoint: str | None) -> TrainerState | None:
    return None if checkpoint is None else TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE_NAME))


def _recorded(state: TrainerState) -> dict:
    record = state.stateful_callbacks.get(DDLRunRecord.__name__) or {}
    if isinstance(record, list):
        record = record[0] if record else {}
    return record.get("args", {})


def recorded_block_size(state: TrainerState) -> int | None:
    return _recorded(state).get("block_size")


# Config fields that say nothing of the model a LoRA adapter was trained on (`model_record`)
UNRECORDED_CONFIG = ("transformers_version", "_name_or_path", "architectures", "auto_map", "use_cache", "dtype",
                     "torch_dtype", *TRAINING_SWITCHES)


def model_record(config) -> dict:
    """A --lora run's model as its checkpoints record it (an adapter's checkpoint has no config.json): the config of
    its base with the run's --ddl_* and --config_overrides, as JSON values."""
    return json.loads(json.dumps({k: v for k, v in config.to_dict().items() if k not in UNRECORDED_CONFIG}))


def check_resumed_lora_model(checkpoint: str, state: TrainerState, config) -> None:
    """A --lora run resumes its adapter on the model it was trained on: `config` (the base and the flags given now)
    must be the recorded one, field by field (a flag left out or changed would ship the adapter merged into another
    model, even where every tensor keeps its shape). A checkpoint saved before the record resumes with a warning."""
    recorded = _recorded(state).get("model")
    if recorded is None:
        logger.warning("%s does not record its model (saved before train.py recorded it): resuming without checking "
                       "that the base and the --ddl_* / --config_overrides flags given here are the run's.", checkpoint)
        return
    now = model_record(config)
    differ = [f"{key} = {now.get(key)!r} (it has {recorded.get(key)!r})" for key in sorted(now.keys() | recorded.keys())
              if now.get(key) != recorded.get(key)]
    if differ:
        raise UsageError(f"--resume_from_checkpoint {checkpoint!r} continues a LoRA adapter trained on another model: "
                         f"here {'; '.join(differ)}. Resume with the run's own base, --ddl_* and --config_overrides "
                         "flags, or start a new run in another --output_dir.")


def file_digest(path: str) -> str:
    """The SHA-256 of a file's content."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def data_record(name: str, files: dict[str, str], text_column: str, split: dict | None = None) -> dict:
    """What a run trains on, as its checkpoints record it: the source's name (`load_raw_datasets`'), each local file
    by its name and the SHA-256 of its content (`files`: split -> path; a file of the same name may hold other text by
    the time the run resumes), the column read, and how its validation rows were held out (`split`: the one of
    `SPLIT_FLAGS` that chose them and its value; none where the data has its own validation split)."""
    return {"name": name, "text_column": text_column, "split": split or {},
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


# The flags that choose which rows are held out for validation when the data has no validation split of its own
SPLIT_FLAGS = ("validation_split_percentage", "streaming_validation_examples")


def resumed_split(checkpoint: str, state: TrainerState, data_args, given: set[str]) -> None:
    """A resumed run holds out its checkpoint's validation rows (`SPLIT_FLAGS` set in `data_args` to the recorded
    values): another split would move rows between training and validation under the resumed data position, so a
    different value given is refused. A checkpoint saved before the record existed keeps what is given."""
    data = _recorded(state).get("data") or {}
    split = data.get("split") or {}
    if len(split) > 1:  # (recorded before only the flag that chose the rows was: the one that can have)
        chose = (None if "validation" in (data.get("files") or {}) else
                 "streaming_validation_examples" if data_args.streaming else "validation_split_percentage")
        split = {name: value for name, value in split.items() if name == chose}
    for name, value in split.items():
        if name in given and getattr(data_args, name) != value:
            raise UsageError(f"--{name} {getattr(data_args, name):g}: {checkpoint!r} held out its validation rows "
                             f"with {value:g}, and another value would move rows between training and validation. "
                             f"Drop --{name} to resume, or start a new run in another --output_dir.")
        setattr(data_args, name, value)


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
# What Trainer builds from the command line on resume: the run's length; the learning-rate schedule's shape, from the
# second resumed step on (the first takes the rate the checkpoint's scheduler computed), at the checkpoint's peak, as
# for a raised --max_steps; and the clipping of every step. Given, they are what the resumed run trains with.
FOLLOWED_ON_RESUME = ("max_steps", "num_train_epochs", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps",
                      "max_grad_norm")
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
    says why; a given one of `FOLLOWED_ON_RESUME` (--max_steps among them) is what the run trains with.
    A checkpoint saved before the record existed resumes with a warning (nothing to compare with)."""
    recorded = _recorded(state).get("training")
    if recorded is None:
        logger.warning("%s does not record its training arguments (saved before train.py recorded them): resuming "
                       "without checking that the learning rate, optimizer, batch and seed given here are its own "
                       "(Trainer continues with the checkpoint's optimizer and learning rate).", checkpoint)
        return
    differ, adopted = [], []
    if given & {"max_steps", "num_train_epochs"}:  # (one setting: a recorded --max_steps would win over given epochs)
        given = given | {"max_steps", "num_train_epochs"}
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


__all__ = [
    "DDLRunRecord",
    "FOLLOWED_ON_RESUME",
    "KEPT_ON_RESUME",
    "check_resumed_data",
    "check_resumed_lora_model",
    "check_resumed_model",
    "data_record",
    "model_record",
    "file_digest",
    "recorded_block_size",
    "resumed_block_size",
    "resumed_split",
    "resumed_state",
    "resumed_training_arguments",
    "steps_left",
    "tokenizer_digest",
    "tokens_seen",
    "training_record",
]
