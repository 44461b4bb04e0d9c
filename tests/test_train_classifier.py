"""train_classifier.py and what it stands on: the genre task from the bundled corpus, the project's own `evaluate`
modules (metrics/), a fine-tuning run end to end at tiny size, and one-line errors for bad input."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, run_cli, tiny_config


SCRIPT = os.path.join(ROOT, "train_classifier.py")
TINY_MODEL = "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=2,head_dim=16"
TINY_RUN = ["--max_train_samples", "48", "--max_eval_samples", "24", "--max_steps", "3", "--max_length", "64",
            "--per_device_train_batch_size", "8", "--use_cpu", "--dataloader_num_workers", "0"]


# ------------------------------------------------------------------------------------------------- the task


def test_genre_task_holds_out_whole_plays_of_every_genre():
    from ddl_tools.tasks import FOLIO_GENRES, GENRE_EVAL_WORKS, GENRE_LABELS, genre_splits

    splits = genre_splits(max_chars=400)
    train_works, eval_works = set(splits["train"]["work"]), set(splits["validation"]["work"])
    assert eval_works == set(GENRE_EVAL_WORKS) and not train_works & eval_works
    assert train_works | eval_works == set(FOLIO_GENRES)
    for split in splits.values():
        assert set(split["label"]) == {0, 1, 2}
        assert all(GENRE_LABELS[label] == FOLIO_GENRES[work] for label, work in zip(split["label"], split["work"]))
        assert all(0 < len(text) <= 400 for text in split["text"])
    assert "HAMLET." in "".join(t for t, w in zip(splits["validation"]["text"], splits["validation"]["work"])
                                if w == "hamlet")


def test_passages_keep_whole_speeches_when_they_fit():
    from ddl_tools.tasks import split_passages

    text = "A.\nOne two.\n\nB.\nThree four five.\n\nC.\n" + "x\n" * 40
    passages = split_passages(text, max_chars=40)
    assert passages[0] == "A.\nOne two.\n\nB.\nThree four five."  # two speeches fit in 40 characters
    assert all(len(p) <= 40 for p in passages) and "".join(passages).count("x") == 40  # a long one is cut at lines


# ---------------------------------------------------------------------------------------- the metric modules


@pytest.fixture(scope="module")
def metrics():
    import evaluate

    return {name: evaluate.load(os.path.join(ROOT, "metrics", name)) for name in ("accuracy", "f1")}


def test_metric_modules_agree_with_scikit_learn(metrics):
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    predictions, references = rng.integers(0, 4, 200), rng.integers(0, 4, 200)
    weights = rng.random(200)
    for kwargs in ({}, {"sample_weight": weights}):
        got = metrics["accuracy"].compute(predictions=predictions, references=references, **kwargs)["accuracy"]
        assert got == pytest.approx(sklearn_metrics.accuracy_score(references, predictions, **kwargs))
        for average in ("micro", "macro", "weighted", None):
            got = metrics["f1"].compute(predictions=predictions, references=references, average=average, **kwargs)
            expected = sklearn_metrics.f1_score(references, predictions, average=average, **kwargs)
            np.testing.assert_allclose(got["f1"], expected, rtol=1e-12)
    binary_p, binary_r = predictions % 2, references % 2
    got = metrics["f1"].compute(predictions=binary_p, references=binary_r, pos_label=0)["f1"]
    assert got == pytest.approx(sklearn_metrics.f1_score(binary_r, binary_p, pos_label=0))


def test_metric_modules_by_hand(metrics):
    assert metrics["accuracy"].compute(predictions=[0, 1, 2, 1], references=[0, 2, 2, 1]) == {"accuracy": 0.75}
    assert metrics["accuracy"].compute(predictions=[0, 1], references=[0, 0], normalize=False) == {"accuracy": 1.0}
    # per label: 0 -> 2*1/(2+0+0) = 1; 1 -> 2*1/(2+1+0) = 2/3; 2 -> 2*1/(2+0+1) = 2/3
    got = metrics["f1"].compute(predictions=[0, 1, 2, 1], references=[0, 2, 2, 1], average=None)["f1"]
    np.testing.assert_allclose(got, [1, 2 / 3, 2 / 3])
    with pytest.raises(ValueError, match="at most two labels"):
        metrics["f1"].compute(predictions=[0, 1, 2], references=[0, 1, 2])  # binary is the default
    with pytest.raises(ValueError, match="average must be one of"):
        metrics["f1"].compute(predictions=[0, 1], references=[0, 1], average="samples")


def test_metric_modules_load_offline_where_the_hubs_do_not(tmp_path):
    """With an empty HF cache and the Hub offline, `evaluate.load("accuracy")` fails and the shipped module loads."""
    shipped = os.path.join(ROOT, "metrics", "accuracy")
    script = (
        "import evaluate, sys\n"
        f"print(evaluate.load({shipped!r}).compute(predictions=[1], references=[1]))\n"
        "try:\n    evaluate.load('accuracy')\nexcept Exception as err:\n    print('hub module:', type(err).__name__)\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "{'accuracy': 1.0}" in proc.stdout and "hub module:" in proc.stdout, proc.stdout


# -------------------------------------------------------------------------------------------- end to end


def run_script(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, SCRIPT, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _eval_passages(seed=42, limit=24):
    from datasets import Dataset

    from ddl_tools.tasks import genre_splits

    return Dataset.from_dict(genre_splits()["validation"]).shuffle(seed=seed).select(range(limit))


def test_fresh_classifier_end_to_end(tmp_path):
    """From another folder (the metrics resolve next to the script): trains, scores with the shipped modules, saves
    a classifier that loads by remote code, and the accuracy it reports is that classifier's on those passages."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "clf"
    proc = run_script("--output_dir", str(out), "--config_overrides", TINY_MODEL, "--vocab_size", "300", *TINY_RUN,
                      cwd=tmp_path)
    results = json.loads((out / "all_results.json").read_text())
    for key in ("eval_accuracy", "eval_f1_macro", "eval_majority_accuracy"):
        assert 0 <= results[key] <= 1, (key, results)
    assert "held-out plays" in proc.stdout and f"accuracy {results['eval_accuracy']:.3f}" in proc.stdout
    # no pickle (Trainer's training_args.bin runs code when loaded): the arguments as JSON; the lock let go of
    assert not (out / "training_args.bin").exists() and (out / "training_args.json").is_file()
    assert not (out / ".ddl.lock").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DDLForSequenceClassification"]
    assert config["id2label"] == {"0": "comedy", "1": "history", "2": "tragedy"}
    assert config["auto_map"]["AutoModelForSequenceClassification"] == "modeling_ddl.DDLForSequenceClassification"

    model = AutoModelForSequenceClassification.from_pretrained(out, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    passages = _eval_passages()
    batch = tokenizer(list(passages["text"]), truncation=True, max_length=64, padding=True, return_tensors="pt")
    with torch.no_grad():
        predictions = model(**batch).logits.argmax(-1).numpy()
    labels = np.array(passages["label"])
    assert results["eval_accuracy"] == pytest.approx(float(np.mean(predictions == labels)))
    assert results["eval_majority_accuracy"] == pytest.approx(np.bincount(labels).max() / len(labels))


def test_fine_tunes_a_causal_lm_checkpoint(tmp_path, tokenizer):
    """A DDL causal LM folder becomes the classifier's base model: with a learning rate of 0 its weights come through
    unchanged, and the head is new."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    lm = tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    from ddl import DDLForCausalLM

    model = DDLForCausalLM(lm)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    out = tmp_path / "clf"
    run_script("--model_name_or_path", str(tmp_path / "lm"), "--output_dir", str(out), "--learning_rate", "0",
               *TINY_RUN, cwd=tmp_path)
    saved = load_file(out / "model.safetensors")
    for name, value in model.state_dict().items():
        if name.startswith("model."):
            torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)
    assert saved["score.weight"].shape == (3, lm.hidden_size)
    results = json.loads((out / "all_results.json").read_text())
    assert 0 <= results["eval_accuracy"] <= 1


# ----------------------------------------------------------------------------------------------- bad input


BAD_INPUTS = {
    "missing-checkpoint": (["--model_name_or_path", "{tmp}/nope"], "cannot read a model config"),
    "not-ddl-checkpoint": (["--model_name_or_path", "{llama}"], "not DDL"),
    "non-empty-output": (["--output_dir", "{nonempty}"], "refusing to overwrite"),
    "bad-override-field": (["--config_overrides", "hiden_size=64"], "not a DDLConfig field"),
    "bad-override-value": (["--config_overrides", "ddl_residual=additve"], "ddl_residual must be one of"),
    "overrides-on-checkpoint": (["--model_name_or_path", "{lm}", "--config_overrides", "qk_norm=true"],
                                "keeps its own architecture"),
    "passages-too-short": (["--max_chars", "10"], "max_chars must be at least 50"),
    "no-samples": (["--max_train_samples", "0"], "must be a positive integer"),
    "unknown-preset": (["--preset", "huge"], "invalid choice"),
    # these were tracebacks (DataLoader, AdamW, TrainingArguments, safetensors, a size-mismatch report)
    "no-batch": (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0: must be at least 1"),
    "negative-learning-rate": (["--learning_rate", "-1"], "--learning_rate -1.0: must be a number >= 0"),
    "negative-warmup": (["--warmup_steps", "-1"], "warmup_steps >= 0"),
    "truncated-checkpoint": (["--model_name_or_path", "{truncated}"], "model.safetensors is cut short"),
    "misshapen-checkpoint": (["--model_name_or_path", "{misshapen}"], "its weights do not fit its config.json"),
    # (Trainer's flag was accepted and ignored: the run started over from the pretrained model)
    "resume": (["--resume_from_checkpoint", "{tmp}/out/checkpoint-2"], "--resume_from_checkpoint: a "
               "train_classifier.py run is not resumed"),
}


@pytest.fixture
def bad_input_args(tmp_path, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    from ddl import DDLForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=99, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "llama")
    DDLForCausalLM(tiny_config(vocab_size=len(tokenizer))).save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "keep.txt").write_text("precious")
    # a checkpoint cut short by a full disk, and one whose config.json is not its weights' own (hidden 64, not 32)
    truncated, misshapen = shutil.copytree(tmp_path / "lm", tmp_path / "truncated"), tmp_path / "misshapen"
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    shutil.copytree(tmp_path / "lm", misshapen)
    config = json.loads((misshapen / "config.json").read_text())
    (misshapen / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))
    fill = dict(tmp=tmp_path, llama=tmp_path / "llama", lm=tmp_path / "lm", nonempty=tmp_path / "nonempty",
                truncated=truncated, misshapen=misshapen)

    def make(case):
        args, message = BAD_INPUTS[case]
        base = ["--output_dir", str(tmp_path / "out"), "--config_overrides", TINY_MODEL, *TINY_RUN]
        if "--model_name_or_path" in args and "--config_overrides" not in args:
            base = base[:2] + base[4:]  # a checkpoint run takes no --config_overrides
        return base + [a.format(**fill) for a in args], message  # later flags win

    yield make
    assert (tmp_path / "nonempty" / "keep.txt").read_text() == "precious"
    assert not (tmp_path / "out").exists()  # nothing was written


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line(case, bad_input_args, capsys):
    """In process (`train_classifier.cli` is what the script runs): exit status 2, one error line, no traceback."""
    import train_classifier

    args, message = bad_input_args(case)
    status, err = run_cli(train_classifier.cli, args, capsys)
    assert status == 2
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and message in lines[0], err[-3000:]
    assert "Traceback" not in err


@pytest.mark.parametrize("variable", ["DDL_IMPLEMENTATION", "DDL_CPU_KERNEL"])
def test_an_invalid_ddl_environment_variable_is_one_line(variable, tmp_path, capsys, monkeypatch):
    """It used to be a ValueError traceback once the model ran."""
    import train_classifier

    monkeypatch.setenv(variable, "fastest")
    status, err = run_cli(train_classifier.cli, ["--output_dir", str(tmp_path / "out"), "--config_overrides",
                                                 TINY_MODEL, *TINY_RUN], capsys)
    assert status == 2 and f"{variable}='fastest'" in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "out").exists()


def test_ctrl_c_is_one_line(tmp_path, capsys, monkeypatch):
    """Ctrl-C in training was a KeyboardInterrupt traceback (train.py's is one line); the folder it created and left
    empty is removed."""
    import train_classifier
    from transformers import Trainer

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "train", interrupted)
    status, err = run_cli(train_classifier.cli, ["--output_dir", str(tmp_path / "out"), "--config_overrides",
                                                 TINY_MODEL, *TINY_RUN], capsys)
    assert status == 130 and "train_classifier.py: interrupted; rerun" in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ the output folder


def test_a_second_run_into_a_folder_being_written_is_refused(tmp_path, capsys):
    """Two runs into one folder both exited 0 and printed "saved", and one result survived: the script took no lock.
    While a run holds the folder's lock, another run into it stops with one line naming the writer, with
    --overwrite_output_dir too, and leaves the folder as it was."""
    import train_classifier
    from ddl_tools.outputs import FolderLock

    out = tmp_path / "clf"
    out.mkdir()
    lock = FolderLock(str(out))  # another open file: flock treats it as another writer, as another process
    assert lock.acquire()
    try:
        for extra in (["--overwrite_output_dir"], []):  # (with it, the second run used to write there too)
            status, err = run_cli(train_classifier.cli, ["--output_dir", str(out), "--config_overrides", TINY_MODEL,
                                                         *TINY_RUN, *extra], capsys)
            assert status == 2 and f"is being written by another run (pid {os.getpid()})" in err, err[-2000:]
            assert os.listdir(out) == [".ddl.lock"]
    finally:
        lock.release()


def test_a_full_disk_at_the_save_is_one_line(tmp_path, capsys, monkeypatch):
    """The disk fills up while the classifier is saved: one line naming the folder and what to do, not a traceback;
    the run's results are not written as if it had succeeded."""
    import errno

    import train_classifier
    from ddl import DDLForSequenceClassification

    def full_disk(self, folder, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(folder, "model.safetensors"))

    monkeypatch.setattr(DDLForSequenceClassification, "save_pretrained", full_disk)
    out = tmp_path / "clf"
    status, err = run_cli(train_classifier.cli, ["--output_dir", str(out), "--config_overrides", TINY_MODEL,
                                                 "--vocab_size", "300", *TINY_RUN], capsys)
    assert status == 2 and "Traceback" not in err, err[-3000:]
    line = next(line for line in err.splitlines() if "error:" in line)
    assert f"saving the classifier into {str(out)!r} failed ([Errno 28] No space left on device" in line
    assert "--overwrite_output_dir" in line
    assert not (out / "all_results.json").exists() and not (out / ".ddl.lock").exists()
