r"""How each DDL operation runs: its specification (`ddl.reference`), or ddl_kernels' implementation for the inputs'
device where one is installed, allowed and serves them. The one table (`FAST`) says which devices' kernels each value
of `DDLConfig.ddl_implementation` runs:

    "auto"       ddl_kernels' C++ on the CPU (fp32/fp64, eager), else the specification (the default)
    "triton"     also ddl_kernels' Triton on CUDA (not yet run through its tests on a GPU: docs/gpu.md)
    "torch", "reference"   the specifications everywhere (PyTorch; two names for one path)

The process default is "auto", or the environment's `DDL_IMPLEMENTATION`. No kernel runs inside a trace (torch.compile
fuses the specification itself); each is tested against it on outputs and gradients (tests/test_*kernel*.py)."""

import os

import torch
from transformers.utils import logging

from . import reference


# under transformers' logger, so that its verbosity governs these lines also as remote code (transformers_modules.*)
logger = logging.get_logger("transformers.ddl")

INTERFACE_VERSION = 5  # the operations' arguments and results, as ddl_kernels declares them (ddl_kernels/__init__.py)
FAST = {"auto": ("cpu",), "triton": ("cpu", "cuda"), "torch": (), "reference": ()}
_installed = None


def choose(implementation=None):
    """The implementation to run: `implementation` (a `DDLConfig.ddl_implementation`), else the process default."""
    name = implementation or os.environ.get("DDL_IMPLEMENTATION", "").strip().lower() or "auto"
    if name not in FAST:
        source = "ddl_implementation" if implementation else "DDL_IMPLEMENTATION"
        raise ValueError(f"{source}={name!r} must be one of {tuple(FAST)} (see ddl.ops).")
    return name


def kernel(op, implementation, device):
    """ddl_kernels' `op` for `device` where `implementation` allows it and it is installed, else None."""
    if device.type not in FAST[implementation] or torch.compiler.is_compiling():
        return None
    global _installed
    if _installed is None:
        _installed = _find_kernels()
    return _installed.get(op, {}).get(device.type)


def _find_kernels():
    try:
        import ddl_kernels
    except ImportError:
        logger.info("DDL: the ddl_kernels package (C++ for CPU, Triton for CUDA) is not installed, so DDL runs its "
                    "specifications in PyTorch (the same numbers, slower); it comes with the ddl repository.")
        return {}
    if (version := getattr(ddl_kernels, "INTERFACE_VERSION", None)) != INTERFACE_VERSION:
        logger.warning(f"DDL: the installed ddl_kernels has interface version {version}, this model's code expects "
                       f"{INTERFACE_VERSION}, so DDL runs its specifications in PyTorch (the same numbers, slower); "
                       "install the ddl_kernels of the ddl version that saved this checkpoint.")
        return {}
    return ddl_kernels.implementations()


def _fast(op, implementation, *args, **kwargs):
    """ddl_kernels' `op` of `args` (on the first's device) where it is allowed, installed and serves them, else None."""
    return None if (run := kernel(op, implementation, args[0].device)) is None else run(*args, **kwargs)


def delta_residual(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, *, v_scale, k_eps, mode,
                   gate_hidden=None, v_constant=None, readout=None, norm=None, u_read=None, implementation="auto"):
    r"""One sublayer's residual seam (`reference.delta_residual`). With `readout`, the next compressor's weight
    `(K, d, d_v)`: (X_next, y), y its readout of X_next (no history) if a kernel made it in the same pass, else None;
    with `norm` too, the next sublayer's RMSNorm `(gain, eps)`: (X_next, y, its RMSNorm or None); with `norm` alone
    (d_v = 1), (X_next, None, its RMSNorm or None). `u_read`: the one-tap weight that read u out of x (kept, not u)."""
    fast = gate_hidden is None and v_constant is None and mode != "additive"  # (what the kernels implement)
    args = (x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, mode, readout)
    if fast and norm and (out := _fast("delta_residual_readout_norm", implementation, *args, *norm, u_read=u_read)):
        return out
    op = "delta_residual" if readout is None else "delta_residual_readout"
    out = _fast(op, implementation, *args, u_read=u_read) if fast else None
    out = reference.delta_residual(*args[:-1], gate_hidden, v_constant) if out is None else out
    out = out if isinstance(out, tuple) or readout is None and norm is None else (out, None)
    return out if norm is None else (*out, None)


def token_readout(x, weight, history=None, implementation="auto", norm=None):
    r"""A compressor's readout `(B, T, d)` (`reference.causal_token_readout`; CC: one tap) of the state x
    `(B, T, d_v, d)` by weight `(K, d, d_v)`, after history `(B, K-1, d_v, d)` or None (zeros); with the next
    LlamaRMSNorm's `norm` (gain, eps) and no history, (y, its norm) where a kernel makes both in one pass, else None."""
    return _convolve("token_readout", reference.causal_token_readout, x, weight, history, implementation) if (
        norm is None) else _fast("token_readout_norm", implementation, x, weight.transpose(1, 2), *norm)


def token_conv(x, weight, history=None, implementation="auto"):
    r"""EC (`reference.causal_token_conv`): the state `(B, T, d_v, d)` of embeddings x `(B, T, d)` by weight
    `(K, d, d_v)`, after history `(B, K-1, d)` or None (zeros)."""
    return _convolve("token_conv", reference.causal_token_conv, x, weight, history, implementation)


def _convolve(op, specification, x, weight, history, implementation):
    run = kernel(op, implementation, x.device)
    if run is not None:  # (kernels take the window whole, taps in the state's layout (K, d_v, d): a view, not a copy)
        out = run(x if history is None else torch.cat([history, x], dim=1), weight.transpose(1, 2))
        if out is not None:
            return out if history is None else out[:, weight.shape[0] - 1 :]
    return specification(x, weight, history)


def folded_conv_read(conv_weight, read, implementation="auto"):
    r"""CC's readout matrix `(d, d_v)` of its conv `(d, K)` and read `(d_v,)` (`reference.folded_conv_read`)."""
    out = _fast("folded_conv_read", implementation, conv_weight, read)
    return reference.folded_conv_read(conv_weight, read) if out is None else out


def window_step(past, x, weight, implementation="auto", norm=None):
    r"""A TC decoding step's readout `(B, 1, d)` of its state x `(B, 1, d_v, d)` after the K-1 states before it,
    `past` `(B, d_v*d, K-1)` as the cache keeps them (channel j*d + i, time last; no autograd), then advanced in place;
    with `norm`, as `token_readout`'s: (y, its norm) where a kernel makes both (and advances), else None (and not)."""
    out = _fast("window_step_norm" if norm else "window_step", implementation, past, x, weight, *(norm or ()))
    if out is None and norm is None:
        steps = past.transpose(1, 2).unflatten(-1, (weight.shape[2], weight.shape[1]))  # (B, K-1, d_v, d)
        out = reference.causal_token_readout(x, weight, steps.to(x.dtype))
        _advance(past, x)
    return out


def conv_step(past, x, weight, implementation="auto"):
    r"""EC `(B, 1, d_v, d)` of a decoding step's embedding x `(B, 1, d)` after the K-1 embeddings before it, `past`
    `(B, d, K-1)` as the cache keeps them (time last; no autograd), then advanced in place."""
    out = _fast("conv_step", implementation, past, x, weight)
    if out is None:
        out = reference.causal_token_conv(x, weight, past.transpose(1, 2).to(x.dtype))
        _advance(past, x)
    return out


def _advance(past, x):
    """The cached window `(B, C, K-1)` moved on by one token x: the oldest input dropped, x appended."""
    past.copy_(torch.cat([past[..., 1:], x.reshape(x.shape[0], -1, 1).to(past.dtype)], dim=-1))


__all__ = ["FAST", "INTERFACE_VERSION", "choose", "conv_step", "delta_residual", "folded_conv_read", "kernel",
           "token_conv", "token_readout", "window_step"]
