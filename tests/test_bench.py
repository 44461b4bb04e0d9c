"""bench.py runs end to end and reports every figure as a ratio to Llama (the speed itself is not asserted)."""

import json
from collections import Counter

import pytest

import bench


def test_bench_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(["--variants", "llama", "ddl-cc", "--repeats", "1", "--train_steps", "1", "--new_tokens", "2",
                "--json", str(out)])
    rows = {row["model"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"llama", "ddl-cc"}
    for key in ("train_tok_s", "prefill_tok_s", "decode_b1_tok_s", "decode_b8_tok_s", "peak_train_mem_MB"):
        assert rows["llama"][key]["ratio"] == 1.0 and rows["ddl-cc"][key]["median"] > 0
    # AdamW state + gradients + parameters alone exceed 4x the fp32 parameter bytes
    assert rows["llama"]["peak_train_mem_MB"]["median"] > 4 * 4 * rows["llama"]["params_M"] * 1e6 / 2**20
    assert "| ddl-cc |" in capsys.readouterr().out


class _Fake:
    def __init__(self, name, values):
        self.name, self.results = name, {"train_tok_s": values}
        self.model = __import__("torch").nn.Linear(1, 1)


def test_ratios_are_paired_by_repeat():
    """A machine that slows down between repeats slows both models alike: the paired ratio stays exact."""
    llama, ddl = _Fake("llama", [100.0, 50.0, 80.0]), _Fake("ddl", [90.0, 45.0, 72.0])
    row = {r["model"]: r for r in bench.summarise([ddl, llama])}["ddl"]["train_tok_s"]
    assert all(abs(row[key] - 0.9) < 1e-12 for key in ("ratio", "ratio_min", "ratio_max"))
    assert row["median"] == 72.0


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_order_balances_positions_and_predecessors(n):
    """Over one cycle of the design every model runs in every position, and right after every other model, equally
    often (a cyclic rotation A B C, B C A, ... fails: B always follows A but in the one round where B runs first)."""
    models = [f"model-{i}" for i in range(n)]
    cycle = 2 * n if n % 2 else n
    orders = [bench.balanced_order(models, repeat) for repeat in range(cycle)]
    assert all(sorted(order) == models for order in orders)
    positions = Counter((order.index(m), m) for order in orders for m in models)
    assert set(positions.values()) == {cycle // n} and len(positions) == n * n
    pairs = Counter(pair for order in orders for pair in zip(order, order[1:]))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1
