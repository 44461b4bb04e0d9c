"""Speed and memory of DDL against transformers' Llama of the same dimensions, measured side by side.

    python bench.py                                  # tiny size, CPU, fp32: a few minutes on 2 cores
    python bench.py --size bench --json bench.json   # hidden 512, 8 layers, 8 heads (4 KV), seq 256, batch 8
    python bench.py --size small --device cuda --dtype bfloat16   # the paper's small model on a GPU
    python bench.py --size small --repeats 1 --batch_size 1 --variants llama ddl-cc   # the small model on a CPU
    python bench.py --variants llama ddl-dv1 --compile
    python bench.py --variants llama ddl-cc --skip prefill decode --memory_timeline timeline  # where memory goes

Every figure is reported as a ratio to Llama paired by repeat: each repeat's figure over Llama's in the same
repeat, the median and the spread (min-max) of those ratios. Machine noise that drifts over seconds then hits both
sides of a ratio alike.
- train tok/s: forward + backward + AdamW step on random tokens, each model in a fresh Python process of its own
  (this script started again as a worker, one model per process): warm-up steps, then the timed steps. A repeat is
  one alternation: Llama, then each variant, one process after the other; the next alternation runs them in
  reverse order, so that neither side always runs first. A process of its own, because a training step's speed
  depends on the allocator state it starts from: in one process, the models that ran before leave the allocator's
  free blocks shaped by their own tensors, and which models were interleaved moved a training ratio by more than
  the differences this bench is meant to show. `--train_in_process` times training like the figures below instead
  (for comparison with that figure).
- prefill tok/s: a no-grad forward of the whole batch that fills the cache,
- decode tok/s: `generate` of new tokens after a short prompt, batch 1 and batch 8 (`--compile`: the compiled
  static-cache path CUDA users get, `cache_implementation="static"` with generate's default `CompileConfig`).
  These two stay in one process, the models interleaved in a balanced order (each repeat runs every model once;
  over the repeats every model runs in every position and right after every other model equally often): inference
  allocates one forward's activations and the cache and frees them again, little beside what training allocates,
  and in one process many repeats cost no start-up of their own.
- peak train memory: the largest bytes of live tensors during one training step (parameters, gradients and AdamW
  state included), in a fresh process per model (the first alternation's, after its timed steps): only that
  model's tensors are live there. `max_memory_allocated` on CUDA, the PyTorch profiler's memory timeline on CPU.
  `--memory_timeline DIR` writes that timeline of one step per model, bytes by category (parameters, optimizer
  state, gradients, activations, ...) over time, as `DIR/<model>.json`, plus `DIR/memory_timeline.png` when
  matplotlib is installed: where a model's training memory goes.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

from ddl import DDLConfig, DDLForCausalLM
from ddl.ops import FAST
from ddl_tools.outputs import (
    UsageError,
    check_writable_file,
    claim_folder,
    die_with_parent,
    folder_contents,
    write_json,
)
from ddl_tools.launch import device_problem
from ddl_tools.presets import PAPER_RECIPE, PRESETS


@dataclass(frozen=True)
class Size:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    seq_len: int
    batch_size: int
    head_dim: int | None = None


def _from_preset(name, vocab_size, seq_len, batch_size):
    """A training preset's dimensions (its QK-norm is left out: the baseline is transformers' plain Llama)."""
    p = PRESETS[name]
    return Size(p["hidden_size"], p["num_hidden_layers"], p["num_attention_heads"],
                p.get("num_key_value_heads", p["num_attention_heads"]), p["intermediate_size"], vocab_size, seq_len,
                batch_size, head_dim=p["head_dim"])


SIZES = {
    "tiny": Size(128, 2, 4, 2, 352, 4096, 128, 4),  # a quick check (not train.py's 4-layer tiny preset)
    "bench": Size(512, 8, 8, 4, 1408, 8192, 256, 8),  # the benchmark size
    "small": _from_preset("small", 50304, 1024, 8),  # the paper's "small" (12 x 768), GPT-2's vocabulary
}

VARIANTS = {
    "llama": None,
    "ddl-dv1": dict(ddl_value_channels=1),
    "ddl-cc": dict(ddl_value_channels=4, ddl_compressor="cc", ddl_embed_conv=True),
    "ddl-tc": dict(ddl_value_channels=4, ddl_compressor="tc", ddl_embed_conv=True),
    "ddl-write_only": dict(ddl_value_channels=1, ddl_residual="write_only"),
}
DEFAULT_VARIANTS = list(VARIANTS)

DECODE_PROMPT_LEN = 16
TIMELINE_POINTS = 1000  # instants kept of a step's memory timeline (the profiler records one per allocation)


def build(variant, size, device, dtype, implementation="auto"):
    dims = dict(
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        intermediate_size=size.intermediate_size,
        vocab_size=size.vocab_size,
        head_dim=size.head_dim,
        max_position_embeddings=max(2048, size.seq_len + 64),
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    overrides = VARIANTS[variant]
    model = LlamaForCausalLM(LlamaConfig(**dims)) if overrides is None else DDLForCausalLM(
        DDLConfig(**dims, **overrides, ddl_implementation=implementation)
    )
    return model if device.type == "meta" else model.to(device=device, dtype=dtype)


def parameter_count(variant, size):
    """Millions of parameters, counted on a model built on the meta device (no memory, no initialisation)."""
    with torch.device("meta"):
        model = build(variant, size, torch.device("meta"), None)
    return sum(p.numel() for p in model.parameters()) / 1e6


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def compiled_decoding() -> CompileConfig:
    """What `generate` compiles a static-cache decoding step with on CUDA (its default `CompileConfig`), here on any
    device: transformers compiles automatically only on accelerators."""
    config = CompileConfig()
    config._compile_all_devices = True
    return config


class Runner:
    """One model with its optimizer and its timed measurements."""

    def __init__(self, name, model, size, device, compile_model):
        self.name, self.model, self.size, self.device = name, model, size, device
        recipe = PAPER_RECIPE  # train.py's optimizer settings (the update's cost does not depend on their values)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["learning_rate"],
                                           betas=(recipe["adam_beta1"], recipe["adam_beta2"]),
                                           weight_decay=recipe["weight_decay"])
        self.max_grad_norm = recipe["max_grad_norm"]
        self.step_fn = torch.compile(model) if compile_model else model
        self.compiled = compile_model
        g = torch.Generator().manual_seed(1)
        self.batch = torch.randint(3, size.vocab_size, (size.batch_size, size.seq_len), generator=g).to(device)
        # the decoding prompts, batch 1 and 8 whatever the training batch (--batch_size 1 still decodes 8 sequences)
        self.prompts = torch.randint(3, size.vocab_size, (8, DECODE_PROMPT_LEN), generator=g).to(device)

    def train_step(self):
        self.model.train()
        loss = self.step_fn(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def time_train(self, steps, warmup=1):
        """Tokens per second over `steps` training steps, after `warmup` untimed ones (in one process, the other
        models ran in between; in a worker, the first steps allocate the optimizer state and load the kernels)."""
        for _ in range(warmup):
            self.train_step()
        sync(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            self.train_step()
        sync(self.device)
        return steps * self.batch.numel() / (time.perf_counter() - start)

    @torch.no_grad()
    def time_prefill(self, steps):
        self.model.eval()
        sync(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            self.step_fn(input_ids=self.batch, use_cache=True, logits_to_keep=1)
        sync(self.device)
        return steps * self.batch.numel() / (time.perf_counter() - start)

    @torch.no_grad()
    def time_decode(self, batch_size, new_tokens):
        self.model.eval()
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if self.compiled:
            kwargs.update(cache_implementation="static", compile_config=compiled_decoding())
        sync(self.device)
        start = time.perf_counter()
        self.model.generate(self.prompts[:batch_size], **kwargs)
        sync(self.device)
        return batch_size * new_tokens / (time.perf_counter() - start)

    def memory_timeline(self):
        """One training step under PyTorch's memory profiler: the bytes of live tensors on this model's device at
        each allocation or release, by category. Returns (times in µs, category names, one row of bytes per
        time). Tensors that live across steps (parameters, AdamW state) count from the start."""
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as prof:
            self.train_step()
        device = self.device
        if device.type == "cuda" and device.index is None:  # the timeline keys tensors by their indexed device
            device = torch.device("cuda", torch.cuda.current_device())
        times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(device)
        names = ["unknown" if category is None else category.name.lower() for category in _CATEGORY_TO_INDEX]
        return times, names, [row[1:] for row in sizes]  # row[0] is the plot's zero baseline

    def peak_train_memory(self):
        """Largest bytes of live tensors during one training step, state from a previous step included."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.train_step()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        _, _, rows = self.memory_timeline()
        return max(sum(row) for row in rows)


def compact_timeline(times, names, rows, points=TIMELINE_POINTS):
    """A memory timeline at most `points` instants long: of each of `points` equal slices of the step's time, the
    instant with the most bytes, so that the peak and the shape around it survive. Times in ms from the start."""
    start, span = times[0], max(times[-1] - times[0], 1)
    kept = {}
    for t, row in zip(times, rows, strict=True):
        slot = min(points - 1, (t - start) * points // span)
        if slot not in kept or sum(row) > sum(kept[slot][1]):
            kept[slot] = (t, row)
    instants = [kept[slot] for slot in sorted(kept)]
    peak = max(rows, key=sum)
    return {
        "categories": names,
        "time_ms": [(t - start) / 1e3 for t, _ in instants],
        "bytes": [row for _, row in instants],  # one row per instant, one column per category
        "peak_bytes": sum(peak),
        "peak_by_category": dict(zip(names, peak, strict=True)),
    }


@dataclass
class Record:
    """One model's measurements: figure -> one value per repeat (per alternation for per-process training)."""

    name: str
    params_M: float
    results: dict = field(default_factory=dict)

    def record(self, key, value):
        self.results.setdefault(key, []).append(value)


def balanced_order(runners, repeat):
    """The order of the models in one repeat, from a Williams design: over n repeats (2n for an odd n) every model
    runs in every position equally often and right after every other model equally often, so that neither a
    position nor a predecessor (whose allocations and caches a model inherits) favours one model."""
    n = len(runners)
    first, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(i + shift) % n for i in first] for shift in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [runners[i] for i in rows[repeat % len(rows)]]


def reference_first(names):
    """The models with the reference (Llama, else the first named) first."""
    reference = "llama" if "llama" in names else names[0]
    return [reference] + [name for name in names if name != reference]


def alternation_order(names, alternation):
    """The order of the worker processes in one alternation: the reference, then the variants; every other
    alternation reversed, so that the reference runs first in half of them and last in the other half."""
    order = reference_first(names)
    return order if alternation % 2 == 0 else order[::-1]


def worker_jobs(names, alternations, train, memory):
    """The worker processes of a run, in order, as (alternation, model, time training?, measure memory?). Training:
    every model once per alternation; peak memory: once per model, in the first alternation's process (after its
    timed steps) or, without timed training, in a process of its own."""
    if not train:
        return [(0, name, False, True) for name in reference_first(names)] if memory else []
    return [(a, name, True, memory and a == 0) for a in range(alternations) for name in alternation_order(names, a)]


def summarise(records):
    """Per model and figure: the median and spread of its values, and of its ratios to the reference (Llama, else the
    first model) paired by repeat: value i over the reference's value i, measured in the same round."""
    reference = next((r for r in records if r.name == "llama"), records[0])
    rows = []
    for record in records:
        row = {"model": record.name, "params_M": record.params_M}
        for key, values in record.results.items():
            ratios = [v / ref for v, ref in zip(values, reference.results[key], strict=True)]
            row[key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
            }
        rows.append(row)
    return rows


COLUMNS = [
    ("train_tok_s", "train tok/s"),
    ("prefill_tok_s", "prefill tok/s"),
    ("decode_b1_tok_s", "decode b1 tok/s"),
    ("decode_b8_tok_s", "decode b8 tok/s"),
    ("peak_train_mem_MB", "peak train MB"),
]


def markdown(rows, header, train_per_process=True):
    lines = [header, "", "| model | params (M) | " + " | ".join(title for _, title in COLUMNS) + " |"]
    lines.append("|---|---|" + "---|" * len(COLUMNS))
    for row in rows:
        cells = [row["model"], f"{row['params_M']:.2f}"]
        for key, _ in COLUMNS:
            if key not in row:
                cells.append("–")
                continue
            s = row[key]
            spread = "" if s["ratio_min"] == s["ratio_max"] else f" [{s['ratio_min']:.2f}–{s['ratio_max']:.2f}]"
            cells.append(f"{s['median']:.0f} ({s['ratio']:.2f}×{spread})")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Cells: median over repeats (ratio to llama, paired by repeat: median [min–max]).")
    if train_per_process:
        lines.append("train: one fresh process per model and alternation (a repeat = one alternation, the order "
                     "reversed every other one); prefill and decode: one process, interleaved; peak memory: a "
                     "fresh process per model.")
    else:
        lines.append("train, prefill and decode: one process, interleaved (--train_in_process); peak memory: a "
                     "fresh process per model.")
    return "\n".join(lines)


def timeline_markdown(timelines):
    """The peak of each model's memory timeline, by category (MB at the instant of the peak)."""
    names = next(iter(timelines.values()))["categories"]
    used = [n for n in names if any(t["peak_by_category"][n] for t in timelines.values())]
    lines = ["Peak training memory by category (MB, at the instant of the peak):", "",
             "| model | " + " | ".join(used) + " | total |", "|---|" + "---|" * (len(used) + 1)]
    for model, t in timelines.items():
        cells = [f"{t['peak_by_category'][n] / 2**20:.0f}" for n in used]
        lines.append(f"| {model} | " + " | ".join(cells) + f" | {t['peak_bytes'] / 2**20:.0f} |")
    return "\n".join(lines)


def plot_timelines(timelines, path):
    """One panel per model, bytes stacked by category over the step (same scale for all); None without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from torch.profiler._memory_profiler import _CATEGORY_TO_COLORS

    from ddl_tools.outputs import save_figure

    colors = {("unknown" if c is None else c.name.lower()): color for c, color in _CATEGORY_TO_COLORS.items()}
    fig, axes = plt.subplots(1, len(timelines), figsize=(4.5 * len(timelines), 3.8), sharey=True, squeeze=False)
    for ax, (model, t) in zip(axes[0], timelines.items(), strict=True):
        columns = [[row[i] / 2**20 for row in t["bytes"]] for i in range(len(t["categories"]))]
        ax.stackplot(t["time_ms"], *columns, labels=t["categories"], colors=[colors[n] for n in t["categories"]],
                     alpha=0.8, step="post")  # the bytes hold until the next allocation or release
        ax.set_title(f"{model}: peak {t['peak_bytes'] / 2**20:.0f} MB")
        ax.set_xlabel("time in one training step (ms)")
    axes[0][0].set_ylabel("live tensors (MB)")
    axes[0][-1].legend(loc="upper right", fontsize=7)
    return save_figure(fig, path)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--batch_size", type=int, help="sequences per training/prefill batch instead of the size's "
                        "(e.g. 1 or 2 for --size small on a CPU, whose batch of 8 x 1024 needs many GB per model)")
    parser.add_argument("--seq_len", type=int, help="tokens per sequence instead of the size's")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--implementation", choices=list(FAST), default="auto",
                        help="DDL's ddl_implementation (see ddl/ops.py)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model for training and prefill, and "
                        "decode with generate's compiled static-cache path (cache_implementation='static')")
    parser.add_argument("--repeats", type=int, default=3,
                        help="repeats of each figure; for training, alternations of one process per model")
    parser.add_argument("--train_steps", type=int, default=2, help="timed training (and prefill) steps per repeat")
    parser.add_argument("--warmup_steps", type=int, default=1,
                        help="untimed training steps before the timed ones in each training process")
    parser.add_argument("--train_in_process", action="store_true",
                        help="time training in this process, interleaved with the other models like prefill and "
                             "decode, instead of one fresh process per model and alternation")
    parser.add_argument("--new_tokens", type=int, default=32, help="generated tokens per decode measurement")
    parser.add_argument("--skip", nargs="*", default=[], choices=["train", "prefill", "decode", "memory"])
    parser.add_argument("--memory_timeline", metavar="DIR",
                        help="write each model's memory timeline of one training step here (a new or empty folder)")
    parser.add_argument("--json", help="also write the results here (a new file)")
    parser.add_argument("--overwrite", action="store_true", help="let --json replace an existing file")
    # a worker process: one model, its training speed and/or memory, results to a JSON file (see worker_command)
    for flag in ("--_worker", "--_result", "--_timeline"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    for flag in ("--_train", "--_memory"):
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("repeats", "train_steps", "new_tokens", "batch_size", "seq_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} {value}: must be at least 1.")
    if args.warmup_steps < 0:
        parser.error(f"--warmup_steps {args.warmup_steps}: must be 0 or more.")
    if not args._worker and (problem := device_problem(args.device, "bench.py")):
        parser.error(problem)
    if args.json and not args._worker:  # checked now: the results would be lost after the whole run
        try:
            check_writable_file(args.json, "--json", args.overwrite)
        except UsageError as err:
            parser.error(str(err))
    if args.memory_timeline and not args._worker and "memory" in args.skip:
        parser.error("--memory_timeline measures memory: drop 'memory' from --skip.")
    return args


def usage_error(message):
    """A mistake found after the flags were parsed: one line and exit status 2, as argparse's own errors."""
    print(f"{os.path.basename(__file__)}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def claim_timeline_folder(folder):
    """--memory_timeline made this run's before anything runs (`claim_folder`: created if missing, locked until the
    run ends, so that a second bench into it stops now instead of overwriting its files at the end), and refused if
    it holds anything: a new folder per comparison, so that no earlier timeline is overwritten. Returns (the lock,
    whether the folder was created)."""
    try:
        lock, created = claim_folder(folder, "--memory_timeline")
    except UsageError as err:
        usage_error(err)
    if folder_contents(folder):
        lock.release(remove=True)
        usage_error(f"--memory_timeline {folder!r} is not empty; choose a new folder (e.g. one per commit, to compare "
                    "before and after), so that no earlier timeline is overwritten.")
    return lock, created


def bench_size(args):
    """The size's dimensions, with --batch_size / --seq_len if given."""
    size = SIZES[args.size]
    return replace(size, batch_size=args.batch_size or size.batch_size, seq_len=args.seq_len or size.seq_len)


def worker_command(args, variant, result, train, memory, timeline_dir=None):
    """This script again, for one model in a fresh process (see `worker`)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--size", args.size, "--device", args.device, "--dtype",
           args.dtype, "--implementation", args.implementation, "--train_steps", str(args.train_steps),
           "--warmup_steps", str(args.warmup_steps), "--_worker", variant, "--_result", result]
    for flag in ("batch_size", "seq_len"):
        if getattr(args, flag):
            cmd += [f"--{flag}", str(getattr(args, flag))]
    cmd += ["--compile"] * args.compile + ["--_train"] * train + ["--_memory"] * memory
    return cmd + (["--_timeline", timeline_dir] if timeline_dir else [])


def worker(args):
    """One model in this fresh process: warm-up steps, then the timed training steps (--_train) and/or one step's
    peak memory (--_memory, and its timeline with --_timeline DIR, as DIR/<model>.json); results to --_result."""
    device, dtype, size = torch.device(args.device), getattr(torch, args.dtype), bench_size(args)
    runner = Runner(args._worker, build(args._worker, size, device, dtype, args.implementation), size, device,
                    args.compile)
    out = {}
    if args._train:
        out["train_tok_s"] = runner.time_train(args.train_steps, warmup=args.warmup_steps)
    else:
        for _ in range(max(1, args.warmup_steps)):  # the measured step starts with AdamW's state, as in training
            runner.train_step()
    if args._memory:
        if args._timeline:
            timeline = compact_timeline(*runner.memory_timeline())
            write_json(os.path.join(args._timeline, f"{args._worker}.json"), timeline)
        # on CPU the timeline's step gives the peak; on CUDA the allocator's own count of a step without profiler
        cpu_peak = args._timeline and device.type != "cuda"
        out["peak_train_mem_MB"] = (timeline["peak_bytes"] if cpu_peak else runner.peak_train_memory()) / 2**20
    write_json(args._result, out)


def run_workers(args, records, jobs, timeline_dir):
    """Each job in a fresh process of its own, one after the other; their figures go to `records`."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for i, (alternation, variant, train, memory) in enumerate(jobs):
            result = os.path.join(tmp, f"{i}.json")
            cmd = worker_command(args, variant, result, train, memory, timeline_dir if memory else None)
            status = subprocess.call(cmd, preexec_fn=die_with_parent())
            if status != 0:
                how = f"signal {-status}" if status < 0 else f"exit status {status}"
                raise SystemExit(
                    f"error: the worker process for {variant} (alternation {alternation + 1}) ended with {how}; its "
                    "output is above. If it ran out of memory, try a smaller --batch_size or --seq_len.")
            with open(result, encoding="utf-8") as f:
                for key, value in json.load(f).items():
                    records[variant].record(key, value)
            if train and i + 1 < len(jobs) and jobs[i + 1][0] != alternation:
                print(f"train_tok_s: alternation {alternation + 1} of {args.repeats} done", flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args._worker:
        return worker(args)
    if not args.memory_timeline:
        return run(args)
    lock, created = claim_timeline_folder(args.memory_timeline)
    try:
        run(args)
    finally:
        lock.release(remove=True)
        if created and not os.listdir(args.memory_timeline):  # a run that failed leaves no empty folder behind
            os.rmdir(args.memory_timeline)


def run(args):
    """The measurements, the table, and the files asked for (--memory_timeline: its folder claimed by `main`)."""
    device, dtype, size = torch.device(args.device), getattr(torch, args.dtype), bench_size(args)
    records = {v: Record(v, parameter_count(v, size)) for v in args.variants}
    if args.compile:  # every model's forward is one code object to dynamo (transformers' wrapper): a graph per model,
        # per call (prefill, decoding step) and per batch size, which its default limit of 8 would cut off (eager)
        torch._dynamo.config.recompile_limit = 8 * len(args.variants)

    # Training speed (per process unless --train_in_process) and peak memory: fresh processes, run first, while
    # this process holds no model.
    per_process = "train" not in args.skip and not args.train_in_process
    jobs = worker_jobs(args.variants, args.repeats, per_process, "memory" not in args.skip)
    timelines = {}
    with tempfile.TemporaryDirectory(prefix="bench-timeline-") as timeline_dir:
        run_workers(args, records, jobs, timeline_dir if args.memory_timeline else None)
        for name in reference_first(args.variants) if args.memory_timeline else []:
            with open(os.path.join(timeline_dir, f"{name}.json"), encoding="utf-8") as f:
                timelines[name] = json.load(f)
    if per_process:
        print(f"train_tok_s: {args.repeats} alternations done", flush=True)

    measurements = {
        "prefill_tok_s": ("prefill", lambda r: r.time_prefill(args.train_steps)),
        "decode_b1_tok_s": ("decode", lambda r: r.time_decode(1, args.new_tokens)),
        "decode_b8_tok_s": ("decode", lambda r: r.time_decode(8, args.new_tokens)),
    }
    if args.train_in_process:
        measurements = {"train_tok_s": ("train", lambda r: r.time_train(args.train_steps)), **measurements}
    measurements = {key: value for key, value in measurements.items() if value[0] not in args.skip}
    if measurements:
        runners = [Runner(v, build(v, size, device, dtype, args.implementation), size, device, args.compile)
                   for v in args.variants]
        for runner in runners:  # warm-up: allocations, optimizer state, compilation
            if "train_tok_s" in measurements:
                runner.train_step()
            if "prefill" not in args.skip:
                runner.time_prefill(1)
            if "decode" not in args.skip:  # a process's first `generate` sets up what later ones reuse (on CUDA
                # the first was up to 10x slower); compiled, each batch size's decoding step is compiled once
                for batch_size in (1, 8):
                    runner.time_decode(batch_size, args.new_tokens if args.compile else 2)
        # One measurement at a time (so that decoding never disturbs the allocator state of training), and within
        # it the models interleaved in a balanced order: every model sees the same machine conditions, positions
        # and predecessors.
        for key, (_, measure) in measurements.items():
            for repeat in range(args.repeats):
                for runner in balanced_order(runners, repeat):
                    records[runner.name].record(key, measure(runner))
            print(f"{key}: {args.repeats} repeats done", flush=True)
        del runners

    rows = summarise(list(records.values()))
    # whether DDL ran ddl_kernels' C++ CPU kernels (installed and built; else its PyTorch paths)
    kernel = (device.type == "cpu" and dtype in (torch.float32, torch.float64) and args.implementation in ("auto", "triton")
              and not args.compile and any(v != "llama" for v in args.variants) and cpu_kernels_built())
    train = "in one process" if args.train_in_process else f"per process, {args.repeats} alternations"
    header = (
        f"### bench.py --size {args.size} ({size}), device {args.device}, {args.dtype}"
        f", ddl_implementation={args.implementation}{' (C++ CPU kernel)' if kernel else ''}{', compiled' if args.compile else ''}"
        f", {args.repeats} repeats (train: {train}), torch {torch.__version__}"
    )
    print(markdown(rows, header, train_per_process=not args.train_in_process))
    if timelines:
        write_timelines(args, size, timelines)
    if args.json:
        write_results(args, {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                             "size": size.__dict__, "torch": torch.__version__, "cpu_kernel": kernel,
                             "train": "in_process" if args.train_in_process else "per_process", "rows": rows})


def write_results(args, results):
    """The results as --json names them; where a file appeared there during the run (without --overwrite), beside
    it under a free name, said in one line. Returns the path written."""
    path, n = args.json, 0
    while True:
        try:
            write_json(path, results, replace=args.overwrite)
            break
        except FileExistsError:
            n += 1
            path = "{0}.{2}{1}".format(*os.path.splitext(args.json), n)
    if path != args.json:
        print(f"--json {args.json!r} appeared while the bench ran; kept, and the results written to {path!r}")
    return path


def cpu_kernels_built() -> bool:
    """Whether ddl_kernels is installed and its C++ CPU kernels are built (and load)."""
    try:
        from ddl_kernels.build import kernels
    except ImportError:
        return False
    return kernels() is not None


def write_timelines(args, size, timelines):
    """The memory timelines into --memory_timeline (claimed by `main`): one JSON per model, the figure, and their
    peaks printed."""
    folder = args.memory_timeline
    for model, timeline in timelines.items():
        about = {"model": model, "size": args.size, "dims": size.__dict__, "device": args.device,
                 "dtype": args.dtype, "implementation": args.implementation, "torch": torch.__version__}
        write_json(os.path.join(folder, f"{model}.json"), {**about, **timeline})
    figure = plot_timelines(timelines, os.path.join(folder, "memory_timeline.png"))
    print()
    print(timeline_markdown(timelines))
    print(f"\nmemory timelines: {folder}/<model>.json" + (f", {figure}" if figure else " (no matplotlib: no figure)"))


if __name__ == "__main__":
    main()
