"""bench.py runs end to end and reports every figure as a ratio to Llama (the speed itself is not asserted); training
is timed one model per fresh process, in alternations."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

import bench


def _forbid_training_here(monkeypatch):
    """Any training step in this (the parent) process fails the test: training must run in the workers."""
    def refuse(self):
        raise AssertionError(f"{self.name} trained in the parent process")

    monkeypatch.setattr(bench.Runner, "train_step", refuse)


def test_bench_trains_per_process_and_writes_memory_timelines(tmp_path, capsys, monkeypatch):
    """The default: training speed and peak memory come from fresh worker processes (the parent trains nothing),
    prefill and decode from this process; a table with every figure, and each model's memory timeline."""
    _forbid_training_here(monkeypatch)
    # the workers run DDL's PyTorch path: each fresh process would otherwise load (and, in a build cache shared with
    # other checkouts, maybe rebuild) the C++ kernel, seconds to this test for nothing it checks
    monkeypatch.setenv("DDL_CPU_KERNEL", "0")
    out, timeline = tmp_path / "bench.json", tmp_path / "timeline"
    bench.main(["--size", "tiny", "--variants", "llama", "ddl-cc", "--repeats", "1", "--train_steps", "1",
                "--new_tokens", "2", "--batch_size", "2", "--seq_len", "64", "--json", str(out),
                "--memory_timeline", str(timeline)])
    result = json.loads(out.read_text())
    assert result["train"] == "per_process" and result["size"]["batch_size"] == 2 and result["size"]["seq_len"] == 64
    rows = {row["model"]: row for row in result["rows"]}
    assert set(rows) == {"llama", "ddl-cc"}
    for key in ("train_tok_s", "prefill_tok_s", "decode_b1_tok_s", "decode_b8_tok_s", "peak_train_mem_MB"):
        assert rows["llama"][key]["ratio"] == 1.0 and rows["ddl-cc"][key]["median"] > 0
    # AdamW state + gradients + parameters alone exceed 4x the fp32 parameter bytes
    assert rows["llama"]["peak_train_mem_MB"]["median"] > 4 * 4 * rows["llama"]["params_M"] * 1e6 / 2**20
    printed = capsys.readouterr().out
    assert "| ddl-cc |" in printed and "per process, 1 alternations" in printed

    for model in ("llama", "ddl-cc"):
        t = json.loads((timeline / f"{model}.json").read_text())
        assert t["model"] == model and len(t["time_ms"]) == len(t["bytes"]) <= bench.TIMELINE_POINTS
        assert all(len(row) == len(t["categories"]) for row in t["bytes"])
        # the timeline's peak is the table's, and is kept by the compaction; parameters live throughout
        assert t["peak_bytes"] / 2**20 == pytest.approx(rows[model]["peak_train_mem_MB"]["median"])
        assert max(map(sum, t["bytes"])) == t["peak_bytes"] == sum(t["peak_by_category"].values())
        params = t["categories"].index("parameter")
        assert min(row[params] for row in t["bytes"]) >= 4 * rows[model]["params_M"] * 1e6 * 0.99
        assert t["peak_by_category"]["activation"] > 0 and t["peak_by_category"]["optimizer_state"] > 0
    assert (timeline / "memory_timeline.png").stat().st_size > 0


def test_bench_in_process_training_figure(tmp_path, capsys):
    """--train_in_process keeps the interleaved figure of one process (for comparison); no worker is started when
    memory is skipped too."""
    out = tmp_path / "bench.json"
    bench.main(["--variants", "llama", "ddl-dv1", "--repeats", "1", "--train_steps", "1", "--train_in_process",
                "--skip", "prefill", "decode", "memory", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["train"] == "in_process"
    rows = {row["model"]: row for row in result["rows"]}
    assert rows["ddl-dv1"]["train_tok_s"]["median"] > 0 and "peak_train_mem_MB" not in rows["ddl-dv1"]
    assert "one process, interleaved (--train_in_process)" in capsys.readouterr().out


def test_memory_timeline_folder_is_never_overwritten(tmp_path, capsys):
    """A folder that already holds files (an earlier timeline, the 'before' of a comparison) is refused in one line,
    before anything runs, and kept as it was."""
    folder = tmp_path / "before"
    folder.mkdir()
    (folder / "llama.json").write_text("{}")
    with pytest.raises(SystemExit) as stop:
        bench.main(["--variants", "llama", "ddl-cc", "--memory_timeline", str(folder)])
    assert stop.value.code == 2
    assert "is not empty; choose a new folder" in capsys.readouterr().err
    assert (folder / "llama.json").read_text() == "{}" and sorted(p.name for p in folder.iterdir()) == ["llama.json"]


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--batch_size", "0"], ["--warmup_steps", "-1"],
                                  ["--skip", "memory", "--memory_timeline", "x"]])
def test_bad_flags_are_one_line(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    assert stop.value.code == 2 and "error: --" in capsys.readouterr().err


def test_alternations_run_each_model_once_reversing_the_order():
    """Each alternation starts every model once, in its own process; Llama first in one, last in the next; peak
    memory once per model, in the first alternation."""
    jobs = bench.worker_jobs(["ddl-cc", "llama", "ddl-tc"], 4, train=True, memory=True)
    by_alternation = [[name for a, name, _, _ in jobs if a == alternation] for alternation in range(4)]
    assert by_alternation == [["llama", "ddl-cc", "ddl-tc"], ["ddl-tc", "ddl-cc", "llama"]] * 2
    assert all(train for _, _, train, _ in jobs)
    assert [(a, name) for a, name, _, memory in jobs if memory] == [(0, "llama"), (0, "ddl-cc"), (0, "ddl-tc")]
    # without timed training (skipped, or timed in one process), one memory process per model
    assert bench.worker_jobs(["ddl-cc", "llama"], 4, train=False, memory=True) == [(0, "llama", False, True),
                                                                                    (0, "ddl-cc", False, True)]
    assert bench.worker_jobs(["ddl-cc", "llama"], 4, train=False, memory=False) == []


def test_worker_command_carries_the_measurement_settings():
    args = bench.parse_args(["--size", "small", "--batch_size", "1", "--seq_len", "512", "--dtype", "bfloat16",
                             "--device", "cpu", "--compile", "--train_steps", "3", "--warmup_steps", "2"])
    cmd = bench.worker_command(args, "ddl-cc", "r.json", train=True, memory=False)
    worker = bench.parse_args(cmd[2:])
    assert cmd[1] == bench.__file__ and worker._worker == "ddl-cc" and worker._train and not worker._memory
    assert bench.bench_size(worker) == bench.bench_size(args) and bench.bench_size(args).seq_len == 512
    for name in ("size", "device", "dtype", "implementation", "compile", "train_steps", "warmup_steps"):
        assert getattr(worker, name) == getattr(args, name)


def test_a_failed_worker_is_one_line(monkeypatch):
    """A worker that dies (out of memory, say) stops the run with a line that names the model and what to try."""
    monkeypatch.setattr(bench, "worker_command", lambda *a, **k: [bench.sys.executable, "-c", "raise SystemExit(3)"])
    args = bench.parse_args(["--variants", "llama", "ddl-cc"])
    records = {v: bench.Record(v, 1.0) for v in args.variants}
    with pytest.raises(SystemExit, match=r"worker process for llama \(alternation 1\) ended with exit status 3.*"
                                         r"smaller --batch_size"):
        bench.run_workers(args, records, bench.worker_jobs(args.variants, 1, True, True), None)


class _Fake:
    def __init__(self, name, values):
        self.name, self.params_M, self.results = name, 1.0, {"train_tok_s": values}


def test_ratios_are_paired_by_repeat():
    """A machine that slows down between repeats slows both models alike: the paired ratio stays exact."""
    llama, ddl = _Fake("llama", [100.0, 50.0, 80.0]), _Fake("ddl", [90.0, 45.0, 72.0])
    row = {r["model"]: r for r in bench.summarise([ddl, llama])}["ddl"]["train_tok_s"]
    assert all(abs(row[key] - 0.9) < 1e-12 for key in ("ratio", "ratio_min", "ratio_max"))
    assert row["median"] == 72.0


def test_ratio_spread_over_alternations():
    """Per alternation, the variant's figure over Llama's of the same alternation; the table shows their median and
    [min-max] (here 0.95 [0.78-0.96]), not a ratio of medians (94/100)."""
    llama = _Fake("llama", [100.0, 90.0, 110.0, 100.0, 120.0])
    ddl = _Fake("ddl-cc", [78.0, 85.5, 104.5, 94.0, 115.2])  # ratios 0.78, 0.95, 0.95, 0.94, 0.96
    rows = bench.summarise([llama, ddl])
    s = rows[1]["train_tok_s"]
    assert (s["ratio"], s["ratio_min"], s["ratio_max"]) == pytest.approx((0.95, 0.78, 0.96))
    table = bench.markdown(rows, "### header")
    assert "| ddl-cc | 1.00 | 94 (0.95× [0.78–0.96]) | – |" in table
    assert "train: one fresh process per model and alternation" in table


def test_compact_timeline_keeps_the_peak():
    times = list(range(0, 10_000, 2))  # µs
    rows = [[1000, (i * 37) % 501] for i in range(len(times))]
    rows[1234] = [1000, 9000]
    t = bench.compact_timeline(times, ["parameter", "activation"], rows, points=100)
    assert len(t["time_ms"]) == 100 and t["peak_bytes"] == 10000 and [1000, 9000] in t["bytes"]
    assert t["peak_by_category"] == {"parameter": 1000, "activation": 9000}
    assert t["time_ms"] == sorted(t["time_ms"]) and 0 <= t["time_ms"][0] < 0.1 and t["time_ms"][-1] <= 10


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_order_balances_positions_and_predecessors(n):
    """Over one cycle of the design every model runs in every position, and right after every other model, equally
    often (a cyclic rotation A B C, B C A, ... fails: B always follows A but in the one round where B runs first)."""
    models = [f"model-{i}" for i in range(n)]
    cycle = 2 * n if n % 2 else n
    orders = [bench.balanced_order(models, repeat) for repeat in range(cycle)]
    assert all(sorted(order) == models for order in orders)
    positions = Counter((order.index(m), m) for order in orders for m in models)
    assert set(positions.values()) == {cycle // n} and len(positions) == n * n
    pairs = Counter(pair for order in orders for pair in zip(order, order[1:]))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1


@pytest.mark.parametrize("where", ["missing-folder", "a-folder", "unwritable"])
def test_json_that_cannot_be_written_is_refused_before_the_run(where, tmp_path, capsys, monkeypatch):
    """`--json` into a folder that does not exist (or at a folder, or where nothing can be written) failed after the
    whole run, its results lost; it is one line before anything runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("the bench ran")

    monkeypatch.setattr(bench, "run_workers", refuse)
    monkeypatch.setattr(bench, "Runner", refuse)
    path = {"missing-folder": tmp_path / "nope" / "bench.json", "a-folder": tmp_path,
            "unwritable": "/proc/ddl-bench.json"}[where]
    with pytest.raises(SystemExit) as stop:
        bench.main(["--variants", "llama", "ddl-cc", "--repeats", "1", "--json", str(path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "error: --json" in err and {"missing-folder": "does not exist", "a-folder": "is a folder",
                                       "unwritable": "cannot write in"}[where] in err, err
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("device, message", [("foo", "is not a device"), ("cuda:99", "CUDA device"),
                                             ("meta", "bench.py runs on cpu or cuda")])
def test_a_device_that_cannot_run_here_is_one_line_before_the_run(device, message, capsys):
    """(A typo was a traceback; cuda on a machine without it, a traceback in each worker and exit status 1.)"""
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--device", device])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_json_naming_an_existing_file_is_refused_before_the_run_unless_told_to_replace_it(tmp_path, capsys,
                                                                                          monkeypatch):
    """`--json` at an existing file (an earlier bench's results, or anything else) wrote over it when the run ended;
    it is one line before anything runs, and `--overwrite` replaces it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the bench ran")

    monkeypatch.setattr(bench, "run_workers", refuse)
    monkeypatch.setattr(bench, "Runner", refuse)
    earlier = tmp_path / "bench.json"
    earlier.write_text('{"rows": "an earlier run"}')
    with pytest.raises(SystemExit) as stop:
        bench.main(["--variants", "llama", "ddl-cc", "--repeats", "1", "--json", str(earlier)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "error: --json" in err and "exists" in err and "--overwrite" in err, err
    assert earlier.read_text() == '{"rows": "an earlier run"}'
    assert bench.parse_args(["--json", str(earlier), "--overwrite"]).overwrite


def test_a_json_file_made_while_the_bench_ran_is_kept_and_the_results_written_beside_it(tmp_path, capsys):
    """The check before the run cannot see a file another run makes meanwhile: the results do not replace it."""
    path = tmp_path / "bench.json"
    args = bench.parse_args(["--json", str(path)])
    path.write_text("another run's")
    written = bench.write_results(args, {"rows": []})
    assert path.read_text() == "another run's" and written != str(path)
    assert json.loads(open(written).read()) == {"rows": []} and written in capsys.readouterr().out


def test_a_second_bench_into_a_timeline_folder_being_written_is_refused(tmp_path, capsys, monkeypatch):
    """The --memory_timeline folder was locked only while the timelines were written, at the end: a second bench
    into the same (empty) folder ran in full and overwrote the first one's files. It is claimed before anything
    runs, and a second bench stops with one line naming the writer."""
    from ddl_tools.outputs import FolderLock

    monkeypatch.setattr(bench, "run_workers", lambda *a, **k: pytest.fail("the bench ran"))
    folder = tmp_path / "timeline"
    folder.mkdir()
    lock = FolderLock(str(folder))  # another open file: flock treats it as another writer, as another process
    assert lock.acquire()
    try:
        with pytest.raises(SystemExit) as stop:
            bench.main(["--variants", "llama", "ddl-cc", "--memory_timeline", str(folder)])
        assert stop.value.code == 2
        assert f"is being written by another run (pid {os.getpid()})" in capsys.readouterr().err
    finally:
        lock.release()


def test_the_triton_seams_forward_launches_fewer_kernels_than_llamas_add_and_norm():
    """scripts/launch_count.py: a training step's kernel launches (what a GPU step that waits on the CPU pays for),
    counted on CPU through Triton's interpreter. The seam replaces Llama's residual add by one kernel, and at d_v=1 the
    attention seam also makes post_attention_layernorm's output: d_v=1's forward and its decoded token (inside
    `generate`) launch fewer kernels than Llama's; a training step of d_v=1 and of TC+EC at most
    1.10x Llama's (the seam's backward, the weights' gradients included, two launches; TC's readouts with their norms)
    and fewer than the specification's; TC's decoded token at most 1.02x Llama's with its Triton steps (each readout
    writing its sublayer's RMSNorm), where the specification's launch more."""
    pytest.importorskip("triton")
    script = os.path.join(os.path.dirname(bench.__file__), "scripts", "launch_count.py")
    done = subprocess.run([sys.executable, script, "--variants", "ddl-dv1", "ddl-tc", "--json"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["ddl-dv1"]["Triton"][0] < result["llama"][0]
    for variant in ("ddl-dv1", "ddl-tc"):  # (TC: its readouts over K tokens, each with its sublayer's RMSNorm)
        ways = result[variant]
        assert ways["Triton"][1] <= 1.10 * result["llama"][1], variant  # (issue 58's bound)
        for part in (0, 1):  # forward, forward + backward
            assert ways["Triton"][part] < ways["PyTorch"][part], (variant, part)
    done = subprocess.run([sys.executable, script, "--variants", "ddl-dv1", "ddl-tc", "--decoding", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])  # (a decoded token: the seam and TC's, EC's steps in Triton)
    assert result["ddl-dv1"]["Triton"] < result["llama"]
    assert result["ddl-tc"]["Triton"] <= 1.02 * result["llama"] < result["ddl-tc"]["PyTorch"]  # (issue 58's bound)


def test_the_triton_path_keeps_no_more_than_its_states_and_outputs_beyond_llama():
    """scripts/triton_memory.py: the peak of a bf16 training step on the Triton path (its kernels' launches stubbed,
    their wrappers' allocations real), measured on CPU. Beyond Llama's, a seam's backward needs its state X and its
    sublayer's output h (its kernels recompute the rest) and the readouts and EC recompute from the states: d_v = 4
    variants may keep at most those bytes more than Llama, and every variant less than its PyTorch path."""
    pytest.importorskip("triton")
    script = os.path.join(os.path.dirname(bench.__file__), "scripts", "triton_memory.py")
    done = subprocess.run([sys.executable, script, "--size", "tiny", "--json"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    size = bench.SIZES["tiny"]
    tokens, seams = size.batch_size * size.seq_len, 2 * size.num_hidden_layers
    states_and_outputs = seams * tokens * (4 * size.hidden_size + size.hidden_size) * 2  # (bf16 X and h, d_v = 4)
    for variant in ("ddl-dv1", "ddl-cc", "ddl-tc"):
        assert result[variant]["Triton"] < result[variant]["PyTorch"], variant
    for variant in ("ddl-cc", "ddl-tc"):
        assert result[variant]["Triton"] - result["llama"] <= states_and_outputs, (variant, result)


def test_every_triton_kernel_compiles_for_an_h200_without_spilling():
    """scripts/triton_sm90.py: Triton's compiler (not the interpreter the kernel tests run on) builds every kernel
    for sm_90 here, and at the paper's small size none spills registers to local memory."""
    pytest.importorskip("triton")
    script = os.path.join(os.path.dirname(bench.__file__), "scripts", "triton_sm90.py")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=300)
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| _")]
    assert done.returncode == 0 and len(rows) == 35, done.stdout + done.stderr
    assert all(row[-1].strip() == "0" for row in rows), done.stdout


def test_ab_cpu_kernels_times_two_builds_in_one_process(tmp_path):
    """scripts/ab_cpu_kernels.py: two checkouts' C++ kernels loaded into one process and alternated call by call; with
    this checkout on both sides (an A/A run) every figure is a ratio of two timings of one build. A folder that holds
    no checkout gets one line saying what to give, before anything is built."""
    from ddl_kernels import build

    if build.kernels() is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    script = os.path.join(os.path.dirname(bench.__file__), "scripts", "ab_cpu_kernels.py")
    checkout = os.path.dirname(os.path.dirname(script))
    done = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "holds no ddl_kernels/build.py" in done.stderr, done.stderr
    for mode in ([], ["--train"]):
        done = subprocess.run([sys.executable, script, checkout, "--size", "tiny", "--variants", "ddl-cc", "--batch",
                               "1", "--new_tokens", "4", "--pairs", "2", *mode], capture_output=True, text=True,
                              cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert "the same build: an A/A run" in lines[1], lines
        figures = [line for line in lines if "new/old speed:" in line]
        assert len(figures) == 1 and ("training step" in figures[0]) == bool(mode), lines
        ratio = float(figures[0].split("new/old speed: ")[1].split()[0])
        assert 0.05 < ratio < 20, figures  # (2 pairs of sub-millisecond calls beside a busy suite: 0.19 was seen)


def _ab_cpu_kernels():
    import importlib.util

    path = os.path.join(os.path.dirname(bench.__file__), "scripts", "ab_cpu_kernels.py")
    spec = importlib.util.spec_from_file_location("ab_cpu_kernels", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_ab_cpu_kernels_sends_the_calls_to_each_build_in_turn(monkeypatch):
    """What the model's kernel calls reach (`ddl_kernels.build.kernels()`) is the old build, then the new, in ABBA
    order after one untimed call each; each ratio is old time over new time; the new build is left in place."""
    from types import SimpleNamespace

    from ddl_kernels import build

    script = _ab_cpu_kernels()
    monkeypatch.setattr(build, "_ops", build._ops)  # (restored after the test)
    old, new, reached = SimpleNamespace(name="old"), SimpleNamespace(name="new"), []
    clock = iter(range(100))
    monkeypatch.setattr(script, "time", SimpleNamespace(perf_counter=lambda: next(clock) * (1 + (build._ops is old))))
    ratios = script.compare(lambda: reached.append(build.kernels().name), new, old, pairs=3)
    assert reached == ["old", "new", "old", "new", "new", "old", "old", "new"]
    assert ratios == [2.0, 2.0, 2.0]  # (each old call timed as twice as long)
    assert build.kernels() is new


def test_ab_cpu_kernels_refuses_builds_called_differently():
    """Two builds are swapped under one checkout's Python only where every kernel takes as many arguments: by its
    signature (the ctypes functions), or by its docstring's first line (a torch extension's pybind11 functions)."""
    from types import SimpleNamespace

    script = _ab_cpu_kernels()

    class Pybind:  # a torch extension's function: no signature, its arguments on its docstring's first line
        __signature__ = property(lambda self: (_ for _ in ()).throw(ValueError("no signature found for builtin")))

        def __init__(self, doc):
            self.__doc__ = doc

        def __call__(self, *args):
            pass

    new = SimpleNamespace(step=lambda past, x: x, forward=lambda x, taps, extra: x)
    assert script.mismatched(SimpleNamespace(step=lambda a, b: a, forward=lambda a, b, c: a), new) == []
    assert script.mismatched(SimpleNamespace(step=Pybind("step(arg0: Tensor, arg1: Tensor) -> Tensor\n\nwords"),
                                             forward=Pybind("forward(arg0: Tensor, arg1: Tensor, arg2: float)")),
                             new) == []
    assert script.mismatched(SimpleNamespace(step=lambda a: a, forward=lambda a, b, c: a), new) == ["step"]
    assert script.mismatched(SimpleNamespace(step=Pybind("step(arg0: Tensor) -> Tensor"),
                                             forward=lambda a, b, c: a), new) == ["step"]
    assert script.mismatched(SimpleNamespace(step=lambda a, b: a), new) == ["forward"]
