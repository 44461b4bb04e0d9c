"""Behaviour of DDLForCausalLM as a transformers model: parity, caching, padding, saving, training hooks."""

import copy
import math

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
)

from conftest import TINY, count_calls, in_hf_cache, seeded, tiny_config, trained_looking, triton_on_cpu
from ddl import DDLConfig, DDLForCausalLM, DDLModel
from ddl.configuration_ddl import conv_state_slots
from ddl.modeling_ddl import DDLCompressor, DDLDeltaResidual, DDLEmbedConv


pytestmark = pytest.mark.device  # (runs on DDL_TEST_DEVICE: see conftest.py)


def _variants():
    yield pytest.param({"ddl_value_channels": 1, "ddl_residual": "delta"}, id="dv1-delta")
    yield pytest.param({"ddl_value_channels": 1, "ddl_residual": "write_only"}, id="dv1-write_only")
    yield pytest.param({"ddl_value_channels": 1, "ddl_residual": "additive"}, id="dv1-additive")
    for compressor in ("cc", "tc"):
        for ec in (True, False):
            for mode in ("delta", "write_only", "additive"):
                overrides = {"ddl_value_channels": 4, "ddl_compressor": compressor, "ddl_embed_conv": ec}
                yield pytest.param({**overrides, "ddl_residual": mode}, id=f"dv4-{compressor}-{'ec' if ec else 'noec'}-{mode}")
    # ddl's earlier layout (one compressor per sublayer, CC as a matrix, its initialisation, QK-norm before RoPE) and
    # the authors' other options: each keeps every cache, padding and beam guarantee of the defaults
    earlier = {"ddl_shared_compressor": False, "ddl_cc_form": "matrix", "ddl_initialization": "llama",
               "qk_norm": True, "qk_norm_position": "before_rope"}
    yield pytest.param({**earlier, "ddl_compressor": "cc"}, id="dv4-cc-ec-earlier-layout")
    yield pytest.param({**earlier, "ddl_compressor": "tc"}, id="dv4-tc-ec-earlier-layout")
    yield pytest.param({"ddl_compressor": "tc", "ddl_v_constant": 2.0, "ddl_beta_hidden_size": 8, "qk_norm": True},
                       id="dv4-tc-ec-constant-v-two-layer-gate")
    yield pytest.param({"ddl_cc_kernel_size": 3, "ddl_beta_hidden_size": 8, "ddl_beta_hidden_bias": True},
                       id="dv4-cc-k3-ec-gate-bias")


VARIANTS = list(_variants())


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    return trained_looking(DDLForCausalLM(tiny_config(**overrides)).eval())


def _ids(batch=2, length=9, seed=1):
    return torch.randint(3, TINY["vocab_size"], (batch, length), generator=seeded(seed))


# ---------------------------------------------------------------------------------------------------------------
# Llama parity


def _llama_and_ddl():
    llama_config = LlamaConfig(**TINY)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(llama_config).eval()
    ddl = DDLForCausalLM(DDLConfig(**TINY, ddl_value_channels=1, ddl_residual="additive")).eval()
    ddl.load_state_dict(llama.state_dict(), strict=True)  # Llama's parameter names, nothing missing or extra
    return llama, ddl


def test_additive_scalar_model_is_exactly_llama():
    llama, ddl = _llama_and_ddl()
    assert llama.config.num_key_value_heads < llama.config.num_attention_heads  # GQA
    ids = _ids(3, 17)
    torch.testing.assert_close(ddl(ids).logits, llama(ids).logits, rtol=0, atol=1e-5)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ddl.generate(ids, **kwargs), llama.generate(ids, **kwargs))


def test_llama_state_dict_loads_by_name_into_delta_model():
    """Shared parts keep Llama's names: a Llama state dict fills everything but the DDL branches."""
    llama, _ = _llama_and_ddl()
    ddl = DDLForCausalLM(tiny_config())
    missing, unexpected = ddl.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected
    assert missing and all(any(p in k for p in ("_delta.", "compress.", "embed_conv", "readout")) for k in missing)


# ---------------------------------------------------------------------------------------------------------------
# Every variant


@pytest.mark.parametrize("implementation", ["auto", "torch", "reference"])
@pytest.mark.parametrize("overrides", VARIANTS)
def test_cached_decoding_equals_full_forward(overrides, implementation):
    model = _model(**overrides, ddl_implementation=implementation)
    ids = _ids(2, 9)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :4], use_cache=True)
        pieces, cache = [out.logits], out.cache
        for t in range(4, 9):  # one token at a time, then check a multi-token continuation too
            step = ids[:, t : t + 1] if t < 7 else ids[:, 7:9]
            if t == 8:
                break
            out = model(step, cache=cache, use_cache=True)
            pieces.append(out.logits)
            cache = out.cache
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-5)


def test_a_checkpoint_loaded_with_fewer_layers_decodes_like_its_full_forward(tmp_path):
    """`from_pretrained(path, num_hidden_layers=1)` (a truncated model, as for a draft or a probe) sets the field on
    the loaded config: the cache layout derived from it follows, so cached decoding runs and equals the forward."""
    _model(ddl_value_channels=4, ddl_compressor="tc", num_hidden_layers=3).save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path, num_hidden_layers=1).to_dict() == DDLConfig.from_dict(
        {**AutoConfig.from_pretrained(tmp_path).to_dict(), "num_hidden_layers": 1}).to_dict()
    model = DDLForCausalLM.from_pretrained(tmp_path, num_hidden_layers=1).eval()
    ids = _ids(2, 5)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
        full = model(out.sequences).logits[:, 4:-1]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=0, atol=1e-5)


def test_a_field_set_out_of_range_after_construction_is_refused_where_the_model_is_built():
    config = tiny_config()
    config.ddl_value_channels = 0
    with pytest.raises(ValueError, match="DDLConfig.ddl_value_channels must be an integer >= 1"):
        DDLForCausalLM(config)
    # what builds a Llama builds a DDL model (output_attentions with the default sdpa: checked where it is used)
    assert DDLForCausalLM(tiny_config(output_attentions=True)).config.output_attentions


@pytest.mark.parametrize("batch", [1, 2], ids=["one-sequence", "batch"])
def test_tc_decoding_steps_read_the_cached_window(batch, cpu_kernel_on_or_off, monkeypatch):
    """Each decoding step's TC readouts read their window where the cache keeps it and advance it there (ddl_kernels'
    C++ window step, or the specification without the kernels) and give the full forward."""
    calls = {name: count_calls(monkeypatch, "window_step", name) for name in ("C++", "PyTorch")}
    model = _model(ddl_value_channels=4, ddl_compressor="tc", ddl_embed_conv=True)
    ids = _ids(batch, 9)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        pieces = [out.logits]
        assert not any(calls.values())  # a prefill takes the general route
        for t in range(5, 9):
            out = model(ids[:, t : t + 1], cache=out.cache, use_cache=True)
            pieces.append(out.logits)
    expected, other = ("C++", "PyTorch") if cpu_kernel_on_or_off == "cpu-kernel" else ("PyTorch", "C++")
    assert len(calls[expected]) == 4 * (2 * model.config.num_hidden_layers + 1) and not calls[other]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("compressor", ["cc", "tc"])
def test_ec_decoding_steps_read_the_cached_window(compressor, cpu_kernel_on_or_off, monkeypatch):
    """Each decoding step's EC reads its window where the cache keeps it and advances it there (ddl_kernels' C++ EC
    step, or the specification without the kernels), and the steps give the full forward."""
    calls = {name: count_calls(monkeypatch, "conv_step", name) for name in ("C++", "PyTorch")}
    expected, other = ("C++", "PyTorch") if cpu_kernel_on_or_off == "cpu-kernel" else ("PyTorch", "C++")
    steps = calls[expected]
    model = _model(ddl_value_channels=4, ddl_compressor=compressor, ddl_embed_conv=True)
    ids = _ids(2, 9)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        pieces = [out.logits]
        assert not steps  # a prefill takes the general route
        for t in range(5, 9):
            out = model(ids[:, t : t + 1], cache=out.cache, use_cache=True)
            pieces.append(out.logits)
    assert len(steps) == 4 and not calls[other]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides", [{"ddl_value_channels": 1}, {}], ids=["dv1", "dv4-cc-ec"])
def test_batch_1_generation_under_cpu_autocast(overrides):
    """Under bf16 autocast the sublayer outputs are bf16 while the state stays fp32: decoding must not take the
    fp32-only C++ kernels and must agree with the reference implementation."""
    ids = _ids(1, 5)
    outputs = {}
    for impl in ("auto", "reference"):
        model = _model(ddl_implementation=impl, **overrides)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs[impl] = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                           output_logits=True, return_dict_in_generate=True)
    assert outputs["auto"].sequences.shape == (1, 9)
    for fused, reference in zip(outputs["auto"].logits, outputs["reference"].logits):
        torch.testing.assert_close(fused, reference, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("overrides", [{"ddl_value_channels": 1}, {}, {"ddl_compressor": "tc"}],
                         ids=["dv1", "cc-ec", "tc-ec"])
def test_ddl_autocast_state_keeps_the_state_in_autocasts_dtype(overrides):
    """`ddl_autocast_state`: under bf16 autocast every state is bf16 (the authors' regime; fp32 without the option),
    the loss and its gradients follow the fp32 state's within bf16's rounding, cached decoding follows the full
    forward; without autocast the option changes nothing."""
    ids = _ids(2, 9)
    models = {flag: _model(ddl_autocast_state=flag, **overrides).train() for flag in (False, True)}
    with torch.no_grad():
        assert torch.equal(models[True](ids).logits, models[False](ids).logits)
    losses, grads = {}, {}
    for flag, model in models.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            states = model.model(ids, output_expanded_states=True).expanded_states
            assert {s.dtype for s in states} == {torch.bfloat16 if flag else torch.float32}
            losses[flag] = model(ids, labels=ids).loss
        losses[flag].backward()
        grads[flag] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert abs(losses[True].item() - losses[False].item()) < 0.01  # (bf16 keeps 8 bits: ~0.4% a rounding)
    assert (grads[True] - grads[False]).norm() < 0.05 * grads[False].norm()
    model = models[True].eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        pieces = [out.logits]
        for t in range(5, 9):
            out = model(ids[:, t : t + 1], cache=out.cache, use_cache=True)
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=0.01)


@pytest.mark.parametrize("overrides", [{}, {"ddl_compressor": "tc"}, {"ddl_residual": "write_only"}],
                         ids=["cc-ec", "tc-ec", "write-only"])
def test_backward_inside_cpu_autocast_equals_backward_after_it(overrides, cpu_kernel_on_or_off):
    """`loss.backward()` written inside the autocast block (PyTorch advises after it; Llama works either way): DDL's
    own backward functions run with autocast off, so the gradients are the same (it raised on mixed dtypes)."""
    model = trained_looking(DDLForCausalLM(tiny_config(**overrides)), scale=0.3)
    ids = _ids(2, 11)
    grads = []
    for inside in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("overrides", VARIANTS)
def test_greedy_with_cache_equals_without_and_beam_search_runs(overrides):
    model = _model(**overrides)
    ids = _ids(2, 5)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with_cache = model.generate(ids, use_cache=True, **kwargs)
    assert torch.equal(with_cache, model.generate(ids, use_cache=False, **kwargs))
    beams = model.generate(ids, num_beams=3, **kwargs)
    assert beams.shape == (2, 11)


@pytest.mark.parametrize("overrides", VARIANTS)
def test_left_padded_batch_equals_rows_alone(overrides):
    model = _model(**overrides)
    short, long = _ids(1, 4, seed=2), _ids(1, 7, seed=3)
    # pad positions hold ordinary tokens (non-zero embeddings), so only the attention mask marks them as padding
    batch = torch.cat([torch.cat([torch.tensor([[7, 8, 9]]), short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 3), torch.ones(1, 4)], 1), torch.ones(1, 7)]).long()
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    together = model.generate(batch, attention_mask=mask, **kwargs)
    for row, alone in ((together[0, 3:], model.generate(short, **kwargs)[0]),
                       (together[1], model.generate(long, **kwargs)[0])):
        # (a row alone may stop at EOS earlier; in the batch it is then padded to the longer row's length)
        assert torch.equal(row[: len(alone)], alone) and torch.all(row[len(alone):] == 0)
    # and the logits of the real tokens of the padded row equal the row alone
    with torch.no_grad():
        padded = model(batch, attention_mask=mask).logits[0, 3:]
        torch.testing.assert_close(padded, model(short).logits[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides", VARIANTS)
def test_gradients_reach_every_parameter(overrides):
    model = _model(**overrides).train()
    ids = _ids(2, 8)
    model(ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("overrides", VARIANTS)
def test_save_and_load_give_identical_logits(overrides, tmp_path):
    model = _model(**overrides)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is DDLForCausalLM
    reloaded_state = reloaded.state_dict()
    assert all(torch.equal(value, reloaded_state[name]) for name, value in model.state_dict().items())
    ids = _ids()
    with torch.no_grad():  # same weights; BLAS may still round differently for differently aligned buffers
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Generation modes


GEN_VARIANTS = [
    pytest.param({"ddl_value_channels": 1}, id="dv1"),
    pytest.param({}, id="dv4-cc-ec"),
    pytest.param({"ddl_compressor": "tc"}, id="dv4-tc-ec"),
]


@pytest.mark.parametrize("overrides", GEN_VARIANTS)
def test_generation_modes(overrides):
    model = _model(**overrides)
    ids = _ids(1, 6)
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    static = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(static, greedy)
    # prompt lookup and assisted decoding verify drafts and crop the cache: the output must equal greedy
    repetitive = torch.cat([ids, ids, ids[:, :3]], 1)
    reference = model.generate(repetitive, max_new_tokens=8, do_sample=False, pad_token_id=0)
    lookup = model.generate(repetitive, max_new_tokens=8, do_sample=False, pad_token_id=0, prompt_lookup_num_tokens=3)
    assert torch.equal(lookup, reference)
    assistant = _model(seed=5, **overrides)
    assisted = model.generate(repetitive, max_new_tokens=8, do_sample=False, pad_token_id=0, assistant_model=assistant)
    assert torch.equal(assisted, reference)
    torch.manual_seed(6)  # a Llama assistant (a DDL model converted from Llama shares its tokenizer) is given
    llama = LlamaForCausalLM(LlamaConfig(**TINY)).eval()  # generate's kwargs too: none of DDL's may reach it
    assisted = model.generate(repetitive, max_new_tokens=8, do_sample=False, pad_token_id=0, assistant_model=llama)
    assert torch.equal(assisted, reference)
    torch.manual_seed(0)
    sampled = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=5, pad_token_id=0)
    assert sampled.shape == (1, 14)
    beam_cache = model.generate(ids, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    beam_plain = model.generate(ids, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(beam_cache, beam_plain)


@pytest.mark.parametrize("overrides", GEN_VARIANTS[1:])
def test_generate_makes_each_readout_weight_once_and_keeps_none(overrides, monkeypatch):
    """A generate call's steps share the compressors' readout weights (each made once, for the prompt), and the next
    call makes its own: weights changed between calls decode as a model that never kept any does."""
    from transformers import GenerationMixin

    model, ids = _model(**overrides), _ids(1, 6)
    made, derived_weight = [], DDLCompressor.derived_weight
    monkeypatch.setattr(DDLCompressor, "derived_weight", lambda self, *a: made.append(self) or derived_weight(self, *a))
    model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    compressors = [m for m in model.modules() if isinstance(m, DDLCompressor)]
    assert sorted(map(id, made)) == sorted(map(id, compressors))
    with torch.no_grad():
        for compressor in compressors:
            compressor.read.mul_(-0.5)
    again = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    made.clear()
    unkept = GenerationMixin.generate(model, ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(again, unkept) and len(made) == 5 * len(compressors)  # (without: once per forward)


def test_bare_dynamic_cache_gets_a_clear_error():
    model = _model()
    with pytest.raises(ValueError, match=r"DynamicCache\(config=model.config\)"):
        model(_ids(), cache=DynamicCache(), use_cache=True)
    # the scalar state has no conv histories, so a bare cache is fine there
    _model(ddl_value_channels=1)(_ids(), cache=DynamicCache(), use_cache=True)


@pytest.mark.parametrize("overrides", GEN_VARIANTS)
def test_attention_backends_agree(overrides):
    model = _model(**overrides, head_dim=16)  # flex attention's CUDA kernels take heads of 16 or more
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    outputs = {}
    for backend in ("eager", "sdpa", "flex_attention"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            outputs[backend] = model(ids, attention_mask=mask).logits[:, 2:]
    torch.testing.assert_close(outputs["sdpa"], outputs["eager"], rtol=0, atol=1e-5)
    torch.testing.assert_close(outputs["flex_attention"], outputs["eager"], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Initialisation


def _check_init(model, beta_init):
    """The DDL parameters as `ddl_initialization` sets them (the backbone's scales: test_authors_initialisation_...)."""
    config = model.config
    authors = config.ddl_initialization == "authors"
    d, dv = config.hidden_size, config.ddl_value_channels
    expected_bias = math.log((beta_init / 2) / (1 - beta_init / 2))
    for module in model.modules():
        if isinstance(module, DDLDeltaResidual):
            assert module.beta_bias.item() == pytest.approx(expected_bias, abs=1e-6)
            if authors:  # small random gate weights (std 0.5 / d), the value bias as nn.Linear's default
                assert 0 < module.beta_weight.abs().max() < 5 * 0.5 / d
                assert module.value_bias.abs().max() <= 1 / math.sqrt(d) and module.value_bias.std() > 0
            else:
                assert torch.all(module.beta_weight == 0) and torch.all(module.value_bias == 0)
            assert module.value_weight.std() > 0
        if isinstance(module, DDLCompressor):
            if module.kind == "cc_matrix":
                assert torch.all(module.weight == 1 / dv)
            elif module.kind == "tc" and not authors:
                assert torch.all(module.conv_weight[-1] == 1) and torch.all(module.conv_weight[:-1] == 0)
            else:
                taps = module.conv_weight.shape[0 if module.kind == "tc" else 1]
                assert torch.all(module.conv_weight == 1 / taps) and torch.all(module.read == 1 / dv)
        if isinstance(module, DDLEmbedConv):
            assert torch.all(module.weight[-1] == 1) and torch.all(module.weight[:-1] == 0)


@pytest.mark.parametrize("initialization", ["authors", "llama"])
def test_initialisation_in_init_weights_survives_construction_loading_and_meta_device(tmp_path, initialization):
    config = dict(ddl_beta_init=0.5, ddl_initialization=initialization)
    model = DDLForCausalLM(tiny_config(**config))
    _check_init(model, 0.5)
    if initialization == "llama":  # zero gate weights: every token starts at exactly beta_init
        beta = model.model.layers[0].attn_delta.gate(torch.randn(2, 3, TINY["hidden_size"]))
        torch.testing.assert_close(beta, torch.full_like(beta, 0.5))
    # a checkpoint without the DDL branches (e.g. a Llama) gets them initialised, not zeros
    llama, _ = _llama_and_ddl()
    llama.save_pretrained(tmp_path / "llama")
    loaded = DDLForCausalLM.from_pretrained(tmp_path / "llama", config=tiny_config(**config))
    _check_init(loaded, 0.5)
    assert torch.equal(loaded.model.layers[1].mlp.up_proj.weight, llama.model.layers[1].mlp.up_proj.weight)
    with torch.device("meta"):
        meta = DDLForCausalLM(tiny_config(**config))
    meta.to_empty(device="cpu")
    meta.init_weights()
    _check_init(meta, 0.5)


def test_authors_initialisation_scales_every_matrix_by_its_fans_and_the_outputs_by_depth():
    """The authors' rule (their modules/initialization.py): std f / sqrt(fan_in) * min(1, sqrt(fan_out / fan_in)),
    f = 0.5, the attention and MLP output projections divided by the number of layers, embeddings N(0, 0.02)."""
    d, layers, width = 256, 4, 683
    torch.manual_seed(0)
    model = DDLForCausalLM(DDLConfig(vocab_size=2000, hidden_size=d, intermediate_size=width, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, qk_norm=True,
                                     tie_word_embeddings=True, ddl_beta_hidden_size=128))

    def spectral(fan_in, fan_out):
        return 0.5 / math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in))

    layer = model.model.layers[1]
    expected = {
        layer.self_attn.q_proj.weight: spectral(d, 256),
        layer.self_attn.k_proj.weight: spectral(d, 128),  # GQA: fan_out 2 heads x 64
        layer.self_attn.o_proj.weight: spectral(256, d) / layers,
        layer.mlp.gate_proj.weight: spectral(d, width),
        layer.mlp.down_proj.weight: spectral(width, d) / layers,
        layer.attn_delta.value_weight: spectral(d, 4),
        layer.attn_delta.beta_hidden_weight: spectral(d, 128),
        layer.attn_delta.beta_weight: spectral(128, 1),
        model.model.embed_tokens.weight: 0.02,
    }
    for weight, std in expected.items():  # within four standard errors of a sample std (beta_weight has 128 values)
        assert weight.std().item() == pytest.approx(std, rel=max(0.1, 4 / math.sqrt(2 * weight.numel())))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert layer.attn_delta.beta_hidden_bias is None  # the authors' two-layer gate has no hidden bias
    assert torch.all(layer.self_attn.q_norm.weight == 1) and torch.all(model.model.norm.weight == 1)


def test_cc_conv_is_a_same_padded_depthwise_conv_along_the_value_channels_then_a_read_vector():
    """The authors' CC: per feature, a K-tap cross-correlation over the d_v channels with "same" zero padding
    (torch's padding="same" pads (K-1)//2 on the left, as theirs), then the read vector; at their initialisation
    (taps 1/4, read 1/4, K = d_v = 4) the folded weight over the channels is (2, 3, 4, 3) / 16."""
    model = DDLForCausalLM(tiny_config())
    compress = model.model.layers[0].compress
    torch.testing.assert_close(compress.derived_weight("reference")[0, 0], torch.tensor([2.0, 3.0, 4.0, 3.0]) / 16)
    for kernel in (4, 3, 2, 1):
        compress = trained_looking(DDLForCausalLM(tiny_config(ddl_cc_kernel_size=kernel))).model.layers[0].compress
        state = torch.randn(2, 5, 4, TINY["hidden_size"])  # (B, T, d_v, d)
        rows = state.permute(0, 1, 3, 2).reshape(10, TINY["hidden_size"], 4)  # (B*T, d, d_v): each feature's channels
        taps = compress.conv_weight.unsqueeze(1)  # (d, 1, K): one kernel per feature
        conv = torch.nn.functional.conv1d(rows, taps, padding="same", groups=TINY["hidden_size"])
        expected = (conv * compress.read).sum(-1).reshape(2, 5, TINY["hidden_size"])
        torch.testing.assert_close(compress(state), expected)


@pytest.mark.parametrize("initialization", ["authors", "llama"])
def test_tc_compressor_starts_neutral(initialization):
    """TC at the authors' start reads the average of the last K tokens and channels (zeros before the sequence);
    at ddl's earlier start, the current token's channel average. EC starts at identity either way."""
    model = DDLForCausalLM(tiny_config(ddl_compressor="tc", ddl_initialization=initialization))
    compress = model.model.layers[0].compress
    state = torch.randn(2, 5, 4, TINY["hidden_size"])  # (B, T, d_v, d)
    mean = state.mean(-2)
    if initialization == "authors":
        padded = torch.nn.functional.pad(mean, (0, 0, 3, 0))
        expected = sum(padded[:, s : s + 5] for s in range(4)) / 4
    else:
        expected = mean
    torch.testing.assert_close(compress(state), expected)
    embeds = torch.randn(2, 5, TINY["hidden_size"])
    torch.testing.assert_close(model.model.embed_conv(embeds), embeds.unsqueeze(-2).expand(-1, -1, 4, -1))


# ---------------------------------------------------------------------------------------------------------------
# transformers features


def test_auto_classes_resolve():
    config = AutoConfig.for_model("ddl", **TINY)
    assert isinstance(config, DDLConfig)
    assert type(AutoModel.from_config(config)) is DDLModel
    assert type(AutoModelForCausalLM.from_config(config)) is DDLForCausalLM


@pytest.mark.parametrize("overrides", GEN_VARIANTS)
def test_gradient_checkpointing_gives_the_same_gradients(overrides):
    model = _model(**overrides).train()
    ids = _ids()
    model(ids, labels=ids).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    model(ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, reference[name], rtol=1e-5, atol=1e-6)


def test_tied_and_untied_embeddings(tmp_path):
    tied = DDLForCausalLM(tiny_config(tie_word_embeddings=True))
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    untied = DDLForCausalLM(tiny_config(tie_word_embeddings=False))
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    tied.save_pretrained(tmp_path)
    reloaded = DDLForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()


def test_resize_token_embeddings():
    model = _model(tie_word_embeddings=True)
    model.resize_token_embeddings(120)
    assert model.config.vocab_size == 120 and model.lm_head.weight.shape == (120, TINY["hidden_size"])
    ids = torch.randint(0, 120, (2, 6))
    assert model(ids, labels=ids).logits.shape == (2, 6, 120)


@pytest.mark.parametrize("dv", [1, 4])
def test_output_hidden_states(dv):
    """Every entry is (B, T, d), as for Llama: the token embeddings, then each block's state read through the final
    readout (the last one normalised: last_hidden_state); the unread states are a separate output."""
    model = _model(ddl_value_channels=dv)
    ids = _ids(2, 5)
    with torch.no_grad():
        out = model.model(ids, output_hidden_states=True, output_expanded_states=True)
        embeds = model.model.embed_tokens(ids)
    d, layers = TINY["hidden_size"], TINY["num_hidden_layers"]
    assert len(out.hidden_states) == layers + 1 and all(h.shape == (2, 5, d) for h in out.hidden_states)
    torch.testing.assert_close(out.hidden_states[0], embeds, rtol=0, atol=0)
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state, rtol=0, atol=0)
    states = out.expanded_states
    assert len(states) == layers and states[0].shape == (2, 5) + ((dv,) if dv > 1 else ()) + (d,)
    read = (lambda x: model.model.readout(x)) if dv > 1 else (lambda x: x)
    for entry, state in zip(out.hidden_states[1:-1], states[:-1]):
        torch.testing.assert_close(entry, read(state), rtol=0, atol=0)
    torch.testing.assert_close(model.model.norm(read(states[-1])), out.last_hidden_state, rtol=0, atol=0)
    # through the causal LM head too; and without the flag nothing is recorded
    assert model(ids, output_hidden_states=True).hidden_states[1].shape == (2, 5, d)
    assert model(ids).hidden_states is None


def test_loss_shifts_labels_ignores_minus_100_and_honours_num_items_in_batch():
    model = _model()
    ids = _ids(2, 8)
    labels = ids.clone()
    labels[:, :3] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, TINY["vocab_size"])
    targets = labels[:, 1:].reshape(-1)
    expected = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    summed = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(model(ids, labels=labels, num_items_in_batch=20).loss, summed / 20)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_forward_is_finite_even_with_zero_sublayer_outputs(dtype):
    model = _model(ddl_compressor="tc").to(dtype)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()  # attention output h = 0 exactly
    out = model(_ids(), labels=_ids())
    assert out.logits.dtype == dtype and torch.isfinite(out.logits).all() and torch.isfinite(out.loss)


def test_qk_norm_after_rope_is_the_authors_and_before_rope_is_qwen3s():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    from ddl.modeling_ddl import DDLQKNormAttention

    hidden = torch.randn(2, 6, TINY["hidden_size"], generator=seeded(4))
    outputs = {}
    for position in ("before_rope", "after_rope"):
        config = tiny_config(qk_norm=True, qk_norm_position=position, attn_implementation="eager")
        torch.manual_seed(0)
        attention = DDLQKNormAttention(config, 0).eval()
        with torch.no_grad():
            for norm in (attention.q_norm, attention.k_norm):
                norm.weight.uniform_(0.5, 1.5)  # differ within rotary pairs, as trained norms do
        rope = LlamaRotaryEmbedding(config)(hidden, torch.arange(6)[None])
        outputs[position] = attention(hidden, rope, None)[0]
        if position == "before_rope":  # exactly transformers' Qwen3 attention
            qwen3 = Qwen3Attention(config, 0).eval()
            qwen3.load_state_dict(attention.state_dict())
            torch.testing.assert_close(outputs[position], qwen3(hidden, rope, None)[0], rtol=0, atol=1e-6)
        else:  # by hand: rotate, then normalise each head
            q, k, v = (proj(hidden).view(2, 6, -1, config.head_dim).transpose(1, 2)
                       for proj in (attention.q_proj, attention.k_proj, attention.v_proj))
            q, k = apply_rotary_pos_emb(q, k, *rope)
            q, k = attention.q_norm(q), attention.k_norm(k)
            k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))  # 4 heads over 2 key/value heads
            weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(config.head_dim), -1)
            expected = attention.o_proj((weights @ v).transpose(1, 2).reshape(2, 6, -1))
            torch.testing.assert_close(outputs[position], expected, rtol=0, atol=1e-6)
    assert (outputs["after_rope"] - outputs["before_rope"]).abs().max() > 1e-4  # not the same model
    model = _model(qk_norm=True)
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.q_norm.weight" in names and "model.layers.0.self_attn.k_norm.weight" in names
    assert model(_ids(), output_attentions=True, attn_implementation="eager").attentions is not None


def test_trainer_runs_a_few_steps(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = _model(ddl_compressor="tc").train()
    ids = _ids(8, 16)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-2, report_to=[], use_cpu=True, gradient_checkpointing=True, logging_steps=1,
    )
    before = copy.deepcopy(model.model.layers[0].attn_delta.beta_bias.detach())
    trainer = Trainer(model=model, args=args, train_dataset=data)
    assert trainer.model_accepts_loss_kwargs  # so num_items_in_batch reaches the loss
    result = trainer.train()
    assert math.isfinite(result.training_loss)
    assert not torch.equal(before.cpu(), model.model.layers[0].attn_delta.beta_bias.cpu())  # use_cpu moved the model



@pytest.mark.parametrize("wrap", ["model", "peft"])
def test_trainer_label_smoothing_shifts_the_labels(wrap, tmp_path):
    """Trainer's label smoother shifts the labels only for the class names in transformers' causal-LM mapping, where
    DDL's was not: `label_smoothing_factor` trained DDL to predict the current token (found by a user-style test
    pass). With a smoothing of 1e-6 the loss is now the model's own (shifted) one."""
    from transformers import Trainer, TrainingArguments

    model = _model().eval()
    ids = _ids(4, 16)
    expected = model(ids, labels=ids).loss
    if wrap == "peft":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=1e-6, report_to=[], use_cpu=True)
    with torch.no_grad():
        loss = Trainer(model=model, args=args).compute_loss(model, {"input_ids": ids, "labels": ids})
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-4)

# ---------------------------------------------------------------------------------------------------------------
# Hub: remote code in a fresh process where `ddl` is not importable, from a folder and from an offline HF cache

REMOTE_SCRIPT = r"""
import json, os, sys
import torch
sys.modules["ddl"] = None  # as for someone who never installed ddl: `import ddl` raises ImportError
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline

expected = json.load(open(sys.argv[1]))
for source, logits in expected.items():
    model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        got = model(ids).logits[0, -1]
    assert torch.allclose(got, torch.tensor(logits), atol=1e-5), (source, (got - torch.tensor(logits)).abs().max())
    assert type(AutoModel.from_pretrained(source, trust_remote_code=True)).__name__ == "DDLModel"
    assert AutoConfig.from_pretrained(source, trust_remote_code=True).model_type == "ddl"
    tok = AutoTokenizer.from_pretrained(source, trust_remote_code=True)
    text = pipeline("text-generation", model=model, tokenizer=tok)("To be", max_new_tokens=5, do_sample=False)
    assert text[0]["generated_text"].startswith("To be")
print("REMOTE-OK", len(expected))
"""


def test_remote_code_loading_in_a_fresh_process(tmp_path, tokenizer):
    import json
    import os
    import subprocess
    import sys

    expected = {}
    hf_home = tmp_path / "hf_home"
    for i, overrides in enumerate([{"ddl_value_channels": 1}, {}, {"ddl_compressor": "tc", "qk_norm": True}]):
        model = _model(**overrides, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
        folder = tmp_path / f"model{i}"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        with torch.no_grad():
            logits = model(torch.tensor([[5, 6, 7, 8, 9, 10]])).logits[0, -1].tolist()
        expected[str(folder)] = logits
        in_hf_cache(folder, hf_home, f"ddl-tests/tiny{i}", revision=f"{i:040x}")
        expected[f"ddl-tests/tiny{i}"] = logits
    config = json.loads((tmp_path / "model1" / "config.json").read_text())
    assert set(config["auto_map"]) == {
        "AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForDecision", "AutoModelForSequenceClassification",
        "AutoModelForTokenClassification", "AutoModelForQuestionAnswering",
    }
    assert {"model.safetensors", "configuration_ddl.py", "modeling_ddl.py", "generation_config.json"} <= {
        p.name for p in (tmp_path / "model1").iterdir()
    }
    (tmp_path / "expected.json").write_text(json.dumps(expected))
    (tmp_path / "check.py").write_text(REMOTE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # without ddl (its folder leaves PYTHONPATH), with whatever else is there (a machine's carried packages)
    kept = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    kept = [p for p in kept if not os.path.isdir(os.path.join(p, "ddl"))]
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.pathsep.join(kept))
    result = subprocess.run(
        [sys.executable, str(tmp_path / "check.py"), str(tmp_path / "expected.json")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0 and "REMOTE-OK 6" in result.stdout, result.stdout + result.stderr


def test_token_convolutions_match_conv1d():
    """EC and TC against torch's own depthwise Conv1d with causal (left) zero padding."""
    from ddl.reference import causal_token_conv, causal_token_readout

    g = seeded(0)
    B, T, d, dv, K = 2, 7, 5, 3, 4
    weight = torch.randn(K, d, dv, generator=g, dtype=torch.float64)
    conv_weight = weight.permute(1, 2, 0).reshape(d * dv, 1, K)  # channel (i, j), taps in time order
    x = torch.randn(B, T, d, generator=g, dtype=torch.float64)
    ec_in = x.unsqueeze(-1).expand(B, T, d, dv).reshape(B, T, d * dv).transpose(1, 2)
    ec = torch.nn.functional.conv1d(torch.nn.functional.pad(ec_in, (K - 1, 0)), conv_weight, groups=d * dv)
    ec = ec.transpose(1, 2).reshape(B, T, d, dv).transpose(-1, -2)  # the state layout (B, T, d_v, d)
    torch.testing.assert_close(causal_token_conv(x, weight), ec)
    state = torch.randn(B, T, dv, d, generator=g, dtype=torch.float64)
    tc_in = torch.nn.functional.pad(state.transpose(-1, -2).reshape(B, T, d * dv).transpose(1, 2), (K - 1, 0))
    tc = torch.nn.functional.conv1d(tc_in, conv_weight, groups=d * dv).transpose(1, 2).reshape(B, T, d, dv).sum(-1)
    torch.testing.assert_close(causal_token_readout(state, weight), tc)
    # with history: the last K-1 tokens of a longer sequence see the same result as the whole sequence
    torch.testing.assert_close(causal_token_readout(state[:, 4:], weight, history=state[:, 1:4]), tc[:, 4:])
    torch.testing.assert_close(causal_token_conv(x[:, 4:], weight, history=x[:, 1:4]), causal_token_conv(x, weight)[:, 4:])


@pytest.mark.parametrize("shape", [(7,), (1, 2, 7)])
def test_input_ids_without_a_batch_dimension_is_one_clear_error(shape):
    """(A 1-D `input_ids` failed deep inside with a traceback about shapes.)"""
    model = _model()
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, sequence\).*unsqueeze\(0\)"):
        model(torch.ones(shape, dtype=torch.long))
    with pytest.raises(ValueError, match="inputs_embeds must be"):
        model(inputs_embeds=torch.ones(7, TINY["hidden_size"]))


def test_decoding_steps_do_not_derive_the_conv_state_slots(monkeypatch):
    """generate() passes position ids on every step; the start-of-sequence check of packed documents that they ask
    for (EC/TC) is for a forward at the start of the cache only, so a decoding step derives nothing for it."""
    import ddl.modeling_ddl as modeling

    model = DDLForCausalLM(tiny_config(ddl_value_channels=4, ddl_compressor="tc", ddl_embed_conv=True)).eval()
    derived = []
    monkeypatch.setattr(modeling, "conv_state_slots", lambda config: derived.append(1) or conv_state_slots(config))
    with torch.no_grad():
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert not derived


# ------------------------------------------------------------------------------------------ static caches, reused


STATIC_VARIANTS = {"dv1": dict(ddl_value_channels=1), "cc-ec": dict(ddl_value_channels=4, ddl_compressor="cc"),
                   "tc-ec": dict(ddl_value_channels=4, ddl_compressor="tc")}


@pytest.mark.parametrize("variant", ["cc-ec", "tc-ec"])
def test_a_reused_static_cache_decodes_with_the_current_weights(variant):
    """A StaticCache reused after reset() (as for compiled decoding) kept the compressors' readout weights derived on
    its first use: after a weight change the next generate decoded with the old ones (logits off by ~1)."""
    from transformers import StaticCache

    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(**STATIC_VARIANTS[variant]))).eval()
    ids, options = torch.randint(3, 99, (1, 6)), dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                                                      output_logits=True)
    cache = StaticCache(config=model.config, max_cache_len=16)
    model.generate(ids, past_key_values=cache, **options)
    with torch.no_grad():  # (in place, as an optimizer step)
        for name, param in model.named_parameters():
            if "compress" in name or "readout" in name:
                param.mul_(-1.5).add_(0.3)
    cache.reset()
    reused, fresh = (model.generate(ids, past_key_values=c, **options)
                     for c in (cache, StaticCache(config=model.config, max_cache_len=16)))
    for a, b in zip(reused.logits, fresh.logits):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("variant", list(STATIC_VARIANTS))
def test_a_decoding_loop_over_a_static_cache_counts_a_padded_rows_positions(variant):
    """A hand-written decoding loop (mask, no position ids) over a StaticCache: a left-padded row's decoding steps were
    placed at the batch's positions, not its own (the prefill counted its own), so its logits were off by ~0.1."""
    from transformers import StaticCache

    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(**STATIC_VARIANTS[variant], qk_norm=True))).eval()
    ids = torch.randint(3, 99, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(ids[:, :6], attention_mask=mask[:, :6], past_key_values=cache)
        for t in range(6, 9):
            step = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache).logits[:, -1]
            full = model(ids[:, :t + 1], attention_mask=mask[:, :t + 1]).logits[:, -1]
            torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compressor, implementation", [("cc", "auto"), ("tc", "triton")])
def test_a_hook_on_the_attention_seam_that_edits_the_next_input_reaches_the_mlp(compressor, implementation,
                                                                                 monkeypatch):
    """A forward hook on a block's attention seam sees (state, next input, its norm or None) and may replace the next
    input: the MLP reads post_attention_layernorm of the edited input (a seam that made the norm itself did so before
    the hook, so a hooked seam makes none), also where the compressor's readout kernel could make the norm inside the
    seam (TC under "triton", through the interpreter)."""
    if implementation == "triton":
        triton_on_cpu(monkeypatch)
    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(ddl_compressor=compressor,
                                                       ddl_implementation=implementation))).eval()
    layer, steer, seen = model.model.layers[0], 0.5 * torch.linspace(-1, 1, TINY["hidden_size"]), {}
    layer.attn_delta.register_forward_hook(lambda module, args, out: seen.update(made=out[1]) or (
        out[0], out[1] + steer, *out[2:]))
    layer.mlp.register_forward_pre_hook(lambda module, args: seen.update(mlp=args[0]))
    with torch.no_grad():
        model(torch.randint(3, 99, (2, 5), generator=seeded(1)))
        torch.testing.assert_close(seen["mlp"], layer.post_attention_layernorm(seen["made"] + steer))


@pytest.mark.parametrize("how", ["gathered", "offloaded"])
@pytest.mark.parametrize("compressor", ["cc", "tc"])
def test_a_compressor_whose_weights_arrive_with_its_call_reads_the_same(compressor, how):
    """A compressor whose weights exist only inside its own call, gathered by a forward pre-hook as DeepSpeed ZeRO-3
    does, or offloaded by accelerate (`cpu_offload`: its forward wrapped, the weights on the meta device outside it),
    gives the logits it gives without; the decoder layer's and the model's readouts built the readout weight from the
    empty or meta weights before the call (an IndexError for CC, a meta-device error for both)."""
    from accelerate import cpu_offload

    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(ddl_compressor=compressor))).eval()
    ids = torch.randint(3, 99, (2, 6), generator=seeded(3))
    with torch.no_grad():
        expected = model(ids).logits
    compressors = [module for module in model.modules() if isinstance(module, DDLCompressor)]
    def set_data(module, data):  # (None: a hook's result that changes nothing)
        for name, p in module.named_parameters():
            p.data = data[name] if data else torch.empty(0)

    for module in compressors if how == "gathered" else []:
        kept = {name: p.data for name, p in module.named_parameters()}
        module.register_forward_pre_hook(lambda m, args, kept=kept: set_data(m, kept))
        module.register_forward_hook(lambda m, args, out: set_data(m, None))
        set_data(module, None)
    for module in compressors if how == "offloaded" else []:
        cpu_offload(module, execution_device=torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("module", ["compress", "post_attention_layernorm"])
def test_a_backward_hook_on_a_module_a_seam_could_do_the_work_of_runs_on_every_path(module):
    """A full backward hook on a block's compressor (whose readout the seam's kernel makes ahead, the C++ one on the
    CPU by default) or its post-attention norm fires as often under "auto" as under "reference": a hooked module is
    left to run (the compressor's hook fired 2 times where the specification's fired 4)."""
    calls = {}
    for implementation in ("reference", "auto"):
        torch.manual_seed(0)
        model = trained_looking(DDLForCausalLM(tiny_config(ddl_implementation=implementation)))
        calls[implementation] = []
        for layer in model.model.layers:
            getattr(layer, module).register_full_backward_hook(lambda m, gi, go, c=calls[implementation]: c.append(1))
        ids = torch.randint(3, 99, (2, 8), generator=seeded(1))
        model(ids, labels=ids).loss.backward()
    assert len(calls["auto"]) == len(calls["reference"]) == 2 * model.config.num_hidden_layers // (
        2 if module == "post_attention_layernorm" else 1)


def test_a_chunked_prefill_over_a_static_cache_counts_a_padded_rows_positions():
    """Chunks of 3 tokens (mask, no position ids) over a StaticCache, whose count of tokens is a tensor: the chunks
    after the first were placed at the batch's positions, not the padded row's own (the full forward counts its own),
    so that row's logits were off by ~0.08."""
    from transformers import StaticCache

    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(ddl_value_channels=1, qk_norm=True))).eval()
    ids = torch.randint(3, 99, (2, 9), generator=seeded(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        chunks = [model(ids[:, s : s + 3], attention_mask=mask[:, : s + 3], cache=cache).logits for s in (0, 3, 6)]
        full = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(torch.cat(chunks, 1)[mask.bool()], full[mask.bool()], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["cc-ec", "tc-ec"])
def test_assisted_decoding_with_a_static_cache_of_token_windows_is_one_error(variant):
    """transformers' static cache layer for token windows rolls back the windows but not the keys: assisted and
    prompt-lookup decoding overflowed it (IndexError) or went on silently wrong. Now one error that says what to do;
    a dynamic cache still decodes greedy's tokens."""
    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(**STATIC_VARIANTS[variant]))).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
    greedy = model.generate(ids, max_new_tokens=7, do_sample=False)
    with pytest.raises(ValueError, match="drop cache_implementation='static'"):
        model.generate(ids, cache_implementation="static", max_new_tokens=7, do_sample=False,
                       prompt_lookup_num_tokens=3)
    assert torch.equal(model.generate(ids, max_new_tokens=7, do_sample=False, prompt_lookup_num_tokens=3), greedy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compressor", ["cc", "tc"])
def test_a_forward_on_the_meta_device_gives_the_shapes_as_llama_does(compressor, dtype):
    """Shape inference on the meta device (no memory, no values), which a Llama forward allows: a forward without
    autograd builds and runs there (autocast, which the specifications ask about, has no meta device)."""
    with torch.device("meta"), torch.no_grad():
        model = DDLForCausalLM(tiny_config(ddl_compressor=compressor)).to(dtype)
        logits = model(torch.zeros(2, 5, dtype=torch.long)).logits
    assert logits.shape == (2, 5, model.config.vocab_size) and logits.device.type == "meta"
