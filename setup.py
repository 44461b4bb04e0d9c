"""The package's metadata is in pyproject.toml; this adds ddl_kernels' C++ CPU kernels, built when the package is
installed (`pip install .`, `pip install -e .`) by the compiler alone: plain shared libraries with C functions that
ddl_kernels/native.py calls through ctypes, so pip's isolated build environment needs no torch. Optional: without a
compiler, or off Linux, the package installs without them and DDL runs its PyTorch paths."""

import importlib.util
import os

from setuptools import setup


def _extension_module():
    """ddl_kernels/extension.py, read by path: importing the package would import torch, which is not here."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddl_kernels", "extension.py")
    spec = importlib.util.spec_from_file_location("ddl_kernels_extension", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


extension = _extension_module()
# The variants one after the other (setuptools' default): they compile the same sources into the same object files,
# so side by side one library could link the other's objects.
setup(ext_modules=extension.extensions("ddl_kernels"), cmdclass={"build_ext": extension.build_ext_command()})
