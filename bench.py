"""Speed and memory of DDL against transformers' Llama of the same dimensions, measured side by side.

    python bench.py                                  # tiny size, CPU, fp32: a few minutes on 2 cores
    python bench.py --size bench --json bench.json   # hidden 512, 8 layers, 8 heads (4 KV), seq 256, batch 8
    python bench.py --size small --device cuda --dtype bfloat16   # the paper's small model on a GPU
    python bench.py --variants llama ddl-dv1 --compile

Every figure is measured for all models in one process, interleaved (each repeat runs every model once, in an order
that balances, over the repeats, which position each model runs in and which model runs right before it), and reported
as a ratio to Llama: each repeat's figure over Llama's in the same repeat, the median and the spread (min-max) of
those paired ratios. Machine noise that drifts over seconds then hits both sides of a ratio alike.
- train tok/s: forward + backward + AdamW step on random tokens,
- prefill tok/s: a no-grad forward of the whole batch that fills the cache,
- decode tok/s: `generate` of new tokens after a short prompt, batch 1 and batch 8,
- peak train memory: the largest bytes of live tensors during one training step (parameters, gradients and
  AdamW state included): `max_memory_allocated` on CUDA, the PyTorch profiler's memory timeline on CPU.
"""

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ddl import DDLConfig, DDLForCausalLM
from ddl.configuration_ddl import DDL_IMPLEMENTATIONS
from ddl.cpu_kernels import cpu_kernel
from ddl_tools.training import PAPER_RECIPE, PRESETS


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
    return model.to(device=device, dtype=dtype)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


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
        g = torch.Generator().manual_seed(1)
        self.batch = torch.randint(3, size.vocab_size, (size.batch_size, size.seq_len), generator=g).to(device)
        self.results = {}

    def train_step(self):
        self.model.train()
        loss = self.step_fn(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def time_train(self, steps):
        self.train_step()  # untimed: the other models ran in between; time this model's steady state, as in training
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
    def time_decode(self, batch_size, new_tokens, prompt_len=16):
        self.model.eval()
        prompt = self.batch[:batch_size, :prompt_len]
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        sync(self.device)
        start = time.perf_counter()
        self.model.generate(prompt, **kwargs)
        sync(self.device)
        return batch_size * new_tokens / (time.perf_counter() - start)

    def peak_train_memory(self):
        """Largest bytes of live tensors during one training step, state from a previous step included."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.train_step()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler._memory_profiler import MemoryProfileTimeline

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
            self.train_step()
        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
        return max(sum(categories) for categories in sizes)

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


def summarise(runners):
    """Per model and figure: the median and spread of its values, and of its ratios to the reference (Llama, else the
    first model) paired by repeat: value i over the reference's value i, measured in the same round."""
    reference = next((r for r in runners if r.name == "llama"), runners[0])
    rows = []
    for runner in runners:
        row = {"model": runner.name, "params_M": sum(p.numel() for p in runner.model.parameters()) / 1e6}
        for key, values in runner.results.items():
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


def markdown(rows, header):
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
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--implementation", choices=list(DDL_IMPLEMENTATIONS), default="auto",
                        help="DDL's ddl_implementation (see ddl/kernels.py)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model for training and prefill")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train_steps", type=int, default=2, help="timed training steps per repeat")
    parser.add_argument("--new_tokens", type=int, default=32, help="generated tokens per decode measurement")
    parser.add_argument("--skip", nargs="*", default=[], choices=["train", "prefill", "decode", "memory"])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    device, dtype, size = torch.device(args.device), getattr(torch, args.dtype), SIZES[args.size]
    runners = [Runner(v, build(v, size, device, dtype, args.implementation), size, device, args.compile) for v in args.variants]
    for runner in runners:  # warm-up: allocations, optimizer state, compilation
        runner.train_step()
        runner.time_prefill(1)
    measurements = {
        "train_tok_s": ("train", lambda r: r.time_train(args.train_steps)),
        "prefill_tok_s": ("prefill", lambda r: r.time_prefill(args.train_steps)),
        "decode_b1_tok_s": ("decode", lambda r: r.time_decode(1, args.new_tokens)),
        "decode_b8_tok_s": ("decode", lambda r: r.time_decode(min(8, size.batch_size), args.new_tokens)),
    }
    # One measurement at a time (so that decoding never disturbs the allocator state of training), and within it
    # the models interleaved in a balanced order: every model sees the same machine conditions, positions and
    # predecessors.
    for key, (group, measure) in measurements.items():
        if group in args.skip:
            continue
        for repeat in range(args.repeats):
            for runner in balanced_order(runners, repeat):
                runner.record(key, measure(runner))
        print(f"{key}: {args.repeats} repeats done", flush=True)
    if "memory" not in args.skip:
        for runner in runners:
            runner.record("peak_train_mem_MB", runner.peak_train_memory() / 2**20)

    rows = summarise(runners)
    # whether DDL's fused path ran its C++ CPU kernel (built on first use; without a compiler, the PyTorch path)
    kernel = (device.type == "cpu" and dtype in (torch.float32, torch.float64) and args.implementation in ("auto", "triton")
              and not args.compile and any(v != "llama" for v in args.variants) and cpu_kernel() is not None)
    header = (
        f"### bench.py --size {args.size} ({size}), device {args.device}, {args.dtype}"
        f", ddl_implementation={args.implementation}{' (C++ CPU kernel)' if kernel else ''}{', compiled' if args.compile else ''}"
        f", {args.repeats} repeats, torch {torch.__version__}"
    )
    print(markdown(rows, header))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "size": size.__dict__, "torch": torch.__version__, "cpu_kernel": kernel,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
