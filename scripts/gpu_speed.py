"""The one prepared GPU speed check of issue 58: DDL against Llama in every regime users train and decode in, within
one device call, each part under its own time limit, Llama re-run in every part, one results file.

    python3 scripts/gpu_speed.py                        # on the GPU machine: about 8 minutes, $OUT/gpu_speed.md
    BUDGET=300 python3 scripts/gpu_speed.py --second --implementation triton   # a second call, if one fits
    python3 scripts/gpu_speed.py --device cpu           # the dry run: every part on CPU at tiny sizes

Parts (the first call; docs/gpu.md says what each measures):
  versions   the card (name, driver, clocks), Python, torch, CUDA, Triton, transformers, accelerate
  kernels    (a) the Triton kernel tests on the device (tests/test_kernels.py -k triton): if they pass, the parts
             below run DDL with ddl_implementation="triton", else with "auto" (PyTorch) and say so
  train      (b) eager training at 8 x 1024 and 32 x 1024, bf16 weights: forward+backward micro-steps timed apart
             from one step of clipping and AdamW(fused=True); GPU-busy time and kernels per micro-step from one
             profiled micro-step; (e) peak training memory
  compile    (c) compiled training at 32 x 1024 against compiled Llama: the decoder layers compiled (regional
             compilation: identical layers compile once, which fits the part's limit; the whole model is the second
             call's); compile seconds, graph breaks, graphs compiled during the timed steps (recompiles)
  decode     (d) eager `generate` and compiled static-cache `generate` (CUDA graphs on CUDA) at batch 1 and 8
and with --second: autocast (16 x 1024 under bf16 autocast with fp32 weights, train.py's regime through accelerate;
CC+EC also with its state in bf16, `ddl_autocast_state`)
and compile_full (the whole model compiled at 32 x 1024, TC+EC first after Llama).

Models: Llama, DDL d_v=1, CC+EC, TC+EC from bench.py's builders at its `small` size (the paper's 12 x 768), one GPU.
Every figure is a ratio to Llama measured in the same part and mode, paired by repeat (the models interleaved in
bench.py's balanced order); absolute tok/s, kernels, GPU-busy and host ms and peak memory are kept for calibrating the
CPU proxies. A part that fails or runs out of time is recorded and the check goes on; none runs past BUDGET seconds
from the start (560 on CUDA: a device call has 600). Inside a part, models and repeats that would not fit its limit
are left out (and said so) rather than killed half-way. Packages the machine lacks travel as wheels in .whl/.
"""

import argparse
import datetime
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from ddl_tools.outputs import die_with_parent, first_line, write_json, write_text  # noqa: E402  (torch only)

VARIANTS = ["llama", "ddl-dv1", "ddl-cc", "ddl-tc"]
LABELS = {"llama": "Llama", "ddl-dv1": "d_v=1", "ddl-cc": "CC+EC", "ddl-tc": "TC+EC",
          "ddl-cc-bf16-state": "CC+EC, bf16 state"}
# under autocast, beside CC+EC: its state in autocast's dtype (`ddl_autocast_state`, the authors' regime)
BF16_STATE = "ddl-cc-bf16-state"

# name: (title, limit on CUDA, limit in the CPU dry run), in seconds. The first call's limits add up to the 8
# minutes; a part may also use what the earlier ones left unused of theirs (`Check.run_part`), none the BUDGET's end.
PARTS = {
    "versions": ("Card and versions", 30, 120),
    "kernels": ("(a) The Triton kernel tests on the device", 80, 300),
    "train": ("(b) Eager training, fused AdamW, and (e) peak memory", 130, 600),
    "compile": ("(c) Compiled training (the decoder layers compiled)", 120, 600),
    "decode": ("(d) Decoding: eager and compiled static-cache `generate`", 120, 600),
    "autocast": ("Eager training under bf16 autocast (train.py's regime)", 100, 600),
    "compile_full": ("Compiled training (the whole model compiled)", 200, 600),
}
FIRST = ["versions", "kernels", "train", "compile", "decode"]
SCOPES = {"regional": "decoder layers compiled", "full": "whole model compiled"}
SECOND = ["versions", "kernels", "autocast", "compile_full"]
WORKER_MARGIN_S = 12  # a worker plans to end this long before its part's limit (its last repeat, the JSON)

# The targets: (row, regimes (all must meet), figure, comparison, targets for d_v=1, CC+EC, TC+EC).
TARGETS = [
    ("eager training, {eager_small} (host-bound)", ["eager_small"], "tok_s", ">=", (0.90, 0.85, 0.85)),
    ("eager training, {eager_large} (GPU-bound)", ["eager_large"], "tok_s", ">=", (0.95, 0.90, 0.87)),
    ("compiled training, {compiled}, against compiled Llama ({scope})", ["compiled"], "tok_s", ">=",
     (0.95, 0.85, 0.82)),
    ("compiled static-cache `generate` ({graphs}), batch 1 and 8", ["decode_compiled_b1", "decode_compiled_b8"],
     "tok_s", ">=", (0.97, 0.95, 0.93)),
    ("eager `generate`, batch 1 and 8", ["decode_eager_b1", "decode_eager_b8"], "tok_s", ">=", (0.95, 0.90, 0.90)),
    ("peak training memory, {eager_small}", ["eager_small"], "peak_mb", "<=", (1.05, 1.10, 1.12)),
    # the second call's: autocast from the review of 2026-12-05 (section 5.1), whole-model compile from the issue
    ("eager training, {autocast} under bf16 autocast (fp32 weights)", ["autocast"], "tok_s", ">=", (0.93, 0.85, 0.82)),
    ("compiled training, {compiled_full}, against compiled Llama (whole model compiled)", ["compiled_full"],
     "tok_s", ">=",
     (0.95, 0.85, 0.82)),
]


def settings(device, args):
    """What each part runs: the issue's shapes on CUDA; the dry run's tiny stand-ins on CPU (seconds per part)."""
    gpu = device == "cuda"
    return {
        "device": device,
        "size": "small" if gpu else "tiny",
        "seq_len": 1024 if gpu else 32,
        "batches": {"eager_small": 8, "eager_large": 32, "compiled": 32, "compiled_full": 32, "autocast": 16}
        if gpu else {"eager_small": 1, "eager_large": 2, "compiled": 2, "compiled_full": 2, "autocast": 2},
        "micro_steps": args.micro_steps or (5 if gpu else 2),
        "repeats": args.repeats or (3 if gpu else 2),
        "decode_batches": [1, 8],
        "new_tokens": {"eager": 32, "compiled": 64} if gpu else {"eager": 3, "compiled": 3},
        "variants": args.variants,
        "compile_backend": args.compile_backend,
        "compile_scope": args.compile_scope,
        "memory_large": gpu,  # the CPU's memory timeline is slow: the dry run measures the small batch only
    }


# -------------------------------------------------------------------------------------------------------------------
# The workers: one part each, in a process of its own (a part that crashes or hangs takes nothing else with it).


class Results:
    """A part's figures, written after each one (a part stopped at its limit keeps what it measured): samples (one
    value per model and repeat, paired into ratios), facts (one value per model: profiles, memory, compile times)
    and notes."""

    def __init__(self, path):
        self.path = path
        self.data = {"samples": [], "facts": {}, "notes": [], "fell_back": []}
        self.save()

    def save(self):
        write_json(self.path, self.data)

    def sample(self, regime, model, repeat, **values):
        self.data["samples"].append({"regime": regime, "model": model, "repeat": repeat, **values})
        self.save()

    def fact(self, regime, model, **values):
        self.data["facts"].setdefault(regime, {}).setdefault(model, {}).update(values)
        self.save()

    def note(self, text):
        print(f"gpu_speed.py: {text}", flush=True)
        self.data["notes"].append(text)
        self.save()

    def kernels_fell_back(self):
        """ddl_kernels' kernels that failed to compile or launch in this process (the specification served them)."""
        try:
            import ddl_kernels
        except ImportError:
            return
        failed = sorted(getattr(ddl_kernels, "_failed", ()))
        if failed != self.data["fell_back"]:
            self.data["fell_back"] = failed
            self.save()


class Clock:
    """The part's time left until `end` (seconds since the epoch: the driver's clock, which started the part before
    this process imported anything), and whether something that took `seconds` last time fits again."""

    def __init__(self, end):
        self.end = end

    def left(self):
        return self.end - time.time()

    def fits(self, seconds):
        return self.left() > 1.2 * seconds


def speed_runner_class():
    """bench.Runner with what this check times differently (a class made here: bench imports torch and transformers,
    which a worker imports only after the carried wheels are on its path)."""
    import torch

    import bench

    class SpeedRunner(bench.Runner):
        """One model: forward+backward micro-steps timed apart from one optimizer step (clipping, AdamW(fused=True)
        as Trainer's `adamw_torch_fused`, gradients cleared), pure-dtype weights or fp32 weights under bf16 autocast
        (accelerate's mixed precision), eager or compiled (the whole model, or each decoder layer)."""

        def __init__(self, name, model, size, device, autocast=False, compile_scope=None, backend="inductor"):
            super().__init__(name, model, size, device, compile_model=False)
            defaults = self.optimizer.defaults  # bench's (train.py's) hyperparameters, fused
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=defaults["lr"], betas=defaults["betas"],
                                               weight_decay=defaults["weight_decay"], fused=True)
            self.autocast = autocast
            if compile_scope == "full":
                self.step_fn = torch.compile(model, backend=backend)
            elif compile_scope == "regional":
                for layer in model.model.layers:
                    layer.compile(backend=backend)
            self.batches = {}

        def use_batch(self, batch_size):
            """Random tokens of `batch_size` sequences (each model gets the same ones)."""
            if batch_size not in self.batches:
                g = torch.Generator().manual_seed(batch_size)
                shape = (batch_size, self.size.seq_len)
                self.batches[batch_size] = torch.randint(3, self.size.vocab_size, shape, generator=g).to(self.device)
            self.batch = self.batches[batch_size]

        def micro_step(self):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                loss = self.step_fn(input_ids=self.batch, labels=self.batch).loss
            loss.backward()

        def optimizer_step(self):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

        def train_step(self):  # (what bench's memory measurements run)
            self.model.train()
            self.micro_step()
            self.optimizer_step()

        def time_micro_steps(self, steps):
            """tok/s and ms of `steps` micro-steps after an untimed one (the blocks the previous model left the
            allocator), the host's ms per micro-step (until the call returns, the GPU maybe still busy: close to the
            step's ms when the step waits on the host), then one timed optimizer step."""
            self.model.train()
            self.micro_step()
            bench.sync(self.device)
            host, start = [], time.perf_counter()
            for _ in range(steps):
                t = time.perf_counter()
                self.micro_step()
                host.append(time.perf_counter() - t)
            bench.sync(self.device)
            wall = time.perf_counter() - start
            t = time.perf_counter()
            self.optimizer_step()
            bench.sync(self.device)
            return {"tok_s": steps * self.batch.numel() / wall, "step_ms": wall / steps * 1e3,
                    "host_ms": statistics.median(host) * 1e3, "optimizer_ms": (time.perf_counter() - t) * 1e3}

        def peak_memory_mb(self):
            """Peak bytes of one training step as if this model were alone on the device: on CUDA the allocator's
            peak over the step less what was allocated before it (the other models' tensors, constant meanwhile),
            plus this model's own parameters and AdamW state; on CPU the profiler's memory timeline (bench)."""
            if self.device.type != "cuda":
                return self.peak_train_memory() / 2**20
            if any(p.grad is not None for p in self.model.parameters()):
                self.optimizer_step()  # (from a step that starts as a training step does: no gradients)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self.train_step()
            torch.cuda.synchronize()
            own = sum(p.numel() * p.element_size() for p in self.model.parameters())
            own += sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                       for t in state.values() if torch.is_tensor(t) and t.device.type == "cuda")
            return (torch.cuda.max_memory_allocated() - before + own) / 2**20

    return SpeedRunner


def compile_counts():
    """Graphs compiled, graph breaks and CUDA graphs skipped (Inductor's reason is in the log) so far in this
    process, from torch._dynamo's counters."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


def counted_since(before):
    now = compile_counts()
    return {key: now[key] - before[key] for key in now}


def profile_call(fn, device):
    """fn once under torch.profiler: kernels launched and their summed time (GPU-busy ms); None on CPU."""
    from gpu_profile import profiled

    wall, busy, kernels, _ = profiled(fn, device)
    if device.type != "cuda":
        return {"profiled_ms": wall}
    return {"kernels": kernels, "busy_ms": busy, "profiled_ms": wall}


class Worker:
    """What every part's worker shares: the configuration, the device, model building, the repeats."""

    def __init__(self, config, results, clock):
        import torch

        import bench

        self.torch, self.bench = torch, bench
        self.config, self.res, self.clock = config, results, clock
        self.device = torch.device(config["device"])
        size = bench.SIZES[config["size"]]
        self.size = replace(size, seq_len=config["seq_len"])
        self.implementation = config["implementation"]
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # (the dry run's tiny models: threads only wait on each other)
        else:
            torch._logging.set_logs(perf_hints=True)  # (Inductor's reason for each CUDA graph it skips, in the log)
        for name, value in (("recompile_limit", 64), ("accumulated_recompile_limit", 1024)):
            if hasattr(torch._dynamo.config, name):  # one model class compiled for every variant and batch
                setattr(torch._dynamo.config, name, value)
        self.SpeedRunner = speed_runner_class()
        backend = config["compile_backend"]
        if backend != "inductor":  # (a quick dry run: generate's compiled decoding step on that backend too, in
            made = bench.compiled_decoding  # this worker process only; CUDA graphs are Inductor's mode)

            def compiled_decoding():
                compile_config = made()
                compile_config.backend, compile_config.mode = backend, None
                return compile_config

            bench.compiled_decoding = compiled_decoding

    def runner(self, variant, dtype="bfloat16", **kwargs):
        model = self.bench.build(variant, self.size, self.device, getattr(self.torch, dtype), self.implementation)
        return self.SpeedRunner(variant, model, self.size, self.device, **kwargs)

    def free(self, runners):
        runners.clear()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()

    def attempt(self, regime, runner, what, fn):
        """fn(); where it raises (out of GPU memory, a compile error), the model is left out of `regime` and said so,
        its traceback goes to the log, and the other models go on. Returns whether fn ran."""
        try:
            fn()
            return True
        except Exception as err:
            traceback.print_exc()
            self.res.note(f"{regime}: {runner.name} left out: {what} raised {type(err).__name__}: {first_line(err)}")
            runner.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                self.torch.cuda.empty_cache()
            return False

    def repeats(self, regime, runners, measure):
        """`measure(runner)` for each model in bench's balanced order, repeat after repeat, while another repeat fits
        the part's limit (at least one: a first repeat that does not fit is cut by the limit, keeping what ran)."""
        took, failed = 0.0, set()
        for repeat in range(self.config["repeats"]):
            if repeat and not self.clock.fits(took):
                self.res.note(f"{regime}: {repeat} of {self.config['repeats']} repeats, to fit the part's limit")
                break
            start = time.monotonic()
            for runner in self.bench.balanced_order(runners, repeat):
                sample = {}
                if runner.name in failed:
                    continue
                if self.attempt(regime, runner, "a timed repeat", lambda r=runner: sample.update(measure(r))):
                    self.res.sample(regime, runner.name, repeat, **sample)
                else:
                    failed.add(runner.name)
            took = time.monotonic() - start
            self.res.kernels_fell_back()

    def training(self, regimes, dtype="bfloat16", autocast=False):
        """Eager training: per regime (a batch size), each model warmed up, one profiled micro-step and optimizer
        step, its peak memory, then the timed repeats; the models built once for all regimes."""
        runners = [self.runner(v, dtype, autocast=autocast) for v in self.config["variants"]]
        if autocast and "ddl-cc" in self.config["variants"]:
            runners.append(self.runner("ddl-cc", dtype, autocast=True))
            runners[-1].name, runners[-1].model.config.ddl_autocast_state = BF16_STATE, True
        for regime in regimes:
            batch_size, ready = self.config["batches"][regime], []

            def prepare(runner):
                runner.use_batch(batch_size)
                runner.train_step()  # AdamW's state, the kernels' first launches (Triton compiles them here)
                micro = profile_call(runner.micro_step, self.device)
                optimizer = profile_call(runner.optimizer_step, self.device)
                self.res.fact(regime, runner.name, batch=batch_size, seq_len=self.size.seq_len, **micro,
                              **{f"optimizer_{k}": v for k, v in optimizer.items()})
                if regime == regimes[0] or self.config["memory_large"]:
                    self.res.fact(regime, runner.name, peak_mb=runner.peak_memory_mb())

            for runner in runners:
                if self.attempt(regime, runner, "its warm-up, profile or memory step", lambda r=runner: prepare(r)):
                    ready.append(runner)
            self.res.kernels_fell_back()
            steps = self.config["micro_steps"]
            self.repeats(regime, ready, lambda r: r.time_micro_steps(steps))
        self.free(runners)

    def compiled_training(self, regime, scope):
        """Compiled training at one batch: each model compiled and warmed up (3 micro-steps: DDL's first steps may
        recompile once), those whose compilation would not fit the part's limit left out; then the timed repeats."""
        batch_size, backend = self.config["batches"][regime], self.config["compile_backend"]
        runners, longest = [], 0.0

        def compile_and_warm_up(runner):
            runner.use_batch(batch_size)
            runner.model.train()
            before = compile_counts()
            start = time.perf_counter()
            runner.micro_step()
            self.bench.sync(self.device)
            first = time.perf_counter() - start
            for _ in range(2):
                runner.micro_step()
            runner.optimizer_step()
            self.bench.sync(self.device)
            runner.step_s = (time.perf_counter() - start - first) / 3  # (a warm micro-step, about)
            self.res.fact(regime, runner.name, batch=batch_size, seq_len=self.size.seq_len, scope=scope,
                          backend=backend, compile_s=first, warmup_s=time.perf_counter() - start,
                          **counted_since(before))

        for variant in self.config["variants"]:
            # a DDL model's compilation takes longer than Llama's: twice Llama's, then the longest so far; and one
            # repeat of every model (its profiled step too) must fit after it
            repeat = sum((self.config["micro_steps"] + 3) * r.step_s + 3 for r in runners)
            expected = longest * (2 if len(runners) == 1 else 1) + 10 + repeat * (len(runners) + 1) / max(
                len(runners), 1)
            if runners and not self.clock.fits(expected):
                self.res.note(f"{regime}: {variant} left out: its compilation (~{expected:.0f} s) would not fit the "
                              f"part's limit ({self.clock.left():.0f} s left)")
                continue
            start = time.monotonic()
            runner = self.runner(variant, compile_scope=scope, backend=backend)
            if self.attempt(regime, runner, "its compilation", lambda r=runner: compile_and_warm_up(r)):
                runners.append(runner)
            longest = max(longest, time.monotonic() - start)
        def profile(runner):
            self.res.fact(regime, runner.name, **profile_call(runner.micro_step, self.device))
            runner.optimizer_step()

        for runner in list(runners):
            if self.clock.fits(10) and not self.attempt(regime, runner, "its profiled step",
                                                        lambda r=runner: profile(r)):
                runners.remove(runner)
        before = compile_counts()
        steps = self.config["micro_steps"]
        self.repeats(regime, runners, lambda r: r.time_micro_steps(steps))
        if runners:
            self.res.fact(regime, "all", graphs_during_timed_steps=counted_since(before)["graphs"])
        self.free(runners)

    def decoding(self):
        """Eager `generate` at batch 1 and 8 (and a decoded token's kernels: 6 new tokens' less 2's, over 4), then
        compiled static-cache `generate` (the decoding step compiled, CUDA graphs on CUDA) per batch: each model's
        first call compiles, its second warms up, then the repeats."""
        batches, tokens = self.config["decode_batches"], self.config["new_tokens"]
        runners, ready = [self.runner(v) for v in self.config["variants"]], []
        for runner in runners:
            runner.compiled = False  # (a process's first generate of a model sets up what the next ones reuse)
            if self.attempt("decode_eager", runner, "its first generate", lambda r=runner: [
                    r.time_decode(b, 2) for b in batches]):
                ready.append(runner)
        for b in batches:
            self.repeats(f"decode_eager_b{b}", ready, lambda r, b=b: {"tok_s": r.time_decode(b, tokens["eager"])})

        def per_token(runner):
            few, more = (profile_call(lambda n=n: runner.time_decode(1, n), self.device) for n in (2, 6))
            self.res.fact("decode_eager_b1", runner.name, **{f"{k}_per_token": (more[k] - few[k]) / 4 for k in few})

        for runner in ready:
            if self.clock.fits(10):
                self.attempt("decode_eager_b1", runner, "its profiled generate", lambda r=runner: per_token(r))
        self.res.kernels_fell_back()
        for b in batches:
            regime, compiled, longest = f"decode_compiled_b{b}", [], 0.0

            def compile_and_warm_up(runner):
                runner.compiled = True
                before = compile_counts()
                start = time.perf_counter()
                runner.time_decode(b, tokens["compiled"])
                first = time.perf_counter() - start
                runner.time_decode(b, tokens["compiled"])
                runner.generate_s = time.perf_counter() - start - first
                self.res.fact(regime, runner.name, compile_s=first, **counted_since(before))

            for runner in runners:  # (as in compiled_training: its compilation, then one repeat of all)
                repeat = sum(r.generate_s for r in compiled) * (len(compiled) + 1) / max(len(compiled), 1)
                expected = longest * (1.5 if len(compiled) == 1 else 1) + 5 + repeat
                if compiled and not self.clock.fits(expected):
                    self.res.note(f"{regime}: {runner.name} left out: its compilation (~{expected:.0f} s) would not "
                                  f"fit the part's limit ({self.clock.left():.0f} s left)")
                    continue
                start = time.monotonic()
                if self.attempt(regime, runner, "its compilation", lambda r=runner: compile_and_warm_up(r)):
                    compiled.append(runner)
                longest = max(longest, time.monotonic() - start)
            before = compile_counts()
            self.repeats(regime, compiled, lambda r, b=b: {"tok_s": r.time_decode(b, tokens["compiled"])})
            if compiled:
                self.res.fact(regime, "all", graphs_during_timed_steps=counted_since(before)["graphs"])
        self.free(runners)


def versions(config):
    """The card and the software, as one dict (what cannot be read is said so)."""
    import platform

    found = {"python": platform.python_version()}
    try:
        query = "name,driver_version,memory.total,clocks.max.sm,clocks.sm,clocks.max.mem,power.limit,pstate"
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        found["nvidia-smi"] = (smi.stdout.strip() or smi.stderr.strip()).splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError) as err:
        found["nvidia-smi"] = f"not available ({type(err).__name__})"
    import torch

    found.update(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        found["gpu"] = (f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
                        f"{p.multi_processor_count} SMs")
    for name in ("triton", "transformers", "accelerate"):
        try:
            module = __import__(name)
            found[name] = module.__version__
            found[f"{name}_from"] = os.path.dirname(os.path.dirname(module.__file__))  # (the carried wheels'?)
        except Exception as err:  # a package that does not import is a result, not a failure of this part
            found[name] = f"not importable ({type(err).__name__}: {str(err)[:200]})"
    try:
        import bench  # noqa: F401  (imports ddl and transformers: what every later part needs)

        found["ddl"] = "imports"
    except Exception as err:
        found["ddl"] = f"does not import ({type(err).__name__}: {str(err)[:300]})"
    return found


def worker_main(args):
    with open(args._config, encoding="utf-8") as f:
        config = json.load(f)
    if args._part == "versions":
        write_json(args._result, {"versions": versions(config)})
        return 0
    res = Results(args._result)
    worker = Worker(config, res, Clock(float(args._deadline)))
    if args._part == "train":
        worker.training(["eager_small", "eager_large"])
    elif args._part == "autocast":
        worker.training(["autocast"], dtype="float32", autocast=True)
    elif args._part == "compile":
        worker.compiled_training("compiled", config["compile_scope"])
    elif args._part == "compile_full":
        worker.compiled_training("compiled_full", "full")
    elif args._part == "decode":
        worker.decoding()
    res.kernels_fell_back()
    return 0


# -------------------------------------------------------------------------------------------------------------------
# The driver: parts under their limits, the results file rewritten after each (stdlib only: no torch or transformers
# is imported before the carried wheels are on the workers' path).


class PartRunner:
    """Runs one command at a time under a time limit, in a process group of its own that is ended (SIGTERM, then
    SIGKILL) at the limit or when this script is interrupted."""

    def __init__(self):
        self.current = None

    def run(self, cmd, limit, log, env):
        start = time.monotonic()
        with open(log, "ab") as out:
            with_parent = die_with_parent()

            def preexec():
                os.setpgrp()  # (a process group, not a session: the device tool still ends it with the call)
                with_parent()

            self.current = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            preexec_fn=preexec)
            try:
                code = self.current.wait(timeout=max(limit, 1))
                status = "ok" if code == 0 else f"failed (exit {code})"
            except subprocess.TimeoutExpired:
                self.stop()
                code, status = None, f"stopped at its {limit:.0f} s limit"
            finally:
                self.current = None
        return {"status": status, "exit": code, "seconds": round(time.monotonic() - start, 1), "limit": round(limit)}

    def stop(self):
        process = self.current
        if process is None or process.poll() is not None:
            return
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue


def last_error(log, limit=300):
    """The last line of a log that names an error (for the parts table), else its last line."""
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f.read()[-200_000:].splitlines() if line.strip()]
    except OSError:
        return ""
    errors = [line for line in lines if re.search(r"Error|error:|Exception|FAILED|Killed|Traceback", line)]
    return (errors or lines or [""])[-1][:limit]


def pytest_summary(log):
    """({'passed': n, 'failed': n, ...}, the FAILED/ERROR lines, whether pytest reached its summary line): a run
    stopped at its limit is counted from pytest's progress characters (-q: one per test)."""
    counts, failed, progress = {}, [], {}
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return counts, failed, False
    for line in text.splitlines():
        if line.startswith(("FAILED", "ERROR ")):
            failed.append(line[:300])
        if re.fullmatch(r"[.FEsxX]+\s*(\[\s*\d+%\])?", line.strip()):
            for char, word in zip(".FEs", ("passed", "failed", "error", "skipped"), strict=True):
                progress[word] = progress.get(word, 0) + line.count(char)
        if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s", line):
            counts = {"error" if word.startswith("error") else word: int(n)
                      for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", line)}
    if counts:
        return counts, failed, True
    return {word: n for word, n in progress.items() if n}, failed, False


class Check:
    """The driver's state: settings, the parts' outcomes and figures, the results files."""

    def __init__(self, args):
        self.args = args
        self.device = args.device
        self.config = settings(args.device, args)
        self.name = "gpu_speed_second" if args.second else "gpu_speed"
        self.out = os.path.realpath(args.out)
        self.md, self.json, self.log = (os.path.join(self.out, f"{self.name}.{ext}") for ext in ("md", "json", "log"))
        self.started = time.monotonic()
        self.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
        self.parts = {}  # name -> outcome (status, seconds, limit, note) and figures
        self.meta = {"call": "second" if args.second else "first", "device": self.device, "budget_s": args.budget,
                     "settings": self.config, "date": self.date,
                     "implementation": None, "implementation_why": "", "wheels": "none carried (.whl/ is empty)"}
        self.runner = PartRunner()
        self.planned = args.budget  # (the parts' limits added up, once `main` knows the parts)
        self.work = tempfile.mkdtemp(prefix="gpu_speed-")

    def left(self):
        return self.args.budget - (time.monotonic() - self.started)

    def env(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY=os.environ.get("TRANSFORMERS_VERBOSITY",
                                                                                         "warning"))
        site = os.path.join(self.work, "site")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site if os.path.isdir(site) else "", ROOT,
                                                        os.environ.get("PYTHONPATH", "")) if p)
        if self.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run's CPU even on a GPU machine
            env.setdefault("DDL_CPU_KERNEL", "0")  # (the C++ CPU kernels are no part of the GPU's paths)
        else:
            env.pop("TRITON_INTERPRET", None)  # (the interpreter would run the kernels on the host)
        return env

    def install_wheels(self):
        """Packages the machine lacks, carried as wheels in .whl/ (docs/gpu.md), into a private folder on the
        workers' path."""
        wheels = sorted(os.path.join(ROOT, ".whl", w) for w in os.listdir(os.path.join(ROOT, ".whl"))
                        if w.endswith(".whl")) if os.path.isdir(os.path.join(ROOT, ".whl")) else []
        if not wheels:
            return
        names = ", ".join(os.path.basename(w).split("-")[0] + " " + os.path.basename(w).split("-")[1]
                          for w in wheels)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", os.path.join(self.work, "site"), *wheels]
        outcome = self.runner.run(cmd, min(60, max(self.left() - 30, 5)), self.log_for("wheels"), self.env())
        self.meta["wheels"] = f"{names}: {'installed' if outcome['status'] == 'ok' else outcome['status']}"
        if outcome["status"] != "ok":
            self.meta["wheels"] += f" ({last_error(self.log_for('wheels'))})"

    def log_for(self, part):
        return os.path.join(self.work, f"{part}.log")

    def limit(self, part):
        """The part's own limit (--limit, else PARTS'); 0 for part (a) where --implementation makes it moot."""
        if part == "kernels" and self.args.implementation:
            return 0
        for given in self.args.limit or []:
            name, _, seconds = given.partition("=")
            if name == part:
                return float(seconds)
        return PARTS[part][1 if self.device == "cuda" else 2]

    def run_part(self, part, later):
        """The part under its limit: its own, plus what the earlier parts left unused of theirs (the parts `later`
        keep their own), and never past the budget."""
        planned_left = self.planned - (time.monotonic() - self.started)
        limit = min(max(self.limit(part), planned_left - sum(map(self.limit, later))), self.left() - 10)
        outcome = {"title": PARTS[part][0]}
        if part == "kernels" and self.args.implementation:
            self.meta.update(implementation=self.args.implementation,
                             implementation_why=f"named by --implementation {self.args.implementation}")
            self.parts[part] = dict(outcome, status="not run: --implementation given", seconds=0, limit=0)
            return
        if limit < 20:
            outcome.update(status=f"not run: the check had used its {self.args.budget:.0f} s budget", seconds=0,
                           limit=0)
            self.parts[part] = outcome
            return
        if part == "kernels":
            expression = self.args.kernel_tests or ("triton" if self.device == "cuda" else
                                                    "triton_window_step and k2-dv4 and fp32 and kept-layout")
            cmd = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-rfE",
                   "tests/test_kernels.py", "-k", expression]
            if self.device == "cuda" and importlib.util.find_spec("xdist"):
                cmd += ["-n", "4", "--dist", "load"]  # (Triton compiles a process's kernels one after the other)
            env = dict(self.env(), DDL_TEST_DEVICE=self.device)
            outcome.update(self.runner.run(cmd, limit, self.log_for(part), env), command=shlex.join(cmd))
            counts, failed, complete = pytest_summary(self.log_for(part))
            outcome.update(tests=counts, failed_tests=failed[:20], complete=complete)
            self.decide_implementation(outcome)
        else:
            result = os.path.join(self.work, f"{part}.json")
            config = dict(self.config, implementation=self.meta["implementation"] or "auto")
            config_path = os.path.join(self.work, f"{part}.config.json")
            write_json(config_path, config)
            cmd = [sys.executable, os.path.abspath(__file__), "--_part", part, "--_config", config_path,
                   "--_result", result, "--_deadline", str(time.time() + max(limit - WORKER_MARGIN_S, 5))]
            outcome.update(self.runner.run(cmd, limit, self.log_for(part), self.env()))
            try:
                with open(result, encoding="utf-8") as f:
                    outcome.update(json.load(f))
            except (OSError, ValueError):
                pass
        if outcome["status"] != "ok":
            outcome["note"] = last_error(self.log_for(part))
        self.parts[part] = outcome

    def decide_implementation(self, outcome):
        """Triton where its kernel tests passed, or ran out of time with none failed (a kernel that then fails to
        compile or launch still gives way to PyTorch, which the results name); else DDL's default, "auto"."""
        counts, status = outcome.get("tests", {}), outcome["status"]
        clean = counts.get("passed", 0) > 0 and not counts.get("failed") and not counts.get("error")
        how = ", ".join(f"{n} {word}" for word, n in counts.items())
        if clean and status == "ok" and outcome.get("complete"):
            self.meta.update(implementation="triton", implementation_why=f"its kernel tests passed: {how}")
        elif clean and status.startswith("stopped"):
            self.meta.update(implementation="triton", implementation_why=(
                f"its kernel tests {status} with none failed ({how}); the rest did not run"))
        else:
            why = (how if counts.get("failed") or counts.get("error") else status if status != "ok" else
                   "no test ran")
            self.meta.update(implementation="auto", implementation_why=(
                f"the Triton kernel tests did not pass ({why}), so DDL runs its PyTorch paths, \"auto\""))

    def versions_ok(self):
        found = self.parts.get("versions", {}).get("versions", {})
        self.meta["versions"] = found
        return found.get("ddl", "imports") == "imports"

    def main(self):
        parts = self.args.parts or (SECOND if self.args.second else FIRST)
        parts = parts if "versions" in parts else ["versions", *parts]  # (the card and versions name every figure)
        self.install_wheels()
        self.planned = time.monotonic() - self.started + sum(map(self.limit, parts))
        self.write()
        for i, part in enumerate(parts):
            print(f"== {part}: {PARTS[part][0]} ({time.strftime('%H:%M:%S')}, {self.left():.0f} s of the budget "
                  "left)", flush=True)
            if part != "versions" and "versions" in self.parts and not self.versions_ok():
                self.parts[part] = {"title": PARTS[part][0], "seconds": 0, "limit": 0,
                                    "status": "not run: DDL does not import here (see versions); carry the wheels "
                                              "(docs/gpu.md)"}
            else:
                self.run_part(part, parts[i + 1:])
                if part == "versions":
                    self.versions_ok()
            print(f"   {self.parts[part]['status']}, {self.parts[part].get('seconds', 0):.0f} s", flush=True)
            self.write()
        print(f"gpu_speed.py: results in {self.md}", flush=True)
        return 0

    def write(self):
        """The results file, its JSON and the parts' logs, rewritten whole (so that an interrupted check keeps what
        ran)."""
        self.meta["seconds"] = round(time.monotonic() - self.started, 1)
        report = {"meta": self.meta, "parts": self.parts, "targets": target_rows(self.parts, self.config)}
        write_json(self.json, report)
        write_text(self.md, markdown(report, self.config))
        logs = []
        for part in ["wheels", *PARTS]:
            path = self.log_for(part)
            if os.path.exists(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                cut = "" if len(text) <= 2_000_000 else f"(the first {len(text) - 2_000_000} characters left out)\n"
                logs.append(f"===== {part} =====\n{cut}{text[-2_000_000:]}")
        write_text(self.log, "\n".join(logs))


# -------------------------------------------------------------------------------------------------------------------
# The figures: ratios paired by repeat, the targets table, the markdown.


def figures(parts):
    """{regime: {"samples": {model: {repeat: sample}}, "facts": {model: facts}}} over all parts' results."""
    out = {}
    for outcome in parts.values():
        for s in outcome.get("samples", []):
            out.setdefault(s["regime"], {"samples": {}, "facts": {}})["samples"].setdefault(
                s["model"], {})[s["repeat"]] = s
        for regime, models in outcome.get("facts", {}).items():
            out.setdefault(regime, {"samples": {}, "facts": {}})["facts"].update(models)
    return out


def paired(regime_figures, model, key):
    """A figure of `model` as a ratio to Llama's: each repeat's over Llama's in the same repeat (repeats one of them
    lacks are left out); a one-off figure (a fact) over Llama's. {"value", "ratio", "ratio_min", "ratio_max", "n"}
    (medians), or None where either side was not measured."""
    samples = regime_figures["samples"]
    mine, ref = samples.get(model, {}), samples.get("llama", {})
    values = [s[key] for s in mine.values() if s.get(key) is not None]
    if values:
        ratios = [mine[r][key] / ref[r][key] for r in mine if r in ref and mine[r].get(key) and ref[r].get(key)]
        value = statistics.median(values)
    else:
        fact, ref_fact = regime_figures["facts"].get(model, {}).get(key), regime_figures["facts"].get(
            "llama", {}).get(key)
        if fact is None:
            return None
        value, ratios = fact, ([fact / ref_fact] if ref_fact else [])
    if not ratios:
        return {"value": value, "ratio": None, "ratio_min": None, "ratio_max": None, "n": len(values)}
    return {"value": value, "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "n": len(ratios)}


def shape_names(config):
    names = {regime: f"{b} x {config['seq_len']}" for regime, b in config["batches"].items()}
    names["graphs"] = "CUDA graphs" if config["device"] == "cuda" else "on CPU: compiled, no CUDA graphs"
    names["scope"] = SCOPES[config.get("compile_scope", "regional")]
    return names


def target_rows(parts, config):
    """The issue's targets table: per row and DDL variant, the measured ratio(s), the target, met or not."""
    found = figures(parts)
    rows = []
    for row, regimes, key, op, targets in TARGETS:
        if not any(regime in found for regime in regimes) and regimes[0] in ("autocast", "compiled_full"):
            continue  # (the second call's rows, shown when it ran)
        cells = {}
        for variant, target in zip(VARIANTS[1:], targets, strict=True):
            measured = {regime: paired(found[regime], variant, key) if regime in found else None
                        for regime in regimes}
            ratios = [m["ratio"] for m in measured.values() if m and m["ratio"] is not None]
            complete = len(ratios) == len(regimes)
            met = complete and all(r >= target if op == ">=" else r <= target for r in ratios)
            cells[variant] = {"measured": measured, "target": target, "op": op,
                              "met": met if complete else None}
        rows.append({"row": row.format(**shape_names(config)), "regimes": regimes, "figure": key, "cells": cells})
    return rows


def ratio_text(m, digits=2):
    if not m or m["ratio"] is None:
        return "–"
    low, high = (f"{m[k]:.{digits}f}" for k in ("ratio_min", "ratio_max"))
    spread = "" if low == high else f" [{low}–{high}]"
    return f"{m['ratio']:.{digits}f}{spread}"


def number(value, digits=0):
    if value is None or (isinstance(value, float) and value != value):  # (None or NaN: not measured)
        return "–"
    return f"{value:,.{digits}f}"


def compiled_text(facts):
    """Graphs compiled and graph breaks (and CUDA graphs skipped, if any) of one model's compilation."""
    if "graphs" not in facts:
        return "–"
    skips = facts.get("cudagraph_skips")
    return f"{facts['graphs']}, {facts['graph_breaks']}" + (f", {skips} CUDA graphs skipped" if skips else "")


def markdown(report, config):
    meta, parts = report["meta"], report["parts"]
    gpu = config["device"] == "cuda"
    v = meta.get("versions", {})
    card = v.get("gpu") or "none seen by torch"
    lines = [f"# DDL GPU speed check (issue 58){', second call' if meta['call'] == 'second' else ''}: {meta['date']}, "
             f"{'CUDA' if gpu else 'CPU DRY RUN (its figures say nothing of a GPU)'}", ""]
    lines += [f"- card: {card}; nvidia-smi (name, driver, memory, max/current SM clock, max memory clock, power "
              f"limit, pstate): {v.get('nvidia-smi', '–')}",
              "- software: " + ", ".join(f"{k} {v[k]}" for k in ("python", "torch", "cuda", "cudnn", "triton",
                                                                  "transformers", "accelerate") if k in v)
              + f" (transformers from {v.get('transformers_from', '–')})",
              f"- carried wheels: {meta['wheels']}",
              f"- DDL's implementation in the timed parts: **{meta['implementation'] or 'auto'}**"
              f"{': ' + meta['implementation_why'] if meta['implementation_why'] else ''}"]
    fell_back = sorted({k for p in parts.values() for k in p.get("fell_back", [])})
    if fell_back:
        lines.append(f"- Triton kernels that failed to compile or launch during the parts, the specification "
                     f"(PyTorch) serving them from then on: **{', '.join(fell_back)}** (the log says why)")
    lines.append(f"- models: bench.py's `{config['size']}` size, bf16 weights (autocast: fp32 weights), sequences of "
                 f"{config['seq_len']} tokens; {config['repeats']} repeats, models interleaved in bench.py's balanced "
                 f"order; training: {config['micro_steps']} timed forward+backward micro-step(s) after an untimed one, "
                 "then one timed optimizer step (clipping, AdamW(fused=True), gradients cleared)")
    lines.append(f"- time: {meta['seconds']:.0f} s of a {meta['budget_s']:.0f} s budget")
    lines += ["", "## Targets (issue 58)", "",
              "Each cell: DDL's figure over Llama's measured in the same part and mode, the median of the repeats' "
              "ratios [min–max]; the target; met or not.", "",
              "| regime | " + " | ".join(LABELS[v] for v in VARIANTS[1:]) + " |", "|---|---|---|---|"]
    for row in report["targets"]:
        cells = []
        for variant in VARIANTS[1:]:
            cell = row["cells"][variant]
            measured = [ratio_text(m) for m in cell["measured"].values()]
            shown = " / ".join(measured) if len(measured) > 1 else measured[0]
            verdict = {True: "**met**", False: "not met", None: "not measured"}[cell["met"]]
            cells.append(f"{shown} ({cell['op']} {cell['target']:.2f}: {verdict})")
        lines.append(f"| {row['row']} | " + " | ".join(cells) + " |")
    lines += ["", "(batch 1 / batch 8 where a row has two figures.)"]
    lines += ["", "## Parts", "", "| part | limit s | took s | outcome |", "|---|---|---|---|"]
    for name, p in parts.items():
        note = f": {p['note']}" if p.get("note") else ""
        lines.append(f"| {p['title']} | {p.get('limit', 0)} | {p.get('seconds', 0):.0f} | {p['status']}{note} |")
    kernels = parts.get("kernels", {})
    if kernels.get("tests") or kernels.get("failed_tests"):
        lines += ["", f"Kernel tests (`{kernels.get('command', '')}`): "
                  + ", ".join(f"{n} {w}" for w, n in kernels.get("tests", {}).items())]
        lines += [f"- {line}" for line in kernels.get("failed_tests", [])]
    lines += details(report, config)
    notes = [f"- {p['title']}: {n}" for p in parts.values() for n in p.get("notes", [])]
    if notes:
        lines += ["", "## Notes from the parts", "", *notes]
    if not gpu:
        lines += ["", "On CPU, not measured (marked –): GPU-busy time and kernels (no CUDA kernels), CUDA graphs "
                  "(the compiled decoding step is compiled without them); peak memory from the profiler's memory "
                  "timeline; the Triton kernels run only through the interpreter in the tests, and serve no CPU "
                  "tensor in the timed parts (\"triton\" runs the specifications there)."]
    return "\n".join(lines) + "\n"


def details(report, config):
    """One table per regime: absolute figures (for calibrating the CPU proxies) beside the ratios."""
    found = figures(report["parts"])
    names = shape_names(config)
    out = []
    training = [("eager_small", "eager training"), ("eager_large", "eager training"), ("autocast", "eager training "
                "under bf16 autocast"), ("compiled", f"compiled training, {names['scope']}"),
                ("compiled_full", f"compiled training, {SCOPES['full']}")]
    for regime, title in training:
        if regime not in found:
            continue
        f = found[regime]
        out += ["", f"## {title}, {names[regime]}", "",
                "| model | tok/s (micro-steps) | ratio | step ms | host ms | GPU-busy ms | kernels | host µs/kernel "
                "| optimizer ms | optimizer kernels | peak MB (ratio) | compile s | graphs, breaks |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for variant in [*VARIANTS, BF16_STATE]:
            if variant not in f["samples"] and variant not in f["facts"]:
                continue
            facts = f["facts"].get(variant, {})
            m = {k: paired(f, variant, k) for k in ("tok_s", "step_ms", "host_ms", "optimizer_ms", "peak_mb")}
            value = lambda k, d=0: number(m[k]["value"], d) if m[k] else "–"  # noqa: E731
            kernels = facts.get("kernels")
            host_per_kernel = (m["host_ms"]["value"] * 1e3 / kernels) if m["host_ms"] and kernels else None
            peak = f"{value('peak_mb')} ({ratio_text(m['peak_mb'])})" if m["peak_mb"] else "–"
            graphs = compiled_text(facts)
            out.append(f"| {LABELS[variant]} | {value('tok_s')} | {ratio_text(m['tok_s'])} | {value('step_ms', 1)} | "
                       f"{value('host_ms', 1)} | {number(facts.get('busy_ms'), 1)} | {number(kernels)} | "
                       f"{number(host_per_kernel, 1)} | {value('optimizer_ms', 1)} | "
                       f"{number(facts.get('optimizer_kernels'))} | {peak} | {number(facts.get('compile_s'), 1)} | "
                       f"{graphs} |")
        during = f["facts"].get("all", {}).get("graphs_during_timed_steps")
        if during is not None:
            out.append(f"\nGraphs compiled during the timed steps (recompiles): {during}.")
    for kind in ("eager", "compiled"):
        regimes = [f"decode_{kind}_b{b}" for b in config["decode_batches"] if f"decode_{kind}_b{b}" in found]
        if not regimes:
            continue
        title = "eager `generate`" if kind == "eager" else f"compiled static-cache `generate` ({names['graphs']})"
        tokens = config["new_tokens"][kind]
        columns = " | ".join(f"batch {r.rsplit('_b', 1)[1]} tok/s | ratio" for r in regimes)
        extra = (" | kernels per token (b1) | GPU-busy ms per token (b1)" if kind == "eager" else
                 " | compile s (per batch) | graphs, breaks (per batch)")
        out += ["", f"## {title}, {tokens} new tokens after a 16-token prompt", "", f"| model | {columns}{extra} |",
                "|---|" + "---|" * (2 * len(regimes) + 2)]
        for variant in VARIANTS:
            if not any(variant in found[r]["samples"] or variant in found[r]["facts"] for r in regimes):
                continue
            cells = []
            for r in regimes:
                m = paired(found[r], variant, "tok_s")
                cells += [number(m["value"], 1) if m else "–", ratio_text(m)]
            if kind == "eager":
                facts = found[regimes[0]]["facts"].get(variant, {})
                cells += [number(facts.get("kernels_per_token")), number(facts.get("busy_ms_per_token"), 2)]
            else:
                facts = [found[r]["facts"].get(variant, {}) for r in regimes]
                cells += [" / ".join(number(x.get("compile_s"), 1) for x in facts),
                          " / ".join(compiled_text(x) for x in facts)]
            out.append(f"| {LABELS[variant]} | " + " | ".join(cells) + " |")
        for r in regimes:
            during = found[r]["facts"].get("all", {}).get("graphs_during_timed_steps")
            if during is not None:
                out.append(f"\n{r}: graphs compiled during the timed calls (recompiles): {during}.")
    return out


# -------------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the dry run, every part at tiny sizes")
    parser.add_argument("--second", action="store_true", help="the second call's parts: " + ", ".join(SECOND))
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), help="these parts only (e.g. one to rerun)")
    parser.add_argument("--implementation", choices=["auto", "triton", "torch"],
                        help="DDL's ddl_implementation in the timed parts, instead of part (a)'s decision (which is "
                             "then not run)")
    parser.add_argument("--kernel_tests", help="part (a)'s pytest -k expression (default: 'triton'; the dry run "
                                               "runs one test)")
    parser.add_argument("--budget", type=float, help="seconds for the whole check (default: $BUDGET, else 560 on "
                                                     "CUDA, 3600 on CPU)")
    parser.add_argument("--limit", nargs="+", metavar="PART=SECONDS", help="a part's time limit instead of its own")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    parser.add_argument("--repeats", type=int, help="interleaved repeats of each figure (default 3; dry run 2)")
    parser.add_argument("--micro_steps", type=int, help="timed micro-steps per repeat (default 5; dry run 2)")
    parser.add_argument("--compile_backend", default="inductor",
                        help="torch.compile's backend for training and decoding (the dry run's test: eager, which "
                             "captures the graphs in seconds; CUDA graphs need inductor)")
    parser.add_argument("--compile_scope", choices=list(SCOPES), default="regional",
                        help="part (c): each decoder layer compiled (identical layers compile once: what fits the "
                             "part's limit), or the whole model (as Trainer's torch_compile; the second call's)")
    parser.add_argument("--out", help="the results' folder (default: $OUT, else gpu_check_out/)")
    for flag in ("--_part", "--_config", "--_result", "--_deadline"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._part:
        return args
    if args.variants[0] != "llama":
        parser.error("--variants must start with llama: every figure is a ratio to it")
    args.budget = args.budget or float(os.environ.get("BUDGET") or (560 if args.device == "cuda" else 3600))
    args.out = args.out or os.environ.get("OUT") or os.path.join(ROOT, "gpu_check_out")
    for given in args.limit or []:
        name, _, seconds = given.partition("=")
        if name not in PARTS or not re.fullmatch(r"\d+(\.\d*)?", seconds):
            parser.error(f"--limit {given}: PART=SECONDS, PART one of {', '.join(PARTS)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args._part:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (gpu_profile, beside this script)
        return worker_main(args)
    check = Check(args)
    if os.path.exists(check.md):
        print(f"gpu_speed.py: {check.md} exists (an earlier run's): move it, or name another --out", file=sys.stderr)
        return 2
    os.makedirs(check.out, exist_ok=True)

    def interrupted(signum, frame):
        check.runner.stop()
        check.write()
        shutil.rmtree(check.work, ignore_errors=True)
        print(f"gpu_speed.py: interrupted; what ran is in {check.md}", file=sys.stderr)
        os._exit(130)

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    try:
        return check.main()
    finally:
        shutil.rmtree(check.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
