"""A fresh process's first use of DDL, timed: a 1-layer toy model's forward, backward and 4 decoding steps, with
Python's audit hooks watching for any process started (a compiler, a build tool). Prints one JSON line: the seconds
taken (imports, then the first forward), whether the C++ CPU kernels were loaded and from where, how often each
operation's C++ implementation served, and the processes started (none: nothing is built at run time).

    python scripts/first_forward.py                        # the ddl and ddl_kernels this python imports
    python scripts/first_forward.py --kernels_from DIR     # as if ddl_kernels' libraries were those in DIR

Run from a folder outside the checkout to use an installed ddl (scripts/fresh_install.sh; tests/test_cpu_kernel.py).
"""

import argparse
import json
import sys
import time


STARTS = ("subprocess.Popen", "os.system", "os.posix_spawn", "os.exec", "os.fork", "os.spawn")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels_from", help="the folder whose C++ libraries (and sources) ddl_kernels loads")
    args = parser.parse_args(argv)
    started = []

    def audit(event, event_args):
        if event in STARTS:
            started.append(f"{event}: {event_args[0]!r}")
            raise RuntimeError("scripts/first_forward.py: a process was started")  # (a build fails now, not in minutes)

    sys.addaudithook(audit)
    begin = time.perf_counter()
    import torch

    from ddl import DDLConfig, DDLForCausalLM, ops
    from ddl_kernels import build

    if args.kernels_from:
        build.HERE = args.kernels_from
    calls = {}
    ops.kernel("delta_residual", "auto", torch.device("cpu"))  # (fills the table)
    for op, devices in ops._installed.items():
        def counted(run, op):
            def served(*a, **kw):
                out = run(*a, **kw)  # (None: the kernel does not serve these inputs)
                if out is not None:
                    calls[op] = calls.get(op, 0) + 1
                return out
            return served

        if devices.get("cpu") is not None:
            devices["cpu"] = counted(devices["cpu"], op)
    imported = time.perf_counter()
    torch.manual_seed(0)
    model = DDLForCausalLM(DDLConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0))
    ids = torch.randint(3, 99, (2, 8))
    model(ids, labels=ids).loss.backward()
    with torch.no_grad():
        model.eval().generate(ids[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
    done = time.perf_counter()
    loaded = build.kernels()
    print("RESULT " + json.dumps({
        "import_s": round(imported - begin, 3), "first_forward_s": round(done - imported, 3),
        "kernels": loaded.__file__ if loaded else None, "calls": calls, "started": started}), flush=True)


if __name__ == "__main__":
    main()
