r"""Loading the CPU kernels: one shared library from each operation's `<op>/<op>.cpp`, `common.h` and `library.cpp`.

Built when the package is installed (`pip install .` or `pip install -e .`: setup.py, ddl_kernels/extension.py), by
the C++ compiler alone, and loaded here through ctypes (native.py); never built at run time, so no forward waits for
a compiler. `python -m ddl_kernels.build` builds them again in place (after editing the C++). Nothing requires them:
when the library is missing, was built from other sources than those beside it, or does not load (a failed or skipped
build, another system), or with `DDL_CPU_KERNEL=0`, `kernels()` is None at once, after one line saying how to build,
and DDL runs its PyTorch paths, which compute the same numbers up to rounding.
"""

import os
import sys

import torch
from transformers.utils import logging

from . import eager, extension


logger = logging.get_logger(__name__)

HERE = extension.HERE
_SWITCH_ON, _SWITCH_OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
HOW_TO_BUILD = ("build them with `pip install -e .` in a checkout of ddl (or `pip install .`), or `python -m "
                "ddl_kernels.build` after editing the C++")


def switched_on():
    """`DDL_CPU_KERNEL`: on (unset, or 1/true/yes/on) or off (0/false/no/off); anything else is a mistake (`disable`
    must not mean "on"), a ValueError that names the values."""
    value = os.environ.get("DDL_CPU_KERNEL", "").strip().lower()
    if value and value not in _SWITCH_ON + _SWITCH_OFF:
        raise ValueError(f"DDL_CPU_KERNEL={value!r}: set it to 0 (PyTorch only) or 1 (use DDL's C++ CPU kernels, the "
                         "default), or unset it.")
    return value not in _SWITCH_OFF


def variant():
    """(library path, flags) of the build this machine runs: AVX2 + FMA where PyTorch runs AVX2 kernels and that
    build is there, else the baseline."""
    avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    found = [(os.path.join(HERE, f"{name}.so"), flags) for name, flags in extension.VARIANTS
             if avx2 or "-mavx2" not in flags]
    return next((v for v in reversed(found) if os.path.isfile(v[0])), found[-1])


_ops = None  # the loaded kernels (native.Kernels); False when missing, stale, unloadable or switched off


def kernels():
    """The C++ kernels (`native.Kernels`: eight functions of tensors), or None; loaded once per process, never
    built."""
    global _ops
    if _ops is None:
        _ops = _load() or False
    return _ops or None


def eager_cpu_float(x):
    """CPU, fp32 or fp64, no autocast, not traced by torch.compile or torch.jit.trace: where the C++ kernels compute
    the specifications' numbers (under autocast the sublayer outputs come in another dtype)."""
    dtype = x.dtype
    return (
        x.is_cpu
        and (dtype is torch.float32 or dtype is torch.float64)
        and not _autocast_enabled("cpu")
        and eager()
    )


_autocast_enabled = torch.is_autocast_enabled  # (looked up once, as `eager`'s)


def ready(x):
    """`eager_cpu_float(x)` and the kernels loaded (on the first such call)."""
    return eager_cpu_float(x) and bool(_ops or (_ops is None and kernels() is not None))


def _load():
    if not switched_on():
        return None
    if not sys.platform.startswith("linux"):  # measured on Linux only (macOS' compiler has no OpenMP by default)
        logger.info("DDL: its C++ CPU kernels are built on Linux only; using the PyTorch paths.")
        return None
    path, flags = variant()
    fallback = "so DDL uses its PyTorch paths (same numbers up to rounding, slower)"
    if not os.path.isfile(path):
        logger.warning(f"DDL: its C++ CPU kernels are not built ({path} is missing, e.g. no C++ compiler at install), "
                       f"{fallback}; {HOW_TO_BUILD}.")
        return None
    from .native import Kernels

    try:
        built = Kernels(path)
        expected = extension.digest(flags, HERE)
    except (OSError, AttributeError) as error:  # not a library, another architecture, missing functions or sources
        logger.warning(f"DDL: its C++ CPU kernels {path} do not load ({type(error).__name__}: {str(error)[-500:]}), "
                       f"{fallback}; {HOW_TO_BUILD}.")
        return None
    if built.digest != expected:
        logger.warning(f"DDL: its C++ CPU kernels {path} were built from other sources than those beside them (an "
                       f"edit since), {fallback}; {HOW_TO_BUILD}.")
        return None
    return built


def build_in_place():
    """Compiles the libraries beside the sources now (into `HERE`, a folder named ddl_kernels), as `pip install` does:
    setuptools' build_ext, all variants, one after the other (setup.py says why); a failure raises."""
    import tempfile

    from setuptools import Distribution

    command_class = extension.build_ext_command()
    command = command_class(Distribution({"name": "ddl", "ext_modules": extension.extensions(HERE, optional=False)}))
    with tempfile.TemporaryDirectory() as temp:
        command.build_lib, command.build_temp = os.path.dirname(HERE), temp
        command.force = True
        command.ensure_finalized()
        command.run()


if __name__ == "__main__":  # python -m ddl_kernels.build: build now, in place (after editing the C++)
    logging.set_verbosity_info()
    try:
        build_in_place()
    except ImportError as error:  # (Python 3.12's environments come without setuptools)
        sys.exit(f"ddl_kernels: building needs setuptools ({error}): pip install setuptools")
    built = kernels()
    print(f"ddl_kernels: C++ CPU kernels {'built: ' + built.__file__ if built else 'not loaded (PyTorch paths)'}")
    sys.exit(0 if built or not switched_on() else 1)
