"""torch.compile(model, fullgraph=True) traces training and cached decoding without graph breaks."""

import pytest
import torch

from conftest import tiny_config
from ddl import DDLForCausalLM


pytestmark = pytest.mark.device  # (runs on DDL_TEST_DEVICE: see conftest.py)


def test_fullgraph_compile_for_training_and_cached_decoding():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DDLForCausalLM(tiny_config(ddl_compressor="tc"))  # TC + EC: the most state (conv histories) to trace
    ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(1))
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
