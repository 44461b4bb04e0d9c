#!/usr/bin/env bash
# transformers' own common model tests on DDL (d_v = 1, and d_v = 4 with CC and EC) and on Llama as the control:
# fetches the harness once, runs tests/test_transformers_common.py, and prints each test's outcome per model.
#
#   scripts/transformers_common_tests.sh                 # fetch (once per transformers version) and run
#   scripts/transformers_common_tests.sh -k hidden       # extra arguments go to pytest
#   scripts/transformers_common_tests.sh --fetch         # fetch only (CI does this; the suite then runs the module)
#
# The harness is in transformers' source distribution on PyPI, not in its wheel. The sdist packages tests/*.py
# (test_modeling_common.py with ModelTesterMixin, test_training_mixin.py with TrainingTesterMixin, ...) but none of
# tests/'s subfolders: not generation/test_utils.py (GenerationTesterMixin), exporters/test_export.py
# (ExportTesterMixin), utils/ (what ConfigTester reads) or models/ (LlamaModelTester). test_modeling_common.py
# imports the first two, so they get empty stand-ins here: ModelTesterMixin runs without its torch.export tests and
# GenerationTesterMixin cannot run (DDL's generation modes are tested in tests/test_modeling_ddl.py). Nothing of the
# harness is copied into this repository; it lives in $DDL_TRANSFORMERS_TESTS (default ~/.cache/ddl/transformers-tests).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
VERSION=$("$PYTHON" -c 'import transformers; print(transformers.__version__)')
export DDL_TRANSFORMERS_TESTS=${DDL_TRANSFORMERS_TESTS:-$HOME/.cache/ddl/transformers-tests}
DEST=$DDL_TRANSFORMERS_TESTS/$VERSION

if [ ! -f "$DEST/transformers_tests/test_modeling_common.py" ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "fetching transformers==$VERSION's source distribution from PyPI for its test harness"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "transformers==$VERSION" -d "$work"
    tar -xzf "$work"/transformers-*.tar.gz -C "$work"
    tests=$(echo "$work"/transformers-*/tests)
    if [ ! -f "$tests/test_modeling_common.py" ]; then
        echo "transformers==$VERSION's sdist has no tests/test_modeling_common.py: the harness cannot run" >&2
        exit 1
    fi
    package=$work/harness/transformers_tests
    mkdir -p "$package/generation" "$package/exporters"
    cp "$tests"/*.py "$package/"
    touch "$package/__init__.py" "$package/generation/__init__.py" "$package/exporters/__init__.py"
    echo "class GenerationTesterMixin:  # not in the sdist (scripts/transformers_common_tests.sh)" \
        > "$package/generation/test_utils.py"
    echo "    pass" >> "$package/generation/test_utils.py"
    echo "class ExportTesterMixin:  # not in the sdist (scripts/transformers_common_tests.sh)" \
        > "$package/exporters/test_export.py"
    echo "    pass" >> "$package/exporters/test_export.py"
    mkdir -p "$DDL_TRANSFORMERS_TESTS"
    rm -rf "$DEST"
    mv "$work/harness" "$DEST"  # complete or absent
fi
if [ "${1:-}" = "--fetch" ]; then
    exit 0
fi
"$PYTHON" -c "import parameterized" 2>/dev/null || {
    echo "transformers' harness needs the parameterized package: $PYTHON -m pip install parameterized" >&2
    exit 1
}

results=$DEST/results.xml
status=0
"$PYTHON" -m pytest -q tests/test_transformers_common.py -p no:cacheprovider \
    -W ignore::pytest.PytestUnknownMarkWarning --junitxml "$results" "$@" > "$DEST/pytest.log" 2>&1 || status=$?
tail -n 1 "$DEST/pytest.log"
"$PYTHON" - "$results" <<'EOF'
"""One line per test: its outcome for Llama and for both DDL variants; tests with the same outcome everywhere are
counted, not listed."""
import collections
import sys
import xml.etree.ElementTree as ET

models = ("LlamaControlTest", "DDLScalarStateTest", "DDLExpandedStateTest")
outcomes = collections.defaultdict(dict)
for case in ET.parse(sys.argv[1]).iter("testcase"):
    model = case.get("classname").rsplit(".", 1)[-1]
    kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
    kind = kinds[0] if kinds else "passed"
    if kind == "skipped" and "xfail" in (case.find("skipped").get("type") or ""):
        kind = "xfail"
    outcomes[case.get("name")][model] = kind
same = collections.Counter()
print(f"\n{'test':<64} {'Llama':>8} {'DDL dv1':>8} {'DDL dv4':>8}")
for name in sorted(outcomes):
    row = [outcomes[name].get(model, "-") for model in models]
    if len(set(row)) == 1:
        same[row[0]] += 1
    else:
        print(f"{name[:64]:<64} {row[0]:>8} {row[1]:>8} {row[2]:>8}")
print("same outcome for all three: " + ", ".join(f"{n} {kind}" for kind, n in sorted(same.items())))
for model in models:
    counts = collections.Counter(outcomes[name][model] for name in outcomes if model in outcomes[name])
    print(f"{model}: " + ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())))
EOF
echo "full log: $DEST/pytest.log"
exit $status
