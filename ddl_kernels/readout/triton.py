r"""The token convolutions of the expanded state in Triton for CUDA: the readout (TC; CC is its one-tap case) maps the
state to a vector, EC (ddl_kernels/conv) maps the embeddings to a state, and each one's input gradient is the other's
shape of computation run backwards in time. So one kernel serves both forward (`_window_row`, in `_window_kernel`: a
K-token window of states -> a d-vector per token, or of d-vectors -> a (d_v x d) tile per token), and the backward is
two launches: `_window_grads_kernel` (the input's gradient, and per-lag products of the taps' summed over a chunk of
tokens) and `_sum_parts_kernel` (the chunks' partial sums added). Each program handles one token (forward) or chunk
(backward) and one block of features; accumulation is in fp32.

A readout is a sublayer's input, which the sublayer's RMSNorm reads next: given its gain (`readout_and_norm`, and
`window_step_norm` for a decoding step), a program holds a token's whole row and also writes that norm, in
LlamaRMSNorm's roundings (`_store_rms_norm`); in backward `_norm_bwd_kernel` turns the normed output's gradient into
the readout's (added to its own) and sums the gain's: the norm's eight launches forward and about fifteen backward
(bf16) become none and two. The residual seam uses the same norm where it makes the readout itself (CC), and there
reads the readout out of the new state again in backward rather than keeping it.

Serves `reference.causal_token_readout` without history (x `(B, T, d_v, d)`, taps `(K, d_v, d)`, zeros before the
first token) for CUDA tensors other than fp64, outside traces (`ddl_kernels.eager`). Opt-in
(`ddl_implementation="triton"`; docs/gpu.md says why); tested on CPU through Triton's interpreter
(tests/test_kernels.py), and compiled on an H200.
"""

import torch
import triton
import triton.language as tl

from .. import eager, fallible, refuse_second_derivative, serving


# Token convolutions. A program's output row `t` reads source rows src = t + offset + direction * s for the lags
# s = 0..K-1 (rows outside [0, L_src) are zeros): offset = (L_src - T_out) - (K - 1), direction +1 for the causal
# forward; the input gradients run the same relation backwards (offset negated, direction -1).

@triton.jit
def _feature_block(d, dv, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's block of features: their columns, and the offsets and mask of a (d_v x block) state tile."""
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    chans = tl.arange(0, BLOCK_V)
    return cols, chans[:, None] * d + cols[None, :], (chans < dv)[:, None] & (cols < d)[None, :]

@triton.jit
def _row_in_range(cols, row, n_rows):
    """0 <= row < n_rows, as a block over the columns (the interpreter mishandles scalar & block masks)."""
    rows = cols * 0 + row
    return (rows >= 0) & (rows < n_rows)

@triton.jit
def _window_row(in_ptr, taps, out_ptr, b, t, row, l_src, offset, d, dv, tap_stride_k, cols, tile, tile_ok,
                READ: tl.constexpr, K: tl.constexpr, DIRECTION: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_V: tl.constexpr):
    """Output row `row` (token t of sequence b) of a K-row window of the input weighted by the taps (this block of
    features; `taps` their tile's pointers at lag 0):
    READ:      out[t] = sum_s sum_j taps[s, j] * in[src(t, s), j]   (B, t_out, d) from a state (B, l_src, d_v, d)
    otherwise: out[t, j] = sum_s taps[s, j] * in[src(t, s)]        (B, t_out, d_v, d) from vectors (B, l_src, d)
    """
    acc = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)
    for s in tl.static_range(K):
        src = t + offset + DIRECTION * s
        ok = _row_in_range(cols, src, l_src)
        w = tl.load(taps + s * tap_stride_k, mask=tile_ok, other=0.0).to(tl.float32)
        if READ:
            x = tl.load(in_ptr + (b * l_src + src) * dv * d + tile, mask=tile_ok & ok[None, :], other=0.0)
            acc += x.to(tl.float32) * w
        else:
            x = tl.load(in_ptr + (b * l_src + src) * d + cols, mask=(cols < d) & ok, other=0.0)
            acc += w * x.to(tl.float32)[None, :]
    if READ:
        out = tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * d + cols, out, mask=cols < d)
    else:
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * dv * d + tile, out, mask=tile_ok)
    return out

@triton.jit
def _store_rms_norm(y, gain_ptr, normed_ptr, cols, d, norm_eps):
    """The RMSNorm of a whole row y (in its storage dtype; 0 past d) as LlamaRMSNorm computes it, gain * (y / sqrt(
    mean(y^2) + eps)), the normalised row rounded to y's dtype before the gain multiplies it, at normed_ptr + cols."""
    row = y.to(tl.float32)
    normal = (row * tl.rsqrt(tl.sum(row * row, axis=0) / d + norm_eps)).to(y.dtype).to(tl.float32)
    gain = tl.load(gain_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
    tl.store(normed_ptr + cols, (gain * normal).to(normed_ptr.dtype.element_ty), mask=cols < d)

@triton.jit
def _window_kernel(
    in_ptr, taps_ptr, out_ptr, gain_ptr, normed_ptr, t_out, l_src, offset, d, dv, tap_stride_k, tap_stride_v,
    tap_stride_d, norm_eps, READ: tl.constexpr, NORM: tl.constexpr, K: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The forward convolution (`_window_row`, causal): one program per output token and block of features; NORM (a
    readout whose block is the whole row): also the next sublayer's RMSNorm of it (`_store_rms_norm`)."""
    row = tl.program_id(0).to(tl.int64)
    cols, tile, tile_ok = _feature_block(d, dv, BLOCK_D, BLOCK_V)
    taps = taps_ptr + tl.arange(0, BLOCK_V)[:, None] * tap_stride_v + cols[None, :] * tap_stride_d
    out = _window_row(in_ptr, taps, out_ptr, row // t_out, row % t_out, row, l_src, offset, d, dv, tap_stride_k, cols,
                      tile, tile_ok, READ, K, 1, BLOCK_D, BLOCK_V)
    if NORM:
        _store_rms_norm(out, gain_ptr, normed_ptr + row * d, cols, d, norm_eps)

@triton.jit
def _window_grads_kernel(
    x_ptr, grad_ptr, taps_ptr, gx_ptr, part_ptr, t_out, l_src, offset, d, dv, n_chunks, tap_stride_k, tap_stride_v,
    tap_stride_d, part_stride_v, part_stride_d,
    READ: tl.constexpr, GRAD_X: tl.constexpr, GRAD_TAPS: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Both gradients of `_window_kernel` for one chunk of CHUNK rows of one sequence and a block of features:
    GRAD_X: the input's rows r of the chunk, the forward's relation run backwards in time (the other kind of
      window): dx[r] = sum_s taps[s] G[r - offset - s];
    GRAD_TAPS: part[chunk, s] = sum over the chunk's output tokens t of x[t + offset + s] * G[t] (per lag s,
      `(d_v, d)` in fp32, stored at the strides part_stride_v, part_stride_d: the taps' layout), the chunks'
      partial sums added by `_sum_parts_kernel`. One of x / G is the state (d_v x d), the other a vector."""
    program = tl.program_id(0).to(tl.int64)
    b, chunk = program // n_chunks, program % n_chunks
    cols, tile, tile_ok = _feature_block(d, dv, BLOCK_D, BLOCK_V)
    if GRAD_X:
        taps = taps_ptr + tl.arange(0, BLOCK_V)[:, None] * tap_stride_v + cols[None, :] * tap_stride_d
        for i in range(CHUNK):
            r = chunk * CHUNK + i
            if r < l_src:
                _window_row(grad_ptr, taps, gx_ptr, b, r, b * l_src + r, t_out, -offset, d, dv, tap_stride_k, cols,
                            tile, tile_ok, not READ, K, -1, BLOCK_D, BLOCK_V)
    if GRAD_TAPS:
        part = part_ptr + tl.arange(0, BLOCK_V)[:, None] * part_stride_v + cols[None, :] * part_stride_d
        for s in tl.static_range(K):
            acc = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)
            for i in range(CHUNK):
                t = chunk * CHUNK + i
                src = t + offset + s
                ok = _row_in_range(cols, src, l_src) & _row_in_range(cols, t, t_out)
                if READ:
                    a = tl.load(x_ptr + (b * l_src + src) * dv * d + tile, mask=tile_ok & ok[None, :], other=0.0)
                    g = tl.load(grad_ptr + (b * t_out + t) * d + cols, mask=(cols < d) & ok, other=0.0)
                    acc += a.to(tl.float32) * g.to(tl.float32)[None, :]
                else:
                    a = tl.load(x_ptr + (b * l_src + src) * d + cols, mask=(cols < d) & ok, other=0.0)
                    g = tl.load(grad_ptr + (b * t_out + t) * dv * d + tile, mask=tile_ok & ok[None, :], other=0.0)
                    acc += a.to(tl.float32)[None, :] * g.to(tl.float32)
            tl.store(part + (program * K + s) * dv * d, acc, mask=tile_ok)


@triton.jit(do_not_specialize=["n_parts"])  # (a seam's probe on one token must compile the variant it will launch)
def _sum_parts_kernel(part_ptr, out_ptr, n_parts, width, BLOCK: tl.constexpr):
    """out = the sum of the partial rows `(n_parts, width)` (fp32, in order), in out's dtype."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    rows = part_ptr + cols
    for _ in range(n_parts):
        acc += tl.load(rows, mask=ok, other=0.0)
        rows += width  # (pointer arithmetic: 64-bit, past 2^31 elements)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_parts(parts, dtype, out=None):
    """The rows of `parts` `(n, ...)` (fp32) added, `(...)` in `dtype` (into `out`, whose elements lie in the order of
    each row's, where given): one launch (a sum and a cast would be two)."""
    out = torch.empty(parts.shape[1:], dtype=dtype, device=parts.device) if out is None else out
    width = out.numel()
    with torch.cuda.device_of(parts):
        _sum_parts_kernel[(triton.cdiv(width, 1024),)](parts, out, parts.shape[0], width, BLOCK=1024)
    return out


@triton.jit(do_not_specialize=["tokens", "per_program"])
def _norm_bwd_kernel(
    y_ptr, taps_ptr, gain_ptr, grad_normed_ptr, grad_y_ptr, out_ptr, part_ptr, tokens, per_program, d, dv,
    tap_stride_v, tap_stride_d, norm_eps, GAIN_GRAD: tl.constexpr, FROM_STATE: tl.constexpr, Y: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """The RMSNorm's backward for `per_program` consecutive tokens, in fp32: with n = y r, r = 1/sqrt(mean(y^2) + eps)
    and dn = gain dL/dnormed, dL/dy = r (dn - n mean(dn n)), plus y's gradient from its other readers; and
    (GAIN_GRAD) this program's row of dL/dgain = sum over its tokens of dL/dnormed n (n as the forward rounded it, to
    y's dtype Y). FROM_STATE: y_ptr is the state `(N, d_v, d)` y was read out of by one tap `(d_v, d)` (at its
    strides), and y is read out of it again, summed in fp32 and rounded to Y as the forward's readout."""
    first = tl.program_id(0).to(tl.int64) * per_program
    count = tl.minimum(per_program, tokens - first).to(tl.int32)
    rows, tile, tile_ok = _feature_block(d, dv, BLOCK_D, BLOCK_V)  # (one block: the whole row)
    row_ok = rows < d
    if FROM_STATE:
        taps = tl.load(taps_ptr + tl.arange(0, BLOCK_V)[:, None] * tap_stride_v + rows[None, :] * tap_stride_d,
                       mask=tile_ok, other=0.0).to(tl.float32)
    gain = tl.load(gain_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    total = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for token in range(count):
        at = (first + token) * d + rows
        if FROM_STATE:
            state = tl.load(y_ptr + (first + token) * dv * d + tile, mask=tile_ok, other=0.0).to(tl.float32)
            y = tl.sum(state * taps, axis=0).to(Y).to(tl.float32)
        else:
            y = tl.load(y_ptr + at, mask=row_ok, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(y * y, axis=0) / d + norm_eps)
        grad_normed = tl.load(grad_normed_ptr + at, mask=row_ok, other=0.0).to(tl.float32)
        dn = grad_normed * gain
        grad = inv * (dn - y * inv * (tl.sum(dn * y, axis=0) * inv / d))
        grad += tl.load(grad_y_ptr + at, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, grad, mask=row_ok)
        if GAIN_GRAD:
            total += grad_normed * (y * inv).to(Y).to(tl.float32)
    if GAIN_GRAD:
        tl.store(part_ptr + tl.program_id(0).to(tl.int64) * d + rows, total, mask=row_ok)


@triton.jit
def _step_kernel(
    past_ptr, x_ptr, w_ptr, out_ptr, gain_ptr, normed_ptr, d, dv, w_stride_k, w_stride_d, w_stride_v, norm_eps,
    READ: tl.constexpr, NORM: tl.constexpr, K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """A decoding step of the token convolutions for one sequence and block of features, from the window of the K-1
    cached inputs (`past`, time last) then x, the products summed in fp32 in `_window_kernel`'s order of taps; then
    the window advanced in place (this program's channels; barriers order every read of a slot before its write).
    READ (TC):  out[i] = sum_j sum_s w[s, i, j] window[j*d + i, s]    past `(d_v*d, K-1)`, x `(d_v, d)`, out `(d,)`
    otherwise (EC):  out[j, i] = sum_s w[s, i, j] window[i, s]        past `(d, K-1)`, x `(d,)`, out `(d_v, d)`
    NORM (a readout whose block is the whole row): also the next sublayer's RMSNorm of out (`_store_rms_norm`)."""
    b = tl.program_id(0).to(tl.int64)
    cols, tile, tile_ok = _feature_block(d, dv, BLOCK_D, BLOCK_V)  # tile: j * d + i (the cache's channel order)
    taps = w_ptr + (cols[None, :] * w_stride_d + tl.arange(0, BLOCK_V)[:, None] * w_stride_v)
    if READ:
        rows, rows_ok, x = past_ptr + (b * dv * d + tile) * (K - 1), tile_ok, x_ptr + b * dv * d + tile
    else:
        rows, rows_ok, x = past_ptr + (b * d + cols) * (K - 1), cols < d, x_ptr + b * d + cols
    x = tl.load(x, mask=rows_ok, other=0.0)
    acc = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)
    for s in tl.static_range(K):
        if s < K - 1:
            value = tl.load(rows + s, mask=rows_ok, other=0.0)
        else:
            value = x
        w = tl.load(taps + s * w_stride_k, mask=tile_ok, other=0.0).to(tl.float32)
        if READ:
            acc += value.to(tl.float32) * w
        else:
            acc += w * value.to(tl.float32)[None, :]
    for s in tl.static_range(K - 1):  # the advance: slot s takes slot s + 1 (the last takes x)
        if s + 1 < K - 1:
            following = tl.load(rows + s + 1, mask=rows_ok, other=0.0)
        else:
            following = x
        tl.debug_barrier()  # (every thread's reads of slot s done: above, or just before as slot s + 1)
        tl.store(rows + s, following, mask=rows_ok)
    if READ:
        out = tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + b * d + cols, out, mask=cols < d)
        if NORM:
            _store_rms_norm(out, gain_ptr, normed_ptr + b * d, cols, d, norm_eps)
    else:
        tl.store(out_ptr + b * dv * d + tile, acc.to(out_ptr.dtype.element_ty), mask=tile_ok)


@triton.jit
def _fold_kernel(c_ptr, r_ptr, w_ptr, d, dv, K: tl.constexpr, PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    """CC's folded readout matrix for one block of features: w[i, j] = sum_m c[i, m] r[j + PAD - m] (fp32 sums),
    c `(d, K)`, r `(d_v,)`, w `(d, d_v)`."""
    rows = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_V)
    acc = tl.zeros((BLOCK_D, BLOCK_V), dtype=tl.float32)
    for m in tl.static_range(K):
        c = tl.load(c_ptr + rows * K + m, mask=rows < d, other=0.0).to(tl.float32)
        at = cols + PAD - m
        r = tl.load(r_ptr + at, mask=(at >= 0) & (at < dv) & (cols < dv), other=0.0).to(tl.float32)
        acc += c[:, None] * r[None, :]
    tl.store(w_ptr + rows[:, None] * dv + cols[None, :], acc.to(w_ptr.dtype.element_ty),
             mask=(rows < d)[:, None] & (cols < dv)[None, :])

@triton.jit
def _fold_grads_kernel(c_ptr, r_ptr, gw_ptr, gc_ptr, gr_ptr, d, dv, gw_stride_d, gw_stride_v, K: tl.constexpr,
                       PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr):
    """The fold's gradients from G = dL/dw (read at its strides), in one program (the read vector's is a sum over
    every feature):
    dc[i, m] = sum_j G[i, j] r[j + PAD - m],   dr[n] = sum_m sum_i G[i, n - PAD + m] c[i, m]."""
    cols = tl.arange(0, BLOCK_V)
    grad_r = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(0, d, BLOCK_D):
        rows = start + tl.arange(0, BLOCK_D)
        ok = rows < d
        g = tl.load(gw_ptr + rows[:, None] * gw_stride_d + cols[None, :] * gw_stride_v,
                    mask=ok[:, None] & (cols < dv)[None, :], other=0.0).to(tl.float32)
        for m in tl.static_range(K):
            at = cols + PAD - m
            r = tl.load(r_ptr + at, mask=(at >= 0) & (at < dv) & (cols < dv), other=0.0).to(tl.float32)
            tl.store(gc_ptr + rows * K + m, tl.sum(g * r[None, :], axis=1).to(gc_ptr.dtype.element_ty), mask=ok)
            c = tl.load(c_ptr + rows * K + m, mask=ok, other=0.0).to(tl.float32)
            per_j = tl.sum(g * c[:, None], axis=0)  # sum_i G[i, j] c[i, m]: reaches dr[j + PAD - m]
            moved = cols[None, :] == cols[:, None] - PAD + m  # [n, j]: j = n - PAD + m
            grad_r += tl.sum(tl.where(moved, per_j[None, :], 0.0), axis=1)
    tl.store(gr_ptr + cols, grad_r.to(gr_ptr.dtype.element_ty), mask=cols < dv)


def channel_block(dv):
    """The d_v axis of a tile: a power of 2, at least 2 (tl.sum over a length-1 axis is avoided)."""
    return max(2, triton.next_power_of_2(dv))


def _tiles(d, dv):
    """A program's tile of features and channels (up to 128 features, a power of 2), and how many cover d."""
    block_d = min(128, triton.next_power_of_2(d))
    return triton.cdiv(d, block_d), dict(BLOCK_D=block_d, BLOCK_V=channel_block(dv))


def row_tile(d, dv, more=1):
    """A program's tile that holds a token's whole state (d_v x d) and the warps for it: enough that a program's few
    fp32 tiles stay in registers, `more` times that for a program that holds more (compiled for sm_90,
    scripts/triton_sm90.py: the seam's forward with 4 warps keeps d = 1,024 x 4 channels without spilling; the
    readout with its norm, whose K taps' tiles are loaded at once, spills 56 bytes a thread at d = 768 x 4 with 4
    warps and none with 8; at d = 4,096 x 4 the norm's readout and step spill 400-1,000 bytes even with 32, as the
    seam's backward does)."""
    block_d, block_v = triton.next_power_of_2(d), channel_block(dv)
    return dict(BLOCK_D=block_d, BLOCK_V=block_v, num_warps=min(32, more * min(16, max(4, block_d * block_v // 1024))))


def _runs(tokens, device):
    """(programs, tokens per program) of a backward over runs of consecutive tokens (`_programs` of them at most)."""
    per_program = triton.cdiv(tokens, _programs(tokens, device))
    return triton.cdiv(tokens, per_program), per_program


def _programs(tokens, device):
    """How many programs the backward runs (each a run of consecutive tokens, and one row of the weights' partial
    gradients): a few per multiprocessor on a GPU, so that the partial rows summed after it stay few; 8 elsewhere (the
    interpreter), so that the tests' few tokens still share programs."""
    most = torch.cuda.get_device_properties(device).multi_processor_count * 4 if device.type == "cuda" else 8
    return min(tokens, most)


_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _norm_gradients(y, gain, norm_eps, grad_normed, grad_y, gain_grad, taps=None):
    """dL/dy (fp32: the normed output's share added to y's own, `grad_y`) and dL/dgain (where `gain_grad`, else None)
    of the RMSNorm a kernel applied to y: two launches, the backward and the sum of its partial rows. With `taps`
    `(d_v, d)` (one tap), `y` is the state `(..., d_v, d)` y was read out of, which the caller keeps anyway: y itself
    need not be kept, the backward reads it out again."""
    d, tokens = grad_normed.shape[-1], grad_normed.numel() // grad_normed.shape[-1]
    programs, per_program = _runs(tokens, y.device)
    grad = torch.empty(grad_normed.shape, dtype=torch.float32, device=y.device)
    parts = torch.empty(programs, d, dtype=torch.float32, device=y.device) if gain_grad else grad
    dv = 1 if taps is None else taps.shape[0]
    dtype = y.dtype if taps is None else torch.promote_types(y.dtype, taps.dtype)
    blocks = dict(_norm_blocks(d), BLOCK_V=channel_block(dv)) if taps is None else row_tile(d, dv, more=2)
    with torch.cuda.device_of(y):
        _norm_bwd_kernel[(programs,)](
            y, y if taps is None else taps, gain, grad_normed.contiguous(), grad_y.contiguous(), grad, parts, tokens,
            per_program, d, dv, *((0, 0) if taps is None else taps.stride()), norm_eps, GAIN_GRAD=gain_grad,
            FROM_STATE=taps is not None, Y=_TRITON_DTYPES[dtype], **blocks,
        )
    return grad, sum_parts(parts, gain.dtype) if gain_grad else None


def _norm_blocks(d):
    """The norm's backward from y itself: a token's row in one block, and warps enough that it stays in registers (from
    the state: `row_tile`'s, as the forward that read y out of it)."""
    block = triton.next_power_of_2(d)
    return dict(BLOCK_D=block, num_warps=min(16, max(4, block // 256)))


_CHUNK = 64  # rows per program of the gradients


def _window(read, inputs, taps, out, t_out, l_src, offset, gain=None, normed=None, norm_eps=0.0):
    """Launch `_window_kernel`: one program per output token and block of features (with a `gain`, a readout's whole
    row, and its RMSNorm into `normed`)."""
    kernel_size, dv, d = taps.shape
    feature_blocks, tile = (1, row_tile(d, dv, more=2)) if gain is not None else _tiles(d, dv)
    with torch.cuda.device_of(out):
        _window_kernel[(out.shape[0] * t_out, feature_blocks)](
            inputs, taps, out, out if gain is None else gain, out if normed is None else normed, t_out, l_src, offset,
            d, dv, *taps.stride(), norm_eps, READ=read, NORM=gain is not None, K=kernel_size, **tile)
    return out


def _taps_layout(taps):
    """An empty tensor for the taps' gradient: a model's weight `(K, d, d_v)` transposed (as ops passes it) gets its
    gradient in that layout, which then needs no copy into its parameter's; any other taps a contiguous one."""
    kernel_size, dv, d = taps.shape
    if taps.stride(1) == 1 and taps.stride(2) == dv and (kernel_size == 1 or taps.stride(0) == dv * d):
        return torch.empty_strided(taps.shape, taps.stride(), dtype=taps.dtype, device=taps.device)
    return torch.empty_like(taps, memory_format=torch.contiguous_format)


class _TritonTokenWindow(torch.autograd.Function):
    """The causal token convolutions over x with history first (if any), `taps` `(K, d_v, d)`:
        read (TC/CC readout):  y[t] = sum_s sum_j taps[s, j] * x[t + offset + s, j]    x `(B, L, d_v, d)` -> `(B, T, d)`
        spread (EC):           y[t, j] = sum_s taps[s, j] * x[t + offset + s]          x `(B, L, d)` -> `(B, T, d_v, d)`
    The input gradient of each is the other run backwards in time: dx[r] = sum_s taps[s] G[r - offset - s]; both
    gradients come from one kernel, the taps' as partial sums per chunk of tokens added by a second."""

    @staticmethod
    def forward(ctx, x, taps, t_out, read):
        x = x.contiguous()  # (the taps are read at their strides: the model's weight, transposed, is not copied)
        offset = x.shape[1] - t_out - (taps.shape[0] - 1)
        shape = (x.shape[0], t_out, x.shape[-1]) if read else (x.shape[0], t_out, taps.shape[1], x.shape[-1])
        out = x.new_empty(shape, dtype=torch.promote_types(x.dtype, taps.dtype))
        ctx.save_for_backward(x, taps)
        ctx.t_out, ctx.offset, ctx.read = t_out, offset, read
        return _window(read, x, taps, out, t_out, x.shape[1], offset)

    @staticmethod
    def backward(ctx, grad):
        x, taps = ctx.saved_tensors
        return *_window_gradients(ctx, x, taps, grad), None, None


def _window_gradients(ctx, x, taps, grad):
    """The gradients of x and the taps (each None where not needed) of a token convolution from its output's, `grad`:
    two launches, the gradients' kernel and the sum of the taps' partial rows."""
    grad = grad.contiguous()
    grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
    grad_taps = _taps_layout(taps) if ctx.needs_input_grad[1] else None
    (batch, l_src), (kernel_size, dv, d) = x.shape[:2], taps.shape
    n_chunks = triton.cdiv(max(l_src, ctx.t_out), _CHUNK)
    feature_blocks, tile = _tiles(d, dv)
    parts = None if grad_taps is None else torch.empty_strided(
        (batch * n_chunks, *taps.shape), (kernel_size * dv * d, *grad_taps.stride()), dtype=torch.float32,
        device=x.device)
    with torch.cuda.device_of(x):
        _window_grads_kernel[(batch * n_chunks, feature_blocks)](
            x, grad, taps, x if grad_x is None else grad_x, x if parts is None else parts, ctx.t_out, l_src,
            ctx.offset, d, dv, n_chunks, *taps.stride(), *(grad_taps.stride()[1:] if parts is not None else (0, 0)),
            READ=ctx.read, GRAD_X=grad_x is not None, GRAD_TAPS=parts is not None, K=kernel_size, CHUNK=_CHUNK,
            **tile)
    return grad_x, None if parts is None else sum_parts(parts, taps.dtype, out=grad_taps)


class _TritonReadoutNorm(torch.autograd.Function):
    """A readout without history (`_TritonTokenWindow`'s read) and the next sublayer's RMSNorm of it, `gain` and
    `norm_eps` (LlamaRMSNorm's), in one launch whose programs each hold a token's whole row: (y, RMSNorm(y)). In
    backward the norm's gradient joins y's own (`_norm_gradients`, two launches), then the readout's two: the norm's
    launches each way, and autograd's addition of y's two gradients, become those two (as in the residual seam)."""

    @staticmethod
    def forward(ctx, x, taps, gain, norm_eps):
        x = x.contiguous()
        ctx.t_out, ctx.offset, ctx.read, ctx.norm_eps = x.shape[1], 1 - taps.shape[0], True, norm_eps
        y = x.new_empty((*x.shape[:2], x.shape[-1]), dtype=torch.promote_types(x.dtype, taps.dtype))
        normed = torch.empty_like(y, dtype=torch.promote_types(y.dtype, gain.dtype))
        gain = gain.contiguous()  # (read at unit stride, here and in backward)
        _window(True, x, taps, y, ctx.t_out, ctx.t_out, ctx.offset, gain, normed, norm_eps)
        ctx.save_for_backward(x, taps, gain, y)
        return y, normed

    @staticmethod
    def backward(ctx, grad_y, grad_normed):
        refuse_second_derivative("the Triton readout and RMSNorm")  # (its gradients are computed outside autograd)
        x, taps, gain, y = ctx.saved_tensors
        grad, grad_gain = _norm_gradients(y, gain, ctx.norm_eps, grad_normed, grad_y, ctx.needs_input_grad[2])
        return *_window_gradients(ctx, x, taps, grad), grad_gain, None


def token_window(x, taps, read):
    """The readout (`read`) or EC of x by taps `(K, d_v, d)`, zeros before the first token."""
    return _TritonTokenWindow.apply(x, taps, x.shape[1], read)


def serves(x, taps):
    """CUDA, not fp64, `eager`."""
    return x.is_cuda and x.dtype != torch.float64 and eager()


def readout_and_norm(x, taps, gain, norm_eps):
    """`kernels.token_readout_norm`: the readout of x `(B, T, d_v, d)` by taps `(K, d_v, d)`, zeros before the first
    token, and LlamaRMSNorm (`gain`, `norm_eps`) of it, (y, normed), in one launch each way but the norms'."""
    return _TritonReadoutNorm.apply(x, taps, gain, float(norm_eps))


def norm_serves(x, taps, gain, norm_eps):
    """As `serves`, the gain on x's device and not fp64 too."""
    return serves(x, taps) and gain.device == x.device and gain.dtype != torch.float64


def _step(read, past, x, weight, gain=None, norm_eps=0.0):
    """Launch `_step_kernel`: one program per sequence and block of features (with a `gain`, a readout's whole row,
    and (out, its RMSNorm) returned)."""
    kernel_size, d, dv = weight.shape
    shape = (x.shape[0], 1, d) if read else (x.shape[0], 1, dv, d)
    out = x.new_empty(shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    normed = None if gain is None else torch.empty_like(out, dtype=torch.promote_types(out.dtype, gain.dtype))
    feature_blocks, tile = (1, row_tile(d, dv, more=2)) if gain is not None else _tiles(d, dv)
    with torch.cuda.device_of(out):
        _step_kernel[(x.shape[0], feature_blocks)](
            past, x.contiguous(), weight, out, out if gain is None else gain.contiguous(),
            out if normed is None else normed, d, dv, *weight.stride(), float(norm_eps), READ=read, NORM=gain is not None,
            K=kernel_size, **tile)
    return out if gain is None else (out, normed)


def window_step(past, x, weight):
    """`kernels.window_step` (TC: a decoding step's readout from the cached window, advanced in place): one launch."""
    return _step(True, past, x, weight)


def window_step_norm(past, x, weight, gain, norm_eps):
    """`kernels.window_step_norm`: `window_step`, and the next sublayer's RMSNorm (LlamaRMSNorm's: `gain`,
    `norm_eps`) of its readout, (y, normed), in one launch."""
    return _step(True, past, x, weight, gain, norm_eps)


def conv_step(past, x, weight):
    """`kernels.conv_step` (EC: a decoding step's state from the cached embeddings, advanced in place): one launch."""
    return _step(False, past, x, weight)


def step_serves(past, x, weight):
    """A decoding step (`step_shapes`) whose window is contiguous (advanced in place) and in x's dtype, all on one
    CUDA device; not fp64, no autograd, `eager` (a trace advances the cache by the PyTorch path)."""
    return (past.is_cuda and past.device == x.device == weight.device and past.dtype == x.dtype
            and past.dtype != torch.float64 and weight.dtype != torch.float64 and past.is_contiguous()
            and not torch.is_grad_enabled() and eager() and step_shapes(past, x, weight))


def step_norm_serves(past, x, weight, gain, norm_eps):
    """As `step_serves`, the gain on x's device and not fp64 too."""
    return step_serves(past, x, weight) and gain.device == x.device and gain.dtype != torch.float64


def step_shapes(past, x, weight):
    """One token x (TC: `(B, 1, d_v, d)`, EC: `(B, 1, d)`), its window `(B, d_v*d or d, K-1)` and a weight
    `(K, d, d_v)`: the kernel writes where these shapes say (checked, as the C++ step checks them)."""
    kernel_size, d, dv = weight.shape
    token = (x.shape[0], 1, dv, d) if x.dim() == 4 else (x.shape[0], 1, d)
    return x.shape == token and past.shape == (x.shape[0], dv * d if x.dim() == 4 else d, kernel_size - 1)


_FOLD_BLOCK = 128  # features per program of the fold (a few taps and channels each: a small tile)


class _TritonFold(torch.autograd.Function):
    """`reference.folded_conv_read` (CC's conv `(d, K)` and read `(d_v,)` as its readout matrix `(d, d_v)`): one
    launch each way, where the specification's pad, flip and product are 3 forward and 6 backward."""

    @staticmethod
    def forward(ctx, conv_weight, read):
        (d, kernel_size), dv = conv_weight.shape, read.shape[0]
        conv_weight, read = conv_weight.contiguous(), read.contiguous()
        out = conv_weight.new_empty(d, dv, dtype=torch.promote_types(conv_weight.dtype, read.dtype))
        with torch.cuda.device_of(out):
            _fold_kernel[(triton.cdiv(d, _FOLD_BLOCK),)](conv_weight, read, out, d, dv, K=kernel_size,
                                                         PAD=(kernel_size - 1) // 2, BLOCK_D=_FOLD_BLOCK,
                                                         BLOCK_V=channel_block(dv))
        ctx.save_for_backward(conv_weight, read)
        return out

    @staticmethod
    def backward(ctx, grad):
        refuse_second_derivative("the Triton CC fold")
        conv_weight, read = ctx.saved_tensors
        (d, kernel_size), dv = conv_weight.shape, read.shape[0]
        grad_c, grad_r = torch.empty_like(conv_weight), torch.empty_like(read)
        with torch.cuda.device_of(grad_c):
            _fold_grads_kernel[(1,)](conv_weight, read, grad, grad_c, grad_r, d, dv, *grad.stride(), K=kernel_size,
                                     PAD=(kernel_size - 1) // 2, BLOCK_D=_FOLD_BLOCK, BLOCK_V=channel_block(dv))
        return grad_c, grad_r


def fold(conv_weight, read):
    """`ddl.ops.folded_conv_read` in Triton."""
    return _TritonFold.apply(conv_weight, read)


def fold_serves(conv_weight, read):
    """Both on one CUDA device, neither fp64, `eager`."""
    return (conv_weight.is_cuda and read.device == conv_weight.device and torch.float64 not in (
        conv_weight.dtype, read.dtype) and eager())


RUN = serving(serves, fallible("Triton readout", lambda x, taps: token_window(x, taps, read=True)))
NORM = serving(norm_serves, fallible("Triton readout and RMSNorm", readout_and_norm))
STEP = serving(step_serves, fallible("Triton window step", window_step))
STEP_NORM = serving(step_norm_serves, fallible("Triton window step and RMSNorm", window_step_norm))
FOLD = serving(fold_serves, fallible("Triton CC fold", fold))

__all__ = ["FOLD", "NORM", "RUN", "STEP", "STEP_NORM", "channel_block", "conv_step", "fold", "fold_serves",
           "norm_serves", "readout_and_norm", "row_tile", "serves", "step_norm_serves", "step_serves", "step_shapes",
           "sum_parts", "token_window", "window_step", "window_step_norm"]
