r"""The delta update in Triton for CUDA: one program per token loads h (d), the state X (d_v x d, stored column after
column), v (d_v) and beta, and writes X_next; the backward program recomputes k, k^T X and the coefficient from the
same inputs, so nothing else is stored. The same kernels serve d_v = 1 and every d_v > 1.

Serves `reference.delta_update` (delta or write-only) for CUDA tensors other than fp64 (the kernels accumulate in
fp32, whatever the storage dtype). Opt-in (`ddl_implementation="triton"`; docs/gpu.md says why); tested on CPU
through Triton's interpreter (`TRITON_INTERPRET=1`, tests/test_kernels.py), and compiled on an H200.
"""

import torch
import triton
import triton.language as tl

from .. import Implementation, fallible
from ..readout.triton import channel_block


@triton.jit
def _load_token(
    x_ptr, h_ptr, v_ptr, beta_ptr, token, d, dv, k_eps_sq,
    ERASE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One token's X tile (fp32), k, s = 1/|h|_eps, the target t (v - k^T X, or v) and beta."""
    rows = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_V)
    row_ok = rows < d
    col_ok = cols < dv
    tile = cols[None, :] * d + rows[:, None]  # the state is (d_v, d) per token
    tile_ok = row_ok[:, None] & col_ok[None, :]
    h = tl.load(h_ptr + token * d + rows, mask=row_ok, other=0.0).to(tl.float32)
    inv_norm = tl.rsqrt(tl.sum(h * h, axis=0) + k_eps_sq)
    k = h * inv_norm  # (BLOCK_D,)
    x = tl.load(x_ptr + token * d * dv + tile, mask=tile_ok, other=0.0).to(tl.float32)
    target = tl.load(v_ptr + token * dv + cols, mask=col_ok, other=0.0).to(tl.float32)
    if ERASE:
        target = target - tl.sum(k[:, None] * x, axis=0)  # v - k^T X
    beta = tl.load(beta_ptr + token).to(tl.float32)
    return rows, row_ok, cols, col_ok, tile, tile_ok, x, k, inv_norm, target, beta

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
    grad_coef = tl.sum(k[:, None] * g, axis=0)  # k^T G
    grad_k = tl.sum(g * (beta * target)[None, :], axis=1)
    gx = g
    if ERASE:
        grad_k = grad_k - tl.sum(x * (beta * grad_coef)[None, :], axis=1)
        gx = g - k[:, None] * (beta * grad_coef)[None, :]
    grad_h = inv_norm * (grad_k - k * tl.sum(k * grad_k, axis=0))
    tl.store(gx_ptr + token * d * dv + tile, gx.to(gx_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(gh_ptr + token * d + rows, grad_h.to(gh_ptr.dtype.element_ty), mask=row_ok)
    tl.store(gv_ptr + token * dv + cols, (beta * grad_coef).to(gv_ptr.dtype.element_ty), mask=col_ok)
    tl.store(gbeta_ptr + token, tl.sum(grad_coef * target, axis=0).to(gbeta_ptr.dtype.element_ty))


class _TritonDeltaUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h, v, beta, k_eps, erase):
        d, dv = h.shape[-1], v.shape[-1]
        x, h, v, beta = x.contiguous(), h.contiguous(), v.contiguous(), beta.contiguous()
        out = torch.empty_like(x)
        block_d, block_v = triton.next_power_of_2(d), channel_block(dv)
        _delta_fwd_kernel[(h.numel() // d,)](
            x, h, v, beta, out, d, dv, k_eps**2, ERASE=erase, BLOCK_D=block_d, BLOCK_V=block_v
        )
        ctx.save_for_backward(x, h, v, beta)
        ctx.k_eps, ctx.erase = k_eps, erase
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, h, v, beta = ctx.saved_tensors
        d, dv = h.shape[-1], v.shape[-1]
        grad_x, grad_h = torch.empty_like(x), torch.empty_like(h)
        grad_v, grad_beta = torch.empty_like(v), torch.empty_like(beta)
        block_d, block_v = triton.next_power_of_2(d), channel_block(dv)
        _delta_bwd_kernel[(h.numel() // d,)](
            x, h, v, beta, grad_out.contiguous(), grad_x, grad_h, grad_v, grad_beta, d, dv, ctx.k_eps**2,
            ERASE=ctx.erase, BLOCK_D=block_d, BLOCK_V=block_v,
        )
        return grad_x, grad_h, grad_v, grad_beta, None, None


def serves(x, h, v, beta, mode, k_eps):
    return x.is_cuda and x.dtype != torch.float64 and mode != "additive"


def run(x, h, v, beta, mode, k_eps):
    return _TritonDeltaUpdate.apply(x, h, v, beta, k_eps, mode == "delta")


UPDATE = Implementation("Triton delta update", ("triton",), serves, fallible("Triton delta update", run))

__all__ = ["UPDATE"]
