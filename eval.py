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

A CHECKPOINT is a local folder or a Hub id, loaded with AutoModelForCausalLM / AutoTokenizer
(trust_remote_code=True). Results go to --output_dir (default eval_results/<name>): comparison.{md,json} and, per
checkpoint, <name>/results.json and with --audit <name>/audit.{json,md} and <name>/audit_{beta_hist,heatmap}.png.
eval.py refuses to write into a folder holding files it did not write (--overwrite to allow).
Each measurement fails on its own: a bad task name or a model without DDL layers costs only that measurement;
the exit status is 1 if anything failed.
"""

import argparse
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field, fields

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from ddl_tools import evaluation
from ddl_tools.outputs import write_json


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
    overwrite: bool = field(default=False, metadata={"help": "allow writing into a folder with other files"})
    device: str | None = field(default=None, metadata={"help": "cpu, cuda, cuda:1, ... (default: cuda if any)"})
    dtype: str = field(default="auto", metadata={"help": "auto (fp32 on CPU, bf16 on GPU), float32, bfloat16"})
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
            parser.add_argument(f"--{f.name}", type=kind, default=f.default, help=f.metadata["help"])
    return EvalConfig(**vars(parser.parse_args(argv)))


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


def checkpoint_names(checkpoints) -> list[str]:
    """Short unique names (folder names) for tables and sub-folders."""
    names = []
    for ckpt in checkpoints:
        base = re.sub(r"[^\w.-]+", "_", os.path.basename(os.path.normpath(ckpt)) or ckpt) or "model"
        name, i = base, 2
        while name in names:
            name, i = f"{base}-{i}", i + 1
        names.append(name)
    return names


def resolve_device_dtype(cfg):
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.dtype == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return device, torch.bfloat16 if bf16 else torch.float32
    return device, getattr(torch, cfg.dtype)


def load_checkpoint(path, device, dtype):
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=dtype)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(
            f"cannot load checkpoint {path!r}: expected a local folder with config.json, weights and a tokenizer, or "
            f"a Hub id (needs the network, or a cached copy with HF_HUB_OFFLINE=1). {type(err).__name__}: {err}"
        ) from err
    return model.to(device).eval(), tokenizer


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


MANIFEST = "eval_manifest.json"


def prepare_output_dir(path, overwrite):
    """Create `path`, or reuse it if it is empty or holds only files of an earlier eval.py run (which are removed,
    so that no stale result survives). Anything else there stops the run unless `overwrite`."""
    os.makedirs(path, exist_ok=True)
    previous = []
    if os.path.exists(os.path.join(path, MANIFEST)):
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            previous = json.load(f)["files"]
    present = [
        os.path.relpath(os.path.join(root, name), path) for root, _, names in os.walk(path) for name in names
    ]
    unrelated = sorted(set(present) - set(previous) - {MANIFEST})
    if unrelated and not overwrite:
        raise SystemExit(
            f"error: {path} holds files eval.py did not write ({', '.join(unrelated[:5])}"
            f"{', ...' if len(unrelated) > 5 else ''}). Choose another --output_dir, or pass --overwrite."
        )
    if previous:
        print(f"replacing the results of an earlier eval.py run in {path}")
    for rel in previous:
        if os.path.isfile(os.path.join(path, rel)):
            os.remove(os.path.join(path, rel))


class Writer:
    """Writes files under the output folder and keeps the manifest of what eval.py wrote."""

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

    def close(self):
        write_json(os.path.join(self.root, MANIFEST), {"files": sorted(set(self.files))})


# ----------------------------------------------------------------------------------------------------------------
# One checkpoint


def evaluate_checkpoint(cfg, ckpt, name, texts, text_source, writer, device, dtype) -> dict:
    """Every measurement of one checkpoint; each one fails on its own (its error is recorded, the others run)."""
    result = {"name": name, "checkpoint": ckpt, "errors": []}
    print(f"\n=== {name} ({ckpt})")
    try:
        model, tokenizer = load_checkpoint(ckpt, device, dtype)
    except ValueError as err:
        print(f"error: {err}")
        result["errors"].append(str(err))
        return result
    result["model"] = describe_model(model)
    print("model: " + ", ".join(f"{k}={v}" for k, v in result["model"].items()))

    context = getattr(model.config, "max_position_embeddings", None) or 1024
    block_size = min(cfg.block_size or context, context)
    ids = windows = None
    if texts is not None and (not cfg.skip_perplexity or cfg.audit):
        ids = evaluation.tokenize_documents(tokenizer, texts, cfg.max_eval_tokens)
        windows = evaluation.token_windows(ids, block_size, cfg.stride, cfg.drop_remainder)
        if not windows:
            _fail(result, f"the evaluation text {text_source} has fewer than two tokens: perplexity and audit skipped")
    if windows and not cfg.skip_perplexity:
        measure_perplexity(cfg, model, windows, block_size, text_source, result)
    if cfg.tasks:
        run_tasks(cfg, model, tokenizer, block_size, name, writer, result)
    if cfg.audit and windows:
        run_audit(cfg, model, ids, block_size, name, text_source, writer, result)
    if cfg.max_new_tokens > 0 and cfg.prompt:
        generate_sample(cfg, model, tokenizer, result)
    writer.json(os.path.join(name, "results.json"), result)
    return result


def _fail(result, message):
    print(f"error: {message}")
    result["errors"].append(message)


def measure_perplexity(cfg, model, windows, block_size, text_source, result):
    """1. Perplexity: the mean next-token NLL over the (sliding) windows."""
    ppl = evaluation.perplexity(model, windows, cfg.batch_size, block_size, cfg.stride)
    result["perplexity"] = {**asdict(ppl), "text": text_source}
    print(f"perplexity on {text_source}: mean NLL {ppl.mean_nll:.4f}  PPL {ppl.perplexity:.2f}  ({ppl.tokens:,} "
          f"tokens, {ppl.windows} windows of {ppl.block_size} / stride {ppl.stride}, {ppl.tokens_per_second:,.0f} tok/s)")


def run_tasks(cfg, model, tokenizer, block_size, name, writer, result):
    """2. Downstream tasks through lm-evaluation-harness."""
    task_names = [t.strip() for t in cfg.tasks.split(",") if t.strip()]
    if not evaluation.lm_eval_available():
        _fail(result, f"lm-evaluation-harness is not installed; tasks skipped. Install it: {evaluation.LM_EVAL_INSTALL}")
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
    prepare_output_dir(root, cfg.overwrite)
    writer = Writer(root)
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
    writer.close()

    print(f"\n=== comparison ({len(results)} checkpoint{'s' if len(results) > 1 else ''})\n{table}")
    for result in results:
        if result.get("audit_summary"):
            print(f"{result['name']}: {result['audit_summary']}\n")
    print(f"results written to {root}")
    return 1 if any(result["errors"] for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
