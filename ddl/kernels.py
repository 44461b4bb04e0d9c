"""Fast paths for `delta_update`, with its exact signature. The reference in modeling_ddl.py is the spec.

On CUDA tensors with triton installed, `fused_delta_update` runs the Triton kernels of `ddl.triton_kernels`
(imported lazily, never required); elsewhere (CPU, Apple, no triton) it runs the PyTorch function below.

`fused_delta_update` is a custom autograd function: the forward computes the same numbers as the reference, but
keeps only the inputs (X, h, v, beta) for backward and recomputes k, k^T X and the coefficient there, instead
of autograd keeping every intermediate (k, the fp32 copies, the readout, the rank-1 product). X is kept alive
anyway by the next norm or compressor, so the extra memory of a sublayer is h alone.
"""

import torch
from transformers.utils import logging


logger = logging.get_logger(__name__)


class _DeltaUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h, v, beta, k_eps, erase):
        acc = torch.promote_types(x.dtype, torch.float32)
        scalar_state = x.dim() == h.dim()
        state = x.unsqueeze(-1) if scalar_state else x  # (B, T, d, d_v)
        h32 = h.to(acc)
        k = h32 * torch.rsqrt(h32.pow(2).sum(-1, keepdim=True) + k_eps**2)
        coef = v.to(acc)
        if erase:
            coef = coef - torch.einsum("btd,btdv->btv", k, state.to(acc))
        coef = beta * coef  # (B, T, d_v)
        out = state + k.to(x.dtype).unsqueeze(-1) * coef.to(x.dtype).unsqueeze(-2)
        ctx.save_for_backward(x, h, v, beta)
        ctx.k_eps, ctx.erase, ctx.scalar_state = k_eps, erase, scalar_state
        return out.squeeze(-1) if scalar_state else out

    @staticmethod
    def backward(ctx, grad_out):
        x, h, v, beta = ctx.saved_tensors
        acc = torch.promote_types(x.dtype, torch.float32)
        state = (x.unsqueeze(-1) if ctx.scalar_state else x).to(acc)
        grad = (grad_out.unsqueeze(-1) if ctx.scalar_state else grad_out).to(acc)
        h32 = h.to(acc)
        inv_norm = torch.rsqrt(h32.pow(2).sum(-1, keepdim=True) + ctx.k_eps**2)
        k = h32 * inv_norm
        target = v.to(acc)
        if ctx.erase:
            target = target - torch.einsum("btd,btdv->btv", k, state)  # v - k^T X
        grad_coef = torch.einsum("btd,btdv->btv", k, grad)  # k^T G: (B, T, d_v)
        grad_k = torch.einsum("btdv,btv->btd", grad, beta * target)
        grad_x = grad
        if ctx.erase:
            grad_k = grad_k - torch.einsum("btdv,btv->btd", state, beta * grad_coef)
            grad_x = grad - k.unsqueeze(-1) * (beta * grad_coef).unsqueeze(-2)
        grad_h = inv_norm * (grad_k - k * (k * grad_k).sum(-1, keepdim=True))  # through k = h / |h|_eps
        grad_v = beta * grad_coef
        grad_beta = (grad_coef * target).sum(-1, keepdim=True)
        if ctx.scalar_state:
            grad_x = grad_x.squeeze(-1)
        return grad_x.to(x.dtype), grad_h.to(h.dtype), grad_v.to(v.dtype), grad_beta.to(beta.dtype), None, None


def fused_delta_update(x, h, v=None, beta=None, mode="delta", k_eps=1e-5):
    """Same contract as `modeling_ddl.delta_update`; less memory in training."""
    if mode == "additive":
        return x + (h if x.dim() == h.dim() else h.unsqueeze(-1))
    if mode not in ("delta", "write_only"):
        raise ValueError(f"delta_update: unknown mode {mode!r}; expected 'delta', 'write_only' or 'additive'.")
    if x.is_cuda and _triton_available():
        from .triton_kernels import triton_delta_update

        logger.info_once("DDL: delta update through the Triton kernels.")
        return triton_delta_update(x, h, v, beta, k_eps, mode == "delta")
    return _DeltaUpdate.apply(x, h, v, beta, k_eps, mode == "delta")


def _triton_available():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["fused_delta_update"]
