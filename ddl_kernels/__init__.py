"""DDL's accelerators: faster implementations of the operations a DDL checkpoint specifies, used when installed.

A DDL checkpoint's code (`ddl/`, what `save_pretrained` ships) holds each operation's specification and its
PyTorch paths, and runs anywhere without this package. When `ddl_kernels` is importable and declares the interface
version the checkpoint's dispatcher (`ddl.kernels`) expects, the dispatcher puts the implementations listed here in
front of its own, in this order; each says next to its code which inputs it serves. One folder per operation:

    residual/   the residual seam (gate, value and delta update; with the next readout) in C++ for CPU; the seam
                and the delta update alone in Triton for CUDA
    readout/    the TC readout of the expanded state (CC: one tap) and a decoding step's window step: C++; Triton
    conv/       EC, the embedding convolution: C++; Triton (the readout's kernels run the other way); a decoding
                step's EC from the cached window: C++
    build.py    building the C++ kernels once per machine (`python -m ddl_kernels.build`; else on first use)

Every implementation is tested against the specification on outputs and every gradient (tests/test_cpu_kernel.py,
tests/test_kernels.py). Every Triton launch runs under `torch.cuda.device_of` its tensors: Triton launches on the
current device, and a model split over GPUs by `device_map` runs each layer on its own.
"""

from collections import namedtuple

import torch
import torch.utils.checkpoint


INTERFACE_VERSION = 2  # what the operations take and return (ddl.kernels); raised on any change of a contract

# name: for messages; choices: the values of `DDLConfig.ddl_implementation` that may use it; serves(*args): whether
# it computes these inputs (the operation's arguments); run(*args): the result, or None when it cannot run after all
Implementation = namedtuple("Implementation", "name choices serves run")


_failed = set()  # kernels that failed to compile or launch in this process: the next implementation serves them


def fallible(name, run):
    """`run`, returning None instead of raising (once, with one warning that names the kernel; never again in this
    process) when it fails to compile or launch, e.g. Triton on a GPU it does not support: the dispatcher then runs
    the next implementation, which computes the same numbers."""

    def guarded(*args):
        if name in _failed:
            return None
        try:
            return run(*args)
        except _NOT_THE_KERNELS:
            raise
        except Exception as error:  # a compile error, a launch error, an unsupported device
            from transformers.utils import logging

            _failed.add(name)
            logging.get_logger(__name__).warning(
                f"DDL: the {name} kernel failed ({type(error).__name__}: {str(error)[:300]}); DDL uses the next "
                "implementation (PyTorch) for it from now on.")
            return None

    return guarded


# Raised through a kernel's call but not by the kernel: out of memory (transient: it must not turn a kernel off for the
# rest of the process), and the signal by which a non-reentrant checkpoint ends its recompute early.
_STOP_RECOMPUTATION = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)  # (private: may go)
_NOT_THE_KERNELS = (torch.OutOfMemoryError,) + ((_STOP_RECOMPUTATION,) if _STOP_RECOMPUTATION else ())


def refuse_second_derivative(operation):
    """First in each backward here: its gradients are computed outside autograd, so under create_graph=True autograd
    would take them for constants, a second derivative silently wrong (as `ddl.fused`'s of the same name: this
    package serves a checkpoint's code without the `ddl` package, tests/test_remote_code.py)."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"DDL: a second derivative (create_graph=True) through {operation} is not supported; set "
                           "model.config.ddl_implementation = 'reference' (and ddl_rebuild_states = False), whose "
                           "operations autograd differentiates twice.")


def eager():
    """Neither torch.compile nor torch.jit.trace is tracing: every kernel here serves only then (a launch inside a
    trace would be recorded wrongly or not at all: Inductor fuses the PyTorch path itself; a jit trace would keep the
    allocation, not the kernel's writes; a C++ build must not start there)."""
    return not (_is_compiling() or _is_tracing())


# looked up once: attribute lookups through `torch.` cost microseconds per sublayer of a decoding step
_is_compiling, _is_tracing = torch.compiler.is_compiling, torch.jit.is_tracing


def implementations():
    """{operation: [Implementation, ...]} in the order the dispatcher tries them. Triton's are listed where CUDA
    and triton are there (importing triton costs seconds; its kernels serve CUDA tensors only)."""
    from .conv import cpu as conv_cpu
    from .readout import cpu as readout_cpu
    from .residual import cpu as residual_cpu

    found = {
        "delta_residual": [residual_cpu.SEAM],
        "delta_residual_readout": [residual_cpu.SEAM_READOUT],
        "delta_update": [],
        "token_readout": [readout_cpu.READOUT],
        "window_step": [readout_cpu.STEP],
        "token_conv": [conv_cpu.CONV],
        "conv_step": [conv_cpu.STEP],
    }
    if torch.cuda.is_available():
        from .conv import triton as conv_triton
        from .readout import triton as readout_triton
        from .residual import triton as residual_triton

        found["delta_residual"].append(residual_triton.SEAM)
        found["delta_update"].append(residual_triton.UPDATE)
        found["token_readout"].append(readout_triton.READOUT)
        found["window_step"].append(readout_triton.STEP)
        found["token_conv"].append(conv_triton.CONV)
        found["conv_step"].append(conv_triton.STEP)
    return found


__all__ = ["INTERFACE_VERSION", "Implementation", "eager", "fallible", "implementations", "refuse_second_derivative"]
