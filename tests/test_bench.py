"""bench.py runs end to end and reports every figure as a ratio to Llama (the speed itself is not asserted)."""

import json

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


def test_rotation_puts_every_model_in_every_position():
    models = ["a", "b", "c"]
    orders = [bench.rotation(models, repeat) for repeat in range(3)]
    assert orders[0] == models and all(sorted(order) == models for order in orders)
    assert all({order[position] for order in orders} == set(models) for position in range(3))
