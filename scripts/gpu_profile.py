"""Where a training step and a decoded token spend their time on a GPU: one markdown report for a short device lease.

    python scripts/gpu_profile.py --out gpu_profile.md                      # CUDA, bf16, the paper's small size
    python scripts/gpu_profile.py --device cpu --size tiny --out /tmp/p.md  # the dry run

For Llama and each DDL variant (with DDL's default paths, then Triton): the step's wall time (synchronised), the
GPU's busy time inside it (the kernels' summed time, from torch.profiler), the number of kernel launches, and the
operations that take the most GPU time. A step whose busy time is far below its wall time waits on the CPU (Python and
launches), not on the GPU. The same for one `generate` of a few tokens at batch 1, per token.
"""

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import SIZES, Runner, build, sync  # noqa: E402


def profiled(fn, device):
    """Runs fn once under the profiler: (wall ms, device-busy ms, kernel launches, the profiler's averages)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        sync(device)
        wall = (time.perf_counter() - start) * 1e3
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 if kernels else float("nan")
    return wall, busy, len(kernels), prof.key_averages()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--variants", nargs="+", default=["llama", "ddl-dv1", "ddl-cc", "ddl-tc"])
    parser.add_argument("--implementations", nargs="+", default=["auto", "triton"])
    parser.add_argument("--new_tokens", type=int, default=8)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if os.path.exists(args.out):
        parser.error(f"--out {args.out} exists (a previous report?): move it, or name a new file")
    device, dtype, size = torch.device(args.device), getattr(torch, args.dtype), SIZES[args.size]
    sort_key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    lines = [f"# gpu_profile.py: {args.size} size, {args.dtype}, {device}, torch {torch.__version__}", "",
             "| model | impl | step ms (timed) | step ms (profiled) | GPU busy ms | kernels | decode ms/token | "
             "decode GPU busy ms/token | decode kernels/token |", "|---|---|---|---|---|---|---|---|---|"]
    details = []
    for variant in args.variants:
        for impl in (["-"] if variant == "llama" else args.implementations):
            model = build(variant, size, device, dtype, "auto" if impl == "-" else impl)
            runner = Runner(variant, model, size, device, compile_model=False)
            step_ms = runner.batch.numel() / runner.time_train(5, warmup=3) * 1e3  # bench's timed steps
            wall, busy, launches, averages = profiled(runner.train_step, device)
            n = args.new_tokens
            runner.time_decode(1, n)  # (the process's first generate of this model is slower: not the one profiled)
            d_wall, d_busy, d_launches, d_averages = profiled(lambda: runner.time_decode(1, n), device)
            lines.append(f"| {variant} | {impl} | {step_ms:.1f} | {wall:.1f} | {busy:.1f} | {launches} | "
                         f"{d_wall / n:.2f} | {d_busy / n:.3f} | {d_launches / n:.0f} |")
            details += [f"\n## {variant}, {impl}: training step, top {args.top} by {sort_key}\n", "```",
                        averages.table(sort_by=sort_key, row_limit=args.top, max_name_column_width=60), "```",
                        f"\n## {variant}, {impl}: generate, {n} tokens at batch 1, top {args.top}\n", "```",
                        d_averages.table(sort_by=sort_key, row_limit=args.top, max_name_column_width=60), "```"]
            print(lines[-1], flush=True)
            with open(args.out, "w") as f:  # after each model, so that a run stopped at its time limit keeps its rows
                f.write("\n".join(lines + details) + "\n")
            del model, runner
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
