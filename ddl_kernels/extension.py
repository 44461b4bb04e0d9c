"""What the C++ CPU kernels are built from, and how: read by setup.py when the package is installed (in pip's build
environment, which has no torch: so this module imports nothing but the standard library and setuptools) and by
`build.py`, which loads the library only when it was built from the sources beside it."""

import glob
import hashlib
import os
import platform
import sys


HERE = os.path.dirname(os.path.realpath(__file__))
BASE_FLAGS = ["-std=c++17", "-O3", "-fopenmp"]
# (library, flags): x86 machines whose PyTorch runs AVX2 kernels load the AVX2 + FMA build (vectors twice as wide as
# the baseline's); the baseline serves the others. Both are built at install, so that a wheel built on one machine
# runs on another.
VARIANTS = [("_cpu", BASE_FLAGS)]
if platform.machine().lower() in ("x86_64", "amd64"):
    VARIANTS.append(("_cpu_avx2", BASE_FLAGS + ["-mavx2", "-mfma"]))


def sources(root=HERE):
    """The library's C++ files in `root` (this folder; setup.py names it relative to the project, as setuptools wants),
    in a fixed order."""
    ops = sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "*", "*.cpp")))
    return [os.path.join(root, name) for name in ["library.cpp", *ops]]


def digest(flags, root=HERE):
    """A digest of the flags and the sources (C++ files and headers, names and texts): the library holds the one it was
    built with (`ddl_sources_digest()`), and the loader refuses one that differs from that of the sources beside it."""
    h = hashlib.sha256(" ".join(flags).encode())
    for path in [*sources(root), *sorted(glob.glob(os.path.join(root, "*.h")))]:
        with open(path, "rb") as f:
            h.update(os.path.relpath(path, root).encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


def extensions(root=HERE, optional=True):
    """The setuptools extensions, one per variant: plain shared libraries (no Python or torch headers, loaded with
    ctypes), Linux only (measured there; macOS' compiler has no OpenMP by default). `optional`: a failed build (no
    compiler) is a warning, and the package installs without them (DDL runs its PyTorch paths)."""
    from setuptools import Extension

    if not sys.platform.startswith("linux"):
        return []
    # depends: what else makes a build stale (setuptools otherwise reuses an older one left in build/)
    depends = [*sorted(glob.glob(os.path.join(root, "*.h"))), os.path.join(root, "extension.py")]
    return [Extension(f"ddl_kernels.{name}", sources=sources(root), include_dirs=[root], depends=depends,
                      extra_compile_args=flags, extra_link_args=["-fopenmp"], language="c++", optional=optional,
                      define_macros=[("DDL_SOURCES_DIGEST", f'"{digest(flags, root)}"')])
            for name, flags in VARIANTS]


def build_ext_command():
    """setuptools' build_ext, naming each library `<name>.so`: it is no Python module (no interpreter tag)."""
    from setuptools.command.build_ext import build_ext

    class BuildLibraries(build_ext):
        def get_ext_filename(self, fullname):
            return os.path.join(*fullname.split(".")) + ".so"

    return BuildLibraries
