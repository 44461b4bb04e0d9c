"""The model in each precision on the test device (CPU here; `DDL_TEST_DEVICE=cuda` runs it on a GPU): every fast
path against the specification (forward and backward), cached decoding against a full forward, a padded batch against
its rows alone. fp32, bf16 and fp16, with trained-looking weights, for d_v=1, CC+EC and TC+EC."""

import pytest
import torch

from conftest import seeded, tiny_config, trained_looking
from ddl import DDLForCausalLM


pytestmark = pytest.mark.device  # (runs on DDL_TEST_DEVICE: see conftest.py)


VARIANTS = {
    "dv1": dict(ddl_value_channels=1),
    "cc-ec": dict(ddl_value_channels=4, ddl_compressor="cc", ddl_embed_conv=True),
    "tc-ec": dict(ddl_value_channels=4, ddl_compressor="tc", ddl_embed_conv=True),
}
# Relative tolerances (to the largest reference magnitude): rounding of a 2-layer model in each precision.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in TOLERANCE]


def _implementations():
    """The fast paths this device has: Triton only on CUDA (elsewhere "triton" is "auto")."""
    device = torch.get_default_device()
    return ["auto", "torch"] + (["triton"] if device.type == "cuda" else [])


def _model(variant, dtype, implementation="auto", seed=0):
    torch.manual_seed(seed)
    model = trained_looking(DDLForCausalLM(tiny_config(**VARIANTS[variant], ddl_implementation=implementation)))
    return model.to(dtype).eval()


def _ids(batch, length, seed=1):
    return torch.randint(3, 99, (batch, length), generator=seeded(seed))


def _assert_close(actual, expected, dtype, what):
    scale = expected.abs().max().clamp_min(1e-6)
    error = (actual.float() - expected.float()).abs().max() / scale
    assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.2e} > {TOLERANCE[dtype]:.0e} in {dtype}"


def _assert_as_accurate(value, spec, truth, factor, what):
    allowed = factor * (spec.float() - truth).norm() + TOLERANCE[torch.float32] * truth.norm()
    error = (value.float() - truth).norm()
    assert error <= allowed, f"{what}: error {error:.3g} > {allowed:.3g}"


def _loss_and_gradients(model, ids):
    loss = model.train()(ids, labels=ids).loss
    loss.backward()
    return {"loss": loss.detach().reshape(1), **{n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_fast_path_matches_the_spec_forward_and_backward(variant, dtype):
    """Each fast path's loss and gradients, in `dtype`, are about as close to the fp32 specification (same weights) as
    the specification itself run in `dtype`: all gradients together within twice its error, each tensor of at least
    16 elements within four times, plus fp32 rounding. A low-precision path may round differently, not worse. (A
    smaller gradient, a gate bias or a read vector, sums terms over every token that largely cancel: its rounding
    error is set by the terms, not the sum, and either path can be exact by chance; it is judged with all the others.)"""
    ids = _ids(2, 12)
    exact = _loss_and_gradients(_model(variant, dtype, "reference").float(), ids)
    spec = _loss_and_gradients(_model(variant, dtype, "reference"), ids)
    for implementation in _implementations():
        fast = _loss_and_gradients(_model(variant, dtype, implementation), ids)
        for name, value in fast.items():
            assert value is not None and torch.isfinite(value).all(), f"{implementation}: {name} is not finite"
            if value.numel() >= 16:
                _assert_as_accurate(value, spec[name], exact[name], 4, f"{implementation} {name} in {dtype}")
        everything = [torch.cat([d[name].float().flatten() for name in exact]) for d in (fast, spec, exact)]
        _assert_as_accurate(*everything, 2, f"{implementation}, all gradients in {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_decoding_equals_full_forward(variant, dtype):
    ids = _ids(2, 10)
    for implementation in _implementations():
        model = _model(variant, dtype, implementation)
        with torch.no_grad():
            full = model(ids).logits
            out = model(ids[:, :4], use_cache=True)
            pieces = [out.logits]
            for t in range(4, 10):
                out = model(ids[:, t : t + 1], cache=out.cache, use_cache=True)
                pieces.append(out.logits)
        _assert_close(torch.cat(pieces, 1), full, dtype, f"{implementation} cached decoding")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_left_padded_batch_equals_rows_alone(variant, dtype):
    short, long = _ids(1, 5, seed=2), _ids(1, 8, seed=3)
    batch = torch.cat([torch.cat([torch.full((1, 3), 7), short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 3), torch.ones(1, 5)], 1), torch.ones(1, 8)]).long()
    for implementation in _implementations():
        model = _model(variant, dtype, implementation)
        with torch.no_grad():
            padded = model(batch, attention_mask=mask).logits
            _assert_close(padded[0, 3:], model(short).logits[0], dtype, f"{implementation} padded row")
            _assert_close(padded[1], model(long).logits[0], dtype, f"{implementation} full row")
