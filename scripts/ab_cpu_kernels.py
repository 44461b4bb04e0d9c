"""Two builds of ddl_kernels' C++ CPU kernels, timed against each other in one process, call by call.

    git worktree add /tmp/old HEAD~1
    python scripts/ab_cpu_kernels.py /tmp/old                          # decoding at batch 1 and 8, bench size
    python scripts/ab_cpu_kernels.py /tmp/old --train --variants ddl-cc
    python scripts/ab_cpu_kernels.py .                                 # the same build twice: the method's noise

A change to the C++ kernels is judged against the old code in the same run (docs/performance.md). In separate
processes, each process here draws a speed of its own (training steps of the same code differ by 5-10% from one
process to the next), so two processes' ratio carries both draws. Here both builds are loaded into one process
(each is a plain Python extension of its own name) and the model's calls go to one or the other
(`ddl_kernels.build._ops`), alternated ABBA over pairs of `generate` calls or training steps: the ratio of a pair
carries only the moment's noise. The model and its Python are this checkout's; only the C++ differs, so the old
checkout's kernels must take the same arguments (`INTERFACE_VERSION`).
"""

import argparse
import importlib.machinery
import importlib.util
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import ddl_kernels.build as kernel_build  # noqa: E402
from bench import SIZES, VARIANTS, Runner, build  # noqa: E402

BUILT_PATH = "import sys; sys.path.insert(0, sys.argv[1]); from ddl_kernels.build import kernels; k = kernels(); " \
             "print('BUILT', k.__file__ if k else '')"


def old_kernels(checkout, new):
    """The other checkout's C++ kernels, built there (by its own build.py) and loaded into this process."""
    print(f"{checkout}: its C++ kernels, built once per checkout (1-2 min) or loaded from torch's cache", flush=True)
    done = subprocess.run([sys.executable, "-c", BUILT_PATH, checkout], capture_output=True, text=True, cwd=checkout)
    built = [line[len("BUILT "):] for line in done.stdout.splitlines() if line.startswith("BUILT ")]
    if done.returncode or not built or not built[0]:
        sys.exit(f"ab_cpu_kernels: {checkout}'s C++ kernels did not build: {done.stderr.strip()[-2000:]}")
    path = built[0]
    if os.path.samefile(path, new.__file__):  # the same build as this checkout's (an A/A run)
        return new
    name = os.path.splitext(os.path.basename(path))[0].split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
    loader.exec_module(module)
    return module


def mismatched(old, new):
    """The functions of the `new` build that `old` lacks or declares with other arguments or results (a pybind11
    function states them on its docstring's first line)."""
    def signature(function):
        return None if function is None else (function.__doc__ or "").split("\n")[0]

    return [name for name in dir(new) if not name.startswith("_") and callable(getattr(new, name)) and
            signature(getattr(old, name, None)) != signature(getattr(new, name))]


def timed(run, kernels):
    kernel_build._ops = kernels
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def compare(run, new, old, pairs):
    """new/old speed (old time / new time) of each pair, the two orders alternated (ABBA)."""
    for kernels in (old, new):  # (each build's first calls, not timed)
        timed(run, kernels)
    ratios = []
    for pair in range(pairs):
        if pair % 2:
            new_time, old_time = timed(run, new), timed(run, old)
        else:
            old_time, new_time = timed(run, old), timed(run, new)
        ratios.append(old_time / new_time)
    kernel_build._ops = new
    return ratios


def summary(ratios):
    ordered = sorted(ratios)
    trim = len(ordered) // 10
    return f"{statistics.median(ordered):.3f} [{ordered[trim]:.3f}-{ordered[-1 - trim]:.3f}] over {len(ordered)} pairs"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the other checkout (a folder holding ddl_kernels/), e.g. a git worktree")
    parser.add_argument("--variants", nargs="+", default=["ddl-dv1", "ddl-cc", "ddl-tc"],
                        choices=[name for name, overrides in VARIANTS.items() if overrides is not None])
    parser.add_argument("--size", choices=sorted(SIZES), default="bench")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decoding batch sizes (at most 8)")
    parser.add_argument("--new_tokens", type=int, default=32, help="tokens per timed `generate` call")
    parser.add_argument("--train", action="store_true", help="time training steps (bench.py's) instead of decoding")
    parser.add_argument("--pairs", type=int, default=16, help="pairs of timed calls per figure")
    args = parser.parse_args(argv)
    args.old = os.path.realpath(args.old)
    if not os.path.isfile(os.path.join(args.old, "ddl_kernels", "build.py")):
        parser.error(f"{args.old} holds no ddl_kernels/build.py: give a checkout of this repository (git worktree "
                     "add /tmp/old <commit>).")
    if args.pairs < 1 or args.new_tokens < 1 or not all(1 <= batch <= 8 for batch in args.batch):
        parser.error("--pairs and --new_tokens must be at least 1, --batch between 1 and 8.")
    return args


def main(argv=None):
    args = parse_args(argv)
    new = kernel_build.kernels()
    if new is None:
        sys.exit("ab_cpu_kernels: this checkout's C++ kernels are not built (DDL_CPU_KERNEL=0, or the build failed).")
    old = old_kernels(args.old, new)
    differ = mismatched(old, new)
    if differ:
        sys.exit(f"ab_cpu_kernels: the two builds' {', '.join(differ)} take different arguments; only kernels "
                 "called the same way can be swapped under this checkout's Python.")
    same = " (the same build: an A/A run, the method's noise)" if old is new else ""
    print(f"new: {new.__name__} ({ROOT}); old: {old.__name__} ({args.old}){same}")
    size, device = SIZES[args.size], torch.device("cpu")
    for variant in args.variants:
        runner = Runner(variant, build(variant, size, device, torch.float32), size, device, compile_model=False)
        if args.train:
            ratios = compare(runner.train_step, new, old, args.pairs)
            print(f"{variant} training step, new/old speed: {summary(ratios)}", flush=True)
            continue
        for batch in args.batch:
            ratios = compare(lambda: runner.time_decode(batch, args.new_tokens), new, old, args.pairs)
            print(f"{variant} decoding at batch {batch}, new/old speed: {summary(ratios)}", flush=True)


if __name__ == "__main__":
    main()
