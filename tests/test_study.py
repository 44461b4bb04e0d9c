"""study.py / ddl.study: the grid, resume bookkeeping, statistics on made-up numbers, and the report writer."""

import json
import math
import os
import sys

import pytest

from ddl_tools import study


# ------------------------------------------------------------------------------------------------------ grid


def test_default_grid_is_six_variants_by_five_seeds_seed_major():
    grid = study.build_grid(study.DEFAULT_VARIANTS, study.DEFAULT_SEEDS)
    assert len(grid) == 30 and study.DEFAULT_SEEDS == (0, 1, 2, 3, 4)
    assert [s.name for s in grid[:6]] == [f"{v}-s0" for v in study.DEFAULT_VARIANTS]
    assert {s.seed for s in grid[6:12]} == {1}
    assert study.DEFAULT_VARIANTS[0] == study.BASELINE == "additive-dv1"
    assert study.PRIMARY == ("delta-dv4-cc-ec", "additive-dv1") and set(study.PRIMARY) <= set(study.DEFAULT_VARIANTS)


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
    with pytest.raises(ValueError, match=r"--seeds -1: must be in \[0, 2\*\*32\)"):  # (was numpy's traceback in a run)
        study.build_grid(["additive-dv1"], [0, -1])


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
    assert flags["--eval_strategy"] == "steps" and flags["--eval_steps"] == "8" and flags["--max_eval_samples"] == "8"
    assert cmd[-2:] == ["--learning_rate", "3e-4"]
    full, _ = script.parse_args([])  # the budget chooses the tokens (resolve_scale), 5 seeds
    assert full.max_tokens is None and full.budget_hours == 3.0 and full.seeds == [0, 1, 2, 3, 4]
    assert full.curve_evals == 8 and full.curve_eval_blocks == 64
    by_hand, _ = script.parse_args(["--max_tokens", "1048576"])
    assert by_hand.max_steps == 256 and by_hand.budget_hours is None
    cmd = script.train_command(by_hand, "additive-dv1", 0, "out", "stats.json", "tok")
    assert dict(zip(cmd[4::2], cmd[5::2]))["--eval_steps"] == "32"  # 8 evaluations, the last at the final step


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
    lock, created = study.claim_study_dir(folder)
    assert created
    study.check_study_config(folder, {"max_tokens": 100, "preset": "tiny"})
    study.check_study_config(folder, {"max_tokens": 100, "preset": "tiny"})  # same settings: resume
    with pytest.raises(ValueError, match="differs in: max_tokens"):
        study.check_study_config(folder, {"max_tokens": 200, "preset": "tiny"})
    lock.release(remove=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a study folder"):
        study.claim_study_dir(str(other))
    assert os.listdir(other) == ["notes.txt"]  # left as it was


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
            curve = [{"step": s, "tokens": s * 4096, "val_loss": 5.5 - 0.025 * s + offset} for s in (4, 8, 12, 16, 20)]
            results.append({
                "variant": variant, "seed": seed, "val_loss": loss, "val_perplexity": math.exp(loss), "tokens": 81920,
                "tokens_per_s": 2000.0, "parameters": 1_400_000, "peak_memory_mib": 1200.0,
                "memory_kind": "process max RSS (CPU)", "history": history, "eval_curve": curve,
                "flops_per_token": 1_250_000 if "dv4" in variant else 1_000_000,
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
    for png in ("loss_vs_tokens.png", "loss_vs_wallclock.png", "loss_vs_flops.png"):
        assert os.path.getsize(tmp_path / png) > 1000 and f"]({png})" in text
    assert (tmp_path / "audit" / "delta-dv1" / "audit_beta_hist.png").exists()
    assert "### `delta-dv1`" in text and "### `delta-dv4-cc-ec`" in text
    table = {}
    for line in text.splitlines():  # the results table comes first; the matched-controls table after it
        if line.startswith("| `"):
            table.setdefault(line.split("|")[1].strip(), line)
    assert "5.0300 ± 0.0300" in table["`additive-dv1`"]
    assert "1,400,000" in table["`delta-dv1`"] and "process max RSS (CPU)" in text
    primary = next(line for line in text.splitlines() if line.startswith("| **primary**"))
    assert "`delta-dv4-cc-ec` − `additive-dv1` | equal tokens | -0.0800 | [-0.0800, -0.0800] | 95%" in primary
    assert text.index("**Primary comparison (named before the runs):**") < text.index("**Secondary comparisons**")
    assert "delta-dv4-cc-ec reaches a **lower** validation loss than additive-dv1 at equal tokens" in text
    assert "delta-dv1 vs write_only-dv1" not in text  # exact offsets: every difference here is resolved
    assert "reaches a **lower** validation loss than write_only-dv1" in text  # matched control
    # equal FLOPs: the baseline's last evaluation (5.5 - 0.025 x 20 = 5.0 at 20 x 4096 tokens x 1e6 FLOPs);
    # delta-dv4-cc-ec spends 1.25e6 FLOPs per token, so it is read at 16 x 4096 tokens: 5.5 - 0.025 x 16 - 0.08 = 5.02
    assert "5.0000 ± 0.0000" in table["`additive-dv1`"] and "5.0200 ± 0.0000" in table["`delta-dv4-cc-ec`"]
    assert "`delta-dv4-cc-ec` − `additive-dv1` | equal FLOPs | +0.0200" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["variant"] for r in summary["variants"]] == ["additive-dv1", "delta-dv1", "write_only-dv1",
                                                           "delta-dv4-cc-ec"]
    assert summary["comparisons"][0]["primary"] and summary["comparisons"][0]["claimed"]


def test_conclusion_with_one_seed_claims_nothing():
    results = [r for r in made_up_results(None) if r["seed"] == 0]
    assert "single seed" in study.conclusion(study.comparisons(results), 1)


def test_conclusion_says_when_the_interval_includes_zero():
    results = made_up_results(None)
    for r in results:  # delta-dv1: +0.05, -0.05, +0.01 around the baseline, per seed
        if r["variant"] == "delta-dv1":
            r["val_loss"] = 5.0 + 0.03 * r["seed"] + (0.05, -0.05, 0.01)[r["seed"]]
    text = study.conclusion(study.comparisons(results), 3)
    assert "delta-dv1 vs additive-dv1 at equal tokens" in text and "not distinguishable at this scale" in text


# ---------------------------------------------------------------------------------- never lose a user's work


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
    assert [p["step"] for p in result["eval_curve"]] == [1, 2] and result["flops_per_token"] > 0  # equal-FLOPs view
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


def test_a_report_before_every_seed_ran_names_the_seeds_it_has(tmp_path, capsys):
    """--report_only --seeds 0 1 2 with only seed 0 finished listed [0, 1, 2] as the report's seeds."""
    script = study_script()
    run = tmp_path / "s" / "runs" / "additive-dv1-s0"
    run.mkdir(parents=True)
    (run / "result.json").write_text(json.dumps({"variant": "additive-dv1", "seed": 0,
                                                 **fake_result(study.RunSpec("additive-dv1", 0))}))
    code = script.main(["--report_only", "--study_dir", str(tmp_path / "s"), "--report_dir", str(tmp_path / "r"),
                        "--variants", "additive-dv1", "--seeds", "0", "1", "2", "--max_tokens", "4096"])
    assert code == 0, capsys.readouterr().err[-2000:]
    setup = (tmp_path / "r" / "report.md").read_text().split("## Setup")[1].split("##")[0]
    assert "[0] (of [0, 1, 2]; the others have no finished run)" in setup, setup


def test_report_only_states_the_settings_the_study_ran_with(tmp_path, capsys):
    """--report_only used to report the command line's settings (defaults included), not the study's: a study of
    4 steps x 128 tokens, reported with --max_tokens 1048576 --block_size 256, said 256 x 4096 tokens."""
    script = study_script()
    folder, report = str(tmp_path / "s"), tmp_path / "r"
    ran = ["--variants", "additive-dv1", "--seeds", "0", "--max_tokens", "512", "--block_size", "32",
           "--per_device_train_batch_size", "4", "--study_dir", folder, "--report_dir", str(tmp_path / "r0")]
    settings, parsed = script.parse_args(ran + ["--", "--learning_rate", "3e-4"])
    os.makedirs(folder)
    script.check_settings(settings, parsed)  # writes the study's study.json, as a training run does
    run = tmp_path / "s" / "runs" / "additive-dv1-s0"
    run.mkdir(parents=True)
    (run / "result.json").write_text(json.dumps({"variant": "additive-dv1", "seed": 0,
                                                 **fake_result(study.RunSpec("additive-dv1", 0))}))
    listed = sorted(os.listdir(folder))
    code = script.main(["--report_only", "--study_dir", folder, "--report_dir", str(report), "--max_tokens",
                        "1048576", "--block_size", "256", "--per_device_train_batch_size", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "--max_tokens 1048576 (the study's: 512), --block_size 256 (the study's: 32)" in err, err
    assert not report.exists() and sorted(os.listdir(folder)) == listed  # refused before anything is written
    code = script.main(["--report_only", "--study_dir", folder, "--report_dir", str(report)])  # the study's own
    assert code == 0, capsys.readouterr().err[-2000:]
    setup = (report / "report.md").read_text().split("## Setup")[1].split("##")[0]
    assert "4 x 128" in setup and "512" in setup and "--learning_rate 3e-4" in setup, setup


@pytest.mark.parametrize("flag, value", [("--eval_tokens", "-100"), ("--audit_tokens", "-1"), ("--eval_tokens", "0"),
                                         ("--per_device_train_batch_size", "0"), ("--block_size", "0"),
                                         ("--gradient_accumulation_steps", "0"), ("--world_size", "0")])
def test_sizes_must_be_positive(tmp_path, capsys, flag, value):
    """A negative --eval_tokens N or --audit_tokens N used to score (audit) all but N tokens, as a slice does, and a
    0 batch or block to be replaced by the preset's: one line, before study.py writes anything."""
    script = study_script()
    with pytest.raises(SystemExit) as exit_:
        script.parse_args(["--max_tokens", "4096", "--study_dir", str(tmp_path / "s"), flag, value])
    assert exit_.value.code == 2
    assert f"error: {flag} must be positive, got {value}." in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --quick's defaults do not stand in for it either
        script.parse_args(["--quick", "--study_dir", str(tmp_path / "s"), flag, value])
    assert f"error: {flag} must be positive, got {value}." in capsys.readouterr().err


def test_a_study_folder_being_written_is_refused_and_a_write_cut_short_does_not_block_it(tmp_path, capsys):
    """While a study.py writes its folder (holds its lock), another one into it stops with one line that names the
    writer, and writes nothing (it used to record its study.json there first). A study.json whose write a kill cut
    short (.study.json.ddl-tmp, alone in the folder) made the folder 'not a study folder'; the next study.py deletes
    it and starts the study there."""
    from ddl_tools.outputs import FolderLock

    script = study_script()
    folder, report = tmp_path / "s", tmp_path / "report"
    folder.mkdir()
    args = ["--variants", "additive-dv1", "--seeds", "0", "--study_dir", str(folder), "--report_dir", str(report),
            "--launcher", "false", "--tokenizer_name", str(tmp_path / "tok"), "--max_tokens", "4096"]
    running = FolderLock(str(folder))  # another open file: to flock, another writer
    assert running.acquire()
    try:
        assert script.main(args) == 2
    finally:
        running.release()  # (its lock file stays, as a killed study.py leaves it)
    assert capsys.readouterr().err.splitlines() == [
        f"study.py: error: --study_dir {str(folder)!r} is being written by another run (pid {os.getpid()}); wait for "
        "it to end, or choose another --study_dir."]
    assert os.listdir(folder) == [".ddl.lock"] and not report.exists()
    (folder / ".study.json.ddl-tmp").write_text('{"variants": ["addit')
    assert script.main(args) == 1  # the study runs: its one training run fails at once (--launcher false)
    out = capsys.readouterr()
    assert "FAILED" in out.out and "not a study folder" not in out.err, out.err
    assert json.loads((folder / "study.json").read_text())["max_tokens"] == 4096
    assert sorted(os.listdir(folder)) == ["runs", "study.json"]  # the leftover and the lock file gone
    assert not report.exists()  # created for the report, which had no finished run to show: removed


def test_a_study_dir_that_is_a_file_is_one_line(tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    with pytest.raises(ValueError, match="is a file, not a folder"):  # study.py prints it as one line (FileExistsError)
        study.claim_study_dir(str(afile))
    assert afile.read_text() == "mine"


# ----------------------------------------------------------------------- primary comparison, Holm, FLOPs, scale


def test_holm_adjust_against_a_hand_worked_example():
    # p = 0.01, 0.04, 0.03, 0.005 (m = 4). Sorted: 0.005 x 4 = 0.02; 0.01 x 3 = 0.03; 0.03 x 2 = 0.06;
    # 0.04 x 1 = 0.04, raised to the running maximum 0.06. Back in the given order:
    assert study.holm_adjust([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # capped at 1; a NaN (no test) stays NaN and does not count in m (here m = 2: 0.3 x 2 = 0.6, 0.7 x 1 -> 0.7)
    adjusted = study.holm_adjust([0.7, math.nan, 0.3])
    assert adjusted[0] == pytest.approx(0.7) and math.isnan(adjusted[1]) and adjusted[2] == pytest.approx(0.6)
    assert study.holm_adjust([0.6, 0.9]) == pytest.approx([1.0, 1.0])


def test_p_values_and_widened_intervals_match_scipy():
    from scipy import stats

    values, base = {0: 5.10, 1: 5.02, 2: 5.21, 3: 5.05, 4: 5.13}, {0: 5.20, 1: 5.07, 2: 5.22, 3: 5.16, 4: 5.15}
    diffs = [values[s] - base[s] for s in range(5)]
    est = study.difference(values, base, level=1 - 0.05 / 7)
    test = stats.ttest_rel(list(values.values()), list(base.values()))
    assert est.p_value == pytest.approx(test.pvalue)
    low, high = stats.ttest_1samp(diffs, 0.0).confidence_interval(1 - 0.05 / 7)
    assert (est.ci_low, est.ci_high) == (pytest.approx(low), pytest.approx(high)) and est.level == 1 - 0.05 / 7


def five_seed_results():
    """The default grid over 5 seeds; delta-dv4-cc-ec 0.03 below the baseline with a small spread (resolved even
    after correction), delta-dv1 0.02 below with a larger one (a 95% interval that excludes zero, a simultaneous one
    that does not)."""
    noise = {"delta-dv4-cc-ec": (0.0, 0.004, -0.003, 0.002, -0.003), "delta-dv1": (0.009, -0.0165, 0.006, -0.012, 0.0135)}
    offset = {"additive-dv1": 0.0, "delta-dv1": -0.02, "write_only-dv1": 0.0, "delta-dv4-cc-ec": -0.03,
              "write_only-dv4-cc-ec": 0.0, "additive-dv4-cc-ec": 0.0}
    results = []
    for variant in study.DEFAULT_VARIANTS:
        for seed in range(5):
            loss = 5.0 + 0.05 * seed + offset[variant] + noise.get(variant, (0.001 * seed,) * 5)[seed]
            results.append({"variant": variant, "seed": seed, "val_loss": loss, "history": []})
    return results


def test_primary_first_then_one_corrected_secondary_family():
    results = five_seed_results()
    comps = study.comparisons(results, order=study.DEFAULT_VARIANTS)
    primary = comps[0]
    assert primary.primary and (primary.variant, primary.control, primary.view) == (*study.PRIMARY, "equal tokens")
    assert primary.estimate.level == 0.95 and primary.claimed and primary.adjusted_p == primary.estimate.p_value
    secondary = comps[1:]
    assert not any(c.primary for c in secondary)
    # 4 other variants vs the baseline + 3 new matched controls (delta-dv1 vs additive-dv1 is already there); no
    # equal-FLOPs contrasts without in-training curves
    assert len(secondary) == 7 and {c.family_size for c in secondary} == {7}
    assert all(c.estimate.level == pytest.approx(1 - 0.05 / 7) for c in secondary)
    assert (study.PRIMARY[0], study.PRIMARY[1], "equal tokens") not in {(c.variant, c.control, c.view)
                                                                        for c in secondary}
    dv1 = next(c for c in secondary if (c.variant, c.control) == ("delta-dv1", "additive-dv1"))
    uncorrected = study.difference(*[{r["seed"]: r["val_loss"] for r in results if r["variant"] == v}
                                     for v in ("delta-dv1", "additive-dv1")])
    assert uncorrected.excludes_zero() and not dv1.claimed  # resolved at 95%, not after the correction
    assert dv1.adjusted_p == pytest.approx(study.holm_adjust([c_raw(c, results) for c in secondary])[
        secondary.index(dv1)])
    text = study.conclusion(comps, 5)
    assert text.startswith("**Primary comparison (named before the runs):**\n- delta-dv4-cc-ec reaches a **lower**")
    assert "one Holm-Bonferroni family of 7" in text
    assert "- delta-dv1 vs additive-dv1 at equal tokens: -0.0220 nats; the 99.29% simultaneous interval" in text
    assert "not distinguishable at this scale" in text


def c_raw(c, results):
    by = lambda v: {r["seed"]: r["val_loss"] for r in results if r["variant"] == v}  # noqa: E731
    return study.difference(by(c.variant), by(c.control)).p_value


def test_training_flops_per_token_against_a_hand_count():
    from conftest import tiny_config

    # TINY: d = 32, MLP 64, 2 layers, 4 heads of 8 (2 key-value heads), vocabulary 99; context 16.
    # dense: per layer q 32x32 + k, v 2 x 32x16 + o 32x32 + MLP 3 x 32x64 = 9,216; x 2 layers + head 32x99 = 21,600
    # attention: 2 layers x 2 products x 32 (4 x 8) x 16 = 2,048
    additive = study.training_flops_per_token(tiny_config(ddl_residual="additive", ddl_value_channels=1), 16)
    assert (additive.dense, additive.attention, additive.ddl) == (6 * 21_600, 6 * 2_048, 0)
    # the paper's default DDL (delta, d_v = 4, CC, EC 4 taps): per seam gate 32 + value 4x32 + k 32 + write 4x32
    # + readout 4x32 = 448, x 4 seams = 1,792; compressors (2 x 2 + 1) x 4x32 = 640; EC 4 x 4x32 = 512
    default = study.training_flops_per_token(tiny_config(), 16)
    assert default.ddl == 6 * (1_792 + 640 + 512) and default.total == 6 * (21_600 + 2_048 + 2_944)
    # write_only, d_v = 2, TC of 3 taps, no EC, a two-layer gate of 8: seam 8x32 + 8 + 2x32 + 32 + 2x32 = 424,
    # x 4 = 1,696; compressors 5 x 3 x 2x32 = 960
    other = study.training_flops_per_token(tiny_config(ddl_residual="write_only", ddl_value_channels=2,
                                                       ddl_compressor="tc", ddl_state_kernel_size=3,
                                                       ddl_embed_conv=False, ddl_beta_hidden_size=8), 16)
    assert other.ddl == 6 * (1_696 + 960)
    assert study.training_flops_per_token(tiny_config(), 32).attention == 2 * default.attention  # linear in context


def test_dense_and_attention_flops_equal_torchs_count_of_a_llama_step():
    """torch's FlopCounterMode counts every matrix product of a forward and backward pass: for the additive d_v = 1
    model (Llama) that is exactly the dense and attention terms."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from conftest import tiny_config
    from ddl import DDLForCausalLM

    config = tiny_config(ddl_residual="additive", ddl_value_channels=1)
    config._attn_implementation = "eager"  # matrix products torch can see
    model = DDLForCausalLM(config)
    ids = torch.randint(3, config.vocab_size, (2, 16))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert counter.get_total_flops() == 2 * 16 * study.training_flops_per_token(config, 16).total


def test_loss_at_flops_interpolates_the_validation_curve():
    run = {"flops_per_token": 10, "eval_curve": [{"tokens": 100, "val_loss": 6.0}, {"tokens": 200, "val_loss": 5.0},
                                                 {"tokens": 400, "val_loss": 4.0}]}
    assert study.loss_at_flops(run, 1500) == pytest.approx(5.5)
    assert study.loss_at_flops(run, 3000) == pytest.approx(4.5)
    assert study.loss_at_flops(run, 4000) == pytest.approx(4.0)
    assert study.loss_at_flops(run, 4001) is None and study.loss_at_flops(run, 900) is None  # no extrapolation
    assert study.loss_at_flops({"eval_curve": run["eval_curve"]}, 1500) is None  # FLOPs per token unknown


def test_training_curves_take_evaluation_pauses_out_of_the_wall_clock():
    script = study_script()
    log = [{"step": 10, "loss": 7.0, "train_runtime": 5.0, "num_input_tokens_seen": 100},
           {"step": 10, "eval_loss": 6.5, "eval_runtime": 2.0, "num_input_tokens_seen": 100},
           {"step": 20, "loss": 6.0, "train_runtime": 12.0, "num_input_tokens_seen": 200},
           {"step": 20, "eval_loss": 6.1, "eval_runtime": 3.0}]
    history, curve = script.training_curves(log, 10)
    assert [h["wall_s"] for h in history] == [5.0, 10.0] and [h["tokens"] for h in history] == [100, 200]
    assert curve == [{"step": 10, "tokens": 100, "val_loss": 6.5, "eval_s": 2.0},
                     {"step": 20, "tokens": 200, "val_loss": 6.1, "eval_s": 3.0}]


def test_plan_scale_fits_the_grid_in_the_budget():
    # 2 variants x 5 seeds in 1 hour, 10% slack, 60 s of calibration spent: 3,240 - 60 = 3,180 s usable;
    # fixed 5 x (30 + 50) = 400 s; per step 5 x (0.5 + 1.0) = 7.5 s -> floor(2,780 / 7.5) = 370 steps
    plan = study.plan_scale({"a": 0.5, "b": 1.0}, {"a": 30.0, "b": 50.0}, seeds=5, budget_s=3600,
                            tokens_per_step=4096, spent_s=60, slack=0.1)
    assert plan["steps"] == 370 and plan["max_tokens"] == 370 * 4096
    assert plan["predicted_s"] == pytest.approx(60 + 400 + 370 * 7.5) and plan["predicted_s"] <= 3600 * 0.9
    with pytest.raises(ValueError, match="too small .* about 0.14 hours"):  # (60 + 400 + 7.5) / 0.9 s = 0.144 h
        study.plan_scale({"a": 0.5, "b": 1.0}, {"a": 30.0, "b": 50.0}, 5, 400, 4096, spent_s=60, slack=0.1)


def test_budget_from_a_recorded_calibration_is_recorded_and_resumed(tmp_path, capsys):
    script = study_script()
    recorded = {"preset": "tiny", "tokens_per_step": 4096, "steps": 12, "seconds": 100.0,
                "variants": {"additive-dv1": {"step_s": 0.5, "tokens_per_s": 8192, "run_s": 30.0},
                             "delta-dv1": {"step_s": 1.0, "tokens_per_s": 4096, "run_s": 50.0}}}
    (tmp_path / "cal.json").write_text(json.dumps(recorded))
    folder = str(tmp_path / "s")
    args = ["--variants", "additive-dv1", "delta-dv1", "--seeds", "0", "1", "2", "3", "4", "--study_dir", folder,
            "--budget_hours", "1", "--calibration", str(tmp_path / "cal.json")]
    settings, parsed = script.parse_args(args)
    lock, _ = study.claim_study_dir(folder)  # as study.py does, before the calibration
    plan = script.resolve_scale(settings, parsed)
    assert settings.max_tokens == plan["max_tokens"] == 378 * 4096  # floor((3,240 - 400) / 7.5): nothing spent
    script.check_settings(settings, parsed)
    from ddl_tools.outputs import write_json

    write_json(os.path.join(folder, script.CALIBRATION_FILE), plan)
    lock.release(remove=True)
    again, parsed = script.parse_args(args[:-2])  # a rerun: no calibration, the recorded plan
    assert script.resolve_scale(again, parsed)["steps"] == 378 and again.max_tokens == 378 * 4096
    other, parsed = script.parse_args(args[:-4] + ["--budget_hours", "2"])
    with pytest.raises(ValueError, match="planned for --budget_hours 1"):
        script.resolve_scale(other, parsed)
    wrong, parsed = script.parse_args(args[:8] + ["--study_dir", str(tmp_path / "t"), "--calibration",
                                                  str(tmp_path / "cal.json"), "--block_size", "128"])
    with pytest.raises(ValueError, match="not tiny at 2048"):
        script.resolve_scale(wrong, parsed)
    with pytest.raises(SystemExit):
        script.parse_args(["--max_tokens", "4096", "--budget_hours", "1"])
    assert "not both" in capsys.readouterr().err


def test_a_text_file_is_scored_on_the_stream_train_py_packs(tmp_path):
    """A .txt validation file's rows are the lines of one text: train.py packs them without an end-of-text token
    after each, and so must the study's final evaluation (with one after every line, an untrained-for token cost
    every line and the final loss disagreed with train.py's own evaluation by nats)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import study as script
    from conftest import tiny_tokenizer

    from ddl_tools import evaluation
    from ddl_tools.data import load_raw_datasets, tokenize_and_pack

    lines = "".join(f"Line {i} of the play, with words.\n" for i in range(40))
    (tmp_path / "train.txt").write_text(lines)
    (tmp_path / "val.txt").write_text(lines)
    settings, _ = script.parse_args(["--quick", "--study_dir", str(tmp_path / "s"), "--train_file",
                                     str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "val.txt")])
    texts, _, documents = script.validation_texts(settings)
    assert documents is False
    tokenizer = tiny_tokenizer(lines)
    ids = evaluation.tokenize_documents(tokenizer, texts, add_eos=documents)
    raw, info = load_raw_datasets(train_file=str(tmp_path / "train.txt"), validation_file=str(tmp_path / "val.txt"))
    packed = tokenize_and_pack(raw, tokenizer, "text", 16, info["documents"])["validation"]
    stream = [token for block in packed["input_ids"] for token in block]
    assert ids[: len(stream)].tolist() == stream and tokenizer.eos_token_id not in ids.tolist()



def test_a_rerun_on_changed_text_is_refused(tmp_path):
    """study.json recorded --train_file by name: a rerun after the file's text changed trained the missing seeds on
    the new text and pooled them with the old ones (found by a user-style test pass). The files' content is recorded
    too; a study.json from before that resumes as it did."""
    script = study_script()
    train_text, validation_text = tmp_path / "train.txt", tmp_path / "valid.txt"
    train_text.write_text("the first text\n" * 50)
    validation_text.write_text("held out\n" * 20)
    folder = str(tmp_path / "s")
    args = ["--variants", "additive-dv1", "--seeds", "0", "--study_dir", folder, "--max_tokens", "1000000",
            "--train_file", str(train_text), "--validation_file", str(validation_text)]
    settings, parsed = script.parse_args(args)
    lock, _ = study.claim_study_dir(folder)
    try:
        script.check_settings(settings, parsed)
        script.check_settings(settings, parsed)  # the same text: resumed
        train_text.write_text("another text\n" * 50)
        with pytest.raises(ValueError, match="differs in: train_file_sha256"):
            script.check_settings(settings, parsed)
        recorded = json.loads((tmp_path / "s" / "study.json").read_text())
        del recorded["train_file_sha256"], recorded["validation_file_sha256"]
        (tmp_path / "s" / "study.json").write_text(json.dumps(recorded))
        script.check_settings(settings, parsed)  # (an older study.json: nothing to compare with)
        train_text.write_text("a third text\n" * 50)  # (its digests are recorded from then on)
        with pytest.raises(ValueError, match="differs in: train_file_sha256"):
            script.check_settings(settings, parsed)
    finally:
        lock.release(remove=True)
