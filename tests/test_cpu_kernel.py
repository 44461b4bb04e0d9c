"""The C++ CPU kernels of ddl_kernels: the residual seam equals `reference.delta_residual`, the readout
`reference.causal_token_readout` and EC `reference.causal_token_conv`, outputs and every gradient; the models take them
wherever they serve (and only there); and their build (ddl_kernels/build.py) never blocks or fails a run."""

import os
from functools import partial
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import assert_same_loss_and_gradients, tiny_config
from conftest import count_calls
from ddl import DDLForCausalLM
from ddl.modeling_ddl import DDLDeltaResidual
from ddl.reference import causal_token_conv, causal_token_readout, delta_update
from ddl_kernels import build
from ddl_kernels.conv import cpu as conv_cpu
from ddl_kernels.readout import cpu as readout_cpu
from ddl_kernels.residual import cpu as residual_cpu


pytestmark = pytest.mark.skipif(build.kernels() is None, reason="the C++ CPU kernels could not be built here")
cpu_kernel = build.kernels
cpu_residual = residual_cpu.run


def cpu_residual_applies(x, h, c, u, *params):
    return residual_cpu.serves(x, h, c, u, *params, "delta", None)


def as_taps(weight):
    """A readout or EC weight `(K, d, d_v)` in the state's layout `(K, d_v, d)`, as the dispatcher gives it."""
    return weight.transpose(1, 2).contiguous()


def _with_history(run, x, weight, history=None):
    """`run(x, taps)` (an implementation, zeros before the first token) over x after its history, as the dispatcher
    calls it (`ops.token_readout`): the spec's contract."""
    full = x if history is None else torch.cat([history, x], dim=1)
    out = run(full, as_taps(weight))
    return out if history is None else out[:, weight.shape[0] - 1 :]


def cpu_token_readout(x, weight, history=None):
    return _with_history(readout_cpu.run, x, weight, history)


def cpu_token_conv(x, weight, history=None):
    return _with_history(conv_cpu.run, x, weight, history)


def _seam(dv, mode, value_input, v_scale, dtype, batch=2, seq_len=4, seed=0, edge_rows=True, **overrides):
    """A residual module with parameters off their init, and inputs with a zero h row and an |h| ~ k_eps row."""
    config = tiny_config(ddl_value_channels=dv, ddl_residual=mode, ddl_value_input=value_input,
                         ddl_v_sigmoid_scale=v_scale, **overrides)
    residual = DDLDeltaResidual(config).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in residual.parameters():
            param.copy_(torch.randn(param.shape, generator=g))
    d = config.hidden_size
    x = torch.randn((batch, seq_len, d) if dv == 1 else (batch, seq_len, dv, d), generator=g).to(dtype)
    c, u, h = (torch.randn(batch, seq_len, d, generator=g).to(dtype) for _ in range(3))
    if edge_rows:
        h[0, 1] = 0
        h[-1, -1] *= 1e-5
    return residual, x, h, c, u


def _run(residual, x, h, c, u, use_kernel):
    """Output and the gradients of all inputs and parameters for a fixed random cotangent."""
    leaves = [t.clone().requires_grad_() for t in (x, h, c, u)]
    x, h, c, u = leaves
    if residual.config.ddl_value_input == "context":
        u = c
    elif x.dim() == h.dim():  # d_v = 1: the value reads the state itself (x_in = X)
        u = x
    params = (residual.beta_weight, residual.beta_bias, residual.value_weight, residual.value_bias)
    if use_kernel:
        out = cpu_residual(x, h, c, u, *params, residual.config.ddl_v_sigmoid_scale, residual.config.ddl_k_eps,
                           residual.mode)
    else:  # the spec (its gate logit in at least fp32: the inputs' dtype here)
        beta = 2 * torch.sigmoid(torch.nn.functional.linear(c, residual.beta_weight.unsqueeze(0), residual.beta_bias))
        out = delta_update(x, h, residual.value(u), beta, mode=residual.mode, k_eps=residual.config.ddl_k_eps)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    grads = torch.autograd.grad(out, leaves + list(params), cotangent, allow_unused=True)
    return [out] + [torch.zeros_like(t) if gr is None else gr for t, gr in zip(leaves + list(params), grads)]


def _assert_same(ours, spec, tol, relative_to_largest=False):
    names = "out x h c u gate_weight gate_bias value_weight value_bias".split()
    for name, a, b in zip(names, ours, spec):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        atol = tol * max(1.0, b.abs().max().item()) if relative_to_largest else tol
        torch.testing.assert_close(a, b, rtol=tol, atol=atol, msg=name)


@pytest.mark.parametrize("edge_rows", [False, True], ids=["plain", "zero-and-tiny-h"])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("v_scale", [4.0, None], ids=["sigmoid-v", "linear-v"])
@pytest.mark.parametrize("value_input", ["state", "context"])
@pytest.mark.parametrize("mode", ["delta", "write_only"])
@pytest.mark.parametrize("dv", [1, 3], ids=["dv1", "dv3"])
def test_kernel_equals_gate_value_and_delta_update(dv, mode, value_input, v_scale, dtype, tol, edge_rows):
    # With a zero and an |h| ~ k_eps row, dh reaches ~1e6 there: errors are then measured against each tensor's
    # largest entry.
    residual, *inputs = _seam(dv, mode, value_input, v_scale, dtype, edge_rows=edge_rows)
    ours, spec = _run(residual, *inputs, use_kernel=True), _run(residual, *inputs, use_kernel=False)
    _assert_same(ours, spec, tol, relative_to_largest=edge_rows)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("mode", ["delta", "write_only"])
@pytest.mark.parametrize("dv", [2, 4, 8, 5])
def test_kernel_for_each_compiled_dv_and_a_ragged_width(dv, mode, dtype, tol):
    """The kernel is compiled for d_v = 1, 2, 4, 8 (5: the run-time loop), its dot products in lanes of two vectors'
    width: a width of 44 leaves a remainder after those lanes, in fp32 (16 lanes) and fp64 (8)."""
    residual, *inputs = _seam(dv, mode, "context", 4.0, dtype, hidden_size=44, head_dim=22)
    ours, spec = _run(residual, *inputs, use_kernel=True), _run(residual, *inputs, use_kernel=False)
    _assert_same(ours, spec, tol, relative_to_largest=True)


@pytest.mark.parametrize("dv", [1, 4], ids=["dv1", "dv4"])
def test_kernel_with_two_threads_equals_spec(dv):
    """Enough tokens (3 x 50) for the kernel to split them over threads and add up the weight gradients' partial
    sums (the suite runs with one thread otherwise)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        residual, *inputs = _seam(dv, "delta", "state", 4.0, torch.float64, batch=3, seq_len=50)
        ours = _run(residual, *inputs, use_kernel=True)
    finally:
        torch.set_num_threads(threads)
    _assert_same(ours, _run(residual, *inputs, use_kernel=False), 1e-10, relative_to_largest=True)


def _run_with_readout(residual, x, h, c, u, weight, use_kernel, used):
    """`_run` of the seam that also makes the readout of X_next by `weight` `(K, d, d_v)` (the next compressor's: CC
    one tap, TC K): the outputs in `used` ("state", "readout" or both) get cotangents, and every input and parameter
    its gradient."""
    leaves = [t.clone().requires_grad_() for t in (x, h, c, u, weight)]
    x, h, c, u, weight = leaves
    u = c if residual.config.ddl_value_input == "context" else u
    params = (residual.beta_weight, residual.beta_bias, residual.value_weight, residual.value_bias)
    scale, eps = residual.config.ddl_v_sigmoid_scale, residual.config.ddl_k_eps
    if use_kernel:
        out, y = cpu_residual(x, h, c, u, *params, scale, eps, residual.mode, weight)
    else:  # the spec: the seam (its gate logit in the inputs' dtype, as in `_run`), then the readout of its state
        beta = 2 * torch.sigmoid(torch.nn.functional.linear(c, residual.beta_weight.unsqueeze(0), residual.beta_bias))
        out = delta_update(x, h, residual.value(u), beta, mode=residual.mode, k_eps=eps)
        y = causal_token_readout(out, weight)
    outputs = [t for t, name in ((out, "state"), (y, "readout")) if name in used]
    g = torch.Generator().manual_seed(5)
    cotangents = [torch.randn(t.shape, generator=g).to(t.dtype) for t in outputs]
    grads = torch.autograd.grad(outputs, leaves + list(params), cotangents, allow_unused=True)
    return [out, y] + [torch.zeros_like(t) if gr is None else gr for t, gr in zip(leaves + list(params), grads)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("used", [("state", "readout"), ("state",), ("readout",)], ids=["both", "state", "readout"])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("value_input, v_scale", [("state", 4.0), ("context", None)])
@pytest.mark.parametrize("mode", ["delta", "write_only"])
@pytest.mark.parametrize("dv", [4, 5])
@pytest.mark.parametrize("taps", [1, 4], ids=["cc", "tc"])
def test_kernel_with_the_next_readout_equals_seam_then_readout(taps, dv, mode, value_input, v_scale, dtype, tol, used,
                                                                threads):
    """The seam that also makes the next compressor's readout (`ops.delta_residual`'s `readout`; CC one tap, TC K
    over the tokens): X_next, the readout and every gradient equal the spec's seam followed by
    `causal_token_readout`, whichever outputs are used (a width of 44 leaves a remainder after the lanes; 3 x 50
    tokens on 2 threads add up partial weight sums, and the second thread's first tokens read the first's states)."""
    residual, x, h, c, u = _seam(dv, mode, value_input, v_scale, dtype, batch=3, seq_len=50 if threads == 2 else 4,
                                 hidden_size=44, head_dim=22)
    weight = torch.randn(taps, 44, dv, generator=torch.Generator().manual_seed(3)).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = _run_with_readout(residual, x, h, c, u, weight, True, used)
    finally:
        torch.set_num_threads(previous)
    spec = _run_with_readout(residual, x, h, c, u, weight, False, used)
    names = "out readout x h c u readout_weight gate_weight gate_bias value_weight value_bias".split()
    for name, a, b in zip(names, ours, spec):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, b.abs().max().item()), msg=name)


@pytest.mark.parametrize("batch, seq_len, taps", [(9, 2, 3), (5, 4, 6), (4, 25, 6), (3, 50, 2)],
                         ids=["starts-at-1-K-over-T", "starts-at-2-K-over-T", "starts-a-sequence", "starts-at-25"])
@pytest.mark.parametrize("dv", [4, 3])
def test_tc_readout_of_the_seam_across_its_threads_chunks(batch, seq_len, taps, dv):
    """TC's readout of a token reads the new states of the K-1 before it in its sequence; on two threads the second
    chunk of tokens starts at the position named (a token before it written by the other thread), and windows reach
    back past the sequence's start (zeros): the spec's numbers, fp64, and the same bits as on one thread."""
    residual, x, h, c, u = _seam(dv, "delta", "state", 4.0, torch.float64, batch=batch, seq_len=seq_len)
    weight = torch.randn(taps, x.shape[-1], dv, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    previous = torch.get_num_threads()
    try:
        runs = []
        for threads in (2, 1):
            torch.set_num_threads(threads)
            runs.append(_run_with_readout(residual, x, h, c, u, weight, True, ("state", "readout")))
    finally:
        torch.set_num_threads(previous)
    spec = _run_with_readout(residual, x, h, c, u, weight, False, ("state", "readout"))
    for a, b in zip(runs[0], spec):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10 * max(1.0, b.abs().max().item()))
    assert torch.equal(runs[0][1], runs[1][1])  # the readout: each token summed in one order, wherever it ran


def test_second_derivative_raises():
    residual, x, h, c, u = _seam(1, "delta", "state", 4.0, torch.float64, edge_rows=False)
    h.requires_grad_()
    params = (residual.beta_weight, residual.beta_bias, residual.value_weight, residual.value_bias)
    out = cpu_residual(x, h, c, x, *params, 4.0, 1e-5, "delta")
    cotangent = torch.ones_like(out, requires_grad=True)
    with pytest.raises(RuntimeError, match="second derivative .*C\\+\\+ residual seam.*'reference'"):
        torch.autograd.grad(out, h, cotangent, create_graph=True)


@pytest.mark.parametrize("value_input", ["state", "context"])
@pytest.mark.parametrize("mode", ["delta", "write_only"])
@pytest.mark.parametrize("dv", [1, 2], ids=["dv1", "dv2"])
def test_kernel_gradcheck_float64(dv, mode, value_input):
    # (finite differences cannot follow k = h / sqrt(|h|^2 + eps^2) at |h| ~ eps: no edge rows here)
    residual, x, h, c, u = _seam(dv, mode, value_input, 4.0, torch.float64, batch=2, seq_len=2, edge_rows=False)
    params = [p.detach().clone().requires_grad_() for p in residual.parameters()]
    names = [n for n, _ in residual.named_parameters()]
    p = dict(zip(names, params))

    def seam(x, h, c, u, *args):
        u = c if value_input == "context" else (x if dv == 1 else u)
        return cpu_residual(x, h, c, u, *args, 4.0, 1e-5, mode)

    inputs = [t.requires_grad_() for t in (x, h, c, u)]
    args = (p["beta_weight"], p["beta_bias"], p["value_weight"], p["value_bias"])
    assert torch.autograd.gradcheck(seam, (*inputs, *args))


def test_inference_forward_equals_training_forward():
    residual, x, h, c, u = _seam(3, "delta", "state", 4.0, torch.float32, batch=3, seq_len=1, edge_rows=False)
    params = (residual.beta_weight, residual.beta_bias, residual.value_weight, residual.value_bias)
    trained = cpu_residual(x, h, c, u, *params, 4.0, 1e-5, "delta")
    assert trained.requires_grad
    with torch.no_grad():
        inferred = cpu_residual(x, h, c, u, *params, 4.0, 1e-5, "delta")
    assert torch.equal(inferred, trained.detach())


def test_kernel_applies_only_where_it_serves():
    x = torch.zeros(1, 1, 8)
    params = (torch.zeros(8), torch.zeros(1), torch.zeros(1, 8), torch.zeros(1))

    def applies(dtype=None, h=None, param=None):
        cast = (lambda t: t.to(dtype)) if dtype else (lambda t: t)
        ps = [cast(p) for p in params]
        if param is not None:
            ps[param[0]] = param[1]
        return cpu_residual_applies(cast(x), cast(x) if h is None else h, cast(x), cast(x), *ps)

    assert applies() and applies(torch.float64)
    assert not applies(torch.bfloat16)
    assert not applies(h=x.bfloat16())  # mixed dtypes
    for i in range(4):  # any parameter in another dtype
        assert not applies(param=(i, params[i].double())), i
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not applies()
    seen = []
    with torch.no_grad():
        torch.jit.trace(lambda a: seen.append(cpu_residual_applies(a, a, a, a, *params)) or a * 2, x,
                        check_trace=False)
    assert seen and not any(seen)


def _serves_step(step, past, x, weight):
    """Whether a decoding step kernel serves these inputs (it runs on copies: it advances its window in place)."""
    return step(past.clone(), x, weight) is not None


def test_window_step_applies_only_without_autograd_in_one_dtype():
    serves = partial(_serves_step, readout_cpu.step)
    past, x, taps = torch.zeros(2, 6, 3), torch.zeros(2, 1, 2, 3), torch.zeros(4, 3, 2)  # (B, d_v*d, K-1), (K, d, d_v)
    with torch.no_grad():
        assert serves(past, x, taps) and serves(past.double(), x.double(), taps.double())
        assert not serves(past, x, taps.double()) and not serves(past, x.double(), taps)
        assert not serves(past.bfloat16(), x.bfloat16(), taps.bfloat16())
        assert not serves(torch.zeros(2, 3, 6).transpose(1, 2), x, taps)  # it is advanced in place: contiguous only
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not serves(past, x, taps)
    assert not serves(past, x, taps)  # grad enabled: the kernel has no backward


def test_ec_step_applies_only_without_autograd_in_one_dtype():
    serves = partial(_serves_step, conv_cpu.step)
    past, x, weight = torch.zeros(2, 3, 3), torch.zeros(2, 1, 3), torch.zeros(4, 3, 2)  # (B, d, K-1), (K, d, d_v)
    with torch.no_grad():
        assert serves(past, x, weight) and serves(past.double(), x.double(), weight.double())
        assert not serves(past, x, weight.double()) and not serves(past, x.double(), weight)
        assert not serves(past.bfloat16(), x.bfloat16(), weight.bfloat16())
        assert not serves(torch.zeros(2, 3, 3).transpose(1, 2), x, weight)  # it is advanced in place: contiguous only
        assert not serves(past, x, torch.zeros(4, 2, 3).transpose(1, 2))  # read in the model's layout
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not serves(past, x, weight)
    assert not serves(past, x, weight)  # grad enabled: the kernel has no backward


@pytest.mark.parametrize("overrides", [{"ddl_value_channels": 1}, {}, {"ddl_compressor": "tc", "ddl_embed_conv": False},
                                       {"ddl_value_channels": 1, "ddl_value_input": "context"}],
                         ids=["dv1", "dv4-cc-ec", "dv4-tc", "dv1-context"])
def test_models_take_the_kernel_in_training_and_decoding(overrides, monkeypatch):
    """Every sublayer of a training forward and of each decoding step goes through the kernel, and at d_v > 1 the
    attention's seam also makes the MLP's input (its compressor's readout; TC's only where the cache holds no tokens
    before), so a block's compressors read one state; TC's steps read their cached windows. The loss,
    every parameter's gradient and greedy generation equal the reference implementation's."""
    from ddl import ops

    seams, readouts = [], count_calls(monkeypatch, "token_readout", "C++")
    for op in ("delta_residual", "delta_residual_readout"):  # (seams.append: whether it made the next input too)
        kernel = ops.kernel(op, "auto", torch.device("cpu"))
        monkeypatch.setitem(ops._installed[op], "cpu", lambda *args, kernel=kernel: (
            lambda out: out if out is None else seams.append(len(args) > 11 and args[11] is not None) or out)(
                kernel(*args)))
    expanded = overrides.get("ddl_value_channels", 4) > 1
    tc = expanded and overrides.get("ddl_compressor", "cc") == "tc"
    models = {}
    for name, impl in (("reference", "reference"), ("fused", "auto")):
        torch.manual_seed(0)
        models[name] = DDLForCausalLM(tiny_config(ddl_implementation=impl, **overrides))
        with torch.no_grad():
            for name, param in models[name].named_parameters():
                if "_delta." in name:
                    param.add_(0.1 * torch.randn_like(param))
    layers = models["fused"].config.num_hidden_layers
    ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(1))

    def assert_every_sublayer_took_it(forwards, cached=0):
        """`forwards` without a cache, then `cached` forwards with one (a prompt, then one-token steps)."""
        steps = max(cached - 1, 0)  # (the first cached forward, the prompt, finds the cache empty)
        ahead = layers * (forwards + min(cached, 1) + (0 if tc else steps)) if expanded else 0
        assert (len(seams), sum(seams)) == (2 * layers * (forwards + cached), ahead)  # (sum: seams that read ahead)
        if expanded:
            assert len(readouts) == (layers + 1) * (forwards + min(cached, 1) + (0 if tc else steps))
        seams.clear()
        readouts.clear()

    assert_same_loss_and_gradients(models, ids, loss_atol=1e-5, grad_rtol=1e-4, grad_atol=1e-5)
    assert_every_sublayer_took_it(1)  # one training forward of the fused model
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    generated = {impl: m.eval().generate(ids[:1, :4], **kwargs) for impl, m in models.items()}
    assert_every_sublayer_took_it(0, 5)  # the prompt's forward, then 4 one-token steps
    assert torch.equal(generated["fused"], generated["reference"])


def test_build_failure_and_switch_fall_back_to_pytorch(monkeypatch, caplog):
    """No compiler (a failed build) or DDL_CPU_KERNEL=0: no kernel, a warning that says so, the PyTorch path."""
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(build, "_ops", None)
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no c++")))
    with caplog.at_level("WARNING"):
        assert cpu_kernel() is None
    assert "could not be built" in caplog.text and "no c++" in caplog.text
    x = torch.zeros(1, 1, 8)
    assert not cpu_residual_applies(x, x, x, x, torch.zeros(8), torch.zeros(1), torch.zeros(1, 8), torch.zeros(1))
    model = DDLForCausalLM(tiny_config(ddl_value_channels=1))
    ids = torch.randint(3, 99, (1, 5), generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(model(ids, labels=ids).loss)  # the PyTorch path
    assert build._ops is False  # remembered: no second build attempt (1-2 min) in this process
    monkeypatch.setattr(build, "_ops", None)
    monkeypatch.setenv("DDL_CPU_KERNEL", "0")
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("DDL_CPU_KERNEL=0 must not build"))
    assert cpu_kernel() is None


@pytest.mark.parametrize("value", ["disable", "disabled", "none", "2"])
def test_a_mistyped_switch_is_an_error_not_on(value, monkeypatch):
    """`DDL_CPU_KERNEL=disable` once meant "on" (only 0/false/no/off switched it off): a value that is neither is
    one clear error, raised before any build. (Failed: it built.)"""
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(build, "_ops", None)
    monkeypatch.setenv("DDL_CPU_KERNEL", value)
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail(f"DDL_CPU_KERNEL={value} built"))
    with pytest.raises(ValueError, match="DDL_CPU_KERNEL"):
        cpu_kernel()


# the token convolutions with a C++ kernel: (kernel, spec, applies, x's feature shape, d_v is x's (readout) or out's)
_TOKEN_CONVS = {
    "readout": (cpu_token_readout, causal_token_readout, readout_cpu.run, (3, 8)),  # (B, T, d_v, d) -> (B, T, d)
    "ec": (cpu_token_conv, causal_token_conv, conv_cpu.run, (8,)),  # (B, T, d) -> (B, T, d_v, d)
}


@pytest.mark.parametrize("with_history", [False, True], ids=["start", "history"])
@pytest.mark.parametrize("kernel", [1, 4], ids=["1-tap", "4-taps"])  # the readout: CC, TC
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("op", list(_TOKEN_CONVS))
def test_token_conv_kernel_equals_spec(op, kernel, threads, with_history):
    """The TC readout (CC: one tap) and EC, and their gradients, over enough tokens (3 x 40) to be split over threads;
    a sequence shorter than the taps (3 tokens) has outputs that read zeros before its first token and gradients
    from fewer taps."""
    cpu_op, spec_op, applies, features = _TOKEN_CONVS[op]
    g = torch.Generator().manual_seed(kernel)
    for length in (40, 3):
        x = torch.randn(3, length, *features, generator=g, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(kernel, 8, 3, generator=g, dtype=torch.float64, requires_grad=True)  # (K, d, d_v)
        history = torch.randn(3, kernel - 1, *features, generator=g, dtype=torch.float64) if with_history else None
        spec = spec_op(x, weight, history)
        cotangent = torch.randn(spec.shape, generator=g, dtype=torch.float64)
        spec_grads = torch.autograd.grad(spec, (x, weight), cotangent)
        assert applies(x.detach(), as_taps(weight.detach())) is not None  # (it serves these)
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = cpu_op(x, weight, history)
            grads = torch.autograd.grad(out, (x, weight), cotangent)
            with torch.no_grad():
                inferred = cpu_op(x, weight, history)
        finally:
            torch.set_num_threads(previous)
        for got, expected in zip((out, inferred, *grads), (spec, spec, *spec_grads)):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", list(_TOKEN_CONVS))
def test_token_conv_second_derivative_raises(op):
    """The C++ gradients carry no graph: their first derivatives pass gradcheck, and under create_graph the backward
    raises (before, autograd took them for constants: a second derivative silently wrong)."""
    cpu_op = _TOKEN_CONVS[op][0]
    g = torch.Generator().manual_seed(0)
    features = (2, 3) if op == "readout" else (3,)  # (d_v, d) or (d,)
    x = torch.randn(2, 5, *features, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(cpu_op, (x, weight))
    out = cpu_op(x, weight)
    with pytest.raises(RuntimeError, match="second derivative .*'reference'"):
        torch.autograd.grad(out, x, torch.ones_like(out, requires_grad=True), create_graph=True)


def test_weight_gradients_are_repeatable_on_several_threads():
    """Each chunk of tokens sums into a buffer of its own: three runs on four threads agree bit for bit (threads
    racing on a shared sum would not). (The chunks are then added in token order; no test here can show that order,
    since on this machine threads mostly finish in token order anyway.)"""
    residual, x, h, c, u = _seam(4, "delta", "state", 4.0, torch.float32, batch=4, seq_len=64, edge_rows=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        runs = [_run(residual, x, h, c, u, use_kernel=True) for _ in range(3)]
    finally:
        torch.set_num_threads(threads)
    for later in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], later))


# ------------------------------------------------------------------------- a killed build must not hang the next


_BUILDER = r"""
import os, sys, time
import torch.utils.cpp_extension as cpp
folder = sys.argv[1]
cpp._get_build_directory = lambda name, verbose: folder

def stuck_build(name, *args, build_directory=None, **kwargs):  # takes torch's lock as a real build does, then hangs
    baton = cpp.FileBaton(os.path.join(build_directory or folder, "lock"))
    assert baton.try_acquire()
    print("building", flush=True)
    time.sleep(600)

cpp.load = stuck_build
from ddl_kernels import build
build.kernels()
"""


def _start_stuck_build(folder):
    """A process in the middle of a kernel build (torch's lock file taken), as far as anyone else can tell."""
    env = {k: v for k, v in os.environ.items() if k != "DDL_CPU_KERNEL"}
    proc = subprocess.Popen([sys.executable, "-c", _BUILDER, str(folder)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "building", "the stand-in build did not start"
    return proc


@pytest.fixture
def fake_torch_build(tmp_path, monkeypatch):
    """torch's extension build pointed at a fresh folder, standing in for `load` with its locking: a `lock` file left
    in the folder makes torch wait forever (FileBaton.wait), here an error instead."""
    import torch.utils.cpp_extension as cpp

    built = object()

    def load(name, *args, build_directory=None, **kwargs):
        baton = cpp.FileBaton(os.path.join(build_directory or str(tmp_path), "lock"))
        if not baton.try_acquire():
            raise TimeoutError("torch would wait for its lock file forever")
        baton.release()
        return built

    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp, "load", load)
    monkeypatch.setattr(build, "_ops", None)
    monkeypatch.delenv("DDL_CPU_KERNEL", raising=False)
    return tmp_path, built


def test_a_build_killed_midway_does_not_hang_the_next_one(fake_torch_build, caplog):
    """kill -9 during a build leaves torch's lock file; every later process used to wait for it forever."""
    folder, built = fake_torch_build
    stuck = _start_stuck_build(folder)
    stuck.send_signal(signal.SIGKILL)
    stuck.wait()
    assert (folder / "lock").exists()  # what the killed build left
    with caplog.at_level("WARNING"):
        assert cpu_kernel() is built
    assert "killed midway" in caplog.text and not (folder / "lock").exists()


def test_a_build_that_hangs_makes_others_fall_back_not_wait(fake_torch_build, caplog, monkeypatch):
    """A live build that takes far too long: the others use the PyTorch path after a bounded wait (they waited
    forever)."""
    folder, _ = fake_torch_build
    monkeypatch.setattr(build, "STALE_AFTER_S", 1.0)
    stuck = _start_stuck_build(folder)
    try:
        with caplog.at_level("WARNING"):
            assert cpu_kernel() is None
    finally:
        stuck.kill()
        stuck.wait()
    assert "another process has held the build lock" in caplog.text


def test_a_lock_file_a_live_build_holds_is_waited_for_not_removed(fake_torch_build, caplog, monkeypatch):
    """A build that does not take DDL's lock (another DDL version sharing the cache) and holds torch's lock file open:
    its file is left alone, and after a bounded wait this process takes the PyTorch path (it used to wait forever)."""
    folder, _ = fake_torch_build
    monkeypatch.setattr(build, "STALE_AFTER_S", 1.0)
    holder = (f"import os, time, torch.utils.cpp_extension as cpp; b = cpp.FileBaton({str(folder / 'lock')!r}); "
              "assert b.try_acquire(); print('building', flush=True); time.sleep(600)")
    other = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "building"
        with caplog.at_level("WARNING"):
            assert cpu_kernel() is None
        assert (folder / "lock").exists() and f"held by process {other.pid}" in caplog.text
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("age", [0.0, 3600.0], ids=["young", "old"])
def test_a_lock_file_whose_holder_cannot_be_told(age, fake_torch_build, caplog, monkeypatch):
    """Where the processes holding torch's lock file cannot be looked up (another user's), its age decides: one
    untouched for `STALE_AFTER_S` is stale (removed, and the build goes on); a younger one is waited for until then."""
    folder, built = fake_torch_build
    monkeypatch.setattr(build, "_baton_holders", lambda baton: None)
    monkeypatch.setattr(build, "STALE_AFTER_S", 1.0)
    (folder / "lock").write_text("")
    os.utime(folder / "lock", (time.time() - age, time.time() - age))
    start = time.monotonic()
    with caplog.at_level("WARNING"):
        assert cpu_kernel() is built
    assert not (folder / "lock").exists() and "untouched for" in caplog.text
    assert (time.monotonic() - start >= 0.9) == (age == 0.0)


def test_each_pytorch_installation_keeps_its_own_kernel_build(monkeypatch):
    """Two environments sharing ~/.cache/torch_extensions compile with different header folders; under one name each
    would rebuild the other's kernel (and wait for its lock) on every start."""
    here = build.library_name()
    assert build.library_name() == here  # stable within one installation
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/site-packages/torch/__init__.py")
    assert build.library_name() != here


def test_each_checkout_keeps_its_own_kernel_build(tmp_path, monkeypatch):
    """Two clones (or worktrees) of one version: the same sources, but torch's build arguments name each one's
    folder (its include path), so under one name each start of the other rebuilt it (1.5-2 minutes here)."""
    here = build.library_name()
    other = tmp_path / "clone" / "ddl_kernels"
    shutil.copytree(build.HERE, other, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(build, "HERE", str(other))
    assert len(build.sources()) > 1 and all(path.startswith(str(other)) for path in build.sources())  # (copies)
    assert build.library_name() != here


def test_one_checkout_reached_through_a_link_keeps_one_build(tmp_path):
    """The same folder imported through a symlink (a linked home or project folder) is the same build, not a second
    one that rebuilds the first's in turn."""
    link = tmp_path / "linked-checkout"
    link.symlink_to(os.path.dirname(os.path.dirname(build.__file__)))
    probe = "import ddl_kernels.build as b; print(b.__file__); print(b.library_name())"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(link)}).stdout.split()
    assert out[0].startswith(str(link)) and out[1] == build.library_name()
