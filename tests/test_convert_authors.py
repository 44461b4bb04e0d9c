"""`python -m ddl_tools.convert_authors`: the authors' own checkpoints as DDL folders, exact or refused.

The fixtures (tests/fixtures/authors, made by their code: make_fixtures.py there) hold, per variant of their five
`model/DDL-*.py` files, their weights and config and what their model computed: fp32 logits, the loss of one training
step, every gradient's norm and the loss after one SGD step. A converted folder must give the same; anything that
cannot be converted exactly is one line on stderr, exit status 2, and nothing written.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT
from ddl import DDLForCausalLM
from ddl_tools import convert_authors
from ddl_tools.convert_authors import main, read_authors


FIXTURES = os.path.join(ROOT, "tests", "fixtures", "authors")
# Their five files at their defaults, then every mapped option at a non-default value, then a nanoGPT ckpt.pt.
VARIANTS = ["vdim1", "cc", "cc-ec", "tc", "tc-ec", "vdim1-options", "cc-ec-options", "tc-options", "tc-ec-ckpt"]
EXPECTED = {"tc-ec-ckpt": "tc-ec"}  # (the same weights)


def expected(variant):
    folder = os.path.join(FIXTURES, EXPECTED.get(variant, variant))
    with open(os.path.join(folder, "expected.json")) as f:
        return load_file(os.path.join(folder, "expected.safetensors")), json.load(f)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """variant -> its converted folder (converted once per module)."""
    root, done = tmp_path_factory.mktemp("converted"), {}

    def get(variant):
        if variant not in done:
            assert main([os.path.join(FIXTURES, variant), str(root / variant)]) == 0
            done[variant] = str(root / variant)
        return done[variant]

    return get


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_a_training_step_equal_the_authors_model(variant, converted):
    tensors, numbers = expected(variant)
    ids = tensors["input_ids"]
    model = DDLForCausalLM.from_pretrained(converted(variant))
    assert model.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tensors["logits"], atol=1e-5, rtol=0)

    model.train()  # their loss: every next token of the batch (their targets end in -1), as ddl's shifted labels
    loss = model(ids, labels=ids).loss
    torch.testing.assert_close(loss.item(), numbers["loss"], atol=1e-5, rtol=0)
    loss.backward()
    names = read_authors(os.path.join(FIXTURES, variant)).names
    params = dict(model.named_parameters())
    for theirs, norm in numbers["grad_norms"].items():
        torch.testing.assert_close(params[names[theirs]].grad.norm().item(), norm, atol=1e-6, rtol=1e-4,
                                   msg=lambda m, theirs=theirs: f"{theirs}: {m}")
    assert len(numbers["grad_norms"]) == len(params)  # every parameter compared (the LM head is the embedding)
    with torch.no_grad():
        for param in model.parameters():
            param.sub_(numbers["sgd_lr"] * param.grad)
        after = model(ids, labels=ids).loss.item()
    torch.testing.assert_close(after, numbers["loss_after_sgd_step"], atol=1e-5, rtol=0)


def test_the_folder_loads_with_the_auto_class_and_its_own_code(converted, tmp_path, monkeypatch):
    """(test_remote_code.py runs such a folder's code in a process that cannot import ddl.)"""
    import transformers.dynamic_module_utils
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [n for n in sys.modules if n.split(".")[0] == "transformers_modules"]:
        monkeypatch.delitem(sys.modules, name)
    tensors, folder = expected("cc-ec")[0], converted("cc-ec")
    assert {"configuration_ddl.py", "modeling_ddl.py"} <= set(os.listdir(folder))  # (the code its auto_map names)
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["auto_map"]["AutoModelForCausalLM"] == "modeling_ddl.DDLForCausalLM"
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(model(tensors["input_ids"]).logits, tensors["logits"], atol=1e-5, rtol=0)


def test_the_command_converts_a_compiled_models_ckpt_pt(tmp_path):
    out = tmp_path / "ddl"
    proc = subprocess.run([sys.executable, "-m", "ddl_tools.convert_authors",
                           os.path.join(FIXTURES, "tc-ec-ckpt", "ckpt.pt"), str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "DDL tc-ec" in proc.stdout and "tokenizer: none found" in proc.stdout
    assert {"config.json", "model.safetensors", "generation_config.json"} <= set(os.listdir(out))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "ddl" and config["ddl_compressor"] == "tc" and config["ddl_embed_conv"]
    assert sorted(os.listdir(tmp_path)) == ["ddl"]  # (no temporary folder left beside it)


def test_a_tokenizer_and_the_special_tokens_come_along(tmp_path):
    src = _copy(tmp_path, "vdim1", config={"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    (src / "tokenizer.json").write_text("{}")
    (src / "tokenizer_config.json").write_text("{}")
    assert main([str(src), str(tmp_path / "out")]) == 0
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config.get("pad_token_id")) == (1, 2, None)
    assert generation["pad_token_id"] == 0  # (for generate; a model field would freeze that embedding row)


# -------------------------------------------------------------------------------------------- refusals


def _copy(tmp_path, variant="cc-ec", config=None, tensors=None):
    """A copy of a fixture with its config changed by `config` (None: a field removed) and its tensors by `tensors`
    (a function of the state dict)."""
    src = tmp_path / "src"
    shutil.copytree(os.path.join(FIXTURES, variant), src)
    if config:
        path = src / "config.json"
        values = {**json.loads(path.read_text()), **config}
        path.write_text(json.dumps({k: v for k, v in values.items() if v is not None or k not in config}))
    if tensors:
        state = tensors(load_file(src / "model.safetensors"))
        save_file(state, src / "model.safetensors")
    return src


def _refused(tmp_path, capsys, src, *names):
    """Converting `src` is one line on stderr naming each of `names`, exit 2, and nothing written."""
    before = sorted(os.listdir(tmp_path))
    assert main([str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m ddl_tools.convert_authors: error: "), err
    for name in names:
        assert name in err, err
    assert sorted(os.listdir(tmp_path)) == before  # no OUTPUT_DIR, no temporary sibling
    return err


@pytest.mark.parametrize("field, value", [
    ("use_output_gate", True), ("use_k_shift", True), ("use_v_shift", True), ("using_groupnorm", True),
    ("q_activation", "silu"), ("rope_ratio", 0.5), ("mup", True), ("ddl_state_dv_shortconv_causal", True),
])
def test_an_option_ddl_cannot_compute_is_refused(field, value, tmp_path, capsys):
    err = _refused(tmp_path, capsys, _copy(tmp_path, config={field: value}), f"{field}={value!r}")
    assert "cannot be converted" in err


@pytest.mark.parametrize("config, names", [
    ({"residual_branch_mult": 2.0}, ["residual_branch_mult", "unknown"]),  # (an option of theirs ddl lacks, unknown)
    ({"model_type": "gpt2"}, ["model_type='gpt2'"]),
    ({"ddl_value_channels": 2}, ["ddl_value_channels=2"]),  # (the weights are d_v = 4)
    ({"ddl_state_shortconv_kernel_size": 2}, ["ddl_state_shortconv_kernel_size=2"]),  # (their CC: kernel = d_v only)
    ({"hidden_size": 24}, ["shape"]),
    ({"ddl_beta_single_linear": False}, ["missing", "beta_in.weight"]),
], ids=["unknown-field", "model-type", "d_v", "cc-kernel", "hidden-size", "gate"])
def test_a_config_that_does_not_describe_the_weights_is_refused(config, names, tmp_path, capsys):
    _refused(tmp_path, capsys, _copy(tmp_path, config=config), *names)


def test_a_field_of_another_variant_is_refused_unless_at_its_default(tmp_path, capsys):
    src = _copy(tmp_path, "cc", config={"input_embed_shortconv_kernel_size": 4})  # (CC without EC ignores it)
    assert main([str(src), str(tmp_path / "out")]) == 0
    shutil.rmtree(tmp_path / "out")
    src = _copy(tmp_path / "again", "cc", config={"input_embed_shortconv_kernel_size": 2})
    _refused(tmp_path / "again", capsys, src, "input_embed_shortconv_kernel_size=2", "another variant")


@pytest.mark.parametrize("change, names", [
    (lambda s: {k: v for k, v in s.items() if k != "transformer.h.1.ddl_mlp.v_proj.bias"},
     ["missing", "transformer.h.1.ddl_mlp.v_proj.bias"]),
    (lambda s: {**s, "transformer.h.0.attn.g_proj.weight": torch.zeros(24, 16)},
     ["transformer.h.0.attn.g_proj.weight", "not part of the model"]),
    (lambda s: {**s, "lm_head.weight": s["transformer.wte.weight"] + 1}, ["lm_head.weight", "ties"]),
    (lambda s: {k: v for k, v in s.items() if k != "transformer.h.0.compress.weight"}, ["compressor"]),
], ids=["missing", "extra", "untied-head", "no-compressor"])
def test_a_wrong_checkpoint_is_refused(change, names, tmp_path, capsys):
    _refused(tmp_path, capsys, _copy(tmp_path, tensors=change), *names)


def test_a_llama_folder_is_refused(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "llama")
    capsys.readouterr()
    _refused(tmp_path, capsys, tmp_path / "llama", "model_type='llama'", "init_from_llama")


def test_a_llama_config_on_their_weights_is_refused(tmp_path, capsys):
    _refused(tmp_path, capsys, _copy(tmp_path, config={"model_type": "llama"}), "model_type='llama'", "init_from_llama")


def test_a_pickle_holding_more_than_tensors_is_not_unpickled(tmp_path, capsys):
    import argparse

    state = load_file(os.path.join(FIXTURES, "cc", "model.safetensors"))
    torch.save({"model": state, "model_args": {}, "config": argparse.Namespace(lr=1)}, tmp_path / "ckpt.pt")
    _refused(tmp_path, capsys, tmp_path / "ckpt.pt", "weights_only=True", "never unpickles code")


def test_an_unreadable_or_ambiguous_source_is_refused(tmp_path, capsys):
    _refused(tmp_path, capsys, tmp_path / "nowhere", "does not exist")
    both = _copy(tmp_path / "both", "cc")
    shutil.copy(os.path.join(FIXTURES, "vdim1-options", "pytorch_model.bin"), both)
    _refused(tmp_path / "both", capsys, both, "model.safetensors and pytorch_model.bin")
    (tmp_path / "torn").mkdir()
    shutil.copy(os.path.join(FIXTURES, "cc", "config.json"), tmp_path / "torn")
    (tmp_path / "torn" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    _refused(tmp_path, capsys, tmp_path / "torn", "safetensors")


def test_the_output_folder_is_never_half_written_nor_silently_replaced(tmp_path, capsys, monkeypatch):
    src, out = os.path.join(FIXTURES, "cc"), tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert main([src, str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err and os.listdir(out) == ["mine.txt"]

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(convert_authors, "_verify", broken)  # (a failure after the files were written)
    with pytest.raises(RuntimeError, match="disk full"):
        main([src, str(out), "--overwrite"])
    assert os.listdir(out) == ["mine.txt"] and sorted(os.listdir(tmp_path)) == ["out"]
    monkeypatch.undo()
    assert main([src, str(out), "--overwrite"]) == 0
    assert "mine.txt" not in os.listdir(out) and sorted(os.listdir(tmp_path)) == ["out"]
    assert main([src, str(tmp_path / "new")]) == 0 and main([src, src]) == 2  # (and never into SRC)


# -------------------------------------------------------------------------------------------- the mapping matters


@pytest.mark.parametrize("variant, mutate", [
    ("tc-ec", lambda: setattr(convert_authors, "_taps", lambda w, d, dv: w.reshape(d, dv, w.shape[-1])
                              .flip(-1).permute(2, 0, 1).contiguous())),  # (the token taps in reverse order)
    ("cc", lambda: setattr(convert_authors, "_compressor_plan", _flipped_cc_taps)),
], ids=["tc-taps-reversed", "cc-taps-reversed"])
def test_a_wrong_mapping_does_not_pass(variant, mutate, tmp_path, monkeypatch):
    """The fixtures tell a right mapping from a wrong one (the taps are all different: no symmetric start)."""
    monkeypatch.setattr(convert_authors, "_taps", convert_authors._taps)
    monkeypatch.setattr(convert_authors, "_compressor_plan", convert_authors._compressor_plan)
    mutate()
    assert main([os.path.join(FIXTURES, variant), str(tmp_path / "out")]) == 0
    tensors, _ = expected(variant)
    with torch.no_grad():
        logits = DDLForCausalLM.from_pretrained(tmp_path / "out")(tensors["input_ids"]).logits
    assert (logits - tensors["logits"]).abs().max() > 1e-2


_compressor_plan = convert_authors._compressor_plan


def _flipped_cc_taps(src, dst, variant, d, dv, kernel):
    plan = _compressor_plan(src, dst, variant, d, dv, kernel)
    return [(name, shape, target, (lambda w: w.flip(-1)) if name.endswith(".weight") else transform)
            for name, shape, target, transform in plan]
