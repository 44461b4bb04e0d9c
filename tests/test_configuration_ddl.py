import dataclasses

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import LlamaConfig

from ddl import DDLConfig, DDLModel, ops


def test_llama_fields_names_and_defaults_are_llamas():
    ddl, llama = DDLConfig(), LlamaConfig()
    llama_fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    for name in llama_fields:
        assert getattr(ddl, name) == getattr(llama, name), name


def test_ddl_defaults_are_the_papers_default_variant():
    config = DDLConfig()
    assert config.model_type == "ddl"
    assert (config.ddl_value_channels, config.ddl_compressor, config.ddl_embed_conv) == (4, "cc", True)
    assert (config.ddl_residual, config.ddl_beta_init, config.ddl_k_eps) == ("delta", 1.0, 1e-5)
    assert (config.ddl_v_sigmoid_scale, config.ddl_beta_hidden_size, config.qk_norm) == (4.0, None, False)
    assert config.ddl_value_input == "state"
    # the authors' code (docs/faithfulness.md)
    assert (config.ddl_shared_compressor, config.ddl_cc_form, config.cc_kernel_size) == (True, "conv", 4)
    assert (config.ddl_initialization, config.ddl_init_std_factor, config.qk_norm_position) == ("authors", 0.5,
                                                                                               "after_rope")
    assert (config.ddl_beta_hidden_bias, config.ddl_v_constant) == (False, None)
    # EC defaults to off for the scalar state
    assert DDLConfig(ddl_value_channels=1).ddl_embed_conv is False


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"ddl_value_channels": 1},
        {"ddl_compressor": "tc", "num_hidden_layers": 3},
        {"ddl_compressor": "tc", "num_hidden_layers": 1, "ddl_embed_conv": True},
        {"ddl_residual": "write_only", "ddl_beta_hidden_size": 16, "qk_norm": True},
        {"ddl_shared_compressor": False, "ddl_cc_form": "matrix", "ddl_initialization": "llama"},
        {"ddl_cc_kernel_size": 2, "ddl_v_constant": 2.0, "qk_norm": True, "qk_norm_position": "before_rope"},
    ],
)
def test_round_trip(kwargs, tmp_path):
    config = DDLConfig(hidden_size=64, num_attention_heads=4, **kwargs)
    restored = DDLConfig.from_dict(config.to_dict())
    assert restored.to_dict() == config.to_dict()
    config.save_pretrained(tmp_path)
    assert DDLConfig.from_pretrained(tmp_path).to_dict() == config.to_dict()


def test_cache_layout_is_derived():
    cc = DDLConfig(num_hidden_layers=3)  # EC history lives in layer 0
    assert cc.layer_types == ["hybrid", "full_attention", "full_attention"] and cc.number_of_conv_states == 1
    scalar = DDLConfig(num_hidden_layers=3, ddl_value_channels=1)
    assert scalar.layer_types == ["full_attention"] * 3 and scalar.number_of_conv_states == 0
    tc = DDLConfig(num_hidden_layers=3, ddl_compressor="tc")  # attn + mlp per layer, + EC (0), + readout (2)
    assert tc.layer_types == ["hybrid"] * 3 and tc.number_of_conv_states == 3
    # a stale layout in a saved config.json is replaced, not trusted, and never written
    stale = DDLConfig(num_hidden_layers=2, layer_types=["full_attention"] * 2, number_of_conv_states=7)
    assert stale.layer_types == ["hybrid", "full_attention"] and stale.number_of_conv_states == 1
    assert "layer_types" not in stale.to_dict() and "number_of_conv_states" not in stale.to_dict()


@pytest.mark.parametrize("change", [{"num_hidden_layers": 3}, {"num_hidden_layers": 1}, {"ddl_compressor": "tc"},
                                    {"ddl_compressor": "cc"}, {"ddl_state_kernel_size": 1},
                                    {"ddl_embed_kernel_size": 1}, {"ddl_embed_conv": False}])
@pytest.mark.parametrize("start", [{"ddl_value_channels": 1}, {}, {"ddl_compressor": "tc"}], ids=["dv1", "cc", "tc"])
def test_a_field_set_on_a_built_config_gives_the_cache_layout_of_the_config_built_with_it(start, change):
    """What the cache layout comes from, set after construction (by a user, or by `from_pretrained(path,
    num_hidden_layers=...)`): the layout generate's cache reads follows, as if it had been passed."""
    if start.get("ddl_value_channels") == 1 and change.get("ddl_embed_conv") is False:
        change = {}
    config = DDLConfig(num_hidden_layers=2, **start)
    for field, value in change.items():
        setattr(config, field, value)
    built = DDLConfig(**{"num_hidden_layers": 2, **start, **change})
    assert (config.layer_types, config.number_of_conv_states) == (built.layer_types, built.number_of_conv_states)


def test_ec_is_resolved_when_the_config_is_made_and_a_later_contradiction_is_one_error():
    """`ddl_embed_conv=None` is d_v > 1, resolved at construction (as Llama's config resolves its defaults); a d_v
    set later that contradicts it is refused where the model is built, in one line that says what to set."""
    assert DDLConfig().ddl_embed_conv is True and DDLConfig(ddl_value_channels=1).ddl_embed_conv is False
    config = DDLConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    config.ddl_value_channels = 1
    with pytest.raises(ValueError, match="ddl_embed_conv must be False when ddl_value_channels == 1"):
        DDLModel(config)
    config.ddl_embed_conv = False
    DDLModel(config)


@pytest.mark.parametrize("order", ["ec-first", "dv-first"])
@pytest.mark.parametrize("how", ["setattr", "update", "update_from_string", "from_pretrained"])
def test_an_explicit_choice_of_ec_is_kept_when_the_value_channels_change(how, order, tmp_path):
    """EC follows d_v only while it holds the default it was given (None): a choice made, or a saved config's, is
    kept in whatever order the two are set (it followed d_v when EC was set to False first on a d_v = 1 config)."""
    changes = {"ddl_embed_conv": False, "ddl_value_channels": 4}
    changes = changes if order == "ec-first" else dict(reversed(changes.items()))
    config = DDLConfig(ddl_value_channels=1)
    if how == "setattr":
        for field, value in changes.items():
            setattr(config, field, value)
    elif how == "update":
        config.update(changes)
    elif how == "update_from_string":
        config.update_from_string(",".join(f"{k}={str(v).lower()}" for k, v in changes.items()))
    else:
        config.save_pretrained(tmp_path)
        config = DDLConfig.from_pretrained(tmp_path, **changes)
    assert config.ddl_embed_conv is False
    explicit = DDLConfig(ddl_value_channels=4, ddl_embed_conv=True)
    explicit.ddl_value_channels = 1  # (refused where the model is built)
    assert explicit.ddl_embed_conv is True
    saved = DDLConfig(ddl_value_channels=1)
    saved.save_pretrained(tmp_path / "saved")
    loaded = DDLConfig.from_pretrained(tmp_path / "saved")
    loaded.ddl_value_channels = 4
    assert loaded.ddl_embed_conv is False and "_ec_default" not in loaded.to_dict()


def test_configs_compare_equal_by_their_fields():
    """(`==` raised on a TC config of several layers: its per-layer conv-state counts are a heterogeneous field.)"""
    assert DDLConfig(ddl_compressor="tc", num_hidden_layers=3) == DDLConfig(ddl_compressor="tc", num_hidden_layers=3)
    assert DDLConfig(ddl_compressor="tc", num_hidden_layers=3) != DDLConfig(ddl_compressor="tc", num_hidden_layers=2)


@pytest.mark.parametrize(
    "kwargs, field, received",
    [
        ({"ddl_value_channels": 0}, "ddl_value_channels", "0"),
        ({"ddl_compressor": "xc"}, "ddl_compressor", "'xc'"),
        ({"ddl_residual": "multiplicative"}, "ddl_residual", "'multiplicative'"),
        ({"ddl_value_input": "embedding"}, "ddl_value_input", "'embedding'"),
        ({"ddl_beta_init": 2.5}, "ddl_beta_init", "2.5"),
        ({"ddl_beta_init": -0.1}, "ddl_beta_init", "-0.1"),
        ({"ddl_state_kernel_size": 0}, "ddl_state_kernel_size", "0"),
        ({"ddl_embed_kernel_size": 0}, "ddl_embed_kernel_size", "0"),
        ({"ddl_beta_hidden_size": 0}, "ddl_beta_hidden_size", "0"),
        ({"ddl_k_eps": 0.0}, "ddl_k_eps", "0.0"),
        ({"ddl_v_sigmoid_scale": -1.0}, "ddl_v_sigmoid_scale", "-1.0"),
        ({"ddl_v_sigmoid_scale": float("inf")}, "ddl_v_sigmoid_scale", "inf"),
        ({"ddl_v_constant": float("nan")}, "ddl_v_constant", "nan"),
        ({"ddl_v_constant": float("-inf")}, "ddl_v_constant", "-inf"),
        ({"ddl_k_eps": float("inf")}, "ddl_k_eps", "inf"),
        ({"ddl_init_std_factor": float("nan")}, "ddl_init_std_factor", "nan"),
        ({"ddl_value_channels": 1, "ddl_embed_conv": True}, "ddl_embed_conv", "True"),
        ({"ddl_cc_form": "vector"}, "ddl_cc_form", "'vector'"),
        ({"ddl_cc_kernel_size": 5}, "ddl_cc_kernel_size", "5"),  # > d_v = 4
        ({"ddl_cc_kernel_size": 0}, "ddl_cc_kernel_size", "0"),
        ({"ddl_initialization": "xavier"}, "ddl_initialization", "'xavier'"),
        ({"ddl_init_std_factor": 0.0}, "ddl_init_std_factor", "0.0"),
        ({"qk_norm_position": "middle"}, "qk_norm_position", "'middle'"),
    ],
)
def test_invalid_values_are_rejected_with_field_value_and_allowed(kwargs, field, received):
    with pytest.raises(StrictDataclassError) as info:
        DDLConfig(**kwargs)
    message = str(info.value.__cause__)
    assert isinstance(info.value.__cause__, ValueError)
    assert f"DDLConfig.{field} must be" in message and f"got {received}" in message


def test_wrong_types_are_rejected():
    with pytest.raises(StrictDataclassError):
        DDLConfig(ddl_value_channels="four")


def test_boundary_beta_init_values_are_allowed():
    for beta in (0.0, 2.0):
        assert DDLConfig(ddl_beta_init=beta).ddl_beta_init == beta


def test_implementation_is_a_runtime_choice_not_saved(tmp_path, monkeypatch):
    """`ddl_implementation` chooses the kernels on this machine (like attn_implementation): never written to
    config.json, so a checkpoint does not pin another machine's; unset, the dispatcher's default runs (the
    environment's `DDL_IMPLEMENTATION`, else "auto"), and a name it does not know is one error naming the choices."""
    monkeypatch.delenv("DDL_IMPLEMENTATION", raising=False)
    config = DDLConfig(ddl_implementation="reference")
    assert config.ddl_implementation == "reference" and "ddl_implementation" not in config.to_dict()
    config.save_pretrained(tmp_path)
    assert "implementation" not in (tmp_path / "config.json").read_text()
    assert DDLConfig.from_pretrained(tmp_path).ddl_implementation is None and ops.choose(None) == "auto"
    assert DDLConfig.from_pretrained(tmp_path, ddl_implementation="torch").ddl_implementation == "torch"
    monkeypatch.setenv("DDL_IMPLEMENTATION", "torch")
    assert ops.choose(DDLConfig.from_pretrained(tmp_path).ddl_implementation) == "torch"
    assert ops.choose("auto") == "auto"  # an explicit choice wins
    monkeypatch.setenv("DDL_IMPLEMENTATION", "fast")
    with pytest.raises(ValueError, match="DDL_IMPLEMENTATION='fast' must be one of"):
        ops.choose(None)
    model = DDLModel(DDLConfig(ddl_implementation="cuda", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                               intermediate_size=64))
    with pytest.raises(ValueError, match="ddl_implementation='cuda' must be one of"):
        model(torch.tensor([[1, 2]]))


def test_checkpoints_saved_with_the_old_ddl_impl_field_load(tmp_path, monkeypatch):
    """config.json files written before the implementation became a runtime choice carry `ddl_impl`."""
    import json

    monkeypatch.delenv("DDL_IMPLEMENTATION", raising=False)
    DDLConfig().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    for legacy, expected in (("fused", "auto"), ("reference", "reference")):
        path.write_text(json.dumps({**json.loads(path.read_text()), "ddl_impl": legacy}))
        config = DDLConfig.from_pretrained(tmp_path)
        assert ops.choose(config.ddl_implementation) == expected and "ddl_impl" not in config.to_dict()


# The authors' parameter counts (their model files at d1f76215: the modules each variant creates), small = 12 x 768,
# 6 heads of 128, MLP 2048; medium = 24 x 1024, 8 heads of 128, MLP 2730; vocabulary 50304, tied, QK-norm.
AUTHORS_PARAMETERS = {
    "small": {"baseline": 123_590_400, "dv1": 123_627_312, "cc-ec": 123_734_956, "cc": 123_722_668,
              "tc-ec": 123_854_764, "tc": 123_842_476},
    "medium": {"baseline": 353_508_352, "dv1": 353_606_752, "cc-ec": 353_873_236, "cc": 353_856_852,
               "tc-ec": 354_180_436, "tc": 354_164_052},
}
VARIANT_FIELDS = {
    "baseline": {"ddl_residual": "additive", "ddl_value_channels": 1}, "dv1": {"ddl_value_channels": 1},
    "cc-ec": {}, "cc": {"ddl_embed_conv": False}, "tc-ec": {"ddl_compressor": "tc"},
    "tc": {"ddl_compressor": "tc", "ddl_embed_conv": False},
}


@pytest.mark.parametrize("size", ["small", "medium"])
def test_presets_and_backbone_fields_alone_give_the_authors_parameter_counts(size):
    import torch

    from ddl import DDLForCausalLM
    from ddl_tools.presets import preset_config

    backbone = {"small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=6, intermediate_size=2048),
                "medium": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
                               intermediate_size=2730)}[size]
    for variant, fields in VARIANT_FIELDS.items():
        configs = [DDLConfig(vocab_size=50304, head_dim=128, tie_word_embeddings=True, qk_norm=True, rms_norm_eps=1e-5,
                             **backbone, **fields),
                   preset_config(size, 50304, fields)]
        for config in configs:
            with torch.device("meta"):
                count = DDLForCausalLM(config).num_parameters()
            assert count == AUTHORS_PARAMETERS[size][variant], (variant, count)
    assert preset_config(size, 50304).rms_norm_eps == 1e-5


@pytest.mark.parametrize("variant", ["tc", "cc"])
def test_checkpoints_saved_before_the_authors_defaults_load_with_their_own_choices(variant):
    """Fixtures saved by ddl d2b2eaf (trained-looking weights, a TC one with QK-norm and a two-layer gate): their
    config.json has none of the new fields; they load with ddl's earlier choices and give the logits they gave."""
    import json
    from pathlib import Path

    import torch

    from ddl import DDLForCausalLM
    from ddl.configuration_ddl import LEGACY_DEFAULTS

    folder = Path(__file__).parent / "fixtures" / f"ddl-{variant}-before-authors-defaults"
    assert "ddl_shared_compressor" not in json.loads((folder / "config.json").read_text())
    model = DDLForCausalLM.from_pretrained(folder)  # (strict: a missing or unexpected weight would raise or warn)
    for field, value in LEGACY_DEFAULTS.items():
        assert getattr(model.config, field) == value
    assert hasattr(model.model.layers[0], "attn_compress") and not hasattr(model.model.layers[0], "compress")
    expected = json.loads((folder / "expected.json").read_text())
    with torch.no_grad():
        logits = model(torch.tensor(expected["input_ids"])).logits
    torch.testing.assert_close(logits, torch.tensor(expected["logits"]), rtol=0, atol=1e-5)
    # saved again, it keeps those choices explicitly, and a new config is not mistaken for an old one
    assert DDLConfig.from_dict(model.config.to_dict()).ddl_shared_compressor is False
    assert DDLConfig.from_dict(DDLConfig().to_dict()).ddl_shared_compressor is True
