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


def _dot_k(k, state, scalar_state):
    """k^T X over the features: `(B, T)` for the scalar state, `(B, T, d_v)` otherwise."""
    if scalar_state:
        return torch.linalg.vecdot(k, state)  # a fused multiply-reduce; einsum would go through a batched matmul
    return (k.unsqueeze(-2) @ state).squeeze(-2)


def _dot_channels(grad, coef, scalar_state):
    """sum_j G[..., j] c[j]: `(B, T, d)`."""
    if scalar_state:
        return grad * coef.unsqueeze(-1)
    return (grad @ coef.unsqueeze(-1)).squeeze(-1)


def _outer(k, coef, scalar_state):
    """The rank-1 factors k (x) c, shaped to broadcast against the state."""
    return (k, coef.unsqueeze(-1)) if scalar_state else (k.unsqueeze(-1), coef.unsqueeze(-2))


class _DeltaUpdate(torch.autograd.Function):
    """X_next = X + beta k (v - k^T X) (erase) or X + beta k v (write-only). Inputs v: `(B, T, d_v)`, beta:
    `(B, T, 1)`. Internally the scalar state uses `(B, T)` coefficients and elementwise products."""

    @staticmethod
    def forward(ctx, x, h, v, beta, k_eps, erase):
        acc = torch.promote_types(x.dtype, torch.float32)
        scalar_state = x.dim() == h.dim()
        if scalar_state:
            v, beta = v.squeeze(-1), beta.squeeze(-1)
        h32 = h.to(acc)
        k = h32 * torch.rsqrt(torch.linalg.vecdot(h32, h32) + k_eps**2).unsqueeze(-1)
        coef = v.to(acc)
        if erase:
            coef = coef - _dot_k(k, x.to(acc), scalar_state)
        coef = beta * coef
        left, right = _outer(k.to(x.dtype), coef.to(x.dtype), scalar_state)
        ctx.save_for_backward(x, h, v, beta)
        ctx.k_eps, ctx.erase, ctx.scalar_state = k_eps, erase, scalar_state
        return torch.addcmul(x, left, right)

    @staticmethod
    def backward(ctx, grad_out):
        x, h, v, beta = ctx.saved_tensors
        scalar = ctx.scalar_state
        acc = torch.promote_types(x.dtype, torch.float32)
        state, grad = x.to(acc), grad_out.to(acc)
        h32 = h.to(acc)
        inv_norm = torch.rsqrt(torch.linalg.vecdot(h32, h32) + ctx.k_eps**2).unsqueeze(-1)
        k = h32 * inv_norm
        target = v.to(acc)
        if ctx.erase:
            target = target - _dot_k(k, state, scalar)  # v - k^T X
        grad_coef = _dot_k(k, grad, scalar)  # k^T G
        grad_k = _dot_channels(grad, beta * target, scalar)
        grad_x = grad
        if ctx.erase:
            grad_k = grad_k - _dot_channels(state, beta * grad_coef, scalar)
            grad_x = torch.addcmul(grad, *_outer(k, -beta * grad_coef, scalar))
        grad_h = inv_norm * torch.addcmul(grad_k, k, -torch.linalg.vecdot(k, grad_k).unsqueeze(-1))  # k = h/|h|_eps
        grad_v = beta * grad_coef
        grad_beta = (grad_coef * target).sum(-1, keepdim=True) if not scalar else grad_coef * target
        if scalar:
            grad_v, grad_beta = grad_v.unsqueeze(-1), grad_beta.unsqueeze(-1)
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
