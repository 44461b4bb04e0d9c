"""An inference engine that runs transformers models by its own attention (vLLM's transformers backend) calls the
model on one flattened row of all requests' tokens, position ids restarting per request, and no cache: it keeps the
attention keys and values itself, and nothing else. A DDL variant whose only memory of earlier tokens is attention
(d_v = 1, or CC without EC) decodes there as `generate` does; one with token convolutions (EC, TC) would read zeros
for each decoding step's history, so such a call is one clear error, never a silently different continuation."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from conftest import tiny_config, trained_looking
from ddl import DDLForCausalLM


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]
STEPS = 6
ATTENTION = "ddl_tests_kv_engine"


class KVOnlyEngine:
    """Keeps each request's keys and values per layer (as a paged engine does) and attends within each request; the
    model sees only the flattened row. `lengths` says how many of the row's tokens each request has this step."""

    def __init__(self):
        self.keys, self.values, self.lengths = {}, {}, []

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        outputs, start = [], 0
        for request, length in enumerate(self.lengths):
            q, k, v = (t[:, :, start : start + length] for t in (query, key, value))
            slot = (module.layer_idx, request)
            k = self.keys[slot] = torch.cat([self.keys[slot], k], 2) if slot in self.keys else k
            v = self.values[slot] = torch.cat([self.values[slot], v], 2) if slot in self.values else v
            past = k.shape[2] - length
            causal = torch.ones(length, k.shape[2], dtype=torch.bool).tril(past)
            outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scaling, enable_gqa=True))
            start += length
        return torch.cat(outputs, 2).transpose(1, 2), None

    def step(self, model, tokens_per_request, positions_per_request):
        """One engine step: the requests' new tokens in one row; the logits of each request's last token."""
        self.lengths = [len(tokens) for tokens in tokens_per_request]
        ids = torch.tensor([sum(tokens_per_request, [])])
        positions = torch.tensor([sum(positions_per_request, [])])
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        ends = torch.tensor(self.lengths).cumsum(0) - 1
        return logits[ends]


@pytest.fixture
def engine():
    engine = KVOnlyEngine()
    AttentionInterface.register(ATTENTION, engine.attention)
    return engine


def _model(**overrides):
    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(**overrides)), scale=0.3).eval()
    model.set_attn_implementation(ATTENTION)
    return model


def _generated(model, prompt):
    """generate()'s greedy tokens and each step's logits for one request alone (sdpa attention, DDL's own cache)."""
    model.set_attn_implementation("sdpa")
    out = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    model.set_attn_implementation(ATTENTION)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)


@pytest.mark.parametrize("overrides", [dict(ddl_value_channels=1), dict(ddl_value_channels=4, ddl_embed_conv=False)],
                         ids=["dv1", "cc-without-ec"])
def test_variants_without_token_convolutions_decode_there_as_generate(engine, overrides):
    """(A guard: these decoded right before too; the check that stops the others must not stop them.)"""
    model = _model(**overrides)
    expected = [_generated(model, prompt) for prompt in PROMPTS]
    tokens, positions = [list(p) for p in PROMPTS], [list(range(len(p))) for p in PROMPTS]
    generated, logits = [[] for _ in PROMPTS], [[] for _ in PROMPTS]
    with torch.no_grad():
        for _ in range(STEPS):
            step_logits = engine.step(model, tokens, positions)
            for request, row in enumerate(step_logits):
                next_token = int(row.argmax())
                generated[request].append(next_token)
                logits[request].append(row)
                positions[request] = [positions[request][-1] + 1]
                tokens[request] = [next_token]
    for request, (expected_tokens, expected_logits) in enumerate(expected):
        assert generated[request] == expected_tokens
        torch.testing.assert_close(torch.stack(logits[request]), expected_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("compressor", ["cc", "tc"], ids=["cc-ec", "tc-ec"])
def test_variants_with_token_convolutions_refuse_to_continue_without_their_history(engine, compressor):
    model = _model(ddl_value_channels=4, ddl_compressor=compressor)
    expected = [_generated(model, prompt) for prompt in PROMPTS]
    with torch.no_grad():
        prefill = engine.step(model, PROMPTS, [list(range(len(p))) for p in PROMPTS])  # (packed rows: exact)
        torch.testing.assert_close(prefill, torch.stack([logits[0] for _, logits in expected]), rtol=0, atol=1e-5)
        next_tokens = [[int(row.argmax())] for row in prefill]
        with pytest.raises(ValueError, match="position ids that do not start at 0 continue a sequence"):
            engine.step(model, next_tokens, [[len(p)] for p in PROMPTS])
        # a single request continued at a position > 0 with no cache: the same
        with pytest.raises(ValueError, match="pass the cache that saw them"):
            model(torch.tensor([next_tokens[0]]), position_ids=torch.tensor([[len(PROMPTS[0])]]))
