"""DDL's accelerators: faster implementations of the operations a DDL checkpoint specifies, used when installed.

A DDL checkpoint's code (`ddl/`, what `save_pretrained` ships) holds each operation's specification and runs anywhere
without this package. When `ddl_kernels` is importable and declares the interface version the checkpoint's
dispatcher (`ddl.ops`) expects, the dispatcher runs the implementation listed here for the inputs' device where it
serves them. One folder per operation:

    residual/   the residual seam (gate, value and delta update, and optionally the next compressor's readout of the
                new state, and in Triton that readout's RMSNorm): C++ for CPU, Triton for CUDA
    readout/    the TC readout of the expanded state (CC: one tap) and a decoding step's window step: C++; Triton
                (and CC's folded readout matrix, and the readout with the next RMSNorm: Triton)
    conv/       EC, the embedding convolution, and a decoding step's EC from the cached window: C++; Triton
    build.py    loading the C++ kernels the install built (`python -m ddl_kernels.build` builds them again)

Every implementation is tested against the specification on outputs and every gradient (tests/test_cpu_kernel.py,
tests/test_kernels.py). This package imports nothing from `ddl`: its kernels are checked against `ddl.reference` by
the tests, not by themselves.
"""

import torch
import torch.utils.checkpoint


# What the operations take and return, as `implementations()` lists them; raised on any change of a contract:
#   delta_residual(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, mode, readout=None)
#       -> X_next; a single linear gate and a learned value; mode "delta"/"write_only"
#   delta_residual_readout(..., readout) -> (X_next, y): also the readout y of X_next by the next compressor's weight
#       `(K, d, d_v)`, zeros before the first token, made in the same pass, or y None where it is not (the caller
#       reads X_next itself)
#   token_readout(x, taps) / token_conv(x, taps) -> y: taps `(K, d_v, d)`, zeros before the first token
#   window_step(past, x, weight) / conv_step(past, x, weight) -> one decoding step's output; `past` advanced in place
#   folded_conv_read(conv_weight, read) -> CC's readout matrix `(d, d_v)` (an operation added without a new version:
#       a dispatcher that does not ask for it runs as before, and one that finds none runs its specification)
#   delta_residual_readout_norm(..., readout, gain, norm_eps) -> (X_next, y, RMSNorm(y)) with the next sublayer's
#       RMSNorm (LlamaRMSNorm's) of y made in the same pass, or both None where y is not; with readout None at d_v = 1
#       (X_next is the next input), (X_next, None, RMSNorm(X_next)) or (X_next, None, None) (version 4: a version 3
#       kernel gave X_next alone there)
#   token_readout_norm(x, taps, gain, norm_eps) -> (y, RMSNorm(y)): token_readout, and the next sublayer's RMSNorm
#       (LlamaRMSNorm's) of y made in the same pass; window_step_norm(past, x, weight, gain, norm_eps) -> (y, RMSNorm(y))
#       likewise of window_step (both added as folded_conv_read was)
#   delta_residual*(..., u_read=None): keyword, the one-tap weight `(1, d, d_v)` u was read out of x by (the caller's
#       promise), so that a kernel may read u out of x again in backward instead of keeping it (version 5)
INTERFACE_VERSION = 5


def implementations():
    """{operation: {device type: run}}: at most one implementation per operation and device. `run(*args)` returns
    the operation's result, or None where it does not serve these inputs (then the specification runs). Triton's are
    listed where CUDA is there (importing triton costs seconds; its kernels serve CUDA tensors only)."""
    from .conv import cpu as conv_cpu
    from .readout import cpu as readout_cpu
    from .residual import cpu as residual_cpu

    found = {
        "delta_residual": {"cpu": residual_cpu.run},
        "delta_residual_readout": {"cpu": residual_cpu.run},
        "token_readout": {"cpu": readout_cpu.run},
        "window_step": {"cpu": readout_cpu.step},
        "token_conv": {"cpu": conv_cpu.run},
        "conv_step": {"cpu": conv_cpu.step},
    }
    if torch.cuda.is_available():
        from .conv import triton as conv_triton
        from .readout import triton as readout_triton
        from .residual import triton as residual_triton

        found["delta_residual"]["cuda"] = residual_triton.RUN
        found["delta_residual_readout"]["cuda"] = residual_triton.RUN
        found["delta_residual_readout_norm"] = {"cuda": residual_triton.RUN}
        found["token_readout"]["cuda"] = readout_triton.RUN
        found["token_readout_norm"] = {"cuda": readout_triton.NORM}
        found["window_step"]["cuda"] = readout_triton.STEP
        found["window_step_norm"] = {"cuda": readout_triton.STEP_NORM}
        found["token_conv"]["cuda"] = conv_triton.RUN
        found["conv_step"]["cuda"] = conv_triton.STEP
        found["folded_conv_read"] = {"cuda": readout_triton.FOLD}
    return found


def serving(serves, run):
    """`run` as the dispatcher calls it: its result where `serves(*args, **kwargs)`, else None."""
    return lambda *args, **kwargs: run(*args, **kwargs) if serves(*args, **kwargs) else None


_failed = set()  # kernels that failed to compile or launch in this process: the specification serves them


def fallible(name, run):
    """`run`, returning None instead of raising (once, with one warning that names the kernel; never again in this
    process) when it fails to compile or launch, e.g. Triton on a GPU it does not support: the dispatcher then runs
    the specification, which computes the same numbers."""

    def guarded(*args, **kwargs):
        if name in _failed:
            return None
        try:
            return run(*args, **kwargs)
        except _NOT_THE_KERNELS:
            raise
        except Exception as error:  # a compile error, a launch error, an unsupported device
            from transformers.utils import logging

            _failed.add(name)
            logging.get_logger(__name__).warning(
                f"DDL: the {name} kernel failed ({type(error).__name__}: {str(error)[:300]}); DDL uses the "
                "specification (PyTorch) for it from now on.")
            return None

    return guarded


# Raised through a kernel's call but not by the kernel: out of memory (transient: it must not turn a kernel off for the
# rest of the process), and the signal by which a non-reentrant checkpoint ends its recompute early.
_STOP_RECOMPUTATION = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)  # (private: may go)
_NOT_THE_KERNELS = (torch.OutOfMemoryError,) + ((_STOP_RECOMPUTATION,) if _STOP_RECOMPUTATION else ())


def refuse_second_derivative(operation):
    """First in each backward here: its gradients are computed outside autograd, so under create_graph=True autograd
    would take them for constants, a second derivative silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"DDL: a second derivative (create_graph=True) through {operation} is not supported; set "
                           "model.config.ddl_implementation = 'reference' (and ddl_rebuild_states = False), whose "
                           "operations autograd differentiates twice.")


def eager():
    """Neither torch.compile nor torch.jit.trace is tracing: every kernel here serves only then (a launch inside a
    trace would be recorded wrongly or not at all: Inductor fuses the specification itself; a jit trace would keep
    the allocation, not the kernel's writes)."""
    return not (_is_compiling() or _is_tracing())


# looked up once: attribute lookups through `torch.` cost microseconds per sublayer of a decoding step
_is_compiling, _is_tracing = torch.compiler.is_compiling, torch.jit.is_tracing


__all__ = ["INTERFACE_VERSION", "eager", "fallible", "implementations", "refuse_second_derivative", "serving"]
