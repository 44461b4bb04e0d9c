"""Fast paths for `delta_update`, `causal_token_readout` and `causal_token_conv`, with their exact signatures, and
`decoding_residual` (gate, value and update of a CPU decoding step in one function), `decoding_token_readout` and
`decoding_token_conv` (one decoding step of TC and EC, read from the cache's window); the references in
modeling_ddl.py are the specs, and `ddl_impl` chooses between the two sets (`modeling_ddl._IMPLEMENTATIONS`).

On CUDA tensors (fp32, bf16, fp16) with triton installed, `fused_delta_update`, `fused_token_readout` (TC, CC) and
`fused_token_conv` (EC) run the Triton kernels of `ddl.triton_kernels` (imported lazily, never required; they
compute in fp32, so fp64 stays on the PyTorch path); elsewhere (CPU, Apple, no triton) they run the PyTorch
functions below.

`fused_delta_update` is a custom autograd function: the forward computes the same numbers as the reference, but
keeps only the inputs (X, h, v, beta) for backward and recomputes k, k^T X and the coefficient there, instead
of autograd keeping every intermediate (k, the fp32 copies, the readout, the rank-1 product). X is kept alive
anyway by the next norm or compressor, so the extra memory of a sublayer is h alone.
"""

import functools
import importlib.util
import math

import torch
from transformers.utils import logging

from .cpu_kernels import (
    cpu_readout_applies,
    cpu_readout_backward,
    cpu_readout_forward,
    cpu_window_readout,
    cpu_window_readout_applies,
    eager_cpu_float,
)


logger = logging.get_logger(__name__)


def _dot_h(h, state, scalar_state):
    """h^T X over the features, `(B, T, d_v)` (the state is `(B, T, d)` or `(B, T, d_v, d)`); in h's dtype (fp32)."""
    if scalar_state:
        return (h * state).sum(-1, keepdim=True)  # twice as fast as linalg.vecdot on CPU (which adds a copy)
    # As a row vector times X^T: 8x faster on CPU than X @ h (a batched matrix-vector product) at d=512, d_v=4.
    return (h.unsqueeze(-2) @ state.to(h.dtype).transpose(-1, -2)).squeeze(-2)


def _combine(state, coef, scalar_state, out=None, alpha=1.0):
    """sum_j X[..., j] c[j], `(B, T, d)`; with `out`, accumulated into it in place: out += alpha * sum_j X[..., j] c[j]
    (one pass, no temporary: these run on every sublayer's backward)."""
    if out is None:
        return state * coef if scalar_state else (coef.unsqueeze(-2) @ state).squeeze(-2)
    if scalar_state:
        return out.addcmul_(state, coef, value=alpha)
    out.view(-1, 1, out.shape[-1]).baddbmm_(coef.reshape(-1, 1, coef.shape[-1]), state.reshape(-1, *state.shape[-2:]),
                                             alpha=alpha)
    return out


def _rank1(h, coef, scalar_state):
    """The factors of the rank-1 write h (x) c, shaped to broadcast against the state `(B, T, d_v, d)`."""
    return (h, coef) if scalar_state else (h.unsqueeze(-2), coef.unsqueeze(-1))


def _delta_forward(x, h, v, beta, k_eps, erase):
    """X_next and the per-token scalars (s, t, beta, h^T X) that the backward needs."""
    # Few, fused operations: this also runs once per sublayer for every decoded token.
    acc = torch.promote_types(x.dtype, torch.float32)
    scalar_state = x.dim() == h.dim()
    h_acc = h.to(acc)  # bf16/fp16 are read out in fp32
    norm = torch.linalg.vector_norm(h_acc, dim=-1, keepdim=True)  # one fused reduction, no temporary
    inv_norm = norm.square_().add_(k_eps**2).rsqrt_()  # s = 1/sqrt(|h|^2 + eps^2): (B, T, 1), in place
    target = v.to(acc)
    h_dot_x = _dot_h(h_acc, x, scalar_state) if erase else None  # h^T X: (B, T, d_v)
    if erase:
        target = torch.addcmul(target, inv_norm, h_dot_x, value=-1.0)  # v - k^T X
    if x.dtype == acc:  # fold 1/|h| into the per-token scale: X_next = X + h (x) (beta s t)
        out = torch.addcmul(x, *_rank1(h, (beta * inv_norm) * target, scalar_state))
    else:  # fp16 would overflow on s = 1/|h| for tiny h: write k = s h (|k| < 1) in the model dtype instead
        k = (h_acc * inv_norm).to(x.dtype)
        out = torch.addcmul(x, *_rank1(k, (beta * target).to(x.dtype), scalar_state))
    return out, (inv_norm, target, beta, h_dot_x)


class _DeltaUpdate(torch.autograd.Function):
    """X_next = X + beta k (v - k^T X) (erase) or X + beta k v (write-only), with k = s h, s = 1/sqrt(|h|^2+eps^2).

    Written in terms of h and per-token scalars so that k is never materialised: the forward reads h and X a
    few times and writes X_next once; it keeps X, h (both (B, T, d[, d_v])) and the small s, t, beta, h^T X for
    backward, whose gradients are linear combinations of G, X and h with per-token coefficients:
        t = v - s h^T X,   b = h^T G,   c_g = s b  (= k^T G)
        dX = G - h (x) (beta s c_g),   dv = beta c_g,   dbeta = c_g . t
        dh = G (s beta t) - X (s beta c_g) - h s^3 beta (b . t - (h^T X) . c_g)
    """

    @staticmethod
    def forward(ctx, x, h, v, beta, k_eps, erase):
        out, saved = _delta_forward(x, h, v, beta, k_eps, erase)
        ctx.save_for_backward(x, h, *saved)
        ctx.erase, ctx.scalar_state, ctx.v_dtype = erase, x.dim() == h.dim(), v.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, h, inv_norm, target, beta, h_dot_x = ctx.saved_tensors
        scalar = ctx.scalar_state
        acc = target.dtype
        grad, h_acc = grad_out.to(acc), h.to(acc)
        state = x.to(acc) if ctx.erase else None  # write-only never reads the state in backward
        b = _dot_h(h_acc, grad, scalar)  # h^T G: (B, T, d_v)
        grad_coef = inv_norm * b  # k^T G
        h_dot_grad_k = (b * target).sum(-1, keepdim=True)
        if ctx.erase:
            h_dot_grad_k = h_dot_grad_k - (h_dot_x * grad_coef).sum(-1, keepdim=True)
        # dh = G (s beta t) - X (s beta c_g) - h s^3 beta (...): one new tensor, the other terms added in place
        grad_h = _combine(grad, inv_norm * beta * target, scalar)
        if ctx.erase:
            _combine(state, inv_norm * beta * grad_coef, scalar, out=grad_h, alpha=-1.0)
        grad_h.addcmul_(h_acc, -(inv_norm**3) * beta * h_dot_grad_k)
        grad_x = grad
        if ctx.erase:
            grad_x = torch.addcmul(grad, *_rank1(h_acc, -inv_norm * beta * grad_coef, scalar))
        grad_v = beta * grad_coef
        grad_beta = (grad_coef * target).sum(-1, keepdim=True)
        return grad_x.to(x.dtype), grad_h.to(h.dtype), grad_v.to(ctx.v_dtype), grad_beta.to(beta.dtype), None, None


def fused_delta_update(x, h, v=None, beta=None, mode="delta", k_eps=1e-5):
    """Same contract as `modeling_ddl.delta_update`; less memory in training."""
    if mode == "additive":
        return x + (h if x.dim() == h.dim() else h.unsqueeze(-2))
    if mode not in ("delta", "write_only"):
        raise ValueError(f"delta_update: unknown mode {mode!r}; expected 'delta', 'write_only' or 'additive'.")
    if _use_triton(x):
        from .triton_kernels import triton_delta_update

        logger.info_once("DDL: delta update through the Triton kernels.")
        return triton_delta_update(x, h, v, beta, k_eps, mode == "delta")
    if not torch.is_grad_enabled():  # inference (e.g. each decoding step): no autograd bookkeeping at all
        return _delta_forward(x, h, v, beta, k_eps, mode == "delta")[0]
    return _DeltaUpdate.apply(x, h, v, beta, k_eps, mode == "delta")


def is_cpu_decoding_step(x):
    """Whether `decoding_residual` applies: one new token per sequence (T = 1), no autograd, and `eager_cpu_float`
    (under autocast its sublayer outputs come in another dtype; a traced graph may meet batch 1, whose `.item()`
    would break it or be recorded as a constant)."""
    return x.shape[1] == 1 and not torch.is_grad_enabled() and eager_cpu_float(x)


def decoding_residual(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, erase):
    r"""Gate, value and delta update of one sublayer for a CPU decoding step, in one function. Same numbers as
    `gate -> value -> delta_update` (tested; rounded differently).

    Per token, everything but the state write is a handful of numbers: beta = 2 sigmoid(w . c + b), the d_v values
    v, s = 1/sqrt(|h|^2 + eps^2) and h^T X; the state gets one rank-1 write X + h (x) (beta s (v - s h^T X)). The
    modules' tensor operations spend several microseconds of dispatch each on tensors of a few elements (~17 per
    sublayer, where Llama's residual is one addition), which made decoding ~9% slower than Llama. Here:
    - one sequence: four dot products, the arithmetic on Python floats (double precision), one axpy;
    - a batch: the same dot products and arithmetic as ~14 tensor operations, the constants folded into the write.
    """
    if x.shape[0] == 1:
        return _one_sequence_residual(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps,
                                      erase)
    state, h_cols = (x.unsqueeze(-2), h.unsqueeze(-2)) if x.dim() == h.dim() else (x, h.unsqueeze(-2))
    gate = torch.sigmoid(torch.linalg.vecdot(c.float(), gate_weight.float()).unsqueeze(-1) + gate_bias.float())
    t, scale = torch.linalg.vecdot(u.unsqueeze(-2), value_weight) + value_bias, 1.0  # (B, 1, d_v)
    if v_scale is not None:  # t = v / scale
        t, scale = torch.sigmoid(t), v_scale
    inv_norm = torch.linalg.vecdot(h, h).unsqueeze(-1).add_(k_eps**2).rsqrt_()  # (B, 1, 1)
    if erase:  # (v - s h^T X) / scale
        t = torch.addcmul(t, inv_norm, torch.linalg.vecdot(state, h_cols), value=-1.0 / scale)
    coef = (gate * inv_norm) * t  # beta s (v - s h^T X) / (2 scale)
    if x.dim() == h.dim():
        return torch.addcmul(x, h, coef, value=2.0 * scale)
    return torch.addcmul(x, h_cols, coef.unsqueeze(-1), value=2.0 * scale)


def _sigmoid(z):
    return 0.5 * (1.0 + math.tanh(0.5 * z))  # never overflows, unlike 1 / (1 + exp(-z))


def _one_sequence_residual(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, erase):
    """`decoding_residual` for a single sequence (B = T = 1): the per-token numbers as Python floats."""
    d = x.shape[-1]
    h = h.view(d)
    beta = 2.0 * _sigmoid(torch.dot(c.view(d).float(), gate_weight.float()).item() + gate_bias.item())  # fp32 logit
    values = [z + b for z, b in zip(torch.mv(value_weight, u.view(d)).tolist(), value_bias.tolist())]
    if v_scale is not None:
        values = [v_scale * _sigmoid(z) for z in values]
    inv_norm = 1.0 / math.sqrt(torch.dot(h, h).item() + k_eps**2)
    if erase:  # t = v - k^T X
        values = [v - inv_norm * r for v, r in zip(values, torch.mv(x.view(-1, d), h).tolist())]
    coef = [beta * inv_norm * t for t in values]
    if len(coef) == 1:
        return torch.add(x, h, alpha=coef[0])
    return torch.addcmul(x, h, x.new_tensor(coef).view(-1, 1))  # (1, 1, d_v, d) + (d) x (d_v, 1)


def _readout_forward(x, taps):
    """y[t] = sum_s sum_j taps[s, j] * x[t - (K-1) + s, j] (zero before the first token), accumulated in place
    along contiguous d: K * d_v fused multiply-adds into one `(B, T, d)` tensor, no state-sized temporary (on CPU
    in fp32/fp64, the C++ kernel's single pass)."""
    if cpu_readout_applies(x, taps):
        return cpu_readout_forward(x, taps)
    kernel, seq_len = taps.shape[0], x.shape[1]
    dtype = torch.promote_types(x.dtype, taps.dtype)
    out = x.new_zeros(x.shape[0], seq_len, x.shape[-1], dtype=torch.promote_types(dtype, torch.float32))
    for lag in range(min(kernel, seq_len)):  # fp32 accumulation (a (B, T, d) buffer): bf16 would round K*d_v times
        rows = out[:, lag:]
        for j in range(x.shape[2]):
            rows.addcmul_(x[:, : seq_len - lag, j], taps[kernel - 1 - lag, j])
    return out.to(dtype)


class _TokenReadout(torch.autograd.Function):
    """The TC/CC readout with a hand-written backward (autograd would zero-fill and copy a state-sized gradient
    for every lag's slice). With G the gradient of y:
        dX[t] = sum_s taps[s] * G[t + (K-1) - s]          (in place into one state-sized tensor)
        dtaps[s, j] = sum over tokens of X[t, j] * G[t + (K-1) - s]   (fp32, one sequence chunk at a time)
    """

    @staticmethod
    def forward(ctx, x, taps):
        ctx.save_for_backward(x, taps)
        return _readout_forward(x, taps)

    @staticmethod
    def backward(ctx, grad):
        x, taps = ctx.saved_tensors
        # (the C++ gradients carry no graph: a double backward, create_graph=True, takes the PyTorch path below)
        if cpu_readout_applies(x, taps) and grad.dtype is x.dtype and not torch.is_grad_enabled():
            return cpu_readout_backward(grad, x, taps)
        kernel, seq_len = taps.shape[0], x.shape[1]
        lags = range(min(kernel, seq_len))
        grad = grad.to(x.dtype)
        grad_x = grad_taps = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mul(grad.unsqueeze(-2), taps[kernel - 1].to(x.dtype))
            for lag in lags[1:]:
                grad_x[:, : seq_len - lag].addcmul_(grad[:, lag:].unsqueeze(-2), taps[kernel - 1 - lag].to(x.dtype))
        if ctx.needs_input_grad[1]:
            acc = torch.zeros(taps.shape, dtype=torch.promote_types(taps.dtype, torch.float32), device=taps.device)
            chunk = -(-x.shape[0] // 8)  # at most 8 chunks of sequences: the products stay cache-sized
            for xs, gs in zip(x.split(chunk), grad.split(chunk)):
                for lag in lags:
                    prod = xs[:, : seq_len - lag] * gs[:, lag:].unsqueeze(-2)
                    acc[kernel - 1 - lag] += prod.sum((0, 1), dtype=acc.dtype)
            grad_taps = acc.to(taps.dtype)
        return grad_x, grad_taps


def fused_token_readout(x, weight, history=None):
    """Same contract as `modeling_ddl.causal_token_readout`; faster, and no state-sized temporaries."""
    if _use_triton(x):
        from .triton_kernels import triton_token_readout

        return triton_token_readout(x, weight, history)
    kernel = weight.shape[0]
    taps = weight.transpose(1, 2).contiguous()  # (K, d_v, d), like the state
    if history is not None:  # the cached inputs before x: read them as the first K-1 tokens, drop their outputs
        x = torch.cat([history, x], dim=1)
    out = _readout_forward(x, taps) if not torch.is_grad_enabled() else _TokenReadout.apply(x, taps)
    return out if history is None else out[:, kernel - 1 :]


# One decoding step of the token convolutions, computed from the window where the cache holds it (time last,
# `modeling_ddl.cached_window`): on CPU no history copied into the state layout and concatenated, a product and a
# sum (profiled in a TC decoding step at bench size: 12 tensor operations per compressor where the general route
# took 27, 80 us where it took 126).
# On CUDA the window goes back to the state layout for the Triton kernels: one launch instead of several.


def decoding_token_readout(window, weight):
    r"""The TC readout of one new token, from its window: `(B, d_v*d, K)`, channel j*d + i, time last; weight
    `(K, d, d_v)`. Returns `(B, 1, d)`, summed in fp32 like the prefill's readout:

        y[b, i] = sum_s sum_j weight[s, i, j] * window[b, j*d + i, s]
    """
    kernel, d, dv = weight.shape
    if _use_triton(window):  # CUDA: one Triton readout over the window, in the state's layout
        x, history = _state_layout(window, kernel, (dv, d))
        return fused_token_readout(x, weight, history)
    taps = weight.permute(2, 1, 0).contiguous()  # (d_v, d, K): the window's layout (a small copy)
    if cpu_window_readout_applies(window, taps):
        return cpu_window_readout(window, taps).unsqueeze(1)
    dtype = torch.promote_types(window.dtype, weight.dtype)
    acc = torch.promote_types(dtype, torch.float32)
    products = window.unflatten(1, (dv, d)).to(acc) * taps.to(acc)  # (B, d_v, d, K)
    return products.sum(-1).sum(1).to(dtype).unsqueeze(1)  # two reductions: faster than one over (1, 3)


def decoding_token_conv(window, weight):
    r"""EC of one new token, from its window of embeddings: `(B, d, K)`, time last; weight `(K, d, d_v)`. Returns
    the state layout `(B, 1, d_v, d)`:

        y[b, j, i] = sum_s weight[s, i, j] * window[b, i, s]
    """
    kernel, d, _ = weight.shape
    if _use_triton(window):
        x, history = _state_layout(window, kernel, (d,))
        return fused_token_conv(x, weight, history)
    dtype = torch.promote_types(window.dtype, weight.dtype)
    acc = torch.promote_types(dtype, torch.float32)  # summed in fp32, like the Triton prefill
    return (window.unsqueeze(1).to(acc) * weight.permute(2, 1, 0).to(acc)).sum(-1).to(dtype).unsqueeze(1)


def _state_layout(window, kernel, features):
    """A decoding step's window `(B, C, K)` as the new input `(B, 1, *features)` and its history `(B, K-1, ...)`."""
    tokens = window.transpose(1, 2).reshape(window.shape[0], kernel, *features)
    return tokens[:, -1:], tokens[:, :-1]


def fused_token_conv(x, weight, history=None):
    """Same contract as `modeling_ddl.causal_token_conv` (EC): the Triton kernels on CUDA; elsewhere the reference
    itself, which already writes one state-sized tensor in place and leaves its backward to autograd."""
    if _use_triton(x):
        from .triton_kernels import triton_token_conv

        return triton_token_conv(x, weight, history)
    from .modeling_ddl import causal_token_conv  # at call time: modeling_ddl imports this module

    return causal_token_conv(x, weight, history)


def _use_triton(x):
    """CUDA tensors the fp32-accumulating kernels serve exactly (not fp64), with triton installed."""
    return x.is_cuda and x.dtype != torch.float64 and _triton_available()


@functools.cache
def _triton_available():
    """Looked up once, not on every update of every decoding step."""
    return importlib.util.find_spec("triton") is not None


__all__ = [
    "decoding_residual", "decoding_token_conv", "decoding_token_readout", "fused_delta_update", "fused_token_conv",
    "fused_token_readout", "is_cpu_decoding_step",
]
