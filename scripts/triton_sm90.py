"""Compiles ddl_kernels' Triton kernels for an H100/H200 (sm_90) on a machine without a GPU, and reports what each
kernel asks of the GPU: registers per thread and local memory (registers spilled), from Triton's own ptxas and
cuobjdump (they come with the triton wheel).

    python scripts/triton_sm90.py               # the paper's small size (d = 768, d_v = 4); exit 1 if one fails
    python scripts/triton_sm90.py --d 4096      # a wide model

The Triton interpreter the tests run on CPU accepts programs the compiler rejects, and says nothing of spills; this
is the compiler's answer, without the device time a GPU check costs. Each kernel is compiled with the launch options
its Python side uses (`num_warps` for the residual seam's), for the dtypes a bf16 model and an fp32 (autocast) one
give it.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # (the interpreter's kernels cannot be compiled)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def variants(d, dv):
    """(kernel, pointer dtype, fp32 pointers, constexprs, launch options) for each compiled variant."""
    import triton.language as tl

    from ddl_kernels.readout import triton as readout
    from ddl_kernels.residual import triton as residual

    blocks, scalar = residual._blocks(d, dv), residual._blocks(d, 1, backward=True)
    warps, scalar_warps = {"num_warps": blocks.pop("num_warps")}, {"num_warps": scalar.pop("num_warps")}
    back_warps = {"num_warps": residual._blocks(d, dv, backward=True)["num_warps"]}
    window = readout._tiles(d, dv)[1]
    norm, row = readout._norm_blocks(d), readout.row_tile(d, dv, more=2)
    row_warps = {"num_warps": row.pop("num_warps")}
    norm_warps = {"num_warps": norm.pop("num_warps")}
    fp32_out = {"gz_ptr", "gy_ptr", "write_ptr", "part_ptr", "v_ptr"}
    return [
        # (KEEP_V: the value kept for a backward that reads u out of X again)
        *[(residual._seam_fwd_kernel, "bf16", {"v_ptr"}, dict(ERASE=True, U_IS_C=False, SIGMOID=True, READ=False,
                                                              NORM=False, KEEP_V=keep, **blocks), warps)
          for keep in (False, True)],
        *[(residual._seam_fwd_kernel, dtype, set(), dict(ERASE=True, U_IS_C=False, SIGMOID=True, READ=True, NORM=norm,
                                                         KEEP_V=False, **blocks), warps)
          for dtype in ("fp32", "bf16") for norm in (False, True)],
        (residual._seam_fwd_kernel, "bf16", set(), dict(ERASE=False, U_IS_C=True, SIGMOID=False, READ=True, NORM=False,
                                                        KEEP_V=False, **blocks), warps),
        # u its own (0), read out of X again where the seam makes no readout (3: CC's value input, the authors'), c (1)
        *[(residual._seam_bwd_kernel, "bf16", fp32_out,
           dict(ERASE=True, U_KIND=kind, SIGMOID=True, READ=read, WEIGHT_GRADS=weight_grads, **blocks), back_warps)
          for kind, read, weight_grads in ((0, False, True), (0, True, True), (3, False, True), (3, False, False),
                                           (1, False, True))],
        # after the next RMSNorm's backward (readout._norm_gradients), the readout's gradient comes in fp32
        (residual._seam_bwd_kernel, "bf16", fp32_out | {"grad_read_ptr"},
         dict(ERASE=True, U_KIND=0, SIGMOID=True, READ=True, WEIGHT_GRADS=True, **blocks), back_warps),
        # u is the state only where d_v = 1: its own tile, no readout
        (residual._seam_bwd_kernel, "bf16", fp32_out,
         dict(ERASE=True, U_KIND=2, SIGMOID=True, READ=False, WEIGHT_GRADS=True, **scalar), scalar_warps),
        (residual._seam_bwd_kernel, "fp32", fp32_out,
         dict(ERASE=False, U_KIND=2, SIGMOID=False, READ=False, WEIGHT_GRADS=False, **scalar), scalar_warps),
        # the norm's backward from y itself, then from the state y was read out of (the seam's: CC's one tap), a
        # token's whole state a program as the forward's readout; and an fp32 gain with a bf16 readout (the normed
        # output, and its gradient, in fp32)
        *[(readout._norm_bwd_kernel, "bf16", {"out_ptr", "part_ptr"} | gain_fp32,
           dict(GAIN_GRAD=gain, FROM_STATE=False, Y=tl.bfloat16, BLOCK_V=2, **norm), norm_warps)
          for gain, gain_fp32 in ((True, set()), (False, set()), (True, {"gain_ptr", "grad_normed_ptr"}))],
        *[(readout._norm_bwd_kernel, "bf16", {"out_ptr", "part_ptr"} | gain_fp32,
           dict(GAIN_GRAD=True, FROM_STATE=True, Y=tl.bfloat16, **row), row_warps)
          for gain_fp32 in (set(), {"gain_ptr", "grad_normed_ptr"})],
        (readout._sum_parts_kernel, "bf16", {"part_ptr"}, dict(BLOCK=1024), {}),
        (readout._fold_kernel, "bf16", set(), dict(K=4, PAD=1, BLOCK_D=readout._FOLD_BLOCK, BLOCK_V=4), {}),
        (readout._fold_grads_kernel, "bf16", set(), dict(K=4, PAD=1, BLOCK_D=readout._FOLD_BLOCK, BLOCK_V=4), {}),
        (readout._window_kernel, "bf16", set(), dict(READ=True, NORM=False, K=4, **window), {}),
        (readout._window_kernel, "bf16", set(), dict(READ=False, NORM=False, K=4, **window), {}),
        # the readout with the next RMSNorm: a token's whole row a program (TC's 4 taps, CC's 1), and an fp32 gain
        *[(readout._window_kernel, dtype, set(), dict(READ=True, NORM=True, K=k, **row), row_warps)
          for dtype, k in (("bf16", 4), ("bf16", 1), ("fp32", 4))],
        (readout._window_kernel, "bf16", {"gain_ptr", "normed_ptr"}, dict(READ=True, NORM=True, K=4, **row), row_warps),
        (readout._step_kernel, "bf16", set(), dict(READ=True, NORM=False, K=4, **window), {}),
        (readout._step_kernel, "bf16", set(), dict(READ=False, NORM=False, K=4, **window), {}),
        # a decoding step with the next RMSNorm: a sequence's whole row a program; and an fp32 gain
        (readout._step_kernel, "bf16", set(), dict(READ=True, NORM=True, K=4, **row), row_warps),
        (readout._step_kernel, "bf16", {"gain_ptr", "normed_ptr"}, dict(READ=True, NORM=True, K=4, **row), row_warps),
        *[(readout._window_grads_kernel, "bf16", {"part_ptr"}, dict(READ=read, GRAD_X=True, GRAD_TAPS=True, K=4,
                                                                    CHUNK=readout._CHUNK, **window), {})
          for read in (True, False)],
    ]


def compile_for_sm90(kernel, dtype, fp32_pointers, constexprs, options):
    """{"registers", "local bytes"} of the kernel compiled for sm_90; raises what the compiler raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    scalars = {name: "fp32" for name in ("k_eps_sq", "v_scale", "norm_eps")}  # (the rest: i32 sizes, offsets and strides)
    signature = {name: "constexpr" if name in constexprs else
                 ("*fp32" if name in fp32_pointers else f"*{dtype}") if name.endswith("_ptr") else
                 scalars.get(name, "i32") for name in kernel.arg_names}
    source = ASTSource(kernel, signature, {(kernel.arg_names.index(name),): value
                                           for name, value in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return {"registers": int(found.group(1)), "local bytes": int(found.group(2))}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=768, help="the hidden size (768: the paper's small)")
    parser.add_argument("--dv", type=int, default=4, help="the state's value channels")
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton_sm90: triton is not installed here (pip install triton)", file=sys.stderr)
        return 2
    failures = 0
    print(f"Triton kernels compiled for sm_90, d = {args.d}, d_v = {args.dv}")
    print("| kernel | dtype | constexprs | warps | registers | local bytes |")
    print("|---|---|---|---|---|---|")
    for kernel, dtype, fp32_pointers, constexprs, options in variants(args.d, args.dv):
        shown = ", ".join(f"{k}={v}" for k, v in constexprs.items() if not k.startswith("BLOCK"))
        try:
            usage = compile_for_sm90(kernel, dtype, fp32_pointers, constexprs, options)
            result = f"{usage['registers']} | {usage['local bytes']}"
        except Exception as error:  # (reported, and the exit status says so)
            failures += 1
            result = f"FAILED: {type(error).__name__}: {str(error).splitlines()[0][:200]} | -"
        print(f"| {kernel.__name__} | {dtype} | {shown} | {options.get('num_warps', 4)} | {result} |")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
