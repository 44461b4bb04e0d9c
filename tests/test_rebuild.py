"""`ddl_rebuild_states`: backward rebuilds each expanded state from the next one (`ddl.rebuild`) instead of keeping it.

The loss and every parameter's gradient equal the stored-state path (fp64 to 1e-10, fp32 to rounding) for every
variant, implementation and batch layout (plain, left-padded, packed); forward frees the states; gradient
checkpointing, torch.compile and DDP fall back or compose, never with wrong gradients."""

import gc
import os
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import TINY, seeded, tiny_config, trained_looking
from ddl import DDLConfig, DDLForCausalLM, rebuild
from ddl.fused import fused_delta_update, rebuild_state

VARIANTS = [
    pytest.param({}, id="cc-ec"),
    pytest.param({"ddl_embed_conv": False}, id="cc"),
    pytest.param({"ddl_compressor": "tc"}, id="tc-ec"),
    pytest.param({"ddl_compressor": "tc", "ddl_embed_conv": False}, id="tc"),
    pytest.param({"ddl_residual": "write_only"}, id="write-only"),
    pytest.param({"ddl_shared_compressor": False, "ddl_cc_form": "matrix"}, id="earlier-layout"),
    pytest.param({"ddl_beta_hidden_size": 8, "ddl_compressor": "tc"}, id="two-layer-gate-tc"),  # PyTorch seam
]


def _model(overrides, implementation, rebuild_states, dtype):
    torch.manual_seed(0)
    config = tiny_config(ddl_implementation=implementation, ddl_rebuild_states=rebuild_states, **overrides)
    return trained_looking(DDLForCausalLM(config)).to(dtype).train()


def _batch(layout):
    """input_ids and the model's keyword arguments for a plain, a left-padded or a packed batch."""
    ids = torch.randint(3, TINY["vocab_size"], (2, 11), generator=seeded(1))
    if layout == "padded":
        mask = torch.ones_like(ids)
        mask[0, :4] = 0  # left padding
        return ids, {"attention_mask": mask}
    if layout == "packed":  # position ids restarting: documents of 5, 2 and 4 tokens in row 0
        positions = torch.cat([torch.arange(5), torch.arange(2), torch.arange(4)]).unsqueeze(0).expand(2, -1)
        positions = positions.clone()
        positions[1] = torch.arange(11)
        return ids, {"position_ids": positions}
    return ids, {}


def _loss_and_grads(model, ids, kwargs):
    labels = ids if "attention_mask" not in kwargs else ids.masked_fill(kwargs["attention_mask"] == 0, -100)
    loss = model(ids, labels=labels, use_cache=False, **kwargs).loss
    loss.backward()
    return loss.detach(), {name: param.grad.clone() for name, param in model.named_parameters()}


@pytest.fixture
def rebuilds(monkeypatch):
    """Counts the states that backward rebuilds (so that a test sees the rebuild run, not a silent fallback)."""
    calls = []

    def counted(x_next, write, **kwargs):
        calls.append(x_next.shape)
        return rebuild_state(x_next, write, **kwargs)

    monkeypatch.setattr(rebuild, "rebuild_state", counted)
    return calls


def _assert_same(stored, rebuilt, rtol, atol):
    (loss, grads), (loss_r, grads_r) = stored, rebuilt
    torch.testing.assert_close(loss_r, loss, rtol=rtol, atol=atol)
    assert grads.keys() == grads_r.keys()
    for name in grads:
        torch.testing.assert_close(grads_r[name], grads[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("layout", ["plain", "padded", "packed"])
@pytest.mark.parametrize("overrides", VARIANTS)
def test_rebuilt_states_give_the_stored_paths_loss_and_gradients_in_fp64(overrides, layout, cpu_kernel_on_or_off,
                                                                         rebuilds):
    implementation = "auto" if cpu_kernel_on_or_off == "cpu-kernel" else "torch"
    ids, kwargs = _batch(layout)
    stored = _loss_and_grads(_model(overrides, implementation, "off", torch.float64), ids, kwargs)
    assert not rebuilds
    rebuilt = _loss_and_grads(_model(overrides, implementation, "on", torch.float64), ids, kwargs)
    assert len(rebuilds) == 2 * TINY["num_hidden_layers"]  # each state once, X_0 included
    _assert_same(stored, rebuilt, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("overrides", VARIANTS)
def test_rebuilt_states_give_the_stored_paths_loss_and_gradients_in_fp32(overrides, cpu_kernel_on_or_off, rebuilds):
    implementation = "auto" if cpu_kernel_on_or_off == "cpu-kernel" else "torch"
    ids, kwargs = _batch("padded")
    stored = _loss_and_grads(_model(overrides, implementation, "off", torch.float32), ids, kwargs)
    rebuilt = _loss_and_grads(_model(overrides, implementation, "auto", torch.float32), ids, kwargs)  # auto: on
    assert len(rebuilds) == 2 * TINY["num_hidden_layers"]
    _assert_same(stored, rebuilt, rtol=1e-5, atol=1e-6)


class _LiveStates(TorchDispatchMode):
    """Every state-like tensor (`(..., d_v, d)`: the states, their masked, spread or reshaped copies) that the forward
    makes, held weakly: what is still alive after the forward is what autograd keeps for backward."""

    def __init__(self, config, tokens):
        super().__init__()
        self.shape, self.made = (config.ddl_value_channels, config.hidden_size), []
        self.numel = tokens * config.ddl_value_channels * config.hidden_size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel and tuple(t.shape[-2:]) == self.shape:
                self.made.append(weakref.ref(t))
        return out

    def alive(self):
        """How many of them are alive, counted by memory (a view or an alias of a state, or a state written into an
        earlier one's memory, is the same state)."""
        gc.collect()
        return len({ref().untyped_storage().data_ptr() for ref in self.made if ref() is not None})


@pytest.mark.parametrize("layout", ["plain", "padded", "packed"])
@pytest.mark.parametrize("overrides", [VARIANTS[0], VARIANTS[2]])
def test_forward_frees_the_states_that_backward_rebuilds(overrides, layout):
    """Stored: every state (2 per layer), and TC's masked or spread copies, stay alive until backward; rebuilt: the
    last state alone (the final readout's input). (Fails without the rebuild: every state is kept.)"""
    ids, kwargs = _batch(layout)
    config = tiny_config(**overrides)
    alive = {}
    for choice in ("off", "on"):
        model = _model(overrides, "torch", choice, torch.float32)
        watch = _LiveStates(config, ids.numel())
        with watch:
            loss = model(ids, labels=ids, use_cache=False, **kwargs).loss
        alive[choice] = watch.alive()
        loss.backward()  # backward still runs, and gives gradients (equality: the tests above)
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        del loss
    assert alive["off"] >= 2 * config.num_hidden_layers
    assert alive["on"] == 1, alive


@pytest.mark.parametrize("overrides", [VARIANTS[0], VARIANTS[2]])
def test_backward_rebuilds_each_state_over_the_one_above_except_the_last(overrides, cpu_kernel_on_or_off, monkeypatch):
    """Backward allocates one new state (X_{L-1}, from the last state, which the tape keeps) and writes every
    earlier one over the state above it, which nothing holds any more; a second backward through the same graph
    (retain_graph) rebuilds them again from the kept last state and gives the same gradients."""
    ids, kwargs = _batch("padded")
    in_place = []

    def recorded(x_next, write, **kwargs):
        in_place.append(kwargs.get("in_place", False))
        return rebuild_state(x_next, write, **kwargs)

    monkeypatch.setattr(rebuild, "rebuild_state", recorded)
    model = _model(overrides, "auto", "on", torch.float64)
    loss = model(ids, labels=ids, use_cache=False, **kwargs).loss
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    sublayers = 2 * model.config.num_hidden_layers
    assert in_place == [False] + [True] * (sublayers - 1)
    second = torch.autograd.grad(loss, list(model.parameters()))
    for a, b in zip(first, second):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@torch.no_grad()  # as in backward
def test_a_state_still_held_elsewhere_is_not_written_over():
    """`_sole_owner`: a rebuilt state with a view or alias alive (e.g. one a backward node still uses) is rebuilt
    into a new tensor instead of over it."""
    tape = rebuild.StateTape()
    x0 = torch.randn(1, 2, 3, 4, dtype=torch.float64, generator=seeded(0))
    h, c = torch.randn(1, 2, 4, dtype=torch.float64), torch.randn(1, 2, 3, dtype=torch.float64)
    write = h.unsqueeze(-2) * c.unsqueeze(-1)
    tape.start(x0.clone())
    for _ in range(3):
        tape.push(tape.states[-1] + write, (h, c))
    x2 = tape.state(2)  # rebuilt from the last state: a new tensor
    held = x2[0]  # a view of it, alive
    x1 = tape.state(1)
    assert x1.data_ptr() != x2.data_ptr()  # not over x2, which `held` still reads
    torch.testing.assert_close(held, (x0 + 2 * write)[0])
    del held, x2
    x0_rebuilt = tape.state(0)
    assert x0_rebuilt.data_ptr() == x1.data_ptr()  # over x1, held by nothing else
    torch.testing.assert_close(x0_rebuilt, x0)


def test_the_tape_goes_with_its_graph_without_waiting_for_the_garbage_collector(monkeypatch):
    """The tape holds the last state and every write: it must be freed when backward frees the graph, by reference
    counting, not later by the cyclic collector (a cycle through its hooks kept ~100 MB per step alive at bench
    size)."""
    from ddl import modeling_ddl

    tapes = []

    class Recorded(rebuild.StateTape):
        def __init__(self):
            super().__init__()
            tapes.append(weakref.ref(self))

    monkeypatch.setattr(modeling_ddl, "StateTape", Recorded)
    model = _model({}, "auto", "on", torch.float32)
    ids, _ = _batch("plain")
    gc.collect()
    gc.disable()
    try:
        loss = model(ids, labels=ids, use_cache=False).loss
        assert len(tapes) == 1 and tapes[0]() is not None  # alive while the graph is
        loss.backward()
        del loss
        assert tapes[0]() is None
    finally:
        gc.enable()


def test_rebuild_state_undoes_the_update():
    """`rebuild_state` subtracts the very write the forward added: X comes back to fp64 rounding."""
    g = seeded(0)
    x = torch.randn(2, 5, 4, 16, dtype=torch.float64, generator=g)
    h = torch.randn(2, 5, 16, dtype=torch.float64, generator=g)
    v, beta = torch.rand(2, 5, 4, dtype=torch.float64, generator=g), 2 * torch.rand(2, 5, 1, dtype=torch.float64,
                                                                                     generator=g)
    for mode in ("delta", "write_only"):
        writes = []
        out = fused_delta_update(x, h, v, beta, mode=mode, writes=writes)
        assert (out - x).abs().max() > 0.1
        torch.testing.assert_close(rebuild_state(out, writes[0]), x, rtol=0, atol=1e-13)


def test_gradient_checkpointing_falls_back_to_stored_states_with_the_same_gradients(rebuilds):
    ids, kwargs = _batch("plain")
    stored = _loss_and_grads(_model({}, "torch", "off", torch.float64), ids, kwargs)
    model = _model({}, "torch", "on", torch.float64)
    model.activation_checkpointing_enable()
    assert not rebuild.rebuild_applies(model.config, torch.float64, model.model.gradient_checkpointing)
    _assert_same(stored, _loss_and_grads(model, ids, kwargs), rtol=1e-10, atol=1e-12)
    assert not rebuilds


def test_a_compiled_training_step_falls_back_with_the_same_gradients(rebuilds):
    torch._dynamo.reset()
    ids, kwargs = _batch("plain")
    stored = _loss_and_grads(_model({"ddl_compressor": "tc"}, "torch", "off", torch.float32), ids, kwargs)
    model = _model({"ddl_compressor": "tc"}, "torch", "on", torch.float32)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(ids, labels=ids, use_cache=False).loss
    loss.backward()
    _assert_same(stored, (loss.detach(), {n: p.grad for n, p in model.named_parameters()}), rtol=1e-5, atol=1e-6)
    assert not rebuilds  # traced: the compiled graph keeps what it needs


def test_ddp_gives_the_stored_paths_gradients(tmp_path, rebuilds):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ids, kwargs = _batch("padded")
    stored = _loss_and_grads(_model({"ddl_compressor": "tc"}, "auto", "off", torch.float64), ids, kwargs)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = _model({"ddl_compressor": "tc"}, "auto", "on", torch.float64)
        rebuilt = _loss_and_grads(DistributedDataParallel(model), ids, kwargs)
    finally:
        dist.destroy_process_group()
    loss, grads = rebuilt
    assert rebuilds
    _assert_same(stored, (loss, {name.removeprefix("module."): g for name, g in grads.items()}), rtol=1e-10,
                 atol=1e-12)


def test_two_ddp_ranks_give_the_full_batchs_stored_gradients(tmp_path):
    """Two gloo ranks in processes of their own, each with half the batch and its states rebuilt in backward: DDP's
    all-reduced gradients equal one process's stored-state gradients on the whole batch."""
    import subprocess
    import sys

    ids, kwargs = _batch("plain")
    stored = _loss_and_grads(_model({"ddl_compressor": "tc"}, "auto", "off", torch.float64), ids, kwargs)
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_rebuild_worker.py")
    out = tmp_path / "rank0.pt"
    ranks = [subprocess.Popen([sys.executable, worker, str(rank), "2", str(tmp_path / "store"), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    for rank in ranks:
        output, _ = rank.communicate(timeout=300)
        assert rank.returncode == 0, output
    result = torch.load(out)
    assert result["rebuilt"] > 0
    # (the loss is computed in fp32 from fp64 logits, and its 1/tokens differs by rounding between half and whole)
    _assert_same(stored, (result["loss"], result["grads"]), rtol=1e-6, atol=1e-9)


def test_a_second_derivative_through_rebuilt_states_raises_instead_of_being_wrong():
    model = _model({}, "torch", "on", torch.float64)
    ids, _ = _batch("plain")
    loss = model(ids, labels=ids, use_cache=False).loss
    with pytest.raises(RuntimeError, match="ddl_rebuild_states"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)


def test_the_choice_is_a_runtime_one_not_saved_and_checked(monkeypatch):
    config = tiny_config(ddl_rebuild_states="on")
    assert config.ddl_rebuild_states == "on" and "_ddl_rebuild_states" not in config.to_dict()
    assert "ddl_rebuild_states" not in config.to_dict()
    monkeypatch.setenv("DDL_REBUILD_STATES", "auto")
    assert tiny_config().ddl_rebuild_states == "auto"
    assert not rebuild.rebuild_applies(tiny_config(), torch.bfloat16)  # auto: fp32/fp64 only
    assert rebuild.rebuild_applies(tiny_config(), torch.float32)
    monkeypatch.setenv("DDL_REBUILD_STATES", "sometimes")
    with pytest.raises(ValueError, match="DDL_REBUILD_STATES='sometimes' must be one of"):
        _ = tiny_config().ddl_rebuild_states
    with pytest.raises(ValueError, match="ddl_rebuild_states must be one of"):
        DDLConfig(ddl_rebuild_states="yes")


def test_fp32_states_under_bf16_autocast_are_rebuilt_by_auto_with_the_stored_paths_gradients(rebuilds):
    """Under autocast the sublayer outputs come in bf16 but the states stay fp32 (the update and the readouts are not
    autocast operations): "auto" rebuilds them, and the gradients are the stored path's."""
    ids, kwargs = _batch("padded")
    results = {}
    for choice in ("off", "auto"):
        model = _model({"ddl_compressor": "tc"}, "torch", choice, torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids, use_cache=False, **kwargs).loss
        loss.backward()
        results[choice] = (loss.detach(), {name: param.grad for name, param in model.named_parameters()})
    assert rebuilds
    _assert_same(results["off"], results["auto"], rtol=1e-5, atol=1e-6)


def test_without_torchs_storage_use_count_the_states_are_rebuilt_into_new_tensors(monkeypatch, rebuilds):
    """`_sole_owner` reads a private torch function; should a torch lack it, nothing is written over (and the
    gradients are the same)."""
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    ids, kwargs = _batch("plain")
    stored = _loss_and_grads(_model({}, "torch", "off", torch.float64), ids, kwargs)
    _assert_same(stored, _loss_and_grads(_model({}, "torch", "on", torch.float64), ids, kwargs), rtol=1e-10,
                 atol=1e-12)
    assert rebuilds and not rebuild._sole_owner(torch.zeros(3))
