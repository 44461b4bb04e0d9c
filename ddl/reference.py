r"""The specifications: DDL's operations in plain PyTorch, written to read like the paper. They are what runs wherever
no faster implementation serves (autograd gives their gradients, Inductor fuses them under torch.compile), and every
faster path (ddl_kernels' C++ and Triton, chosen in `ddl.ops`) is tested against them on outputs and gradients.

- `delta_update`: the residual update of one sublayer (paper Eq. 2.1-2.2), with the write-only and additive controls.
- `delta_gate`, `delta_value`, `delta_residual`: where beta and v come from, and the whole residual seam.
- `causal_token_conv` (EC), `causal_token_readout` (TC; CC its one-tap case): the expanded state's token convolutions.
- `folded_conv_read`: CC's conv and read vector as the one matrix its readout applies.

The state X is `(B, T, d)` for d_v = 1 and `(B, T, d_v, d)` (d_v rows of contiguous d) for the expanded state."""

import torch
import torch.nn.functional as F


DELTA_MODES = ("delta", "write_only", "additive")


def delta_update(x, h, v=None, beta=None, mode="delta", k_eps=1e-5):
    r"""The DDL residual update of one sublayer (paper Eq. 2.1-2.2).

        delta:       X_next = X + beta k (v^T - k^T X) = (I - beta k k^T) X + beta k v^T
        write_only:  X_next = X + beta k v^T                   (same branches, no erase term)
        additive:    X_next = X + h                             (the plain residual; h added to every value channel)

    with the direction k = h / sqrt(|h|^2 + k_eps^2), the sublayer output normalised (zero when h = 0).

    Args:
        x: the residual state X, `(B, T, d)` for d_v = 1 or `(B, T, d_v, d)` for the expanded state.
        h: `(B, T, d)`, the sublayer output F(c) that gives the direction k.
        v: `(B, T, d_v)`, the target value (unused by `additive`).
        beta: `(B, T, 1)`, the gate in [0, 2] (unused by `additive`).
    Returns X_next like `x`. k, k^T X and beta (v - k^T X) are in fp32 (as the authors' code, for bf16/fp16); the
    state and the rank-1 write stay in the model dtype."""
    scalar_state = x.dim() == h.dim()
    if mode == "additive":
        return x + (h if scalar_state else h.unsqueeze(-2))
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 at least (fp64 stays fp64)
    h32 = h.to(acc)
    k = h32 * torch.rsqrt(h32.pow(2).sum(-1, keepdim=True) + k_eps**2)  # (B, T, d), |k| < 1
    state = x.unsqueeze(-2) if scalar_state else x  # (B, T, d_v, d)
    if mode == "delta":
        readout = _dot(k, state)  # k^T X: (B, T, d_v), in k's dtype
        coef = beta * (v.to(acc) - readout)  # (B, T, d_v)
    elif mode == "write_only":
        coef = beta * v.to(acc)
    else:
        raise ValueError(f"delta_update: unknown mode {mode!r}; expected one of {DELTA_MODES}.")
    out = state + coef.to(x.dtype).unsqueeze(-1) * k.to(x.dtype).unsqueeze(-2)  # rank-1 write along k
    return out.squeeze(-2) if scalar_state else out


def delta_gate(c, weight, bias, hidden_weight=None, hidden_bias=None):
    r"""The gate beta = 2 sigmoid(w . c + b) in (0, 2), `(B, T, 1)`, in at least fp32 (only the logit, for stability).

    With `hidden_weight` `(H, d)` and `hidden_bias` `(H,)` (or None: no hidden bias, as the authors' gate), the
    two-layer gate 2 sigmoid(w . tanh(W_1 c + b_1) + b).
    c: `(B, T, d)`, the normalised sublayer input; weight: `(d,)` (or `(H,)`); bias: `(1,)`."""
    acc = torch.promote_types(c.dtype, torch.float32)  # fp32 at least (fp64 stays fp64)
    if hidden_weight is not None:
        c = torch.tanh(F.linear(c.to(acc), hidden_weight.to(acc), None if hidden_bias is None else hidden_bias.to(acc)))
    return 2.0 * torch.sigmoid(_project(c, weight.to(acc).unsqueeze(0), bias, exact=True))  # (also under autocast)


def delta_value(u, weight, bias, scale=4.0):
    r"""The target v = scale sigmoid(W_v u + b_v) in (0, scale), or W_v u + b_v when `scale` is None: `(B, T, d_v)`.

    u: `(B, T, d)`, the value input; weight: `(d_v, d)`; bias: `(d_v,)`."""
    v = _project(u, weight, bias)
    return v if scale is None else scale * torch.sigmoid(v)


def _dot(k, state):
    """k^T X `(B, T, d_v)` of k `(B, T, d)` and the state `(B, T, d_v, d)` in k's dtype, also under autocast: one bmm
    where both have it outside autocast, else products summed over d (autograd keeps the state; Inductor fuses them)."""
    autocast = k.device.type != "meta" and torch.is_autocast_enabled(k.device.type)  # (meta: no autocast to ask)
    plain = state.dtype == k.dtype and not (torch.compiler.is_compiling() or autocast)
    return torch.einsum("btd,btvd->btv", k, state) if plain else (k.unsqueeze(-2) * state).sum(-1)


def _project(x, weight, bias, exact=False):
    """F.linear(x, weight, bias) to a gate's or value's few outputs `(..., N)`; products summed over d (promoted:
    autograd keeps x, not a wider copy) where the dtypes differ, under autocast if `exact`, or traced (fused)."""
    autocast = x.device.type != "meta" and torch.is_autocast_enabled(x.device.type)
    plain = not torch.compiler.is_compiling() and (not exact if autocast else x.dtype == weight.dtype)
    return F.linear(x, weight, bias.to(weight.dtype)) if plain else (x.unsqueeze(-2) * weight).sum(-1) + bias


def constant_value(x, constant):
    """A fixed target v = `constant` on every value channel of the state x: `(B, T, d_v)`, fp32."""
    shape = x.shape[:-1] if x.dim() == 4 else (*x.shape[:-1], 1)
    return torch.full(shape, float(constant), dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)


def delta_residual(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale=4.0, k_eps=1e-5,
                   mode="delta", gate_hidden=None, v_constant=None):
    r"""One sublayer's whole residual seam: the gate, the value and the update,

        X_next = delta_update(X, h, delta_value(u), delta_gate(c))

    x: the state X; h: the sublayer output; c: the normalised sublayer input; u: the value input (c, or the
    un-normalised sublayer input x_in); `gate_hidden`: `(W_1, b_1)` of a two-layer gate (b_1 may be None), or None;
    `v_constant`: a fixed target instead of `delta_value` (then `value_weight`/`value_bias` are None)."""
    if mode == "additive":
        return delta_update(x, h, mode=mode)
    beta = delta_gate(c, gate_weight, gate_bias, *(gate_hidden or ()))
    v = constant_value(x, v_constant) if v_constant is not None else delta_value(u, value_weight, value_bias, v_scale)
    return delta_update(x, h, v, beta, mode=mode, k_eps=k_eps)


def folded_conv_read(conv_weight, read):
    r"""CC's conv form (the authors': K taps along d_v, "same" zero padding p = (K-1) // 2, then the read vector r
    `(d_v,)`) as the matrix `(d, d_v)` its readout applies: w[i, j] = sum_m c[i, m] r[j + p - m] (0 outside d_v)."""
    kernel, pad = conv_weight.shape[1], (conv_weight.shape[1] - 1) // 2
    windows = F.pad(read, (kernel, kernel)).unfold(0, read.shape[0], 1)  # windows[s, j] = r[s + j - K] (0 outside)
    shifted = windows[pad + 1 : pad + kernel + 1].flip(0)  # (K, d_v): shifted[m, j] = r[j + p - m]
    if torch.compiler.is_compiling():  # (as products summed over K, Inductor fuses it; a matmul stays a call)
        return (conv_weight.unsqueeze(-1) * shifted).sum(1)
    return conv_weight @ shifted


def _causal_window(x, kernel, history):
    """x with the K-1 inputs before it prepended (the cached history, or zeros at the start of a sequence)."""
    if kernel == 1:  # no window (CC): x itself, not a copy that autograd would keep for backward
        return x
    history = x.new_zeros(x.shape[0], kernel - 1, *x.shape[2:]) if history is None else history
    return torch.cat([history, x], dim=1)


def causal_token_conv(x, weight, history=None):
    r"""EC: depthwise causal convolution over the token axis, from d input features to d x d_v channels.

        y[t, j, i] = sum_s weight[s, i, j] * x[t - (K - 1) + s, i]

    x: `(B, T, d)`; weight: `(K, d, d_v)`, tap K-1 is the current token; history: `(B, K-1, d)`, the inputs
    before x (zeros at the start of a sequence). Returns the state layout `(B, T, d_v, d)`."""
    kernel, seq_len = weight.shape[0], x.shape[1]
    full = _causal_window(x, kernel, history).unsqueeze(-2)  # (B, K-1+T, 1, d)
    weight = weight.transpose(1, 2).contiguous()  # (K, d_v, d): a tiny copy, so every product runs along d
    out = full[:, kernel - 1 :] * weight[kernel - 1]
    for s in range(kernel - 1):
        out.addcmul_(full[:, s : s + seq_len], weight[s])  # in place: no new state-sized tensor per tap
    return out


def causal_token_readout(x, weight, history=None):
    r"""TC: a causal depthwise token convolution of the state and the read over its d_v channels, in one step.

        y[t, i] = sum_j sum_s weight[s, i, j] * x[t - (K - 1) + s, j, i]      (weight = conv taps c * read r)

    x: `(B, T, d_v, d)`; weight: `(K, d, d_v)`; history: `(B, K-1, d_v, d)` or None (zeros). Returns `(B, T, d)`.
    CC is the one-tap case (K = 1, weight = w). Products and sums in at least fp32."""
    kernel, seq_len = weight.shape[0], x.shape[1]
    full = x if history is None else torch.cat([history, x], dim=1)  # (B, H+T, d_v, d), H = 0 or K-1
    length, weight = full.shape[1], weight.transpose(1, 2).contiguous()  # (K, d_v, d), like the state
    dtype = torch.promote_types(x.dtype, weight.dtype)
    acc = torch.promote_types(dtype, torch.float32)
    y = 0
    for s in range(kernel):  # tap s reads the input lag = K-1-s tokens before (zeros before the sequence)
        lag = kernel - 1 - s
        tap = (full * weight[s].to(acc)).sum(-2)  # (B, H+T, d): products and sums in fp32 (no copy of the state)
        y = y + (tap if lag == 0 else F.pad(tap, (0, 0, lag, 0))[:, :length])  # (no guard on a symbolic T)
    return y[:, length - seq_len :].to(dtype)


__all__ = ["DELTA_MODES", "causal_token_conv", "causal_token_readout", "delta_gate", "delta_residual", "delta_update",
           "delta_value", "folded_conv_read"]
