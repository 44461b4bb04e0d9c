"""What a run reports about itself: the loss curve, the model card and its metadata, the published training
arguments.
"""

import contextlib
import json
import math
import os

from ddl import DDLConfig

from .outputs import save_figure


def loss_history(log_history: list[dict]) -> tuple[list, list]:
    """[(step, train loss)], [(step, eval loss)] from `trainer.state.log_history`."""
    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e]
    evals = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e]
    return train, evals


def plot_loss_curve(log_history: list[dict], path: str, title: str = "", unigram: float | None = None) -> str | None:
    """Train and validation loss against steps (and the unigram reference), as a PNG; None when nothing was logged."""
    train, evals = loss_history(log_history)
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="validation loss")
    if unigram is not None:
        ax.axhline(unigram, color="gray", ls="--", lw=1, label="unigram (context-free) reference")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def describe_variant(config: DDLConfig) -> str:
    """A short name for the residual variant, in the paper's terms."""
    if config.ddl_residual == "additive" and config.ddl_value_channels == 1:
        return "baseline (additive residual: a Llama" + (" with QK-norm)" if config.qk_norm else ")")
    mode = {"delta": "DDL", "write_only": "write-only control", "additive": "additive control"}[config.ddl_residual]
    if config.ddl_value_channels == 1:
        return f"{mode} d_v=1"
    ec = "" if config.ddl_embed_conv else " w/o EC"
    return f"{mode}-{config.ddl_compressor.upper()}{ec} (d_v={config.ddl_value_channels})"


def training_time(metrics, tokens_seen, steps, world_size):
    """The card's training-time line. `train_runtime` is this run's; a resumed run trained only the steps after its
    checkpoint (`resumed_at_step`), so its speed counts only their share of the tokens seen. Then the steady rate
    (`StepClock`: without compilation, the first steps, evaluations and saves), the precision and whether the model
    was compiled, where the run recorded them."""
    runtime, start = metrics["train_runtime"], metrics.get("resumed_at_step", 0)
    where = f"on {world_size} process(es), {metrics.get('device', 'unknown device')}"
    if start >= steps:  # resumed at (or past) the last step: this run trained nothing
        return f"- Training time: {runtime:.0f} s {where} (resumed at step {start:,}: no step left to train)."
    run_tokens = tokens_seen * (steps - start) / steps
    resumed = f"; resumed at step {start:,}, so for its last {steps - start:,} steps" if start else ""
    seconds, counted = metrics.get("train_steady_seconds"), metrics.get("train_steady_steps")
    steady = (f"; steady {tokens_seen / steps * counted / seconds:,.0f} tokens/s over {counted:,} steps, without the "
              "first two, evaluations and saves" if seconds and counted else "")
    regime = "" if "precision" not in metrics else f"; {metrics['precision']}, " + (
        "compiled (torch.compile: its compilation is in the time, not in the steady rate)" if metrics.get(
            "compiled") else "not compiled")
    return f"- Training time: {runtime:.0f} s ({run_tokens / runtime:,.0f} tokens/s {where}{resumed}{steady}){regime}."


MODEL_CARD = """---
{metadata}
---

# {repo_name}

{intro}

## Model

| | |
|---|---|
| variant | {variant} (`ddl_residual={c.ddl_residual}`, `ddl_value_channels={c.ddl_value_channels}`, `ddl_compressor={c.ddl_compressor}`, `ddl_embed_conv={c.ddl_embed_conv}`) |
| parameters | {num_parameters:,} |
| layers x hidden | {c.num_hidden_layers} x {c.hidden_size} (MLP {c.intermediate_size}) |
| heads | {c.num_attention_heads} x {c.head_dim} (kv heads {c.num_key_value_heads}) |
| vocabulary | {c.vocab_size} ({tokenizer_source}) |
| context | trained on blocks of {block_size} tokens (max_position_embeddings {c.max_position_embeddings}) |
| QK-norm / tied embeddings | {c.qk_norm} ({c.qk_norm_position}) / {c.tie_word_embeddings} |
| layout and initialisation | `ddl_shared_compressor={c.ddl_shared_compressor}`, `ddl_cc_form={c.ddl_cc_form}`, `ddl_initialization={c.ddl_initialization}` (the defaults are the authors' code at d1f76215) |

## Data and training

- Data: {data_name}{train_tokens}.
- Tokens seen: {tokens_seen:,} in {steps:,} optimizer steps ({a.per_device_train_batch_size} x {a.gradient_accumulation_steps} x {a.world_size} blocks of {block_size} tokens per step).
{training_time}{finetuning}- Optimizer: AdamW (beta1 {a.adam_beta1}, beta2 {a.adam_beta2}), weight decay {a.weight_decay}, peak lr {a.learning_rate:g}, {scheduler} schedule, warm-up {warmup}, gradient clipping {a.max_grad_norm}, seed {a.seed}.

## Results

| | loss (nats/token) | perplexity |
|---|---|---|
| final train loss (last logged) | {train_loss} | {train_ppl} |
| validation | {val_loss} | {val_ppl} |
{unigram_row}{loss_curve}{sample}
## Use

The modeling code is stored next to the weights, so no package is needed; pass `trust_remote_code=True`:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

path = "{repo_name}"  # this folder, or its Hub id
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
print(generator({prompt!r}, max_new_tokens=100)[0]["generated_text"])
```

The remote code is PyTorch only (the model and its operations' specifications in PyTorch): loading,
training and generating start no process and write nothing but transformers' own module cache. Faster kernels (C++
for CPU, Triton for CUDA) are the optional `ddl_kernels` package of the ddl repository; when it is installed the same
code uses them (`DDL_IMPLEMENTATION=torch`, or `ddl_implementation="torch"` in `from_pretrained`, keeps PyTorch).
The model's `.py` files are the ddl project's, under the Apache-2.0 license.

Fine-tune it further with `python train.py --model_name_or_path <this folder> ...`, or as a classifier with
`python train_classifier.py --model_name_or_path <this folder>` (its `auto_map` also lists
`AutoModelForSequenceClassification`, `AutoModelForTokenClassification` and `AutoModelForQuestionAnswering`, which
load this model with a fresh head).
"""


def model_card(*, repo_name: str, config: DDLConfig, num_parameters: int, data_name: str, block_size: int,
               tokenizer_source: str, train_tokens: int | None, steps: int, metrics: dict, training_args,
               loss_curve: str | None, unigram: float | None = None, sample: str | None = None,
               prompt: str = "Romeo.\n", init_from: str | None = None, status: str | None = None,
               finetuning: str | None = None, metadata: dict | None = None) -> str:
    """The checkpoint's README.md (`MODEL_CARD` filled in): variant, sizes, data, training, results, how to load it.
    `init_from` says what the run started from (None: from scratch); `status` is a line under the introduction
    (e.g. that training is in progress); `finetuning` how the weights were adapted (e.g. LoRA), if not in full;
    `metadata` the card's metadata beyond the library, task and tags (`card_metadata`)."""
    from huggingface_hub import ModelCardData

    variant = describe_variant(config)
    header = ModelCardData(library_name="transformers", pipeline_tag="text-generation",
                           tags=["ddl", "deep-delta-learning", "custom_code"], **(metadata or {})).to_yaml()

    def loss_and_ppl(x):
        return ("n/a", "n/a") if x is None else (f"{x:.4f}", f"{math.exp(min(x, 50)):.2f}")

    train_loss, train_ppl = loss_and_ppl(metrics.get("final_train_loss"))
    val_loss, val_ppl = loss_and_ppl(metrics.get("eval_loss"))
    scheduler = getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type)
    timed = metrics.get("train_runtime") and steps
    intro = (f"A Deep Delta Learning language model (Zhang et al., 2026, arXiv 2601.00417): **{variant}**, trained "
             "from scratch with `train.py` of the `ddl` project." if not init_from else
             f"A Deep Delta Learning language model (**{variant}**), trained with `train.py` from {init_from}.")
    if status:
        intro += f"\n\n{status}"
    return MODEL_CARD.format(
        metadata=header, repo_name=repo_name, intro=intro, variant=variant, c=config, a=training_args,
        num_parameters=num_parameters,
        tokenizer_source=tokenizer_source, block_size=block_size, data_name=data_name,
        train_tokens=f"; {train_tokens:,} training tokens" if train_tokens else "",
        tokens_seen=metrics["tokens_seen"], steps=steps, scheduler=scheduler, warmup=_warmup(training_args.warmup_steps),
        training_time=training_time(metrics, metrics["tokens_seen"], steps, training_args.world_size) + "\n"
        if timed else "",
        train_loss=train_loss, train_ppl=train_ppl, val_loss=val_loss, val_ppl=val_ppl,
        unigram_row=f"| unigram reference (context-free, validation) | {unigram:.4f} | {math.exp(unigram):.2f} |\n"
        if unigram is not None else "",
        loss_curve=f"\n![loss curve]({os.path.basename(loss_curve)})\n" if loss_curve else "",
        sample=f"\nA sample (sampling with the saved generation config):\n\n```text\n{sample.strip()}\n```\n"
        if sample is not None else "",
        prompt=prompt,
        finetuning=f"- Fine-tuning: {finetuning}.\n" if finetuning else "",
    )


def card_metadata(*, license_id: str | None, dataset_name: str | None, base: str | None) -> dict:
    """The card's metadata of a run: its license (train.py's default: apache-2.0, the code's), the Hub dataset it
    trained on, and the model it started from (`base`) as a Hub id; a local folder names the base its own card names,
    a local file nothing."""
    from huggingface_hub import ModelCard

    metadata = {"license": license_id} if license_id else {}
    if dataset_name and not os.path.exists(dataset_name):
        metadata["datasets"] = [dataset_name]
    if base and os.path.isdir(base):
        card = os.path.join(base, "README.md")
        base = None
        with contextlib.suppress(ValueError):  # (a card whose metadata does not parse names no base)
            base = ModelCard.load(card).data.base_model if os.path.isfile(card) else None
    if base:
        metadata.update(base_model=base, base_model_relation="finetune")
    return metadata


def _warmup(warmup_steps: float) -> str:
    return f"{warmup_steps:.0%} of the steps" if 0 < warmup_steps < 1 else f"{int(warmup_steps)} steps"


def shareable_arguments(args) -> str:
    """The training arguments as JSON for the output folder, which is published: the output folder named by its own
    name, not by where it lay on the machine that trained it."""
    values = args.to_dict()
    values["output_dir"] = os.path.basename(os.path.abspath(args.output_dir))
    return json.dumps(values, indent=2, sort_keys=True) + "\n"


__all__ = [
    "MODEL_CARD",
    "card_metadata",
    "describe_variant",
    "loss_history",
    "model_card",
    "plot_loss_curve",
    "shareable_arguments",
]
