"""Evaluation helpers used by `eval.py`: perplexity, lm-evaluation-harness tasks, the gate audit, reports.

- `perplexity`: mean next-token NLL over a token stream cut into (sliding) windows, with the exact loss that
  `Trainer.evaluate` reports when the windows are non-overlapping blocks (stride == block size).
- `run_lm_eval`: downstream tasks through lm-evaluation-harness (`lm_eval.simple_evaluate`), including the small
  task shipped in `tasks/` so that the path runs offline.
- `GateAudit`: forward hooks on every `DDLDeltaResidual` that measure what the delta gates do: the distribution of
  beta, the discrepancy along k before and after the update (e_pre = k^T X - v^T, e_post = k^T X_next - v^T; the
  paper predicts |e_post| = |1 - beta| |e_pre|), |v| and the relative size of the update.
- `write_*` / `*_markdown` / `plot_*`: JSON, Markdown and PNG reports.

Library code: it logs and never prints.
"""

import inspect
import math
import os
import re
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.utils import logging

from .outputs import save_figure


logger = logging.get_logger(__name__)

TASKS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tasks")
LM_EVAL_INSTALL = 'pip install "lm-eval>=0.4,<0.5"'
DELTA_CLASS_NAME = "DDLDeltaResidual"
# Gate regimes (paper section 5, "audit of the learned gates"); beta lies in [0, 2].
SKIP_BELOW, OVERWRITE_LOW, OVERWRITE_HIGH, OVER_RELAXED_ABOVE = 0.1, 0.9, 1.1, 1.0
BETA_BINS = 40  # bins of width 0.05 on [0, 2]: the regime edges 0.1, 0.9, 1.0 and 1.1 fall on bin edges


# ----------------------------------------------------------------------------------------------------------------
# Text -> token windows


def tokenize_documents(tokenizer, texts, max_tokens=None, add_eos=True) -> torch.Tensor:
    """One token stream: each document tokenized on its own and followed by the EOS token (if the tokenizer has
    one), as train.py packs its validation set. Empty documents are dropped. `max_tokens` truncates the stream.
    `add_eos=False` for rows that are consecutive lines of one text (a .txt file), which train.py packs without one.
    """
    eos = [] if tokenizer.eos_token_id is None or not add_eos else [tokenizer.eos_token_id]
    stream = []
    for text in texts:
        if not text or not text.strip():
            continue
        stream.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] + eos)
        if max_tokens is not None and len(stream) >= max_tokens:
            break
    if max_tokens is not None:
        stream = stream[:max_tokens]
    return torch.tensor(stream, dtype=torch.long)


def token_windows(ids: torch.Tensor, block_size: int, stride: int | None = None, drop_remainder: bool = False):
    """Cut a token stream into windows of at most `block_size` tokens, starting every `stride` tokens.

    Returns a list of `(input_ids, labels)` 1-D tensors. Each token is scored once: labels are -100 for the tokens
    an earlier window already scored, so with `stride < block_size` every scored token sees at least
    `block_size - stride` tokens of context (the sliding window of the transformers perplexity guide). With
    `stride == block_size` (the default) the windows are the non-overlapping blocks a Trainer evaluates; as there,
    the first token of a block is context only. Windows that score nothing are dropped. `drop_remainder` drops the
    tokens after the last full block, as packing for training does (then the windows are exactly a Trainer's
    evaluation blocks).
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (one context token and one target), got {block_size}.")
    stride = block_size if stride is None else stride
    if not 1 <= stride <= block_size:
        raise ValueError(f"stride must lie in [1, block_size={block_size}], got {stride}.")
    n = len(ids) if not drop_remainder else len(ids) // block_size * block_size
    windows, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + block_size, n)
        input_ids = ids[begin:end]
        labels = input_ids.clone()
        labels[: max(prev_end - begin, 0)] = -100  # already scored by an earlier window
        if (labels[1:] != -100).any():  # position 0 is never a target (the loss shifts by one)
            windows.append((input_ids, labels))
        prev_end = end
        if end == n:
            break
    return windows


def _batches(windows, batch_size):
    """Consecutive windows of equal length stacked into `(B, T)` batches (no padding needed)."""
    batch = []
    for window in windows:
        if batch and (len(batch) == batch_size or len(window[0]) != len(batch[0][0])):
            yield torch.stack([w[0] for w in batch]), torch.stack([w[1] for w in batch])
            batch = []
        batch.append(window)
    if batch:
        yield torch.stack([w[0] for w in batch]), torch.stack([w[1] for w in batch])


# ----------------------------------------------------------------------------------------------------------------
# Perplexity


@dataclass
class PerplexityResult:
    mean_nll: float  # nats per scored token
    perplexity: float  # exp(mean_nll)
    tokens: int  # scored tokens
    windows: int
    block_size: int
    stride: int
    seconds: float
    tokens_per_second: float


@torch.no_grad()
def perplexity(model, windows, batch_size=8, block_size=None, stride=None) -> PerplexityResult:
    """Mean next-token NLL (fp32 log-softmax, summed in fp64) over `windows` from `token_windows`.

    On non-overlapping equal-length blocks this is the `eval_loss` of `Trainer.evaluate` (which averages
    `ForCausalLMLoss` over the same tokens); perplexity = exp(mean NLL).
    """
    if not windows:
        raise ValueError("No tokens to evaluate: the text is empty or shorter than two tokens.")
    model.eval()
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for input_ids, labels in _batches(windows, batch_size):
        input_ids, labels = input_ids.to(device), labels.to(device)
        logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
        targets = labels[:, 1:]  # (B, T-1)
        nll = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="sum")
        total_nll += nll.double().item()
        total_tokens += int((targets != -100).sum())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    mean_nll = total_nll / total_tokens
    return PerplexityResult(
        mean_nll=mean_nll,
        perplexity=math.exp(mean_nll),
        tokens=total_tokens,
        windows=len(windows),
        block_size=block_size or max(len(w[0]) for w in windows),
        stride=stride or block_size or max(len(w[0]) for w in windows),
        seconds=seconds,
        tokens_per_second=total_tokens / seconds if seconds > 0 else float("inf"),
    )


# ----------------------------------------------------------------------------------------------------------------
# lm-evaluation-harness


def lm_eval_available() -> bool:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return False
    return True


def task_manager(task_names, include_path=TASKS_DIR):
    """A `TaskManager` that knows `tasks/`. lm-eval's own ~15k task configs are indexed (seconds) only when a
    requested name is not a local task. Raises `ValueError` naming unknown tasks and the closest known names."""
    import difflib

    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path, include_defaults=False)
    if set(task_names) - set(manager.match_tasks(list(task_names))):
        manager = TaskManager(include_path=include_path)
    unknown = [name for name in task_names if not manager.match_tasks([name])]
    if unknown:
        hints = {name: difflib.get_close_matches(name, manager.all_tasks, n=3) for name in unknown}
        hint = "; ".join(f"{name!r}: did you mean {close}?" if close else repr(name) for name, close in hints.items())
        raise ValueError(
            f"lm-eval does not know the task(s) {hint}. `lm_eval ls tasks` lists them; local tasks live in "
            f"{include_path}."
        )
    return manager


def run_lm_eval(model, tokenizer, task_names, num_fewshot=None, batch_size=8, limit=None, max_length=None):
    """Run lm-eval tasks on an already loaded model. Returns `{task: {metric: value}}` (stderrs dropped) and the
    raw `results` dict of `simple_evaluate` under the key `"_raw"`."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    manager = task_manager(task_names)
    device = str(next(model.parameters()).device)
    lm = HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        backend="causal",
        batch_size=batch_size,
        device=device,
        max_length=max_length,
    )
    output = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(task_names),
        num_fewshot=num_fewshot,
        task_manager=manager,
        limit=limit,
        bootstrap_iters=0,
        log_samples=False,
    )
    scores = {}
    for task, metrics in output["results"].items():
        scores[task] = {
            key.split(",")[0]: value
            for key, value in metrics.items()
            if "," in key and "_stderr" not in key and isinstance(value, (int, float))
        }
    scores["_raw"] = {"results": output["results"], "n-shot": output.get("n-shot"), "versions": output.get("versions")}
    return scores


# ----------------------------------------------------------------------------------------------------------------
# Gate audit


def find_delta_modules(model):
    """`[(layer_idx, sublayer, module)]` for every DDL delta residual, found by class name so that remote-code
    models (whose classes live in `transformers_modules...`) are found too. sublayer: "attn" or "mlp"."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ != DELTA_CLASS_NAME:
            continue
        match = re.search(r"layers\.(\d+)\.(\w+?)_delta$", name)
        if match is None:
            raise ValueError(f"Unexpected place of a {DELTA_CLASS_NAME} in the model: {name!r}.")
        found.append((int(match.group(1)), match.group(2), module))
    return sorted(found, key=lambda item: (item[0], item[1] != "attn"))


class _SublayerStats:
    """Running sums for one delta residual (all statistics are per token, averaged over the tokens seen)."""

    def __init__(self, layer, sublayer, mode):
        self.layer, self.sublayer, self.mode = layer, sublayer, mode
        self.tokens = 0
        self.beta_hist = torch.zeros(BETA_BINS, dtype=torch.float64)
        self.sums = dict.fromkeys(
            [
                "beta", "beta_sq", "skip", "overwrite", "over_relaxed", "abs_1_minus_beta",
                "e_pre", "e_post", "e_pre_weighted_1_minus_beta", "v_norm", "update_share",
            ],
            0.0,
        )  # fmt: skip
        self.beta_min, self.beta_max = math.inf, -math.inf

    def add(self, **per_token):
        """per_token: 1-D fp32 tensors over the tokens of one forward call."""
        self.tokens += per_token["update_share"].numel()
        self.sums["update_share"] += per_token["update_share"].double().sum().item()
        beta = per_token.get("beta")
        if beta is None:
            return
        beta = beta.double()
        e_pre, e_post = per_token["e_pre"].double(), per_token["e_post"].double()
        self.beta_hist += torch.histc(beta.clamp(0.0, 2.0), bins=BETA_BINS, min=0.0, max=2.0).cpu()
        self.beta_min, self.beta_max = min(self.beta_min, beta.min().item()), max(self.beta_max, beta.max().item())
        updates = {
            "beta": beta.sum(),
            "beta_sq": beta.pow(2).sum(),
            "skip": (beta < SKIP_BELOW).sum(),
            "overwrite": ((beta >= OVERWRITE_LOW) & (beta <= OVERWRITE_HIGH)).sum(),
            "over_relaxed": (beta > OVER_RELAXED_ABOVE).sum(),
            "abs_1_minus_beta": (1.0 - beta).abs().sum(),
            "e_pre": e_pre.sum(),
            "e_post": e_post.sum(),
            "e_pre_weighted_1_minus_beta": ((1.0 - beta).abs() * e_pre).sum(),
            "v_norm": per_token["v_norm"].double().sum(),
        }
        for key, value in updates.items():
            self.sums[key] += float(value)

    def summary(self) -> dict:
        n, s = max(self.tokens, 1), self.sums
        row = {"layer": self.layer, "sublayer": self.sublayer, "mode": self.mode, "tokens": self.tokens}
        row["update_share"] = s["update_share"] / n
        if self.mode == "additive":
            row["note"] = "additive residual (x + h): no gate"
            return row
        mean_beta = s["beta"] / n
        row.update(
            beta_mean=mean_beta,
            beta_std=math.sqrt(max(s["beta_sq"] / n - mean_beta**2, 0.0)),
            beta_min=self.beta_min,
            beta_max=self.beta_max,
            share_skip=s["skip"] / n,
            share_overwrite=s["overwrite"] / n,
            share_over_relaxed=s["over_relaxed"] / n,
            e_pre=s["e_pre"] / n,
            e_post=s["e_post"] / n,
            # Measured contraction of the discrepancy, and what the paper predicts for delta mode: |1 - beta|,
            # averaged with the same weights (|e_pre|) as the measured ratio of means.
            e_ratio=s["e_post"] / s["e_pre"] if s["e_pre"] > 0 else float("nan"),
            e_ratio_predicted=s["e_pre_weighted_1_minus_beta"] / s["e_pre"] if s["e_pre"] > 0 else float("nan"),
            mean_abs_1_minus_beta=s["abs_1_minus_beta"] / n,
            v_norm=s["v_norm"] / n,
            beta_hist=self.beta_hist.tolist(),
        )
        return row


class GateAudit:
    """Measure what every DDL delta residual does, through forward hooks (the model's own forward is unchanged).

    For each sublayer and token, from the hooked call `forward(x, h, context, sublayer_input) -> x_next`:

        beta = module.gate(context)                     (the model's gate)
        v    = module.value(u, X)                       (u = sublayer_input or context, as the model uses it; a
                                                         constant target, `ddl_v_constant`, takes X's shape)
        k    = h / sqrt(|h|^2 + k_eps^2)                (the direction of `delta_update`)
        e_pre = k^T X - v^T,   e_post = k^T X_next - v^T (mean |.| over the d_v channels)
        update_share = |X_next - X| / |X|                (Frobenius norm over d[, d_v])

    Use as a context manager around forward passes, then call `summary()`. Raises `ValueError` if the model has no
    DDL delta residuals (e.g. a plain Llama checkpoint).
    """

    def __init__(self, model):
        self.model = model
        self.modules = find_delta_modules(model)
        if not self.modules:
            raise ValueError(
                f"No {DELTA_CLASS_NAME} modules in this model ({type(model).__name__}, model_type="
                f"{getattr(model.config, 'model_type', '?')!r}): it is not a DDL checkpoint, so there are no gates "
                "to audit."
            )
        self.stats = [_SublayerStats(layer, sub, module.mode) for layer, sub, module in self.modules]
        self._handles = []

    def __enter__(self):
        for (_, _, module), stats in zip(self.modules, self.stats):
            # the remote code of checkpoints saved before the constant target has value(u), without the state
            takes_state = "state" in inspect.signature(module.value).parameters
            hook = self._make_hook(stats, inspect.signature(module.forward), self.model.config, takes_state)
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @staticmethod
    def _make_hook(stats, signature, config, value_takes_state):
        @torch.no_grad()
        def hook(module, args, kwargs, output):
            bound = signature.bind(*args, **kwargs).arguments
            # (the seam's arguments and result as each version of the model's code names them: a checkpoint's own
            # remote code may be older; since ddl 0.4 the seam also gives the next sublayer's input)
            x, h, context = bound.get("state", bound.get("x")), bound["h"], bound["context"]
            output = output[0] if isinstance(output, tuple) else output
            state, next_state = x.float(), output.float()
            if state.dim() == 3:  # d_v = 1: (B, T, d) -> (B, T, 1, d)
                state, next_state = state.unsqueeze(-2), next_state.unsqueeze(-2)
            update_share = (next_state - state).flatten(2).norm(dim=-1) / state.flatten(2).norm(dim=-1).clamp_min(
                1e-12
            )  # (B, T)
            if module.mode == "additive":
                stats.add(update_share=update_share.flatten())
                return
            u = bound.get("x_in", bound.get("sublayer_input")) if config.ddl_value_input == "state" else context
            beta = module.gate(context).squeeze(-1)  # (B, T)
            v = (module.value(u, x) if value_takes_state else module.value(u)).float()  # (B, T, d_v)
            h32 = h.float()
            # the paper's k, written out here: this file runs without the ddl package (remote-code checkpoints)
            k = h32 * torch.rsqrt(h32.pow(2).sum(-1, keepdim=True) + config.ddl_k_eps**2)  # (B, T, d)
            e_pre = torch.einsum("btd,btvd->btv", k, state) - v  # (B, T, d_v)
            e_post = torch.einsum("btd,btvd->btv", k, next_state) - v
            stats.add(
                beta=beta.flatten(),
                e_pre=e_pre.abs().mean(-1).flatten(),
                e_post=e_post.abs().mean(-1).flatten(),
                v_norm=v.norm(dim=-1).flatten(),
                update_share=update_share.flatten(),
            )

        return hook

    def summary(self) -> list[dict]:
        return [stats.summary() for stats in self.stats]


@torch.no_grad()
def audit_gates(model, windows, batch_size=8) -> list[dict]:
    """Run `windows` (from `token_windows`) through the model under a `GateAudit`; one row per delta residual."""
    model.eval()
    device = next(model.parameters()).device
    with GateAudit(model) as audit:
        for input_ids, _ in _batches(windows, batch_size):
            model(input_ids=input_ids.to(device), use_cache=False)
    return audit.summary()


def audit_paragraph(rows) -> str:
    """A plain-language paragraph about an audit (for people who have not read the paper)."""
    gated = [r for r in rows if r["mode"] != "additive"]
    if not gated:
        return (
            f"All {len(rows)} residual connections are plain additions (x + h): this model has no gates, so every "
            f"sublayer simply adds its output, changing the state by {_mean(rows, 'update_share'):.0%} of its norm "
            "on average."
        )
    tokens = gated[0]["tokens"]
    mode = gated[0]["mode"]
    skip, over = _mean(gated, "share_skip"), _mean(gated, "share_over_relaxed")
    overwrite = _mean(gated, "share_overwrite")
    attn = [r for r in gated if r["sublayer"] == "attn"]
    mlp = [r for r in gated if r["sublayer"] == "mlp"]
    low = min(gated, key=lambda r: r["beta_mean"])
    high = max(gated, key=lambda r: r["beta_mean"])
    biggest = max(gated, key=lambda r: r["update_share"])
    if max(overwrite, skip, over) < 0.5:
        habit = "use a mix of regimes, none for a majority of tokens"
    elif overwrite >= max(skip, over):
        habit = "mostly overwrite what the state says along their direction (beta near 1)"
    elif skip >= over:
        habit = "mostly skip, leaving the state almost untouched (beta near 0)"
    else:
        habit = "mostly over-relax, pushing past the target and flipping the sign of the mismatch (beta above 1)"
    text = (
        f"Over {tokens} tokens, the {len(gated)} {mode} gates ({len(gated) // max(len({r['layer'] for r in gated}), 1)}"
        f" per layer) {habit}: {overwrite:.0%} of gate values are near 1 (overwrite), {skip:.0%} below 0.1 (skip) and "
        f"{over:.0%} above 1 (over-relaxed; values in (1, 1.1] count in both). Attention gates average beta = "
        f"{_mean(attn, 'beta_mean'):.2f} and MLP gates {_mean(mlp, 'beta_mean'):.2f}"
    )
    if high["beta_mean"] - low["beta_mean"] < 0.01:
        text += "; every gate sits at about the same value. "
    else:
        text += (
            f"; the lowest is layer {low['layer']} {low['sublayer']} ({low['beta_mean']:.2f}), the highest layer "
            f"{high['layer']} {high['sublayer']} ({high['beta_mean']:.2f}). "
        )
    if mode == "delta":
        text += (
            f"Each update shrinks the mismatch between what the state reads along k and the target v to "
            f"{_mean(gated, 'e_ratio'):.2f} of its size on average (the paper's rule |1 - beta| predicts "
            f"{_mean(gated, 'e_ratio_predicted'):.2f}). "
        )
    else:
        text += (
            "This control has no erase term, so the mismatch along k is not driven to zero "
            f"(after/before = {_mean(gated, 'e_ratio'):.2f} on average). "
        )
    text += (
        f"An update changes the state by {_mean(gated, 'update_share'):.0%} of its norm on average, most in layer "
        f"{biggest['layer']} {biggest['sublayer']} ({biggest['update_share']:.0%})."
    )
    return text


def _mean(rows, key):
    values = [r[key] for r in rows if key in r and not math.isnan(r[key])]
    return sum(values) / len(values) if values else float("nan")


# ----------------------------------------------------------------------------------------------------------------
# Reports


def _fmt(value, spec=".3f"):
    if value is None:
        return "–"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return str(value)


def audit_markdown(rows) -> str:
    header = (
        "| layer | sublayer | mode | β mean ± std | β<0.1 | 0.9≤β≤1.1 | β>1 | mean abs(e_pre) | mean abs(e_post) | "
        "e_post/e_pre | predicted abs(1−β) | ‖v‖ | ‖ΔX‖/‖X‖ |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if r["mode"] == "additive":
            lines.append(
                f"| {r['layer']} | {r['sublayer']} | additive (no gate) | – | – | – | – | – | – | – | – | – | "
                f"{_fmt(r['update_share'])} |"
            )
            continue
        lines.append(
            f"| {r['layer']} | {r['sublayer']} | {r['mode']} | {r['beta_mean']:.3f} ± {r['beta_std']:.3f} | "
            f"{r['share_skip']:.1%} | {r['share_overwrite']:.1%} | {r['share_over_relaxed']:.1%} | "
            f"{_fmt(r['e_pre'])} | {_fmt(r['e_post'])} | {_fmt(r['e_ratio'])} | {_fmt(r['e_ratio_predicted'])} | "
            f"{_fmt(r['v_norm'])} | {_fmt(r['update_share'])} |"
        )
    return header + "\n".join(lines) + "\n"


def plot_audit(rows, output_dir, title="") -> list[str]:
    """β histograms per layer and a layer × sublayer heat map. Returns the PNG paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import patheffects

    outline = [patheffects.withStroke(linewidth=2, foreground="white")]

    gated = [r for r in rows if r["mode"] != "additive"]
    if not gated:
        return []
    paths = []
    layers = sorted({r["layer"] for r in gated})
    sublayers = ["attn", "mlp"]
    edges = torch.linspace(0.0, 2.0, BETA_BINS + 1).tolist()
    width = edges[1] - edges[0]

    cols = min(4, len(layers))
    nrows = math.ceil(len(layers) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.4 * nrows), squeeze=False, sharex=True)
    for ax in axes.flat[len(layers) :]:
        ax.set_visible(False)
    for ax, layer in zip(axes.flat, layers):
        for r in (r for r in gated if r["layer"] == layer):
            share = [count / max(r["tokens"], 1) for count in r["beta_hist"]]
            ax.bar(edges[:-1], share, width=width, align="edge", alpha=0.6, label=r["sublayer"])
        for x in (SKIP_BELOW, OVERWRITE_LOW, OVERWRITE_HIGH):
            ax.axvline(x, color="grey", lw=0.6, ls="--")
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlim(0, 2)
        ax.tick_params(labelsize=7)
    axes.flat[0].legend(fontsize=7)
    fig.supxlabel("β (0 = skip, 1 = overwrite, 2 = reflect)", fontsize=9)
    fig.supylabel("share of tokens", fontsize=9)
    fig.suptitle(f"β per layer {title}".strip(), fontsize=10)
    paths.append(save_figure(fig, os.path.join(output_dir, "audit_beta_hist.png")))

    panels = [
        ("beta_mean", "mean β", (0.0, 2.0), "coolwarm"),
        ("e_ratio", "e_post / e_pre", (0.0, None), "viridis"),
        ("update_share", "‖ΔX‖ / ‖X‖", (0.0, None), "magma"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 0.5 + 0.35 * len(layers) + 1.2))
    for ax, (key, label, (vmin, vmax), cmap) in zip(axes, panels):
        grid = torch.full((len(layers), len(sublayers)), float("nan"))
        for r in gated:
            grid[layers.index(r["layer"]), sublayers.index(r["sublayer"])] = r[key]
        image = ax.imshow(grid.numpy(), aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax)
        ax.set_xticks(range(len(sublayers)), sublayers)
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
        ax.set_ylabel("layer")
        ax.set_title(label, fontsize=10)
        for i in range(len(layers)):
            for j in range(len(sublayers)):
                if not math.isnan(value := grid[i, j].item()):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, path_effects=outline)
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle(f"gates by layer × sublayer {title}".strip(), fontsize=10)
    paths.append(save_figure(fig, os.path.join(output_dir, "audit_heatmap.png")))
    return paths


COMPARISON_COLUMNS = [
    ("name", "checkpoint"),
    ("residual", "residual"),
    ("value_channels", "d_v"),
    ("parameters", "params"),
    ("mean_nll", "NLL"),
    ("perplexity", "PPL"),
    ("tokens", "tokens"),
    ("tokens_per_second", "tok/s"),
    ("beta_mean", "β mean"),
    ("share_skip", "β<0.1"),
    ("share_overwrite", "β≈1"),
    ("share_over_relaxed", "β>1"),
    ("e_ratio", "e_post/e_pre"),
    ("update_share", "‖ΔX‖/‖X‖"),
]


def comparison_rows(results) -> list[dict]:
    """One flat row per checkpoint result (as eval.py builds them) for the side-by-side table."""
    rows = []
    for result in results:
        row = {"name": result["name"], **result.get("model", {})}
        row.update({k: result["perplexity"][k] for k in ("mean_nll", "perplexity", "tokens", "tokens_per_second")}
                   if result.get("perplexity") else {})  # fmt: skip
        audit = [r for r in result.get("audit") or [] if r["mode"] != "additive"]
        if audit:
            row.update({key: _mean(audit, key) for key in
                        ("beta_mean", "share_skip", "share_overwrite", "share_over_relaxed", "e_ratio")})  # fmt: skip
        if result.get("audit"):
            row["update_share"] = _mean(result["audit"], "update_share")
        for task, metrics in (result.get("tasks") or {}).items():
            if task.startswith("_"):
                continue
            for metric, value in metrics.items():
                row[f"{task}/{metric}"] = value
        if result.get("errors"):
            row["errors"] = "; ".join(result["errors"])
        rows.append(row)
    return rows


def comparison_markdown(rows) -> str:
    task_columns = sorted({key for row in rows for key in row if "/" in key})
    columns = [(key, label) for key, label in COMPARISON_COLUMNS if any(key in row for row in rows)]
    columns += [(key, key) for key in task_columns]
    if any(row.get("errors") for row in rows):
        columns.append(("errors", "errors"))
    specs = {"parameters": ",d", "tokens": ",d", "tokens_per_second": ",.0f", "perplexity": ".2f", "mean_nll": ".4f"}
    share_keys = {"share_skip", "share_overwrite", "share_over_relaxed", "update_share"}
    lines = [
        "| " + " | ".join(label for _, label in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        cells = []
        for key, _ in columns:
            value = row.get(key)
            if key == "errors":
                cells.append((value or "")[:80].replace("|", "/") + ("…" if value and len(value) > 80 else ""))
                continue
            if key in share_keys:
                spec = ".1%"
            else:
                spec = specs.get(key, "d" if isinstance(value, int) else ".3f")
            cells.append(_fmt(value, spec))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


__all__ = [
    "GateAudit",
    "PerplexityResult",
    "audit_gates",
    "audit_markdown",
    "audit_paragraph",
    "comparison_markdown",
    "comparison_rows",
    "find_delta_modules",
    "lm_eval_available",
    "perplexity",
    "plot_audit",
    "run_lm_eval",
    "task_manager",
    "token_windows",
    "tokenize_documents",
]
