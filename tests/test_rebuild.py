"""The expanded states rebuilt in backward (`modeling_ddl.StateRebuild`, `ddl_rebuild_states`): the
same loss and gradients as keeping them, on every variant and batch layout, and the states really let go."""

import gc
import weakref

import pytest
import torch
from conftest import seeded, tiny_config, trained_looking

from ddl import DDLForCausalLM
from ddl_kernels import build


VARIANTS = {
    "cc-ec": {},
    "tc-ec": {"ddl_compressor": "tc"},
    "cc-no-ec": {"ddl_embed_conv": False},
    "tc-unshared": {"ddl_compressor": "tc", "ddl_shared_compressor": False},
    "write-only": {"ddl_residual": "write_only"},
    "additive": {"ddl_residual": "additive"},
    "two-layer-gate": {"ddl_beta_hidden_size": 8, "ddl_v_constant": 2.0},
}


def _model(rebuild, implementation="auto", dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    config = tiny_config(ddl_rebuild_states=rebuild, ddl_implementation=implementation, num_hidden_layers=3,
                         **overrides)
    return trained_looking(DDLForCausalLM(config), scale=0.3).to(dtype)


def _loss_and_grads(model, **batch):
    labels = batch.pop("labels")
    loss = model(**batch, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _batches():
    g = seeded(3)
    ids = torch.randint(3, 99, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, 7:] = 0  # right padding (compacted for TC/EC)
    positions = torch.cat([torch.arange(5), torch.arange(6)]).unsqueeze(0)  # two documents packed in one row
    return {
        "plain": dict(input_ids=ids, labels=ids),
        "padded": dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)),
        "packed": dict(input_ids=ids[:1], position_ids=positions, labels=ids[:1]),
    }


@pytest.mark.parametrize("layout", ["plain", "padded", "packed"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rebuilt_states_give_the_kept_states_gradients(variant, layout, cpu_kernel_on_or_off):
    """fp64, trained-looking weights: loss and every parameter's gradient equal to rounding (C++ or PyTorch paths)."""
    batch = _batches()[layout]
    kept = _loss_and_grads(_model(False, **VARIANTS[variant]), **dict(batch))
    rebuilt = _loss_and_grads(_model(True, **VARIANTS[variant]), **dict(batch))
    torch.testing.assert_close(rebuilt[0], kept[0], rtol=0, atol=0)
    assert rebuilt[1].keys() == kept[1].keys()
    for name, grad in kept[1].items():
        torch.testing.assert_close(rebuilt[1][name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_fp32_gradients_stay_within_the_models_rounding():
    kept = _loss_and_grads(_model(False, dtype=torch.float32), **_batches()["plain"])
    rebuilt = _loss_and_grads(_model(True, dtype=torch.float32), **_batches()["plain"])
    for name, grad in kept[1].items():
        torch.testing.assert_close(rebuilt[1][name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(), msg=name)


def _live_states(model, **batch):
    """How many of the states after each block are still alive (their memory) after forward, while the graph is
    (seen by wrapping the layers' forward, not by a hook: a user's hook turns the rebuild off, `DDLModel._rebuilds`)."""
    refs = []
    for layer in model.model.layers:
        def forward(*args, _forward=layer.forward, **kwargs):
            out = _forward(*args, **kwargs)
            refs.append(weakref.ref(out.untyped_storage()))
            return out

        layer.forward = forward
    loss = model(**batch).loss
    for layer in model.model.layers:
        del layer.forward
    gc.collect()
    alive = sum(ref() is not None for ref in refs)
    loss.backward()
    return alive


@pytest.mark.parametrize("variant", ["cc-ec", "tc-ec"])
def test_backward_keeps_only_the_last_state(variant, cpu_kernel_on_or_off):
    batch = _batches()["plain"]
    assert _live_states(_model(False, **VARIANTS[variant]), **batch) == 3  # kept for backward
    assert _live_states(_model(True, **VARIANTS[variant]), **batch) == 1  # the last block's, read by the final readout


def test_a_fresh_model_rebuilds_by_default():
    """The default config trains with the rebuild (the peak memory the bench reports), in fp32 as users train."""
    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(num_hidden_layers=3)), scale=0.3)
    assert model.config.ddl_rebuild_states is True
    assert _live_states(model, **_batches()["plain"]) == 1


def test_where_it_does_not_apply_the_states_are_kept():
    """bf16 states (rounding would compound over depth), gradient checkpointing (its own hooks), flag off."""
    batch = _batches()["plain"]
    assert _live_states(_model(True, dtype=torch.bfloat16), **batch) == 3
    model = _model(True)
    model.activation_checkpointing_enable({"use_reentrant": False})
    model.train()
    _live_states(model, **batch)  # (checkpointing keeps the blocks' inputs, its own way)
    model.zero_grad(set_to_none=True)
    kept = _loss_and_grads(_model(False), **batch)
    torch.testing.assert_close(_loss_and_grads(model, **batch)[1]["model.embed_tokens.weight"],
                               kept[1]["model.embed_tokens.weight"], rtol=1e-10, atol=1e-12)


def test_a_retained_graph_runs_backward_twice_the_same():
    model = _model(True)
    batch = _batches()["plain"]
    loss = model(**batch).loss
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    second = torch.autograd.grad(loss, list(model.parameters()))
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_a_second_derivative_says_what_to_do():
    model = _model(True)
    loss = model(**_batches()["plain"]).loss
    with pytest.raises(RuntimeError, match="ddl_rebuild_states = False"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    model.config.ddl_rebuild_states, model.config.ddl_implementation = False, "reference"
    loss = model(**_batches()["plain"]).loss
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True, allow_unused=True)
    assert any(g is not None and g.requires_grad for g in grads)


@pytest.mark.parametrize("dv", [1, 4])
def test_a_second_derivative_through_a_kernel_raises_and_the_specification_gives_it(dv):
    """A kernel's backward (C++) is made of tensors without a graph: a gradient penalty through it (create_graph=True)
    was silently wrong (d_v = 1: the opposite sign along a direction; the states' rebuild, which raises, is for
    d_v > 1 only). It raises, saying to use the specifications, whose second derivative matches a finite difference of
    the first."""
    model = _model(False, "auto", ddl_value_channels=dv, ddl_embed_conv=dv > 1)
    model.set_attn_implementation("eager")  # (SDPA on CPU has no second derivative)
    ids = _batches()["plain"]["input_ids"]
    embeds = model.get_input_embeddings()(ids).detach()
    weight = model.get_parameter("model.layers.0.self_attn.q_proj.weight")

    def penalty(create_graph):
        inputs = embeds.clone().requires_grad_()
        (grad,) = torch.autograd.grad(model(inputs_embeds=inputs, labels=ids).loss, inputs, create_graph=create_graph)
        return grad.square().sum()

    if build.kernels() is not None:
        with pytest.raises(RuntimeError, match="second derivative .*ddl_implementation = 'reference'"):
            penalty(True)
    model.config.ddl_implementation = "reference"
    (second,) = torch.autograd.grad(penalty(True), weight)
    direction, eps = torch.randn(weight.shape, generator=seeded(1), dtype=weight.dtype), 1e-3
    with torch.no_grad():
        weight.add_(eps * direction)
    ahead = penalty(False).detach()
    with torch.no_grad():
        weight.sub_(2 * eps * direction)
    behind = penalty(False).detach()
    torch.testing.assert_close((second * direction).sum(), (ahead - behind) / (2 * eps), rtol=5e-3, atol=1e-6)


def _compare(kept, rebuilt, rtol=1e-10):
    for name, grad in kept[1].items():
        torch.testing.assert_close(rebuilt[1][name], grad, rtol=rtol, atol=rtol * grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("variant", ["cc-ec", "tc-ec"])
def test_a_hook_that_replaces_a_blocks_output_stops_the_chain(variant):
    """Activation steering: the next update reads another tensor than the state the chain holds (before, every
    gradient below it came out hundreds of times too large)."""
    def run(rebuild):
        model = _model(rebuild, **VARIANTS[variant])
        steer = 0.1 * torch.arange(model.config.hidden_size, dtype=torch.float64)
        model.model.layers[0].register_forward_hook(lambda module, args, out: out + steer)
        return _loss_and_grads(model, **_batches()["plain"])

    _compare(run(False), run(True))


def _steer(module, args, out):
    state, *rest = out  # (a seam gives the new state, the next sublayer's input and, the attention's, its norm)
    return state + 0.1 * torch.arange(state.shape[-1], dtype=state.dtype), *rest


def _double_h(module, args):
    return (args[0], 2 * args[1], *args[2:])


def _turn_h(module, args):
    return (args[0], args[1] + 0.3 * torch.arange(args[1].shape[-1], dtype=args[1].dtype) / args[1].shape[-1],
            *args[2:])


@pytest.mark.parametrize("hook", ["pre-hook scales h", "pre-hook turns h", "output replaced"])
@pytest.mark.parametrize("variant", ["cc-ec", "tc-ec", "additive"])
def test_hooks_on_an_update_give_the_kept_states_gradients(variant, hook, cpu_kernel_on_or_off):
    """A pre-hook that changes the sublayer output the update reads (the update is recorded as made of what it read;
    before, the write of 2h was taken for one along h: gradients 85 times too large; a turned h, projected, 5-26
    times), and a forward hook that replaces the new state (the chain stops there; before, its tensor was taken for
    the update's: 140 times)."""
    def run(rebuild):
        model = _model(rebuild, **VARIANTS[variant])
        delta = model.model.layers[1].attn_delta
        if hook == "output replaced":
            delta.register_forward_hook(_steer)
        else:
            delta.register_forward_pre_hook(_double_h if hook == "pre-hook scales h" else _turn_h)
        return _loss_and_grads(model, **_batches()["plain"])

    _compare(run(False), run(True))


@pytest.mark.parametrize("module", ["layer", "attn_delta", "compress"])
@pytest.mark.parametrize("edit", ["in place", "through .data"])
def test_a_hook_that_sees_a_state_turns_the_rebuild_off_and_an_edited_state_gets_the_kept_states_gradients(edit,
                                                                                                          module):
    """User code that sees a state (a forward hook on a layer or a seam, a pre-hook on a compressor) may change it
    in place, and through `.data` autograd does not see the change (before, the rebuild rebuilt the wrong states:
    gradients 3-95 times off; an in-place change raised): the states are kept there, with their gradients."""
    def scale(state):
        (state.data if edit == "through .data" else state).mul_(1.1)

    def hooked(rebuild):
        model = _model(rebuild)
        layer = model.model.layers[1]
        if module == "compress":
            layer.compress.register_forward_pre_hook(lambda _, args: scale(args[0]))
        else:
            (layer if module == "layer" else layer.attn_delta).register_forward_hook(
                lambda _, args, out: scale(out[0] if isinstance(out, tuple) else out))
        return model

    if module == "attn_delta" and edit == "in place":  # (the seam made the next input of it: autograd says so)
        for rebuild in (False, True):
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                _loss_and_grads(hooked(rebuild), **_batches()["plain"])
        return
    assert _live_states(hooked(True), **_batches()["plain"]) == 3
    _compare(_loss_and_grads(hooked(False), **_batches()["plain"]),
             _loss_and_grads(hooked(True), **_batches()["plain"]))


@pytest.mark.parametrize("variant", ["cc-ec", "additive"])
def test_under_autocast_the_write_is_computed_in_the_states_dtype(variant):
    """bf16 autocast keeps the fp32 state, so the rebuild runs; the update's w is fp32, and a projected one (`X + h`
    hands none) is a difference of two dot products, which a bf16 matmul would round away (gradients 10-30% off)."""
    def run(rebuild):
        model = _model(rebuild, dtype=torch.float32, **VARIANTS[variant])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**_batches()["plain"]).loss
        loss.backward()  # (outside autocast, as PyTorch recommends)
        return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    _compare(run(False), run(True), rtol=2e-3)


def test_the_chain_holds_no_graph_and_is_freed_without_backward():
    """Forward without backward (an evaluation with grad on, a skipped step), or after retain_graph: the states go
    with the graph (before, the chain and the graph held each other through autograd, out of gc's reach)."""
    model = _model(True)
    refs = []
    model.model.layers[-1].register_forward_hook(
        lambda module, args, out: refs.append(weakref.ref(out.untyped_storage())))
    loss = model(**_batches()["plain"]).loss
    del loss
    gc.collect()
    loss = model(**_batches()["plain"]).loss
    loss.backward(retain_graph=True)
    del loss
    gc.collect()
    assert [ref() for ref in refs] == [None, None]


def test_torch_activation_checkpointing_around_the_layers_gives_the_same_gradients_twice():
    """torch's own checkpoint wrapper (FSDP/accelerate's `apply_activation_checkpointing`): its recompute in
    backward runs the updates again; the chain ends with the forward, so they are not recorded twice."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

    from ddl.modeling_ddl import DDLDecoderLayer

    kept = _loss_and_grads(_model(False), **_batches()["plain"])
    model = _model(True)
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, DDLDecoderLayer),
                                   checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, CheckpointImpl.NO_REENTRANT))
    names = [name.replace("._checkpoint_wrapped_module", "") for name, _ in model.named_parameters()]
    loss = model(**_batches()["plain"]).loss
    for retain in (True, False):
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=retain, allow_unused=True)
        _compare(kept, (loss, {n: g for n, g in zip(names, grads) if g is not None}))


def test_a_lora_wrapped_model_gets_the_kept_states_gradients():
    """PEFT's LoRA layers inside attention and the MLP (trained-looking adapters, not their zero init)."""
    from peft import LoraConfig, get_peft_model

    def run(rebuild):
        torch.manual_seed(1)
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
        return _loss_and_grads(get_peft_model(_model(rebuild), lora), **_batches()["padded"])

    kept, rebuilt = run(False), run(True)
    assert any("lora" in name for name in kept[1])
    _compare(kept, rebuilt)
