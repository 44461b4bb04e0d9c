"""Reusable logic of `study.py`: the grid of (variant, seed) runs, resume bookkeeping, statistics and the report.

- Variants are named `<residual>-dv<d_v>[-cc|-tc][-ec]`, e.g. `additive-dv1` (= Llama), `delta-dv4-cc-ec` (the
  paper's default DDL); `variant_flags` turns a name into train.py's `--ddl_*` flags.
- A run lives in `<study_dir>/runs/<variant>-s<seed>/` and is finished only when its `result.json` exists; that file
  is written last and atomically, so a folder without it is a crashed run, which `run_study` deletes and redoes.
- Statistics: mean, sample std and a t-based 95% confidence interval (scipy's t quantile if installed, else a t
  table for df <= 30); the difference to the baseline is paired by seed when the seeds match (else Welch).
- `write_report`: Markdown table, loss-against-tokens and loss-against-wall-clock plots, gate audits, conclusion.

Library code: it logs and never prints. The launching of one run (train.py + evaluation) lives in `study.py`
and is passed to `run_study` as a function, so tests can replace it.
"""

import json
import math
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from transformers.utils import logging

from .outputs import save_figure, write_json


logger = logging.get_logger(__name__)

RESULT_FILE = "result.json"
STUDY_FILE = "study.json"
BASELINE = "additive-dv1"
# The issue's default grid: the Llama baseline, DDL d_v=1 and its write-only control, then the paper's default DDL
# (d_v=4, CC, EC) with both matched expanded-state controls (write-only, and additive with the same state).
DEFAULT_VARIANTS = (
    "additive-dv1",
    "delta-dv1",
    "write_only-dv1",
    "delta-dv4-cc-ec",
    "write_only-dv4-cc-ec",
    "additive-dv4-cc-ec",
)
DEFAULT_SEEDS = (0, 1, 2)
_VARIANT_RE = re.compile(r"^(delta|write_only|additive)-dv(\d+)(?:-(cc|tc))?(-ec)?$")


# ----------------------------------------------------------------------------------------------------------- grid


def variant_flags(name: str) -> dict:
    """train.py's `--ddl_*` flags of a variant name such as `delta-dv4-cc-ec` (residual, d_v, compressor, EC)."""
    match = _VARIANT_RE.match(name)
    if not match:
        raise ValueError(
            f"Unknown variant {name!r}: expected '<delta|write_only|additive>-dv<N>[-cc|-tc][-ec]', e.g. "
            f"{', '.join(DEFAULT_VARIANTS[:4])}."
        )
    residual, dv, compressor, ec = match.group(1), int(match.group(2)), match.group(3), bool(match.group(4))
    if dv < 1:
        raise ValueError(f"Variant {name!r}: d_v must be >= 1, got {dv}.")
    if dv == 1 and (compressor or ec):
        raise ValueError(f"Variant {name!r}: d_v=1 has no compressor or EC; write '{residual}-dv1'.")
    if dv > 1 and not compressor:
        raise ValueError(f"Variant {name!r}: d_v={dv} needs a compressor, e.g. '{residual}-dv{dv}-cc-ec'.")
    flags = {"ddl_residual": residual, "ddl_value_channels": dv}
    if dv > 1:
        flags.update(ddl_compressor=compressor, ddl_embed_conv=ec)
    return flags


@dataclass(frozen=True)
class RunSpec:
    variant: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant}-s{self.seed}"


def build_grid(variants: Sequence[str], seeds: Sequence[int]) -> list[RunSpec]:
    """All (variant, seed) runs, seed-major: every variant of seed 0 first, so a study cut short after k seeds holds
    k complete, comparable seeds."""
    if not variants:
        raise ValueError("The study needs at least one variant (--variants).")
    if not seeds:
        raise ValueError("The study needs at least one seed (--seeds).")
    for name, values in (("variants", variants), ("seeds", seeds)):
        duplicates = sorted({str(v) for v in values if list(values).count(v) > 1})
        if duplicates:
            raise ValueError(f"--{name} lists {duplicates} more than once.")
    for variant in variants:
        variant_flags(variant)
    return [RunSpec(variant, seed) for seed in seeds for variant in variants]


def steps_for_tokens(max_tokens: int, tokens_per_step: int) -> int:
    """Optimizer steps that reach `max_tokens` (rounded up): every variant sees the same number of tokens."""
    if max_tokens <= 0 or tokens_per_step <= 0:
        raise ValueError(f"max_tokens ({max_tokens}) and tokens per step ({tokens_per_step}) must be positive.")
    return math.ceil(max_tokens / tokens_per_step)


# ----------------------------------------------------------------------------------------------------- resume


def run_dir(study_dir: str, spec: RunSpec) -> str:
    return os.path.join(study_dir, "runs", spec.name)


def run_status(path: str) -> str:
    """'finished' (result.json present), 'crashed' (folder without it) or 'missing'."""
    if os.path.isfile(os.path.join(path, RESULT_FILE)):
        return "finished"
    return "crashed" if os.path.isdir(path) else "missing"


def check_study_config(study_dir: str, config: dict) -> None:
    """Record the study's configuration in `study.json`, or check that an existing study has the same one (runs
    made with other settings are not comparable and must not be mixed)."""
    path = os.path.join(study_dir, STUDY_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            previous = json.load(f)
        if previous != json.loads(json.dumps(config)):
            changed = sorted(k for k in set(previous) | set(config) if previous.get(k) != config.get(k))
            raise ValueError(
                f"{study_dir!r} holds a study with another configuration (differs in: {', '.join(changed)}). "
                f"Rerun with the same settings to resume it, or choose another --study_dir."
            )
        return
    if os.path.isdir(study_dir) and os.listdir(study_dir):
        raise ValueError(f"{study_dir!r} exists and is not a study folder (no {STUDY_FILE}); choose another "
                         "--study_dir.")
    os.makedirs(study_dir, exist_ok=True)
    write_json(path, config)


def run_study(study_dir: str, grid: Sequence[RunSpec], launch: Callable[[RunSpec, str], dict],
              on_event: Callable[[str, RunSpec, dict | None], None] | None = None) -> dict:
    """Run every (variant, seed) of `grid` that is not finished yet.

    `launch(spec, run_dir)` trains and evaluates one run in the (fresh, existing) `run_dir` and returns its result;
    `run_study` writes that result as `result.json`, last. A finished run is skipped; a crashed one (a folder
    without `result.json`) is deleted and redone. A run that raises is logged and left unfinished (redone next
    time); the others go on. `on_event(kind, spec, result)` is called with kind in skip | start | done | failed.
    Returns {"skipped": [...], "done": [...], "failed": {name: error}}.
    """
    summary = {"skipped": [], "done": [], "failed": {}}
    notify = on_event or (lambda kind, spec, result: None)
    for spec in grid:
        path = run_dir(study_dir, spec)
        status = run_status(path)
        if status == "finished":
            summary["skipped"].append(spec.name)
            notify("skip", spec, None)
            continue
        if status == "crashed":
            logger.warning("%s has no %s (an interrupted run): deleting it and running it again", path, RESULT_FILE)
            shutil.rmtree(path)
        os.makedirs(path)
        notify("start", spec, None)
        try:
            result = launch(spec, path)
        except Exception as err:  # one failed run must not cost the rest of a 90-minute study
            logger.error("%s failed: %s: %s", spec.name, type(err).__name__, err)
            summary["failed"][spec.name] = f"{type(err).__name__}: {err}"
            notify("failed", spec, {"error": str(err)})
            continue
        result = {"variant": spec.variant, "seed": spec.seed, **result}
        write_json(os.path.join(path, RESULT_FILE), result)
        summary["done"].append(spec.name)
        notify("done", spec, result)
    return summary


def load_results(study_dir: str) -> list[dict]:
    """The results of all finished runs of a study."""
    root = os.path.join(study_dir, "runs")
    results = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name, RESULT_FILE)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                results.append(json.load(f))
    return results


# ------------------------------------------------------------------------------------------------- statistics


def t_quantile(df: float) -> float:
    """Two-sided 95% Student-t quantile t_{0.975, df} (scipy's)."""
    from scipy import stats

    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}.")
    return float(stats.t.ppf(0.975, df))


@dataclass
class Estimate:
    """Mean with a 95% confidence interval; `std` is the sample std (n - 1) of the values (for a Welch difference:
    its standard error), NaN (no interval) when n < 2."""

    mean: float
    std: float
    n: int
    ci_low: float
    ci_high: float
    paired: bool | None = None  # differences only: paired by seed (True) or Welch (False)

    @property
    def half_width(self) -> float:
        return (self.ci_high - self.ci_low) / 2

    def excludes_zero(self) -> bool:
        return self.n >= 2 and not math.isnan(self.ci_low) and (self.ci_low > 0 or self.ci_high < 0)


def summarize(values: Sequence[float]) -> Estimate:
    """Mean, sample std and the t-based 95% CI of the mean: mean ± t_{0.975, n-1} std / sqrt(n)."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        raise ValueError("summarize needs at least one value.")
    mean = sum(values) / n
    if n < 2:
        return Estimate(mean, math.nan, n, math.nan, math.nan)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(n - 1) * std / math.sqrt(n)
    return Estimate(mean, std, n, mean - half, mean + half)


def difference(values: dict[int, float], baseline: dict[int, float]) -> Estimate:
    """`values - baseline` (dicts seed -> metric) with a 95% CI: paired by seed when both have the same seeds
    (mean of the per-seed differences), else Welch's interval for two independent samples."""
    if set(values) == set(baseline) and len(values) >= 1:
        est = summarize([values[s] - baseline[s] for s in sorted(values)])
        est.paired = True
        return est
    a, b = summarize(list(values.values())), summarize(list(baseline.values()))
    mean = a.mean - b.mean
    if a.n < 2 or b.n < 2:
        return Estimate(mean, math.nan, min(a.n, b.n), math.nan, math.nan, paired=False)
    va, vb = a.std**2 / a.n, b.std**2 / b.n
    se = math.sqrt(va + vb)
    if se == 0:
        return Estimate(mean, 0.0, min(a.n, b.n), mean, mean, paired=False)
    df = (va + vb) ** 2 / (va**2 / (a.n - 1) + vb**2 / (b.n - 1))  # Welch-Satterthwaite
    half = t_quantile(df) * se
    return Estimate(mean, se, min(a.n, b.n), mean - half, mean + half, paired=False)


# ----------------------------------------------------------------------------------------------------- report


def _by_variant(results: list[dict]) -> dict[str, list[dict]]:
    grouped = {}
    for r in sorted(results, key=lambda r: r["seed"]):
        grouped.setdefault(r["variant"], []).append(r)
    return grouped


def _ordered_variants(grouped: dict, order: Sequence[str] | None) -> list[str]:
    order = [v for v in (order or []) if v in grouped]
    return order + sorted(v for v in grouped if v not in order)


def summary_rows(results: list[dict], baseline: str = BASELINE, order: Sequence[str] | None = None) -> list[dict]:
    """One row per variant: loss / perplexity estimates, difference to the baseline, cost."""
    grouped = _by_variant(results)
    base = {r["seed"]: r["val_loss"] for r in grouped.get(baseline, [])}
    rows = []
    for variant in _ordered_variants(grouped, order):
        runs = grouped[variant]
        losses = {r["seed"]: r["val_loss"] for r in runs}
        row = {
            "variant": variant,
            "seeds": sorted(losses),
            "val_loss": summarize(list(losses.values())),
            "val_ppl": summarize([math.exp(v) for v in losses.values()]),
            "diff": difference(losses, base) if base and variant != baseline else None,
            "parameters": runs[0].get("parameters"),
            "tokens": runs[0].get("tokens"),
            "tokens_per_s": summarize([r["tokens_per_s"] for r in runs if r.get("tokens_per_s")])
            if any(r.get("tokens_per_s") for r in runs) else None,
            "peak_memory_mib": max((r.get("peak_memory_mib") or 0 for r in runs), default=0) or None,
            "memory_kind": runs[0].get("memory_kind", ""),
        }
        rows.append(row)
    return rows


def contrasts(results: list[dict]) -> list[tuple[str, str, Estimate]]:
    """Matched controls of each delta variant: the write-only and additive variants with the same state (d_v,
    compressor, EC), as (delta variant, control, difference delta - control)."""
    grouped = _by_variant(results)
    out = []
    for variant in grouped:
        if not variant.startswith("delta-"):
            continue
        suffix = variant[len("delta-"):]
        for control in (f"write_only-{suffix}", f"additive-{suffix}"):
            if control in grouped:
                a = {r["seed"]: r["val_loss"] for r in grouped[variant]}
                b = {r["seed"]: r["val_loss"] for r in grouped[control]}
                out.append((variant, control, difference(a, b)))
    return out


def _pm(est: Estimate | None, spec=".4f") -> str:
    if est is None:
        return "–"
    if est.n < 2:
        return f"{est.mean:{spec}} (n=1)"
    return f"{est.mean:{spec}} ± {est.std:{spec}}"


def _ci(est: Estimate | None, spec=".4f") -> str:
    if est is None or est.n < 2 or math.isnan(est.ci_low):
        return "–"
    return f"[{est.ci_low:{spec}}, {est.ci_high:{spec}}]"


def _signed_ci(est: Estimate | None) -> str:
    if est is None:
        return "–"
    text = f"{est.mean:+.4f}"
    if est.n >= 2 and not math.isnan(est.ci_low):
        text += f" [{est.ci_low:+.4f}, {est.ci_high:+.4f}]" + ("" if est.paired else " (unpaired)")
    return text


def conclusion(rows: list[dict], pairs: list[tuple[str, str, Estimate]], baseline: str = BASELINE) -> str:
    """Plain-language statements that say only what the 95% intervals support."""
    lines = []
    n_seeds = max((len(r["seeds"]) for r in rows), default=0)
    if n_seeds < 2:
        return ("Each variant has a single seed, so there are no confidence intervals and no difference can be called "
                "real: the numbers above are one draw each. Run more seeds (--seeds 0 1 2) before concluding.")

    def sentence(name, other, est):
        if est.n < 2 or math.isnan(est.ci_low):
            return f"- {name} vs {other}: {est.mean:+.4f} nats from one seed; no interval, no conclusion."
        if est.excludes_zero():
            word = "lower" if est.mean < 0 else "higher"
            return (f"- {name} reaches a **{word}** validation loss than {other}: {est.mean:+.4f} nats (95% CI "
                    f"{est.ci_low:+.4f} to {est.ci_high:+.4f}, {est.n} seeds).")
        return (f"- {name} vs {other}: {est.mean:+.4f} nats, but the 95% CI ({est.ci_low:+.4f} to "
                f"{est.ci_high:+.4f}, {est.n} seeds) includes zero: no difference these runs can resolve.")

    for row in rows:
        if row["diff"] is not None:
            lines.append(sentence(row["variant"], baseline, row["diff"]))
    if pairs:
        lines.append("")
        lines.append("Matched controls (same state size, compressor and EC; only the residual rule differs):")
        lines.extend(sentence(a, b, est) for a, b, est in pairs)
    lines += ["", "These statements hold for this model size, data and token budget only; intervals over "
              f"{n_seeds} seeds are wide, and a difference that is not resolved here may still exist at scale."]
    return "\n".join(lines)


def plot_curves(results: list[dict], out_dir: str, order: Sequence[str] | None = None,
                baseline: str = BASELINE) -> list[str]:
    """Training loss against tokens and against wall-clock seconds (mean over seeds, one line per variant, the
    seeds' range shaded), smoothed with a running mean of 5 logs. Returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = _by_variant(results)
    paths = []
    for x_key, x_label, file in (("tokens", "training tokens", "loss_vs_tokens.png"),
                                 ("wall_s", "wall-clock seconds of training", "loss_vs_wallclock.png")):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for variant in _ordered_variants(grouped, order):
            curves = [_curve(r, x_key) for r in grouped[variant]]
            curves = [c for c in curves if c[0]]
            if not curves:
                continue
            n = min(len(c[0]) for c in curves)
            xs = [sum(c[0][i] for c in curves) / len(curves) for i in range(n)]
            ys = [[c[1][i] for c in curves] for i in range(n)]
            mean = _smooth([sum(y) / len(y) for y in ys])
            style = dict(lw=2.0, color="black") if variant == baseline else dict(lw=1.3)
            (line,) = ax.plot(xs, mean, label=f"{variant} ({len(curves)} seed{'s' * (len(curves) > 1)})", **style)
            if len(curves) > 1:
                ax.fill_between(xs, _smooth([min(y) for y in ys]), _smooth([max(y) for y in ys]),
                                color=line.get_color(), alpha=0.12)
        ax.set_xlabel(x_label)
        ax.set_ylabel("training loss (nats/token)")
        ax.set_title(f"Training loss against {x_label}" + (" (compute-matched view)" if x_key == "wall_s" else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, os.path.join(out_dir, file)))
    return paths


def _curve(result: dict, x_key: str) -> tuple[list, list]:
    points = [p for p in result.get("history", []) if p.get(x_key) is not None and p.get("train_loss") is not None]
    return [p[x_key] for p in points], [p["train_loss"] for p in points]


def _smooth(values: list[float], window: int = 5) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def report_markdown(results: list[dict], settings: dict, plots: list[str], audits: dict[str, str],
                    failed: dict | None = None, baseline: str = BASELINE, order: Sequence[str] | None = None) -> str:
    """The study report: setup, results table, matched controls, plots, gate audits, conclusion."""
    rows = summary_rows(results, baseline, order)
    pairs = contrasts(results)
    memory_kind = next((r["memory_kind"] for r in rows if r["memory_kind"]), "peak memory")
    lines = [
        "# Study: does the delta rule help?",
        "",
        "Generated by `study.py` (do not edit by hand; rerun `study.py --report_only` to refresh).",
        "",
        "## Setup",
        "",
        *[f"- {key}: `{value}`" for key, value in settings.items()],
        "- Equal dimensions (one preset), equal tokens (same steps x batch x block) and equal data order: runs with "
        "the same seed draw the same batches in the same order (Trainer's sampler is seeded by `--seed`).",
        "- Validation loss: mean next-token NLL over the same fixed validation blocks for every run (eval.py's "
        "perplexity code path, blocks of the training length, full blocks only).",
        "",
        "## Final validation loss",
        "",
        f"Mean ± sample std over seeds, the t-based 95% confidence interval of the mean, and the difference to "
        f"`{baseline}` (paired by seed; negative = better) with its 95% CI.",
        "",
        "| variant | seeds | val loss mean ± std | 95% CI | perplexity mean ± std | Δ loss vs baseline [95% CI] | "
        f"parameters | tokens | tokens/s | {memory_kind} (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tps = "–" if r["tokens_per_s"] is None else f"{r['tokens_per_s'].mean:,.0f}"
        diff = "(baseline)" if r["variant"] == baseline else _signed_ci(r["diff"])
        lines.append(
            f"| `{r['variant']}` | {','.join(map(str, r['seeds']))} | {_pm(r['val_loss'])} | {_ci(r['val_loss'])} | "
            f"{_pm(r['val_ppl'], '.2f')} | {diff} | {_fmt_int(r['parameters'])} | {_fmt_int(r['tokens'])} | {tps} | "
            f"{_fmt_int(r['peak_memory_mib'])} |"
        )
    if pairs:
        lines += ["", "## Matched controls", "", "Each delta variant against the controls with the same state (d_v, "
                  "compressor, EC); only the residual rule differs.", "",
                  "| delta variant | control | Δ loss (delta − control) [95% CI] |", "|---|---|---|"]
        lines += [f"| `{a}` | `{b}` | {_signed_ci(est)} |" for a, b, est in pairs]
    if failed:
        lines += ["", "## Unfinished runs", "", *[f"- `{name}`: {err}" for name, err in failed.items()]]
    if plots:
        lines += ["", "## Learning curves", "",
                  "Training loss (running mean of 5 logs; shaded: range over seeds) against tokens, and against "
                  "wall-clock seconds of training on this machine: the compute-matched view, in which a slower "
                  "variant has to win per second, not only per token.", ""]
        lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
    if audits:
        lines += ["", "## Gate audits (first seed of each DDL variant)", ""]
        for variant, text in audits.items():
            lines += [f"### `{variant}`", "", text, ""]
    lines += ["", "## Conclusion", "", conclusion(rows, pairs, baseline), ""]
    return "\n".join(lines)


def _fmt_int(value) -> str:
    return "–" if value is None else f"{int(value):,}"


def write_report(results: list[dict], report_dir: str, settings: dict, failed: dict | None = None,
                 baseline: str = BASELINE, order: Sequence[str] | None = None) -> str:
    """Write `report.md`, `summary.json`, the two learning-curve PNGs and the gate audits (Markdown + PNGs, from
    each result's `audit`) into `report_dir`. Returns the path of report.md."""
    from .evaluation import audit_markdown, audit_paragraph, plot_audit

    if not results:
        raise ValueError("No finished runs to report on.")
    os.makedirs(report_dir, exist_ok=True)
    plots = plot_curves(results, report_dir, order, baseline)
    audits = {}
    for r in sorted(results, key=lambda r: r["seed"]):
        rows = r.get("audit")
        if not rows or r["variant"] in audits or all(row["mode"] == "additive" for row in rows):
            continue
        folder = os.path.join(report_dir, "audit", r["variant"])
        os.makedirs(folder, exist_ok=True)
        pngs = plot_audit(rows, folder, f"{r['variant']} seed {r['seed']}")
        images = "\n".join(f"![{os.path.basename(p)}]({os.path.relpath(p, report_dir)})" for p in pngs)
        audits[r["variant"]] = (f"Seed {r['seed']}. {audit_paragraph(rows)}\n\n<details><summary>per-layer table"
                                f"</summary>\n\n{audit_markdown(rows)}\n</details>\n\n{images}")
    text = report_markdown(results, settings, plots, audits, failed, baseline, order)
    path = os.path.join(report_dir, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    summary = [{**{k: v for k, v in row.items() if not isinstance(v, Estimate)},
                **{k: asdict(v) for k, v in row.items() if isinstance(v, Estimate)}}
               for row in summary_rows(results, baseline, order)]
    write_json(os.path.join(report_dir, "summary.json"), summary)
    return path


__all__ = [
    "BASELINE",
    "DEFAULT_SEEDS",
    "DEFAULT_VARIANTS",
    "Estimate",
    "RunSpec",
    "build_grid",
    "check_study_config",
    "conclusion",
    "contrasts",
    "difference",
    "load_results",
    "plot_curves",
    "report_markdown",
    "run_dir",
    "run_status",
    "run_study",
    "steps_for_tokens",
    "summarize",
    "summary_rows",
    "t_quantile",
    "variant_flags",
    "write_report",
]
