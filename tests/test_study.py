"""study.py / ddl.study: the grid, resume bookkeeping, statistics on made-up numbers, and the report writer."""

import json
import math
import os
import sys

import pytest

from ddl_tools import study


# ------------------------------------------------------------------------------------------------------ grid


def test_default_grid_is_six_variants_by_three_seeds_seed_major():
    grid = study.build_grid(study.DEFAULT_VARIANTS, study.DEFAULT_SEEDS)
    assert len(grid) == 18
    assert [s.name for s in grid[:6]] == [f"{v}-s0" for v in study.DEFAULT_VARIANTS]
    assert {s.seed for s in grid[6:12]} == {1}
    assert study.DEFAULT_VARIANTS[0] == study.BASELINE == "additive-dv1"


@pytest.mark.parametrize("name, flags", [
    ("additive-dv1", {"ddl_residual": "additive", "ddl_value_channels": 1}),
    ("write_only-dv1", {"ddl_residual": "write_only", "ddl_value_channels": 1}),
    ("delta-dv4-cc-ec", {"ddl_residual": "delta", "ddl_value_channels": 4, "ddl_compressor": "cc",
                         "ddl_embed_conv": True}),
    ("additive-dv4-tc", {"ddl_residual": "additive", "ddl_value_channels": 4, "ddl_compressor": "tc",
                         "ddl_embed_conv": False}),
])
def test_variant_flags(name, flags):
    assert study.variant_flags(name) == flags


@pytest.mark.parametrize("name, message", [
    ("llama", "Unknown variant"), ("delta-dv1-cc", "d_v=1 has no compressor"), ("delta-dv4", "needs a compressor"),
    ("delta-dv0", "d_v must be"),
])
def test_bad_variant_names_are_explained(name, message):
    with pytest.raises(ValueError, match=message):
        study.variant_flags(name)


def test_bad_grids_are_refused():
    with pytest.raises(ValueError, match="at least one seed"):
        study.build_grid(["additive-dv1"], [])
    with pytest.raises(ValueError, match="at least one variant"):
        study.build_grid([], [0])
    with pytest.raises(ValueError, match="more than once"):
        study.build_grid(["delta-dv1", "delta-dv1"], [0])
    with pytest.raises(ValueError, match="Unknown variant"):
        study.build_grid(["additive-dv1", "deltanet"], [0])


def test_token_budget_gives_equal_steps():
    assert study.steps_for_tokens(1_048_576, 16 * 256) == 256
    assert study.steps_for_tokens(1_000_000, 16 * 256) == 245  # rounded up
    with pytest.raises(ValueError):
        study.steps_for_tokens(0, 4096)


def test_train_command_passes_the_variant_seed_and_budget(tmp_path):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import study as script

    settings, args = script.parse_args(["--quick", "--study_dir", str(tmp_path), "--", "--learning_rate", "3e-4"])
    assert settings.seeds == [0] and len(settings.variants) == 6 and args.report_dir == str(tmp_path / "report")
    cmd = script.train_command(settings, "delta-dv4-cc-ec", 7, "out", "stats.json", "tok")
    flags = dict(zip(cmd[4::2], cmd[5::2]))
    assert cmd[2:4] == ["_train_child", "stats.json"]
    assert flags["--seed"] == "7" and flags["--max_steps"] == str(settings.max_steps) == "16"
    assert flags["--ddl_residual"] == "delta" and flags["--ddl_value_channels"] == "4"
    assert flags["--ddl_embed_conv"] == "true" and flags["--tokenizer_name"] == "tok"
    assert flags["--overwrite_output_dir"] == "true" and flags["--report_to"] == "none"
    assert cmd[-2:] == ["--learning_rate", "3e-4"]
    full, _ = script.parse_args([])
    assert full.max_steps == 256 and full.seeds == [0, 1, 2] and full.max_tokens == 1_048_576


def first_batches(variant, seed, tmp_path, n=4):
    """The training batches train.py's Trainer would feed, in train.py's order: seed, build the model (which draws
    a variant-dependent amount of randomness), then the trainer."""
    import torch
    from datasets import Dataset
    from transformers import TrainingArguments, default_data_collator, set_seed

    from conftest import tiny_config
    from ddl import DDLForCausalLM
    from ddl_tools.training import DDLTrainer

    set_seed(seed)
    model = DDLForCausalLM(tiny_config(**study.variant_flags(variant)))
    rows = Dataset.from_dict({"input_ids": [[i, i + 1] for i in range(64)], "labels": [[i, i + 1] for i in range(64)]})
    args = TrainingArguments(output_dir=str(tmp_path / f"{variant}-{seed}"), seed=seed, per_device_train_batch_size=4,
                             report_to="none", use_cpu=True)
    trainer = DDLTrainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator)
    torch.randn(1000 if "dv4" in variant else 3)  # more draws between the trainer and the loader change nothing
    loader = iter(trainer.get_train_dataloader())
    return [next(loader)["input_ids"][:, 0].tolist() for _ in range(n)]


def test_data_order_depends_only_on_the_seed(tmp_path):
    """The study compares variants on the same batches in the same order: a claim about Trainer and accelerate's
    seedable sampler (seeded from the run's --seed, not from the model's draws) that this test pins down."""
    base = first_batches("additive-dv1", 0, tmp_path)
    assert first_batches("delta-dv4-cc-ec", 0, tmp_path) == base
    assert first_batches("write_only-dv1", 0, tmp_path) == base
    assert first_batches("additive-dv1", 1, tmp_path) != base  # and the seed does change the order
    assert sorted(sum(base, [])) != list(range(16))  # shuffled, not sequential


# ---------------------------------------------------------------------------------------------------- resume


def fake_result(spec):
    loss = 5.0 + 0.01 * spec.seed - (0.05 if spec.variant.startswith("delta") else 0.0)
    return {"val_loss": loss, "val_perplexity": math.exp(loss), "tokens_per_s": 1000.0, "parameters": 10,
            "tokens": 4096, "history": []}


def test_finished_runs_are_skipped(tmp_path):
    grid = study.build_grid(["additive-dv1", "delta-dv1"], [0, 1])
    calls = []

    def launch(spec, path):
        calls.append(spec.name)
        return fake_result(spec)

    first = study.run_study(str(tmp_path), grid, launch)
    assert first["done"] == [s.name for s in grid] and calls == first["done"]
    assert not any(name.endswith(".tmp") for _, _, files in os.walk(tmp_path) for name in files)
    calls.clear()
    second = study.run_study(str(tmp_path), grid, launch)
    assert calls == [] and second["skipped"] == first["done"]
    results = study.load_results(str(tmp_path))
    assert {(r["variant"], r["seed"]) for r in results} == {(s.variant, s.seed) for s in grid}


def test_crashed_run_is_redone(tmp_path):
    grid = study.build_grid(["additive-dv1", "delta-dv1"], [0])

    def crashing(spec, path):
        with open(os.path.join(path, "partial.bin"), "w") as f:
            f.write("half a checkpoint")
        if spec.variant == "delta-dv1":
            raise RuntimeError("killed")
        return fake_result(spec)

    summary = study.run_study(str(tmp_path), grid, crashing)
    assert summary["done"] == ["additive-dv1-s0"] and "delta-dv1-s0" in summary["failed"]
    crashed = study.run_dir(str(tmp_path), grid[1])
    assert study.run_status(crashed) == "crashed"

    seen = []

    def good(spec, path):
        seen.append((spec.name, os.listdir(path)))  # the crashed folder was emptied before the redo
        return fake_result(spec)

    summary = study.run_study(str(tmp_path), grid, good)
    assert seen == [("delta-dv1-s0", [])] and summary["skipped"] == ["additive-dv1-s0"]
    assert study.run_status(crashed) == "finished"


def test_a_study_folder_refuses_other_settings(tmp_path):
    folder = str(tmp_path / "s")
    study.check_study_config(folder, {"max_tokens": 100, "preset": "tiny"})
    study.check_study_config(folder, {"max_tokens": 100, "preset": "tiny"})  # same settings: resume
    with pytest.raises(ValueError, match="differs in: max_tokens"):
        study.check_study_config(folder, {"max_tokens": 200, "preset": "tiny"})
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a study folder"):
        study.check_study_config(str(other), {"max_tokens": 100})


# ------------------------------------------------------------------------------------------------ statistics


def test_summarize_mean_sample_std_and_t_interval():
    est = study.summarize([1.0, 2.0, 3.0, 4.0])
    assert est.mean == 2.5 and est.n == 4
    assert est.std == pytest.approx(math.sqrt(5 / 3))
    assert est.half_width == pytest.approx(3.182446 * math.sqrt(5 / 3) / 2, rel=1e-5)  # t_{0.975, 3}
    single = study.summarize([3.0])
    assert single.mean == 3.0 and math.isnan(single.std) and math.isnan(single.ci_low)
    with pytest.raises(ValueError):
        study.summarize([])


def test_interval_matches_scipy():
    from scipy import stats

    values = [5.31, 5.27, 5.36, 5.29]
    low, high = stats.ttest_1samp(values, 0.0).confidence_interval()
    est = study.summarize(values)
    assert (est.ci_low, est.ci_high) == (pytest.approx(low), pytest.approx(high))
    assert est.std == pytest.approx(stats.tstd(values))


def test_difference_is_paired_by_seed():
    values, base = {0: 1.0, 1: 2.0, 2: 3.5}, {0: 1.5, 1: 2.1, 2: 3.7}
    est = study.difference(values, base)
    diffs = [-0.5, -0.1, -0.2]
    mean = sum(diffs) / 3
    std = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    assert est.paired and est.mean == pytest.approx(mean) and est.std == pytest.approx(std)
    assert est.half_width == pytest.approx(4.302653 * std / math.sqrt(3), rel=1e-5)
    assert not est.excludes_zero()  # the seed-to-seed spread (1.0 -> 3.5) cancels out, the interval is still wide
    clear = study.difference({0: 4.9, 1: 5.0, 2: 5.1}, {0: 5.0, 1: 5.11, 2: 5.19})
    assert clear.paired and clear.excludes_zero() and clear.ci_high < 0


def test_difference_without_matching_seeds_is_welch():
    stats = pytest.importorskip("scipy.stats")
    a, b = {0: 1.0, 1: 1.2, 2: 1.1}, {3: 1.5, 4: 1.4, 5: 1.8, 6: 1.6}
    est = study.difference(a, b)
    assert est.paired is False and est.mean == pytest.approx(1.1 - 1.575)
    low, high = stats.ttest_ind(list(a.values()), list(b.values()), equal_var=False).confidence_interval(0.95)
    assert (est.ci_low, est.ci_high) == (pytest.approx(low), pytest.approx(high))
    assert math.isnan(study.difference({0: 1.0}, {1: 2.0}).ci_low)


# ---------------------------------------------------------------------------------------------------- report


def made_up_results(audit_rows):
    results = []
    for variant, offset in (("additive-dv1", 0.0), ("delta-dv1", -0.01), ("write_only-dv1", 0.02),
                            ("delta-dv4-cc-ec", -0.08)):
        for seed in (0, 1, 2):
            loss = 5.0 + offset + 0.03 * seed
            history = [{"step": s, "tokens": s * 4096, "train_loss": 8 - s * 0.1 + offset, "wall_s": s * (1 + offset)}
                       for s in range(1, 21)]
            results.append({
                "variant": variant, "seed": seed, "val_loss": loss, "val_perplexity": math.exp(loss), "tokens": 81920,
                "tokens_per_s": 2000.0, "parameters": 1_400_000, "peak_memory_mib": 1200.0,
                "memory_kind": "process max RSS (CPU)", "history": history,
                **({"audit": audit_rows} if seed == 0 and variant.startswith("delta") else {}),
            })
    return results


def test_report_on_made_up_results(tmp_path):
    import torch

    from conftest import tiny_config
    from ddl import DDLForCausalLM
    from ddl_tools.evaluation import audit_gates, token_windows

    torch.manual_seed(0)
    model = DDLForCausalLM(tiny_config(ddl_value_channels=1))
    rows = audit_gates(model, token_windows(torch.randint(3, 99, (64,)), 32))
    results = made_up_results(rows)
    path = study.write_report(results, str(tmp_path), {"preset": "tiny"}, order=study.DEFAULT_VARIANTS)
    text = open(path, encoding="utf-8").read()
    for png in ("loss_vs_tokens.png", "loss_vs_wallclock.png"):
        assert os.path.getsize(tmp_path / png) > 1000 and f"]({png})" in text
    assert (tmp_path / "audit" / "delta-dv1" / "audit_beta_hist.png").exists()
    assert "### `delta-dv1`" in text and "### `delta-dv4-cc-ec`" in text
    table = {}
    for line in text.splitlines():  # the results table comes first; the matched-controls table after it
        if line.startswith("| `"):
            table.setdefault(line.split("|")[1].strip(), line)
    assert "5.0300 ± 0.0300" in table["`additive-dv1`"] and "(baseline)" in table["`additive-dv1`"]
    assert "-0.0800 [-0.0800, -0.0800]" in table["`delta-dv4-cc-ec`"]  # same offset every seed: zero-width CI
    assert "1,400,000" in table["`delta-dv1`"] and "process max RSS (CPU)" in text
    assert "reaches a **lower** validation loss than additive-dv1" in text
    assert "delta-dv1 vs write_only-dv1" not in text  # exact offsets: every difference here is resolved
    assert "reaches a **lower** validation loss than write_only-dv1" in text  # matched control
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["variant"] for r in summary] == ["additive-dv1", "delta-dv1", "write_only-dv1", "delta-dv4-cc-ec"]


def test_conclusion_with_one_seed_claims_nothing():
    results = [r for r in made_up_results(None) if r["seed"] == 0]
    for r in results:
        r.pop("audit", None)
    rows = study.summary_rows(results)
    assert "single seed" in study.conclusion(rows, study.contrasts(results))


def test_conclusion_says_when_the_interval_includes_zero():
    results = made_up_results(None)
    for r in results:  # delta-dv1: +0.05, -0.05, +0.01 around the baseline, per seed
        if r["variant"] == "delta-dv1":
            r["val_loss"] = 5.0 + 0.03 * r["seed"] + (0.05, -0.05, 0.01)[r["seed"]]
    text = study.conclusion(study.summary_rows(results), [])
    assert "delta-dv1 vs additive-dv1" in text and "includes zero" in text


# ------------------------------------------------------------------------ issue 14: never lose a user's work


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def study_script():
    sys.path.insert(0, ROOT)
    import study as script

    return script


def test_study_runs_from_another_working_directory(tmp_path):
    """Relative --study_dir, data and report paths, started outside the repository: its train.py children used to
    run in the repository root, where those paths mean something else, so every run failed."""
    import random
    import subprocess

    rng = random.Random(0)
    words = ("the", "king", "queen", "lord", "lady", "crown", "sword", "night", "day", "love", "death", "fair")
    lines = [" ".join(rng.choice(words) for _ in range(8)) for _ in range(600)]
    (tmp_path / "train.txt").write_text("\n".join(lines[:500]) + "\n")
    (tmp_path / "val.txt").write_text("\n".join(lines[500:]) + "\n")
    args = ["--variants", "additive-dv1", "--seeds", "0", "--block_size", "32", "--per_device_train_batch_size", "4",
            "--max_tokens", "256", "--vocab_size", "300", "--train_file", "train.txt", "--validation_file", "val.txt",
            "--eval_tokens", "512", "--audit_tokens", "256", "--study_dir", "st", "--report_dir", "rep", "--",
            "--config_overrides",
            ("hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=2,head_dim=16")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "study.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "st" / "runs" / "additive-dv1-s0" / "result.json").read_text())
    assert result["steps"] == 2 and math.isfinite(result["val_loss"])
    assert (tmp_path / "st" / "runs" / "additive-dv1-s0" / "model" / "model.safetensors").is_file()
    assert (tmp_path / "rep" / "report.md").is_file()
    assert not os.path.exists(os.path.join(ROOT, "st"))


def test_a_killed_study_takes_its_training_child_with_it(tmp_path):
    """kill -9 of study.py used to leave its train.py child writing into a run folder that the rerun deletes."""
    import signal
    import subprocess
    import time

    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    parent = (f"import sys; sys.path.insert(0, {ROOT!r}); import study; "
              f"study.run_child([sys.executable, '-c', {child!r}], {str(tmp_path / 'log.txt')!r})")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        for _ in range(300):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for _ in range(100):
            if not _alive(pid):
                break
            time.sleep(0.1)
        assert not _alive(pid), "the child outlived the killed study.py"
    finally:
        proc.kill()
        if pid_file.exists() and pid_file.read_text() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie has ended (nobody may reap it in a container)
    except FileNotFoundError:
        return False


def test_a_rerun_does_not_delete_a_run_folder_still_being_written(tmp_path):
    """A crashed run's folder whose writer still lives (its lock held) is left alone and reported, not deleted."""
    from ddl_tools.outputs import FolderLock

    grid = study.build_grid(["additive-dv1", "delta-dv1"], [0])
    busy = study.run_dir(str(tmp_path), grid[0])
    os.makedirs(busy)
    with open(os.path.join(busy, "partial.bin"), "w") as f:
        f.write("being written")
    writer = FolderLock(busy)  # another open file: to flock, another writer
    assert writer.acquire()
    try:
        summary = study.run_study(str(tmp_path), grid, lambda spec, path: fake_result(spec))
    finally:
        writer.release()
    assert "still being written by pid" in summary["failed"]["additive-dv1-s0"]
    assert summary["done"] == ["delta-dv1-s0"]
    with open(os.path.join(busy, "partial.bin")) as f:
        assert f.read() == "being written"


def test_report_dir_with_someone_elses_report_is_refused_first(tmp_path, capsys):
    """--report_dir used to overwrite a report.md study.py did not write (here with --report_only, which reports at
    once; a training run is refused the same way before it trains)."""
    script = study_script()
    run = tmp_path / "s" / "runs" / "additive-dv1-s0"
    run.mkdir(parents=True)
    (run / "result.json").write_text(json.dumps({"variant": "additive-dv1", "seed": 0,
                                                 **fake_result(study.RunSpec("additive-dv1", 0))}))
    report = tmp_path / "mine" / "report.md"
    report.parent.mkdir()
    report.write_text("# My notes\n")
    code = script.main(["--report_only", "--study_dir", str(tmp_path / "s"), "--report_dir", str(report.parent)])
    assert code == 2 and "was not written by study.py" in capsys.readouterr().err
    assert report.read_text() == "# My notes\n"
    with pytest.raises(ValueError, match="was not written by study.py"):
        study.write_report([json.loads((run / "result.json").read_text())], str(report.parent), {})
    # a report study.py wrote is refreshed
    path = study.write_report([json.loads((run / "result.json").read_text())], str(tmp_path / "ours"), {})
    study.write_report([json.loads((run / "result.json").read_text())], str(tmp_path / "ours"), {})
    with open(path, encoding="utf-8") as f:
        assert study.REPORT_MARK in f.read()


def test_a_second_study_in_the_same_folder_is_refused(tmp_path, capsys):
    from ddl_tools.outputs import FolderLock

    script = study_script()
    folder = tmp_path / "s"
    args = ["--variants", "additive-dv1", "--seeds", "0", "--study_dir", str(folder), "--launcher", "false",
            "--tokenizer_name", str(tmp_path / "tok")]
    assert script.check_settings(*script.parse_args(args)) is not None  # creates the study folder
    running = FolderLock(str(folder))
    assert running.acquire()
    try:
        assert script.main(args) == 2
    finally:
        running.release()
    assert "another study.py runs in" in capsys.readouterr().err
    assert not (folder / "runs").exists()


def test_a_study_dir_that_is_a_file_is_one_line(tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    with pytest.raises(ValueError, match="is a file, not a folder"):  # study.py prints it as one line (FileExistsError)
        study.check_study_config(str(afile), {"max_tokens": 100})
    assert afile.read_text() == "mine"
