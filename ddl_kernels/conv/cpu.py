r"""EC in C++ (conv.cpp): the state written once in forward, its gradient read once in backward.

Serves `reference.causal_token_conv` without history, as the dispatcher calls it: embeddings x `(B, T, d)` and taps
`(K, d_v, d)`, zeros before the first token, into the state `(B, T, d_v, d)`,

    y[t, j, i] = sum_s taps[s, j, i] x[t - (K-1) + s, i]
    dx[t, i] = sum_s sum_j taps[s, j, i] G[t + (K-1) - s, j, i],   dtaps[s, j, i] = sum_t x[t - (K-1) + s, i] G[t, j, i]

for CPU tensors in fp32 or fp64, eager. The step: one new token's EC from the K-1 embeddings before it as the cache
holds them, `(B, d, K-1)` (time last), which it then advances in place, no autograd.
"""

import torch
import torch.nn.functional as F

from .. import Implementation
from ..build import kernels, ready


def serves(x, taps):
    return taps.dtype is x.dtype and taps.is_cpu and ready(x)


def conv_backward(grad, x, taps):
    """The gradients of EC (`reference.causal_token_conv`, taps `(K, d_v, d)`) for the state's gradient G
    `(B, T, d_v, d)`, in differentiable operations (for a second derivative; the C++ kernel serves the first):
        dx[t] = sum_s sum_j taps[s, j] * G[t + (K-1) - s, j]
        dtaps[s, j] = sum over tokens of x[t - (K-1) + s] * G[t, j]
    """
    kernel, seq_len = taps.shape[0], x.shape[1]
    grad = grad.to(x.dtype)
    ahead = F.pad(grad, (0, 0, 0, 0, 0, kernel - 1))  # G then K-1 zero tokens
    behind = F.pad(x, (0, 0, kernel - 1, 0))  # K-1 zero tokens then x
    grad_x = sum((ahead[:, kernel - 1 - s : kernel - 1 - s + seq_len] * taps[s]).sum(-2) for s in range(kernel))
    grad_taps = torch.stack([(behind[:, s : s + seq_len].unsqueeze(-2) * grad).sum((0, 1)) for s in range(kernel)])
    return grad_x, grad_taps.to(taps.dtype)


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, taps):
        ctx.save_for_backward(x, taps)
        return kernels().conv_forward(x, taps)

    @staticmethod
    def backward(ctx, grad):
        x, taps = ctx.saved_tensors
        if torch.is_grad_enabled() or grad.dtype is not x.dtype:  # create_graph: the C++ gradients carry no graph
            return conv_backward(grad, x, taps)
        return tuple(kernels().conv_backward(grad.contiguous(), x, taps))


def run(x, taps):
    x, taps = x.contiguous(), taps.contiguous()
    return _Conv.apply(x, taps) if torch.is_grad_enabled() else kernels().conv_forward(x, taps)


def step_serves(past, x, weight):
    """A decoding step's cached embeddings `(B, d, K-1)` (advanced in place), its embedding `(B, 1, d)` and the weight
    `(K, d, d_v)` as the model keeps it: no autograd (no backward here), one dtype, CPU, eager."""
    return (weight.dtype is past.dtype and x.dtype is past.dtype and weight.is_cpu and weight.is_contiguous()
            and past.is_contiguous() and not torch.is_grad_enabled() and ready(past))


def step_run(past, x, weight):
    return kernels().conv_step(past, x, weight)


CONV = Implementation("C++ EC", ("auto", "triton"), serves, run)
STEP = Implementation("C++ EC step", ("auto", "triton"), step_serves, step_run)

__all__ = ["CONV", "STEP"]
