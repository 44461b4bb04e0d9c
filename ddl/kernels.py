r"""The one place that chooses how each DDL operation runs: one dispatcher per operation, called once per use by the
model, holding the whole decision order.

    delta_residual   the gate, the value and the delta update of one sublayer   (spec: `reference.delta_residual`)
    token_readout    a CC/TC compressor or the final readout of the state      (spec: `reference.causal_token_readout`)
    token_conv       EC, the embedding convolution                              (spec: `reference.causal_token_conv`)

Each takes `implementation`, a runtime choice (`DDLConfig.ddl_implementation`; not saved with a checkpoint, as
transformers keeps `attn_implementation`):

    "auto"       (the default) the fastest path that has been verified on the device: on CPU (Linux, fp32/fp64, eager)
                 the C++ kernels of `ddl.cpu_kernels`, built on first use; everywhere else, CUDA included, the PyTorch
                 fast paths of `ddl.fused`.
    "triton"     "auto", plus the Triton kernels of `ddl.triton_kernels` on CUDA. Opt-in: they have been tested
                 through Triton's CPU interpreter, not yet run on a GPU (docs/gpu.md). A Triton compile or launch
                 failure falls back to PyTorch with one warning that names the kernel.
    "torch"      the PyTorch fast paths only (no compiled kernel).
    "reference"  the specifications themselves (plain autograd; slow, and the memory of every intermediate).

Every path computes the specification's numbers up to rounding; each one is tested against it on outputs and
gradients. The environment variable `DDL_IMPLEMENTATION` sets the default for configs that do not choose.
"""

import torch
from transformers.utils import logging

from .cpu_kernels import (
    cpu_conv_applies,
    cpu_readout_applies,
    cpu_residual,
    cpu_residual_applies,
    cpu_token_conv,
    cpu_token_readout,
    cpu_window_readout,
    cpu_window_readout_applies,
)
from .fused import fused_delta_update, fused_token_readout
from .reference import causal_token_conv, causal_token_readout, constant_value, delta_gate, delta_value
from .reference import delta_residual as reference_residual


logger = logging.get_logger(__name__)

# ----------------------------------------------------------------------------------------------- the residual seam


def delta_residual(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, *, v_scale, k_eps, mode,
                   gate_hidden=None, v_constant=None, implementation="auto", tape=None):
    r"""One sublayer's residual seam, X_next = delta_update(X, h, v(u), beta(c)) (`reference.delta_residual`).

    With a `rebuild.StateTape` (the model's rebuild of the states in backward; "auto" and "torch" only), X_next and
    the update's rank-1 write go on the tape, which then rebuilds X from them in backward instead of keeping it.

    Decision order:
    1. "reference": the specification.
    2. The C++ seam (`cpu_residual`: gate, value and update in one pass, forward and backward) unless "torch": CPU
       tensors all in fp32 or all in fp64, eager, a single linear gate, a learned value, the kernel built.
    3. The gate and the value in PyTorch, then the update: Triton on CUDA under "triton"; else `fused_delta_update`.
    """
    if implementation == "reference":
        return reference_residual(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, mode,
                                  gate_hidden, v_constant)
    writes, buffer = (None, None) if tape is None else ([], tape.buffer_like(x))
    if (implementation != "torch" and gate_hidden is None and v_constant is None
            and cpu_residual_applies(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias)):
        out = cpu_residual(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, mode, writes,
                           buffer)
        return out if tape is None else tape.push(out, writes[0])
    beta = delta_gate(c, gate_weight, gate_bias, *(gate_hidden or ()))
    v = constant_value(x, v_constant) if v_constant is not None else delta_value(u, value_weight, value_bias, v_scale)
    if implementation == "triton" and tape is None and _triton_serves(x):
        out = _triton("triton_delta_update", x, h, v, beta, k_eps, mode == "delta")
        if out is not None:
            return out
    out = fused_delta_update(x, h, v, beta, mode=mode, k_eps=k_eps, writes=writes, buffer=buffer)
    return out if tape is None else tape.push(out, writes[0])


# -------------------------------------------------------------------------------------- the token convolutions


def window_history(window, x):
    """The inputs before x in a cached window `(B, C, K-1+T)` (time last, as transformers' conv states are), in x's
    own layout `(B, K-1, ...)`; None stays None (the start of a sequence: zeros)."""
    if window is None:
        return None
    past = window[..., : window.shape[-1] - x.shape[1]]
    return past.transpose(1, 2).reshape(x.shape[0], past.shape[-1], *x.shape[2:])


def window_readout(window, weight):
    r"""The TC readout of one new token from its cached window `(B, d_v*d, K)` (channel j*d + i, time last), read
    where the cache keeps it instead of copied back into the state's layout: `(B, 1, d)`, summed in fp32 like the
    readout of a whole sequence,

        y[b, i] = sum_s sum_j weight[s, i, j] * window[b, j*d + i, s]
    """
    kernel, d, dv = weight.shape
    dtype = torch.promote_types(window.dtype, weight.dtype)
    acc = torch.promote_types(dtype, torch.float32)
    products = window.unflatten(1, (dv, d)).to(acc) * weight.permute(2, 1, 0).to(acc)  # (B, d_v, d, K)
    return products.sum(-1).sum(1).to(dtype).unsqueeze(1)  # two reductions: faster than one over (1, 3)


def token_readout(x, weight, window=None, *, documents=None, implementation="auto"):
    r"""A compressor's readout of the state (`reference.causal_token_readout`; CC is its one-tap case): `(B, T, d)`.

    x: the state `(B, T, d_v, d)`; weight: `(K, d, d_v)`; window: x's causal window as the cache holds it
    (`modeling_ddl.cached_window`), or None at the start of a sequence; documents: a packed batch's
    `packing.Documents` (the readout restarts at each document, whichever path runs), or None. Decision order:
    1. "reference": the specification.
    2. A decoding step (one token, no autograd) with a cached window: the C++ window readout unless "torch", else
       `window_readout`: both read the window where the cache keeps it.
    3. The C++ readout unless "torch" (CPU, fp32/fp64, eager, the kernel built).
    4. Triton on CUDA under "triton"; else `fused_token_readout`.
    """
    if documents is not None:
        history = window_history(window, x)
        return documents.convolve(lambda wide: _token_readout(wide, weight, history, implementation), x,
                                  weight.shape[0])
    if implementation != "reference" and window is not None and x.shape[1] == 1 and not torch.is_grad_enabled():
        if implementation != "torch" and cpu_window_readout_applies(window, weight):
            return cpu_window_readout(window, weight)
        return window_readout(window, weight)
    return _token_readout(x, weight, window_history(window, x), implementation)


def _token_readout(x, weight, history, implementation):
    """`token_readout` of a whole sequence after its history (None: zeros): steps 1, 3 and 4."""
    if implementation == "reference":
        return causal_token_readout(x, weight, history)
    if implementation != "torch" and cpu_readout_applies(x, weight):
        return cpu_token_readout(x, weight, history)
    if implementation == "triton" and _triton_serves(x):
        out = _triton("triton_token_readout", x, weight, history)
        if out is not None:
            return out
    return fused_token_readout(x, weight, history)


def token_conv(x, weight, window=None, *, documents=None, implementation="auto"):
    r"""EC of the embeddings (`reference.causal_token_conv`): the state `(B, T, d_v, d)`.

    x: `(B, T, d)`; weight: `(K, d, d_v)`; window, documents: as for `token_readout`. Decision order:
    1. The C++ conv (`cpu_token_conv`: the state written once, its gradient read once) unless "reference" or
       "torch" (CPU, fp32/fp64, eager, the kernel built).
    2. Triton on CUDA under "triton".
    3. The specification, which writes one state-sized tensor in place (its backward through autograd makes two
       state-sized products per tap).
    """
    history = window_history(window, x)
    if documents is not None:
        return documents.convolve(lambda wide: _token_conv(wide, weight, history, implementation), x,
                                  weight.shape[0])
    return _token_conv(x, weight, history, implementation)


def _token_conv(x, weight, history, implementation):
    if implementation not in ("torch", "reference") and cpu_conv_applies(x, weight):
        return cpu_token_conv(x, weight, history)
    if implementation == "triton" and _triton_serves(x):
        out = _triton("triton_token_conv", x, weight, history)
        if out is not None:
            return out
    return causal_token_conv(x, weight, history)


# ------------------------------------------------------------------------------------------------------- Triton


_triton_failed = set()  # kernels that failed to compile or launch in this process: PyTorch serves them from then on


def _triton_serves(x):
    """CUDA tensors that the fp32-accumulating kernels serve exactly (not fp64)."""
    return x.is_cuda and x.dtype != torch.float64


def _triton(name, *args):
    """`ddl.triton_kernels.<name>(*args)`, or None (with one warning naming the kernel) when triton is missing or
    the kernel fails to compile or launch; the caller then runs the PyTorch path."""
    if name in _triton_failed:
        return None
    try:
        # (`from .triton_kernels import ...`, so that a saved checkpoint carries the file with the others)
        from .triton_kernels import triton_delta_update, triton_token_conv, triton_token_readout

        functions = {"triton_delta_update": triton_delta_update, "triton_token_conv": triton_token_conv,
                     "triton_token_readout": triton_token_readout}
        return functions[name](*args)
    except Exception as error:  # ImportError, a compile error, a launch error: PyTorch computes the same numbers
        _triton_failed.add(name)
        logger.warning(f"DDL: the Triton kernel {name} failed ({type(error).__name__}: {str(error)[:300]}); DDL "
                       "uses the PyTorch path for it from now on.")
        return None


__all__ = [
    "delta_residual", "token_conv", "token_readout", "window_history",
    "window_readout",
]
