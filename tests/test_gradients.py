"""Gradients where researchers look: at every tensor the model hands out or that user code can see (expanded states,
a decoder layer's output seen by a forward hook, a gradient hook on it), on every implementation, against the
specification (`ddl_implementation="reference"`, states kept, float64) with the same weights and the same hooks.

A fast path that cannot keep this contract (a readout made inside the update before it, the state rebuild) may run
only where no user code sees the state; these tests hold each path to it with trained-looking weights."""

import copy

import pytest
import torch
from conftest import seeded, tiny_config, trained_looking

from ddl import DDLForCausalLM


pytestmark = pytest.mark.device

VARIANTS = {"dv1": dict(ddl_value_channels=1), "cc-ec": {}, "tc-ec": dict(ddl_compressor="tc")}
IMPLEMENTATIONS = ("auto", "torch", "reference")


def _models(variant, implementation, dtype=torch.float32):
    """(the path under test at its defaults, state rebuild included; the specification in fp64 with kept states)."""
    torch.manual_seed(0)
    model = DDLForCausalLM(tiny_config(num_hidden_layers=3, **VARIANTS[variant]))
    torch.manual_seed(1)
    trained_looking(model, scale=0.3)
    spec = copy.deepcopy(model).double()
    spec.config.ddl_implementation, spec.config.ddl_rebuild_states = "reference", False
    model.config.ddl_implementation = implementation
    return model.to(dtype), spec


def _ids(batch=2, length=9):
    return torch.randint(3, 99, (batch, length), generator=seeded(2))


def _close(actual, expected, what, rtol=1e-3):
    """Equal up to fp32's rounding against fp64, measured over the whole tensor (a relative error of its norm): the
    specification itself in fp32 is up to 2e-4 off here (a gate bias's gradient sums terms that cancel), the wrong
    gradients this guards against are off by tens of percent or more."""
    assert actual is not None, f"{what}: no gradient (the specification has one)"
    error = float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30))
    assert error <= rtol, f"{what}: relative error {error:.2e} against the specification (at most {rtol:.0e})"


def _weighted_logits(model, **kwargs):
    """The logits weighted by fixed random numbers, summed: a loss whose gradient reaches every state."""
    out = model.model(_ids(), **kwargs)
    logits = model.lm_head(out.last_hidden_state).double()
    return (logits * torch.randn(logits.shape, generator=seeded(5), dtype=torch.float64)).sum(), out


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_gradient_at_every_expanded_state_is_the_specifications(variant, implementation):
    """`autograd.grad(loss, expanded_states)`: each block's state gets the specification's gradient, the last too."""
    grads = {}
    for name, model in zip(("test", "spec"), _models(variant, implementation)):
        loss, out = _weighted_logits(model, output_expanded_states=True)
        states = out.expanded_states
        assert len(states) == model.config.num_hidden_layers
        grads[name] = torch.autograd.grad(loss, states, allow_unused=True)
    for i, (actual, expected) in enumerate(zip(grads["test"], grads["spec"])):
        _close(actual, expected, f"the gradient at block {i}'s state")


def _layer_hooks(model, retain=None, scale=None, edit=None, block=1):
    """Forward hooks on the decoder layers, as attribution and steering tools set them: keep every output's gradient
    (`retain`: a list), scale the gradient at block `block`'s output, or edit that output in place through `.data`."""
    for i, layer in enumerate(model.model.layers):
        def hook(module, args, out, i=i):
            if retain is not None:
                out.retain_grad()
                retain.append(out)
            if scale is not None and i == block:
                out.register_hook(lambda grad: scale * grad)
            if edit is not None and i == block:
                out.data.mul_(edit)  # (.data: no version bump, autograd does not see it)
        layer.register_forward_hook(hook)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_kept_by_forward_hooks_on_the_layers_are_the_specifications(variant, implementation):
    """`retain_grad()` on each decoder layer's output from a forward hook (what layer-attribution tools do)."""
    kept = {}
    for name, model in zip(("test", "spec"), _models(variant, implementation)):
        kept[name] = []
        _layer_hooks(model, retain=kept[name])
        _weighted_logits(model)[0].backward()
    for i, (actual, expected) in enumerate(zip(kept["test"], kept["spec"])):
        _close(actual.grad, expected.grad, f"the gradient kept at block {i}'s output")


def _parameter_grads(model, loss):
    loss.backward()
    return {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_gradient_hook_at_a_blocks_output_reaches_every_parameter_as_in_the_specification(variant, implementation):
    """A tensor hook that scales the gradient at a block's output by -0.5: every parameter's gradient changes as
    the specification's does."""
    grads = {}
    for name, model in zip(("test", "spec"), _models(variant, implementation)):
        _layer_hooks(model, scale=-0.5)
        grads[name] = _parameter_grads(model, _weighted_logits(model)[0])
    for name, expected in grads["spec"].items():
        _close(grads["test"][name], expected, name)


@pytest.mark.parametrize("block", [1, 2])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_state_edited_through_data_in_a_forward_hook_gives_the_specifications_logits_and_gradients(
        variant, implementation, block):
    """Steering through `.data` in a forward hook (no version bump): the next sublayer reads the edited state (logits
    and greedy tokens) and backward uses it (every parameter's gradient), the last block's too."""
    models, logits, grads = _models(variant, implementation), {}, {}
    for name, model in zip(("test", "spec"), models):
        _layer_hooks(model, edit=1.5, block=block)
        logits[name] = model(_ids()).logits
        grads[name] = _parameter_grads(model, _weighted_logits(model)[0])
    torch.testing.assert_close(logits["test"].double(), logits["spec"], rtol=1e-4, atol=1e-5)
    for name, expected in grads["spec"].items():
        _close(grads["test"][name], expected, name)
    with torch.no_grad():
        tokens = [model.generate(_ids(1, 4), max_new_tokens=4, do_sample=False, pad_token_id=0) for model in models]
    assert torch.equal(*tokens)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("variant", ["cc-ec", "tc-ec"])
def test_a_compressor_the_loss_does_not_reach_gets_no_gradient(variant, implementation):
    """A loss on a middle block's hidden state (a probe, early exit): the later blocks' parameters get None, as
    PyTorch gives an unused parameter (zeros would let weight decay move them), and the rest the specification's."""
    grads = {}
    for name, model in zip(("test", "spec"), _models(variant, implementation)):
        out = model.model(_ids(), output_hidden_states=True)
        weights = torch.randn(out.hidden_states[1].shape, generator=seeded(5), dtype=torch.float64)
        grads[name] = _parameter_grads(model, (out.hidden_states[1].double() * weights).sum())
    unused = {name for name, grad in grads["spec"].items() if grad is None}
    assert any(".layers.2." in name for name in unused)
    assert {name for name, grad in grads["test"].items() if grad is None} == unused
    for name, expected in grads["spec"].items():
        if expected is not None:
            _close(grads["test"][name], expected, name)


@pytest.mark.parametrize("implementation", ["auto", "torch"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_in_fp64_every_path_agrees_with_the_specification_to_rounding(variant, implementation):
    """The specification computes in at least fp32 (fp64 stays fp64): an fp64 model's logits and gradients on every
    path equal it to fp64 rounding."""
    model, spec = _models(variant, implementation, dtype=torch.float64)
    ids = _ids()
    losses = {name: m(ids, labels=ids) for name, m in (("test", model), ("spec", spec))}
    torch.testing.assert_close(losses["test"].logits, losses["spec"].logits, rtol=1e-10, atol=1e-12)
    grads = {name: _parameter_grads(m, losses[name].loss) for name, m in (("test", model), ("spec", spec))}
    for name, expected in grads["spec"].items():
        torch.testing.assert_close(grads["test"][name], expected, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("variant", ["cc-ec", "tc-ec"])
def test_gradients_kept_by_a_hook_on_every_module_are_the_specifications(variant):
    """`retain_grad()` on each seam's new state from a forward hook on every module (`register_module_forward_hook`,
    as tracing tools install them), on the C++ path: the gradient there includes what the next sublayer's readout
    sends back (a readout made inside the update before it would send it around the state)."""
    from ddl.modeling_ddl import DDLDeltaResidual

    kept = []

    def retain(module, args, output):
        if isinstance(module, DDLDeltaResidual):
            output[0].retain_grad()
            kept[-1].append(output[0])

    handle = torch.nn.modules.module.register_module_forward_hook(retain)
    try:
        for model in _models(variant, "auto"):
            kept.append([])
            _weighted_logits(model)[0].backward()
    finally:
        handle.remove()
    assert len(kept[0]) == len(kept[1]) == 6
    for i, (actual, expected) in enumerate(zip(*kept)):
        _close(actual.grad, expected.grad, f"the gradient kept at seam {i}'s state")
