"""The residual seam: C++ for CPU (residual.cpp, cpu.py); the seam and the delta update alone in Triton for CUDA
(triton.py)."""


def value_input_kind(x, h, c, u):
    """What the value reads, by identity (so before any copy): 1 when u is c, 2 when u is the state x of d_v = 1
    (x `(B, T, d)`, like h), 0 when u is its own tensor. The kernels then read u from c or x, and the backward adds
    u's gradient into theirs."""
    return 1 if u is c else (2 if u is x and x.dim() == h.dim() else 0)
