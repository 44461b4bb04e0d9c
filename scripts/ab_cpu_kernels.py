"""Two builds of ddl_kernels' C++ CPU kernels, timed against each other in one process, call by call.

    git worktree add /tmp/old HEAD~1
    python scripts/ab_cpu_kernels.py /tmp/old                          # decoding at batch 1 and 8, bench size
    python scripts/ab_cpu_kernels.py /tmp/old --train --variants ddl-cc
    python scripts/ab_cpu_kernels.py .                                 # the same build twice: the method's noise

A change to the C++ kernels is judged against the old code in the same run (docs/performance.md). In separate
processes, each process here draws a speed of its own (training steps of the same code differ by 5-10% from one
process to the next), so two processes' ratio carries both draws. Here both builds are loaded into one process
(each a library of its own path, with its checkout's ctypes functions, ddl_kernels/native.py; or, for a checkout from
before the libraries were built at install, its torch extension) and the model's calls go to one or the other
(`ddl_kernels.build._ops`), alternated ABBA over pairs of `generate` calls or training steps: the ratio of a pair
carries only the moment's noise. The model and its Python are this checkout's; only the kernels differ, so the old
checkout's must take the same arguments (`INTERFACE_VERSION`). An old checkout whose libraries are not built is built
first (`python -m ddl_kernels.build` there).
"""

import argparse
import importlib.machinery
import importlib.util
import inspect
import os
import re
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


def _built(checkout):
    """The path of the kernels `checkout` loads (its libraries, or its torch extension, built by then), or ''."""
    done = subprocess.run([sys.executable, "-c", BUILT_PATH, checkout], capture_output=True, text=True, cwd=checkout)
    built = [line[len("BUILT "):] for line in done.stdout.splitlines() if line.startswith("BUILT ")]
    if done.returncode or not built:
        sys.exit(f"ab_cpu_kernels: {checkout}'s C++ kernels did not load: {done.stderr.strip()[-2000:]}")
    return built[0]


def old_kernels(checkout, new):
    """The other checkout's C++ kernels, loaded into this process: its libraries (built there now if they are not)
    with its own ctypes functions, or its torch extension (built by its build.py on first use, 1-2 min)."""
    native = os.path.join(checkout, "ddl_kernels", "native.py")
    print(f"{checkout}: its C++ kernels", flush=True)
    path = _built(checkout)
    if not path and os.path.isfile(native):
        subprocess.run([sys.executable, "-m", "ddl_kernels.build"], cwd=checkout, check=True,
                       env={**os.environ, "PYTHONPATH": checkout})
        path = _built(checkout)
    if not path:
        sys.exit(f"ab_cpu_kernels: {checkout}'s C++ kernels did not build.")
    if os.path.samefile(path, new.__file__):  # the same build as this checkout's (an A/A run)
        return new
    if os.path.isfile(native):
        spec = importlib.util.spec_from_file_location(f"old_ddl_kernels_native_{abs(hash(checkout))}", native)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.Kernels(path)
    name = os.path.splitext(os.path.basename(path))[0].split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
    loader.exec_module(module)
    return module


def arguments(function):
    """How many arguments a kernel takes: from its signature, or for a torch extension's (pybind11) function, which
    has none, from its docstring's first line, `name(arg0: T, arg1: T) -> R`."""
    try:
        return len(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return len(re.findall(r"\barg\d+:", (function.__doc__ or "").split("\n")[0]))


def mismatched(old, new):
    """The functions of the `new` kernels that `old` lacks or that take another number of arguments there."""
    return [name for name in dir(new) if not name.startswith("_") and callable(getattr(new, name)) and
            (getattr(old, name, None) is None or arguments(getattr(old, name)) != arguments(getattr(new, name)))]


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
        sys.exit("ab_cpu_kernels: this checkout's C++ kernels are not loaded (DDL_CPU_KERNEL=0, or not built: "
                 "python -m ddl_kernels.build).")
    old = old_kernels(args.old, new)
    differ = mismatched(old, new)
    if differ:
        sys.exit(f"ab_cpu_kernels: the two builds' {', '.join(differ)} take different arguments; only kernels "
                 "called the same way can be swapped under this checkout's Python.")
    same = " (the same build: an A/A run, the method's noise)" if old is new else ""
    print(f"new: {new.__file__}; old: {old.__file__}{same}")
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
