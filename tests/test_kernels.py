"""The dispatcher (`ddl.ops`) runs the specifications (`ddl.reference`) or ddl_kernels' implementation for the
inputs' device, as its table says; the specifications' readouts keep no copy of the state and sum in fp32; the
kernels equal the specifications on outputs and gradients: the C++ ones in tests/test_cpu_kernel.py, the Triton ones
here through Triton's CPU interpreter; a kernel that fails gives way to the specification; a checkpoint's code runs
without ddl_kernels."""

import warnings
from functools import partial

import pytest
import torch

from conftest import assert_same_loss_and_gradients, seeded, tiny_config, trained_looking, triton_on_cpu
from ddl import DDLForCausalLM, ops
from ddl.modeling_ddl import window_history
from ddl.ops import conv_step, token_conv, token_readout, window_step
from ddl.reference import causal_token_conv, causal_token_readout, delta_residual, delta_update, folded_conv_read


pytestmark = pytest.mark.device  # (runs on DDL_TEST_DEVICE: see conftest.py)


def _inputs(dv, dtype, seed=0, zero_h=False):
    g = seeded(seed)
    shape = (2, 3) + ((dv,) if dv > 1 else ()) + (6,)  # the state: (B, T, d) or (B, T, d_v, d)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    h = torch.randn(2, 3, 6, generator=g, dtype=torch.float64)
    h = (h * 0 if zero_h else h).to(dtype).requires_grad_()
    v = torch.rand(2, 3, dv, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    beta = (2 * torch.rand(2, 3, 1, generator=g, dtype=torch.float64)).to(
        torch.promote_types(dtype, torch.float32)).requires_grad_()
    return x, h, v, beta


def test_the_table_says_which_kernels_each_choice_runs(monkeypatch):
    """"auto" runs ddl_kernels' CPU kernels, "triton" also its CUDA ones, "torch" and "reference" none; inside a
    trace none (Inductor fuses the specification); an unknown name is one error that names the choices."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(ops, "_installed", {"token_readout": {"cpu": "C++", "cuda": "Triton"}})
    assert [ops.kernel("token_readout", name, cpu) for name in ops.FAST] == ["C++", "C++", None, None]
    assert [ops.kernel("token_readout", name, cuda) for name in ops.FAST] == [None, "Triton", None, None]
    assert ops.kernel("delta_residual", "auto", cpu) is None  # (none installed)
    assert torch.compile(lambda: ops.kernel("token_readout", "auto", cpu), backend="eager", fullgraph=True)() is None
    with pytest.raises(ValueError, match=r"ddl_implementation='fast' must be one of \('auto', 'triton'"):
        ops.choose("fast")


@pytest.mark.parametrize("found", ["missing", "another interface"])
def test_without_the_kernels_of_this_interface_the_specifications_run(found, monkeypatch, caplog):
    """A checkpoint's code next to no ddl_kernels, or one of another interface version: the specifications run (the
    same numbers), with one line that says why (a warning for another version: an install to fix)."""
    import sys

    import ddl_kernels

    monkeypatch.setattr(ops, "_installed", None)
    if found == "missing":
        monkeypatch.setitem(sys.modules, "ddl_kernels", None)  # (import raises ImportError)
    else:
        monkeypatch.setattr(ddl_kernels, "INTERFACE_VERSION", ops.INTERFACE_VERSION + 1)
    with caplog.at_level("INFO", logger="transformers.ddl"):
        assert ops.kernel("delta_residual", "auto", torch.device("cpu")) is None
    assert ("not installed" if found == "missing" else "interface version") in caplog.text
    models = {}
    for name, impl in (("reference", "reference"), ("fused", "auto")):
        torch.manual_seed(0)
        models[name] = trained_looking(DDLForCausalLM(tiny_config(ddl_implementation=impl)))
    assert_same_loss_and_gradients(models, torch.randint(3, 99, (2, 8), generator=seeded(1)), loss_atol=0,
                                   grad_rtol=0, grad_atol=0)


@pytest.mark.parametrize("gate", ["two-layer", "constant target", "additive"])
def test_the_seams_no_kernel_serves_run_the_specification(gate, monkeypatch):
    """A two-layer gate, a constant target and the additive control: the dispatcher asks no kernel."""
    asked = []
    monkeypatch.setattr(ops, "_installed", {"delta_residual": {"cpu": lambda *args, **kwargs: asked.append(1)}})
    overrides = {"two-layer": dict(ddl_beta_hidden_size=8), "constant target": dict(ddl_v_constant=2.0),
                 "additive": dict(ddl_residual="additive")}[gate]
    model = DDLForCausalLM(tiny_config(**overrides))
    model(torch.randint(3, 99, (2, 5), generator=seeded(0)))
    assert not asked


def test_zero_branch_output_gives_finite_gradients():
    inputs = _inputs(4, torch.float32, zero_h=True)
    delta_update(*inputs).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in inputs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dv", [1, 4], ids=["dv1", "dv4"])
def test_low_precision_tiny_or_zero_h_is_finite(dtype, dv):
    x, h, v, beta = (t.detach() for t in _inputs(dv, dtype))
    for scale in (0.0, 1e-4):
        hh = (h * scale).requires_grad_()
        xx = x.clone().requires_grad_()
        out = delta_update(xx, hh, v, beta)
        assert torch.isfinite(out).all()
        out.float().sum().backward()
        assert torch.isfinite(xx.grad).all()
        # dk/dh = I/eps_k at h = 0 (1e5): finite in bf16's range, not in fp16's
        assert dtype == torch.float16 or torch.isfinite(hh.grad).all()


@pytest.mark.parametrize("overrides", [{"ddl_value_channels": 1}, {}, {"ddl_compressor": "tc", "ddl_residual": "write_only"},
                                       {"ddl_compressor": "tc"}])
def test_models_with_either_implementation_agree(overrides, cpu_kernel_on_or_off):
    models = {}
    for name, impl in (("reference", "reference"), ("fused", "auto")):
        torch.manual_seed(0)
        models[name] = DDLForCausalLM(tiny_config(ddl_implementation=impl, **overrides))
    ids = torch.randint(3, 99, (2, 8), generator=seeded(1))
    assert_same_loss_and_gradients(models, ids)


# ---------------------------------------------------------------------------------------------------------------
# The token readout (TC; CC is its one-tap case)


def _readout_inputs(kernel, seq_len, dtype=torch.float64, seed=0):
    g = seeded(seed)
    x = torch.randn(3, seq_len, 2, 5, generator=g, dtype=torch.float64).to(dtype).requires_grad_()  # (B, T, d_v, d)
    weight = torch.randn(kernel, 5, 2, generator=g, dtype=torch.float64).to(dtype).requires_grad_()  # (K, d, d_v)
    return x, weight


def _readout_by_definition(x, weight, history=None):
    """y[t] = sum_s sum_j weight[s, :, j] x[t - (K-1) + s, j] (zeros before the first token), token by token."""
    kernel = weight.shape[0]
    full = torch.cat([x.new_zeros(x.shape[0], kernel - 1, *x.shape[2:]) if history is None else history, x], dim=1)
    taps = weight.transpose(1, 2)  # (K, d_v, d)
    return torch.stack([sum((full[:, t + s] * taps[s]).sum(-2) for s in range(kernel))
                        for t in range(x.shape[1])], dim=1)


@pytest.mark.parametrize("kernel, seq_len", [(1, 4), (3, 5), (4, 2)], ids=["cc", "tc", "tc-short"])
def test_the_readouts_specification_is_its_definition(kernel, seq_len):
    """`causal_token_readout` (taps summed into slices of its output, no window built) equals the readout written
    token by token, with and without history, and its gradients pass gradcheck (fp64)."""
    x, weight = _readout_inputs(kernel, seq_len)
    history = torch.randn(3, kernel - 1, 2, 5, dtype=torch.float64)
    for past in (None, history):
        torch.testing.assert_close(causal_token_readout(x, weight, past), _readout_by_definition(x, weight, past),
                                   rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(causal_token_readout, (x, weight))
    assert torch.autograd.gradcheck(lambda a, w: causal_token_readout(a, w, history), (x, weight))
    assert torch.autograd.gradgradcheck(causal_token_readout, (x, weight))


@pytest.mark.parametrize("kernel", [1, 4], ids=["cc", "tc"])
def test_the_readouts_specification_keeps_no_copy_of_the_state(kernel):
    """Without history the readout builds no window: autograd keeps views of the state itself, never a state-sized
    copy (a copy per compressor raised the specification's peak training memory from 1.35x to 1.57x of Llama), and
    the state rebuild can stand in for them (`StateRebuild` rebuilds views of its states)."""
    x, weight = torch.randn(2, 6, 4, 5, requires_grad=True), torch.randn(kernel, 5, 4, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        causal_token_readout(x, weight)
    of_tokens = [t for t in saved if t.dim() >= 3]  # (B, T, ...): not a tap's row of the weight
    assert of_tokens and all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in of_tokens)


@torch.no_grad()
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 2e-2)],
                         ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("seq_len", [1, 2, 6], ids=["decode-step", "two-tokens", "prefill"])
@pytest.mark.parametrize("kernel", [1, 4], ids=["cc", "tc"])
def test_dispatched_readouts_match_the_exact_numbers(kernel, seq_len, dtype, tol, cpu_kernel_on_or_off):
    """The readout as the dispatcher runs it (the C++ kernel or the specification), summing in fp32 for bf16: the
    specification's numbers in fp64, rounded to the dtype."""
    x, weight = (t.detach() for t in _readout_inputs(kernel, seq_len, dtype))
    history = torch.randn(3, kernel - 1, 2, 5, dtype=torch.float64).to(dtype)
    for past in (None, history):
        out = token_readout(x, weight, past, "auto")
        exact = causal_token_readout(x.double(), weight.double(), None if past is None else past.double())
        assert out.dtype == dtype
        torch.testing.assert_close(out, exact.to(dtype), rtol=tol, atol=tol)


@torch.no_grad()
@pytest.mark.parametrize("seq_len", [1, 2, 6], ids=["decode-step", "two-tokens", "prefill"])
@pytest.mark.parametrize("kernel", [1, 4], ids=["cc", "tc"])
def test_token_readout_sums_bf16_products_in_fp32(kernel, seq_len):
    """Two rows whose products cancel but for a part bf16 cannot hold: 4096 (1 + 2^-7)^2 - 4096 (1 + 2^-6) = 1/4,
    which the fp32 sum keeps and a bf16 one loses (the random inputs above are within bf16's tolerance either way)."""
    x = torch.empty(2, seq_len, 2, 3, dtype=torch.bfloat16)
    x[:, :, 0], x[:, :, 1] = 4096 * (1 + 2**-7), -4096
    weight = torch.zeros(kernel, 3, 2, dtype=torch.bfloat16)  # (K, d, d_v): the last tap reads the token itself
    weight[-1, :, 0], weight[-1, :, 1] = 1 + 2**-7, 1 + 2**-6
    assert torch.equal(causal_token_readout(x.double(), weight.double()), torch.full((2, seq_len, 3), 0.25,
                                                                                      dtype=torch.float64))
    assert torch.equal(causal_token_readout(x, weight), torch.full((2, seq_len, 3), 0.25, dtype=torch.bfloat16))


def _cache_window(history, x):
    """A decoding step's window as the cache holds it (`modeling_ddl.cached_window`): time last, `(B, C, K-1+T)`."""
    full = torch.cat([history, x], dim=1)
    return full.reshape(full.shape[0], full.shape[1], -1).transpose(1, 2)


def _from_window(op, x, weight, window, implementation="auto"):
    """The readout (or EC) of x given its window as the cache holds it, as `modeling_ddl.convolve_tokens` runs it: a
    decoding step reads the K-1 inputs before x in place and advances them (checked: to the window's last K-1),
    anything else gets the window's history back."""
    if x.shape[1] == 1 and not torch.is_grad_enabled():
        past = window[..., :-1].contiguous()
        out = (window_step if op is token_readout else conv_step)(past, x, weight, implementation)
        torch.testing.assert_close(past, window[..., 1:], rtol=0, atol=0)
        return out
    return op(x, weight, window_history(window, x), implementation)


@torch.no_grad()
@pytest.mark.parametrize("implementation", ["auto", "reference"])
@pytest.mark.parametrize("seq_len", [1, 3], ids=["decoding-step", "continuation"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dispatched_token_convolutions_with_a_cached_window_match_reference(dtype, seq_len, implementation,
                                                                           cpu_kernel_on_or_off):
    """The readout and EC given their window as the cache holds it (a decoding step reads it in place and advances
    it: the C++ window step or the specification; longer inputs go back to the state layout) equal the specs given the
    same inputs as history; also for a window sliced from a longer cache (assisted decoding's)."""
    g = seeded(0)
    x = torch.randn(3, seq_len, 2, 5, generator=g, dtype=dtype)
    history = torch.randn(3, 3, 2, 5, generator=g, dtype=dtype)
    weight = torch.randn(4, 5, 2, generator=g, dtype=dtype)
    window = _cache_window(history, x)
    longer = torch.cat([torch.randn(3, 10, 10, generator=g, dtype=dtype), window], dim=-1)[..., -window.shape[-1]:]
    expected = causal_token_readout(x, weight, history)
    for w in (window, longer):
        torch.testing.assert_close(_from_window(token_readout, x, weight, w, implementation), expected, rtol=0,
                                   atol=1e-6)
    embeds, past = torch.randn(3, seq_len, 5, generator=g, dtype=dtype), torch.randn(3, 3, 5, generator=g, dtype=dtype)
    torch.testing.assert_close(_from_window(token_conv, embeds, weight, _cache_window(past, embeds), implementation),
                               causal_token_conv(embeds, weight, past), rtol=0, atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("kernel", [2, 3, 9])  # (the C++ step is compiled for K-1 up to 7, any other at run time)
@pytest.mark.parametrize("implementation", ["auto", "reference"])
def test_window_step_equals_the_spec_for_one_token(implementation, kernel, cpu_kernel_on_or_off):
    """Token after token from the cache's window (advanced in place by each step) equals the readout of the whole
    sequence, and the window ends as the last K-1 inputs."""
    g = seeded(1)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        x = torch.randn(2, 11, 3, 4, generator=g, dtype=dtype)
        weight = torch.randn(kernel, 4, 3, generator=g, dtype=dtype)
        past = torch.zeros(2, 12, kernel - 1, dtype=dtype)  # (B, d_v*d, K-1): the start of a sequence
        steps = torch.cat([window_step(past, x[:, t : t + 1], weight, implementation) for t in range(11)], dim=1)
        whole = token_readout(x, weight, None, implementation)
        torch.testing.assert_close(steps, whole, rtol=tol, atol=tol)
        torch.testing.assert_close(past, _cache_window(x[:, 12 - kernel :], x[:, :0]), rtol=0, atol=0)


@torch.no_grad()
@pytest.mark.parametrize("kernel", [2, 4])
@pytest.mark.parametrize("implementation", ["auto", "reference"])
def test_conv_step_equals_the_spec_for_one_token(implementation, kernel, cpu_kernel_on_or_off):
    """EC token after token from the cache's window (advanced in place by each step) equals EC of the whole sequence,
    and the window ends as the last K-1 embeddings."""
    g = seeded(2)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        x = torch.randn(2, 11, 5, generator=g, dtype=dtype)
        weight = torch.randn(kernel, 5, 3, generator=g, dtype=dtype)
        past = torch.zeros(2, 5, kernel - 1, dtype=dtype)  # (B, d, K-1): the start of a sequence
        steps = torch.cat([conv_step(past, x[:, t : t + 1], weight, implementation) for t in range(11)], dim=1)
        torch.testing.assert_close(steps, causal_token_conv(x, weight), rtol=tol, atol=tol)
        torch.testing.assert_close(past, x[:, 12 - kernel :].transpose(1, 2), rtol=0, atol=0)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_token_conv_low_precision_decoding_steps_equal_prefill(dtype):
    """EC token by token from the cache computes what the whole sequence computes, in the same order: bit for bit."""
    g = seeded(0)
    x, weight = torch.randn(2, 12, 64, generator=g).to(dtype), torch.randn(4, 64, 4, generator=g).to(dtype)
    padded = torch.cat([x.new_zeros(2, 3, 64), x], dim=1)
    steps = torch.cat([_from_window(token_conv, x[:, t : t + 1], weight,
                                    _cache_window(padded[:, t : t + 3], x[:, t : t + 1])) for t in range(12)], dim=1)
    assert torch.equal(steps, token_conv(x, weight))
    exact = causal_token_conv(x.double(), weight.double())
    torch.testing.assert_close(steps.double(), exact, rtol=2**-6, atol=1e-2)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_token_readout_low_precision_decoding_equals_prefill(dtype):
    """Token by token from the cache gives what the whole sequence gives (both accumulate in fp32)."""
    g = seeded(0)
    x = torch.randn(2, 12, 4, 64, generator=g).to(dtype)
    weight = torch.randn(4, 64, 4, generator=g).to(dtype)
    prefill = token_readout(x, weight)
    padded = torch.cat([x.new_zeros(2, 3, 4, 64), x], dim=1)
    steps = torch.cat([_from_window(token_readout, x[:, t : t + 1], weight,
                                    _cache_window(padded[:, t : t + 3], x[:, t : t + 1])) for t in range(12)], dim=1)
    torch.testing.assert_close(steps, prefill, rtol=2**-7, atol=1e-3)
    exact = causal_token_readout(x.double(), weight.double())
    torch.testing.assert_close(prefill.double(), exact, rtol=2**-7, atol=1e-2)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels: on CPU through the interpreter (conftest sets TRITON_INTERPRET=1), on CUDA when there is one.


def _triton(op):
    """ddl_kernels' Triton module of an operation (residual, readout, conv)."""
    pytest.importorskip("triton")
    import importlib

    return importlib.import_module(f"ddl_kernels.{op}.triton")


def _seam_inputs(dv, dtype, seed):
    """x, h, c, u and the gate's and value's weights, trained-looking, d = 200 (a partial block of 256 features)."""
    g = seeded(seed)
    shape = (2, 3) + ((dv,) if dv > 1 else ()) + (200,)
    randn = partial(torch.randn, generator=g, dtype=torch.float64)
    x, h, c, u = (randn(s) for s in (shape, *3 * [(2, 3, 200)]))
    weights = [0.1 * randn(200), randn(1), 0.1 * randn(dv, 200), randn(dv)]
    return [t.to(dtype) for t in (x, h, c, u, *weights)]


@pytest.mark.parametrize("mode, v_scale", [("delta", 4.0), ("write_only", 4.0), ("delta", None)],
                         ids=["delta", "write_only", "linear-value"])
@pytest.mark.parametrize("dv, value_input", [(1, "u"), (1, "c"), (1, "state"), (3, "u"), (4, "u"), (4, "c")],
                         ids=["dv1-u", "dv1-c", "dv1-state", "dv3-u", "dv4-u", "dv4-c"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "autocast"], ids=["fp32", "bf16", "autocast"])
def test_triton_seam_matches_reference(dv, mode, v_scale, value_input, dtype):
    """The Triton seam (gate, value and update in one kernel each way) against `reference.delta_residual` in fp64:
    outputs and the gradients of every input and weight (each in the specification's dtype), with u a tensor of its
    own, c, or the d_v = 1 state; "autocast": everything fp32 but h, a bf16 product (accelerate's mixed precision)."""
    seam = _triton("residual").run
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = _seam_inputs(dv, torch.float32 if dtype == "autocast" else dtype, seed=dv)
    if dtype == "autocast":
        inputs[1] = inputs[1].bfloat16()
    runs = {}
    for name, run, exact in (("exact", delta_residual, True), ("spec", delta_residual, False), ("seam", seam, False)):
        leaves = [t.to(device=device, dtype=torch.float64 if exact else t.dtype).clone().requires_grad_()
                  for t in inputs]
        x, h, c, u = leaves[:4]
        u = {"u": u, "c": c, "state": x}[value_input]
        with torch.autocast(device, torch.bfloat16, enabled=dtype == "autocast" and name == "seam"):
            out = run(x, h, c, u, *leaves[4:], v_scale, 1e-5, mode)
            upstream = torch.randn(out.shape, generator=seeded(7), dtype=torch.float64).to(device)
            (out.double() * upstream).sum().backward()
        runs[name] = out, leaves
    out, leaves = runs["seam"]
    assert out.dtype == runs["spec"][0].dtype and out.shape == runs["exact"][0].shape
    names = "x h c u w b w_v b_v".split()
    for name, exact, spec, fast in zip(["out", *names], *([r[0], *r[1]] for r in runs.values())):
        exact, spec, fast = ((t if name == "out" else t.grad) for t in (exact, spec, fast))
        if exact is None:  # (u unused: it is c or the state)
            assert fast is None and spec is None, name
            continue
        assert fast.dtype == spec.dtype, name
        tol = 1e-5 if fast.dtype == torch.float32 else 3e-2  # (bf16: a rounding, which the interpreter truncates)
        torch.testing.assert_close(fast.double(), exact, rtol=tol, atol=tol * max(1.0, exact.abs().max().item()),
                                   msg=name)


@pytest.mark.parametrize("frozen", [(4, 5, 6, 7), (4, 5), (6, 7)], ids=["gate-and-value", "gate", "value"])
def test_triton_seam_with_frozen_weights_gives_the_trained_ones_gradients(frozen):
    """With some of the gate's and value's weights frozen (LoRA trains the projections, not these; a user may freeze
    the gate alone), the seam gives the frozen ones no gradient and every other tensor its specification's."""
    seam = _triton("residual").run
    device = "cuda" if torch.cuda.is_available() else "cpu"
    grads = {}
    for name, run in (("spec", delta_residual), ("seam", seam)):
        leaves = [t.to(device).requires_grad_(i not in frozen) for i, t in enumerate(_seam_inputs(4, torch.float32, 5))]
        out = run(*leaves, 4.0, 1e-5, "delta")
        out.backward(torch.randn(out.shape, generator=seeded(6)).to(device))
        grads[name] = [t.grad for t in leaves]
    for i, (spec, fast) in enumerate(zip(grads["spec"], grads["seam"])):
        if i in frozen:
            assert spec is None and fast is None, i
        else:
            torch.testing.assert_close(fast, spec, rtol=1e-5, atol=1e-5, msg=str(i))


@pytest.mark.parametrize("programs", [1, 3, 8])
@pytest.mark.parametrize("dv, value_input", [(1, "state"), (4, "u"), (4, "c")], ids=["dv1-state", "dv4-u", "dv4-c"])
def test_triton_seam_backward_in_runs_of_tokens(programs, dv, value_input, monkeypatch):
    """The seam's backward runs consecutive tokens per program and sums the weights' gradients per program before the
    rows are added: with 22 tokens in 1 run, in 3 (8, 8 and a shorter last) or in 8, every gradient is the
    specification's."""
    residual = _triton("residual")
    monkeypatch.setattr(_triton("readout"), "_programs", lambda tokens, device: min(tokens, programs))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = seeded(11)
    shape = (2, 11) + ((dv,) if dv > 1 else ()) + (40,)
    inputs = [torch.randn(s, generator=g) for s in (shape, (2, 11, 40), (2, 11, 40), (2, 11, 40))]
    inputs += [0.1 * torch.randn(40, generator=g), torch.randn(1, generator=g), 0.1 * torch.randn(dv, 40, generator=g),
               torch.randn(dv, generator=g)]
    grads = {}
    for name, run in (("spec", delta_residual), ("seam", residual.run)):
        leaves = [t.to(device).clone().requires_grad_() for t in inputs]
        x, h, c, u = leaves[:4]
        out = run(x, h, c, {"u": u, "c": c, "state": x}[value_input], *leaves[4:], 4.0, 1e-5, "delta")
        out.backward(torch.randn(out.shape, generator=seeded(12)).to(device))
        grads[name] = [t.grad for t in leaves]
    for i, (spec, fast) in enumerate(zip(grads["spec"], grads["seam"])):
        if spec is None:
            assert fast is None, i
        else:
            torch.testing.assert_close(fast, spec, rtol=1e-5, atol=1e-5, msg=str(i))


_READOUT_SEAM_CASES = [  # (programs, d_v, dtype, tolerance, frozen inputs): trained weights, then frozen ones
    *[pytest.param(programs, dv, dtype, tol, (), id=f"{programs}-programs-dv{dv}-{name}") for programs in (3, 8)
      for dv in (4, 3) for dtype, tol, name in ((torch.float32, 1e-5, "fp32"), (torch.bfloat16, 3e-2, "bf16"))],
    *[pytest.param(3, 4, torch.float32, 1e-5, frozen, id=name) for frozen, name in (
        ((4, 5, 6, 7), "seam-weights-frozen"), ((8,), "readout-frozen"), ((4, 5, 6, 7, 8), "all-frozen"),
        ((9,), "gain-frozen"))]]


@pytest.mark.parametrize("norm", [False, True], ids=["readout", "readout-and-rmsnorm"])
@pytest.mark.parametrize("programs, dv, dtype, tol, frozen", _READOUT_SEAM_CASES)
def test_triton_seam_with_the_next_readout_matches_reference(programs, dv, dtype, tol, frozen, norm, monkeypatch):
    """With a one-tap readout weight (CC's), the seam also gives the next compressor's readout of X_next as stored,
    made in the same pass, and, given the next sublayer's RMSNorm (its gain), that norm of the readout (transformers'
    LlamaRMSNorm, whose input it is in the decoder layer): X_next, y, the normed y and every gradient (the state's
    through all of them, y's through its own use and the norm, the readout weight's and the gain's) equal the
    specification's (the seam, then `causal_token_readout`, then LlamaRMSNorm) in fp64, and a frozen weight (LoRA's
    case) gets none; with K > 1 taps (TC), or u = c, it gives X_next and None (and None for the norm)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    if 9 in frozen and not norm:
        pytest.skip("no gain without the norm")
    residual = _triton("residual")
    monkeypatch.setattr(_triton("readout"), "_programs", lambda tokens, device: min(tokens, programs))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = seeded(dv + programs)
    inputs = [torch.randn(2, 11, dv, 40, generator=g)] + [torch.randn(2, 11, 40, generator=g) for _ in range(3)]
    inputs += [0.1 * torch.randn(40, generator=g), torch.randn(1, generator=g), 0.1 * torch.randn(dv, 40, generator=g),
               torch.randn(dv, generator=g), torch.randn(1, 40, dv, generator=g)]
    inputs += [1 + 0.3 * torch.randn(40, generator=g)] if norm else []
    upstream = [torch.randn(2, 11, dv, 40, generator=g, dtype=torch.float64)] + [
        torch.randn(2, 11, 40, generator=g, dtype=torch.float64) for _ in range(2 if norm else 1)]

    def spec(x, h, c, u, *weights):
        out = delta_residual(x, h, c, u, *weights[:4], 4.0, 1e-5, "delta")
        y = causal_token_readout(out, weights[4])
        if not norm:
            return out, y
        rms = LlamaRMSNorm(40, eps=1e-6).to(device=device, dtype=weights[5].dtype)
        rms.weight = weights[5]  # (the leaf itself: its gradient is the one compared)
        return out, y, rms(y)

    def fast(x, h, c, u, *weights):
        return residual.run(x, h, c, u, *weights[:4], 4.0, 1e-5, "delta", *weights[4:], *([1e-6] if norm else []))

    _matches_the_specification_in_fp64(spec, fast, inputs, upstream, dtype, tol, frozen, 9 if norm else None, device)
    x, h, c, u, *weights = (t.to(device=device, dtype=dtype) for t in inputs[:8])
    extra = [inputs[9].to(device=device, dtype=dtype), 1e-6] if norm else []
    for value_input, readout in ((u, torch.randn(4, 40, dv, generator=g).to(device=device, dtype=dtype)),
                                 (c, inputs[8].to(device=device, dtype=dtype))):
        out, y, *normed = residual.run(x, h, c, value_input, *weights, 4.0, 1e-5, "delta", readout, *extra)
        assert y is None and normed == ([None] if norm else []) and out.shape == x.shape


@pytest.mark.parametrize("value", ["state", "u"])
@pytest.mark.parametrize("dtype, tol, frozen", [(torch.float32, 1e-5, ()), (torch.bfloat16, 3e-2, ()),
                                                (torch.float32, 1e-5, (8,)), (torch.float32, 1e-5, (4, 5, 6, 7))],
                         ids=["fp32", "bf16", "gain-frozen", "seam-weights-frozen"])
def test_triton_seam_at_dv1_makes_the_next_rmsnorm_of_its_state(dtype, tol, frozen, value, monkeypatch):
    """At d_v = 1 the state is the next sublayer's input: given that sublayer's RMSNorm (its gain) and no readout,
    the seam also writes LlamaRMSNorm(X_next) in its pass, and in backward the norm's gradient joins X_next's before
    the seam's kernel reads it: X_next, the normed state and every gradient (the state's through both, the gain's,
    none for a frozen weight) equal the specification's (the seam, then LlamaRMSNorm) in fp64."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    residual = _triton("residual")
    monkeypatch.setattr(_triton("readout"), "_programs", lambda tokens, device: min(tokens, 3))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = seeded(5)
    inputs = [torch.randn(2, 11, 40, generator=g) for _ in range(4)]
    inputs += [0.1 * torch.randn(40, generator=g), torch.randn(1, generator=g), 0.1 * torch.randn(1, 40, generator=g),
               torch.randn(1, generator=g), 1 + 0.3 * torch.randn(40, generator=g)]
    upstream = [torch.randn(2, 11, 40, generator=g, dtype=torch.float64) for _ in range(2)]

    def spec(x, h, c, u, *weights):
        out = delta_residual(x, h, c, u, *weights[:4], 4.0, 1e-5, "delta")
        rms = LlamaRMSNorm(40, eps=1e-6).to(device=device, dtype=weights[4].dtype)
        rms.weight = weights[4]  # (the leaf itself: its gradient is the one compared)
        return out, rms(out)

    def fast(x, h, c, u, *weights):
        out, y, normed = residual.run(x, h, c, u, *weights[:4], 4.0, 1e-5, "delta", None, weights[4], 1e-6)
        assert y is None
        return out, normed

    def value_input(run):  # (u: the state itself, or its own tensor)
        return lambda x, h, c, u, *weights: run(x, h, c, x if value == "state" else u, *weights)

    _matches_the_specification_in_fp64(value_input(spec), value_input(fast), inputs, upstream, dtype, tol, frozen, 8,
                                       device)


@pytest.mark.parametrize("next_readout", [False, True], ids=["alone", "with-next-readout-and-rmsnorm"])
@pytest.mark.parametrize("dtype, tol, frozen", [(torch.float32, 1e-5, ()), (torch.bfloat16, 3e-2, ()),
                                                (torch.bfloat16, 3e-2, (3, 4, 5, 6))],
                         ids=["fp32", "bf16", "bf16-seam-weights-frozen"])
def test_triton_seam_reads_its_value_input_out_of_the_state_again(dtype, tol, frozen, next_readout, monkeypatch):
    """Told that u is x's one-tap readout (`u_read`: CC's, whose output the authors' value reads), a seam that makes
    no readout itself keeps v (d_v floats a token) where it kept u (d) and reads u out of x again in backward; one that
    makes the next readout keeps u (its backward's registers are full), and so does an fp32 one. Either way X_next (and the next readout and
    its RMSNorm) and every gradient (x's through the update and through u, u's weight's, the seam's and the next
    readout's weights', the gain's) equal the specification's (u = `causal_token_readout(x, weight)`, then the seam)
    in fp64."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    residual = _triton("residual")
    monkeypatch.setattr(_triton("readout"), "_programs", lambda tokens, device: min(tokens, 3))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = seeded(11)
    inputs = [torch.randn(2, 11, 4, 40, generator=g)] + [torch.randn(2, 11, 40, generator=g) for _ in range(2)]
    inputs += [0.1 * torch.randn(40, generator=g), torch.randn(1, generator=g), 0.1 * torch.randn(4, 40, generator=g),
               torch.randn(4, generator=g), torch.randn(1, 40, 4, generator=g)]
    inputs += [torch.randn(1, 40, 4, generator=g), 1 + 0.3 * torch.randn(40, generator=g)] if next_readout else []
    upstream = [torch.randn(2, 11, 4, 40, generator=g, dtype=torch.float64)] + [
        torch.randn(2, 11, 40, generator=g, dtype=torch.float64) for _ in range(2 if next_readout else 0)]

    def spec(x, h, c, *weights):
        out = delta_residual(x, h, c, causal_token_readout(x, weights[4]), *weights[:4], 4.0, 1e-5, "delta")
        if not next_readout:
            return (out,)
        rms = LlamaRMSNorm(40, eps=1e-6).to(device=device, dtype=weights[6].dtype)
        rms.weight = weights[6]  # (the leaf itself: its gradient is the one compared)
        y = causal_token_readout(out, weights[5])
        return out, y, rms(y)

    def fast(x, h, c, *weights):
        u = causal_token_readout(x, weights[4])
        after = (weights[5], weights[6], 1e-6) if next_readout else ()
        out = residual.run(x, h, c, u, *weights[:4], 4.0, 1e-5, "delta", *after, u_read=weights[4])
        return out if next_readout else (out,)

    _matches_the_specification_in_fp64(spec, fast, inputs, upstream, dtype, tol, frozen, 9 if next_readout else None,
                                       device)
    x, h, c, *weights = (t.to(device=device, dtype=dtype).requires_grad_(i not in frozen) for i, t in enumerate(inputs))
    u = causal_token_readout(x, weights[4]).detach().requires_grad_()  # (u's own storage)
    after = (weights[5], weights[6], 1e-6) if next_readout else ()
    for u_read in (None, weights[4]):
        residual.run(x, h, c, u, *weights[:4], 4.0, 1e-5, "delta", *after, u_read=u_read)  # (compiles the backward)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = residual.run(x, h, c, u, *weights[:4], 4.0, 1e-5, "delta", *after, u_read=u_read)
        given = {t.untyped_storage().data_ptr() for t in (x, c, *weights, (out if next_readout else [out])[0])}
        own = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
               if t.untyped_storage().data_ptr() not in given}
        kept_u = u_read is None or next_readout or dtype == torch.float32  # (an fp32 state may be rebuilt)
        assert (u.untyped_storage().data_ptr() in own) == kept_u and h.untyped_storage().data_ptr() in own
        beside = [size for ptr, size in own.items() if ptr not in (h.untyped_storage().data_ptr(),
                                                                    u.untyped_storage().data_ptr())]
        fp32_y = next_readout and dtype == torch.float32  # (the next readout, kept for its norm: an fp32 state)
        assert sorted(beside) == sorted(([] if kept_u else [2 * 11 * 4 * 4]) + ([2 * 11 * 40 * 4] if fp32_y else []))


def _matches_the_specification_in_fp64(spec, fast, inputs, upstream, dtype, tol, frozen, gain, device):
    """`fast` on `inputs` in `dtype` against `spec` on them in fp64 (those at `frozen` with no gradient, the one at
    `gain` a Parameter, as a norm's weight), each output weighted by `upstream` and summed for backward: every output
    and every input's gradient within `tol` of the largest element of the exact one, None where its is None."""
    results = []
    for run, cast in ((spec, torch.float64), (fast, dtype)):
        leaves = [t.to(device=device, dtype=cast).requires_grad_(i not in frozen) for i, t in enumerate(inputs)]
        if gain is not None:
            leaves[gain] = torch.nn.Parameter(leaves[gain], requires_grad=gain not in frozen)
        outs = run(*leaves)
        assert all(t.dtype == cast for t in outs)
        (sum((t.double() * up.to(device)).sum() for t, up in zip(outs, upstream))).backward()
        results.append([*outs, *(t.grad for t in leaves)])
    for i, (exact, fast_) in enumerate(zip(*results)):
        if exact is None:
            assert fast_ is None, i
            continue
        torch.testing.assert_close(fast_.double(), exact, rtol=tol, atol=tol * max(1.0, exact.abs().max().item()),
                                   msg=str(i))


@pytest.mark.parametrize("dv", [4, 1])
@pytest.mark.parametrize("hook", ["forward", "backward"])
def test_the_rmsnorm_after_a_seam_is_made_by_the_seam_unless_a_hook_is_on_it(hook, dv, monkeypatch):
    """In a model under "triton" (through the interpreter), each block's attention seam, which reads the MLP's input
    ahead (CC) or whose state is it (d_v = 1), also makes post_attention_layernorm's output; a forward or backward hook
    on that norm (user code that must see it run) makes the seam leave the norm to the module, with the same loss and
    gradients."""
    import ddl_kernels

    monkeypatch.setattr(ddl_kernels, "_failed", set())
    residual = _triton("residual")
    normed, run = [], residual.run

    def counted(*args, **kwargs):  # (whether the seam was given the norm's gain and made the norm)
        out = run(*args, **kwargs)
        normed.append(len(args) > 12 and out[2] is not None)
        return out

    monkeypatch.setattr(residual, "run", counted)
    triton_on_cpu(monkeypatch)
    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(ddl_implementation="triton", ddl_value_channels=dv)))
    ids = torch.randint(3, 99, (2, 8), generator=seeded(1))

    def loss_and_gradients():
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return [loss] + [p.grad.clone() for p in model.parameters()]

    fused = loss_and_gradients()
    assert normed.count(True) == model.config.num_hidden_layers
    seen, normed[:] = [], []
    for layer in model.model.layers:
        norm = layer.post_attention_layernorm
        if hook == "forward":
            norm.register_forward_hook(lambda module, args, out: seen.append(out))
        else:
            norm.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(grad_out))
    hooked = loss_and_gradients()
    assert not any(normed) and len(seen) == model.config.num_hidden_layers
    for got, expected in zip(hooked, fused):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compressor, hook", [("tc", None), ("cc", "norm-forward"), ("cc", "norm-backward"),
                                              ("cc", "compressor")])
def test_a_readouts_rmsnorm_is_made_by_its_kernel_unless_a_hook_is_on_either(compressor, hook, monkeypatch):
    """Under "triton" (through the interpreter), a readout no seam made ahead (each block's attention input, TC's MLP
    input too, the final readout) comes with its sublayer's RMSNorm from one kernel; a forward or backward hook on
    the norms, or a forward hook on the compressors, leaves the norm to its module (each hook fires once a norm or
    readout): the loss and every gradient equal the specification's either way."""
    import ddl_kernels

    monkeypatch.setattr(ddl_kernels, "_failed", set())
    windows = _triton("readout")
    fused, readout_and_norm = [], windows.readout_and_norm
    monkeypatch.setattr(windows, "readout_and_norm", lambda *args: fused.append(1) or readout_and_norm(*args))
    triton_on_cpu(monkeypatch)
    models = {}
    for name, impl in (("reference", "reference"), ("fused", "triton")):
        torch.manual_seed(0)
        models[name] = trained_looking(DDLForCausalLM(tiny_config(ddl_implementation=impl,
                                                                  ddl_compressor=compressor)))
    model, layers, seen = models["fused"].model, models["fused"].model.layers, []
    norms = [model.norm] + [layer.input_layernorm for layer in layers] + (
        [layer.post_attention_layernorm for layer in layers] if compressor == "tc" else [])
    for module in norms if hook and hook.startswith("norm") else [model.readout, *(
        layer.compress for layer in layers)] if hook else []:
        if hook == "norm-backward":
            module.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(module))
        else:
            module.register_forward_hook(lambda module, args, out: seen.append(module))
    assert_same_loss_and_gradients(models, torch.randint(3, 99, (2, 8), generator=seeded(1)), grad_atol=1e-5)
    assert not ddl_kernels._failed
    assert len(fused) == (0 if hook else len(norms))
    assert len(seen) == (0 if hook is None else len(norms) if hook.startswith("norm") else 1 + 2 * len(layers))


def test_a_backward_hook_on_every_module_fires_for_every_norm_and_readout_under_triton(monkeypatch):
    """A full backward hook on every module (`register_module_full_backward_hook`) fires for each RMSNorm and
    compressor as often under "triton" (its kernels through the interpreter: the seam's readout and norm, the
    readouts' with their norms) as under "reference": no kernel does a hooked module's work (under "triton" it fired
    for none of them, 0 of 5 each)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from ddl.modeling_ddl import DDLCompressor

    triton_on_cpu(monkeypatch)
    seen = {}
    for impl in ("reference", "triton"):
        torch.manual_seed(0)
        model = trained_looking(DDLForCausalLM(tiny_config(ddl_implementation=impl)))
        seen[impl] = []
        handle = torch.nn.modules.module.register_module_full_backward_hook(
            lambda module, grad_in, grad_out, c=seen[impl]: c.append(type(module).__name__) if isinstance(
                module, (LlamaRMSNorm, DDLCompressor)) else None)
        try:
            ids = torch.randint(3, 99, (2, 8), generator=seeded(1))
            model(ids, labels=ids).loss.backward()
        finally:
            handle.remove()
    assert sorted(seen["triton"]) == sorted(seen["reference"]) and len(seen["reference"]) == 10


@pytest.mark.parametrize("checkpointing, failing_backward", [(False, False), (True, False), (True, True)],
                         ids=["plain", "checkpointed", "checkpointed-failing-backward"])
def test_triton_seam_in_a_model_matches_reference(checkpointing, failing_backward, monkeypatch, caplog):
    """Under "triton" the dispatcher gives every sublayer's seam to the Triton kernels (here made to serve CPU
    tensors, through the interpreter): d_v = 1 (u is the state), CC+EC (u the compressed state), u = c, CC without EC
    (the embeddings repeated d_v times: a stride-0 view); the loss and every parameter's gradient equal the
    specification's, also with gradient checkpointing (transformers' default, non-reentrant: the forward is re-run in
    backward). A backward kernel that cannot compile is found before the first forward serves (one warning): then the
    specification runs the seams, forward and backward."""
    import ddl_kernels

    residual = _triton("residual")
    calls = []
    run = residual.run
    monkeypatch.setattr(residual, "run", lambda *args, **kwargs: calls.append(1) or run(*args, **kwargs))
    monkeypatch.setattr(ddl_kernels, "_failed", set())
    monkeypatch.setattr(residual, "_compiled", set())
    triton_on_cpu(monkeypatch, operations=("delta_residual",))
    if failing_backward:
        monkeypatch.setattr(residual, "_seam_bwd_kernel", _Launch(_ptxas_fails))
    for overrides in ({"ddl_value_channels": 1}, {}, {"ddl_value_input": "context"}, {"ddl_embed_conv": False}):
        models = {}
        for name, impl in (("reference", "reference"), ("fused", "triton")):
            torch.manual_seed(0)
            models[name] = trained_looking(DDLForCausalLM(tiny_config(ddl_implementation=impl, **overrides)))
            if checkpointing:
                models[name].gradient_checkpointing_enable()
                models[name].train()
        ids = torch.randint(3, 99, (2, 8), generator=seeded(1))
        if not failing_backward:
            calls.clear()
        with caplog.at_level("WARNING"):
            assert_same_loss_and_gradients(models, ids, grad_atol=1e-5)
        seams = 2 * models["fused"].config.num_hidden_layers
        if not failing_backward:  # (a checkpoint runs each forward twice)
            assert len(calls) == seams * (2 if checkpointing else 1), overrides
    if failing_backward:
        assert len(calls) == 1  # (tried once, then never again)
    assert ("Triton residual seam" in ddl_kernels._failed) == failing_backward
    assert caplog.text.count("Triton residual seam kernel failed") == failing_backward


def _ptxas_fails(*args, **kwargs):
    raise RuntimeError("ptxas fatal: unsupported GPU")


@pytest.mark.parametrize("dv, value_input", [(4, "u"), (4, "c"), (1, "state")])
def test_a_seam_whose_backward_cannot_compile_does_not_serve(dv, value_input, monkeypatch, caplog):
    """The seam's backward kernel is tried on one token before its forward first serves: if it fails, the seam does
    not serve (one warning naming it, never tried again), and the specification gives forward and backward, so no
    step is left without gradients."""
    import ddl_kernels

    residual = _triton("residual")
    attempts = []
    monkeypatch.setattr(residual, "_seam_bwd_kernel", _Launch(lambda *a, **k: attempts.append(1) or _ptxas_fails()))
    monkeypatch.setattr(ddl_kernels, "_failed", set())
    monkeypatch.setattr(residual, "_compiled", set())
    guarded = ddl_kernels.serving(lambda *args, **kwargs: True,
                                  ddl_kernels.fallible("Triton residual seam", residual.run))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for _ in range(2):
        leaves = [t.to(device).requires_grad_() for t in _seam_inputs(dv, torch.float32, seed=0)]
        x, h, c, u = leaves[:4]
        u = {"u": u, "c": c, "state": x}[value_input]
        with caplog.at_level("WARNING"):
            assert guarded(x, h, c, u, *leaves[4:], 4.0, 1e-5, "delta", None) is None
    assert len(attempts) == 1 and caplog.text.count("Triton residual seam kernel failed") == 1
    assert "ptxas fatal" in caplog.text


def test_triton_seam_serves_the_paper_seams_on_cuda_only():
    """The seam serves delta or write-only (the dispatcher asks for a single linear gate and a learned value only), on
    CUDA, not fp64 and not inside a trace; the additive control and CPU tensors go elsewhere. (Its inputs here stand in
    for tensors: it reads only where they are and their dtype.)"""
    from types import SimpleNamespace

    serves = _triton("residual").serves

    def inputs(dtype=torch.float32, cuda=True):
        return [SimpleNamespace(is_cuda=cuda, dtype=dtype) for _ in range(8)] + [4.0, 1e-5]

    assert serves(*inputs(), "delta") and serves(*inputs(torch.bfloat16), "write_only")
    assert not serves(*inputs(cuda=False), "delta")
    assert not serves(*inputs(torch.float64), "delta")
    assert not serves(*inputs(), "additive")
    mixed = inputs()
    mixed[3] = SimpleNamespace(is_cuda=False, dtype=torch.float32)
    assert not serves(*mixed, "delta")
    paper = inputs()
    assert not torch.compile(lambda: serves(*paper, "delta"), backend="eager", fullgraph=True)()
    assert not _in_jit_trace(lambda: serves(*paper, "delta"))


def _in_jit_trace(serves):
    """What `serves()` says while torch.jit.trace records a function that asks it."""
    said = []

    def traced(t):
        said.append(serves())
        return t * 2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the trace warns that the Python value will not be recorded)
        torch.jit.trace(traced, torch.zeros(1), check_trace=False)
    return said[0]


class _Launch:
    """A stand-in for a Triton kernel: `kernel[grid](...)` calls `run(grid, ...)`."""

    def __init__(self, run):
        self.run = run

    def __getitem__(self, grid):
        return partial(self.run, grid)


@pytest.mark.parametrize("kind", ["readout", "conv"])
@pytest.mark.parametrize("kernel, dv, with_history, seq_len",
                         [(1, 4, False, 19), (4, 4, False, 19), (4, 3, True, 19), (3, 2, False, 19), (4, 4, True, 1)],
                         ids=["cc", "tc", "tc-dv3-history", "k3-dv2", "tc-decoding-step"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_triton_token_convolutions_match_reference(kind, kernel, dv, with_history, seq_len, dtype, tol, monkeypatch):
    """TC/CC readout and EC through the Triton kernels, after their history as the dispatcher gives it: outputs and
    gradients of input and taps equal the specs."""
    windows = _triton("readout")
    monkeypatch.setattr(windows, "_CHUNK", 8)  # 19 tokens = 3 chunks of tap gradients (the last one partial)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = seeded(kernel * 10 + dv)
    batch, d = 2, 200  # two blocks of 128 features, the second one partial (masked)
    x_shape = (batch, seq_len, dv, d) if kind == "readout" else (batch, seq_len, d)
    x = torch.randn(x_shape, generator=g).to(device=device, dtype=dtype).requires_grad_()
    weight = torch.randn(kernel, d, dv, generator=g).to(device=device, dtype=dtype).requires_grad_()
    history = torch.randn(batch, kernel - 1, *x_shape[2:], generator=g).to(device=device, dtype=dtype) \
        if with_history else None
    spec = causal_token_readout if kind == "readout" else causal_token_conv

    def fast(x, weight, history):
        full = x if history is None else torch.cat([history, x], dim=1)
        out = windows.token_window(full, weight.transpose(1, 2), read=kind == "readout")  # (a view, as ops gives it)
        return out if history is None else out[:, kernel - 1 :]

    ref_x, ref_w = (t.detach().clone().requires_grad_() for t in (x, weight))
    ref = spec(ref_x.double(), ref_w.double(), None if history is None else history.double())
    out = fast(x, weight, history)
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * 4)
    upstream = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (ref * upstream).sum().backward()
    (out * upstream.to(device=device, dtype=dtype)).sum().backward()
    torch.testing.assert_close(x.grad.double(), ref_x.grad.double(), rtol=tol, atol=tol * 4)
    torch.testing.assert_close(weight.grad.double(), ref_w.grad.double(), rtol=tol, atol=tol * 20)  # 38-token sums


@pytest.mark.parametrize("kind", ["readout", "conv"])
@pytest.mark.parametrize("frozen", [None, "taps", "input"])
def test_triton_token_convolutions_backward_with_either_input_frozen(kind, frozen, monkeypatch):
    """One backward kernel makes both gradients of the token convolutions, or only the one asked for (frozen taps, as
    under LoRA; frozen embeddings): each equals the specification's, and the taps' comes back in the layout of the
    view the model passes (its weight transposed), so that it needs no copy into the parameter's."""
    windows = _triton("readout")
    monkeypatch.setattr(windows, "_CHUNK", 4)  # 9 + 3 rows of history: the input's rows in 3 chunks, the output's in 3
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = seeded(7)
    batch, seq_len, kernel, dv, d = 2, 9, 4, 3, 150
    x_shape = (batch, seq_len + kernel - 1, dv, d) if kind == "readout" else (batch, seq_len + kernel - 1, d)
    x = torch.randn(x_shape, generator=g, dtype=torch.float64).to(device)
    weight = torch.randn(kernel, d, dv, generator=g, dtype=torch.float64).to(device)
    spec = causal_token_readout if kind == "readout" else causal_token_conv
    upstream = torch.randn((batch, seq_len, dv, d) if kind == "conv" else (batch, seq_len, d), generator=g,
                           dtype=torch.float64).to(device)
    for t, is_frozen in ((x, frozen == "input"), (weight, frozen == "taps")):
        t.requires_grad_(not is_frozen)
    wanted = [t for t in (x, weight) if t.requires_grad]
    exact = torch.autograd.grad((spec(x[:, kernel - 1 :], weight, x[:, : kernel - 1]) * upstream).sum(), wanted)
    taps = weight.float().transpose(1, 2)
    fast_inputs = [t.float().detach().requires_grad_(t.requires_grad) for t in (x, taps)]
    out = windows.token_window(fast_inputs[0], fast_inputs[1], read=kind == "readout")[:, kernel - 1 :]
    fast = torch.autograd.grad((out * upstream.float()).sum(), [t for t in fast_inputs if t.requires_grad])
    names = [name for name, t in (("input", x), ("taps", weight)) if t.requires_grad]
    for name, e, f in zip(names, exact, fast):
        f = f.transpose(1, 2) if name == "taps" else f
        torch.testing.assert_close(f.double(), e, rtol=1e-5, atol=1e-4, msg=name)
    if frozen != "taps":
        assert fast[-1].stride() == taps.stride()


@pytest.mark.parametrize("kernel, dv, d, frozen", [
    (4, 4, 40, ()), (1, 4, 200, ()), (3, 3, 130, ()), (4, 4, 40, (0,)), (4, 4, 40, (1,)), (4, 4, 40, (2,)),
    (4, 4, 40, (1, 2))], ids=["tc", "cc", "k3-dv3-wide", "state-frozen", "taps-frozen", "gain-frozen", "weights-frozen"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_triton_readout_with_the_next_rmsnorm_matches_reference(kernel, dv, d, frozen, dtype, tol, monkeypatch):
    """The readout without history (TC's K taps, CC's one) and the next sublayer's RMSNorm of it in one launch, a
    program per token holding the whole row (d up to the next power of 2, masked past d): y, the normed y and every
    gradient (the state's through y's own use and the norm, the taps', the gain's) equal the specification's
    (`causal_token_readout`, then transformers' LlamaRMSNorm) in fp64, and a frozen input gets none."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    windows = _triton("readout")
    monkeypatch.setattr(windows, "_CHUNK", 4)  # (9 tokens: the taps' gradient in 3 chunks, the last partial)
    monkeypatch.setattr(windows, "_programs", lambda tokens, device: min(tokens, 5))  # (the norm's: runs of 4)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = seeded(kernel * 100 + d)
    inputs = [torch.randn(2, 9, dv, d, generator=g), torch.randn(kernel, d, dv, generator=g),
              1 + 0.3 * torch.randn(d, generator=g)]
    upstream = [torch.randn(2, 9, d, generator=g, dtype=torch.float64) for _ in range(2)]

    def spec(x, weight, gain):
        rms = LlamaRMSNorm(d, eps=1e-6).to(device=device, dtype=gain.dtype)
        rms.weight = gain  # (the leaf itself: its gradient is the one compared)
        y = causal_token_readout(x, weight)
        return y, rms(y)

    def fast(x, weight, gain):
        return windows.readout_and_norm(x, weight.transpose(1, 2), gain, 1e-6)  # (a view, as ops gives it)

    results = []
    for run, cast in ((spec, torch.float64), (fast, dtype)):
        leaves = [t.to(device=device, dtype=cast).requires_grad_(i not in frozen) for i, t in enumerate(inputs)]
        leaves[2] = torch.nn.Parameter(leaves[2], requires_grad=2 not in frozen)
        outs = run(*leaves)
        assert all(t.dtype == cast and t.shape == (2, 9, d) for t in outs)
        sum((t.double() * up.to(device)).sum() for t, up in zip(outs, upstream)).backward()
        results.append([*outs, *(t.grad for t in leaves)])
    for name, exact, fast_ in zip(("y", "normed", "state", "taps", "gain"), *results):
        if exact is None:
            assert fast_ is None, name
            continue
        torch.testing.assert_close(fast_.double(), exact, rtol=tol, atol=tol * max(1.0, exact.abs().max().item()),
                                   msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("dv", [4, 1])
def test_a_seam_that_makes_the_next_rmsnorm_keeps_no_copy_of_its_input(dv, dtype):
    """A low-precision seam that writes the next sublayer's RMSNorm keeps for backward only tensors it was given, h
    and its new state, never the readout y `(B, T, d)` it made: the norm's backward reads y out of the state again
    (which the next seam keeps anyway; at d_v = 1 the state is y). An fp32 state may be rebuilt in backward instead of
    kept (`StateRebuild`), whose hooks would keep a new state saved before the model hands it over: an fp32 d_v > 1
    seam keeps y, not X_next."""
    residual = _triton("residual")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, h, c, u, *weights = (t.to(device).requires_grad_() for t in _seam_inputs(dv, dtype, 0))
    taps = torch.randn(1, 200, dv, device=device, dtype=dtype, requires_grad=True)
    gain = torch.nn.Parameter(1 + 0.3 * torch.randn(200, device=device, dtype=dtype))
    readout = taps if dv > 1 else None
    residual.run(x, h, c, u, *weights, 4.0, 1e-5, "delta", readout, gain, 1e-6)  # (compiles the backward, unsaved)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outs = residual.run(x, h, c, u, *weights, 4.0, 1e-5, "delta", readout, gain, 1e-6)
    assert outs[-1] is not None and saved  # (the norm was made here)
    storages = {t.untyped_storage().data_ptr() for t in saved}
    given = {t.untyped_storage().data_ptr() for t in (x, h, c, u, *weights, taps, gain)}
    made = [t.untyped_storage().data_ptr() for t in outs[:2] if t is not None]  # (X_next, and y at d_v > 1)
    expected = made[1:] if dtype == torch.float32 and dv > 1 else made[:1]
    assert storages - given == set(expected), [tuple(t.shape) for t in saved]


@pytest.mark.parametrize("d, kernel, dv", [(200, 3, 4), (130, 4, 4), (64, 5, 3), (300, 1, 8), (40, 7, 4)],
                         ids=["k3-dv4", "k4-even", "dv3", "k1", "k7-wider-than-dv"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_triton_cc_fold_matches_reference(d, kernel, dv, dtype, tol):
    """CC's conv and read vector folded into its readout matrix by the Triton kernels (features in blocks of 128, the
    last partial; the read vector's gradient summed over every block in one program): the matrix and both gradients
    equal `reference.folded_conv_read`'s in fp64."""
    windows = _triton("readout")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = seeded(d + kernel)
    conv, read = torch.randn(d, kernel, generator=g), torch.randn(dv, generator=g)
    upstream = torch.randn(d, dv, generator=g, dtype=torch.float64)
    results = []
    for run, cast in ((folded_conv_read, torch.float64), (windows.fold, dtype)):
        leaves = [t.to(device=device, dtype=cast).requires_grad_() for t in (conv, read)]
        out = run(*leaves)
        (out.double() * upstream.to(device)).sum().backward()
        assert out.dtype == cast and out.shape == (d, dv)
        results.append([out, *(t.grad for t in leaves)])
    for name, exact, fast in zip(("w", "conv", "read"), *results):
        torch.testing.assert_close(fast.double(), exact, rtol=tol, atol=tol * max(1.0, exact.abs().max().item()),
                                   msg=name)


@pytest.mark.parametrize("overrides", [{}, {"ddl_compressor": "tc"}, {"ddl_cc_kernel_size": 2},
                                       {"ddl_value_channels": 1}], ids=["cc-ec", "tc-ec", "cc-even-kernel", "dv1"])
def test_every_triton_kernel_in_a_model_matches_reference(overrides, monkeypatch):
    """Under "triton" with every Triton kernel serving (the seam, the readouts and their norms, EC, CC's fold;
    through the interpreter), a model's loss and every parameter's gradient equal the specification's; none of them
    failed (a failing kernel gives way to the specification, which would compare the specification with itself); the
    MLP seams are told that their value input is their state's readout (`u_read`)."""
    import ddl_kernels

    monkeypatch.setattr(ddl_kernels, "_failed", set())
    residual, windows = _triton("residual"), _triton("readout")
    calls = []
    for module, name in ((residual, "run"), (windows, "fold"), (windows, "token_window"),
                         (windows, "readout_and_norm")):
        function = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, _f=function, _n=name, **kwargs: calls.append(
            _n + (" u_read" if kwargs.get("u_read") is not None else "")) or _f(*args, **kwargs))
    triton_on_cpu(monkeypatch)
    models = {}
    for name, impl in (("reference", "reference"), ("fused", "triton")):
        torch.manual_seed(0)
        models[name] = trained_looking(DDLForCausalLM(tiny_config(ddl_implementation=impl, **overrides)))
    assert_same_loss_and_gradients(models, torch.randint(3, 99, (2, 8), generator=seeded(1)), grad_atol=1e-5)
    assert not ddl_kernels._failed
    expected = {"run"} if overrides.get("ddl_value_channels") == 1 else {"run", "run u_read", "token_window",
                                                                         "readout_and_norm"} | (
        {"fold"} if overrides.get("ddl_compressor") != "tc" else set())
    assert set(calls) == expected, calls


def _tell_the_seams(monkeypatch, strip=()):
    """Every Triton seam's call, through the interpreter: a list of whether it was told `u_read` (not passed on while
    `strip` is not empty)."""
    import ddl_kernels

    monkeypatch.setattr(ddl_kernels, "_failed", set())
    residual = _triton("residual")
    told, run = [], residual.run

    def seam(*args, u_read=None, **kwargs):
        told.append(u_read is not None)
        return run(*args, u_read=None if strip else u_read, **kwargs)

    monkeypatch.setattr(residual, "run", seam)
    triton_on_cpu(monkeypatch)
    return told


@pytest.mark.parametrize("where", ["compressor", "attention-seam", "norm"])
def test_a_seam_keeps_its_value_input_where_a_hook_may_change_it(where, monkeypatch):
    """A hook between the readout and the MLP's seam may change x_in after the readout made it (a forward hook on the
    compressor or the attention seam, a pre-hook on the norm editing it in place): the seams are then not told that u
    is their state's readout (they keep u), and the model's loss and gradients under "triton" equal the
    specification's with the same hook."""
    import ddl_kernels

    def hook(layer):
        if where == "compressor":
            layer.compress.register_forward_hook(lambda module, args, out: out * 1.5)
        elif where == "attention-seam":
            layer.attn_delta.register_forward_hook(lambda module, args, out: (out[0], out[1] * 1.5, *out[2:]))
        else:
            layer.post_attention_layernorm.register_forward_pre_hook(lambda module, args: (args[0].mul_(1.5), None)[1])

    told = _tell_the_seams(monkeypatch)
    models = {}
    for name, impl in (("reference", "reference"), ("fused", "triton")):
        torch.manual_seed(0)
        models[name] = trained_looking(DDLForCausalLM(tiny_config(ddl_implementation=impl)))
        for layer in models[name].model.layers:
            hook(layer)
    assert_same_loss_and_gradients(models, torch.randint(3, 99, (2, 8), generator=seeded(1)), grad_atol=1e-5)
    assert told and not any(told) and not ddl_kernels._failed


def test_under_the_state_rebuild_the_triton_seams_keep_no_state_alive(monkeypatch):
    """fp32 training rebuilds the states in backward instead of keeping them (`ddl_rebuild_states`): with the Triton
    seams making the MLP's readout and norm, no attention seam's new state outlives the forward (its norm's backward
    keeps the readout, not the state, which the rebuild's hooks could not place before the model hands it over)."""
    import gc
    import weakref

    _tell_the_seams(monkeypatch)
    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(ddl_implementation="triton", num_hidden_layers=3)))
    states = []
    for layer in model.model.layers:  # (not a hook: hooks would change what the kernels may do)
        def seam(*args, _forward=layer.attn_delta.forward, **kwargs):
            out = _forward(*args, **kwargs)
            states.append(weakref.ref(out[0].untyped_storage()))
            return out

        layer.attn_delta.forward = seam
    ids = torch.randint(3, 99, (2, 8), generator=seeded(1))
    loss = model(input_ids=ids, labels=ids).loss
    gc.collect()
    assert len(states) == 3 and all(state() is None for state in states)
    loss.backward()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
def test_a_bf16_model_whose_mlp_seams_read_their_input_again_has_the_same_gradients(checkpointing, monkeypatch):
    """In a bf16 CC model under "triton" the MLP seams are told that u is their state's readout and keep v instead
    of u: its loss and every gradient equal those of the same model whose seams keep u (only the order of an fp32
    sum may differ), and the seams kept no u: the step's saved bytes are fewer."""
    strip = []
    told = _tell_the_seams(monkeypatch, strip)
    ids = torch.randint(3, 99, (2, 8), generator=seeded(1))
    results = []
    for stripped in (False, True):
        strip += [stripped] if stripped else []  # (then the seams keep u: as if nobody told them)
        torch.manual_seed(0)
        model = trained_looking(DDLForCausalLM(tiny_config(ddl_implementation="triton"))).to(torch.bfloat16)
        if checkpointing:  # (its recompute reads u again too)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        model(input_ids=ids, labels=ids).loss.backward()  # (compiles; then the measured step)
        model.zero_grad(set_to_none=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        kept = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}.values())
        results.append((loss.item(), [p.grad.float() for p in model.parameters()], kept))
    assert any(told)
    (loss, grads, kept), (loss_u, grads_u, kept_u) = results
    assert loss == pytest.approx(loss_u, rel=1e-3) and (checkpointing or kept < kept_u)  # (checkpointing keeps none)
    for grad, grad_u in zip(grads, grads_u):
        torch.testing.assert_close(grad, grad_u, rtol=2e-2, atol=2e-2 * max(1.0, grad_u.abs().max().item()))


@torch.no_grad()
@pytest.mark.parametrize("kernel, dv", [(2, 4), (4, 3), (4, 1)], ids=["k2-dv4", "k4-dv3", "k4-dv1"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kept_layout", [True, False], ids=["kept-layout", "parameter-layout"])
def test_triton_window_step_equals_the_spec_for_one_token(kernel, dv, dtype, tol, kept_layout):
    """The Triton TC decoding step, token after token from the cache's window (advanced in place by each step), equals
    the specification's readout of the whole sequence (in fp32 Triton's own, bit for bit where the weight is kept in
    the decoding run's layout), and leaves the window the
    specification's step leaves; the weight read where a decoding run keeps it (`(d_v, d, K)`, viewed as `(K, d, d_v)`)
    or as the parameter is."""
    step = _triton("readout").window_step
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = seeded(kernel * 10 + dv)
    batch, d, length = 2, 200, 7  # (two blocks of 128 features, the second partial)
    x = torch.randn(batch, length, dv, d, generator=g).to(device=device, dtype=dtype)
    weight = torch.randn(kernel, d, dv, generator=g).to(device=device, dtype=dtype)
    if kept_layout:
        weight = weight.permute(2, 1, 0).contiguous().permute(2, 1, 0)
    past, spec_past = (torch.zeros(batch, dv * d, kernel - 1, device=device, dtype=dtype) for _ in range(2))
    steps = torch.cat([step(past, x[:, t : t + 1], weight) for t in range(length)], dim=1)
    for t in range(length):
        window_step(spec_past, x[:, t : t + 1], weight, "reference")
    whole = causal_token_readout(x.double(), weight.double())
    assert steps.dtype == dtype
    torch.testing.assert_close(steps.double(), whole, rtol=tol, atol=tol * 4)
    torch.testing.assert_close(past, spec_past, rtol=0, atol=0)
    if dtype == torch.float32:  # Triton's readout of the whole sequence: the same products and order of taps
        readout = _triton("readout").token_window(x, weight.transpose(1, 2).contiguous(), read=True)
        # (bit for bit in the layout a decoding run keeps; from the parameter's, the compiler may spread the d_v
        # channels over threads and pair their sum otherwise)
        torch.testing.assert_close(steps, readout, rtol=0 if kept_layout else 1e-6, atol=0 if kept_layout else 1e-6)


@torch.no_grad()
@pytest.mark.parametrize("kernel, dv, gain_fp32", [(4, 3, False), (2, 4, True)], ids=["k4-dv3", "k2-fp32-gain"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_triton_window_step_with_the_next_rmsnorm_equals_the_spec(kernel, dv, gain_fp32, dtype, tol):
    """The TC decoding step with the next sublayer's RMSNorm (one program a sequence, its whole row): token after
    token, its readout and the norm of it equal the specification's readout of the whole sequence and transformers'
    LlamaRMSNorm of that, and it advances the window as the plain step does; in fp32, its readout equals the plain
    step's and its norm the prefill's (`readout_and_norm`) bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    windows = _triton("readout")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = seeded(kernel * 10 + dv + 1)
    batch, d, length = 2, 200, 6
    x = torch.randn(batch, length, dv, d, generator=g).to(device=device, dtype=dtype)
    weight = torch.randn(kernel, d, dv, generator=g).to(device=device, dtype=dtype)
    gain = (1 + 0.3 * torch.randn(d, generator=g)).to(device=device, dtype=torch.float32 if gain_fp32 else dtype)
    past, plain_past = (torch.zeros(batch, dv * d, kernel - 1, device=device, dtype=dtype) for _ in range(2))
    made = [windows.window_step_norm(past, x[:, t : t + 1], weight, gain, 1e-6) for t in range(length)]
    plain = torch.cat([windows.window_step(plain_past, x[:, t : t + 1], weight) for t in range(length)], dim=1)
    steps, normed = (torch.cat(outs, dim=1) for outs in zip(*made))
    rms = LlamaRMSNorm(d, eps=1e-6).to(device=device, dtype=torch.float64)
    rms.weight.copy_(gain)
    whole = causal_token_readout(x.double(), weight.double())
    assert steps.dtype == dtype and normed.dtype == torch.promote_types(dtype, gain.dtype)
    torch.testing.assert_close(steps.double(), whole, rtol=tol, atol=tol * 4)
    torch.testing.assert_close(normed.double(), rms(whole), rtol=tol, atol=tol * 4)
    torch.testing.assert_close(past, plain_past, rtol=0, atol=0)
    if dtype == torch.float32:
        prefill = windows.readout_and_norm(x, weight.transpose(1, 2), gain, 1e-6)
        torch.testing.assert_close(steps, plain, rtol=0, atol=0)
        torch.testing.assert_close(normed, prefill[1], rtol=0, atol=0)


@pytest.mark.parametrize("hook", [False, True], ids=["fused", "norms-hooked"])
def test_triton_decoding_steps_with_the_next_rmsnorm_generate_the_specifications_tokens(hook, monkeypatch):
    """TC+EC under "triton" with its decoding steps too (through the interpreter): every readout of a decoded token
    comes with its sublayer's RMSNorm from the step's kernel, and greedy `generate` gives the specification's tokens
    and logits; a forward hook on the norms leaves each to its module (and fires each step)."""
    import ddl_kernels

    monkeypatch.setattr(ddl_kernels, "_failed", set())
    windows = _triton("readout")
    fused, step_norm = [], windows.window_step_norm
    monkeypatch.setattr(windows, "window_step_norm", lambda *args: fused.append(1) or step_norm(*args))
    triton_on_cpu(monkeypatch, operations=("delta_residual", "token_readout", "token_conv", "window_step",
                                           "conv_step"))
    ids, outs, seen = torch.randint(3, 99, (1, 5), generator=seeded(2)), {}, []
    for name, impl in (("reference", "reference"), ("fused", "triton")):
        torch.manual_seed(0)
        model = trained_looking(DDLForCausalLM(tiny_config(ddl_implementation=impl, ddl_compressor="tc"))).eval()
        norms = [model.model.norm] + [n for layer in model.model.layers
                                      for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        for norm in norms if hook and name == "fused" else []:
            norm.register_forward_hook(lambda module, args, out: seen.append(module))
        outs[name] = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
                                    return_dict_in_generate=True)
    assert torch.equal(outs["fused"].sequences, outs["reference"].sequences)
    torch.testing.assert_close(torch.stack(outs["fused"].logits), torch.stack(outs["reference"].logits), rtol=1e-5,
                               atol=1e-5)
    assert not ddl_kernels._failed
    assert len(fused) == (0 if hook else 3 * len(norms))  # (3 decoding steps after the prefill)
    assert len(seen) == (4 * len(norms) if hook else 0)


@torch.no_grad()
@pytest.mark.parametrize("kernel, dv", [(2, 4), (4, 3), (1, 4)], ids=["k2-dv4", "k4-dv3", "k1"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_triton_conv_step_equals_the_spec_for_one_token(kernel, dv, dtype, tol):
    """The Triton EC decoding step, token after token from the cached embeddings (advanced in place), equals the
    specification's EC of the whole sequence, and leaves the window the specification's step leaves; and, in fp32,
    Triton's own EC of the whole sequence bit for bit (the same sums in the same order)."""
    triton_conv = _triton("readout")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = seeded(kernel * 10 + dv)
    batch, d, length = 2, 200, 6
    x = torch.randn(batch, length, d, generator=g).to(device=device, dtype=dtype)
    weight = torch.randn(kernel, d, dv, generator=g).to(device=device, dtype=dtype)
    past, spec_past = (torch.zeros(batch, d, kernel - 1, device=device, dtype=dtype) for _ in range(2))
    steps = torch.cat([triton_conv.conv_step(past, x[:, t : t + 1], weight) for t in range(length)], dim=1)
    for t in range(length):
        conv_step(spec_past, x[:, t : t + 1], weight, "reference")
    assert steps.dtype == dtype
    torch.testing.assert_close(steps.double(), causal_token_conv(x.double(), weight.double()), rtol=tol, atol=tol * 4)
    torch.testing.assert_close(past, spec_past, rtol=0, atol=0)
    if dtype == torch.float32:
        whole = triton_conv.token_window(x, weight.transpose(1, 2).contiguous(), read=False)
        torch.testing.assert_close(steps, whole, rtol=0, atol=0)


def test_triton_steps_serve_one_token_with_its_window_only():
    """The Triton decoding steps write where the shapes say: they serve one token and its window of K-1 inputs in the
    cache's layout, nothing else (the PyTorch step serves the rest)."""
    shapes = _triton("readout").step_shapes
    weight = torch.zeros(4, 6, 3)  # (K, d, d_v)
    assert shapes(torch.zeros(2, 18, 3), torch.zeros(2, 1, 3, 6), weight)  # TC
    assert shapes(torch.zeros(2, 6, 3), torch.zeros(2, 1, 6), weight)  # EC
    assert not shapes(torch.zeros(2, 18, 3), torch.zeros(2, 2, 3, 6), weight)  # two tokens
    assert not shapes(torch.zeros(2, 6, 3), torch.zeros(2, 1, 3, 6), weight)  # TC with EC's window
    assert not shapes(torch.zeros(2, 18, 2), torch.zeros(2, 1, 3, 6), weight)  # K-2 inputs kept
    assert not shapes(torch.zeros(1, 6, 3), torch.zeros(2, 1, 6), weight)  # another batch
    assert not shapes(torch.zeros(2, 6, 3), torch.zeros(2, 1, 5), weight)  # another width


def test_triton_readout_and_steps_serve_eager_cuda_inputs_only():
    """The Triton readout serves CUDA tensors, not fp64; the decoding steps a contiguous window in the token's dtype,
    on the token's device, without autograd. Neither serves inside a trace (Inductor fuses the PyTorch path, which
    advances the cache as the cache's own code does). (The inputs stand in for tensors: only these are read.)"""
    from types import SimpleNamespace

    readout = _triton("readout")

    def tensor(shape, dtype=torch.float32, device="cuda:0", contiguous=True):
        return SimpleNamespace(shape=torch.Size(shape), dtype=dtype, device=torch.device(device),
                               is_cuda=device.startswith("cuda"), is_contiguous=lambda: contiguous,
                               dim=lambda: len(shape))

    def step(**past):
        return tensor((2, 18, 3), **past), tensor((2, 1, 3, 6)), tensor((4, 6, 3))

    with torch.no_grad():
        assert readout.step_serves(*step()) and readout.serves(tensor((2, 5, 3, 6)), tensor((4, 3, 6)))
        assert not readout.step_serves(*step(device="cpu")) and not readout.step_serves(*step(device="cuda:1"))
        assert not readout.step_serves(*step(dtype=torch.bfloat16)) and not readout.step_serves(*step(contiguous=False))
        assert not readout.serves(tensor((2, 5, 3, 6), torch.float64), tensor((4, 3, 6), torch.float64))
        assert not readout.serves(tensor((2, 5, 3, 6), device="cpu"), tensor((4, 3, 6), device="cpu"))
        inputs = step()
        assert not torch.compile(lambda: readout.step_serves(*inputs), backend="eager", fullgraph=True)()
        x, taps = tensor((2, 5, 3, 6)), tensor((4, 3, 6))
        assert not torch.compile(lambda: readout.serves(x, taps), backend="eager", fullgraph=True)()
        assert not _in_jit_trace(lambda: readout.step_serves(*inputs)) and not _in_jit_trace(
            lambda: readout.serves(x, taps))
    assert not readout.step_serves(*step())  # (autograd on)


@pytest.mark.parametrize("error", ["out of memory", "checkpoint's early stop"])
def test_a_kernel_passes_on_what_it_did_not_cause(error, monkeypatch):
    """Out of memory (transient) and a non-reentrant checkpoint's signal to end its recompute pass through a kernel's
    guard to the caller, and leave the kernel on: they say nothing about whether the kernel can run."""
    import ddl_kernels

    if error == "out of memory":
        raised = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    else:
        stop = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)
        if stop is None:
            pytest.skip("this torch has no _StopRecomputationError")
        raised = stop()
    calls = []

    def run(*args):
        calls.append(1)
        if len(calls) == 1:
            raise raised
        return "ran"

    monkeypatch.setattr(ddl_kernels, "_failed", set())
    guarded = ddl_kernels.fallible("Triton residual seam", run)
    with pytest.raises(type(raised)):
        guarded()
    assert guarded() == "ran" and not ddl_kernels._failed and len(calls) == 2


def test_a_failing_kernel_gives_way_to_the_specification_with_one_warning(monkeypatch, caplog):
    """A kernel that fails to compile or launch gives way to the specification (same numbers), with one warning
    naming it, and is not tried again."""
    import ddl_kernels

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("ptxas fatal: unsupported GPU")

    ops.kernel("delta_residual", "auto", torch.device("cpu"))  # (fills the table)
    monkeypatch.setitem(ops._installed["delta_residual"], "cpu", ddl_kernels.fallible("Triton residual seam", broken))
    monkeypatch.setattr(ddl_kernels, "_failed", set())
    model = DDLForCausalLM(tiny_config(ddl_value_channels=1, ddl_implementation="triton"))
    reference = DDLForCausalLM(tiny_config(ddl_value_channels=1, ddl_implementation="reference"))
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(3, 99, (2, 6), generator=seeded(0))
    with caplog.at_level("WARNING"):
        loss = model(ids, labels=ids).loss
        model(ids, labels=ids)
    torch.testing.assert_close(loss, reference(ids, labels=ids).loss)
    assert len(calls) == 1 and caplog.text.count("Triton residual seam kernel failed") == 1
    assert "ptxas fatal" in caplog.text
