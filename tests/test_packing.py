"""Packed batches (several documents per row, no padding: `DataCollatorWithFlattening`, TRL's padding-free packing,
flash attention's `cu_seq_lens_q/k`) give each document what it gives alone: EC and TC restart at every document
boundary, on every implementation, in training, and in the cache that decoding continues from.

Trained-looking weights throughout: at initialisation the token convolutions are identity taps and cannot leak."""

import pytest
import torch
from transformers import DataCollatorWithFlattening

from conftest import TINY, seeded, tiny_config, trained_looking, triton_on_cpu
from ddl import DDLForCausalLM


pytestmark = pytest.mark.device  # (runs on DDL_TEST_DEVICE: see conftest.py)


VARIANTS = [
    pytest.param({"ddl_value_channels": 1}, id="dv1"),
    pytest.param({"ddl_value_channels": 4, "ddl_compressor": "cc", "ddl_embed_conv": True}, id="cc-ec"),
    pytest.param({"ddl_value_channels": 4, "ddl_compressor": "tc", "ddl_embed_conv": False}, id="tc"),
    pytest.param({"ddl_value_channels": 4, "ddl_compressor": "tc", "ddl_embed_conv": True}, id="tc-ec"),
]
# Triton (through its CPU interpreter, slow) on the variant that runs both of its token kernels, EC and TC
IMPLEMENTATIONS = ["reference", "torch", "auto", "triton"]


def _cases():
    for implementation in IMPLEMENTATIONS:
        for variant in VARIANTS:
            if implementation != "triton" or variant.id == "tc-ec":
                yield pytest.param(variant.values[0], implementation, id=f"{variant.id}-{implementation}")


CASES = list(_cases())
LENGTHS = (7, 2, 9)  # a document shorter than the kernels' K-1 = 3 history, between two longer ones


def _model(overrides, implementation, monkeypatch, dtype=torch.float32):
    if implementation == "triton":  # ddl_kernels' Triton through its CPU interpreter (conftest: TRITON_INTERPRET=1)
        triton_on_cpu(monkeypatch)
    torch.manual_seed(0)
    model = DDLForCausalLM(tiny_config(ddl_implementation=implementation, **overrides))
    return trained_looking(model).to(dtype).eval()


def _documents(lengths=LENGTHS, seed=1):
    g = seeded(seed)
    return [torch.randint(3, TINY["vocab_size"], (n,), generator=g) for n in lengths]


def _flattened(documents, **collator_args):
    """The batch `DataCollatorWithFlattening` makes of the documents: one row, position ids restarting at each
    document, labels -100 at each document's first token, no attention mask."""
    batch = DataCollatorWithFlattening(**collator_args)([{"input_ids": d.tolist()} for d in documents])
    assert "attention_mask" not in batch
    return {k: v.to(torch.get_default_device()) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.parametrize("overrides, implementation", CASES)
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float64, 1e-7)], ids=["fp32", "fp64"])
def test_each_packed_document_gives_what_it_gives_alone(overrides, implementation, dtype, atol, monkeypatch):
    """Position ids restarting per document (with and without a cache being filled), and flash attention's
    cumulative lengths alone (position ids then run on, and RoPE's scores depend only on relative positions).
    (fp64: the gate logit is computed in fp32 by design, so the attention's last-bit differences between a masked
    and a plain causal pass can move a gate by one fp32 rounding; a leak moves logits by 1e-2.)"""
    if dtype == torch.float64 and implementation == "triton":
        pytest.skip("the Triton kernels do not serve fp64 (the PyTorch paths run)")
    model = _model(overrides, implementation, monkeypatch, dtype)
    documents = _documents()
    batch = _flattened(documents, return_flash_attn_kwargs=True)
    ids, positions = batch["input_ids"], batch["position_ids"]
    with torch.no_grad():
        alone = [model(d.unsqueeze(0), output_hidden_states=True) for d in documents]
        by_positions = model(ids, position_ids=positions, use_cache=False, output_hidden_states=True)
        runs = {
            "position ids": by_positions.logits,
            "with a cache": model(ids, position_ids=positions, use_cache=True).logits,
            "all-ones mask": model(ids, position_ids=positions, attention_mask=torch.ones_like(ids)).logits,
            "cu_seq_lens": model(ids, cu_seq_lens_q=batch["cu_seq_lens_q"], cu_seq_lens_k=batch["cu_seq_lens_k"],
                                 use_cache=False).logits,
        }
    for name, packed in runs.items():
        torch.testing.assert_close(packed, torch.cat([a.logits for a in alone], 1), rtol=0, atol=atol, msg=name)
    for layer, packed in enumerate(by_positions.hidden_states):  # each block's state read through the readout
        expected = torch.cat([a.hidden_states[layer] for a in alone], 1)
        scale = 10 * float(expected.abs().max())  # unnormalised states, read after every (fp32) gate
        torch.testing.assert_close(packed, expected, rtol=0, atol=atol * scale, msg=f"hidden state {layer}")


@pytest.mark.parametrize("overrides, implementation", CASES)
def test_packed_loss_and_gradients_are_the_sum_over_documents_alone(overrides, implementation, monkeypatch):
    """The whole `DataCollatorWithFlattening` batch (its flash-attention kwargs included) as Trainer passes it;
    `num_items_in_batch=1` makes both losses sums over their tokens."""
    model = _model(overrides, implementation, monkeypatch)
    documents = _documents()
    packed = model(**_flattened(documents, return_flash_attn_kwargs=True), num_items_in_batch=1).loss
    packed.backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    alone = sum(model(d.unsqueeze(0), labels=d.unsqueeze(0), num_items_in_batch=1).loss for d in documents)
    alone.backward()
    torch.testing.assert_close(packed, alone, rtol=1e-6, atol=1e-4)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("implementation", ["auto", "torch", "reference"])
@pytest.mark.parametrize("overrides", VARIANTS)
def test_decoding_after_a_packed_prefill_continues_the_last_document_alone(overrides, implementation, monkeypatch):
    """The cache of a packed prefill holds the last document's history only (zeros before it, however short), so
    greedy decoding continues that document as if it had been prefilled alone; the earlier documents are masked out
    of attention by a 2D mask over the cache, as for padding."""
    model = _model(overrides, implementation, monkeypatch)
    for lengths in (LENGTHS, (7, 9, 2)):  # the last document longer, then shorter, than the K-1 = 3 history
        documents = _documents(lengths)
        batch = _flattened(documents)
        last = documents[-1].unsqueeze(0)
        earlier = batch["input_ids"].shape[1] - last.shape[1]
        with torch.no_grad():
            runs = {}
            for name, ids, positions, skipped in (("packed", batch["input_ids"], batch["position_ids"], earlier),
                                                  ("alone", last, None, 0)):
                out = model(ids, position_ids=positions, use_cache=True)
                logits, tokens = [out.logits[:, -1]], []
                for step in range(5):
                    tokens.append(logits[-1].argmax(-1, keepdim=True))
                    length = last.shape[1] + step + 1
                    mask = torch.cat([torch.zeros(1, skipped, dtype=torch.long), torch.ones(1, length, dtype=torch.long)], 1)
                    out = model(tokens[-1], cache=out.cache, attention_mask=mask, use_cache=True,
                                position_ids=torch.tensor([[length - 1]]))
                    logits.append(out.logits[:, -1])
                runs[name] = torch.cat(tokens, 1), torch.stack(logits, 1)
        assert torch.equal(runs["packed"][0], runs["alone"][0]), lengths
        torch.testing.assert_close(runs["packed"][1], runs["alone"][1], rtol=0, atol=1e-5, msg=str(lengths))


def test_documents_from_cumulative_lengths_and_from_position_ids_agree():
    """`cu_seq_lens_q` counts over the flattened rows; each row starts its own first document."""
    from ddl.packing import find_documents

    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])  # the second row continues a document first
    cu_seq_lens = torch.tensor([0, 3, 5, 8, 12], dtype=torch.int32)
    by_positions = find_documents(2, 6, position_ids=positions)
    by_lengths = find_documents(2, 6, cu_seq_lens_q=cu_seq_lens)
    expected = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 1, 1]])
    assert torch.equal(by_positions.index, expected) and torch.equal(by_lengths.index, expected)
    assert find_documents(2, 6, position_ids=torch.arange(6).expand(2, 6)) is None  # unpacked: nothing to do
    assert find_documents(2, 6, cu_seq_lens_q=torch.tensor([0, 6, 12])) is None


@pytest.mark.parametrize("implementation", ["auto", "torch"])
@pytest.mark.parametrize("overrides", [VARIANTS[0], VARIANTS[3]])
def test_a_packed_chunk_after_a_cache_continues_its_first_document_and_starts_the_next(overrides, implementation,
                                                                                       monkeypatch):
    """Prefill part of document A, then one chunk [rest of A | B] (position ids restarting at B): A continues from
    the cache, B starts alone, and decoding continues B alone."""
    model = _model(overrides, implementation, monkeypatch)
    a, b = (d.unsqueeze(0) for d in _documents((9, 6)))
    with torch.no_grad():
        a_alone, b_alone = model(a).logits, model(b).logits
        cache = model(a[:, :5], use_cache=True).cache
        positions = torch.tensor([[5, 6, 7, 8, 0, 1, 2, 3, 4, 5]])
        chunk = model(torch.cat([a[:, 5:], b], 1), cache=cache, position_ids=positions, use_cache=True)
        nxt = torch.tensor([[5]])
        mask = torch.cat([torch.zeros(1, 9, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], 1)
        step = model(nxt, cache=chunk.cache, attention_mask=mask, position_ids=torch.tensor([[6]]), use_cache=True)
        b_step = model(torch.cat([b, nxt], 1)).logits[:, -1]
    torch.testing.assert_close(chunk.logits[:, :4], a_alone[:, 5:], rtol=0, atol=1e-5)
    torch.testing.assert_close(chunk.logits[:, 4:], b_alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(step.logits[:, -1], b_step, rtol=0, atol=1e-5)


def test_a_cache_that_records_the_past_keeps_one_input_a_token_through_the_documents_path():
    """Assisted decoding's cache records every input, to crop the rejected tokens' away: a forward through the
    documents path (a packed batch, or any traced forward with position ids) with fewer tokens than the window keeps
    (here 1 and 2 against K-1 = 3) recorded some inputs twice, so a crop rolled back to the wrong window (1.35 off);
    its windows now equal the plain path's through prefill, steps, a crop and the step after it."""
    from transformers import DynamicCache

    from ddl.modeling_ddl import cached_window
    from ddl.packing import Documents

    tokens = torch.randn(1, 8, 5, generator=torch.Generator().manual_seed(0))

    def windows(documents):
        cache, out, start = DynamicCache(config=tiny_config(ddl_compressor="tc")), [], 0
        cache.layers[0].activate_past_recording()
        for n in (4, 1, 2, 1):
            documents_ = Documents(torch.zeros(1, n, dtype=torch.long)) if documents else None  # (the row's first)
            out.append(cached_window(tokens[:, start : start + n], 4, cache, 0, 0, documents_))
            start += n
            if n == 2:  # (the last token rejected: the layer's crop(-1), for the one window in use)
                cache.layers[0].conv_states[0], start = cache.layers[0].conv_states[0][..., -4:-1], start - 1
        return out

    for plain, packed in zip(windows(False), windows(True)):
        assert plain is packed is None or torch.equal(plain, packed)

