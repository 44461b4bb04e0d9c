r"""Evaluate causal-LM checkpoints (DDL or not): perplexity, lm-evaluation-harness tasks, a gate audit, a sample.

    # perplexity on the embedded corpus's held-out works (Shakespeare validation split) + a sample generation
    python eval.py out/ddl-small

    # train.py's eval_loss exactly: its block size (tiny preset: 256) and only full blocks
    python eval.py outputs/ddl-tiny-shakespeare --block_size 256 --drop_remainder

    # what the delta gates do: beta regimes, e_post/e_pre against |1 - beta|, |v|, |dX|/|X| (JSON, Markdown, PNG)
    python eval.py out/ddl-small --audit

    # several checkpoints trained the same way, one side-by-side table (comparison.md / comparison.json)
    python eval.py out/additive out/delta out/write_only --audit --tasks ddl_shakespeare --num_fewshot 1

    # downstream tasks through lm-evaluation-harness (pip install "lm-eval>=0.4,<0.5"); ddl_shakespeare ships in
    # tasks/ and runs offline, lm-eval's own tasks download their data unless cached
    python eval.py out/ddl-small --tasks ddl_shakespeare,hellaswag --num_fewshot 0 --limit 200

    # another text: a 🤗 dataset split or a local file; sliding window of 1024 tokens moving 256 at a time
    python eval.py myorg/ddl-124m --dataset_name wikitext --dataset_config wikitext-2-raw-v1 --split test \
        --block_size 1024 --stride 256
    python eval.py out/ddl-small --file my_text.txt --max_eval_tokens 50000

A CHECKPOINT is a local folder or a Hub id, loaded with AutoModelForCausalLM / AutoTokenizer. DDL checkpoints load
with the classes of the installed `ddl` package; a checkpoint's own code (config.json's auto_map: a model transformers
does not know) runs only with --trust_remote_code. Results go to --output_dir (default eval_results/<name>):
comparison.{md,json} and, per checkpoint, <name>/results.json and with --audit <name>/audit.{json,md} and
<name>/audit_{beta_hist,heatmap}.png. They are written into a temporary folder inside it and replace an earlier run's
results only when the run has finished: an interrupted or crashed run leaves the earlier results as they were, and
so does a run in which no checkpoint loaded, or in which anything failed while the earlier results are complete.
eval.py refuses a folder holding files it did not write (links included: nothing is written through one), or the
results of other checkpoints (e.g. another checkpoint-500 under the same default name); --overwrite allows both (a
result then replaces a link in its way, never what it points to). One eval.py at a time per folder. Bad flags and a
bad --file are one line, before anything is written. Each measurement fails on its own: a checkpoint that does not
load (a truncated file, an invalid config, code it needs but may not run), a bad task name or a model without DDL
layers costs only that measurement; the exit status is 1 if anything failed.
"""

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field, fields

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import ddl  # noqa: F401 (registers the DDL classes with the Auto classes: DDL checkpoints need no remote code)
from ddl_tools import evaluation
from ddl_tools.launch import device_problem
from ddl_tools.outputs import FolderLock, UsageError, claim_folder, is_leftover, publish, write_json
from ddl_tools.presets import config_error_message


DEFAULT_CONTEXT = 1024  # the block of a model whose config names no context


@dataclass
class EvalConfig:
    checkpoints: list[str] = field(metadata={"help": "local folders or Hub ids", "nargs": "+"})
    # held-out text for perplexity (and the audit)
    dataset_name: str | None = field(default=None, metadata={"help": "🤗 dataset (default: embedded corpus)"})
    dataset_config: str | None = field(default=None, metadata={"help": "🤗 dataset configuration"})
    split: str = field(default="validation", metadata={"help": "split of --dataset_name or the embedded corpus"})
    text_column: str = field(default="text", metadata={"help": "text column of --dataset_name"})
    file: str | None = field(default=None, metadata={"help": "a UTF-8 text file, one document"})
    block_size: int | None = field(default=None, metadata={"help": "window length (default: the model's context)"})
    stride: int | None = field(default=None, metadata={"help": "window step; < block_size = sliding window"})
    drop_remainder: bool = field(default=False, metadata={"help": "only full blocks, as train.py's eval set"})
    max_eval_tokens: int | None = field(default=None, metadata={"help": "evaluate only the first N tokens"})
    batch_size: int = field(default=8, metadata={"help": "windows (or lm-eval requests) per forward pass"})
    skip_perplexity: bool = field(default=False, metadata={"help": "no perplexity"})
    # downstream
    tasks: str | None = field(default=None, metadata={"help": "comma-separated lm-eval task names"})
    num_fewshot: int | None = field(default=None, metadata={"help": "few-shot examples (default: the task's)"})
    limit: int | None = field(default=None, metadata={"help": "items per task (a quick look)"})
    # gate audit
    audit: bool = field(default=False, metadata={"help": "audit the delta gates of every layer and sublayer"})
    audit_tokens: int = field(default=16384, metadata={"help": "tokens of the held-out text the audit runs on"})
    # sample
    prompt: str = field(default="To be, or not to be,", metadata={"help": "prompt of the sample generation"})
    max_new_tokens: int = field(default=40, metadata={"help": "0 = no sample generation"})
    # where and how
    output_dir: str | None = field(default=None, metadata={"help": "default: eval_results/<name>"})
    overwrite: bool = field(default=False, metadata={"help": "allow a folder holding other files or links, or "
                                                           "results of other checkpoints (replaced)"})
    trust_remote_code: bool = field(default=False, metadata={"help": "run a non-DDL checkpoint's own code "
                                                                   "(config.json's auto_map); DDL's comes from the "
                                                                   "ddl package and needs no permission"})
    device: str | None = field(default=None, metadata={"help": "cpu, cuda, cuda:1, ... (default: cuda if any)"})
    dtype: str = field(default="auto", metadata={"help": "auto (fp32 on CPU, bf16 on GPU) or a torch dtype",
                                                 "choices": ("auto", "float32", "bfloat16", "float16", "float64")})
    seed: int = field(default=0, metadata={"help": "torch seed"})


def parse_args(argv=None) -> EvalConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(EvalConfig):
        if f.name == "checkpoints":
            parser.add_argument(f.name, nargs="+", help=f.metadata["help"])
        elif f.type is bool:
            parser.add_argument(f"--{f.name}", action="store_true", help=f.metadata["help"])
        else:
            kind = int if "int" in str(f.type) else str
            parser.add_argument(f"--{f.name}", type=kind, default=f.default, help=f.metadata["help"],
                                choices=f.metadata.get("choices"))
    cfg = EvalConfig(**vars(parser.parse_args(argv)))
    problem = check_config(cfg) or stride_problem(cfg)
    if problem:
        parser.error(problem)
    return cfg


def check_config(cfg: EvalConfig) -> str | None:
    """What is wrong with the flags (one line saying what to pass), or None."""
    if cfg.block_size is not None and cfg.block_size < 2:
        return f"--block_size {cfg.block_size}: must be at least 2 (one context token and one target)."
    if cfg.stride is not None and not 1 <= cfg.stride <= (cfg.block_size or cfg.stride):
        return f"--stride {cfg.stride}: must lie in [1, --block_size] (the window moves by at least one token)."
    if cfg.batch_size < 1:
        return f"--batch_size {cfg.batch_size}: must be at least 1."
    for flag, least, hint in (
        ("max_eval_tokens", 1, "leave it out to evaluate the whole text"),
        ("audit_tokens", 1, "the audit runs on the first N tokens of the text"),
        ("limit", 1, "leave it out to run every item of a task"),
        ("num_fewshot", 0, "leave it out for the task's default"),
        ("max_new_tokens", 0, "0 = no sample"),
    ):  # (a negative --max_eval_tokens N would score all but N tokens, as a slice does)
        value = getattr(cfg, flag)
        if value is not None and value < least:
            return f"--{flag} {value}: must be at least {least} ({hint})."
    if cfg.file is not None:
        problem = text_file_problem(cfg.file)
        if problem:
            return problem
    return device_problem(cfg.device, "eval.py") if cfg.device is not None else None


def checkpoint_context(ckpt) -> int | None:
    """The context (max_position_embeddings) a checkpoint's config.json gives, read without loading the weights, a
    Hub id only from the local cache, no checkpoint's own code run; None if that cannot tell (the check after
    loading then covers it)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(ckpt, local_files_only=True, trust_remote_code=False)
    except Exception:  # noqa: BLE001 (a missing or invalid config, remote code: load_checkpoint says what is wrong)
        return None
    return getattr(config, "max_position_embeddings", None) or DEFAULT_CONTEXT


def stride_problem(cfg: EvalConfig) -> str | None:
    """--stride against the block each checkpoint is evaluated with (--block_size limited to its context), or
    None: found before the output folder is touched, not after a model has loaded and a folder of errors was
    written."""
    if cfg.stride is None:
        return None
    for ckpt in cfg.checkpoints:
        context = checkpoint_context(ckpt)
        if context is not None and cfg.stride > min(cfg.block_size or context, context):
            given = f"--block_size {cfg.block_size} is limited to" if cfg.block_size else "the block is"
            return (f"--stride {cfg.stride}: must lie in [1, block size], and {given} {context}, the context "
                    f"(max_position_embeddings) of checkpoint {ckpt!r}; pass --stride {context} or less.")
    return None


def text_file_problem(path) -> str | None:
    """What is wrong with --file (missing, not a file, unreadable, not UTF-8, no text), or None: found here, before
    the output folder is touched, rather than after the earlier results were replaced. Read in pieces, so a large
    file costs no memory."""
    if not os.path.exists(path):
        return f"--file {path!r} does not exist; pass a UTF-8 text file."
    if not os.path.isfile(path):
        return f"--file {path!r} is not a file; pass a UTF-8 text file."
    has_text = False
    try:
        with open(path, encoding="utf-8") as f:
            for piece in iter(lambda: f.read(1 << 20), ""):
                has_text = has_text or bool(piece.strip())
    except UnicodeDecodeError as err:
        return f"--file {path!r} is not UTF-8 text ({err.reason}); convert it (iconv -t UTF-8) or pass another file."
    except OSError as err:
        return f"--file {path!r}: cannot read it ({err.strerror}); pass a file you can read."
    if not has_text:
        return f"--file {path!r} holds no text (it is empty or blank); pass the text to evaluate."
    return None


# ----------------------------------------------------------------------------------------------------------------
# Inputs


def load_texts(cfg: EvalConfig) -> tuple[list[str], str]:
    """The held-out documents and a description of where they come from."""
    if cfg.file:
        with open(cfg.file, encoding="utf-8") as f:
            return [f.read()], cfg.file
    if cfg.dataset_name:
        import datasets

        data = datasets.load_dataset(cfg.dataset_name, cfg.dataset_config, split=cfg.split)
        if cfg.text_column not in data.column_names:
            raise ValueError(
                f"{cfg.dataset_name} has no column {cfg.text_column!r} (columns: {data.column_names}); "
                "pick one with --text_column."
            )
        return list(data[cfg.text_column]), f"{cfg.dataset_name}/{cfg.dataset_config or ''}:{cfg.split}"
    from ddl_tools.data import CORPUS_NAME, shakespeare_splits

    splits = shakespeare_splits()
    if cfg.split not in splits:
        raise ValueError(f"The embedded corpus has splits {sorted(splits)}, not {cfg.split!r}.")
    return splits[cfg.split], f"{CORPUS_NAME}:{cfg.split}"


def checkpoint_names(checkpoints, earlier=None, reserve=False) -> list[str]:
    """Short unique names (folder names) for tables and sub-folders: a folder's own name (`..` is the name of the
    folder it stands for), a Hub id's last part; a checkpoint an earlier run in the output folder named (`earlier`,
    {name: checkpoint_source}) keeps its name there, and (`reserve`: no --overwrite) no other takes the names of
    those not evaluated now. A name never starts with a dot: as a sub-folder, `..` or `.`
    would put a checkpoint's results outside the output folder or over its other files; nor is it one of the run's
    own files (`RUN_FILES`)."""
    kept = {source: name for name, source in (earlier or {}).items() if isinstance(source, str) and re.fullmatch(
        r"[\w-][\w.-]*", name) and name.lower() not in RUN_FILES}  # (a manifest edited by hand)
    names = [kept.pop(checkpoint_source(ckpt), None) for ckpt in checkpoints]
    taken = set(names) | (set(kept.values()) if reserve else set())
    for index in (i for i, name in enumerate(names) if name is None):
        base = re.sub(r"[^\w.-]+", "_", os.path.basename(os.path.abspath(checkpoints[index]))).lstrip(".") or "model"
        name, i = base, 2
        while name in taken or name.lower() in RUN_FILES:  # (lower: a case-insensitive disk's clash too)
            name, i = f"{base}-{i}", i + 1
        names[index] = name
        taken.add(name)
    return names


def resolve_device_dtype(cfg):
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.dtype == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return device, torch.bfloat16 if bf16 else torch.float32
    return device, getattr(torch, cfg.dtype)


def load_checkpoint(path, device, dtype, trust_remote_code=False):
    """The model and tokenizer of a checkpoint; whatever stops them from loading (a missing or truncated file, an
    invalid config, code it needs but may not run, ...) is a `ValueError` that names the checkpoint. Its own code
    (config.json's auto_map) runs only with `trust_remote_code`: a DDL checkpoint's classes come from `ddl` (the
    Auto classes prefer them to its auto_map), and a Llama checkpoint is transformers' own, whatever module its
    auto_map names."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, dtype=dtype).to(device)
    except Exception as err:  # safetensors, huggingface_hub's strict config checks, ... each have their own kind
        if not trust_remote_code and "trust_remote_code" in str(err):  # transformers: "pass trust_remote_code=True"
            raise ValueError(
                f"cannot load checkpoint {path!r}: it needs its own code (the auto_map of its config.json or "
                "tokenizer_config.json), which eval.py runs only when asked; pass --trust_remote_code if you trust it."
            ) from err
        detail = config_error_message(err) if isinstance(err, StrictDataclassError) else str(err)
        raise ValueError(
            f"cannot load checkpoint {path!r}: expected a local folder with config.json, weights and a tokenizer, or "
            f"a Hub id (needs the network, or a cached copy with HF_HUB_OFFLINE=1). {type(err).__name__}: {detail}"
        ) from err
    return model.eval(), tokenizer


def describe_model(model) -> dict:
    config = model.config
    return {
        "model_type": config.model_type,
        "class": type(model).__name__,
        "residual": getattr(config, "ddl_residual", "additive (no DDL)"),
        "value_channels": getattr(config, "ddl_value_channels", 1),
        "parameters": model.num_parameters(),
        "context": getattr(config, "max_position_embeddings", None),
        "dtype": str(model.dtype),
    }


# ----------------------------------------------------------------------------------------------------------------
# Output folder


MANIFEST = "eval_manifest.json"  # {"files": [...], "checkpoints": {name: checkpoint}} of the results in the folder
RUN_FILES = {"comparison.md", "comparison.json", MANIFEST}  # (the lock's name starts with a dot, as no name does)
STAGE_PREFIX = ".partial-"  # the temporary folder of a run's results until it has finished


def checkpoint_source(ckpt) -> str:
    """What a checkpoint is, to tell two of the same name apart: a local folder's real path, else the Hub id."""
    return os.path.realpath(ckpt) if os.path.isdir(ckpt) else ckpt


def prepare_output_dir(path, overwrite, sources):
    """Make `path` this run's (the rule of ddl_tools.outputs): claim it (`claim_folder`: create it, take its lock,
    delete the unfinished writes a kill or a full disk left), and check that it is empty or holds only an earlier
    eval.py run's results of checkpoints evaluated now, `sources` ({name: checkpoint}). eval.py never writes a
    link, and a result moved onto a path through one would land where it points: a link is refused unless
    --overwrite lets `publish` replace it (the link itself). Returns (the lock, a temporary folder for this run's
    results, the earlier run's files, whether those were complete). Nothing but leftovers is removed here."""
    try:
        lock, _ = claim_folder(path, "--output_dir", own_files=[MANIFEST])
    except UsageError as err:
        raise SystemExit(f"error: {err}")
    try:
        previous, complete = check_output_dir(path, overwrite, sources)
        return lock, tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=path), previous, complete
    except BaseException:
        lock.release(remove=True)
        raise


def check_output_dir(path, overwrite, sources):
    """The checks of `prepare_output_dir` (its folder claimed); returns (the earlier run's files, complete)."""
    for name in os.listdir(path):  # an interrupted run's unfinished results (nobody writes them: the lock is ours)
        if name.startswith(STAGE_PREFIX) and not os.path.islink(os.path.join(path, name)):
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    manifest = read_manifest(path, overwrite)
    previous, earlier = manifest.get("files", []), manifest.get("checkpoints", {})
    present, links = [], []
    for folder, dirs, names in os.walk(path):  # os.walk lists links (to folders among `dirs`) but never follows them
        for full in (os.path.join(folder, name) for name in dirs + names):
            if os.path.islink(full):
                links.append(f"{os.path.relpath(full, path)} -> {os.readlink(full)}")
        present += [os.path.relpath(os.path.join(folder, name), path) for name in names
                    if not os.path.islink(os.path.join(folder, name)) and not is_leftover(name, [MANIFEST])]
    if links and not overwrite:
        raise SystemExit(
            f"error: {path} holds links eval.py did not write ({', '.join(sorted(links)[:5])}"
            f"{', ...' if len(links) > 5 else ''}), and results would be written where they point. Remove them, "
            "choose another --output_dir, or pass --overwrite (a result replaces a link in its way, never what it "
            "points to)."
        )
    unrelated = sorted(set(present) - set(previous) - {MANIFEST, FolderLock.NAME})
    if unrelated and not overwrite:
        raise SystemExit(
            f"error: {path} holds files eval.py did not write ({', '.join(unrelated[:5])}"
            f"{', ...' if len(unrelated) > 5 else ''}). Choose another --output_dir, or pass --overwrite."
        )
    clash = [name for name in sources if name in earlier and earlier[name] != sources[name]]
    dropped = sorted(set(earlier.values()) - set(sources.values()))  # (a rerun replaces the folder's results)
    if not overwrite and (clash or dropped):
        raise SystemExit(
            f"error: {path} holds eval.py results of {', '.join(dropped or sorted(set(earlier.values())))}, not of "
            "the checkpoint(s) evaluated now. Choose another --output_dir, evaluate those too, or pass --overwrite to "
            "replace them."
        )
    return previous, bool(previous) and earlier_complete(path, manifest)


def read_manifest(path, overwrite) -> dict:
    """The manifest of the earlier run's results in `path` ({} if none); one that is not eval.py's (damaged, edited)
    is one line, or with --overwrite taken for none."""
    file = os.path.join(path, MANIFEST)
    if not os.path.lexists(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
        if isinstance(manifest, dict) and isinstance(manifest.get("files", []), list) and isinstance(
                manifest.get("checkpoints", {}), dict):
            return manifest
    except (OSError, ValueError):
        pass
    if overwrite:
        return {}
    raise SystemExit(f"error: {file} is not an eval.py manifest (damaged or edited), so what {path} holds is "
                     "unknown. Choose another --output_dir, or pass --overwrite to write this run's results there.")


def earlier_complete(path, manifest) -> bool:
    """Whether the earlier run's results in `path` are complete (nothing failed in that run): its manifest says so,
    or, written by an older eval.py, its comparison.json does."""
    if "complete" in manifest:
        return bool(manifest["complete"])
    try:
        with open(os.path.join(path, "comparison.json"), encoding="utf-8") as f:
            results = json.load(f)["results"]
        return not any(result.get("errors") for result in results)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # missing or not what eval.py writes
        return False


class Writer:
    """Writes files under the run's temporary folder and lists them (relative paths) for `publish`."""

    def __init__(self, root):
        self.root, self.files = root, []

    def path(self, *parts):
        full = os.path.join(self.root, *parts)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        self.files.append(os.path.relpath(full, self.root))
        return full

    def register(self, full_path):
        self.files.append(os.path.relpath(full_path, self.root))

    def text(self, rel, content):
        with open(self.path(rel), "w", encoding="utf-8") as f:
            f.write(content)

    def json(self, rel, obj):
        write_json(self.path(rel), obj)


# ----------------------------------------------------------------------------------------------------------------
# One checkpoint


def evaluate_checkpoint(cfg, ckpt, name, texts, text_source, writer, device, dtype) -> dict:
    """Every measurement of one checkpoint; each one fails on its own (its error is recorded, the others run)."""
    result = {"name": name, "checkpoint": ckpt, "errors": []}
    print(f"\n=== {name} ({ckpt})")
    try:
        model, tokenizer = load_checkpoint(ckpt, device, dtype, cfg.trust_remote_code)
    except ValueError as err:
        print(f"error: {err}")
        result["errors"].append(str(err))
        return result
    result["model"] = describe_model(model)
    print("model: " + ", ".join(f"{k}={v}" for k, v in result["model"].items()))

    context = getattr(model.config, "max_position_embeddings", None) or DEFAULT_CONTEXT
    block_size = min(cfg.block_size or context, context)
    if cfg.block_size and cfg.block_size > context:  # (it was limited without a word)
        print(f"note: --block_size {cfg.block_size} is limited to {context}, the model's context "
              "(max_position_embeddings).")
    ids = windows = None
    if texts is not None and (not cfg.skip_perplexity or cfg.audit):
        ids, windows = _attempt(result, "evaluation windows", evaluation_windows, cfg, tokenizer, texts, block_size,
                                text_source, result) or (None, None)
    if windows and not cfg.skip_perplexity:
        _attempt(result, "perplexity", measure_perplexity, cfg, model, windows, block_size, text_source, result)
    if cfg.tasks:
        _attempt(result, "lm-eval", run_tasks, cfg, model, tokenizer, block_size, name, writer, result)
    if cfg.audit and windows:
        _attempt(result, "audit", run_audit, cfg, model, ids, block_size, name, text_source, writer, result)
    if cfg.max_new_tokens > 0 and cfg.prompt:
        _attempt(result, "sample", generate_sample, cfg, model, tokenizer, result)
    writer.json(os.path.join(name, "results.json"), result)
    return result


def _fail(result, message):
    print(f"error: {message}")
    result["errors"].append(message)


def _attempt(result, what, measure, *args):
    """One measurement: its failure is recorded in `result` and the others still run."""
    try:
        return measure(*args)
    except Exception as err:  # noqa: BLE001 (any failure of one measurement, whatever its kind)
        _fail(result, f"{what}: {type(err).__name__}: {err}")
        return None


def evaluation_windows(cfg, tokenizer, texts, block_size, text_source, result):
    """The held-out text as token windows (none, with the reason recorded, if it is too short)."""
    ids = evaluation.tokenize_documents(tokenizer, texts, cfg.max_eval_tokens)
    windows = evaluation.token_windows(ids, block_size, cfg.stride, cfg.drop_remainder)
    if not windows:
        short = (f"fewer than one block of {block_size} (--drop_remainder keeps only full blocks)"
                 if cfg.drop_remainder and len(ids) >= 2 else "fewer than two")
        _fail(result, f"the evaluation text {text_source} has {len(ids)} token(s), {short}: perplexity and audit "
                      "skipped")
    return ids, windows


def measure_perplexity(cfg, model, windows, block_size, text_source, result):
    """1. Perplexity: the mean next-token NLL over the (sliding) windows."""
    ppl = evaluation.perplexity(model, windows, cfg.batch_size, block_size, cfg.stride)
    result["perplexity"] = {**asdict(ppl), "text": text_source}
    print(f"perplexity on {text_source}: mean NLL {ppl.mean_nll:.4f}  PPL {ppl.perplexity:.2f}  ({ppl.tokens:,} "
          f"tokens, {ppl.windows} windows of {ppl.block_size} / stride {ppl.stride}, "
          f"{ppl.tokens_per_second:,.0f} tok/s)")


def run_tasks(cfg, model, tokenizer, block_size, name, writer, result):
    """2. Downstream tasks through lm-evaluation-harness."""
    task_names = [t.strip() for t in cfg.tasks.split(",") if t.strip()]
    if not evaluation.lm_eval_available():
        _fail(result, "lm-evaluation-harness is not installed; tasks skipped. Install it: "
                      f"{evaluation.LM_EVAL_INSTALL}")
        return
    try:
        scores = evaluation.run_lm_eval(model, tokenizer, task_names, cfg.num_fewshot, cfg.batch_size, cfg.limit,
                                        block_size)
    except (ValueError, KeyError, OSError, RuntimeError) as err:  # e.g. an unknown task, data not reachable
        _fail(result, f"lm-eval: {type(err).__name__}: {err}")
        return
    result["tasks"] = {k: v for k, v in scores.items() if not k.startswith("_")}
    writer.json(os.path.join(name, "lm_eval.json"), scores["_raw"])
    for task, metrics in result["tasks"].items():
        print(f"{task}: " + "  ".join(f"{m} {v:.4f}" for m, v in metrics.items()))


def run_audit(cfg, model, ids, block_size, name, text_source, writer, result):
    """3. The gate audit, on non-overlapping blocks of the first --audit_tokens tokens (a model without DDL layers
    gets a note, not a failure: a Llama baseline in a comparison)."""
    audit_windows = evaluation.token_windows(ids[: cfg.audit_tokens], block_size)
    try:
        rows = evaluation.audit_gates(model, audit_windows, cfg.batch_size)
    except ValueError as err:
        print(f"audit skipped: {err} The other measurements are unaffected.")
        result["notes"] = [f"audit skipped: {err}"]
        return
    table, summary = evaluation.audit_markdown(rows), evaluation.audit_paragraph(rows)
    result.update(audit=rows, audit_summary=summary)
    writer.json(os.path.join(name, "audit.json"), {"text": text_source, "rows": rows, "summary": summary})
    writer.text(os.path.join(name, "audit.md"), f"# Gate audit: {name}\n\nText: {text_source}\n\n{table}\n{summary}\n")
    for png in evaluation.plot_audit(rows, os.path.join(writer.root, name), name):
        writer.register(png)
    print(f"gate audit ({rows[0]['tokens']:,} tokens):\n{table}")


def generate_sample(cfg, model, tokenizer, result):
    """4. A greedy sample through `pipeline("text-generation")`."""
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = generator(cfg.prompt, max_new_tokens=cfg.max_new_tokens, do_sample=False, return_full_text=True)
    result["generation"] = {"prompt": cfg.prompt, "text": out[0]["generated_text"]}
    print(f"sample (greedy, {cfg.max_new_tokens} new tokens): {out[0]['generated_text']!r}")


def main(argv=None) -> int:
    cfg = parse_args(argv)
    torch.manual_seed(cfg.seed)
    names = checkpoint_names(cfg.checkpoints)
    root = cfg.output_dir or os.path.join("eval_results", names[0] if len(names) == 1 else "-vs-".join(names)[:100])
    if os.path.isdir(root):  # (a look before the folder is claimed; checked again, under its lock, below)
        names = checkpoint_names(cfg.checkpoints, read_manifest(root, overwrite=True).get("checkpoints"),
                                 reserve=not cfg.overwrite)
    sources = {name: checkpoint_source(ckpt) for name, ckpt in zip(names, cfg.checkpoints)}
    lock, stage, previous, previous_complete = prepare_output_dir(root, cfg.overwrite, sources)
    try:
        return evaluate_all(cfg, names, root, stage, previous, previous_complete, sources)
    finally:  # an interrupted or crashed run leaves the earlier results as they were
        shutil.rmtree(stage, ignore_errors=True)
        lock.release(remove=True)


def evaluate_all(cfg, names, root, stage, previous, previous_complete, sources) -> int:
    """Every checkpoint into `stage`, then the results moved into `root` in place of the earlier ones, unless this
    run failed where they had not (`previous_complete`): a rerun's typo must not cost complete results."""
    writer = Writer(stage)
    device, dtype = resolve_device_dtype(cfg)

    texts, text_source, errors = None, None, []
    if not cfg.skip_perplexity or cfg.audit:
        try:
            texts, text_source = load_texts(cfg)
        except (OSError, ValueError, ImportError, RuntimeError) as err:
            errors.append(f"evaluation text: {err}")
            print(f"error: cannot load the evaluation text: {err}. Perplexity and audit are skipped.")
        else:
            if not any(t and t.strip() for t in texts):
                errors.append(f"the evaluation text {text_source} is empty")
                print(f"error: the evaluation text {text_source} is empty. Perplexity and audit are skipped.")
                texts = None

    results = [
        evaluate_checkpoint(cfg, ckpt, name, texts, text_source, writer, device, dtype)
        for ckpt, name in zip(cfg.checkpoints, names)
    ]
    for result in results:
        result["errors"] = errors + result["errors"]

    rows = evaluation.comparison_rows(results)
    table = evaluation.comparison_markdown(rows)
    writer.text("comparison.md", f"# Evaluation: {', '.join(names)}\n\nText: {text_source}\n\n{table}")
    writer.json("comparison.json", {"config": asdict(cfg), "rows": rows, "results": results})

    print(f"\n=== comparison ({len(results)} checkpoint{'s' if len(results) > 1 else ''})\n{table}")
    for result in results:
        if result.get("audit_summary"):
            print(f"{result['name']}: {result['audit_summary']}\n")
    failed = any(result["errors"] for result in results)
    if previous and not any("model" in result for result in results):
        print(f"error: no checkpoint could be loaded, so the earlier results in {root} are kept as they were.")
        return 1
    if previous and previous_complete and failed:
        print(f"error: this run had errors (above), so the earlier complete results in {root} are kept as they were; "
              "fix what failed and rerun, or choose another --output_dir for this run's results.")
        return 1
    if previous:
        print(f"replacing the results of an earlier eval.py run in {root}")
    files = sorted(set(writer.files))
    publish(stage, root, files, previous, lambda listed: write_json(
        os.path.join(root, MANIFEST),
        {"files": listed, "checkpoints": sources, "complete": not failed and listed == files},
    ))
    print(f"results written to {root}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
