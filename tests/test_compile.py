"""torch.compile(model, fullgraph=True) traces training and cached decoding without graph breaks."""

import pytest
import torch

from conftest import seeded, tiny_config, trained_looking
from ddl import DDLForCausalLM


pytestmark = pytest.mark.device  # (runs on DDL_TEST_DEVICE: see conftest.py)


def test_fullgraph_compile_for_training_and_cached_decoding():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DDLForCausalLM(tiny_config(ddl_compressor="tc"))  # TC + EC: the most state (conv histories) to trace
    ids = torch.randint(3, 99, (2, 8), generator=seeded(1))
    compiled = torch.compile(model, fullgraph=True)  # any graph break raises
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = model(ids, labels=ids).loss
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-5, msg=name)

    model.eval()
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        cache = model(ids[:, :-1], use_cache=True).cache
        step = compiled(ids[:, -1:], cache=cache, use_cache=True)
    torch.testing.assert_close(step.logits[:, -1], full, rtol=1e-5, atol=1e-5)


def test_compiled_training_on_packed_batches_equals_eager():
    """Packed batches (position ids restarting per document, as DataCollatorWithFlattening makes them) compiled with
    fullgraph: the documents stay apart in EC's and TC's convolutions (tap by tap while tracing, where eager spreads
    them apart) and in attention, with the cache a training forward makes by default (it left them together). The
    loss and gradients equal eager's for two batches whose documents lie differently, in one graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DDLForCausalLM(tiny_config(ddl_compressor="tc", num_hidden_layers=1))
    ids = torch.randint(3, 99, (2, 10), generator=seeded(1))
    compiled, graphs = torch.compile(model, fullgraph=True), counters["stats"]["unique_graphs"]
    batches = ([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 0, 1, 2, 3, 4, 5, 6, 7]],
               [[0, 1, 2, 3, 4, 5, 6, 0, 1, 2], [0, 1, 2, 0, 1, 2, 0, 1, 2, 3]])
    for positions in batches:
        kwargs = dict(labels=ids, position_ids=torch.tensor(positions))
        loss = compiled(ids, **kwargs).loss
        grads = torch.autograd.grad(loss, list(model.parameters()))
        reference = model(ids, **kwargs).loss
        torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
        for got, expected in zip(grads, torch.autograd.grad(reference, list(model.parameters()))):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs + 1


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_compiled_prefill_in_chunks_shorter_than_the_window_equals_the_full_forward(static):
    """Chunks of 2 tokens (TC's and EC's windows keep K-1 = 3) with their position ids, traced by dynamo (what
    matters here; Inductor adds nothing): a trace cannot tell a packed chunk from a plain one, so the cache keeps each
    row's last document with the inputs it continues (it kept zeros in their place: the logits moved by 0.06); over a
    static cache, whose count of tokens is a tensor, the second chunk's trace broke on a branch on it."""
    from transformers import DynamicCache, StaticCache

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(ddl_compressor="tc", num_hidden_layers=1))).eval()
    ids = torch.randint(3, 99, (2, 6), generator=seeded(1))
    cache = StaticCache(config=model.config, max_cache_len=8) if static else DynamicCache(config=model.config)
    compiled, logits = torch.compile(model, backend="eager", fullgraph=True), []
    with torch.no_grad():
        for start in range(0, 6, 2):
            positions = torch.arange(start, start + 2).expand(2, -1)
            logits.append(compiled(ids[:, start : start + 2], cache=cache, position_ids=positions).logits)
        full = model(ids).logits
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-5, atol=1e-5)


def test_a_compiled_static_cache_step_with_a_mask_and_no_position_ids():
    """(A static cache counts its tokens in a tensor: comparing the mask's width with it broke the compiled step.)"""
    from transformers import StaticCache

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DDLForCausalLM(tiny_config(ddl_value_channels=1, qk_norm=True)).eval()
    ids, mask = torch.randint(3, 99, (2, 6), generator=seeded(1)), torch.ones(2, 6, dtype=torch.long)
    compiled = torch.compile(model, fullgraph=True)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        compiled(ids[:, :5], attention_mask=mask[:, :5], cache=cache, use_cache=True)
        step = compiled(ids[:, 5:], attention_mask=mask, cache=cache, use_cache=True).logits
        full = model(ids).logits[:, -1:]
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


def compile_on_any_device():
    """generate's default `CompileConfig` (what it compiles a static-cache decoding step with on CUDA), on any device:
    transformers compiles automatically only on accelerators."""
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = True
    return config


@pytest.mark.parametrize("overrides", [{"ddl_value_channels": 1}, {}, {"ddl_compressor": "tc"}],
                         ids=["dv1", "dv4-cc-ec", "dv4-tc-ec"])
def test_compiled_static_cache_generate_equals_eager(overrides):
    """`cache_implementation="static"` makes generate compile its decoding step (on CUDA by default): the tokens are
    eager generation's, for left-padded prompts of different lengths, with trained-looking weights."""
    from conftest import trained_looking

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(num_hidden_layers=1, **overrides))).eval()
    ids = torch.randint(3, 99, (2, 7), generator=seeded(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is 4 tokens, left-padded
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    eager = model.generate(ids, **kwargs)
    static = model.generate(ids, cache_implementation="static", disable_compile=True, **kwargs)
    compiled = model.generate(ids, cache_implementation="static", compile_config=compile_on_any_device(), **kwargs)
    assert hasattr(model, "_compiled_call")  # generate did compile the step
    assert torch.equal(static, eager) and torch.equal(compiled, eager)


@pytest.mark.parametrize("compiled_layers, rebuilt", [((0, 1), 0), ((1,), 2), ((0,), 0)])
def test_regional_compilation_of_fp32_training_breaks_no_graph_and_equals_eager(compiled_layers, rebuilt, monkeypatch):
    """transformers' regional compilation (`layer.compile()` on decoder layers) of an fp32 model in training: the state
    rebuild, made by the eager forward around the layers, stays out of the compiled regions (their graphs keep what
    they save), so a layer is one graph with no break; loss and gradients equal eager's, also with a layer left eager:
    the states of eager layers before the first compiled one are rebuilt (two a layer), none after it."""
    from torch._dynamo.utils import counters

    from ddl.modeling_ddl import StateRebuild

    chains, end = [], StateRebuild.end
    monkeypatch.setattr(StateRebuild, "end", lambda self: chains.append(len(self.writes)) or end(self))
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = DDLForCausalLM(tiny_config(ddl_compressor="tc"))
    ids = torch.randint(3, 99, (2, 8), generator=seeded(1))
    reference = model(ids, labels=ids).loss
    expected = torch.autograd.grad(reference, list(model.parameters()))
    for i in compiled_layers:
        model.model.layers[i].compile(fullgraph=True)  # (a graph break raises)
    loss = model(ids, labels=ids).loss
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    for got, want in zip(torch.autograd.grad(loss, list(model.parameters())), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == len(compiled_layers)
    assert chains == [4, rebuilt]  # (eager: both layers' two updates)
