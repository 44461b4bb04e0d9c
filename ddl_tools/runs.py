"""The run's output folder: which checkpoints in it are complete, the claim a run takes on it (refusing another
run's folder or one holding earlier work, unless told to start over), and saving into it.
"""

import contextlib
import json
import os
import re
import shutil
import sys
import time

from safetensors import SafetensorError
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from .loading import file_damage
from .outputs import FolderLock, UsageError, claim_folder, first_line, folder_contents, release_folder, write_json


logger = logging.get_logger(__name__)

# train.py's mark on an output folder from the start of a run until its final save: a folder holding it (and no
# complete checkpoint) holds only what an unfinished run left, and a new run may start over in it.
UNFINISHED_RUN = ".ddl_unfinished_run.json"
_held_claims: list[tuple[str, FolderLock, bool]] = []  # (folder, lock, created by this run) of this process


def checkpoint_step(path: str) -> int | None:
    match = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def checkpoint_damage(path: str) -> str | None:
    """Why the checkpoint folder `path` cannot be resumed from, in words that follow "checkpoint-N is" (None: it
    can). Trainer writes `trainer_state.json` last: without it the save was interrupted. With it, every file must
    look whole (`file_damage`): a full disk or a power loss during a save leaves a 0-byte or truncated state,
    weights or optimizer file, and resuming from it would be a traceback."""
    state = os.path.join(path, TRAINER_STATE_NAME)
    if not os.path.isfile(state):
        return f"incomplete (no {TRAINER_STATE_NAME}: its save was interrupted)"
    names = [TRAINER_STATE_NAME] + sorted(name for name in os.listdir(path) if name != TRAINER_STATE_NAME)
    for name in names:
        if os.path.isfile(os.path.join(path, name)):
            problem = file_damage(os.path.join(path, name))
            if problem is not None:
                return f"damaged (its {name} {problem}: a save cut short by a full disk or a crash)"
    with open(state, encoding="utf-8") as f:
        if not isinstance(json.load(f), dict):
            return f"damaged (its {TRAINER_STATE_NAME} is not a Trainer state)"
    return None


def checkpoints(folder: str) -> list[str]:
    """The `checkpoint-<step>` folders in `folder`, oldest step first."""
    found = [os.path.join(folder, name) for name in folder_contents(folder)
             if checkpoint_step(name) is not None and os.path.isdir(os.path.join(folder, name))]
    return sorted(found, key=checkpoint_step)


def last_complete_checkpoint(folder: str) -> str | None:
    complete = [path for path in checkpoints(folder) if checkpoint_damage(path) is None]
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
                os.path.join(resume, TRAINER_STATE_NAME)):
            problem = f"not a Trainer checkpoint folder (no {TRAINER_STATE_NAME})"
        raise UsageError(f"--resume_from_checkpoint {resume!r} is {problem}.{hint}")
    return resume


def claim_output_dir(out: str, resume: str | None, overwrite: bool, do_train: bool, main_process: bool = True):
    """Make `out` this run's (the rule of `ddl_tools.outputs`) and say which checkpoint to resume from (None: start
    fresh). The main process creates the folder (a file there, or no permission, is a `UsageError` now, not at the
    first save after training) and takes its lock (one run at a time); nothing in it changes until the run's checks
    have passed and `take_output_dir` makes it this run's.

    A non-empty folder is refused unless it is resumed from (`--resume_from_checkpoint` names a checkpoint in it),
    holds only what an unfinished run left (the mark, no complete checkpoint: e.g. the tokenizer of a run that
    failed), or `overwrite` is given."""
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
    return checkpoint


def take_output_dir(out: str, overwrite: bool, resume: str | None) -> None:
    """Make the claimed `out` this run's once every check has passed (a refused run leaves it as it was: a finished
    run stays finished and keeps its checkpoints): mark it unfinished (until `finish_output_dir`), and, for a run that
    does not resume in it, delete its old checkpoints with `overwrite` (a later `--resume_from_checkpoint true` must
    not pick them up). The main process's, before its first write there."""
    if overwrite and not (resume is not None and _is_inside(resume, out)):
        for path in checkpoints(out):
            shutil.rmtree(path)
    if not os.path.exists(os.path.join(out, UNFINISHED_RUN)):  # (a mark already there is kept)
        write_json(os.path.join(out, UNFINISHED_RUN), {"command": sys.argv, "started": time.ctime()})


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
        raise UsageError(f"saving {what} into {folder!r} failed ({first_line(err)}). Free space there (or make it "
                         f"writable); {then or interruption_note(folder)}") from err


def run_cli(main, argv: list[str], prog: str, interrupted) -> int:
    """A script's `main(argv)` as its command line runs it: a user mistake is one `prog: error: ...` line on stderr
    and exit status 2, Ctrl-C one line that says what to do (`interrupted()`) and status 130. However it ends, its
    output folders are let go of (one it created and left empty is removed) and its process group is ended."""
    from huggingface_hub.errors import StrictDataclassError

    from .launch import end_process_group
    from .presets import config_error_message

    failed = True
    try:
        main(argv)
        failed = False
    except UsageError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except StrictDataclassError as err:  # a DDLConfig built from a config.json or the flags is invalid
        print(f"{prog}: error: {config_error_message(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; {interrupted()}", file=sys.stderr)
        return 130
    finally:
        release_output_dirs(failed)
        end_process_group()
    return 0


def release_output_dirs(failed: bool = False) -> None:
    """Let go of this process's output folders (the operating system does it at exit anyway). `failed`: a folder
    this run created and left holding nothing but its mark is removed (a mistyped flag leaves no trace)."""
    while _held_claims:
        out, lock, created = _held_claims.pop()
        leftover = failed and created and set(folder_contents(out)) <= {UNFINISHED_RUN}  # (refused before the mark)
        if leftover and os.path.exists(os.path.join(out, UNFINISHED_RUN)):
            os.remove(os.path.join(out, UNFINISHED_RUN))
        release_folder(out, lock, leftover)


__all__ = [
    "SAVE_ERRORS",
    "UNFINISHED_RUN",
    "checkpoint_damage",
    "checkpoint_step",
    "checkpoints",
    "claim_output_dir",
    "claim_results_dir",
    "finish_output_dir",
    "interruption_note",
    "last_complete_checkpoint",
    "take_output_dir",
    "release_output_dirs",
    "run_cli",
    "saving_into",
]
