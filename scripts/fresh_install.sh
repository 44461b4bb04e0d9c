#!/usr/bin/env bash
# The install a new user makes, checked: a new environment, torch, then `pip install <this checkout>` (pip's isolated
# build, which has no torch: setup.py builds the C++ CPU kernels with the compiler alone), then a fresh process's first
# forward, backward and decoding steps, timed (scripts/first_forward.py, run outside the checkout so that python
# imports the installed ddl): it must start no process (no compiler) and run the C++ kernels of the installation.
# Needs the network or a local package index for torch, transformers and setuptools; hence a script, not a test
# (tests/test_cpu_kernel.py builds with setup.py offline instead).
#
#   scripts/fresh_install.sh            # in a temporary folder, removed after
#   PYTHON=python3.12 TORCH_VERSION=2.13.0 scripts/fresh_install.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
start=$("$PY" -c "import time; print(time.time())")
"$PY" -m pip install -q "$ROOT"
"$PY" -c "import time; print(f'pip install $ROOT: {time.time() - $start:.0f} s (with its dependencies)')"
mkdir "$WORK/elsewhere"
cd "$WORK/elsewhere"
"$PY" "$ROOT/scripts/first_forward.py" | tee "$WORK/result"
"$PY" - "$WORK/result" "$WORK/venv" <<'EOF'
import json, sys
result = json.loads(open(sys.argv[1]).read().split("RESULT ", 1)[1])
ok = result["started"] == [] and (result["kernels"] or "").startswith(sys.argv[2]) and result["calls"]
print(f"fresh_install: {'OK' if ok else 'FAILED'}: first forward {result['first_forward_s']} s after "
      f"{result['import_s']} s of imports; C++ kernels {result['kernels']}; processes started: {result['started']}")
sys.exit(0 if ok else 1)
EOF
