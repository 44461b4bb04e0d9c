r"""How each DDL operation runs: one registry per operation, and the first implementation that serves the inputs.

    delta_residual   a sublayer's gate, value and update in one fused seam (spec: `reference.delta_residual`)
    delta_residual_readout   the seam, and the next compressor's readout of its new state (the two specs)
    delta_update     the update alone                                      (spec: `reference.delta_update`)
    token_readout    a CC/TC compressor or the final readout of the state  (spec: `reference.causal_token_readout`)
    window_step      a TC decoding step's readout, advancing its window    (the same spec, one token)
    token_conv       EC, the embedding convolution                         (spec: `reference.causal_token_conv`)
    conv_step        an EC decoding step, advancing its window              (the same spec, one token)

Implementations in the order tried, each saying which inputs it serves: `ddl_kernels`' (C++ for CPU, Triton for
CUDA; installed with this `INTERFACE_VERSION`), then `ddl.fused`'s PyTorch. `implementation` says which may run:
"auto" (C++ on CPU, else PyTorch), "triton" (plus Triton on CUDA; a failed compile gives way to PyTorch), "torch",
"reference" (the specifications). Every path is tested against the specification on outputs and gradients.
An update's autograd node may keep `write`, the coefficients w `(B, T, d_v)` (X's dtype) of the write it made,
X_next = X + h (x) w: `modeling_ddl.StateRebuild` takes them instead of projecting X_next - X on h (two states read).
"""

from collections import namedtuple
from functools import partial

import torch
from transformers.utils import logging

from .fused import as_taps, conv, delta_gate, delta_value, fused_delta_update, readout
from .fused import conv_step as torch_conv_step
from .fused import window_step as torch_window_step
from .reference import causal_token_conv, causal_token_readout
from .reference import delta_residual as reference_residual
from .reference import delta_update as reference_update


# under transformers' logger, so that its verbosity governs these lines also as remote code (transformers_modules.*)
logger = logging.get_logger("transformers.ddl")

INTERFACE_VERSION = 2  # the operations' arguments and results, as ddl_kernels implements them
Implementation = namedtuple("Implementation", "name choices serves run")  # (ddl_kernels declares the same fields)
_PYTORCH = ("auto", "triton", "torch")
_any = lambda *args: True  # noqa: E731
_TORCH = {  # what serves every input of an operation, last in its registry
    "delta_residual": [],  # (no fused seam in PyTorch: the gate and value, then `delta_update`)
    "delta_residual_readout": [],  # (in PyTorch: `delta_residual` only; the compressor reads the state)
    "delta_update": [Implementation("PyTorch delta update", _PYTORCH, _any, fused_delta_update)],
    "token_readout": [Implementation("PyTorch readout", _PYTORCH, _any, readout)],
    "window_step": [Implementation("PyTorch window step", _PYTORCH, _any, torch_window_step)],
    "token_conv": [Implementation("PyTorch EC", _PYTORCH, _any, conv)],
    "conv_step": [Implementation("PyTorch EC step", _PYTORCH, _any, torch_conv_step)],
}
_registries = None


def registries():
    """{operation: [Implementation, ...]}: ddl_kernels' (installed, this interface) first; made once per process."""
    global _registries
    if _registries is None:
        found = _accelerators()
        _registries = {op: [*found.get(op, []), *own] for op, own in _TORCH.items()}
    return _registries


def _accelerators():
    try:
        import ddl_kernels
    except ImportError:
        logger.info("DDL: the ddl_kernels package (C++ for CPU, Triton for CUDA) is not installed, so DDL runs its "
                    "PyTorch paths (the same numbers, slower); it comes with the ddl repository (pip install -e .).")
        return {}
    if (version := getattr(ddl_kernels, "INTERFACE_VERSION", None)) != INTERFACE_VERSION:
        logger.warning(f"DDL: the installed ddl_kernels has interface version {version}, this model's code expects "
                       f"{INTERFACE_VERSION}, so DDL runs its PyTorch paths (the same numbers, slower); install the "
                       "ddl_kernels of the ddl version that saved this checkpoint.")
        return {}
    return ddl_kernels.implementations()


def offered(op, implementation):
    """Whether any implementation of `op` that `implementation` allows is installed (to skip preparing its inputs)."""
    return any(implementation in impl.choices for impl in registries()[op])


def _run(op, implementation, *args):
    """The result of the first implementation of `op` that `implementation` allows and that serves `args`."""
    for impl in registries()[op]:
        if implementation in impl.choices and impl.serves(*args):
            out = impl.run(*args)
            if out is not None:  # (None: it could not run after all, e.g. a Triton compile error)
                return out
    return None


# ----------------------------------------------------------------------------------------------- the residual seam


def delta_residual(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, *, v_scale, k_eps, mode,
                   gate_hidden=None, v_constant=None, implementation="auto"):
    r"""One sublayer's residual seam, X_next = delta_update(X, h, v(u), beta(c)) (`reference.delta_residual`): a fused
    seam where one serves (ddl_kernels' C++ on CPU, Triton on CUDA), else gate and value in PyTorch, `delta_update`."""
    args = (x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, mode, gate_hidden,
            v_constant)
    if implementation == "reference":
        return reference_residual(*args)
    out = _run("delta_residual", implementation, *args)
    if out is None:  # the gate's and the value's PyTorch paths, then this module's `delta_update`
        out = reference_residual(*args, update=partial(delta_update, implementation=implementation), gate=delta_gate,
                                 value=delta_value)
    return out


def delta_residual_readout(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, readout_weight, *, v_scale,
                           k_eps, mode, gate_hidden=None, v_constant=None, implementation="auto"):
    r"""(X_next, y): `delta_residual`, and the `token_readout` y of X_next (no history) by `readout_weight`
    `(K, d, d_v)` (the next compressor's) made in the same pass over the state where one serves (ddl_kernels' C++ on
    CPU); else y is None (the compressor reads X_next itself)."""
    args = (x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, mode, gate_hidden,
            v_constant)
    out = None if implementation == "reference" else _run("delta_residual_readout", implementation, *args,
                                                          readout_weight)
    return out or (delta_residual(*args[:8], v_scale=v_scale, k_eps=k_eps, mode=mode, gate_hidden=gate_hidden,
                                  v_constant=v_constant, implementation=implementation), None)


def delta_update(x, h, v=None, beta=None, *, mode="delta", k_eps=1e-5, implementation="auto"):
    """`reference.delta_update`: ddl_kernels' Triton under "triton" on CUDA, else `fused_delta_update`."""
    if implementation == "reference":
        return reference_update(x, h, v, beta, mode, k_eps)
    return _run("delta_update", implementation, x, h, v, beta, mode, k_eps)


# -------------------------------------------------------------------------------------- the token convolutions


def token_readout(x, weight, history=None, implementation="auto"):
    r"""A compressor's readout `(B, T, d)` (`reference.causal_token_readout`; CC: one tap) of x `(B, T, d_v, d)` by
    weight `(K, d, d_v)` after history `(B, K-1, d_v, d)` or None (zeros); implementations get it prepended."""
    if implementation == "reference":
        return causal_token_readout(x, weight, history)
    return _with_history("token_readout", implementation, x, weight, history)


def window_step(past, x, weight, implementation="auto"):
    r"""The TC readout `(B, 1, d)` of a decoding step's state x `(B, 1, d_v, d)` from the K-1 states before it, `past`
    `(B, d_v*d, K-1)` as the cache keeps them (channel j*d + i, time last; no autograd), then advanced in place."""
    if implementation == "reference":
        steps = past.transpose(1, 2).unflatten(-1, (weight.shape[2], weight.shape[1]))  # (B, K-1, d_v, d)
        out = causal_token_readout(x, weight, steps)
        past.copy_(torch.cat([past, x.reshape(x.shape[0], -1, 1)], dim=-1)[..., 1:])
        return out
    return _run("window_step", implementation, past, x, weight)


def token_conv(x, weight, history=None, implementation="auto"):
    r"""EC (`reference.causal_token_conv`): the state `(B, T, d_v, d)` from x `(B, T, d)`, weight `(K, d, d_v)`."""
    if implementation == "reference":
        return causal_token_conv(x, weight, history)
    return _with_history("token_conv", implementation, x, weight, history)


def conv_step(past, x, weight, implementation="auto"):
    r"""EC `(B, 1, d_v, d)` of a decoding step's embedding x `(B, 1, d)` from the K-1 embeddings before it, `past`
    `(B, d, K-1)` as the cache keeps them (time last; no autograd), then advanced in place."""
    if implementation == "reference":  # (the PyTorch step is the specification's operations on the window)
        return torch_conv_step(past, x, weight)
    return _run("conv_step", implementation, past, x, weight)


def _with_history(op, implementation, x, weight, history):
    x = x if history is None else torch.cat([history, x], dim=1)
    out = _run(op, implementation, x, as_taps(weight))
    return out if history is None else out[:, weight.shape[0] - 1 :]


__all__ = ["INTERFACE_VERSION", "conv_step", "delta_residual", "delta_residual_readout", "delta_update", "offered",
           "registries", "token_conv", "token_readout", "window_step"]
