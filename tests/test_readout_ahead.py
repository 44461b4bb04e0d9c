"""A compressor's readout made by the update before it (`modeling_ddl.ReadoutAhead`, the C++ seam with the next
readout): the model's numbers stay the specification's, the compressors are still called (their hooks see every
readout), and a state that a hook replaced or changed in place is read again, never served a stale readout; a TC
readout made with no tokens before the forward's is used only where the cache holds none."""

import pytest
import torch
from transformers import DynamicCache

from conftest import assert_same_loss_and_gradients, count_calls, tiny_config, trained_looking
from ddl import DDLForCausalLM
from ddl.modeling_ddl import DDLCompressor, ReadoutAhead
from ddl.reference import causal_token_readout
from ddl_kernels import build


pytestmark = pytest.mark.skipif(build.kernels() is None, reason="the C++ CPU kernels could not be built here")

VARIANTS = {"cc-ec": {}, "cc-matrix-per-sublayer": dict(ddl_cc_form="matrix", ddl_shared_compressor=False,
                                                        ddl_embed_conv=False), "tc-ec": dict(ddl_compressor="tc")}


def _models(overrides, layers=3):
    """{"reference": the specifications, "fused": the C++ kernels}: the same trained-looking weights."""
    models = {}
    for name, implementation in (("reference", "reference"), ("fused", "auto")):
        torch.manual_seed(0)
        model = DDLForCausalLM(tiny_config(num_hidden_layers=layers, ddl_implementation=implementation, **overrides))
        torch.manual_seed(1)
        models[name] = trained_looking(model)
    return models


def _ids(batch=2, length=9):
    return torch.randint(3, 99, (batch, length), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_compressor_is_called_and_its_hooks_see_its_readout(variant, monkeypatch):
    """2L + 1 compressor calls per forward, each output the specification's readout of the state it was given (TC's
    decoding steps: of their cached windows, not checked here), while in forwards of several tokens all but the first
    were made by the updates."""
    model = _models(VARIANTS[variant])["fused"]
    tc = model.config.ddl_compressor == "tc"
    readouts = count_calls(monkeypatch, "token_readout", "C++")
    seen = []
    for module in model.modules():
        if isinstance(module, DDLCompressor):
            module.register_forward_hook(lambda module, args, out: seen.append((module, args[0], out)))
    model(_ids(), labels=_ids()).loss.backward()
    with torch.no_grad():
        model.generate(_ids(1, 4), max_new_tokens=2, do_sample=False, pad_token_id=0)
    layers = model.config.num_hidden_layers
    # a training forward and a prompt (made ahead: one C++ readout each, of EC's state), one step (each reads itself;
    # TC: its cached window, by the window step)
    assert len(seen) == 3 * (2 * layers + 1) and len(readouts) == 2 + (0 if tc else 2 * layers + 1)
    for module, state, out in seen[: 2 * (2 * layers + 1)] if tc else seen:
        torch.testing.assert_close(out, causal_token_readout(state, module.derived_weight()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_hook_that_replaces_a_blocks_output_is_read_again(variant):
    """The next compressor gets the hook's tensor, not the one the update made a readout of: loss and gradients equal
    the specification's with the same hook, and so do greedy tokens."""
    models = _models(VARIANTS[variant])
    steer = torch.linspace(-1, 1, 32)
    for model in models.values():
        model.model.layers[1].register_forward_hook(lambda module, args, out: 1.5 * out + steer)
    assert_same_loss_and_gradients(models, _ids(), loss_atol=1e-5, grad_rtol=1e-4, grad_atol=1e-5)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    tokens = [model.generate(_ids(1, 4), **kwargs) for model in models.values()]
    assert torch.equal(*tokens)


@pytest.mark.parametrize("kernel", [4, 1])
def test_a_tc_readout_is_made_ahead_only_where_the_cache_holds_no_tokens_before(kernel, monkeypatch):
    """A prompt in two forwards of several tokens (chunked prefill): the first's TC readouts, made with zeros before
    its tokens, are the right ones and leave each window in the cache; in the second, whose compressors read the
    first's tokens too, none is made ahead. The logits equal one forward of the whole prompt by the specification,
    and the greedy tokens after it the specification's. (K = 1: no window; the cache keeps none.)"""
    models = _models(dict(VARIANTS["tc-ec"], ddl_state_kernel_size=kernel))
    made = count_calls(monkeypatch, "delta_residual_readout", "C++")
    ids = _ids(2, 11)
    # (a training forward has a cache too: use_cache defaults to True)
    assert_same_loss_and_gradients(models, ids, loss_atol=1e-5, grad_rtol=1e-4, grad_atol=1e-5)
    layers = models["fused"].config.num_hidden_layers
    with torch.no_grad():
        whole = models["reference"](ids).logits
        fused = models["fused"]
        cache = DynamicCache(config=fused.config)
        made.clear()
        first = fused(ids[:, :6], cache=cache, use_cache=True).logits
        assert len(made) == 2 * layers
        second = fused(ids[:, 6:], cache=cache, use_cache=True).logits
        assert len(made) == 2 * layers
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=1e-4, atol=1e-5)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(*(model.generate(ids, **kwargs) for model in models.values()))


def test_a_state_changed_in_place_is_read_again():
    """A forward hook that changes a block's output in place (no autograd, as steering while decoding does): the
    readout made before the change is not used; the logits equal the specification's with the same hook."""
    models = _models({})
    for model in models.values():
        model.model.layers[0].register_forward_hook(lambda module, args, out: out.mul_(1.5))
        model.model.layers[-1].register_forward_hook(lambda module, args, out: out.add_(0.25))  # the final readout's
    with torch.no_grad():
        logits = [model(_ids()).logits for model in models.values()]
    torch.testing.assert_close(*logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("absent", ["zero3-partitioned", "offloaded-to-meta"])
def test_a_compressor_whose_parameters_are_not_here_reads_itself(absent):
    """A later block's parameters may be empty until its own forward (ZeRO-3), on the meta device (accelerate's
    offload), or shards (FSDP2's DTensors, tests/test_fsdp2.py): such a compressor's weight is not taken ahead."""
    model = _models({})["fused"]
    ahead = ReadoutAhead(model.model.layers, model.model.readout, None)
    first_update, second_compressor = model.model.layers[0].attn_delta, model.model.layers[0].compressor("mlp")
    assert ahead.weight(first_update) is not None
    if absent == "zero3-partitioned":
        second_compressor.read.data = torch.empty(0)
    else:
        second_compressor.read = torch.nn.Parameter(torch.empty(4, device="meta"))
    assert ahead.weight(first_update) is None
    assert ahead.weight(model.model.layers[-1].mlp_delta) is not None  # the final readout's are here


def test_under_reentrant_gradient_checkpointing_every_compressor_reads_its_state(monkeypatch):
    """A reentrant recompute runs each block's forward without autograd, so a readout made in one block and read in
    the next would be cut off its graph: there the updates make none, and the gradients are the specification's."""
    models = _models({})
    for model in models.values():
        model.train().gradient_checkpointing_enable({"use_reentrant": True})
    readouts = count_calls(monkeypatch, "token_readout", "C++")
    assert_same_loss_and_gradients(models, _ids(), loss_atol=1e-5, grad_rtol=1e-4, grad_atol=1e-5)
    assert len(readouts) >= 2 * models["fused"].config.num_hidden_layers + 1


def test_in_inference_mode_every_compressor_reads_its_state(monkeypatch):
    """Inference tensors keep no version counter to show an in-place change: no readouts made ahead there."""
    models = _models({})
    readouts = count_calls(monkeypatch, "token_readout", "C++")
    with torch.inference_mode():
        logits = [model(_ids()).logits for model in models.values()]
    torch.testing.assert_close(*logits, rtol=1e-4, atol=1e-5)
    assert len(readouts) == 2 * models["fused"].config.num_hidden_layers + 1


@pytest.mark.parametrize("impl", ["reentrant", "non-reentrant"])
def test_blocks_wrapped_by_torchs_checkpoint_get_the_specifications_gradients(impl):
    """torch's own activation checkpointing (`apply_activation_checkpointing`, as FSDP and accelerate apply it)
    wraps each block: a block's recompute must find the readouts it made in its first forward, so none is made ahead
    (reentrant: wrong gradients, embeddings' none; non-reentrant: a CheckpointError on different saved tensors)."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             apply_activation_checkpointing,
                                                                             checkpoint_wrapper)

    from ddl.modeling_ddl import DDLDecoderLayer

    models = _models({})
    wrapper = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT if impl == "reentrant" else
                      CheckpointImpl.NO_REENTRANT)
    for model in models.values():
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper,
                                       check_fn=lambda module: isinstance(module, DDLDecoderLayer))
        model.train()
    ids = _ids()
    losses = {name: model(ids, labels=ids, use_cache=False).loss for name, model in models.items()}
    for loss in losses.values():
        loss.backward()
    torch.testing.assert_close(losses["fused"], losses["reference"], rtol=1e-5, atol=1e-5)
    reference = dict(models["reference"].named_parameters())
    for name, param in models["fused"].named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, reference[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_compressor_whose_pre_hooks_remake_its_weight_reads_itself():
    """Pruning remakes a weight from its `_orig` in a forward pre-hook: the weight the update before would read is
    the previous forward's, so none is taken ahead (after an in-place step on `_orig`, as an optimizer makes)."""
    from torch.nn.utils import prune

    models = _models({})
    for model in models.values():
        prune.l1_unstructured(model.model.readout, "conv_weight", amount=0.5)
        model(_ids())  # the pre-hook sets conv_weight from conv_weight_orig
        with torch.no_grad():
            model.model.readout.conv_weight_orig.mul_(-2.0)
    logits = [model(_ids()).logits for model in models.values()]
    torch.testing.assert_close(*logits, rtol=1e-4, atol=1e-5)


def test_where_no_implementation_makes_readouts_ahead_no_weight_is_made_for_one(monkeypatch):
    """With only the PyTorch paths allowed (as on a GPU), each compressor's weight is made once per forward, by the
    compressor: not a second time for an update that could not use it."""
    model = DDLForCausalLM(tiny_config(num_hidden_layers=3, ddl_implementation="torch"))
    made = []
    original = DDLCompressor.derived_weight
    monkeypatch.setattr(DDLCompressor, "derived_weight", lambda self: made.append(self) or original(self))
    model(_ids(), labels=_ids()).loss.backward()
    assert len(made) == 2 * model.config.num_hidden_layers + 1


def test_where_the_cpu_kernels_are_not_there_one_update_tries_and_the_rest_do_not(monkeypatch):
    """"auto" on the CPU, ddl_kernels installed, its C++ build switched off or failed (DDL_CPU_KERNEL=0): the first
    update folds its next compressor's weight, gets no readout, and no later update of that forward folds one."""
    from ddl_kernels import build

    monkeypatch.setattr(build, "_ops", False)  # what a failed or switched-off build leaves
    model = DDLForCausalLM(tiny_config(num_hidden_layers=3))
    made = []
    original = DDLCompressor.derived_weight
    monkeypatch.setattr(DDLCompressor, "derived_weight", lambda self: made.append(self) or original(self))
    model(_ids(), labels=_ids()).loss.backward()
    assert len(made) == 2 * model.config.num_hidden_layers + 2
