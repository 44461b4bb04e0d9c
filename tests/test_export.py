"""`torch.export` with a dynamic batch and sequence length: one exported program per variant gives the eager logits at
every length from 1, shorter and longer than the token convolutions' kernels (EC, TC: 4 taps)."""

import pytest
import torch
from torch.export import Dim

from conftest import tiny_config, trained_looking
from ddl import DDLForCausalLM


VARIANTS = {
    "dv1": dict(ddl_value_channels=1),
    "cc-ec": dict(ddl_value_channels=4, ddl_compressor="cc"),
    "tc-ec": dict(ddl_value_channels=4, ddl_compressor="tc"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_exported_program_gives_the_eager_logits_at_every_length(variant):
    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(**VARIANTS[variant])), scale=0.3).eval()
    dynamic = {"input_ids": {0: Dim("batch", min=1, max=8), 1: Dim("seq", min=1, max=64)}, "use_cache": None}
    with torch.no_grad():
        program = torch.export.export(model, (), {"input_ids": torch.randint(3, 99, (2, 16)), "use_cache": False},
                                      dynamic_shapes=dynamic)
        for seq_len in (1, 2, 5, 40):
            ids = torch.randint(3, 99, (3, seq_len))
            exported = program.module()(input_ids=ids, use_cache=False).logits
            torch.testing.assert_close(exported, model(ids, use_cache=False).logits, rtol=0, atol=1e-5)


def test_exported_program_with_a_padding_mask_keeps_the_batch_dynamic():
    """A mask and no position ids (positions then count each row's real tokens): the batch stays dynamic (reading
    it with len() made it a constant, and the export failed)."""
    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(ddl_value_channels=1, qk_norm=True)), scale=0.3).eval()
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=64)
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}, "use_cache": None}
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :4] = 0
    with torch.no_grad():
        program = torch.export.export(model, (), {"input_ids": torch.randint(3, 99, (2, 16)), "attention_mask": mask,
                                                  "use_cache": False}, dynamic_shapes=dynamic)
        ids, mask = torch.randint(3, 99, (3, 30)), torch.ones(3, 30, dtype=torch.long)
        mask[1, :2] = 0
        exported = program.module()(input_ids=ids, attention_mask=mask, use_cache=False).logits
        eager = model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(exported[mask.bool()], eager[mask.bool()], rtol=0, atol=1e-5)
