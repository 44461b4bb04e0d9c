"""Writing results without ever losing a user's work: the one rule that train.py, eval.py and study.py follow.

1. A folder is written only by the run that created it. Each script recognises its own earlier output (train.py: an
   unfinished-run marker and Trainer's checkpoints; eval.py: its manifest; study.py: `study.json` and its report's
   header) and refuses a folder holding anything else, unless told to replace it (`--overwrite_output_dir`,
   `--overwrite`).
2. One writer at a time. A process writing a folder holds its `FolderLock`, which the operating system releases
   when that process ends, however it ends (Ctrl-C, a crash, `kill -9`), so a lock is never stale; a second run
   into the same folder stops with one line that names the holder.
3. Results are complete or absent. A file is written under a temporary name and renamed into place
   (`write_json`, `write_text`); a set of results is written into a temporary folder and moved into place when
   the run has finished (`publish`), and only then replaces the earlier results.
4. Bad input is one line that says what to do (`UsageError`), raised before anything is written.
"""

import json
import os
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


# ---------------------------------------------------------------------------------------------- files


def write_json(path, obj):
    """Atomically (a temporary file, then a rename): a reader never sees half a file, e.g. a study's result.json."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


def write_text(path, text):
    """Atomically, like `write_json`."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


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


def folder_contents(path) -> list[str]:
    """The names in `path` (none if it does not exist), leaving out the lock file."""
    if not os.path.isdir(path):
        return []
    return sorted(name for name in os.listdir(path) if name != FolderLock.NAME)


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
        try:
            file = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held open: the lock lives with it)
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


def publish(stage, root, files, previous, record):
    """Move a finished run's results `files` (paths relative to the temporary folder `stage`) into `root`, then
    delete the earlier run's results (`previous`, relative to `root`) that this run did not write again.
    `record(files)` writes the list of the folder's results (a manifest): first the union, so that a crash while
    moving leaves every file accounted for, then this run's files alone."""
    record(sorted(set(files) | set(previous)))
    for rel in files:
        target = os.path.join(root, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(os.path.join(stage, rel), target)
    for rel in sorted(set(previous) - set(files)):
        path = os.path.join(root, rel)
        if os.path.isfile(path):
            os.remove(path)
        folder = os.path.dirname(path)
        while folder != os.path.normpath(root) and os.path.isdir(folder) and not os.listdir(folder):
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


__all__ = [
    "FolderLock",
    "UsageError",
    "die_with_parent",
    "folder_contents",
    "make_output_folder",
    "publish",
    "save_figure",
    "write_json",
    "write_text",
]
