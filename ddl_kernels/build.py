r"""Building and loading the CPU kernels: one C++ extension from each operation's `<op>/<op>.cpp`, `common.h` and
`bindings.cpp`.

Built once per machine with PyTorch's C++ extension tools (`torch.utils.cpp_extension.load`, cached under
`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`): by `python -m ddl_kernels.build` (setup.sh runs it), or
else on first use. One process builds at a time; a build killed midway blocks no later one (`_clear_stale_baton`);
and nothing requires it: without a C++ compiler or ninja, on other systems, or with `DDL_CPU_KERNEL=0`, `kernels()`
is None and DDL runs its PyTorch paths, which compute the same numbers up to rounding.
"""

import contextlib
import glob
import hashlib
import os
import sys
import time

import torch
from transformers.utils import logging

from . import eager


logger = logging.get_logger(__name__)

HERE = os.path.dirname(os.path.realpath(__file__))  # (one checkout reached through a link is still one build)
FUNCTIONS = ("residual_forward", "residual_backward", "readout_forward", "readout_backward", "window_step",
             "conv_forward", "conv_backward", "conv_step")
_SWITCH_ON, _SWITCH_OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def sources():
    """The extension's C++ files, in a fixed order."""
    ops = sorted(os.path.basename(os.path.dirname(path)) for path in glob.glob(os.path.join(HERE, "*", "*.cpp")))
    return [os.path.join(HERE, "bindings.cpp"), *(os.path.join(HERE, op, f"{op}.cpp") for op in ops)]


def switched_on():
    """`DDL_CPU_KERNEL`: on (unset, or 1/true/yes/on) or off (0/false/no/off); anything else is a mistake (`disable`
    must not mean "on"), a ValueError that names the values."""
    value = os.environ.get("DDL_CPU_KERNEL", "").strip().lower()
    if value and value not in _SWITCH_ON + _SWITCH_OFF:
        raise ValueError(f"DDL_CPU_KERNEL={value!r}: set it to 0 (PyTorch only, no C++ build) or 1 (build and use "
                         "DDL's C++ CPU kernels, the default), or unset it.")
    return value not in _SWITCH_OFF


def library_name():
    """One name per source text, so that an edited kernel is rebuilt instead of loading a stale build; AVX2 builds
    get their own name, so that a cache shared by machines with different instruction sets keeps one of each; and
    one per PyTorch installation (its folder and version) and per ddl_kernels folder (torch's build arguments hold
    its path, for common.h), so that environments and checkouts sharing the cache each keep their build instead of
    rebuilding it in turn."""
    digest = hashlib.sha1()
    for path in [*sources(), os.path.join(HERE, "common.h")]:
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join([*_flags(), os.path.dirname(torch.__file__), torch.__version__, HERE]).encode())
    return "ddl_cpu_" + digest.hexdigest()[:12]


def _flags():
    """x86 machines whose PyTorch runs AVX2 kernels get AVX2 + FMA (vectors twice as wide as the baseline's)."""
    avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return ["-O3", "-fopenmp"] + (["-mavx2", "-mfma"] if avx2 else [])


_ops = None  # the built module; False when the build failed or is switched off


def kernels():
    """The compiled functions (`FUNCTIONS`), or None: built once per machine, then loaded from torch's extension
    cache; never required."""
    global _ops
    if _ops is None:
        _ops = _build() or False
    return _ops or None


def eager_cpu_float(x):
    """CPU, fp32 or fp64, no autocast, not traced by torch.compile or torch.jit.trace: where the C++ kernels compute
    the specifications' numbers (under autocast the sublayer outputs come in another dtype; a trace must not build)."""
    dtype = x.dtype
    return (
        x.is_cpu
        and (dtype is torch.float32 or dtype is torch.float64)
        and not _autocast_enabled("cpu")
        and eager()
    )


_autocast_enabled = torch.is_autocast_enabled  # (looked up once, as `eager`'s)


def ready(x):
    """`eager_cpu_float(x)` and the kernels built (built on the first such call; never inside a trace)."""
    return eager_cpu_float(x) and bool(_ops or (_ops is None and kernels() is not None))


def _build():
    if not switched_on():
        return None
    if not sys.platform.startswith("linux"):  # measured on Linux only (macOS' compiler has no OpenMP by default)
        logger.info("DDL: its C++ CPU kernels are built on Linux only; using the PyTorch paths.")
        return None
    name = library_name()
    try:
        import shutil

        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # torch builds with ninja; the pip package's binary is beside python
            with contextlib.suppress(ImportError):
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        folder = _build_directory(name)
        with _build_lock(folder) as held:
            if not held:
                logger.warning(f"DDL: another process has held the build lock of its C++ CPU kernels {name} for over "
                               f"{STALE_AFTER_S:.0f} s; using the PyTorch paths (same numbers up to rounding, slower).")
                return None
            if folder is not None and not _clear_stale_baton(folder):
                return None
            if not _is_built(folder):
                logger.warning(f"DDL: building its C++ CPU kernels {name} once (1-2 min on 2 cores; cached for the "
                               "next runs). Set DDL_CPU_KERNEL=0 to use the PyTorch paths instead.")
            return load(name, sources=sources(), extra_cflags=_flags(), extra_include_paths=[HERE], verbose=False,
                        build_directory=folder)
    except Exception as error:  # no compiler, no ninja, a failed build: the PyTorch paths serve
        logger.warning(f"DDL: the C++ CPU kernels could not be built, so DDL uses the PyTorch paths (same numbers up "
                       f"to rounding, slower): {type(error).__name__}: {str(error)[-1500:]}")
        return None


def _build_directory(name):
    """torch's build folder of the extension `name` (created), or None if torch's private helper is not there."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return _get_build_directory(name, verbose=False)
    except Exception:  # then torch picks the folder, and a stale lock in it is not looked for
        return None


def _is_built(folder):
    return folder is not None and any(f.endswith((".so", ".pyd")) for f in os.listdir(folder))


# A build takes 1-2 min on 2 cores (more on a busy machine); a build lock held for longer than this belongs to a
# process that hangs, and a torch lock file untouched for longer (when its holder cannot be looked up) to a build that
# died.
STALE_AFTER_S = 600.0
BUILD_LOCK = "ddl_build.lock"


@contextlib.contextmanager
def _build_lock(folder):
    """One DDL process at a time builds (or loads) the kernels in `folder`: an exclusive `flock` on a file there, which
    the operating system releases when its holder ends, however it ends. Yields True once held, or False when
    another process has held it for over `STALE_AFTER_S` (the caller then falls back instead of waiting forever)."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    if folder is None or fcntl is None:
        yield True
        return
    with open(os.path.join(folder, BUILD_LOCK), "a+") as f:
        start, waiting = time.monotonic(), False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() - start > STALE_AFTER_S:
                    yield False
                    return
                if not waiting:
                    logger.warning("DDL: waiting for another process that builds its C++ CPU kernels.")
                    waiting = True
                time.sleep(0.5)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _baton_holders(baton):
    """The pids of the processes that hold torch's lock file open (its `FileBaton` keeps it open for the whole build),
    or None when that cannot be told (no /proc, or processes this user may not look into)."""
    if not os.path.isdir("/proc"):
        return None
    target, holders, hidden = os.path.realpath(baton), [], False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except PermissionError:
            hidden = True
            continue
        except OSError:  # the process has ended meanwhile
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    holders.append(int(pid))
            except OSError:
                continue
    return None if hidden and not holders else holders


def _clear_stale_baton(folder):
    """torch's own lock file (`lock`, a `FileBaton`) exists while a build runs, and torch waits for it forever: one
    left by a build killed midway would hang every later process. Holding DDL's build lock, one that no process holds
    open (or, when that cannot be told, untouched for `STALE_AFTER_S`) is removed, and the build goes on. One that a
    live process holds (a build that does not take DDL's lock, e.g. another version of DDL sharing the cache) is
    waited for, for at most `STALE_AFTER_S`; then this process uses the PyTorch paths (returns False)."""
    baton = os.path.join(folder, "lock")
    start = time.monotonic()
    while os.path.exists(baton):
        holders = _baton_holders(baton)
        try:
            age = time.time() - os.path.getmtime(baton)
        except FileNotFoundError:  # its build just finished
            break
        if holders == [] or (holders is None and age > STALE_AFTER_S):
            why = "no process holds it" if holders == [] else f"untouched for {age:.0f} s"
            logger.warning(f"DDL: removing {baton}, left by a build that was killed midway ({why}; torch would wait "
                           "for it forever), and building again.")
            with contextlib.suppress(FileNotFoundError):
                os.remove(baton)
            break
        if time.monotonic() - start > STALE_AFTER_S:
            owner = f"process {holders[0]}" if holders else "a process"
            logger.warning(f"DDL: {baton} has been held by {owner} for over {STALE_AFTER_S:.0f} s, so DDL uses the "
                           "PyTorch paths (same numbers up to rounding, slower); if no build is running, delete it.")
            return False
        time.sleep(0.5)
    return True


if __name__ == "__main__":  # python -m ddl_kernels.build: build now (setup.sh), not at the first training step
    logging.set_verbosity_info()
    built = kernels()
    print(f"ddl_kernels: C++ CPU kernels {'built: ' + library_name() if built else 'not built (PyTorch paths)'}")
    sys.exit(0)
