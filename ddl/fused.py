r"""The PyTorch paths of DDL's operations: the specifications' numbers (`ddl.reference`) as custom autograd functions
that keep less for backward and write their gradients in place, on any device, where no faster implementation serves.
`fused_delta_update` keeps X, h, v, beta and a few numbers per token and recomputes k, k^T X and the coefficient in
backward; `readout` (TC; CC with one tap) sums in place along contiguous d (one CC token: a product and a sum);
`delta_gate` keeps a bf16/fp16 c as it is, not its fp32 copy.
"""

import torch
import torch.nn.functional as F

from .reference import DELTA_MODES, causal_token_conv
from .reference import delta_gate as reference_gate


def refuse_second_derivative(operation):
    """First in each backward (here, in ddl_kernels) made of tensors that carry no graph, such as a forward's results
    under no autograd or a kernel's: under create_graph=True autograd took them for constants, silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"DDL: a second derivative (create_graph=True) through {operation} is not supported; set "
                           "model.config.ddl_implementation = 'reference' (and ddl_rebuild_states = False), whose "
                           "operations autograd differentiates twice.")


class _Fp32Linear(torch.autograd.Function):
    """F.linear(x.float(), weight.float(), bias.float()), keeping x in its own dtype for backward: autograd would keep
    the fp32 copy, in a bf16 model twice the activation's bytes per sublayer. The same numbers."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        weight32 = weight.float()  # (kept: a weight's bytes, not an activation's; no second cast in backward)
        needs_x, needs_weight = ctx.needs_input_grad[:2]  # (a frozen weight, as under LoRA, needs no x)
        ctx.save_for_backward(x if needs_weight else None, weight32 if needs_x else None)
        ctx.dtypes = x.dtype, weight.dtype, None if bias is None else bias.dtype
        return F.linear(x.float(), weight32, None if bias is None else bias.float())

    @staticmethod
    def backward(ctx, grad):
        refuse_second_derivative("the fp32 gate of a bf16/fp16 model")
        x, weight32 = ctx.saved_tensors
        grad = grad.float()  # (under autocast the product came in bf16)
        rows, (x_dtype, weight_dtype, bias_dtype) = grad.reshape(-1, grad.shape[-1]), ctx.dtypes
        grad_x = (grad @ weight32).to(x_dtype) if ctx.needs_input_grad[0] else None
        grad_w = (rows.T @ x.float().reshape(-1, x.shape[-1])).to(weight_dtype) if ctx.needs_input_grad[1] else None
        grad_b = rows.sum(0).to(bias_dtype) if bias_dtype and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def delta_gate(c, weight, bias, hidden_weight=None, hidden_bias=None):
    """`reference.delta_gate`, whose first product, when c is bf16/fp16 and gradients are kept, is `_Fp32Linear`;
    traced by torch.compile without autograd (decoding), a single gate's product is `_traced_product`."""
    if hidden_weight is None and torch.compiler.is_compiling() and not torch.is_grad_enabled():
        return 2.0 * torch.sigmoid(_traced_product(c.float(), weight.float().unsqueeze(0), bias.float()))
    if c.dtype in (torch.float32, torch.float64) or not torch.is_grad_enabled():
        return reference_gate(c, weight, bias, hidden_weight, hidden_bias)
    if hidden_weight is None:
        return 2.0 * torch.sigmoid(_Fp32Linear.apply(c, weight.unsqueeze(0), bias))
    hidden = torch.tanh(_Fp32Linear.apply(c, hidden_weight, hidden_bias))
    return 2.0 * torch.sigmoid(F.linear(hidden, weight.float().unsqueeze(0), bias.float()))


def delta_value(u, weight, bias, scale=4.0):
    """`reference.delta_value`; traced by torch.compile without autograd (decoding), its product as a sum."""
    traced = torch.compiler.is_compiling() and not torch.is_grad_enabled()  # (training: measured nowhere)
    v = _traced_product(u, weight, bias) if traced else F.linear(u, weight, bias)
    return v if scale is None else scale * torch.sigmoid(v)


def _traced_product(x, weight, bias):
    """F.linear(x, weight, bias) to the few outputs of a gate or value `(..., N)`, as products summed over d: Inductor
    fuses that into the seam's kernel, where F.linear stays a library call (two per sublayer of a decoding step)."""
    return (x.unsqueeze(-2) * weight).sum(-1) + bias


def _dot_h(h, state, scalar_state):
    """h^T X over the features, `(B, T, d_v)` (the state is `(B, T, d)` or `(B, T, d_v, d)`); in h's dtype (fp32)."""
    if scalar_state:
        return (h * state).sum(-1, keepdim=True)  # linalg.vecdot adds a copy on CPU
    # as a row vector times X^T: on CPU, X @ h runs as a batched matrix-vector product, several times slower
    return (h.unsqueeze(-2) @ state.to(h.dtype).transpose(-1, -2)).squeeze(-2)


def _combine(state, coef, scalar_state, out=None, alpha=1.0):
    """sum_j X[..., j] c[j], `(B, T, d)`; with `out`, out += alpha * sum_j X[..., j] c[j] in one pass, no temporary."""
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
    """X_next, the per-token scalars (s, t, beta, h^T X) that the backward needs, in few fused operations, and the
    write's coefficients c, X_next = X + h (x) c (None for bf16/fp16 states, written along k)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    scalar_state = x.dim() == h.dim()
    h_acc = h.to(acc)  # bf16/fp16 are read out in fp32
    norm = torch.linalg.vector_norm(h_acc, dim=-1, keepdim=True)  # one fused reduction, no temporary
    inv_norm = norm.square_().add_(k_eps**2).rsqrt_()  # s = 1/sqrt(|h|^2 + eps^2): (B, T, 1), in place
    target = v.to(acc)
    h_dot_x = _dot_h(h_acc, x, scalar_state) if erase else None  # h^T X: (B, T, d_v)
    if erase:
        target = torch.addcmul(target, inv_norm, h_dot_x, value=-1.0)  # v - k^T X
    a, c = _rank1_write(h, h_acc, inv_norm, target, beta, x.dtype)
    return torch.addcmul(x, *_rank1(a, c, scalar_state)), (inv_norm, target, beta, h_dot_x), c if a is h else None


def _rank1_write(h, h_acc, inv_norm, target, beta, dtype):
    r"""The update's rank-1 write as the factors (a, c) that the forward adds, X_next = X + a (x) c:

        fp32/fp64 states:  a = h,            c = beta s t     (1/|h| folded into the per-token scale)
        bf16/fp16 states:  a = k = s h,      c = beta t       (fp16 would overflow on s = 1/|h| for tiny h; |k| < 1)

    with s = 1/sqrt(|h|^2 + eps^2) and t = v - k^T X (write-only: t = v); h_acc is h in target's dtype."""
    if dtype == target.dtype:
        return h, (beta * inv_norm) * target
    return (h_acc * inv_norm).to(dtype), (beta * target).to(dtype)


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
        out, saved, ctx.write = _delta_forward(x, h, v, beta, k_eps, erase)  # (the write: see `ddl.kernels`)
        ctx.save_for_backward(x, h, *saved)
        ctx.erase, ctx.scalar_state, ctx.v_dtype = erase, x.dim() == h.dim(), v.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        refuse_second_derivative("the PyTorch delta update")
        with torch.autocast(grad_out.device.type, enabled=False):  # (backward may run under autocast)
            x, h, inv_norm, target, beta, h_dot_x = ctx.saved_tensors
            scalar, acc = ctx.scalar_state, target.dtype
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
    """Same contract as `reference.delta_update`; less memory in training, no autograd bookkeeping in inference."""
    if mode == "additive":
        return x + (h if x.dim() == h.dim() else h.unsqueeze(-2))
    if mode not in DELTA_MODES:
        raise ValueError(f"delta_update: unknown mode {mode!r}; expected one of {DELTA_MODES}.")
    if not torch.is_grad_enabled():
        return _delta_forward(x, h, v, beta, k_eps, mode == "delta")[0]
    return _DeltaUpdate.apply(x, h, v, beta, k_eps, mode == "delta")


def readout_forward(x, taps):
    """y[t] = sum_s sum_j taps[s, j] * x[t - (K-1) + s, j] (zero before the first token) for a state `(B, T, d_v, d)`
    and taps `(K, d_v, d)`: K * d_v multiply-adds into one fp32 buffer `(B, T+K-1, d)` at fixed offsets, whose first
    T rows are y (so a symbolic T, torch.export, needs no guard on T against K)."""
    kernel, seq_len = taps.shape[0], x.shape[1]
    dtype = torch.promote_types(x.dtype, taps.dtype)
    out = x.new_zeros(x.shape[0], seq_len + kernel - 1, x.shape[-1], dtype=torch.promote_types(dtype, torch.float32))
    for lag in range(kernel):
        rows = out[:, lag : lag + seq_len]
        for j in range(x.shape[2]):
            rows.addcmul_(x[:, :, j], taps[kernel - 1 - lag, j])
    return out[:, :seq_len].to(dtype)  # (a view in fp32: a contiguous copy would be one more pass over y)


def readout_backward(grad, x, taps, needs_x=True, needs_taps=True):
    """The gradients of `readout_forward` for G `(B, T, d)` (differentiable itself, for second derivatives):
        dX[t] = sum_s taps[s] * G[t + (K-1) - s],   dtaps[s, j] = sum_t X[t, j] * G[t + (K-1) - s]  (fp32)"""
    kernel, seq_len = taps.shape[0], x.shape[1]
    lags = range(min(kernel, seq_len))
    grad = grad.to(x.dtype)
    grad_x = grad_taps = None
    if needs_x:
        grad_x = torch.mul(grad.unsqueeze(-2), taps[kernel - 1].to(x.dtype))
        for lag in lags[1:]:
            grad_x[:, : seq_len - lag].addcmul_(grad[:, lag:].unsqueeze(-2), taps[kernel - 1 - lag].to(x.dtype))
    if needs_taps:
        acc = torch.zeros(taps.shape, dtype=torch.promote_types(taps.dtype, torch.float32), device=taps.device)
        chunk = -(-x.shape[0] // 8)  # at most 8 chunks of sequences: the products stay cache-sized
        for xs, gs in zip(x.split(chunk), grad.split(chunk)):
            for lag in lags:
                prod = xs[:, : seq_len - lag] * gs[:, lag:].unsqueeze(-2)
                acc[kernel - 1 - lag] += prod.sum((0, 1), dtype=acc.dtype)
        grad_taps = acc.to(taps.dtype)
    return grad_x, grad_taps


class _TokenReadout(torch.autograd.Function):
    """`readout_forward` with `readout_backward` as its backward."""

    @staticmethod
    def forward(ctx, x, taps):
        ctx.save_for_backward(x, taps)
        return readout_forward(x, taps)

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(grad.device.type, enabled=False):  # (backward may run under autocast: not its matmuls)
            return readout_backward(grad, *ctx.saved_tensors, *ctx.needs_input_grad)


def as_taps(weight):
    """A readout or EC weight `(K, d, d_v)` as taps in the state's layout `(K, d_v, d)` (a small copy; none for a
    weight kept in that layout)."""
    return weight.transpose(1, 2).contiguous()


def readout(x, taps):
    """`reference.causal_token_readout` of a state `(B, T, d_v, d)` by taps `(K, d_v, d)`, zeros before the first
    token (as `ddl.kernels` calls its implementations): `readout_forward`, with `readout_backward` under autograd; a
    CC decoding step's one token as one product and one sum (its loop's steps cost more than their arithmetic; not in a
    trace, where T may be symbolic)."""
    if torch.is_grad_enabled():
        return _TokenReadout.apply(x, taps)
    if taps.shape[0] == 1 and x.shape[1] == 1 and not torch.compiler.is_compiling():
        dtype = torch.promote_types(x.dtype, taps.dtype)
        return (x.to(torch.promote_types(dtype, torch.float32)) * taps[0]).sum(-2).to(dtype)
    return readout_forward(x, taps)


def conv(x, taps):
    """`reference.causal_token_conv` of x `(B, T, d)` by taps `(K, d_v, d)`: the specification itself, in place into
    one state-sized tensor (its backward through autograd makes two state-sized products per tap)."""
    return causal_token_conv(x, taps.transpose(1, 2))


def window_step(past, x, weight):
    """`kernels.window_step` in PyTorch: the window (the cached inputs, then x) read where the cache keeps it, not
    copied back into the state's layout, summed in fp32 like the readout of a whole sequence; then advanced in place."""
    window = torch.cat([past, x.reshape(x.shape[0], -1, 1).to(past.dtype)], dim=-1)  # (B, d_v*d, K)
    _, d, dv = weight.shape
    dtype = torch.promote_types(window.dtype, weight.dtype)
    acc = torch.promote_types(dtype, torch.float32)
    products = window.unflatten(1, (dv, d)).to(acc) * weight.permute(2, 1, 0).to(acc)  # (B, d_v, d, K)
    past.copy_(window[..., 1:])
    return products.sum(-1).sum(1).to(dtype).unsqueeze(1)  # two reductions: faster than one over (1, 3)


def conv_step(past, x, weight):
    """`kernels.conv_step` in PyTorch: the specification on the window (the cached inputs, then x), so that token by
    token it gives what `conv` gives for the whole sequence, bit for bit in every dtype; then the window advanced."""
    out = causal_token_conv(x, weight, past.transpose(1, 2))
    past.copy_(torch.cat([past, x.reshape(x.shape[0], -1, 1).to(past.dtype)], dim=-1)[..., 1:])
    return out


__all__ = ["as_taps", "conv", "conv_step", "delta_gate", "delta_value", "fused_delta_update", "readout",
           "readout_backward", "readout_forward", "window_step"]
