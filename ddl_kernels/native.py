"""The C++ CPU kernels' Python side: each C function of the library (`<op>/<op>.cpp`) behind a function that takes and
returns tensors, as `build.kernels()` hands them to the operations (`<op>/cpu.py`).

The library knows nothing of torch (it builds where torch is not, ddl_kernels/extension.py): here the outputs are
allocated with torch, and the C functions get the tensors' pointers, sizes and dtype (fp32 or fp64) and the thread
count (`torch.get_num_threads()`, per call). A decoding step makes about two calls per sublayer, so each wrapper does
only what it must: the shape and dtype checks that keep the C code inside its tensors, the allocations, and one
ctypes call with one argument, the others packed into a buffer in the order of the C function's struct (each field 8
bytes: int64, double or a pointer, 0 for none). ctypes converting 10-25 arguments one by one cost 3-7 us a call
here, more than the kernel at batch 1."""

import ctypes
import struct

import torch


# each C function's struct (<op>/<op>.cpp): q int64, d double, P pointer; f64 and threads first
_ARGUMENTS = {
    "residual_forward": struct.Struct("2q8P2d4q5P2q"),
    "residual_backward": struct.Struct("2q8Pd5q11P2q"),
    "readout_forward": struct.Struct("2q3P5q3P"),
    "readout_backward": struct.Struct("2q3P5q3P"),
    "window_step": struct.Struct("2q3P4qP"),
    "conv_forward": struct.Struct("2q3P5q3P"),
    "conv_backward": struct.Struct("2q3P5q3P"),
    "conv_step": struct.Struct("2q3P4qP"),
}
_F64 = {torch.float32: 0, torch.float64: 1}
_EMPTY = {dtype: torch.empty(0, dtype=dtype) for dtype in _F64}  # the results not made (cpu.py drops them)


def open_library(path):
    """The library at `path` (an OSError when it does not load), its C functions' argument declared."""
    library = ctypes.CDLL(path)
    for name in _ARGUMENTS:
        function = getattr(library, f"ddl_{name}")
        function.argtypes, function.restype = [ctypes.c_char_p], None
    library.ddl_sources_digest.restype = ctypes.c_char_p
    return library


class Kernels:
    """The kernels of one library, `kernels()`'s result: eight functions of tensors (below), `__file__` (the library)
    and `digest` (of the sources it was built from)."""

    def __init__(self, path):
        library = open_library(path)
        self.__file__ = path
        self.digest = library.ddl_sources_digest().decode()
        for name in _ARGUMENTS:
            setattr(self, name, globals()[f"_{name}"](getattr(library, f"ddl_{name}"), _ARGUMENTS[name].pack))


def _mismatch(name):
    return RuntimeError(f"ddl {name}: mismatched shapes, dtypes or layouts")


def _dense(*tensors):
    """Each tensor in CPU memory and contiguous: the C functions read and write them as flat arrays from their
    pointers."""
    return all(t.is_cpu and t.is_contiguous() for t in tensors)


def _f64(x, name):
    """The C functions' dtype flag for x (fp32: 0, fp64: 1); they read CPU memory only."""
    f64 = _F64.get(x.dtype)
    if f64 is None or not x.is_cpu:
        raise RuntimeError(f"ddl {name}: CPU tensors in fp32 or fp64 only, not {x.dtype} on {x.device}")
    return f64


_threads = torch.get_num_threads


def _residual_forward(run, pack):
    def residual_forward(x, h, c, u, wb, bb, wv, bv, scale, eps, erase, save, wr):
        """X_next, the statistics backward needs (None unless `save`), the next readout (with taps wr (K, d_v, d);
        empty when wr is) and the write's coefficients (None unless `save`)."""
        f64, dtype = _f64(x, "residual_forward"), x.dtype
        d = h.shape[-1]
        n, nv, read = h.numel() // d, wv.shape[0], wr.numel() > 0
        if not (x.numel() == n * nv * d and c.numel() == n * d and u.numel() == n * d and wb.numel() == d
                and bb.numel() == 1 and wv.numel() == nv * d and bv.numel() == nv
                and (not read or (x.dim() == 4 and x.shape[2:] == (nv, d) and wr.shape[1:] == (nv, d)
                                  and wr.dtype is dtype))
                and h.dtype is dtype and c.dtype is dtype and u.dtype is dtype and wb.dtype is dtype
                and bb.dtype is dtype and wv.dtype is dtype and bv.dtype is dtype
                and _dense(x, h, c, u, wb, bb, wv, bv, wr)):
            raise _mismatch("residual_forward")
        out = torch.empty_like(x)
        stats, y, write = None, _EMPTY[dtype], None
        if read:
            y = torch.empty_like(h)
        if save:
            stats, write = h.new_empty(n * (2 + 2 * nv)), h.new_empty(n, nv)
        run(pack(f64, _threads(), x.data_ptr(), h.data_ptr(), c.data_ptr(), u.data_ptr(), wb.data_ptr(),
                 bb.data_ptr(), wv.data_ptr(), bv.data_ptr(), scale, eps, erase, n, nv, d, out.data_ptr(),
                 stats.data_ptr() if save else 0, write.data_ptr() if save else 0, wr.data_ptr() if read else 0,
                 y.data_ptr() if read else 0, wr.shape[0] if read else 1, x.shape[1] if read else 1))
        return [out, stats, y, write]

    return residual_forward


def _residual_backward(run, pack):
    def residual_backward(g, x, h, c, u, wb, wv, stats, scale, erase, u_kind, gy, wr):
        """The gradients of x, h, c, u (empty unless u_kind is 0), the gate's weight and bias, the value's weight and
        bias, and the readout's taps (empty unless gy, the readout's gradient, is given)."""
        f64, dtype = _f64(x, "residual_backward"), x.dtype
        d = h.shape[-1]
        n, nv, read = h.numel() // d, wv.shape[0], gy.numel() > 0
        if not (g.numel() == x.numel() == n * nv * d and stats.numel() == n * (2 + 2 * nv) and c.numel() == n * d
                and u.numel() == n * d and wb.numel() == d and wv.numel() == nv * d
                and u_kind in (0, 1, 2)
                and (not read or (gy.numel() == n * d and x.dim() == 4 and x.shape[2:] == (nv, d)
                                  and wr.shape[1:] == (nv, d)
                                  and gy.dtype is dtype and wr.dtype is dtype))
                and g.dtype is dtype and h.dtype is dtype and c.dtype is dtype and u.dtype is dtype
                and wb.dtype is dtype and wv.dtype is dtype and stats.dtype is dtype
                and _dense(g, x, h, c, u, wb, wv, stats, gy, wr)):
            raise _mismatch("residual_backward")
        gx, gh, gc = torch.empty_like(x), torch.empty_like(h), torch.empty_like(c)
        gu = torch.empty_like(u) if u_kind == 0 else _EMPTY[dtype]
        gwb, gbb, gwv, gbv = torch.empty_like(wb), wb.new_empty(1), torch.empty_like(wv), wv.new_empty(nv)
        gwr = torch.empty_like(wr) if read else _EMPTY[dtype]
        run(pack(f64, _threads(), g.data_ptr(), x.data_ptr(), h.data_ptr(), c.data_ptr(), u.data_ptr(), wb.data_ptr(),
                 wv.data_ptr(), stats.data_ptr(), scale, erase, u_kind, n, nv, d, gx.data_ptr(), gh.data_ptr(),
                 gc.data_ptr(), gu.data_ptr() if u_kind == 0 else 0, gwb.data_ptr(), gbb.data_ptr(), gwv.data_ptr(),
                 gbv.data_ptr(), gy.data_ptr() if read else 0, wr.data_ptr() if read else 0,
                 gwr.data_ptr() if read else 0, wr.shape[0] if read else 1, x.shape[1] if read else 1))
        return [gx, gh, gc, gu, gwb, gbb, gwv, gbv, gwr]

    return residual_backward


def _readout_forward(run, pack):
    def readout_forward(x, taps):
        """The readout y (B, T, d) of the state x (B, T, d_v, d) with taps (K, d_v, d)."""
        f64 = _f64(x, "readout_forward")
        batch, length, nv, d = x.shape
        k, taps_nv, taps_d = taps.shape
        if not (taps_nv == nv and taps_d == d and taps.dtype is x.dtype and _dense(x, taps)):
            raise _mismatch("readout_forward")
        y = x.new_empty(batch, length, d)
        run(pack(f64, _threads(), 0, x.data_ptr(), taps.data_ptr(), batch, length, k, nv, d, y.data_ptr(), 0, 0))
        return y

    return readout_forward


def _readout_backward(run, pack):
    def readout_backward(g, x, taps):
        """The gradients of the state and the taps for the readout's gradient g (B, T, d)."""
        f64 = _f64(x, "readout_backward")
        batch, length, nv, d = x.shape
        k, taps_nv, taps_d = taps.shape
        if not (taps_nv == nv and taps_d == d and g.numel() == batch * length * d and taps.dtype is x.dtype
                and g.dtype is x.dtype and _dense(g, x, taps)):
            raise _mismatch("readout_backward")
        gx, gtaps = torch.empty_like(x), torch.empty_like(taps)
        run(pack(f64, _threads(), g.data_ptr(), x.data_ptr(), taps.data_ptr(), batch, length, k, nv, d, 0,
                 gx.data_ptr(), gtaps.data_ptr()))
        return [gx, gtaps]

    return readout_backward


def _window_step(run, pack):
    def window_step(past, state, weight):
        """One decoding step's readout (B, 1, d) of the cached window past (B, d_v*d, K-1) and the state (B, 1, d_v,
        d), with the weight (K, d, d_v); past advanced in place."""
        f64 = _f64(past, "window_step")
        taps = weight.permute(2, 1, 0).contiguous()  # (d_v, d, K): no copy for the weight a decoding run keeps
        x = state.contiguous()
        nv, d, k = taps.shape
        batch, channels, kept = past.shape
        if not (channels == nv * d and kept == k - 1 and k > 1 and _dense(past, x, taps)
                and x.shape == (batch, 1, nv, d) and x.dtype is past.dtype and taps.dtype is past.dtype):
            raise _mismatch("window_step")
        y = x.new_empty(batch, 1, d)
        run(pack(f64, _threads(), past.data_ptr(), x.data_ptr(), taps.data_ptr(), batch, nv, d, k, y.data_ptr()))
        return y

    return window_step


def _conv_forward(run, pack):
    def conv_forward(x, taps):
        """EC of the embeddings x (B, T, d) with taps (K, d_v, d): the state (B, T, d_v, d)."""
        f64 = _f64(x, "conv_forward")
        batch, length, d = x.shape
        k, nv, taps_d = taps.shape
        if not (taps_d == d and _dense(x, taps) and taps.dtype is x.dtype):
            raise _mismatch("conv_forward")
        y = x.new_empty(batch, length, nv, d)
        run(pack(f64, _threads(), 0, x.data_ptr(), taps.data_ptr(), batch, length, k, nv, d, y.data_ptr(), 0, 0))
        return y

    return conv_forward


def _conv_backward(run, pack):
    def conv_backward(g, x, taps):
        """The gradients of the embeddings and the taps for the state's gradient g (B, T, d_v, d)."""
        f64 = _f64(x, "conv_backward")
        batch, length, d = x.shape
        k, nv, taps_d = taps.shape
        if not (taps_d == d and _dense(g, x, taps)
                and g.numel() == batch * length * nv * d and taps.dtype is x.dtype and g.dtype is x.dtype):
            raise _mismatch("conv_backward")
        gx, gtaps = torch.empty_like(x), torch.empty_like(taps)
        run(pack(f64, _threads(), g.data_ptr(), x.data_ptr(), taps.data_ptr(), batch, length, k, nv, d, 0,
                 gx.data_ptr(), gtaps.data_ptr()))
        return [gx, gtaps]

    return conv_backward


def _conv_step(run, pack):
    def conv_step(past, embeds, weight):
        """One decoding step's EC (B, 1, d_v, d) from the cached embeddings past (B, d, K-1) and the new one (B, 1,
        d), with the weight (K, d, d_v); past advanced in place."""
        f64 = _f64(past, "conv_step")
        x = embeds.contiguous()
        k, d, nv = weight.shape
        batch, channels, kept = past.shape
        if not (channels == d and kept == k - 1 and k > 1 and _dense(past, x, weight)
                and x.shape == (batch, 1, d) and x.dtype is past.dtype and weight.dtype is past.dtype):
            raise _mismatch("conv_step")
        y = x.new_empty(batch, 1, nv, d)
        run(pack(f64, _threads(), past.data_ptr(), x.data_ptr(), weight.data_ptr(), batch, k, nv, d, y.data_ptr()))
        return y

    return conv_step
