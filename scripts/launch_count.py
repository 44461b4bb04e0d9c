"""How many kernels one training step (forward and backward), or one decoded token, would launch on a GPU, counted on
the CPU.

    python scripts/launch_count.py                       # bf16, tiny size: Llama, then each DDL variant both ways
    python scripts/launch_count.py --dtype float32
    python scripts/launch_count.py --decoding --dtype float32   # per token decoded inside `generate`, batch 1

A GPU step that waits on the CPU (docs/gpu.md) costs about one launch's overhead per kernel, so the count is what a
change to the GPU paths can be judged by without a GPU. Counted: every PyTorch operation that computes (views and
allocations excluded) and every Triton kernel launch. DDL runs two ways: its specifications in PyTorch (what CUDA runs
by default) and ddl_kernels' Triton kernels (the seam, the readouts, EC and the decoding steps), which run through
Triton's CPU interpreter, made to serve CPU tensors. The optimizer step is not counted (one fused step on a GPU).
A decoded token is counted inside `generate` (the launches of 6 new tokens less those of 2, over 4), with generate's
own per-token work, which is Llama's too.
"""

import argparse
import collections
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # (before triton is imported)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import SIZES, build  # noqa: E402


NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "unsqueeze_", "squeeze_", "expand",
             "detach", "alias", "as_strided", "slice", "select", "permute", "_reshape_alias", "split", "unbind",
             "split_with_sizes", "lift_fresh", "empty", "empty_like", "empty_strided", "resolve_conj", "resolve_neg",
             "promote_types", "result_type", "size", "stride", "is_nonzero", "new_empty", "new_empty_strided", "unfold",
             "narrow", "diagonal"}
launches = collections.Counter()


class CountOperations(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in NO_KERNEL:
            launches["torch"] += 1
        return func(*args, **(kwargs or {}))


class CountedKernel:
    """A Triton kernel whose launches are counted (and whose interpreted run is not: it is one launch)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            launches["triton"] += 1
            with _disable_current_modes():
                return self.kernel[grid](*args, **kwargs)

        return launch


def triton_table():
    """ddl.ops' table of installed kernels with ddl_kernels' Triton kernels for the CPU (through the interpreter)."""
    from ddl_kernels import serving
    from ddl_kernels.readout import triton as readout
    from ddl_kernels.residual import triton as residual

    serves = lambda *args, **kwargs: args[0].dtype != torch.float64  # noqa: E731
    runs = {"delta_residual": residual.run, "delta_residual_readout": residual.run,
            "delta_residual_readout_norm": residual.run,
            "token_readout": lambda x, taps: readout.token_window(x, taps, read=True),
            "token_readout_norm": readout.readout_and_norm,
            "token_conv": lambda x, taps: readout.token_window(x, taps, read=False),
            "window_step": readout.window_step, "window_step_norm": readout.window_step_norm,
            "conv_step": readout.conv_step, "folded_conv_read": readout.fold}
    return {op: {"cpu": serving(serves, run)} for op, run in runs.items()}


def count(model, ids):
    """(forward, forward + backward) launches of one training step of `model` on `ids`."""
    model(input_ids=ids, labels=ids).loss.backward()  # (the first step's one-time work is not counted)
    model.zero_grad(set_to_none=True)  # (as a training step starts: no accumulation into earlier gradients)
    launches.clear()
    with CountOperations():
        loss = model(input_ids=ids, labels=ids).loss
        forward = sum(launches.values())
        loss.backward()
    return forward, sum(launches.values())


@torch.no_grad()
def count_decoding(model, ids):
    """Launches per token decoded inside `generate` (batch 1, the first row of `ids` as the prompt): those of 6 new
    tokens less those of 2, over 4, after one warm-up call."""
    model.eval()
    kwargs = dict(do_sample=False, pad_token_id=0)
    model.generate(ids[:1], max_new_tokens=2, min_new_tokens=2, **kwargs)
    counted = []
    for new in (2, 6):
        launches.clear()
        with CountOperations():
            model.generate(ids[:1], max_new_tokens=new, min_new_tokens=new, **kwargs)
        counted.append(sum(launches.values()))
    return (counted[1] - counted[0]) // 4


def counts(variants, dtype, size, decoding=False):
    """{"llama": (forward, step), variant: {way: (forward, step)}} (`decoding`: a decoded token's launches instead)."""
    ids = torch.randint(3, size.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    measure = count_decoding if decoding else count
    return both_ways(variants, dtype, size, lambda variant, model: measure(model, ids), CountedKernel)


def both_ways(variants, dtype, size, measure, stand_in):
    """{"llama": measure("llama", Llama), variant: {"PyTorch": ..., "Triton": ...}}: each model built on the CPU and
    measured by `measure(variant, model)`, DDL's PyTorch path and its Triton path (ddl.ops' table of `triton_table()`),
    every Triton kernel of ddl_kernels replaced by `stand_in(kernel)` meanwhile; the table and the kernels restored."""
    from ddl import ops
    from ddl_kernels.readout import triton as readout
    from ddl_kernels.residual import triton as residual

    cpu = torch.device("cpu")
    ops.kernel("delta_residual", "auto", cpu)  # (fills the table)
    kept_table = ops._installed
    kept_kernels = [(module, name, kernel) for module in (readout, residual)
                    for name, kernel in list(vars(module).items()) if name.endswith("_kernel")]
    try:
        for module, name, kernel in kept_kernels:
            setattr(module, name, stand_in(kernel))
        result = {"llama": measure("llama", build("llama", size, cpu, dtype, "torch"))}
        for variant in variants:
            result[variant] = {}
            for label, table, implementation in (("PyTorch", {}, "torch"), ("Triton", triton_table(), "triton")):
                ops._installed = table
                result[variant][label] = measure(variant, build(variant, size, cpu, dtype, implementation))
        return result
    finally:
        ops._installed = kept_table
        for module, name, kernel in kept_kernels:
            setattr(module, name, kernel)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--variants", nargs="+", default=["ddl-dv1", "ddl-cc", "ddl-tc"])
    parser.add_argument("--decoding", action="store_true", help="a token decoded inside generate (batch 1)")
    parser.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    args = parser.parse_args(argv)
    result = counts(args.variants, getattr(torch, args.dtype), SIZES[args.size], args.decoding)
    if args.json:
        print(json.dumps(result))
        return 0
    shown = (lambda n: f"{n:5d}") if args.decoding else (lambda n: f"{n[0]:5d} / {n[1]:5d}")  # noqa: E731
    print(f"launches per {'decoded token' if args.decoding else 'training step (forward / forward + backward)'}, "
          f"{args.dtype}, size {args.size}")
    print(f"{'llama':10s} {shown(result.pop('llama'))}")
    for variant, ways in result.items():
        print(f"{variant:10s} " + "   ".join(f"{label} {shown(n)}" for label, n in ways.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
