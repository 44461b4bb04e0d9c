"""Writing results without ever losing a user's work: the one rule that train.py, eval.py and study.py follow.

1. A folder is written only by the run that created it. Each script recognises its own earlier output (train.py: an
   unfinished-run marker and Trainer's checkpoints; eval.py: its manifest; study.py: `study.json` and its report's
   header) and refuses a folder holding anything else, unless told to replace it (`--overwrite_output_dir`,
   `--overwrite`).
2. One writer at a time. A process writing a folder holds its `FolderLock`, which the operating system releases
   when that process ends, however it ends (Ctrl-C, a crash, `kill -9`), so a lock is never stale; a second run
   into the same folder stops with one line that names the holder. Every script claims its folder through
   `claim_folder`.
3. Results are complete or absent. A file is written under a temporary name and renamed into place
   (`write_json`, `write_text`; a temporary file left by a kill or a full disk is recognised as such and removed by
   the next claim, never taken for a user's file); a set of results is written into a temporary folder and moved
   into place when the run has finished (`publish`), and only then replaces the earlier results. Nothing is written
   or deleted through a link, or outside the folder.
4. Bad input is one line that says what to do (`UsageError`), raised before anything is written.
"""

import contextlib
import json
import os
import secrets
import shutil
import sys
from dataclasses import asdict

import torch

try:
    import fcntl
except ImportError:  # not POSIX: no locking (the rule's second point is not enforced there)
    fcntl = None


class UsageError(ValueError):
    """A mistake in the command line or the inputs; the message says what was expected and how to fix it."""


def check_seeds(flag: str, seeds) -> None:
    """Seeds numpy accepts, [0, 2**32) (a negative one was its traceback after the tokenizer was written); None: not
    given."""
    outside = [seed for seed in seeds if seed is not None and not 0 <= seed < 2**32]
    if outside:
        raise UsageError(f"{flag} {' '.join(map(str, outside))}: must be in [0, 2**32) (numpy's range).")


# ---------------------------------------------------------------------------------------------- files


TMP_SUFFIX = ".ddl-tmp"  # a file being written (`write_json`, `write_text`): `.<name>.<random>.ddl-tmp`, then renamed


def temporary_name(path):
    """Where `path` is written before it is renamed into place: a hidden name in the same folder (the rename is then
    atomic), recognisably this project's, so that one left by a kill or a full disk is never mistaken for a user's
    file (`is_leftover`), and its writer's own (two runs writing the same file never write into one another's)."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name[:200]}.{secrets.token_hex(6)}{TMP_SUFFIX}")  # (a name's bytes: <= 255)


def is_leftover(name, own_files=()):
    """Whether a file name in a folder is an unfinished write of this project's: a `temporary_name`, or (as earlier
    versions named them) `<one of own_files>.tmp`."""
    return (name.startswith(".") and name.endswith(TMP_SUFFIX)) or any(name == f"{own}.tmp" for own in own_files)


def _write_atomically(path, write, replace=True):
    tmp = temporary_name(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            write(f)
        if not replace:  # made only where no file is: a hard link, or (none on this file system) a last look first
            try:
                os.link(tmp, path)
                os.remove(tmp)
                return
            except FileExistsError:
                raise
            except OSError:
                if os.path.lexists(path):
                    raise FileExistsError(path) from None
        os.replace(tmp, path)
    except BaseException:  # a full disk, Ctrl-C: no half file under either name
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json(path, obj, replace=True):
    """Atomically (a temporary file, then a rename): a reader never sees half a file, e.g. a study's result.json.
    `replace=False`: FileExistsError where `path` exists (made by someone else since it was checked)."""

    def dump(f):
        json.dump(obj, f, indent=2, default=_json_default)
        f.write("\n")

    _write_atomically(path, dump, replace)


def write_text(path, text):
    """Atomically, like `write_json`."""
    _write_atomically(path, lambda f: f.write(text))


def check_writable_file(path, flag, overwrite=False):
    """That the file `path` (named by the command-line `flag`) can be written when a run ends: its folder exists and
    takes a file (one is created under the `temporary_name` and removed), `path` is not a folder, and nothing is
    there unless `overwrite` (`--overwrite`). A `UsageError` now, before the run, instead of an error after it, when
    its results would be lost, or a file lost to them."""
    folder = os.path.realpath(os.path.dirname(path) or ".")  # (abspath reads `link/..` as text: another folder)
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a folder; name a file to write.")
    if os.path.lexists(path) and not overwrite:
        raise UsageError(f"{flag} {path!r} exists; name a new file, or pass --overwrite to replace it.")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path!r}: its folder {folder!r} does not exist; create it, or name a file in an "
                         "existing folder.")
    probe = temporary_name(os.path.join(folder, os.path.basename(path)))
    try:
        with open(probe, "w", encoding="utf-8"):
            pass
        os.remove(probe)
    except OSError as err:
        raise UsageError(f"{flag} {path!r}: cannot write in {folder!r} ({err.strerror}); name a file in a folder you "
                         "can write to.")


def _json_default(obj):
    if isinstance(obj, torch.dtype):
        return str(obj)
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    return str(obj)


def save_figure(fig, path):
    """Every figure of the project: tight layout, 120 dpi PNG, closed afterwards (no pyplot state left behind)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -------------------------------------------------------------------------------------------- folders


def make_output_folder(path, flag) -> bool:
    """Create the output folder `path` (named by the command-line `flag`) if needed; returns whether it was created.
    A path naming a file, or a folder that cannot be created, is a `UsageError` (before any work is done)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a file, not a folder; choose a folder (it is created if missing).")
    created = not os.path.exists(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise UsageError(f"{flag} {path!r}: cannot create it ({err.strerror}); choose a folder you can write to.")
    return created


def folder_contents(path, own_files=()) -> list[str]:
    """The names in `path` (none if it does not exist), leaving out the lock file and unfinished writes of this
    project's (`is_leftover`)."""
    if not os.path.isdir(path):
        return []
    return sorted(name for name in os.listdir(path) if name != FolderLock.NAME and not is_leftover(name, own_files))


def claim_folder(path, flag, own_files=()):
    """Make the output folder `path` (named by the command-line `flag`) this process's, the part of the rule every
    script shares: create it if needed, take its `FolderLock` (a `UsageError` naming the holder if another process
    writes it), and delete the unfinished writes a killed or failed run left in it (nobody else writes them while
    the lock is held). Returns (the lock, whether the folder was created). What the folder may already hold is each
    script's own rule (its earlier results, recognised by their files)."""
    created = make_output_folder(path, flag)
    lock = FolderLock(path)
    if not lock.acquire(flag):
        raise UsageError(f"{flag} {path!r} is being written by another run ({lock.holder()}); wait for it to end, or "
                         f"choose another {flag}.")
    for name in os.listdir(path):
        if is_leftover(name, own_files) and os.path.isfile(os.path.join(path, name)):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, name))
    return lock, created


def release_folder(path, lock, created) -> None:
    """Let go of a folder `claim_folder` claimed (`lock`): its lock file is removed, and so is the folder itself if
    that claim `created` it and nothing was written into it, so that a run refused or failed before writing leaves
    no trace."""
    lock.release(remove=True)
    if created and os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path):
        with contextlib.suppress(OSError):
            os.rmdir(path)


class FolderLock:
    """An exclusive lock on a folder held by one process: `fcntl.flock` on `<folder>/.ddl.lock`, which also records
    the holder's pid (for the message a second writer gets). The operating system releases it when the holder's
    process ends, however it ends, so it is never stale."""

    NAME = ".ddl.lock"

    def __init__(self, folder):
        self.path = os.path.join(folder, self.NAME)
        self._file = None

    def acquire(self, flag="the folder") -> bool:
        """Take the lock (without waiting); False if another process holds it. The lock file's creation is also
        the proof that the folder is writable (a `UsageError` that says so otherwise)."""
        if os.path.islink(self.path):  # never truncate (below) the file a link points to: the link is not ours
            raise UsageError(f"{flag} {os.path.dirname(self.path)!r}: its {self.NAME} is a link, which this project "
                             "never makes; remove it, or choose another folder.")
        try:
            # (O_NOFOLLOW: a link made between the check and the open is refused too)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
            file = os.fdopen(fd, "a+", encoding="utf-8")  # held open: the lock lives with it
        except OSError as err:
            raise UsageError(f"{flag} {os.path.dirname(self.path)!r}: cannot write there ({err.strerror}); choose a "
                             "folder you can write to.")
        if fcntl is not None:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                file.close()
                return False
        file.seek(0)
        file.truncate()
        file.write(str(os.getpid()))
        file.flush()
        self._file = file
        return True

    def record(self, pid):
        """Name another process as the writer (a child that does the writing while this process holds the lock)."""
        self._file.seek(0)
        self._file.truncate()
        self._file.write(str(pid))
        self._file.flush()

    def holder(self) -> str:
        """'pid N' of the process that holds the lock, as it recorded it."""
        try:
            with open(self.path, encoding="utf-8") as f:
                pid = f.read().strip()
        except OSError:
            pid = ""
        return f"pid {pid}" if pid.isdigit() else "another process"

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self, remove=False):
        """Let go of the lock; `remove` also deletes the lock file (a finished folder keeps no trace of it)."""
        if self._file is None:
            return
        if remove:
            try:
                os.remove(self.path)
            except OSError:
                pass
        self._file.close()  # closing the file releases the flock
        self._file = None


def _within(root, path) -> bool:
    """Whether the real path of `path` (links and `..` resolved) is the folder `root` or lies inside it."""
    base = os.path.realpath(root)
    return os.path.commonpath([base, os.path.realpath(path)]) == base


def publish(stage, root, files, previous, record):
    """Move a finished run's results `files` (paths relative to the temporary folder `stage`) into `root`, then
    delete the earlier run's results (`previous`, relative to `root`) that this run did not write again.
    `record(files)` writes the list of the folder's results (a manifest): first the union, so that a crash while
    moving leaves every file accounted for, then this run's files alone.

    Nothing outside `root` is written or deleted, whatever the names say: a name of `files` that leaves it (an
    absolute path, `..`) is a `ValueError` before anything is moved, and an earlier result whose real path is outside
    (`../results.json` in a manifest of an older eval.py, a file behind a link) is neither deleted nor listed again.
    A link on the way to a result is replaced itself by a folder, never written through (the caller refuses a
    folder holding links unless the user allowed their replacement: eval.py's --overwrite)."""
    climbing = [rel for rel in files if os.path.isabs(rel) or os.path.normpath(rel).split(os.sep)[0] in ("..", ".")]
    if climbing:
        raise ValueError(f"results {climbing} would be written outside {root!r}; nothing was moved.")
    # the real folder, once: normpath below would collapse `link/..` (--output_dir link/../x) as text, to ./x, not
    # the folder it names (where the link points, one up), and the earlier results there were neither deleted nor
    # listed, left as files the next run refused
    root = os.path.realpath(root)
    previous = [rel for rel in previous if _within(root, os.path.join(root, rel))]
    record(sorted(set(files) | set(previous)))
    for rel in files:
        folder = root
        for part in os.path.normpath(rel).split(os.sep)[:-1]:
            folder = os.path.join(folder, part)
            if os.path.islink(folder):
                os.unlink(folder)
        target = os.path.join(root, os.path.normpath(rel))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not _within(root, os.path.dirname(target)):  # only if the folder changed under us
            raise ValueError(f"{os.path.dirname(target)!r} does not lie inside {root!r}; {rel!r} was not moved.")
        os.replace(os.path.join(stage, rel), target)  # a link at `target` is replaced itself
    for rel in sorted(set(previous) - set(files)):
        path = os.path.normpath(os.path.join(root, rel))
        if os.path.isfile(path) and _within(root, path):
            os.remove(path)
        folder = os.path.dirname(path)
        while (folder != os.path.normpath(root) and _within(root, folder) and os.path.isdir(folder)
               and not os.path.islink(folder) and not os.listdir(folder)):
            os.rmdir(folder)
            folder = os.path.dirname(folder)
    record(sorted(files))
    shutil.rmtree(stage, ignore_errors=True)


# -------------------------------------------------------------------------------------------- children


def die_with_parent():
    """A `preexec_fn` for `subprocess`: the child gets SIGTERM when the process that started it ends, however it
    ends (Linux `PR_SET_PDEATHSIG`), so a killed script leaves no child writing into its folders. Elsewhere a
    no-op (the folder locks still keep a rerun from deleting what a surviving child writes)."""
    parent = os.getpid()

    def preexec():
        if not sys.platform.startswith("linux"):
            return
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def first_line(err: BaseException) -> str:
    """An exception's message cut to its first non-blank line (at most 300 characters), for a one-line error."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:300]


__all__ = [
    "FolderLock",
    "TMP_SUFFIX",
    "UsageError",
    "check_seeds",
    "check_writable_file",
    "claim_folder",
    "die_with_parent",
    "first_line",
    "folder_contents",
    "is_leftover",
    "make_output_folder",
    "publish",
    "release_folder",
    "save_figure",
    "temporary_name",
    "write_json",
    "write_text",
]
