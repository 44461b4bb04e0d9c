"""One-command study: does the delta rule help? Seeds, matched controls and a compute-matched view (the paper,
arXiv 2601.00417, lists all three among what it leaves open).

Trains a grid of variants at equal dimensions, equal tokens and equal data order, for several seeds, each through
train.py's own code path (`python train.py ...` in a subprocess), evaluates every run on the same validation blocks
with eval.py's code path (perplexity; gate audit of each DDL variant's first seed) and writes a report to
docs/study/: mean ± std and 95% CIs, the difference to the additive baseline, cost, learning curves, conclusion.

    python study.py                   # the full default study: 6 variants x 3 seeds, tiny preset, 47 min on 2 CPUs
    python study.py --quick           # 5-minute smoke test (6 variants x 1 seed x 16 steps) into outputs/study-quick
    python study.py --report_only     # rebuild docs/study/ from the finished runs
    python study.py --variants additive-dv1 delta-dv4-cc-ec delta-dv4-tc-ec --seeds 0 1 2 3 4

Resumable: each (variant, seed) run writes outputs/study/runs/<variant>-s<seed>/result.json last; rerunning the
same command skips finished runs and redoes interrupted ones, so the study can span several sittings (Ctrl-C, even
kill -9, is safe: a training child ends with study.py, and a rerun never deletes a folder a live process still
writes). A study folder remembers its settings and refuses to mix runs made with other ones; one study.py runs in it
at a time. Paths are relative to the folder study.py is started from (its training runs start there too), and
--report_dir is refused if it holds a report study.py did not write.

The paper's setups on GPUs: the study runs as plain python, and `--launcher` wraps each training run; train.py
flags after `--` pass through unchanged (they become part of the study's settings):

    python study.py --preset small --dataset_name HuggingFaceFW/fineweb-edu --dataset_config_name sample-10BT \\
        --streaming --tokenizer_name gpt2 --max_tokens 2_000_000_000 --per_device_train_batch_size 16 \\
        --gradient_accumulation_steps 4 --world_size 8 --launcher "accelerate launch --multi_gpu --num_processes 8" \\
        --eval_tokens 2_000_000 --study_dir outputs/study-small --report_dir docs/study-small -- --bf16 true

Default budget (the arithmetic): on 2 idle CPU cores the tiny preset runs ~0.47 s/step (additive d_v=1),
~0.55 s/step (delta / write-only d_v=1) and ~0.9 s/step (any d_v=4 CC+EC) at 16 x 256 tokens per step, i.e.
~4.3 s per step for the six variants. 3 seeds x 4.3 s x 256 steps = 55 min of training, plus ~35 s per run of
start-up, data preparation, evaluation and saving (measured; 18 x 35 s = 11 min): ~66 min, leaving ~25% slack for
a busy machine within 90 minutes. Hence --max_tokens 1,048,576 = 256 steps x 16 x 256 (51% of `python train.py`'s 2.05M
tokens); the models learn well below the unigram loss (6.32) by then. Measured: the whole default study took 47 min on
2 idle cores (with evaluation during training, since dropped), validation losses 5.28-5.36.
"""

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TOKENS = 1_048_576  # per run; see "Default budget" above
QUICK_STEPS = 16  # --quick: 16 steps of the preset's batch


@dataclass
class StudySettings:
    """What a study folder remembers (built by `parse_args`, which owns the defaults)."""

    variants: list[str]
    seeds: list[int]
    preset: str
    max_tokens: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    world_size: int  # processes the launcher starts (tokens per step = batch x accumulation x world x block)
    block_size: int
    dataset_name: str | None
    dataset_config_name: str | None
    train_file: str | None
    validation_file: str | None
    streaming: bool
    tokenizer_name: str | None
    vocab_size: int
    eval_split: str
    eval_tokens: int | None  # None: the whole validation text
    audit_tokens: int
    launcher: str
    train_args: list[str] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size * self.block_size

    @property
    def max_steps(self) -> int:
        from ddl_tools.study import steps_for_tokens

        return steps_for_tokens(self.max_tokens, self.tokens_per_step)


def parse_args(argv):
    from ddl_tools.study import DEFAULT_SEEDS, DEFAULT_VARIANTS
    from ddl_tools.training import PRESET_RUN_DEFAULTS, PRESETS
    from train import ModelArguments

    train_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                   help="<delta|write_only|additive>-dv<N>[-cc|-tc][-ec]; the first additive-dv1 is the baseline")
    p.add_argument("--seeds", nargs="*", type=int, default=list(DEFAULT_SEEDS))
    p.add_argument("--preset", default="tiny", choices=list(PRESETS))
    p.add_argument("--max_tokens", type=int, default=None,
                   help=f"training tokens per run (default {DEFAULT_TOKENS:,}; --quick {QUICK_STEPS} steps)")
    p.add_argument("--per_device_train_batch_size", type=int, default=None, help="default: the preset's")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--world_size", type=int, default=1, help="processes per run started by --launcher")
    p.add_argument("--block_size", type=int, default=None, help="default: the preset's")
    for name in ("dataset_name", "dataset_config_name", "train_file", "validation_file", "tokenizer_name"):
        p.add_argument(f"--{name}")
    p.add_argument("--streaming", action="store_true")
    p.add_argument("--vocab_size", type=int, default=ModelArguments.vocab_size,
                   help="of the BPE trained once for all runs")
    p.add_argument("--eval_split", default="validation", help="split of --dataset_name for the validation loss")
    p.add_argument("--eval_tokens", type=int, default=None,
                   help="validation tokens (default: all of the validation text)")
    p.add_argument("--audit_tokens", type=int, default=16384)
    p.add_argument("--launcher", default="", help='e.g. "accelerate launch --num_processes 8" (default: python)')
    p.add_argument("--study_dir", default=None, help="runs (default outputs/study; --quick outputs/study-quick)")
    p.add_argument("--report_dir", default=None, help="report (default docs/study; --quick <study_dir>/report)")
    p.add_argument("--quick", action="store_true", help="5-minute smoke test: all variants, one seed, 16 steps")
    p.add_argument("--report_only", action="store_true", help="only rebuild the report from finished runs")
    args = p.parse_args(argv)
    run_defaults = PRESET_RUN_DEFAULTS[args.preset]
    args.per_device_train_batch_size = args.per_device_train_batch_size or run_defaults["per_device_train_batch_size"]
    args.block_size = args.block_size or run_defaults["block_size"]
    tokens_per_step = (args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
                       * args.block_size)
    if args.quick:
        args.seeds = args.seeds if "--seeds" in argv else [0]
        args.max_tokens = args.max_tokens or QUICK_STEPS * tokens_per_step
        args.eval_tokens = args.eval_tokens or 8192
        args.audit_tokens = 4096 if "--audit_tokens" not in argv else args.audit_tokens
    args.study_dir = args.study_dir or os.path.join("outputs", "study-quick" if args.quick else "study")
    args.report_dir = args.report_dir or (os.path.join(args.study_dir, "report") if args.quick
                                          else os.path.join("docs", "study"))
    if args.train_file and not args.validation_file:
        p.error("--train_file needs --validation_file: every run must be evaluated on the same fixed text.")
    settings = StudySettings(
        variants=args.variants, seeds=args.seeds, preset=args.preset, max_tokens=args.max_tokens or DEFAULT_TOKENS,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, world_size=args.world_size,
        block_size=args.block_size, dataset_name=args.dataset_name,
        dataset_config_name=args.dataset_config_name, train_file=args.train_file,
        validation_file=args.validation_file, streaming=args.streaming, tokenizer_name=args.tokenizer_name,
        vocab_size=args.vocab_size, eval_split=args.eval_split, eval_tokens=args.eval_tokens,
        audit_tokens=args.audit_tokens, launcher=args.launcher, train_args=train_args,
    )
    return settings, args


# ------------------------------------------------------------------------------------------------- one run


def train_command(settings: StudySettings, variant: str, seed: int, out: str, stats_path: str, tokenizer: str):
    """The command line of one training run: train.py's flags, run through this file's child entry (which records
    peak memory). No evaluation during training: the study evaluates every run afterwards on the same blocks."""
    from ddl_tools.study import variant_flags

    steps = settings.max_steps
    flags = {
        "output_dir": out, "overwrite_output_dir": "true", "seed": seed, "preset": settings.preset,
        "max_steps": steps, "per_device_train_batch_size": settings.per_device_train_batch_size,
        "gradient_accumulation_steps": settings.gradient_accumulation_steps, "block_size": settings.block_size,
        "tokenizer_name": tokenizer, "report_to": "none", "save_strategy": "no", "eval_strategy": "no",
        "max_eval_samples": 32, "logging_steps": max(1, min(10, steps // 20)),
        "sample_max_new_tokens": 16,
        **{k: str(v).lower() if isinstance(v, bool) else v for k, v in variant_flags(variant).items()},
    }
    for name in ("dataset_name", "dataset_config_name", "train_file", "validation_file"):
        if getattr(settings, name):
            flags[name] = getattr(settings, name)
    if settings.streaming:
        flags["streaming"] = "true"
    argv = [item for k, v in flags.items() for item in (f"--{k}", str(v))] + list(settings.train_args)
    launcher = shlex.split(settings.launcher) if settings.launcher else [sys.executable]
    return launcher + [os.path.join(ROOT, "study.py"), "_train_child", stats_path] + argv


def train_child(stats_path: str, argv: list[str]) -> int:
    """Run `train.cli(argv)`, then record the process's peak memory (rank 0 only). (Every training log entry already
    carries `train_runtime`, the seconds since training began: the wall-clock axis of the report.) Rank 0 holds the
    run folder's lock while it runs, so that a rerun of a killed study.py cannot delete the folder under it."""
    import torch
    import train
    from ddl_tools.outputs import FolderLock

    lock = FolderLock(os.path.dirname(os.path.abspath(stats_path)))
    if int(os.environ.get("RANK", "0")) == 0 and not lock.acquire():
        print(f"study.py: error: the run folder is being written by {lock.holder()}.", file=sys.stderr)
        return 2
    code = train.cli(argv)
    if int(os.environ.get("RANK", "0")) == 0:
        stats = {"max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
        if torch.cuda.is_available():
            stats["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        with open(stats_path, "w") as f:
            json.dump(stats, f)
    return code


class Evaluator:
    """Validation loss and gate audit of a trained run on fixed validation blocks, with eval.py's code path."""

    def __init__(self, settings: StudySettings):
        import eval as eval_script

        self.eval_script, self.settings = eval_script, settings
        self.device, self.dtype = eval_script.resolve_device_dtype(
            eval_script.EvalConfig(checkpoints=[], device=None, dtype="auto"))
        self.texts, self.source = validation_texts(settings)

    def __call__(self, model_dir: str, audit: bool) -> dict:
        from ddl_tools import evaluation

        model, tokenizer = self.eval_script.load_checkpoint(model_dir, self.device, self.dtype)
        ids = evaluation.tokenize_documents(tokenizer, self.texts, self.settings.eval_tokens)
        block = self.settings.block_size
        windows = evaluation.token_windows(ids, block, drop_remainder=True)  # = train.py's packed eval blocks
        ppl = evaluation.perplexity(model, windows, batch_size=16, block_size=block)
        out = {"val_loss": ppl.mean_nll, "val_perplexity": ppl.perplexity, "val_tokens": ppl.tokens,
               "val_text": self.source, "parameters": model.num_parameters()}
        if audit:
            audit_windows = evaluation.token_windows(ids[: self.settings.audit_tokens], block)
            try:
                out["audit"] = evaluation.audit_gates(model, audit_windows, batch_size=16)
            except ValueError:  # no delta residual (an additive variant)
                pass
        return out


def validation_texts(settings: StudySettings) -> tuple[list[str], str]:
    """The fixed validation text of every run: the embedded corpus's held-out works, --validation_file, or a split
    of --dataset_name (streamed when --streaming, stopping after about --eval_tokens tokens' worth of rows)."""
    if settings.validation_file:
        from ddl_tools.training import load_raw_datasets

        raw, _ = load_raw_datasets(train_file=settings.train_file, validation_file=settings.validation_file)
        return list(raw["validation"]["text"]), settings.validation_file
    if settings.dataset_name:
        import datasets

        data = datasets.load_dataset(settings.dataset_name, settings.dataset_config_name, split=settings.eval_split,
                                     streaming=settings.streaming)
        texts, chars = [], 0
        for row in data:  # ~4 characters per token; stop well after --eval_tokens
            texts.append(row["text"])
            chars += len(row["text"])
            if settings.eval_tokens and chars > 8 * settings.eval_tokens:
                break
        return texts, f"{settings.dataset_name}:{settings.eval_split}"
    from ddl_tools.data import CORPUS_NAME, shakespeare_splits

    return shakespeare_splits()["validation"], f"{CORPUS_NAME}:validation (held-out works)"


def shared_tokenizer(settings: StudySettings, study_dir: str) -> str:
    """--tokenizer_name, else one byte-level BPE trained (as train.py trains it) once for all runs, so that every
    run sees the same tokens and is scored on the same validation blocks."""
    if settings.tokenizer_name:
        return settings.tokenizer_name
    path = os.path.join(study_dir, "tokenizer")
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    from ddl_tools.training import (ensure_validation_split, load_raw_datasets, prepare_tokenizer_for_generation,
                              text_batches, train_bpe_tokenizer)
    from train import DataArguments  # train.py's defaults: the same split and tokenizer rows as a training run

    raw, info = load_raw_datasets(settings.dataset_name, settings.dataset_config_name, settings.train_file,
                                  settings.validation_file, settings.streaming)
    raw = ensure_validation_split(raw, DataArguments.validation_split_percentage, 0, info["documents"])
    rows = DataArguments.tokenizer_train_rows if settings.streaming else None
    batches = text_batches(raw["train"], "text", max_rows=rows)
    tokenizer = prepare_tokenizer_for_generation(train_bpe_tokenizer(batches, settings.vocab_size))
    tmp = path + ".tmp"
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def run_child(cmd: list[str], log_path: str) -> int:
    """Run one training process with its output in `log_path`, in study.py's working directory (the study's relative
    paths mean the same there), ended with study.py if that is killed."""
    from ddl_tools.outputs import die_with_parent

    with open(log_path, "w") as log:
        return subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())


def make_launcher(settings: StudySettings, study_dir: str, first_seed: int):
    tokenizer = shared_tokenizer(settings, study_dir)
    evaluator = Evaluator(settings)

    def launch(spec, path: str) -> dict:
        out, stats_path, log_path = (os.path.join(path, name) for name in ("model", "train_stats.json", "train.log"))
        cmd = train_command(settings, spec.variant, spec.seed, out, stats_path, tokenizer)
        start = time.time()
        code = run_child(cmd, log_path)
        if code != 0:
            with open(log_path) as f:
                tail = "".join(f.readlines()[-5:])
            raise RuntimeError(f"train.py exited with {code}; see {log_path}:\n{tail}")
        train_wall = time.time() - start
        with open(os.path.join(out, "all_results.json")) as f:
            metrics = json.load(f)
        with open(os.path.join(out, "trainer_state.json")) as f:
            log_history = json.load(f)["log_history"]
        with open(stats_path) as f:
            stats = json.load(f)
        cuda = stats.get("cuda_max_allocated_mib")
        result = {
            "steps": settings.max_steps, "tokens": metrics.get("tokens_seen"),
            "train_runtime_s": metrics.get("train_runtime"), "process_wall_s": train_wall,
            "tokens_per_s": metrics["tokens_seen"] / metrics["train_runtime"] if metrics.get("train_runtime") else None,
            "peak_memory_mib": cuda if cuda is not None else stats["max_rss_mib"],
            "memory_kind": "peak GPU memory allocated" if cuda is not None else "process max RSS (CPU)",
            "final_train_loss": metrics.get("final_train_loss"), "device": metrics.get("device"),
            "history": [{"step": e["step"], "tokens": e.get("num_input_tokens_seen", e["step"] * settings.tokens_per_step),
                         "train_loss": e["loss"], "wall_s": e["train_runtime"]} for e in log_history if "loss" in e],
        }
        result.update(evaluator(out, audit=spec.seed == first_seed))
        return result

    return launch


# ---------------------------------------------------------------------------------------------------- main


def check_settings(settings: StudySettings, args):
    """The grid, and a study folder that holds runs of these settings only (raises ValueError)."""
    from ddl_tools import study

    grid = study.build_grid(settings.variants, settings.seeds)
    if settings.max_tokens < settings.tokens_per_step:
        raise ValueError(f"--max_tokens {settings.max_tokens:,} is less than one step ({settings.tokens_per_step:,} "
                         "tokens).")
    config = {k: v for k, v in asdict(settings).items() if k not in ("variants", "seeds", "launcher")}
    study.check_report_dir(args.report_dir)  # now, not after the training
    if not args.report_only:
        study.check_study_config(args.study_dir, config)
    return grid


def train_grid(settings: StudySettings, args, grid) -> dict:
    """Train and evaluate every run of the grid that is not finished yet, printing one line per event."""
    from ddl_tools import study

    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
        print(f"warning: the machine is busy (load average {load:.1f} on {os.cpu_count()} cores): runs will be "
              "slower than the budget assumes, and tokens/s and the wall-clock curves will be distorted.")
    start = time.time()

    def on_event(kind, spec, result):
        stamp = f"[{(time.time() - start) / 60:5.1f} min] {spec.name}:"
        if kind == "skip":
            print(f"{stamp} finished earlier, skipped")
        elif kind == "start":
            print(f"{stamp} training ...", flush=True)
        elif kind == "done":
            print(f"{stamp} val loss {result['val_loss']:.4f} (ppl {result['val_perplexity']:.1f}), "
                  f"{result['tokens_per_s']:,.0f} tokens/s, {result['parameters']:,} parameters")
        else:
            print(f"{stamp} FAILED: {result['error']}")

    summary = study.run_study(args.study_dir, grid, make_launcher(settings, args.study_dir, settings.seeds[0]),
                              on_event)
    print(f"done in {(time.time() - start) / 60:.1f} min: {len(summary['done'])} run(s) trained, "
          f"{len(summary['skipped'])} skipped, {len(summary['failed'])} failed")
    return summary


def report(settings: StudySettings, args, grid, failed: dict) -> int:
    """Write the report from the finished runs of the grid and print its headline."""
    from ddl_tools import study

    wanted = {(s.variant, s.seed) for s in grid}
    results = [r for r in study.load_results(args.study_dir) if (r["variant"], r["seed"]) in wanted]
    if not results:
        print("study.py: error: no finished runs to report on.", file=sys.stderr)
        return 1
    shown = {"preset": settings.preset, "steps x tokens/step": f"{settings.max_steps} x {settings.tokens_per_step}",
             "tokens per run": settings.max_steps * settings.tokens_per_step,
             "data": settings.dataset_name or settings.train_file or "embedded Shakespeare (4 held-out works)",
             "seeds": settings.seeds, "extra train.py flags": " ".join(settings.train_args) or "none",
             "device": results[0].get("device")}
    baseline = study.BASELINE if study.BASELINE in settings.variants else settings.variants[0]
    path = study.write_report(results, args.report_dir, shown, failed, baseline, settings.variants)
    print(f"\nreport: {path}\n")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    print(text[text.find("## Final validation loss"):text.find("## Learning curves")].strip())
    print("\n" + text[text.find("## Conclusion"):].strip())
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    settings, args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging

    logging.set_verbosity_warning()
    logging.disable_progress_bar()
    try:
        grid = check_settings(settings, args)
    except ValueError as err:
        print(f"study.py: error: {err}", file=sys.stderr)
        return 2
    from ddl_tools.outputs import FolderLock

    lock = FolderLock(args.study_dir)
    try:
        busy = not args.report_only and not lock.acquire("--study_dir")
    except ValueError as err:  # the folder is not writable
        print(f"study.py: error: {err}", file=sys.stderr)
        return 2
    if busy:
        print(f"study.py: error: another study.py runs in {args.study_dir} ({lock.holder()}); wait for it to end, or "
              "choose another --study_dir.", file=sys.stderr)
        return 2
    try:
        print(f"study: {len(settings.variants)} variants x {len(settings.seeds)} seeds = {len(grid)} runs; "
              f"{settings.preset} preset, {settings.max_steps} steps x {settings.tokens_per_step:,} tokens = "
              f"{settings.max_steps * settings.tokens_per_step:,} tokens per run; runs in {args.study_dir}")
        failed = {} if args.report_only else train_grid(settings, args, grid)["failed"]
        return report(settings, args, grid, failed)
    finally:
        lock.release(remove=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_train_child":
        sys.exit(train_child(sys.argv[2], sys.argv[3:]))
    sys.exit(main(sys.argv[1:]))
