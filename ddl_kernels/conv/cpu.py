r"""EC in C++ (conv.cpp): the state written once in forward, its gradient read once in backward.

Serves `reference.causal_token_conv` without history, as the dispatcher calls it: embeddings x `(B, T, d)` and taps
`(K, d_v, d)`, zeros before the first token, into the state `(B, T, d_v, d)`,

    y[t, j, i] = sum_s taps[s, j, i] x[t - (K-1) + s, i]
    dx[t, i] = sum_s sum_j taps[s, j, i] G[t + (K-1) - s, j, i],   dtaps[s, j, i] = sum_t x[t - (K-1) + s, i] G[t, j, i]

for CPU tensors in fp32 or fp64, eager. The step: one new token's EC from the K-1 embeddings before it as the cache
holds them, `(B, d, K-1)` (time last), which it then advances in place, no autograd.
"""

import torch

from .. import refuse_second_derivative
from ..build import kernels, ready


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, taps):
        ctx.save_for_backward(x, taps)
        return kernels().conv_forward(x, taps)

    @staticmethod
    def backward(ctx, grad):
        refuse_second_derivative("the C++ EC")
        x, taps = ctx.saved_tensors
        return tuple(kernels().conv_backward(grad.to(x.dtype).contiguous(), x, taps))


def run(x, taps):
    """`reference.causal_token_conv` without history (None where it does not serve: one dtype, fp32 or fp64, CPU,
    eager)."""
    if not (taps.dtype is x.dtype and taps.is_cpu and ready(x)):
        return None
    x, taps = x.contiguous(), taps.contiguous()
    return _Conv.apply(x, taps) if torch.is_grad_enabled() else kernels().conv_forward(x, taps)


def step(past, x, weight):
    """A decoding step's EC from its cached embeddings `(B, d, K-1)` (advanced in place), its embedding `(B, 1, d)`
    and the weight `(K, d, d_v)` as the model keeps it (None where it does not serve: no autograd, one dtype, CPU,
    eager)."""
    if not (weight.dtype is past.dtype and x.dtype is past.dtype and weight.is_cpu and weight.is_contiguous()
            and past.is_contiguous() and not torch.is_grad_enabled() and ready(past)):
        return None
    return kernels().conv_step(past, x, weight)


__all__ = ["run", "step"]
