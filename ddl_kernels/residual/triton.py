r"""The residual seam in Triton for CUDA: one program per token. `_seam_*` make the gate, the value and the delta update
in one kernel each way (`reference.delta_residual`); `_delta_*` the update alone (`reference.delta_update`) for the
seams that one does not serve (a two-layer gate, a constant target). Each program loads h (d), the state X (d_v x d,
stored column after column) and the inputs of beta and v, and writes X_next; the backward program recomputes k, k^T X,
beta, v and the coefficient from the same inputs, so nothing else is stored. The same kernels serve d_v = 1 and every
d_v > 1.

Per token, with the gate and value of `reference.delta_residual` (all in fp32, whatever the storage dtype):
    beta = 2 sigmoid(w . c + b),   v_j = s_v sigmoid(W_v[j] . u + b_v[j])  (or W_v[j] . u + b_v[j] when s_v = None)
    k = h s, s = 1 / sqrt(|h|^2 + eps^2),   t_j = v_j - k . X_j  (write-only: t_j = v_j),   X_next_j = X_j + k beta t_j
and backward, from G = dL/dX_next: g_j = k . G_j, dv_j = beta g_j, dbeta = sum_j g_j t_j, dX_j = G_j - k beta g_j
(write-only: G_j), dk = sum_j G_j beta t_j - X_j beta g_j, dh = s (dk - k (k . dk)); through the gate and the value
dz = dbeta beta (1 - beta / 2), dy_j = dv_j v_j (1 - v_j / s_v) (or dv_j), dc = dz w, du = sum_j dy_j W_v[j] (added to
dc when u is c, to dX when u is the d_v = 1 state). The weights' gradients are sums over tokens of dz and dy_j times c
and u: products in PyTorch, from the per-token dz and dy the kernel writes. Why: in eager PyTorch the gate and value
are 9 more launches forward and 5 more backward per sublayer in bf16 (scripts/launch_count.py), each a launch that a
GPU step waits for.

Serves `reference.delta_residual` (a single linear gate, a learned value; delta or write-only) and
`reference.delta_update` (delta or write-only) for CUDA tensors other than fp64, outside traces (`ddl_kernels.eager`).
The seam computes v from u in fp32 where the specification, in a bf16 model, rounds W_v u to bf16 first (so a bf16
seam is closer to the fp64 numbers). Opt-in (`ddl_implementation="triton"`; docs/gpu.md says why); tested on CPU
through Triton's interpreter (`TRITON_INTERPRET=1`, tests/test_kernels.py).
"""

import torch
import triton
import triton.language as tl

from .. import Implementation, eager, fallible, refuse_second_derivative
from ..readout.triton import channel_block
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
def _load_token(
    x_ptr, h_ptr, v_ptr, beta_ptr, token, d, dv, k_eps_sq,
    ERASE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """`_token_state`, the target t (v - k^T X, or v) and beta, v and beta given."""
    rows, row_ok, cols, col_ok, tile, tile_ok, x, k, inv_norm, h = _token_state(
        x_ptr, h_ptr, token, d, dv, k_eps_sq, BLOCK_D, BLOCK_V
    )
    target = _target(tl.load(v_ptr + token * dv + cols, mask=col_ok, other=0.0).to(tl.float32), k, x, ERASE)
    beta = tl.load(beta_ptr + token).to(tl.float32)
    return rows, row_ok, cols, col_ok, tile, tile_ok, x, k, inv_norm, target, beta

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
def _delta_fwd_kernel(
    x_ptr, h_ptr, v_ptr, beta_ptr, out_ptr, d, dv, k_eps_sq,
    ERASE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    rows, row_ok, cols, col_ok, tile, tile_ok, x, k, inv_norm, target, beta = _load_token(
        x_ptr, h_ptr, v_ptr, beta_ptr, token, d, dv, k_eps_sq, ERASE, BLOCK_D, BLOCK_V
    )
    out = x + k[:, None] * (beta * target)[None, :]
    tl.store(out_ptr + token * d * dv + tile, out.to(out_ptr.dtype.element_ty), mask=tile_ok)

@triton.jit
def _delta_bwd_kernel(
    x_ptr, h_ptr, v_ptr, beta_ptr, grad_ptr, gx_ptr, gh_ptr, gv_ptr, gbeta_ptr, d, dv, k_eps_sq,
    ERASE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    rows, row_ok, cols, col_ok, tile, tile_ok, x, k, inv_norm, target, beta = _load_token(
        x_ptr, h_ptr, v_ptr, beta_ptr, token, d, dv, k_eps_sq, ERASE, BLOCK_D, BLOCK_V
    )
    g = tl.load(grad_ptr + token * d * dv + tile, mask=tile_ok, other=0.0).to(tl.float32)
    grad_coef, gx, grad_h = _update_grads(x, k, inv_norm, target, beta, g, ERASE)
    tl.store(gx_ptr + token * d * dv + tile, gx.to(gx_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(gh_ptr + token * d + rows, grad_h.to(gh_ptr.dtype.element_ty), mask=row_ok)
    tl.store(gv_ptr + token * dv + cols, (beta * grad_coef).to(gv_ptr.dtype.element_ty), mask=col_ok)
    tl.store(gbeta_ptr + token, tl.sum(grad_coef * target, axis=0).to(gbeta_ptr.dtype.element_ty))


@triton.jit
def _gate_and_value(
    c_ptr, u_ptr, w_ptr, b_ptr, wv_ptr, bv_ptr, token, d, v_scale, rows, row_ok, cols, col_ok, tile, tile_ok,
    U_IS_C: tl.constexpr, SIGMOID: tl.constexpr,
):
    """c, w, u, W_v's tile (fp32) and this token's beta = 2 sigmoid(w . c + b) and v `(BLOCK_V,)` (0 past d_v)."""
    c = tl.load(c_ptr + token * d + rows, mask=row_ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    beta = 2.0 * tl.sigmoid(tl.sum(w * c, axis=0) + tl.load(b_ptr).to(tl.float32))
    if U_IS_C:
        u = c
    else:
        u = tl.load(u_ptr + token * d + rows, mask=row_ok, other=0.0).to(tl.float32)
    wv = tl.load(wv_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)  # W_v (d_v, d): the state's layout
    v = tl.sum(wv * u[:, None], axis=0) + tl.load(bv_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if SIGMOID:
        v = v_scale * tl.sigmoid(v)
    return c, w, u, wv, beta, tl.where(col_ok, v, 0.0)

@triton.jit
def _seam_fwd_kernel(
    x_ptr, h_ptr, c_ptr, u_ptr, w_ptr, b_ptr, wv_ptr, bv_ptr, out_ptr, write_ptr, d, dv, k_eps_sq, v_scale,
    ERASE: tl.constexpr, U_IS_C: tl.constexpr, SIGMOID: tl.constexpr, WRITE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """X_next = X + h (x) w with w = s beta t `(d_v,)`, also written out where WRITE (for `StateRebuild`)."""
    token = tl.program_id(0).to(tl.int64)
    rows, row_ok, cols, col_ok, tile, tile_ok, x, k, inv_norm, h = _token_state(
        x_ptr, h_ptr, token, d, dv, k_eps_sq, BLOCK_D, BLOCK_V
    )
    c, w, u, wv, beta, v = _gate_and_value(
        c_ptr, u_ptr, w_ptr, b_ptr, wv_ptr, bv_ptr, token, d, v_scale, rows, row_ok, cols, col_ok, tile, tile_ok,
        U_IS_C, SIGMOID,
    )
    target = _target(v, k, x, ERASE)
    write = inv_norm * beta * target
    out = x + h[:, None] * write[None, :]
    tl.store(out_ptr + token * d * dv + tile, out.to(out_ptr.dtype.element_ty), mask=tile_ok)
    if WRITE:
        tl.store(write_ptr + token * dv + cols, write.to(write_ptr.dtype.element_ty), mask=col_ok)

@triton.jit
def _seam_bwd_kernel(
    x_ptr, h_ptr, c_ptr, u_ptr, w_ptr, b_ptr, wv_ptr, bv_ptr, grad_ptr, gx_ptr, gh_ptr, gc_ptr, gu_ptr, gz_ptr,
    gy_ptr, d, dv, k_eps_sq, v_scale,
    ERASE: tl.constexpr, U_KIND: tl.constexpr, SIGMOID: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """dX, dh, dc, du (U_KIND 0; 1: u is c, its gradient in dc; 2: u is the d_v = 1 state, in dX) and the per-token
    dz `(N,)` and dy `(N, d_v)` (fp32) that the weights' gradients sum."""
    token = tl.program_id(0).to(tl.int64)
    rows, row_ok, cols, col_ok, tile, tile_ok, x, k, inv_norm, h = _token_state(
        x_ptr, h_ptr, token, d, dv, k_eps_sq, BLOCK_D, BLOCK_V
    )
    c, w, u, wv, beta, v = _gate_and_value(
        c_ptr, u_ptr, w_ptr, b_ptr, wv_ptr, bv_ptr, token, d, v_scale, rows, row_ok, cols, col_ok, tile, tile_ok,
        U_KIND == 1, SIGMOID,
    )
    target = _target(v, k, x, ERASE)
    g = tl.load(grad_ptr + token * d * dv + tile, mask=tile_ok, other=0.0).to(tl.float32)
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
    if U_KIND == 0:
        tl.store(gu_ptr + token * d + rows, grad_u.to(gu_ptr.dtype.element_ty), mask=row_ok)
    tl.store(gx_ptr + token * d * dv + tile, gx.to(gx_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(gh_ptr + token * d + rows, grad_h.to(gh_ptr.dtype.element_ty), mask=row_ok)
    tl.store(gc_ptr + token * d + rows, grad_c.to(gc_ptr.dtype.element_ty), mask=row_ok)
    tl.store(gz_ptr + token, grad_z)
    tl.store(gy_ptr + token * dv + cols, grad_y, mask=col_ok)


def _blocks(d, dv):
    """A token's tile (BLOCK_D, BLOCK_V) and the warps for it: enough that a backward program's few fp32 tiles stay in
    registers (compiled for sm_90: 4 warps keep d = 1,024 x 4 channels without spilling; d = 4,096 x 4 spilled 7 KB per
    thread with 4, 112 bytes with 16)."""
    block_d, block_v = triton.next_power_of_2(d), channel_block(dv)
    return dict(BLOCK_D=block_d, BLOCK_V=block_v, num_warps=min(16, max(4, block_d * block_v // 1024)))


class _TritonDeltaUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h, v, beta, k_eps, erase):
        d, dv = h.shape[-1], v.shape[-1]
        x, h, v, beta = x.contiguous(), h.contiguous(), v.contiguous(), beta.contiguous()
        out = torch.empty_like(x)
        with torch.cuda.device_of(x):
            _delta_fwd_kernel[(h.numel() // d,)](x, h, v, beta, out, d, dv, k_eps**2, ERASE=erase, **_blocks(d, dv))
        ctx.save_for_backward(x, h, v, beta)
        ctx.k_eps, ctx.erase = k_eps, erase
        return out

    @staticmethod
    def backward(ctx, grad_out):
        refuse_second_derivative("the Triton delta update")
        x, h, v, beta = ctx.saved_tensors
        d, dv = h.shape[-1], v.shape[-1]
        grad_x, grad_h = torch.empty_like(x), torch.empty_like(h)
        grad_v, grad_beta = torch.empty_like(v), torch.empty_like(beta)
        with torch.cuda.device_of(x):
            _delta_bwd_kernel[(h.numel() // d,)](
                x, h, v, beta, grad_out.contiguous(), grad_x, grad_h, grad_v, grad_beta, d, dv, ctx.k_eps**2,
                ERASE=ctx.erase, **_blocks(d, dv),
            )
        return grad_x, grad_h, grad_v, grad_beta, None, None


_SEAM, _SEAM_BACKWARD = "Triton residual seam", "Triton residual seam's backward"


class _TritonSeam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, erase, u_kind,
                keep_write):
        d, dv = h.shape[-1], value_weight.shape[0]
        out = torch.empty_like(x)
        write = x.new_empty(*h.shape[:-1], dv) if keep_write else out  # (else not written)
        ctx.v_scale, ctx.k_eps, ctx.erase, ctx.u_kind = v_scale, k_eps, erase, u_kind
        with torch.cuda.device_of(x):
            _seam_fwd_kernel[(h.numel() // d,)](
                x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, out, write, d, dv, k_eps**2,
                ERASE=erase, U_IS_C=u_kind == 1, WRITE=keep_write, **_value(v_scale), **_blocks(d, dv),
            )
        ctx.save_for_backward(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias)
        ctx.write = write if keep_write else None  # X_next = X + h (x) write (`ddl.kernels`)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        refuse_second_derivative("the Triton residual seam")  # (its gradients are computed outside autograd)
        saved = ctx.saved_tensors  # (once: a checkpointed forward's tensors may be unpacked only once)
        # a backward kernel that fails gives the specification's gradients, this and every later backward; the
        # forward still serves (a checkpoint's recompute must save what the first forward saved)
        grads = _seam_backward(ctx, saved, grad_out)
        return grads if grads is not None else _reference_gradients(ctx, saved, grad_out)


def _value(v_scale):
    """The kernels' v_scale and SIGMOID (v_scale None: the linear value, v = W_v u + b_v)."""
    return dict(v_scale=1.0 if v_scale is None else v_scale, SIGMOID=v_scale is not None)


def _seam_gradients(ctx, saved, grad_out):
    x, h, c, u, gate_weight, gate_bias, value_weight, value_bias = saved
    d, dv, tokens = h.shape[-1], value_weight.shape[0], h.numel() // h.shape[-1]
    grad_x, grad_h, grad_c = torch.empty_like(x), torch.empty_like(h), torch.empty_like(c)
    grad_u = torch.empty_like(u) if ctx.u_kind == 0 else grad_c  # (not written otherwise)
    grad_z = torch.empty(tokens, dtype=torch.float32, device=x.device)
    grad_y = torch.empty(tokens, dv, dtype=torch.float32, device=x.device)
    with torch.cuda.device_of(x):
        _seam_bwd_kernel[(tokens,)](
            x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, grad_out.contiguous(), grad_x, grad_h,
            grad_c, grad_u, grad_z, grad_y, d, dv, ctx.k_eps**2, ERASE=ctx.erase, U_KIND=ctx.u_kind,
            **_value(ctx.v_scale), **_blocks(d, dv),
        )
    # the weights' (none when frozen, as under LoRA): sums over tokens, fp32 products (the gate is fp32 throughout)
    needs = ctx.needs_input_grad
    grad_w = grad_b = grad_wv = grad_bv = None
    with torch.autocast(x.device.type, enabled=False):  # (backward may run under autocast)
        if needs[4]:
            grad_w = (grad_z @ c.reshape(tokens, d).float()).to(gate_weight.dtype)
        if needs[5]:
            grad_b = grad_z.sum(0, keepdim=True).to(gate_bias.dtype)
        if needs[6]:
            grad_wv = (grad_y.T @ u.reshape(tokens, d).float()).to(value_weight.dtype)
        if needs[7]:
            grad_bv = grad_y.sum(0).to(value_bias.dtype)
    return (grad_x, grad_h, grad_c, grad_u if ctx.u_kind == 0 else None, grad_w, grad_b, grad_wv, grad_bv,
            None, None, None, None, None)


_seam_backward = fallible(_SEAM_BACKWARD, _seam_gradients)


def _reference_gradients(ctx, saved, grad_out):
    """The gradients `_seam_gradients` gives, through autograd over `reference.delta_residual` (the same inputs)."""
    from ddl.reference import delta_residual

    leaves = [t.detach().requires_grad_(need) for t, need in zip(saved, ctx.needs_input_grad)]
    x, h, c, u = leaves[:4]
    u = (u, c, x)[ctx.u_kind]
    wanted = [t for t in leaves if t.requires_grad]
    with torch.enable_grad(), torch.autocast(x.device.type, enabled=False):  # (as the kernel: the inputs' dtypes)
        out = delta_residual(x, h, c, u, *leaves[4:], ctx.v_scale, ctx.k_eps, "delta" if ctx.erase else "write_only")
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
    return (*(next(grads) if t.requires_grad else None for t in leaves), None, None, None, None, None)


def seam_serves(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, mode, gate_hidden,
                v_constant):
    """A single linear gate, a learned value, delta or write-only; every tensor on CUDA and none fp64; `eager`."""
    tensors = (x, h, c, u, gate_weight, gate_bias, value_weight, value_bias)
    return (gate_hidden is None and v_constant is None and mode != "additive" and eager()
            and all(t.is_cuda and t.dtype != torch.float64 for t in tensors))


def seam_run(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, mode, gate_hidden=None,
             v_constant=None):
    """`reference.delta_residual` (where `seam_serves`) through the seam's kernels, with autograd."""
    u_kind = value_input_kind(x, h, c, u)
    x, h, c = x.contiguous(), h.contiguous(), c.contiguous()
    u = c if u_kind == 1 else (x if u_kind == 2 else u.contiguous())
    inputs = (x, h, c, u, gate_weight.contiguous(), gate_bias.contiguous(), value_weight.contiguous(),
              value_bias.contiguous())
    keep_write = (x.dtype == torch.float32 and torch.is_grad_enabled()  # (for `StateRebuild`: fp32 training)
                  and any(t.requires_grad for t in inputs))
    return _TritonSeam.apply(*inputs, None if v_scale is None else float(v_scale), float(k_eps), mode == "delta",
                             u_kind, keep_write)


def serves(x, h, v, beta, mode, k_eps):
    return x.is_cuda and x.dtype != torch.float64 and mode != "additive" and eager()


def run(x, h, v, beta, mode, k_eps):
    return _TritonDeltaUpdate.apply(x, h, v, beta, k_eps, mode == "delta")


UPDATE = Implementation("Triton delta update", ("triton",), serves, fallible("Triton delta update", run))
SEAM = Implementation(_SEAM, ("triton",), seam_serves, fallible(_SEAM, seam_run))

__all__ = ["SEAM", "UPDATE", "seam_run"]
