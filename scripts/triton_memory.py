"""Peak training memory of DDL's Triton path on a GPU, measured on the CPU.

    python scripts/triton_memory.py                          # bf16, bench size: Llama, then each DDL variant both ways
    python scripts/triton_memory.py --size small --batch_size 2

What a step keeps, and so its peak, is decided by what it allocates and when it lets go, not by the numbers in its
tensors. Here every Triton kernel's launch is a stub that writes nothing, while the Python around the kernels (what
allocates their outputs, their scratch and what autograd keeps) runs as it does on a GPU; bench.py's memory timeline
(PyTorch's memory profiler, exact on the CPU) then gives the Triton path's peak. The numbers the stubbed step computes
are meaningless and only its bytes are reported. (Triton's interpreter, which the kernel tests run on, cannot run
under the profiler: the profiler's records of it outgrow this machine's memory at the tiny size.) DDL's PyTorch path,
what CUDA runs by default, runs as it is, with the same timeline. Peaks are of one training step after a first, so
that AdamW's state is there, as bench.py measures them.
"""

import argparse
import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_count import both_ways  # noqa: E402 (sets TRITON_INTERPRET: no kernel runs here either way)

import torch  # noqa: E402
from bench import SIZES, Runner  # noqa: E402


class _NoLaunch:
    """A Triton kernel's stand-in: `kernel[grid](...)` launches nothing."""

    def __init__(self, kernel):
        pass

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def peaks(variants, dtype, size):
    """{"llama": bytes, variant: {"PyTorch": bytes, "Triton": bytes}}: the peak of one training step."""

    def peak(variant, model):
        runner = Runner(variant, model, size, torch.device("cpu"), False)
        runner.train_step()
        return runner.peak_train_memory()

    return both_ways(variants, dtype, size, peak, _NoLaunch)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--size", default="bench", choices=sorted(SIZES))
    parser.add_argument("--batch_size", type=int, help="the size's batch by default")
    parser.add_argument("--variants", nargs="+", default=["ddl-dv1", "ddl-cc", "ddl-tc"])
    parser.add_argument("--json", action="store_true", help="print the peaks (bytes) as one JSON object")
    args = parser.parse_args(argv)
    size = SIZES[args.size] if args.batch_size is None else replace(SIZES[args.size], batch_size=args.batch_size)
    result = peaks(args.variants, getattr(torch, args.dtype), size)
    if args.json:
        print(json.dumps(result))
        return 0
    llama = result.pop("llama")
    print(f"peak training memory, {args.dtype}, size {args.size} ({size.batch_size} x {size.seq_len}); "
          f"Llama {llama / 2**20:.1f} MiB")
    for variant, ways in result.items():
        print(f"{variant:10s} " + "   ".join(f"{label} {n / 2**20:8.1f} MiB ({n / llama:.3f}x)" for label, n in
                                            ways.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
