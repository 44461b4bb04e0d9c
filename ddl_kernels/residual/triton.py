r"""The residual seam in Triton for CUDA. `_seam_*` make the gate, the value and the delta update in one kernel each
way (`reference.delta_residual`): the forward one program per token, the backward one per run of consecutive tokens.
Each program loads h (d), the state X (d_v x d, stored column after column) and the inputs of beta and v, and writes
X_next; the backward recomputes k, k^T X, beta, v and the coefficient from the same inputs, so nothing else is
stored (but v, d_v floats a token, where u is read out of X again: `run`'s `u_read`). The same kernels serve d_v = 1 and every d_v > 1. Given the next compressor's one-tap weight (CC), the forward
also writes that compressor's readout of X_next, the next sublayer's input, and the backward takes its gradient
(`run`): the seam returns the state and the next input, as the C++ seam does. Given the next sublayer's RMSNorm too
(its gain; `delta_residual_readout_norm`), the forward also writes that norm of the readout, the input the sublayer
itself reads, in LlamaRMSNorm's roundings; in backward the norm's kernel (`readout.triton._norm_gradients`) reads the
readout out of X_next again (which the next seam keeps), turns the normed output's gradient into the readout's (added
to the readout's own) and sums the gain's, before the seam's backward takes it: the norm's launches each way, and
autograd's addition of the readout's two gradients, become those two (as fla's and mamba's fused add-norm return the
normed input beside the residual).

Per token, with the gate and value of `reference.delta_residual` (all in fp32, whatever the storage dtype):
    beta = 2 sigmoid(w . c + b),   v_j = s_v sigmoid(W_v[j] . u + b_v[j])  (or W_v[j] . u + b_v[j] when s_v = None)
    k = h s, s = 1 / sqrt(|h|^2 + eps^2),   t_j = v_j - k . X_j  (write-only: t_j = v_j),   X_next_j = X_j + k beta t_j
and backward, from G = dL/dX_next: g_j = k . G_j, dv_j = beta g_j, dbeta = sum_j g_j t_j, dX_j = G_j - k beta g_j
(write-only: G_j), dk = sum_j G_j beta t_j - X_j beta g_j, dh = s (dk - k (k . dk)); through the gate and the value
dz = dbeta beta (1 - beta / 2), dy_j = dv_j v_j (1 - v_j / s_v) (or dv_j), dc = dz w, du = sum_j dy_j W_v[j] (added to
dc when u is c, to dX when u is the d_v = 1 state). The weights' gradients are sums over tokens of dz and dy_j times c
and u: each backward program sums its tokens' into one row of partial sums (a second pass over its tokens), and a
second kernel adds the rows in the weights' dtype (`readout.triton.sum_parts`). Why: a launch is what an eager GPU
step waits for (scripts/launch_count.py): in PyTorch the gate and value are 9 more launches forward and 5 more
backward per sublayer in bf16, and the weights' gradients as products and casts after the kernel were 9 more; the
seam is 1 launch forward and 2 backward.

Serves `reference.delta_residual` (a single linear gate, a learned value; delta or write-only) for CUDA tensors
other than fp64, outside traces (`ddl_kernels.eager`).
The seam computes v from u in fp32 where the specification, in a bf16 model, rounds W_v u to bf16 first (so a bf16
seam is closer to the fp64 numbers). Opt-in (`ddl_implementation="triton"`; docs/gpu.md says why); tested on CPU
through Triton's interpreter (`TRITON_INTERPRET=1`, tests/test_kernels.py).
"""

import torch
import triton
import triton.language as tl

from .. import eager, fallible, refuse_second_derivative, serving
from ..readout.triton import _norm_gradients, _runs, _store_rms_norm, row_tile, sum_parts
from . import value_input_kind


@triton.jit
def _token_state(x_ptr, h_ptr, token, d, dv, k_eps_sq, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr):
    """One token's X tile (fp32; the state is (d_v, d) per token), k, s = 1/|h|_eps and h."""
    rows = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_V)
    row_ok = rows < d
    col_ok = cols < dv
    tile = cols[None, :] * d + rows[:, None]
    tile_ok = row_ok[:, None] & col_ok[None, :]
    h = tl.load(h_ptr + token * d + rows, mask=row_ok, other=0.0).to(tl.float32)
    inv_norm = tl.rsqrt(tl.sum(h * h, axis=0) + k_eps_sq)
    x = tl.load(x_ptr + token * d * dv + tile, mask=tile_ok, other=0.0).to(tl.float32)
    return rows, row_ok, cols, col_ok, tile, tile_ok, x, h * inv_norm, inv_norm, h

@triton.jit
def _target(v, k, x, ERASE: tl.constexpr):
    """t = v - k^T X (delta), or v (write-only): `(BLOCK_V,)`."""
    if ERASE:
        v = v - tl.sum(k[:, None] * x, axis=0)
    return v

@triton.jit
def _update_grads(x, k, inv_norm, target, beta, g, ERASE: tl.constexpr):
    """The update's gradients from G = dL/dX_next: k^T G `(BLOCK_V,)`, dX (the state's tile) and dh `(BLOCK_D,)`."""
    grad_coef = tl.sum(k[:, None] * g, axis=0)  # k^T G
    grad_k = tl.sum(g * (beta * target)[None, :], axis=1)
    gx = g
    if ERASE:
        grad_k = grad_k - tl.sum(x * (beta * grad_coef)[None, :], axis=1)
        gx = g - k[:, None] * (beta * grad_coef)[None, :]
    return grad_coef, gx, inv_norm * (grad_k - k * tl.sum(k * grad_k, axis=0))

@triton.jit
def _weights(w_ptr, wv_ptr, rows, row_ok, tile, tile_ok):
    """The gate's w `(BLOCK_D,)` and W_v's tile `(BLOCK_D, BLOCK_V)` (fp32; W_v (d_v, d) is in the state's layout)."""
    w = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    return w, tl.load(wv_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)

@triton.jit
def _read_out(x, taps_ptr, rows, cols, tile_ok, tap_stride_d, tap_stride_v, dtype):
    """A one-tap readout of a token's state tile x (fp32), y[i] = sum_j taps[i, j] x[j, i] (fp32 sums, as the seam's
    and the readout's forward make it), rounded to `dtype`; taps `(d, d_v)` read at their strides."""
    taps = tl.load(taps_ptr + rows[:, None] * tap_stride_d + cols[None, :] * tap_stride_v, mask=tile_ok,
                   other=0.0).to(tl.float32)
    return tl.sum(x * taps, axis=1).to(dtype).to(tl.float32)

@triton.jit
def _gate_and_value(
    c_ptr, u_ptr, b_ptr, bv_ptr, v_ptr, w, wv, token, d, dv, v_scale, rows, row_ok, cols, col_ok,
    U_IS_C: tl.constexpr, V_KEPT: tl.constexpr, SIGMOID: tl.constexpr,
):
    """c (fp32) and this token's beta = 2 sigmoid(w . c + b) and v `(BLOCK_V,)` (0 past d_v): from u (U_IS_C c, else
    loaded), or V_KEPT as the forward kept it at v_ptr `(N, d_v)` (fp32)."""
    c = tl.load(c_ptr + token * d + rows, mask=row_ok, other=0.0).to(tl.float32)
    beta = 2.0 * tl.sigmoid(tl.sum(w * c, axis=0) + tl.load(b_ptr).to(tl.float32))
    if V_KEPT:
        v = tl.load(v_ptr + token * dv + cols, mask=col_ok, other=0.0)
    else:
        if U_IS_C:
            u = c
        else:
            u = tl.load(u_ptr + token * d + rows, mask=row_ok, other=0.0).to(tl.float32)
        v = tl.sum(wv * u[:, None], axis=0) + tl.load(bv_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if SIGMOID:
            v = v_scale * tl.sigmoid(v)
        v = tl.where(col_ok, v, 0.0)
    return c, beta, v

@triton.jit
def _seam_fwd_kernel(
    x_ptr, h_ptr, c_ptr, u_ptr, w_ptr, b_ptr, wv_ptr, bv_ptr, taps_ptr, out_ptr, y_ptr, gain_ptr, normed_ptr, v_ptr, d,
    dv, k_eps_sq, v_scale, norm_eps, tap_stride_d, tap_stride_v,
    ERASE: tl.constexpr, U_IS_C: tl.constexpr, SIGMOID: tl.constexpr, READ: tl.constexpr, NORM: tl.constexpr,
    KEEP_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """X_next = X + h (x) w with w = s beta t `(d_v,)`; READ: also the next compressor's readout of X_next as stored,
    y[i] = sum_j taps[i, j] X_next[j, i] (fp32 sums), taps `(d, d_v)` read at their strides; NORM: also the next
    sublayer's RMSNorm of y as stored, gain * (y / sqrt(mean(y^2) + eps)) (LlamaRMSNorm's roundings), or without READ
    (d_v = 1) of X_next as stored."""
    token = tl.program_id(0).to(tl.int64)
    rows, row_ok, cols, col_ok, tile, tile_ok, x, k, inv_norm, h = _token_state(
        x_ptr, h_ptr, token, d, dv, k_eps_sq, BLOCK_D, BLOCK_V
    )
    w, wv = _weights(w_ptr, wv_ptr, rows, row_ok, tile, tile_ok)
    c, beta, v = _gate_and_value(
        c_ptr, u_ptr, b_ptr, bv_ptr, v_ptr, w, wv, token, d, dv, v_scale, rows, row_ok, cols, col_ok, U_IS_C, False,
        SIGMOID,
    )
    if KEEP_V:  # (for the backward, which then needs no u: d_v floats a token where u is d)
        tl.store(v_ptr + token * dv + cols, v, mask=col_ok)
    target = _target(v, k, x, ERASE)
    write = inv_norm * beta * target
    out = (x + h[:, None] * write[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * d * dv + tile, out, mask=tile_ok)
    if READ:
        taps = tl.load(taps_ptr + rows[:, None] * tap_stride_d + cols[None, :] * tap_stride_v, mask=tile_ok,
                       other=0.0).to(tl.float32)
        y = tl.sum(out.to(tl.float32) * taps, axis=1).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + token * d + rows, y, mask=row_ok)
        if NORM:
            _store_rms_norm(y, gain_ptr, normed_ptr + token * d, rows, d, norm_eps)
    elif NORM:  # (d_v = 1: the next input is X_next itself, the one column of its tile)
        y = tl.sum(out.to(tl.float32), axis=1).to(out_ptr.dtype.element_ty)
        _store_rms_norm(y, gain_ptr, normed_ptr + token * d, rows, d, norm_eps)

@triton.jit(do_not_specialize=["tokens", "per_program"])  # (the probe's one token must not compile its own variant)
def _seam_bwd_kernel(
    x_ptr, h_ptr, c_ptr, u_ptr, w_ptr, b_ptr, wv_ptr, bv_ptr, taps_ptr, grad_ptr, grad_read_ptr, gx_ptr, gh_ptr,
    gc_ptr, gu_ptr, gz_ptr, gy_ptr, write_ptr, part_ptr, v_ptr, tokens, per_program, d, dv, k_eps_sq, v_scale,
    tap_stride_d, tap_stride_v, u_tap_stride_d, u_tap_stride_v,
    ERASE: tl.constexpr, U_KIND: tl.constexpr, SIGMOID: tl.constexpr, READ: tl.constexpr,
    WEIGHT_GRADS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """dX, dh, dc, du (U_KIND 0; 3: the same, v as the forward kept it at v_ptr and u, for the weights' sums, read out
    of X again by the one-tap weight at u_ptr, in du's dtype; 1: u is c, its gradient in dc; 2: u is the d_v = 1
    state, in dX) of `per_program` consecutive tokens, and (WEIGHT_GRADS) this program's row of the weights' partial
    gradients, sums over its tokens in fp32: [dw = sum dz c (d) | dW_v = sum u dy^T (d_v x d, W_v's layout) | db_v =
    sum dy (d_v) | db = sum dz].
    The sums are a second pass over the tokens, from the per-token dz `(N,)` and dy `(N, d_v)` the first one wrote
    (fp32) and c and u read again (one more read of each: from L2 while a program's run of tokens is still there), so
    that no running sum holds registers while the first pass's tiles do. READ (the forward also read X_next out):
    dL/dX_next adds taps * dL/dy, and the row ends with the taps' partial gradient, sum X_next dL/dy (d_v x d), X_next
    made again from X, h and the write w `(N, d_v)` the first pass kept."""
    first = tl.program_id(0).to(tl.int64) * per_program
    count = tl.minimum(per_program, tokens - first).to(tl.int32)
    x_ptr, grad_ptr, gx_ptr = x_ptr + first * d * dv, grad_ptr + first * d * dv, gx_ptr + first * d * dv
    h_ptr, c_ptr = h_ptr + first * d, c_ptr + first * d
    if U_KIND != 3:  # (3: u_ptr is the readout's weight)
        u_ptr += first * d
    gh_ptr, gc_ptr, gu_ptr = gh_ptr + first * d, gc_ptr + first * d, gu_ptr + first * d
    gz_ptr, gy_ptr, write_ptr, grad_read_ptr = gz_ptr + first, gy_ptr + first * dv, write_ptr + first * dv, (
        grad_read_ptr + first * d)
    v_ptr += first * dv
    for token in range(count):
        rows, row_ok, cols, col_ok, tile, tile_ok, x, k, inv_norm, h = _token_state(
            x_ptr, h_ptr, token, d, dv, k_eps_sq, BLOCK_D, BLOCK_V
        )
        w, wv = _weights(w_ptr, wv_ptr, rows, row_ok, tile, tile_ok)
        c, beta, v = _gate_and_value(
            c_ptr, u_ptr, b_ptr, bv_ptr, v_ptr, w, wv, token, d, dv, v_scale, rows, row_ok, cols, col_ok, U_KIND == 1,
            U_KIND == 3, SIGMOID,
        )
        target = _target(v, k, x, ERASE)
        g = tl.load(grad_ptr + token * d * dv + tile, mask=tile_ok, other=0.0).to(tl.float32)
        if READ:
            taps = tl.load(taps_ptr + rows[:, None] * tap_stride_d + cols[None, :] * tap_stride_v, mask=tile_ok,
                           other=0.0).to(tl.float32)
            g += taps * tl.load(grad_read_ptr + token * d + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        grad_coef, gx, grad_h = _update_grads(x, k, inv_norm, target, beta, g, ERASE)
        grad_z = tl.sum(grad_coef * target, axis=0) * beta * (1.0 - 0.5 * beta)  # d beta / dz = beta (1 - beta/2)
        grad_y = beta * grad_coef  # dv
        if SIGMOID:
            grad_y = grad_y * v * (1.0 - v / v_scale)
        grad_u = tl.sum(wv * grad_y[None, :], axis=1)
        grad_c = grad_z * w
        if U_KIND == 1:
            grad_c = grad_c + grad_u
        if U_KIND == 2:
            gx = gx + grad_u[:, None]
        if U_KIND == 0 or U_KIND == 3:
            tl.store(gu_ptr + token * d + rows, grad_u.to(gu_ptr.dtype.element_ty), mask=row_ok)
        tl.store(gx_ptr + token * d * dv + tile, gx.to(gx_ptr.dtype.element_ty), mask=tile_ok)
        tl.store(gh_ptr + token * d + rows, grad_h.to(gh_ptr.dtype.element_ty), mask=row_ok)
        tl.store(gc_ptr + token * d + rows, grad_c.to(gc_ptr.dtype.element_ty), mask=row_ok)
        if WEIGHT_GRADS:
            tl.store(gz_ptr + token, grad_z)
            tl.store(gy_ptr + token * dv + cols, grad_y, mask=col_ok)
            if READ:
                tl.store(write_ptr + token * dv + cols, inv_norm * beta * target, mask=col_ok)
    if WEIGHT_GRADS:
        tl.debug_barrier()  # (every thread's dz and dy stored before any reads them)
        rows = tl.arange(0, BLOCK_D)
        cols = tl.arange(0, BLOCK_V)
        row_ok, col_ok = rows < d, cols < dv
        sum_w = tl.zeros((BLOCK_D,), dtype=tl.float32)
        sum_wv = tl.zeros((BLOCK_D, BLOCK_V), dtype=tl.float32)
        sum_bv = tl.zeros((BLOCK_V,), dtype=tl.float32)
        sum_b = 0.0
        sum_taps = tl.zeros((BLOCK_D, BLOCK_V), dtype=tl.float32)
        for token in range(count):
            grad_z = tl.load(gz_ptr + token)
            grad_y = tl.load(gy_ptr + token * dv + cols, mask=col_ok, other=0.0)
            c = tl.load(c_ptr + token * d + rows, mask=row_ok, other=0.0).to(tl.float32)
            tile = cols[None, :] * d + rows[:, None]
            tile_ok = row_ok[:, None] & col_ok[None, :]
            if READ or U_KIND == 3:  # (X as stored: u's and X_next's source)
                x = tl.load(x_ptr + token * d * dv + tile, mask=tile_ok, other=0.0).to(tl.float32)
            if U_KIND == 1:
                u = c
            elif U_KIND == 3:
                u = _read_out(x, u_ptr, rows, cols, tile_ok, u_tap_stride_d, u_tap_stride_v, gu_ptr.dtype.element_ty)
            else:
                u = tl.load(u_ptr + token * d + rows, mask=row_ok, other=0.0).to(tl.float32)
            sum_w += grad_z * c
            sum_wv += u[:, None] * grad_y[None, :]
            sum_bv += grad_y
            sum_b += grad_z
            if READ:  # (X_next as the forward stored it)
                h = tl.load(h_ptr + token * d + rows, mask=row_ok, other=0.0).to(tl.float32)
                write = tl.load(write_ptr + token * dv + cols, mask=col_ok, other=0.0)
                stored = (x + h[:, None] * write[None, :]).to(gx_ptr.dtype.element_ty).to(tl.float32)
                sum_taps += stored * tl.load(grad_read_ptr + token * d + rows, mask=row_ok, other=0.0).to(
                    tl.float32)[:, None]
        part = part_ptr + tl.program_id(0).to(tl.int64) * (d + d * dv + dv + 1 + (d * dv if READ else 0))
        tl.store(part + rows, sum_w, mask=row_ok)
        tl.store(part + d + cols[None, :] * d + rows[:, None], sum_wv, mask=row_ok[:, None] & col_ok[None, :])
        tl.store(part + d + d * dv + cols, sum_bv, mask=col_ok)
        tl.store(part + d + d * dv + dv, sum_b)
        if READ:
            tl.store(part + d + d * dv + dv + 1 + cols[None, :] * d + rows[:, None], sum_taps,
                     mask=row_ok[:, None] & col_ok[None, :])

def _blocks(d, dv, backward=False):
    """A token's tile and the warps for it (`row_tile`); the backward, whose loop over tokens holds more, needs twice
    the forward's (compiled for sm_90, scripts/triton_sm90.py, d = 768 x 4: 80 bytes spilled per thread with 4 warps,
    none with 8, with the readout's gradient too; d = 4,096 x 4: 416-472 bytes with 32, 792-880 with the readout's)."""
    return row_tile(d, dv, more=2 if backward else 1)


_SEAM = "Triton residual seam"


class _TritonSeam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, taps, gain, v_scale, k_eps, norm_eps,
                erase, u_kind, u_taps):
        d, dv = h.shape[-1], value_weight.shape[0]
        out = torch.empty_like(x)
        y = None if taps is None else h.new_empty(h.shape, dtype=torch.promote_types(x.dtype, taps.dtype))
        normed = None if gain is None else h.new_empty(h.shape, dtype=torch.promote_types((
            out if y is None else y).dtype, gain.dtype))
        ctx.v_scale, ctx.k_eps, ctx.norm_eps, ctx.erase, ctx.u_kind = v_scale, k_eps, norm_eps, erase, u_kind
        ctx.u_dtype = u.dtype
        values = h.new_empty((h.numel() // d, dv), dtype=torch.float32) if u_kind == 3 else None
        with torch.cuda.device_of(x):
            _seam_fwd_kernel[(h.numel() // d,)](
                x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, x if taps is None else taps, out,
                out if y is None else y, x if gain is None else gain, out if normed is None else normed,
                out if values is None else values, d, dv, k_eps**2, norm_eps=norm_eps, **_tap_strides(taps),
                ERASE=erase, U_IS_C=u_kind == 1, READ=taps is not None, NORM=gain is not None,
                KEEP_V=values is not None, **_value(v_scale), **_blocks(d, dv),
            )
        # For the norm's backward: y, or X_next (which the next seam keeps) where y is read out of it again; not where
        # the state is fp32, which the model may rebuild in backward (its hooks would keep an X_next saved here). u_kind
        # 3: v, not u (read out of x again).
        kept = None if gain is None else y if y is not None and x.dtype == torch.float32 else out
        ctx.save_for_backward(x, h, c, u_taps if u_kind == 3 else u, gate_weight, gate_bias, value_weight,
                              value_bias, taps, gain, kept, values)
        if y is None:  # (d_v = 1 with the norm: of X_next)
            return out if normed is None else (out, normed)
        return (out, y) if normed is None else (out, y, normed)

    @staticmethod
    def backward(ctx, grad_out, *grad_read_and_normed):
        refuse_second_derivative("the Triton residual seam")  # (its gradients are computed outside autograd)
        *saved, gain, kept, values = ctx.saved_tensors
        grad_read, grad_normed = (((None,) if saved[8] is None else ()) + grad_read_and_normed + (None, None))[:2]
        grad_gain = None
        if gain is not None and saved[8] is None:  # (d_v = 1: the norm's gradient joins X_next's own)
            grad_out, grad_gain = _norm_gradients(kept, gain, ctx.norm_eps, grad_normed, grad_out,
                                                  ctx.needs_input_grad[9])
        elif gain is not None:  # (the RMSNorm's gradient joins y's, y kept or read out of X_next, before the seam's)
            again = kept.dim() > saved[1].dim()  # (X_next, not y)
            grad_read, grad_gain = _norm_gradients(kept, gain, ctx.norm_eps, grad_normed, grad_read,
                                                   ctx.needs_input_grad[9], saved[8][0].t() if again else None)
        grads = _seam_gradients(ctx, saved, grad_out, grad_read, values)
        return *grads[:9], grad_gain, *grads[9:], None, None


def _value(v_scale):
    """The kernels' v_scale and SIGMOID (v_scale None: the linear value, v = W_v u + b_v)."""
    return dict(v_scale=1.0 if v_scale is None else v_scale, SIGMOID=v_scale is not None)


def _aligned(n):
    """n rounded up to a multiple of 16 (fp32: 64 bytes)."""
    return -(-n // 16) * 16


def _tap_strides(taps, prefix=""):
    """The readout taps' `(1, d, d_v)` strides along d and d_v, as the kernels take them (0 without a readout)."""
    return dict(zip((f"{prefix}tap_stride_d", f"{prefix}tap_stride_v"), (0, 0) if taps is None else taps.stride()[1:]))


def _seam_gradients(ctx, saved, grad_out, grad_read=None, values=None):
    """The seam's gradients in two launches: the backward kernel, then the sum of its partial rows of the weights'
    gradients (the gate's, the value's and, with a readout, its taps') in their dtype (none where no weight needs
    one, as under LoRA)."""
    x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, taps = saved
    d, dv, tokens, read = h.shape[-1], value_weight.shape[0], h.numel() // h.shape[-1], taps is not None
    grad_x, grad_h, grad_c = torch.empty_like(x), torch.empty_like(h), torch.empty_like(c)
    grad_u = torch.empty_like(h, dtype=ctx.u_dtype) if ctx.u_kind in (0, 3) else grad_c  # (not written otherwise)
    weights = (gate_weight, gate_bias, value_weight, value_bias) + ((taps,) if read else ())
    needs = ctx.needs_input_grad[4 : 4 + len(weights)]
    programs, per_program = _runs(tokens, x.device)
    width = d + d * dv + dv + 1 + (d * dv if read else 0)  # [w | W_v | b_v | b | taps]
    if any(needs):  # (one allocation, fp32: dz `(N,)`, dy `(N, d_v)`, the write `(N, d_v)`, the partial rows; each
        # part 64-byte aligned, as a tensor of its own would be, so that any token count compiles one variant)
        ends = [_aligned(n) for n in (tokens, tokens * dv, tokens * dv, programs * width)]
        starts = [sum(ends[:i]) for i in range(4)]
        scratch = torch.empty(sum(ends), dtype=torch.float32, device=x.device)
        grad_z, grad_y, write, parts = (scratch[s : s + n] for s, n in zip(
            starts, (tokens, tokens * dv, tokens * dv, programs * width)))
    else:
        grad_z = grad_y = write = parts = grad_h  # (not written)
    with torch.cuda.device_of(x):
        _seam_bwd_kernel[(programs,)](
            x, h, c, u, *weights[:4], taps if read else x, grad_out.contiguous(),
            grad_read.contiguous() if read else grad_out, grad_x, grad_h, grad_c, grad_u, grad_z, grad_y, write,
            parts, grad_z if values is None else values, tokens, per_program, d, dv, ctx.k_eps**2,
            **_tap_strides(taps), **_tap_strides(u if ctx.u_kind == 3 else None, "u_"), ERASE=ctx.erase,
            U_KIND=ctx.u_kind, READ=read, WEIGHT_GRADS=any(needs), **_value(ctx.v_scale),
            **_blocks(d, dv, backward=True),
        )
    grads = [None] * len(weights)
    if any(needs):
        dtype = gate_weight.dtype if all(w.dtype == gate_weight.dtype for w in weights) else torch.float32
        summed = sum_parts(parts.view(programs, width), dtype)
        end = d + d * dv + dv + 1
        split = (summed[:d], summed[end - 1 : end], summed[d : d + d * dv].view(dv, d), summed[d + d * dv : end - 1])
        split += (summed[end:].view(1, dv, d).transpose(1, 2),) if read else ()  # (rows: w, W_v, b_v, b, the taps)
        grads = [part.to(w.dtype) if need else None for part, w, need in zip(split, weights, needs)]
    return (grad_x, grad_h, grad_c, grad_u if ctx.u_kind in (0, 3) else None, *grads[:4], grads[4] if read else None,
            None, None, None, None)


_compiled = set()  # the kernels' variants whose backward compiled here


def _backward_compiles(x, h, c, u, weights, taps, gain, v_scale, k_eps, erase, u_kind, u_taps):
    """This variant's backward kernels compiled and launched (else raises), tried once (on one token) before its forward
    first serves: a backward that failed only after the forward ran could give no gradient for that step, while a
    seam that does not serve leaves forward and backward to the specification. None without autograd (a decoding
    step: no backward follows)."""
    if not torch.is_grad_enabled():
        return
    trained = (*weights, taps) if taps is not None else weights
    weight_grads = any(w.requires_grad for w in trained)
    key = (x.dtype, h.dtype, c.dtype, u.dtype, *(w.dtype for w in weights), x.device, h.shape[-1], weights[2].shape[0],
           v_scale is None, erase, u_kind, weight_grads, None if taps is None else taps.dtype,
           None if gain is None else (gain.dtype, gain.requires_grad), None if u_taps is None else u_taps.dtype)
    if key not in _compiled:
        class Probe:
            needs_input_grad = (False,) * 4 + (weight_grads,) * 5 + (False,) * 4

        probe = Probe()
        probe.v_scale, probe.k_eps, probe.erase, probe.u_kind, probe.u_dtype = v_scale, k_eps, erase, u_kind, u.dtype
        one = [t.reshape(-1, *t.shape[2:])[:1].contiguous() for t in (x, h, c, u)]
        one[3] = one[3] if u_taps is None else u_taps.detach()
        kept = (*(w.detach() for w in weights), None if taps is None else taps.detach())
        read = None if taps is None else one[1].new_zeros(one[1].shape, dtype=torch.promote_types(x.dtype, taps.dtype))
        grad = torch.zeros_like(one[0])
        if gain is not None:  # (as backward runs them: the norm's first, whose fp32 gradient the seam's then reads)
            y = grad if read is None else read  # (d_v = 1: the norm of X_next; else of its readout, kept or read again)
            normed = y.new_zeros(y.shape, dtype=torch.promote_types(y.dtype, gain.dtype))
            again = read is not None and x.dtype != torch.float32
            y = _norm_gradients(grad if again else y, gain.detach(), 1e-6, normed, y, gain.requires_grad,
                                kept[-1][0].t() if again else None)[0]
            grad, read = (y, read) if read is None else (grad, y)
        values = None if u_taps is None else torch.zeros(1, weights[2].shape[0], device=x.device)  # (the kept v)
        _seam_gradients(probe, (*one, *kept), grad, read, values)  # (grad, read: as X_next's and y's gradients)
        _compiled.add(key)


def serves(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, mode, readout=None, gain=None,
           norm_eps=None, u_read=None):
    """Delta or write-only; every tensor on CUDA and none fp64; `eager`."""
    tensors = (x, h, c, u, gate_weight, gate_bias, value_weight, value_bias) + tuple(
        t for t in (readout, gain, u_read) if t is not None)
    return mode != "additive" and eager() and all(t.is_cuda and t.dtype != torch.float64 for t in tensors)


def run(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, mode, readout=None, gain=None,
        norm_eps=None, u_read=None):
    """`reference.delta_residual` through the seam's kernels, with autograd: X_next; with the next compressor's
    `readout` weight `(K, d, d_v)`, (X_next, y), y its readout of X_next made in the same pass where it has one tap
    (CC) and u is not c, else None (TC's reads earlier tokens' states, which other programs write; with u = c the
    backward spilled registers when compiled for sm_90 at d = 768, scripts/triton_sm90.py, where the others do not);
    with the next sublayer's RMSNorm too (its `gain` and `norm_eps`), (X_next, y, RMSNorm(y)) where y is made here,
    else (X_next, None, None) (the caller then reads and normalises X_next itself); with the norm and no readout at
    d_v = 1, where X_next is the next input, (X_next, None, RMSNorm(X_next)). `u_read`, a one-tap weight `(1, d, d_v)`
    by which u was read out of x (CC's readout, the authors' value input; the caller's promise): where the seam makes
    no readout itself and the state is not fp32 (which the model may rebuild), it keeps v (d_v floats a token) for
    backward, which reads u out of x again for the value's weight, instead of keeping u (d a token; beside the
    readout's tiles the backward spilled registers for sm_90)."""
    u_kind = value_input_kind(x, h, c, u)
    taps = readout if readout is not None and readout.shape[0] == 1 and u_kind != 1 else None  # (1, d, d_v)
    u_taps = u_read if u_kind == 0 and taps is None and u_read is not None and x.dim() == h.dim() + 1 and (
        u_read.shape == (1, h.shape[-1], value_weight.shape[0])) and x.dtype != torch.float32 and (
        torch.is_grad_enabled()) else None
    u_kind = 3 if u_taps is not None else u_kind
    x, h, c = x.contiguous(), h.contiguous(), c.contiguous()
    u = c if u_kind == 1 else (x if u_kind == 2 else u.contiguous())
    weights = (gate_weight.contiguous(), gate_bias.contiguous(), value_weight.contiguous(), value_bias.contiguous())
    norm = None if gain is None or taps is None and (readout is not None or x.dim() != h.dim()) else (
        gain.contiguous())  # (with no readout at d_v = 1, the norm of X_next, the next input)
    v_scale, erase = None if v_scale is None else float(v_scale), mode == "delta"
    _backward_compiles(x, h, c, u, weights, taps, norm, v_scale, float(k_eps), erase, u_kind, u_taps)
    out = _TritonSeam.apply(x, h, c, u, *weights, taps, norm, v_scale, float(k_eps),
                            0.0 if norm_eps is None else float(norm_eps), erase, u_kind, u_taps)
    if taps is None and norm is not None:  # (d_v = 1: the next input is X_next)
        return out[0], None, out[1]
    if readout is None and gain is None:
        return out
    out = out if taps is not None else (out, None)
    return out if gain is None or norm is not None else (*out, None)


RUN = serving(serves, fallible(_SEAM, run))

__all__ = ["RUN", "run", "serves"]
