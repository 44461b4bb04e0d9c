"""One-command study: does the delta rule help? Seeds, matched controls and compute-matched views (the paper,
arXiv 2601.00417, lists all three among what it leaves open).

Trains a grid of variants at equal dimensions, equal tokens and equal data order, for several seeds, each through
train.py's own code path (`python train.py ...` in a subprocess; the model is DDLConfig's defaults, the authors'
code, through train.py's preset), evaluates every run on the same validation blocks with eval.py's code path
(perplexity; gate audit of each DDL variant's first seed) and writes a report to docs/study/: mean ± std and 95% CIs,
the comparisons, cost, learning curves against tokens, wall-clock and FLOPs, conclusion.

    python study.py                   # the full study: 6 variants x 5 seeds, tiny preset, scaled to fit 3 hours
    python study.py --budget_hours 6  # the same, scaled to fit 6 hours of this machine
    python study.py --quick           # 5-minute smoke test (6 variants x 1 seed x 16 steps) into outputs/study-quick
    python study.py --report_only     # rebuild docs/study/ from the finished runs
    python study.py --variants additive-dv1 delta-dv4-cc-ec delta-dv4-tc-ec --max_tokens 1048576

Primary comparison, named before any run: `delta-dv4-cc-ec` (the paper's default DDL) minus `additive-dv1` (the
Llama baseline), final validation loss at equal tokens, paired by seed, two-sided t-test at 5% with its 95% interval,
uncorrected. Every other contrast (each variant against the baseline at equal tokens and at equal FLOPs, each delta
variant against its matched controls) is secondary: one Holm-Bonferroni family, reported with Holm-adjusted p-values
and Bonferroni-simultaneous intervals; the conclusion states a difference only where its interval excludes zero.

Equal FLOPs: every run is evaluated `--curve_evals` times during training on the first `--curve_eval_blocks`
validation blocks; its loss there is read at the FLOPs the baseline run of the same seed spent
(`ddl_tools.study.training_flops_per_token` documents the accounting).

Scale (`--budget_hours H`, default 3; `--max_tokens N` instead sets it by hand): before the first run, each variant
trains `--calibration_steps` steps through the same code path in a temporary folder (or `--calibration FILE` reuses
the calibration.json of an earlier study on this machine); from the measured seconds per step and per-run fixed cost
(start-up, evaluations, saving), `ddl_tools.study.plan_scale` picks the largest whole number of steps for which
variants x seeds runs fit in H hours less `--budget_slack` (10%) and the calibration's own time. The study folder
records the plan (calibration.json), a rerun resumes with it, and the report states the chosen scale, the measured
throughput, the predicted and the actual cost. The machine should be otherwise idle, during calibration and runs.

Resumable: each (variant, seed) run writes outputs/study/runs/<variant>-s<seed>/result.json last; rerunning the
same command skips finished runs and redoes interrupted ones, so the study can span several sittings (Ctrl-C, even
kill -9, is safe: a training child ends with study.py, and a rerun never deletes a folder a live process still
writes). A study folder remembers its settings and refuses to mix runs made with other ones; one study.py runs in it
at a time, and writes its --report_dir while no other process does (both folders are claimed as every script claims
its own: `ddl_tools.outputs.claim_folder`). Paths are relative to the folder study.py is started from (its training
runs start there too), and --report_dir is refused if it holds a report study.py did not write.

The paper's setups on GPUs: the study runs as plain python, and `--launcher` wraps each training run; train.py
flags after `--` pass through unchanged (they become part of the study's settings):

    python study.py --preset small --dataset_name HuggingFaceFW/fineweb-edu --dataset_config_name sample-10BT \\
        --streaming --tokenizer_name gpt2 --max_tokens 2_000_000_000 --per_device_train_batch_size 16 \\
        --gradient_accumulation_steps 4 --world_size 8 --launcher "accelerate launch --multi_gpu --num_processes 8" \\
        --eval_tokens 2_000_000 --study_dir outputs/study-small --report_dir docs/study-small -- --bf16 true

The earlier 3-seed study (made before the authors' defaults, 1,048,576 tokens per run) is kept as a record in
docs/study/3-seeds-before-authors-defaults/.
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
DEFAULT_BUDGET_HOURS = 3.0  # "a few hours of these 2 cores" for the whole default grid
QUICK_STEPS = 16  # --quick: 16 steps of the preset's batch
CALIBRATION_FILE = "calibration.json"


@dataclass
class StudySettings:
    """What a study folder remembers (built by `parse_args`, which owns the defaults)."""

    variants: list[str]
    seeds: list[int]
    preset: str
    max_tokens: int | None  # None until the budget has chosen it (`resolve_scale`)
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    world_size: int  # processes the launcher starts (tokens per step = batch x accumulation x world x block)
    block_size: int
    curve_evals: int  # in-training evaluations per run (the validation curve of the equal-FLOPs view)
    curve_eval_blocks: int  # validation blocks each of them evaluates
    budget_hours: float | None  # the study's time budget that chose max_tokens (None: --max_tokens given)
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
    """(StudySettings, the parsed arguments) from study.py's command line; what follows `--` is passed to every
    train.py run. A bad combination is one line (argparse's error, exit 2)."""
    train_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1 :]
    parser = study_parser()
    args = parser.parse_args(argv)
    fill_defaults(args, argv)
    check_arguments(args, parser)
    return study_settings(args, train_args), args


def study_parser() -> argparse.ArgumentParser:
    from ddl_tools.presets import PRESETS
    from ddl_tools.study import DEFAULT_SEEDS, DEFAULT_VARIANTS, PRIMARY
    from train import ModelArguments

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                   help="<delta|write_only|additive>-dv<N>[-cc|-tc][-ec]; additive-dv1 is the baseline. Primary "
                        f"comparison (named before the runs): {PRIMARY[0]} - {PRIMARY[1]}, final validation loss at "
                        "equal tokens, paired by seed, 95%%; every other contrast is Holm-corrected")
    p.add_argument("--seeds", nargs="*", type=int, default=list(DEFAULT_SEEDS))
    p.add_argument("--preset", default="tiny", choices=list(PRESETS))
    p.add_argument("--max_tokens", type=int, default=None,
                   help="training tokens per run, set by hand (default: chosen by --budget_hours; --quick "
                        f"{QUICK_STEPS} steps)")
    p.add_argument("--budget_hours", type=float, default=None,
                   help=f"hours the whole grid may take on this machine (default {DEFAULT_BUDGET_HOURS:g}): "
                        "calibration steps of each variant choose --max_tokens")
    p.add_argument("--budget_slack", type=float, default=0.1, help="fraction of the budget kept free")
    p.add_argument("--calibration_steps", type=int, default=12, help="timed steps per variant before the study")
    p.add_argument("--calibration", default=None,
                   help="reuse this calibration.json (an earlier study's on this machine) instead of timing")
    p.add_argument("--curve_evals", type=int, default=8,
                   help="in-training evaluations per run (the curve read at equal FLOPs)")
    p.add_argument("--curve_eval_blocks", type=int, default=64, help="validation blocks each of them evaluates")
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
    p.add_argument("--report_only", action="store_true",
                   help="only rebuild the report from finished runs, with the settings the study recorded")
    return p


def fill_defaults(args, argv) -> None:
    """The preset's batch and block, --quick's smaller grid (only where not given), the default budget and folders."""
    from ddl_tools.presets import PRESET_RUN_DEFAULTS

    run_defaults = PRESET_RUN_DEFAULTS[args.preset]
    for name in ("per_device_train_batch_size", "block_size"):  # only where left out: a 0 given is refused
        if getattr(args, name) is None:
            setattr(args, name, run_defaults[name])
    if args.quick:
        tokens_per_step = (args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
                           * args.block_size)
        args.seeds = args.seeds if "--seeds" in argv else [0]
        if args.budget_hours is None:
            args.max_tokens = QUICK_STEPS * tokens_per_step if args.max_tokens is None else args.max_tokens
        args.eval_tokens = 8192 if args.eval_tokens is None else args.eval_tokens
        args.audit_tokens = 4096 if "--audit_tokens" not in argv else args.audit_tokens
        args.curve_evals = args.curve_evals if "--curve_evals" in argv else 2
        args.curve_eval_blocks = args.curve_eval_blocks if "--curve_eval_blocks" in argv else 8
    if args.max_tokens is None and args.budget_hours is None:
        args.budget_hours = DEFAULT_BUDGET_HOURS
    args.study_dir = args.study_dir or os.path.join("outputs", "study-quick" if args.quick else "study")
    args.report_dir = args.report_dir or (os.path.join(args.study_dir, "report") if args.quick
                                          else os.path.join("docs", "study"))


def check_arguments(args, parser) -> None:
    """Refuse what no run could follow (argparse's one-line error)."""
    if args.max_tokens is not None and args.budget_hours is not None:
        parser.error("give --max_tokens or --budget_hours, not both: the budget chooses the tokens per run.")
    # a negative --eval_tokens N or --audit_tokens N would score all but N tokens (a slice), and a 0 batch or block
    # would stand for the preset's; the sizes come first, as --quick's --max_tokens follows from them
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "world_size", "block_size",
                 "max_tokens", "budget_hours", "calibration_steps", "curve_evals", "curve_eval_blocks", "eval_tokens",
                 "audit_tokens"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}.")
    if not 0 <= args.budget_slack < 1:
        parser.error(f"--budget_slack must be in [0, 1), got {args.budget_slack}.")
    if args.train_file and not args.validation_file:
        parser.error("--train_file needs --validation_file: every run must be evaluated on the same fixed text.")


def study_settings(args, train_args: list[str]) -> StudySettings:
    return StudySettings(
        variants=args.variants, seeds=args.seeds, preset=args.preset, max_tokens=args.max_tokens,
        curve_evals=args.curve_evals, curve_eval_blocks=args.curve_eval_blocks, budget_hours=args.budget_hours,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, world_size=args.world_size,
        block_size=args.block_size, dataset_name=args.dataset_name,
        dataset_config_name=args.dataset_config_name, train_file=args.train_file,
        validation_file=args.validation_file, streaming=args.streaming, tokenizer_name=args.tokenizer_name,
        vocab_size=args.vocab_size, eval_split=args.eval_split, eval_tokens=args.eval_tokens,
        audit_tokens=args.audit_tokens, launcher=args.launcher, train_args=train_args,
    )


# ------------------------------------------------------------------------------------------------- one run


def train_command(settings: StudySettings, variant: str, seed: int, out: str, stats_path: str, tokenizer: str,
                  steps: int | None = None):
    """The command line of one training run (`steps`: default the study's): train.py's flags, run through this
    file's child entry (which records peak memory). During training, `curve_evals` evaluations on the first
    `curve_eval_blocks` validation blocks (the last at the final step) give the validation curve of the equal-FLOPs
    view; the study evaluates every run afterwards on all its validation blocks."""
    from ddl_tools.study import variant_flags

    steps = steps or settings.max_steps
    flags = {
        "output_dir": out, "overwrite_output_dir": "true", "seed": seed, "preset": settings.preset,
        "max_steps": steps, "per_device_train_batch_size": settings.per_device_train_batch_size,
        "gradient_accumulation_steps": settings.gradient_accumulation_steps, "block_size": settings.block_size,
        "tokenizer_name": tokenizer, "report_to": "none", "save_strategy": "no", "eval_strategy": "steps",
        "eval_steps": max(1, steps // settings.curve_evals), "max_eval_samples": settings.curve_eval_blocks,
        "logging_steps": max(1, min(10, steps // 20)),
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
        self.texts, self.source, self.documents = validation_texts(settings)

    def __call__(self, model_dir: str, audit: bool) -> dict:
        from ddl_tools import evaluation, study

        model, tokenizer = self.eval_script.load_checkpoint(model_dir, self.device, self.dtype)
        ids = evaluation.tokenize_documents(tokenizer, self.texts, self.settings.eval_tokens, self.documents)
        block = self.settings.block_size
        windows = evaluation.token_windows(ids, block, drop_remainder=True)  # = train.py's packed eval blocks
        ppl = evaluation.perplexity(model, windows, batch_size=16, block_size=block)
        flops = study.training_flops_per_token(model.config, block)
        out = {"val_loss": ppl.mean_nll, "val_perplexity": ppl.perplexity, "val_tokens": ppl.tokens,
               "val_text": self.source, "parameters": model.num_parameters(), "flops_per_token": flops.total,
               "flops_breakdown": asdict(flops)}
        if audit:
            audit_windows = evaluation.token_windows(ids[: self.settings.audit_tokens], block)
            try:
                out["audit"] = evaluation.audit_gates(model, audit_windows, batch_size=16)
            except ValueError:  # no delta residual (an additive variant)
                pass
        return out


def validation_texts(settings: StudySettings) -> tuple[list[str], str, bool]:
    """The fixed validation text of every run: the embedded corpus's held-out works, --validation_file, or a split
    of --dataset_name (streamed when --streaming, stopping after about --eval_tokens tokens' worth of rows); and
    whether its rows are documents (an EOS after each, as train.py packs them) or the lines of a .txt file (none)."""
    if settings.validation_file:
        from ddl_tools.data import load_raw_datasets

        raw, info = load_raw_datasets(train_file=settings.train_file, validation_file=settings.validation_file)
        return list(raw["validation"]["text"]), settings.validation_file, info["documents"]
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
        return texts, f"{settings.dataset_name}:{settings.eval_split}", True
    from ddl_tools.data import CORPUS_NAME, shakespeare_splits

    return shakespeare_splits()["validation"], f"{CORPUS_NAME}:validation (held-out works)", True


def shared_tokenizer(settings: StudySettings, study_dir: str) -> str:
    """--tokenizer_name, else one byte-level BPE trained (as train.py trains it) once for all runs, so that every
    run sees the same tokens and is scored on the same validation blocks."""
    if settings.tokenizer_name:
        return settings.tokenizer_name
    path = os.path.join(study_dir, "tokenizer")
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    from ddl_tools.data import (
        ensure_validation_split,
        load_raw_datasets,
        prepare_tokenizer_for_generation,
        text_batches,
        train_bpe_tokenizer,
    )
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


def make_launcher(settings: StudySettings, study_dir: str, first_seed: int | None, steps: int | None = None):
    """`launch(spec, path)`: train one run (`steps`: default the study's) and evaluate it; the result of `run_study`."""
    tokenizer = shared_tokenizer(settings, study_dir)
    evaluator = Evaluator(settings)
    steps = steps or settings.max_steps

    def launch(spec, path: str) -> dict:
        out, stats_path, log_path = (os.path.join(path, name) for name in ("model", "train_stats.json", "train.log"))
        cmd = train_command(settings, spec.variant, spec.seed, out, stats_path, tokenizer, steps)
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
        history, eval_curve = training_curves(log_history, settings.tokens_per_step)
        eval_s = sum(p["eval_s"] for p in eval_curve)
        train_s = metrics["train_runtime"] - eval_s if metrics.get("train_runtime") else None
        result = {
            "steps": steps, "tokens": metrics.get("tokens_seen"),
            "train_runtime_s": metrics.get("train_runtime"), "curve_eval_s": eval_s, "process_wall_s": train_wall,
            "tokens_per_s": metrics["tokens_seen"] / train_s if train_s else None,
            "peak_memory_mib": cuda if cuda is not None else stats["max_rss_mib"],
            "memory_kind": "peak GPU memory allocated" if cuda is not None else "process max RSS (CPU)",
            "final_train_loss": metrics.get("final_train_loss"), "device": metrics.get("device"),
            "history": history, "eval_curve": eval_curve,
        }
        start = time.time()
        result.update(evaluator(out, audit=spec.seed == first_seed))
        result["final_eval_s"] = time.time() - start
        return result

    return launch


def training_curves(log_history: list[dict], tokens_per_step: int) -> tuple[list[dict], list[dict]]:
    """Trainer's log history as the study's curves: the training-loss logs (`wall_s`: seconds of training, the
    in-training evaluations before each log taken out) and the in-training validation losses."""
    history, eval_curve, paused = [], [], 0.0
    for e in log_history:
        tokens = e.get("num_input_tokens_seen") or e["step"] * tokens_per_step
        if "eval_loss" in e:
            eval_curve.append({"step": e["step"], "tokens": tokens, "val_loss": e["eval_loss"],
                               "eval_s": e.get("eval_runtime", 0.0)})
            paused += e.get("eval_runtime", 0.0)
        elif "loss" in e:
            history.append({"step": e["step"], "tokens": tokens, "train_loss": e["loss"],
                            "wall_s": e["train_runtime"] - paused})
    return history, eval_curve


# --------------------------------------------------------------------------------------------------- scale


def calibrate(settings: StudySettings, args) -> dict:
    """Time `--calibration_steps` training steps of every variant (seed = the study's first), through the study's own
    launch path in a temporary folder next to the study folder (deleted after), with one in-training evaluation at
    the end. Per variant: `step_s` (seconds per step, between the first and last step logs: the first step's
    warm-up excluded) and `run_s`, the fixed cost of one study run: the process's time beyond its steps (start-up,
    data, warm-up, saving), `--curve_evals` in-training evaluations at the measured cost of one, and the final
    evaluation (the first seed's gate audit is not included)."""
    import shutil
    import tempfile
    from dataclasses import replace

    from ddl_tools import study

    steps = args.calibration_steps
    if steps < 3:
        raise ValueError(f"--calibration_steps must be at least 3 to time steps after the first, got {steps}.")
    probe = replace(settings, max_tokens=steps * settings.tokens_per_step, curve_evals=1)
    parent = os.path.dirname(os.path.abspath(args.study_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="study-calibration-", dir=parent)
    start = time.time()
    variants = {}
    try:
        launch = make_launcher(probe, tmp, first_seed=None, steps=steps)
        for variant in settings.variants:
            path = os.path.join(tmp, variant)
            os.makedirs(path)
            print(f"calibration: {variant}, {steps} steps ...", flush=True)
            r = launch(study.RunSpec(variant, settings.seeds[0]), path)
            first, last = r["history"][0], r["history"][-1]
            if last["step"] <= first["step"]:
                raise ValueError(f"calibration of {variant}: too few step logs to time a step.")
            step_s = (last["wall_s"] - first["wall_s"]) / (last["step"] - first["step"])
            eval_one = r["curve_eval_s"] / max(1, len(r["eval_curve"]))
            run_s = r["process_wall_s"] - steps * step_s + settings.curve_evals * eval_one + r["final_eval_s"]
            variants[variant] = {"step_s": step_s, "tokens_per_s": settings.tokens_per_step / step_s, "run_s": run_s,
                                 "flops_per_token": r["flops_per_token"], "device": r.get("device")}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"steps": steps, "seconds": time.time() - start, "variants": variants,
            "load_average": os.getloadavg()[0], "preset": settings.preset,
            "tokens_per_step": settings.tokens_per_step, "curve_evals": settings.curve_evals}


def resolve_scale(settings: StudySettings, args) -> dict | None:
    """Set `settings.max_tokens` from `--budget_hours`: the plan a study folder recorded at its first start (a
    rerun resumes with it), else a new calibration (or `--calibration FILE`) and `plan_scale`. Returns the plan,
    None when --max_tokens was given. Raises ValueError (one line) for a folder planned otherwise."""
    from ddl_tools import study

    if settings.max_tokens is not None:
        return None
    recorded = os.path.join(args.study_dir, CALIBRATION_FILE)
    if os.path.isfile(os.path.join(args.study_dir, study.STUDY_FILE)):
        if not os.path.isfile(recorded):
            raise ValueError(f"{args.study_dir!r} holds a study whose --max_tokens was given by hand; rerun with the "
                             "same --max_tokens to resume it, or choose another --study_dir.")
        with open(recorded, encoding="utf-8") as f:
            plan = json.load(f)
        if plan["budget_hours"] != settings.budget_hours:
            raise ValueError(f"{args.study_dir!r} holds a study planned for --budget_hours {plan['budget_hours']:g}; "
                             "rerun with it to resume, or choose another --study_dir.")
        settings.max_tokens = plan["max_tokens"]
        return plan
    if args.report_only:
        raise ValueError(f"{args.study_dir!r} holds no study to report on.")
    if args.calibration:
        calibration = read_calibration(args.calibration, settings)
        spent = 0.0
    else:
        calibration = calibrate(settings, args)
        spent = calibration["seconds"]
    variants = calibration["variants"]
    plan = study.plan_scale({v: variants[v]["step_s"] for v in settings.variants},
                            {v: variants[v]["run_s"] for v in settings.variants}, len(settings.seeds),
                            settings.budget_hours * 3600, settings.tokens_per_step, spent, args.budget_slack)
    settings.max_tokens = plan["max_tokens"]
    return {"budget_hours": settings.budget_hours, "slack": args.budget_slack, **plan,
            "calibration_source": args.calibration or "measured at the study's start", "calibration": calibration}


def read_calibration(path: str, settings: StudySettings) -> dict:
    """The calibration of an earlier study (its calibration.json, or the calibration inside it), for this grid."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"--calibration {path!r}: cannot read it ({err}).") from err
    data = data.get("calibration", data)
    missing = [v for v in settings.variants if v not in data.get("variants", {})]
    if missing:
        raise ValueError(f"--calibration {path!r} has no timing of {', '.join(missing)}; calibrate anew (leave out "
                         "--calibration).")
    if (data.get("preset"), data.get("tokens_per_step")) != (settings.preset, settings.tokens_per_step):
        raise ValueError(f"--calibration {path!r} timed the {data.get('preset')} preset at "
                         f"{data.get('tokens_per_step')} tokens per step, not {settings.preset} at "
                         f"{settings.tokens_per_step}; calibrate anew (leave out --calibration).")
    return data


def describe_scale(plan: dict | None, results: list[dict]) -> dict:
    """The report's lines on how the scale was chosen and what the study cost."""
    if plan is None:
        return {"scale": "--max_tokens given by hand"}
    calibration = plan["calibration"]
    spent = sum((r.get("process_wall_s") or 0) + (r.get("final_eval_s") or 0) for r in results)
    return {
        "scale": f"chosen by --budget_hours {plan['budget_hours']:g} (slack {plan['slack']:.0%}): the largest whole "
                 f"number of steps for which the grid's predicted time fits; {plan['steps']} steps",
        "throughput (calibration, "
        f"{calibration['steps']} steps each; {plan['calibration_source']})": "; ".join(
            f"{v} {c['tokens_per_s']:,.0f} tokens/s ({c['step_s']:.3f} s/step), {c['run_s']:.0f} s fixed per run"
            for v, c in calibration["variants"].items()),
        "predicted cost (calibration included)": f"{plan['predicted_s'] / 3600:.2f} h",
        "measured cost of the finished runs (training processes and final evaluations)": f"{spent / 3600:.2f} h",
    }


# ---------------------------------------------------------------------------------------------------- main


def given_settings(argv: list[str]) -> set[str]:
    """The settings the command line gives itself (not argparse's or `fill_defaults`' defaults)."""
    flags = argv[: argv.index("--")] if "--" in argv else argv
    parser = study_parser()
    # None stands for "not given" (argparse.SUPPRESS as the default breaks --seeds' nargs="*" in Python 3.11)
    parser.set_defaults(**dict.fromkeys(vars(parser.parse_args([]))))
    given = {name for name, value in vars(parser.parse_args(flags)).items() if value is not None}
    return given | ({"train_args"} if "--" in argv else set())


def recorded_settings(settings: StudySettings, args, argv: list[str]) -> None:
    """--report_only: take the settings the study's runs had from its study.json, so that the report states them
    (not the command line's, defaults included). A flag given with another value is refused (raises
    ValueError, one line). Runs without a study.json are reported with the command line's settings."""
    from ddl_tools import study

    path = os.path.join(args.study_dir, study.STUDY_FILE)
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        recorded = {k: v for k, v in json.load(f).items() if k in StudySettings.__dataclass_fields__}
    given = given_settings(argv)

    def shown(name, value):  # the train.py flags after -- as typed
        return (" ".join(value) or "none") if name == "train_args" else value

    differ = [f"--{'' if name == 'train_args' else name} {shown(name, getattr(settings, name))} (the study's: "
              f"{shown(name, value)})" for name, value in recorded.items()
              if name in given and json.loads(json.dumps(getattr(settings, name))) != value]
    if differ:
        raise ValueError(f"{args.study_dir!r} holds a study run with other settings: {', '.join(differ)}; "
                         "--report_only reports it as it ran: leave these flags out.")
    for name, value in recorded.items():
        setattr(settings, name, value)
    if settings.budget_hours is not None:
        settings.max_tokens = None  # read with the plan from calibration.json (`resolve_scale`)


def check_settings(settings: StudySettings, args):
    """The grid, and a study folder that holds runs of these settings only (raises ValueError)."""
    from ddl_tools import study
    from ddl_tools.resume import file_digest

    grid = study.build_grid(settings.variants, settings.seeds)
    if settings.max_tokens < settings.tokens_per_step:
        raise ValueError(f"--max_tokens {settings.max_tokens:,} is less than one step ({settings.tokens_per_step:,} "
                         "tokens).")
    config = {k: v for k, v in asdict(settings).items() if k not in ("variants", "seeds", "launcher")}
    for name in ("train_file", "validation_file"):  # by content too: a file of the same name may hold other text
        if getattr(settings, name):
            config[f"{name}_sha256"] = file_digest(getattr(settings, name))
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


def seeds_shown(seeds: list[int], results: list[dict]):
    """The seeds the report's runs have (a study cut short, or reported before it finished, has not run them all)."""
    ran = [seed for seed in seeds if any(r["seed"] == seed for r in results)]
    return seeds if ran == list(seeds) else f"{ran} (of {list(seeds)}; the others have no finished run)"


def report(settings: StudySettings, args, grid, failed: dict, plan: dict | None = None) -> int:
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
             "seeds": seeds_shown(settings.seeds, results), "extra train.py flags": " ".join(settings.train_args) or "none",
             "in-training evaluations (equal-FLOPs curve)": f"{settings.curve_evals} x {settings.curve_eval_blocks} "
                                                             "validation blocks",
             "device": results[0].get("device"), **describe_scale(plan, results)}
    baseline = study.BASELINE if study.BASELINE in settings.variants else settings.variants[0]
    path = study.write_report(results, args.report_dir, shown, failed, baseline, settings.variants)
    print(f"\nreport: {path}\n")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    print(text[text.find("## Final validation loss"):text.find("## Learning curves")].strip())  # and comparisons
    print("\n" + text[text.find("## Conclusion"):].strip())
    return 1 if failed else 0


def claim_folders(args) -> list[tuple]:
    """The folders this study.py writes, made its own by the rule every script follows (`ddl_tools.outputs`): the
    study folder (`ddl_tools.study.claim_study_dir`; not for --report_only, which only reads it) and the report
    folder (`claim_folder`), before anything is timed or written. Returns (folder, lock, created) for each, for
    `release_folders`; a folder another process writes is one line naming it, and nothing is claimed."""
    from ddl_tools import study
    from ddl_tools.outputs import claim_folder

    claims = []
    try:
        if not args.report_only:
            claims.append((args.study_dir, *study.claim_study_dir(args.study_dir, own_files=[CALIBRATION_FILE])))
        if os.path.realpath(args.report_dir) != os.path.realpath(args.study_dir) or args.report_only:
            claims.append((args.report_dir, *claim_folder(args.report_dir, "--report_dir")))
    except BaseException:
        release_folders(claims)
        raise
    return claims


def release_folders(claims: list[tuple]) -> None:
    """Let go of the folders `claim_folders` claimed, last first; one this run created and wrote nothing into (a
    study refused or failed before writing) is removed."""
    from ddl_tools.outputs import release_folder

    for folder, lock, created in reversed(claims):
        release_folder(folder, lock, created)


def main(argv: list[str]) -> int:
    settings, args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging

    logging.set_verbosity_warning()
    logging.disable_progress_bar()
    claims = []
    try:
        try:
            from ddl_tools import study

            study.build_grid(settings.variants, settings.seeds)  # bad names: refused before any calibration
            study.check_report_dir(args.report_dir)
            if args.report_only:
                recorded_settings(settings, args, argv)
            claims = claim_folders(args)  # one study.py at a time: before the calibration
            plan = resolve_scale(settings, args)
            grid = check_settings(settings, args)
            if plan is not None and not os.path.isfile(os.path.join(args.study_dir, CALIBRATION_FILE)):
                from ddl_tools.outputs import write_json

                write_json(os.path.join(args.study_dir, CALIBRATION_FILE), plan)
        except ValueError as err:
            print(f"study.py: error: {err}", file=sys.stderr)
            return 2
        print(f"study: {len(settings.variants)} variants x {len(settings.seeds)} seeds = {len(grid)} runs; "
              f"{settings.preset} preset, {settings.max_steps} steps x {settings.tokens_per_step:,} tokens = "
              f"{settings.max_steps * settings.tokens_per_step:,} tokens per run; runs in {args.study_dir}")
        if plan is not None:
            print(f"scale: {settings.max_steps} steps per run, chosen to fit --budget_hours {settings.budget_hours:g} "
                  f"(predicted {plan['predicted_s'] / 3600:.2f} h, calibration included)")
        failed = {} if args.report_only else train_grid(settings, args, grid)["failed"]
        return report(settings, args, grid, failed, plan)
    finally:
        release_folders(claims)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_train_child":
        sys.exit(train_child(sys.argv[2], sys.argv[3:]))
    sys.exit(main(sys.argv[1:]))
