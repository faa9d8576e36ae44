"""`ampkit plan`: the side-by-side table, --json, and one-line errors for bad input."""
import json

import pytest

from ampkit.cli import main


def test_json_per_mode_with_the_largest_batch(capsys):
    rc = main(["plan", "--model", "mlp", "--precision", "fp32,bf16-pure", "--memory", "64MB", "--json",
               "--batch-size", "16"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and [m["mode"] for m in out["modes"]] == ["fp32", "bf16-pure"]
    fp32, pure = out["modes"]
    assert out["budget_bytes"] == 64 * 10**6 and out["margin"] == 0.1
    assert pure["breakdown"]["weights"] * 2 == fp32["breakdown"]["weights"]
    assert pure["breakdown"]["compensation"] > 0 and "compensation" not in fp32["breakdown"]
    for m in out["modes"]:
        assert 0 < m["max_batch_peak_bytes"] <= 64 * 10**6 * 0.9
        assert m["max_batch_size"] >= 1


def test_table_names_the_margin_and_every_mode(capsys):
    rc = main(["plan", "--model", "mlp", "--precision", "fp32,bf16-master", "--memory", "1GB", "--max-batch", "256"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "fp32 masters" in out and "optimizer state" in out and "peak" in out
    assert "10% margin" in out and "256 (cap)" in out


@pytest.mark.parametrize("argv, words", [
    (["--memory", "80XB"], "80GB"),
    (["--precision", "fp99"], "Unknown precision"),
    (["--batch-size", "0"], "--batch-size"),
    (["--margin", "2"], "--margin"),
    (["--model", "nosuch"], "Unknown model"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, words):
    rc = main(["plan", "--model", "mlp", *argv] if "--model" not in argv else ["plan", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and words in err and len(err.splitlines()) == 1
