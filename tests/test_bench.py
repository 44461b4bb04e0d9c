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
