"""Continuous batching (`generate_batch`, `transformers serve --continuous-batching`): requests of different lengths
arriving together. Its paged cache keeps each request's attention keys and values and nothing else, so it serves
the variants whose only memory of earlier tokens is attention (d_v = 1, CC without EC) as `generate` does; the
variants with token convolutions (EC, TC), whose histories it has no place for, refuse it in one line at the call."""

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from conftest import tiny_config, trained_looking
from ddl import DDLForCausalLM


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]
STEPS = 8
# small pages and blocks: the default sizes the cache from the machine's memory (seconds to allocate on a CPU)
CB_CONFIG = dict(block_size=16, num_blocks=16, max_batch_tokens=64, return_logprobs=True)


def _model(**overrides):
    torch.manual_seed(0)
    return trained_looking(DDLForCausalLM(tiny_config(**overrides)), scale=0.3).eval()


def _generation_config():
    return GenerationConfig(max_new_tokens=STEPS, do_sample=False, eos_token_id=-1, pad_token_id=0)


@pytest.mark.parametrize("overrides", [dict(ddl_value_channels=1), dict(ddl_value_channels=4, ddl_embed_conv=False)],
                         ids=["dv1", "cc-without-ec"])
def test_variants_without_token_convolutions_batch_continuously_as_generate(overrides):
    """(A guard: these ran before too.)"""
    model = _model(**overrides)
    outputs = model.generate_batch(PROMPTS, generation_config=_generation_config(), warmup=False,
                                   continuous_batching_config=ContinuousBatchingConfig(**CB_CONFIG))
    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs.values()):
        assert output.error is None, output.error
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                                      eos_token_id=None)
        tokens = expected.sequences[0, len(prompt):]
        assert output.generated_tokens == tokens.tolist()
        logprobs = torch.cat(expected.logits).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(output.logprobs), logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("compressor", ["cc", "tc"], ids=["cc-ec", "tc-ec"])
def test_variants_with_token_convolutions_refuse_it_at_the_call(compressor):
    model = _model(ddl_value_channels=4, ddl_compressor=compressor)
    with pytest.raises(ValueError, match=r"continuous batching keeps only attention keys and values .* use "
                                         r"generate\(\)"):
        model.generate_batch(PROMPTS, generation_config=_generation_config(), warmup=False,
                             continuous_batching_config=ContinuousBatchingConfig(**CB_CONFIG))
    # what `transformers serve --continuous-batching` asks before using it (it then serves by generate)
    assert not hasattr(model, "init_continuous_batching")
