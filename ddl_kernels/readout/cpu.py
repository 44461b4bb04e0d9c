r"""The readout of the expanded state in C++ (readout.cpp), forward and backward in one pass each, and a TC decoding
step's readout of its cached window.

Serves `reference.causal_token_readout` (TC; CC is its one-tap case) without history, as the dispatcher calls it:
a state x `(B, T, d_v, d)` and taps `(K, d_v, d)` (the weight in the state's layout), zeros before the first token,

    y[t, i] = sum_s sum_j taps[s, j, i] x[t - (K-1) + s, j, i]
    dx[t, j, i] = sum_s taps[s, j, i] G[t + (K-1) - s, i],   dtaps[s, j, i] = sum_t x[t - (K-1) + s, j, i] G[t, i]

for CPU tensors in fp32 or fp64, eager. The window step: one new token's readout from the K-1 inputs before it as
the cache holds them, `(B, d_v*d, K-1)` (channel j*d + i, time last), which it then advances in place (the oldest
dropped, the new one appended), no autograd: the readout of the window those inputs and the new one make.
"""

import torch

from .. import refuse_second_derivative
from ..build import kernels, ready


class _Readout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, taps):
        ctx.save_for_backward(x, taps)
        return kernels().readout_forward(x.contiguous(), taps)

    @staticmethod
    def backward(ctx, grad):
        refuse_second_derivative("the C++ readout")
        x, taps = ctx.saved_tensors
        return tuple(kernels().readout_backward(grad.to(x.dtype).contiguous(), x.contiguous(), taps))


def run(x, taps):
    """`reference.causal_token_readout` without history (None where it does not serve: taps and x of one dtype, fp32
    or fp64, on the CPU, eager)."""
    if not (taps.dtype is x.dtype and taps.is_cpu and ready(x)):
        return None
    if torch.is_grad_enabled():
        return _Readout.apply(x, taps.contiguous())
    return kernels().readout_forward(x.contiguous(), taps.contiguous())  # (a stride-0 repeated state is copied)


def step(past, x, weight):
    """A decoding step's readout from its cached inputs `(B, d_v*d, K-1)` (advanced in place), its state
    `(B, 1, d_v, d)` and weight `(K, d, d_v)` (None where it does not serve: no autograd, one dtype, CPU, eager)."""
    if not (weight.dtype is past.dtype and x.dtype is past.dtype and weight.is_cpu and past.is_contiguous()
            and not torch.is_grad_enabled() and ready(past)):
        return None
    return kernels().window_step(past, x, weight)  # (the weight read in place where kept as taps (d_v, d, K))


__all__ = ["run", "step"]
