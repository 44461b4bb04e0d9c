"""scripts/gpu_speed.py, the prepared GPU speed check: its CPU dry run runs every part and fills the issue's targets
table; a part past its limit is stopped and recorded; ratios are paired by repeat; the kernel tests decide the
implementation. (No figure of the dry run is asserted: a CPU says nothing of a GPU.)"""

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_speed  # noqa: E402


def test_the_dry_run_runs_every_part_and_fills_the_targets_table(tmp_path):
    """Every part of the first call on CPU (Llama and TC+EC, the variant with the most paths: compressors, EC, the
    window step; torch.compile's eager backend, which captures the graphs in seconds): each part ends ok, each row
    of the targets table has TC+EC's ratio, the compiled parts count graphs, and nothing from the GPU is made up."""
    env = dict(os.environ, DDL_CPU_KERNEL="0")
    env.pop("OUT", None)
    start = time.monotonic()
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_speed.py"), "--device", "cpu",
                           "--out", str(tmp_path), "--variants", "llama", "ddl-tc", "--micro_steps", "1",
                           "--compile_backend", "eager"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_speed.json").read_text())
    parts = report["parts"]
    assert list(parts) == gpu_speed.FIRST
    assert all(p["status"] == "ok" for p in parts.values()), {k: (p["status"], p.get("note")) for k, p in parts.items()}
    assert report["meta"]["implementation"] == "triton" and "passed" in report["meta"]["implementation_why"]
    assert report["meta"]["versions"]["ddl"] == "imports"
    assert report["meta"]["seconds"] < time.monotonic() - start

    rows = report["targets"]
    assert len(rows) == 6  # the table (the second call's rows only when it ran)
    for row in rows:
        tc = row["cells"]["ddl-tc"]
        assert tc["met"] in (True, False), row["row"]
        for measured in tc["measured"].values():
            assert measured["ratio"] > 0 and measured["n"] >= 1
        assert row["cells"]["ddl-dv1"]["met"] is None  # (not run here)
    eager = [s for s in parts["train"]["samples"] if s["regime"] == "eager_small"]
    assert sorted((s["model"], s["repeat"]) for s in eager) == [("ddl-tc", 0), ("ddl-tc", 1), ("llama", 0),
                                                                ("llama", 1)]
    assert all(s["tok_s"] > 0 and s["optimizer_ms"] > 0 and s["host_ms"] > 0 for s in eager)
    facts = parts["train"]["facts"]
    assert facts["eager_small"]["ddl-tc"]["peak_mb"] > 0 and "kernels" not in facts["eager_small"]["ddl-tc"]
    for part, regime in (("compile", "compiled"), ("decode", "decode_compiled_b1"), ("decode", "decode_compiled_b8")):
        for model in ("llama", "ddl-tc"):
            compiled = parts[part]["facts"][regime][model]
            assert compiled["graphs"] >= 1 and compiled["compile_s"] > 0, (regime, model)
        assert isinstance(parts[part]["facts"][regime]["all"]["graphs_during_timed_steps"], int)

    md = (tmp_path / "gpu_speed.md").read_text()
    assert md.startswith("# DDL GPU speed check (issue 58)") and "CPU DRY RUN" in md
    assert "| eager training, 1 x 32 (host-bound) |" in md and "(>= 0.85: " in md and "(<= 1.12: " in md
    assert "## compiled static-cache `generate` (on CPU: compiled, no CUDA graphs)" in md
    log = (tmp_path / "gpu_speed.log").read_text()
    assert "===== decode =====" in log
    # a second check into the same folder is refused: the first one's results stay
    again = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_speed.py"), "--device", "cpu",
                            "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exists" in again.stderr


def test_a_part_past_its_limit_is_stopped_and_one_that_fails_is_recorded(tmp_path):
    runner = gpu_speed.PartRunner()
    start = time.monotonic()
    hung = runner.run([sys.executable, "-c", "import time; time.sleep(120)"], 1, tmp_path / "hung.log", os.environ)
    assert hung["status"] == "stopped at its 1 s limit" and hung["exit"] is None
    assert time.monotonic() - start < 30
    script = "import sys; print('working'); print('ValueError: the part broke', file=sys.stderr); sys.exit(3)"
    failed = runner.run([sys.executable, "-c", script], 30, tmp_path / "failed.log", os.environ)
    assert failed["status"] == "failed (exit 3)"
    assert gpu_speed.last_error(tmp_path / "failed.log") == "ValueError: the part broke"


def _parts(samples, facts=None):
    return {"train": {"samples": [dict(zip(("regime", "model", "repeat", "tok_s"), s, strict=True)) for s in samples],
                      "facts": facts or {}}}


def test_ratios_pair_repeats_and_the_targets_say_met_or_not():
    """A ratio is DDL's figure over Llama's of the same repeat (a repeat one side lacks is left out); peak memory
    is a one-off figure, its target an upper bound; a row of two regimes is met only where both are."""
    samples = [("eager_small", "llama", 0, 100.0), ("eager_small", "ddl-tc", 0, 90.0),
               ("eager_small", "llama", 1, 50.0), ("eager_small", "ddl-tc", 1, 40.0),
               ("eager_small", "ddl-tc", 2, 1.0),  # Llama's third repeat did not run: left out
               ("decode_eager_b1", "llama", 0, 10.0), ("decode_eager_b1", "ddl-tc", 0, 9.5),
               ("decode_eager_b8", "llama", 0, 10.0), ("decode_eager_b8", "ddl-tc", 0, 8.0)]
    facts = {"eager_small": {"llama": {"peak_mb": 1000.0}, "ddl-tc": {"peak_mb": 1100.0}}}
    found = gpu_speed.figures(_parts(samples, facts))
    tc = gpu_speed.paired(found["eager_small"], "ddl-tc", "tok_s")
    assert tc["n"] == 2 and tc["ratio"] == pytest.approx(0.85) and (tc["ratio_min"], tc["ratio_max"]) == (0.8, 0.9)
    assert gpu_speed.paired(found["eager_small"], "ddl-tc", "peak_mb")["ratio"] == pytest.approx(1.1)
    assert gpu_speed.paired(found["eager_small"], "ddl-cc", "tok_s") is None

    config = gpu_speed.settings("cuda", gpu_speed.parse_args(["--device", "cuda"]))
    rows = {row["row"].split(",")[0]: row for row in gpu_speed.target_rows(_parts(samples, facts), config)}
    assert list(rows) == ["eager training", "compiled training", "compiled static-cache `generate` (CUDA graphs)",
                          "eager `generate`", "peak training memory"]  # (the second call's rows: once it ran)
    eager = gpu_speed.target_rows(_parts(samples, facts), config)[:2]
    assert [row["row"] for row in eager] == ["eager training, 8 x 1024 (host-bound)",
                                             "eager training, 32 x 1024 (GPU-bound)"]
    assert eager[0]["cells"]["ddl-tc"]["met"] is True  # 0.85 >= 0.85
    assert eager[0]["cells"]["ddl-cc"]["met"] is None and eager[1]["cells"]["ddl-tc"]["met"] is None
    assert rows["peak training memory"]["cells"]["ddl-tc"]["met"] is True  # 1.10 <= 1.12
    assert rows["eager `generate`"]["cells"]["ddl-tc"]["met"] is False  # batch 1 0.95 >= 0.90, batch 8 0.80 not
    report = {"meta": {"call": "first", "date": "now", "wheels": "none", "implementation": "triton",
                       "implementation_why": "its kernel tests passed: 101 passed", "seconds": 1.0, "budget_s": 560},
              "parts": {"train": dict(_parts(samples, facts)["train"], title="(b)", status="ok", seconds=1, limit=2)},
              "targets": gpu_speed.target_rows(_parts(samples, facts), config)}
    md = gpu_speed.markdown(report, config)
    assert "| eager training, 8 x 1024 (host-bound) | – (>= 0.90: not measured) | – (>= 0.85: not measured) | " \
           "0.85 [0.80–0.90] (>= 0.85: **met**) |" in md
    assert "0.95 / 0.80 (>= 0.90: not met)" in md


@pytest.mark.parametrize("log, status, chosen, why", [
    ("....s.  [100%]\n101 passed, 1 skipped, 112 deselected in 50.1s\n", "ok", "triton", "passed: 101 passed"),
    ("..F.  [100%]\nFAILED tests/test_kernels.py::test_triton_x - ptxas fatal\n1 failed, 3 passed in 9.0s\n",
     "failed (exit 1)", "auto", "1 failed"),
    ("........  [ 40%]\n.....", "stopped at its 90 s limit", "triton", "stopped at its 90 s limit with none failed"),
    ("....F...  [ 40%]\n", "stopped at its 90 s limit", "auto", "1 failed"),
    ("ImportError while loading conftest\n", "failed (exit 4)", "auto", "failed (exit 4)"),
], ids=["passed", "failed", "stopped-clean", "stopped-failing", "broken"])
def test_the_kernel_tests_decide_the_implementation(tmp_path, log, status, chosen, why):
    (tmp_path / "kernels.log").write_text(log)
    counts, failed, complete = gpu_speed.pytest_summary(tmp_path / "kernels.log")
    check = gpu_speed.Check(gpu_speed.parse_args(["--device", "cpu", "--out", str(tmp_path)]))
    check.decide_implementation({"status": status, "tests": counts, "complete": complete})
    assert check.meta["implementation"] == chosen and why in check.meta["implementation_why"]
    assert bool(failed) == ("FAILED" in log)


def test_parts_beyond_the_budget_or_without_ddl_are_recorded_not_run(tmp_path, monkeypatch):
    check = gpu_speed.Check(gpu_speed.parse_args(["--device", "cpu", "--out", str(tmp_path), "--budget", "5"]))
    os.makedirs(check.out, exist_ok=True)
    assert check.main() == 0
    assert all(p["status"].startswith("not run: the check had used its 5 s budget") for p in check.parts.values())
    assert "not run: the check had used its 5 s budget" in (tmp_path / "gpu_speed.md").read_text()

    def versions_only(self, part, later):  # a machine whose transformers is too old for DDL
        self.parts[part] = {"title": part, "status": "ok", "seconds": 1, "limit": 40,
                            "versions": {"ddl": "does not import (ImportError: DDL needs transformers>=5.24)"}}

    monkeypatch.setattr(gpu_speed.Check, "run_part", versions_only)
    check = gpu_speed.Check(gpu_speed.parse_args(["--device", "cpu", "--out", str(tmp_path / "old")]))
    os.makedirs(check.out, exist_ok=True)
    check.main()
    assert [p["status"].split(":")[0] for p in check.parts.values()] == ["ok"] + ["not run"] * 4
    assert "carry the wheels" in check.parts["train"]["status"]
