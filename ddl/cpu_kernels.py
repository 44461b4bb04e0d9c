r"""C++ kernels for CPU: one sublayer's whole residual seam (the gate, the value and the delta update, forward and
backward, in one pass over each token's rows), the TC readout (CC: one tap), EC (the embedding convolution, its
transpose), and a TC decoding step's readout of its cached window. `ddl.kernels` calls them where they apply
(Linux, CPU tensors in fp32 or fp64, eager mode).

They are built on first use with PyTorch's C++ extension tools (`torch.utils.cpp_extension.load_inline`, cached under
`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`), from the source in `ddl.cpu_kernels_source`, one
process at a time (a build killed midway blocks no later one: see `_clear_stale_baton`), and never required: without
a C++ compiler or ninja, on other systems, or with `DDL_CPU_KERNEL=0` (or the implementation "torch"), DDL runs
the PyTorch functions of `ddl.fused`, which compute the same numbers up to rounding (summation order; an fp64
model's gate logit is fp64 here, fp32 there).

Why: in eager PyTorch each operation of a sublayer's seam is a separate pass over a `(B, T, d)` tensor (the gate and
value projections to 1-4 outputs run as matrix-vector products, far below the memory speed), and a decoding step pays
a dispatch per operation for a handful of numbers. Here each token's row is read once for its dot products and once
for its writes, while it is in cache, and a decoding step is one call.

Per token (rows of length d; the state X has d_v rows, `(B, T, d)` when d_v = 1 or `(B, T, d_v, d)`), the same
numbers as `reference.delta_residual`:
    beta = 2 sigmoid(w . c + b),   v_j = s_v sigmoid(W_v[j] . u + b_v[j])  (or W_v[j] . u + b_v[j] when s_v = None)
    s = 1 / sqrt(|h|^2 + eps^2),   t_j = v_j - s h . X_j  (write-only: t_j = v_j)
    X_next_j = X_j + h (beta s t_j)
and the backward of `fused._DeltaUpdate`, followed by the gate's and the value's:
    b_j = h . G_j,   c_j = s b_j,   dv_j = beta c_j,   dbeta = sum_j c_j t_j
    dX_j = G_j - h (beta s c_j),   dh = sum_j G_j (s beta t_j) - X_j (s beta c_j) - h s^3 beta (sum_j b_j t_j - hX_j c_j)
    dz = dbeta beta (1 - beta/2),  dy_j = dv_j v_j (1 - v_j / s_v)  (dv_j without the sigmoid)
    dc = dz w (+ sum_j dy_j W_v[j] when u is c),  du = sum_j dy_j W_v[j]  (into dX when u is the d_v = 1 state)
    dw = sum over tokens of dz c,  db = sum dz,  dW_v[j] = sum dy_j u,  db_v[j] = sum dy_j
fp32 and fp64 (each in its own precision); other dtypes, autocast and tracing take the PyTorch path.
"""

import contextlib
import functools
import hashlib
import os
import sys
import time

import torch
from torch.autograd.function import once_differentiable
from transformers.utils import logging

from .cpu_kernels_source import SOURCE
from .fused import conv_backward, readout_backward, readout_with_history


logger = logging.get_logger(__name__)


def _library_name():
    """One name per source text, so that an edited kernel is rebuilt instead of loading a stale build; AVX2 builds
    get their own name, so that a cache shared by machines with different instruction sets keeps one of each; and
    one per PyTorch installation (its folder and version), so that environments sharing the cache each keep their
    build instead of rebuilding it in turn (torch rebuilds whenever the compile command, which names its headers,
    changes)."""
    installation = f"{os.path.dirname(torch.__file__)} {torch.__version__}"
    return "ddl_cpu_" + hashlib.sha1((SOURCE + " ".join(_flags()) + installation).encode()).hexdigest()[:12]


def _flags():
    """x86 machines whose PyTorch runs AVX2 kernels get AVX2 + FMA (vectors twice as wide as the baseline's)."""
    return ["-O3", "-fopenmp"] + (["-mavx2", "-mfma"] if _has_avx2() else [])


def _has_avx2():
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


_ops = None  # the built module; False when the build failed or is switched off


def cpu_kernel():
    """The compiled functions (`residual_forward` / `residual_backward`, `readout_forward` / `readout_backward`,
    `conv_forward` / `conv_backward`, `window_readout`), or None: built once per machine (20-40 s on first use, then
    loaded from torch's extension cache), never required."""
    global _ops
    if _ops is None:
        _ops = _build() or False
    return _ops or None


_SWITCH_ON, _SWITCH_OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _switched_on():
    """`DDL_CPU_KERNEL`: on (unset, or one of `_SWITCH_ON`) or off (`_SWITCH_OFF`); anything else is a mistake
    (`disable` must not mean "on"), a ValueError that names the values."""
    value = os.environ.get("DDL_CPU_KERNEL", "").strip().lower()
    if value and value not in _SWITCH_ON + _SWITCH_OFF:
        raise ValueError(f"DDL_CPU_KERNEL={value!r}: set it to 0 (PyTorch only, no C++ build) or 1 (build and use "
                         "DDL's C++ CPU kernels, the default), or unset it.")
    return value not in _SWITCH_OFF


def _build():
    if not _switched_on():
        return None
    if not sys.platform.startswith("linux"):  # measured on Linux only (macOS' compiler has no OpenMP by default)
        logger.info_once("DDL: the C++ CPU kernel is built on Linux only; using the PyTorch path.")
        return None
    name = _library_name()
    try:
        import shutil

        from torch.utils.cpp_extension import load_inline

        if shutil.which("ninja") is None:  # torch builds with ninja; the pip package's binary is beside python
            try:
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            except ImportError:
                pass
        folder = _build_directory(name)
        with _build_lock(folder) as held:
            if not held:
                logger.warning(f"DDL: another process has held the build lock of its C++ CPU kernel {name} for over "
                               f"{_STALE_AFTER_S:.0f} s; using the PyTorch path (same numbers up to rounding, slower).")
                return None
            if folder is not None and not _clear_stale_baton(folder):
                return None
            if not _is_built(folder):
                logger.warning(
                    f"DDL: building its C++ CPU kernel {name} once (20-40 s; cached for the next runs). Set "
                    "DDL_CPU_KERNEL=0 to use the PyTorch path instead."
                )
            functions = ["residual_forward", "residual_backward", "readout_forward", "readout_backward",
                         "conv_forward", "conv_backward", "window_readout"]
            return load_inline(name, cpp_sources=SOURCE, functions=functions, extra_cflags=_flags(), verbose=False,
                               build_directory=folder)
    except Exception as error:  # no compiler, no ninja, a failed build: the PyTorch path serves
        logger.warning(f"DDL: the C++ CPU kernel could not be built, so DDL uses the PyTorch path (same numbers up "
                       f"to rounding, slower): {type(error).__name__}: {str(error)[-1500:]}")
        return None


def _build_directory(name):
    """torch's build folder of the extension `name` (created), or None if torch's private helper is not there."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return _get_build_directory(name, verbose=False)
    except Exception:  # then torch picks the folder, and a stale lock in it is not looked for
        return None


def _is_built(folder):
    return folder is not None and any(f.endswith((".so", ".pyd")) for f in os.listdir(folder))


# A build takes 20-40 s (minutes on a busy machine); a build lock held for longer than this belongs to a process that
# hangs, and a torch lock file untouched for longer (when its holder cannot be looked up) to a build that died.
_STALE_AFTER_S = 600.0
_BUILD_LOCK = "ddl_build.lock"


@contextlib.contextmanager
def _build_lock(folder):
    """One DDL process at a time builds (or loads) the kernel in `folder`: an exclusive `flock` on a file there, which
    the operating system releases when its holder ends, however it ends. Yields True once held, or False when
    another process has held it for over `_STALE_AFTER_S` (the caller then falls back instead of waiting forever)."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    if folder is None or fcntl is None:
        yield True
        return
    with open(os.path.join(folder, _BUILD_LOCK), "a+") as f:
        start, waiting = time.monotonic(), False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() - start > _STALE_AFTER_S:
                    yield False
                    return
                if not waiting:
                    logger.warning("DDL: waiting for another process that builds its C++ CPU kernel.")
                    waiting = True
                time.sleep(0.5)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _baton_holders(baton):
    """The pids of the processes that hold torch's lock file open (its `FileBaton` keeps it open for the whole build),
    or None when that cannot be told (no /proc, or processes this user may not look into)."""
    if not os.path.isdir("/proc"):
        return None
    target, holders, hidden = os.path.realpath(baton), [], False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except PermissionError:
            hidden = True
            continue
        except OSError:  # the process has ended meanwhile
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    holders.append(int(pid))
            except OSError:
                continue
    return None if hidden and not holders else holders


def _clear_stale_baton(folder):
    """torch's own lock file (`lock`, a `FileBaton`) exists while a build runs, and torch waits for it forever: one
    left by a build killed midway would hang every later process. Holding DDL's build lock, one that no process holds
    open (or, when that cannot be told, untouched for `_STALE_AFTER_S`) is removed, and the build goes on. One that a
    live process holds (a build that does not take DDL's lock, e.g. another version of DDL sharing the cache) is
    waited for, for at most `_STALE_AFTER_S`; then this process uses the PyTorch path (returns False)."""
    baton = os.path.join(folder, "lock")
    start = time.monotonic()
    while os.path.exists(baton):
        holders = _baton_holders(baton)
        try:
            age = time.time() - os.path.getmtime(baton)
        except FileNotFoundError:  # its build just finished
            break
        if holders == [] or (holders is None and age > _STALE_AFTER_S):
            why = "no process holds it" if holders == [] else f"untouched for {age:.0f} s"
            logger.warning(f"DDL: removing {baton}, left by a build that was killed midway ({why}; torch would wait "
                           "for it forever), and building again.")
            with contextlib.suppress(FileNotFoundError):
                os.remove(baton)
            break
        if time.monotonic() - start > _STALE_AFTER_S:
            owner = f"process {holders[0]}" if holders else "a process"
            logger.warning(f"DDL: {baton} has been held by {owner} for over {_STALE_AFTER_S:.0f} s, so DDL uses the "
                           "PyTorch path (same numbers up to rounding, slower); if no build is running, delete it.")
            return False
        time.sleep(0.5)
    return True


def eager_cpu_float(x):
    """CPU, fp32 or fp64, no autocast, not traced by torch.compile or torch.jit.trace: where the C++ kernels compute
    the specs' numbers (under autocast the sublayer outputs come in another dtype; a trace must not build)."""
    dtype = x.dtype
    return (
        x.is_cpu
        and (dtype is torch.float32 or dtype is torch.float64)
        and not _autocast_enabled("cpu")
        and not _is_compiling()
        and not _is_tracing()
    )


# looked up once: attribute lookups through `torch.` cost microseconds per sublayer of a decoding step
_autocast_enabled, _is_compiling = torch.is_autocast_enabled, torch.compiler.is_compiling
_is_tracing = torch.jit.is_tracing


def _ready(x):
    """`eager_cpu_float` and the kernel built (never built inside a trace)."""
    return eager_cpu_float(x) and bool(_ops or (_ops is None and cpu_kernel() is not None))


def cpu_residual_applies(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias):
    """Whether `cpu_residual` serves these inputs: all on the CPU and all fp32 or all fp64 (the parameters
    included), no autocast, not traced. Checked on every sublayer of every decoding step, so written out flat."""
    dtype = x.dtype
    return (
        h.dtype is dtype
        and c.dtype is dtype
        and u.dtype is dtype
        and gate_weight.dtype is dtype
        and gate_bias.dtype is dtype
        and value_weight.dtype is dtype
        and value_bias.dtype is dtype
        and gate_weight.is_cpu
        and value_weight.is_cpu
        and _ready(x)
    )


_NO_BUFFER = torch.empty(0)  # residual_forward's `buffer` when X_next gets a new tensor


class _Residual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale, k_eps, erase, u_kind,
                writes, buffer):
        out, stats = cpu_kernel().residual_forward(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias,
                                                  v_scale, k_eps, erase, True, _NO_BUFFER if buffer is None else buffer)
        if writes is not None:
            # made when backward needs it, from tensors saved anyway: nothing more stays allocated until then
            writes.append(functools.partial(_write_of_stats, h, stats, value_weight.shape[0]))
        ctx.save_for_backward(x, h, c, u, gate_weight, value_weight, stats)
        ctx.v_scale, ctx.erase, ctx.u_kind = v_scale, erase, u_kind
        return out

    @staticmethod
    @once_differentiable  # its gradients are computed outside autograd: a second derivative raises
    def backward(ctx, grad):
        x, h, c, u, gate_weight, value_weight, stats = ctx.saved_tensors
        gx, gh, gc, gu, gw, gb, gwv, gbv = cpu_kernel().residual_backward(
            grad.contiguous(), x, h, c, u, gate_weight, value_weight, stats, ctx.v_scale, ctx.erase, ctx.u_kind
        )
        return gx, gh, gc, gu if ctx.u_kind == 0 else None, gw, gb, gwv, gbv, None, None, None, None, None, None


def _write_of_stats(h, stats, nv):
    """The rank-1 write (h, beta s t) of the kernel's update, X_next = X + h (x) (beta s t) (`fused.rebuild_state`),
    from the per-token numbers it saves for backward: beta, s, v and h^T X (0 for write-only), in that order."""
    n = h.numel() // h.shape[-1]
    beta, s = stats[:n].unsqueeze(-1), stats[n : 2 * n].unsqueeze(-1)
    v, hx = stats[2 * n : 2 * n + n * nv].view(n, nv), stats[2 * n + n * nv :].view(n, nv)
    return h, (beta * s * (v - s * hx)).view(*h.shape[:-1], nv)


def cpu_residual(x, h, c, u, gate_weight, gate_bias, value_weight, value_bias, v_scale=4.0, k_eps=1e-5,
                 mode="delta", writes=None, buffer=None):
    """`reference.delta_residual` (a single linear gate) through the C++ kernel, for any number of tokens, with
    autograd (check `cpu_residual_applies` first). `writes`: a list that gets the update's rank-1 write appended
    (`fused.rebuild_state`); `buffer`: memory for X_next (`rebuild.StateTape.buffer_like`) where it fits; training
    only."""
    u_kind = 1 if u is c else (2 if u is x and x.dim() == h.dim() else 0)  # before any copy: by identity
    x = x.contiguous()  # the stride-0 repeated embeddings of a d_v > 1 model without EC
    u = x if u_kind == 2 else u.contiguous()
    args = (x, h.contiguous(), c.contiguous(), u, gate_weight.contiguous(), gate_bias.contiguous(),
            value_weight.contiguous(), value_bias.contiguous(), -1.0 if v_scale is None else float(v_scale),
            float(k_eps), mode == "delta")
    if torch.is_grad_enabled():
        return _Residual.apply(*args, u_kind, writes, buffer)
    return cpu_kernel().residual_forward(*args, False, _NO_BUFFER)[0]


def cpu_readout_applies(x, weight):
    """Whether `cpu_token_readout` serves a state `(B, T, d_v, d)` and a weight `(K, d, d_v)`."""
    return weight.dtype is x.dtype and weight.is_cpu and _ready(x)


class _Readout(torch.autograd.Function):
    """The readout of a state `(B, T, d_v, d)` by taps `(K, d_v, d)`, forward and backward in one pass each."""

    @staticmethod
    def forward(ctx, x, taps):
        ctx.save_for_backward(x, taps)
        return cpu_kernel().readout_forward(x.contiguous(), taps)

    @staticmethod
    def backward(ctx, grad):
        x, taps = ctx.saved_tensors
        if torch.is_grad_enabled() or grad.dtype is not x.dtype:  # create_graph: the C++ gradients carry no graph
            return readout_backward(grad, x, taps, *ctx.needs_input_grad)
        return tuple(cpu_kernel().readout_backward(grad.contiguous(), x.contiguous(), taps))


def _readout(x, taps):
    if torch.is_grad_enabled():
        return _Readout.apply(x, taps)
    return cpu_kernel().readout_forward(x.contiguous(), taps)  # (a stride-0 repeated state is copied first)


def cpu_token_readout(x, weight, history=None):
    """`reference.causal_token_readout` (TC; CC with one tap) through the C++ kernel (check `cpu_readout_applies`)."""
    return readout_with_history(_readout, x, weight, history)


def cpu_conv_applies(x, weight):
    """Whether `cpu_token_conv` serves embeddings `(B, T, d)` and a weight `(K, d, d_v)`."""
    return weight.dtype is x.dtype and weight.is_cpu and _ready(x)


class _Conv(torch.autograd.Function):
    """EC of x `(B, T, d)` by taps `(K, d_v, d)` into the state `(B, T, d_v, d)`, forward and backward in one pass
    each (the state written once; its gradient read once)."""

    @staticmethod
    def forward(ctx, x, taps):
        ctx.save_for_backward(x, taps)
        return cpu_kernel().conv_forward(x, taps)

    @staticmethod
    def backward(ctx, grad):
        x, taps = ctx.saved_tensors
        if torch.is_grad_enabled() or grad.dtype is not x.dtype:  # create_graph: the C++ gradients carry no graph
            return conv_backward(grad, x, taps)
        return tuple(cpu_kernel().conv_backward(grad.contiguous(), x, taps))


def _conv(x, taps):
    x = x.contiguous()
    return _Conv.apply(x, taps) if torch.is_grad_enabled() else cpu_kernel().conv_forward(x, taps)


def cpu_token_conv(x, weight, history=None):
    """`reference.causal_token_conv` (EC) through the C++ kernel (check `cpu_conv_applies`)."""
    return readout_with_history(_conv, x, weight, history)


def cpu_window_readout_applies(window, weight):
    """Whether `cpu_window_readout` serves a decoding step's window `(B, d_v*d, K)` and a weight `(K, d, d_v)`: no
    autograd (it has no backward), the same dtype."""
    return weight.dtype is window.dtype and weight.is_cpu and not torch.is_grad_enabled() and _ready(window)


def cpu_window_readout(window, weight):
    r"""The TC readout of one new token from its window as the cache holds it, `(B, d_v*d, K)` (channel j*d + i,
    time last), in one pass: `(B, 1, d)`, y[b, i] = sum_s sum_j weight[s, i, j] * window[b, j*d + i, s]."""
    taps = weight.permute(2, 1, 0).contiguous()  # (d_v, d, K): the window's layout (no copy if kept so)
    return cpu_kernel().window_readout(window.contiguous(), taps).unsqueeze(1)


__all__ = [
    "cpu_conv_applies", "cpu_kernel", "cpu_readout_applies", "cpu_residual", "cpu_residual_applies", "cpu_token_conv",
    "cpu_token_readout", "cpu_window_readout", "cpu_window_readout_applies", "eager_cpu_float",
]
