r"""One sublayer's residual seam in C++ (residual.cpp): the gate, the value and the delta update, forward and
backward, in one pass over each token's rows.

Serves `reference.delta_residual` (a single linear gate and a learned value, as the dispatcher asks), delta or
write-only, for CPU tensors all in fp32 or all in fp64, eager (no autocast, not traced). Per token (rows of length d;
the state X has d_v rows), the specification's numbers:
    beta = 2 sigmoid(w . c + b),   v_j = s_v sigmoid(W_v[j] . u + b_v[j])  (or W_v[j] . u + b_v[j] when s_v = None)
    s = 1 / sqrt(|h|^2 + eps^2),   t_j = v_j - s h . X_j  (write-only: t_j = v_j)
    X_next_j = X_j + h (beta s t_j)
and its gradients (the update's, followed by the gate's and the value's):
    b_j = h . G_j,   c_j = s b_j,   dv_j = beta c_j,   dbeta = sum_j c_j t_j
    dX_j = G_j - h (beta s c_j),   dh = sum_j G_j (s beta t_j) - X_j (s beta c_j) - h s^3 beta (sum_j b_j t_j - hX_j c_j)
    dz = dbeta beta (1 - beta/2),  dy_j = dv_j v_j (1 - v_j / s_v)  (dv_j without the sigmoid)
    dc = dz w (+ sum_j dy_j W_v[j] when u is c),  du = sum_j dy_j W_v[j]  (into dX when u is the d_v = 1 state)
    dw = sum over tokens of dz c,  db = sum dz,  dW_v[j] = sum dy_j u,  db_v[j] = sum dy_j
With the next compressor's weight W_r `(K, d, d_v)` (the `readout` argument; CC: one tap, TC: K taps over the
tokens of each sequence, zeros before its first), also that readout of X_next, y_t = sum_s sum_j W_r[s, j]
X_next_{t-(K-1)+s, j}, while the rows are in cache: its backward adds sum_s W_r[s, j] g_y[t+(K-1)-s] into each G_j and
sums dW_r[s, j] = X_next_j g_y[t+(K-1)-s] (X_next recomputed from X) in the same pass, so the readout reads no state
of its own.
Why: in eager PyTorch each operation of the seam is a pass over a `(B, T, d)` tensor (the gate and value projections
to 1-4 outputs run as matrix-vector products, far below the memory speed), and a decoding step pays a dispatch per
operation; here each token's rows are read once for the dot products and once for the writes.
"""

import torch

from .. import refuse_second_derivative
from ..build import kernels, ready
from . import value_input_kind


def serves(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, mode, readout):
    """Delta or write-only; every tensor on the CPU and in x's dtype (fp32 or fp64), eager; a readout weight
    `(K, d, d_v)` with the expanded state `(B, T, d_v, d)`. Checked on every sublayer of every decoding step, so
    written out flat."""
    dtype = x.dtype
    return (
        mode != "additive"
        and h.dtype is dtype
        and c.dtype is dtype
        and u.dtype is dtype
        and gate_weight.dtype is dtype
        and gate_bias.dtype is dtype
        and value_weight.dtype is dtype
        and value_bias.dtype is dtype
        and gate_weight.is_cpu
        and value_weight.is_cpu
        and (readout is None or (x.dim() == 4 and readout.dtype is dtype and readout.is_cpu))
        and ready(x)
    )


_NONE = torch.empty(0)  # (the kernels' "no readout")


class _Seam(torch.autograd.Function):
    """X_next, or (X_next, y) with readout taps `(K, d_v, d)`."""

    @staticmethod
    def forward(ctx, x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, erase, u_kind,
                readout):
        out, stats, y, _ = kernels().residual_forward(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias,
                                                      v_scale, k_eps, erase, True,
                                                      _NONE if readout is None else readout)
        ctx.save_for_backward(x, h, c, u, gate_weight, value_weight, stats, readout)
        ctx.v_scale, ctx.erase, ctx.u_kind = v_scale, erase, u_kind
        ctx.set_materialize_grads(False)  # (an output the loss does not reach gets no gradient, not zeros)
        return out if readout is None else (out, y)

    @staticmethod
    def backward(ctx, grad, grad_y=None):
        refuse_second_derivative("the C++ residual seam")  # (its gradients are computed outside autograd)
        x, h, c, u, gate_weight, value_weight, stats, readout = ctx.saved_tensors
        grad = torch.zeros_like(x) if grad is None else grad.contiguous()  # (only the readout was used)
        read = readout is not None and grad_y is not None
        gx, gh, gc, gu, gw, gb, gwv, gbv, gwr = kernels().residual_backward(
            grad, x, h, c, u, gate_weight, value_weight, stats, ctx.v_scale, ctx.erase, ctx.u_kind,
            grad_y.contiguous() if read else _NONE, readout if read else _NONE)
        return (gx, gh, gc, gu if ctx.u_kind == 0 else None, gw, gb, gwv, gbv, None, None, None, None,
                gwr if read else None)


def run(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, mode, readout=None, u_read=None):
    """`reference.delta_residual` through the C++ kernel (None where it does not serve), for any number of tokens,
    with autograd; with `readout` `(K, d, d_v)`, (X_next, its `reference.causal_token_readout` without history).
    `u_read` (the weight u was read out of x by) is not used: this seam keeps u."""
    if not serves(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, mode, readout):
        return None
    u_kind = value_input_kind(x, h, c, u)
    x = x.contiguous()  # the stride-0 repeated embeddings of a d_v > 1 model without EC
    u = x if u_kind == 2 else u.contiguous()
    args = (x, h.contiguous(), c.contiguous(), u, gate_weight.contiguous(), gate_bias.contiguous(),
            value_weight.contiguous(), value_bias.contiguous(), -1.0 if v_scale is None else float(v_scale),
            float(k_eps), mode == "delta")
    read = None if readout is None else readout.transpose(1, 2).contiguous()  # (K, d_v, d): the state's layout
    if torch.is_grad_enabled():
        return _Seam.apply(*args, u_kind, read)
    out, _, y, _ = kernels().residual_forward(*args, False, _NONE if read is None else read)
    return out if read is None else (out, y)


__all__ = ["run", "serves"]
