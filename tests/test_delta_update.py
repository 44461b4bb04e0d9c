"""The paper's algebra (arXiv 2601.00417, section 2: identity at beta = 0, projection at 1, reflection at 2, error
contraction by 1 - beta, the spectrum of I - beta k k^T), checked on the update function itself."""

import pytest
import torch

from conftest import seeded

from ddl.reference import delta_gate, delta_residual, delta_update


pytestmark = pytest.mark.device  # (runs on DDL_TEST_DEVICE: see conftest.py)


B, T, D = 2, 3, 8


def _inputs(dv, beta_value=None, seed=0):
    g = seeded(seed)
    x = torch.randn(B, T, D, dtype=torch.float64, generator=g)
    if dv > 1:
        x = torch.randn(B, T, dv, D, dtype=torch.float64, generator=g)  # d_v columns of length d
    h = torch.randn(B, T, D, dtype=torch.float64, generator=g) * 3
    v = torch.randn(B, T, dv, dtype=torch.float64, generator=g)
    if beta_value is None:
        beta = 2 * torch.rand(B, T, 1, dtype=torch.float64, generator=g)
    else:
        beta = torch.full((B, T, 1), float(beta_value), dtype=torch.float64)
    return x, h, v, beta


def _unit(h, eps=1e-5):
    return h / torch.sqrt(h.pow(2).sum(-1, keepdim=True) + eps**2)


def _state(x):
    """The state as the paper's d x d_v matrix per token: `(B, T, d, d_v)`."""
    return x.unsqueeze(-1) if x.dim() == 3 else x.transpose(-1, -2)


@pytest.mark.parametrize("dv", [1, 4])
def test_beta_zero_is_identity(dv):
    x, h, v, beta = _inputs(dv, beta_value=0.0)
    assert torch.equal(delta_update(x, h, v, beta), x)


@pytest.mark.parametrize("dv", [1, 4])
def test_beta_one_overwrites_the_readout_with_v(dv):
    x, h, v, beta = _inputs(dv, beta_value=1.0)
    k = _unit(h, eps=0.0)
    out = delta_update(x, h, v, beta, k_eps=0.0)
    readout = torch.einsum("btd,btdv->btv", k, _state(out))
    torch.testing.assert_close(readout, v, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dv", [1, 4])
def test_error_contracts_by_one_minus_beta(dv):
    x, h, v, beta = _inputs(dv)
    k = _unit(h, eps=0.0)
    e_pre = torch.einsum("btd,btdv->btv", k, _state(x)) - v
    e_post = torch.einsum("btd,btdv->btv", k, _state(delta_update(x, h, v, beta, k_eps=0.0))) - v
    torch.testing.assert_close(e_post, (1 - beta) * e_pre, rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta_value", [0.3, 1.0, 1.7, 2.0])
def test_frozen_operator_spectrum(beta_value):
    """A = I - beta k k^T: eigenvalue 1 (multiplicity d-1) and 1 - beta (eigenvector k)."""
    x, h, v, beta = _inputs(1, beta_value=beta_value)
    columns = torch.eye(D, dtype=torch.float64).expand(1, D, D)  # apply the update to the basis, v = 0
    hk = h[:1, :1].expand(1, D, D)
    operator = delta_update(columns, hk, torch.zeros(1, D, 1, dtype=torch.float64), beta[:1, :1].expand(1, D, 1), k_eps=0.0)[0]
    eigenvalues = torch.linalg.eigvalsh((operator + operator.T) / 2)
    expected = torch.tensor(sorted([1.0] * (D - 1) + [1 - beta_value]), dtype=torch.float64)
    torch.testing.assert_close(eigenvalues, expected, rtol=0, atol=1e-12)
    k = _unit(h[0, 0], eps=0.0)
    torch.testing.assert_close(operator @ k, (1 - beta_value) * k, rtol=0, atol=1e-12)
    if beta_value == 2.0:  # Householder reflection preserves norms
        torch.testing.assert_close(operator @ operator, torch.eye(D, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dv", [1, 4])
def test_directions_orthogonal_to_k_are_untouched(dv):
    x, h, v, beta = _inputs(dv)
    k = _unit(h, eps=0.0)
    out = delta_update(x, h, v, beta, k_eps=0.0)
    basis = torch.randn(B, T, D, dtype=torch.float64)
    u = basis - (basis * k).sum(-1, keepdim=True) * k  # u ⟂ k
    before = torch.einsum("btd,btdv->btv", u, _state(x))
    after = torch.einsum("btd,btdv->btv", u, _state(out))
    torch.testing.assert_close(after, before, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dv", [1, 4])
def test_equals_explicit_matrix_form(dv):
    """X_next = (I - beta k k^T) X + beta k v^T, token by token."""
    x, h, v, beta = _inputs(dv)
    out = _state(delta_update(x, h, v, beta))
    for b in range(B):
        for t in range(T):
            k = _unit(h[b, t])[:, None]  # (d, 1)
            a = torch.eye(D, dtype=torch.float64) - beta[b, t] * k @ k.T
            expected = a @ _state(x)[b, t] + beta[b, t] * k @ v[b, t][None, :]
            torch.testing.assert_close(out[b, t], expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dv", [1, 4])
def test_write_only_and_additive(dv):
    x, h, v, beta = _inputs(dv)
    k = _unit(h)
    write_only = delta_update(x, h, v, beta, mode="write_only")
    torch.testing.assert_close(_state(write_only), _state(x) + (beta * v).unsqueeze(-2) * k.unsqueeze(-1))
    additive = delta_update(x, h, mode="additive")
    torch.testing.assert_close(_state(additive), _state(x) + h.unsqueeze(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_zero_branch_output_is_finite(dtype):
    """h = 0 gives k = 0 (no NaN from 0/0), so the update is the identity, in bf16 and fp16."""
    x = torch.randn(B, T, 4, D).to(dtype)
    h = torch.zeros(B, T, D, dtype=dtype)
    out = delta_update(x, h, torch.rand(B, T, 4, dtype=dtype), torch.ones(B, T, 1))
    assert out.dtype == dtype and torch.equal(out, x)
    tiny = torch.full((B, T, D), 1e-4, dtype=dtype)  # |h|^2 underflows in fp16 arithmetic
    assert torch.isfinite(delta_update(x, tiny, torch.rand(B, T, 4, dtype=dtype), torch.ones(B, T, 1))).all()


@pytest.mark.parametrize("dv", [1, 4])
def test_a_bf16_seam_keeps_its_state_and_input_for_backward_not_fp32_copies(dv):
    """k^T X and the gate's logit are fp32 sums of a bf16 state and normalised input c: autograd keeps those two
    themselves for backward, never an fp32 copy of either (twice the bytes; the state's copy, of d_v x d per token, is
    the largest tensor such a training step would keep). The copy of h stays (d per token: its norm, as written).
    Outputs and gradients equal the seam's in fp64 on the same values to a few of bf16's roundings (2^-8 each) of the
    largest element; beta, fp32, to fp32's (a logit summed in bf16 would be off by bf16's)."""
    g = seeded(3)
    x = torch.randn(B, 5, dv, 64, generator=g) if dv > 1 else torch.randn(B, 5, 64, generator=g)
    h, c = torch.randn(B, 5, 64, generator=g), torch.randn(B, 5, 64, generator=g)
    weights = [torch.randn(64, generator=g) / 8, torch.zeros(1), torch.randn(dv, 64, generator=g) / 8, torch.zeros(dv)]
    inputs = [t.bfloat16() for t in (x, h, c, *weights)]
    kept, grads = [], {}
    for dtype in (torch.bfloat16, torch.float64):
        leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            out = delta_residual(*leaves[:3], leaves[2], *leaves[3:])
        out.double().square().sum().backward()
        grads[dtype] = [out.double(), *(t.grad.double() for t in leaves)]
        if dtype == torch.bfloat16:
            bf16_kept = list(kept)
    flat = lambda t: t.detach().float().flatten().sort().values  # noqa: E731 (a copy in any layout)
    for name, original in (("state", inputs[0]), ("c", inputs[2])):
        copies = [t for t in bf16_kept if t.dtype == torch.float32 and t.numel() == original.numel()
                  and torch.equal(flat(t), flat(original))]
        assert not copies, f"autograd keeps an fp32 copy of the bf16 {name}"
    for got, expected in zip(grads[torch.bfloat16], grads[torch.float64]):
        assert (got - expected).abs().max() <= 2**-5 * expected.abs().max()
    beta = delta_gate(inputs[2], *inputs[3:5])
    assert beta.dtype == torch.float32
    expected = delta_gate(*(t.double() for t in (inputs[2], *inputs[3:5])))
    torch.testing.assert_close(beta.double(), expected, rtol=1e-6, atol=1e-6)  # (a few of fp32's roundings)


def test_the_gate_and_the_readout_along_k_stay_fp32_under_autocast():
    """beta (its logit) and k^T X are fp32 also under bf16 autocast (train.py's --bf16), as the kernels and the
    authors' gate compute them: autocast would run F.linear's and einsum's products in bf16. The seam under autocast
    equals the seam without it, to fp32's rounding."""
    g = seeded(4)
    x, c, h = torch.randn(B, T, 4, D, generator=g), torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
    weight, bias, v = torch.randn(D, generator=g), torch.randn(1, generator=g), torch.rand(B, T, 4, generator=g)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        beta, out = delta_gate(c, weight, bias), delta_update(x, h, v, delta_gate(c, weight, bias))
    assert beta.dtype == torch.float32
    torch.testing.assert_close(beta, delta_gate(c, weight, bias))
    torch.testing.assert_close(out, delta_update(x, h, v, delta_gate(c, weight, bias)))


def test_unknown_mode_is_rejected():
    x, h, v, beta = _inputs(1)
    with pytest.raises(ValueError, match="unknown mode 'nope'"):
        delta_update(x, h, v, beta, mode="nope")
