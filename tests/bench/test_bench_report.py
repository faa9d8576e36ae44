"""ampkit.bench.report: ratios against the fp32 row of the same model and runner, and the three outputs."""
import json

from ampkit.bench.report import finalize, markdown, write_json, write_markdown, write_png

DEV = {"type": "cpu", "name": "test cpu", "matrix_units": "none", "bf16_fast": True, "threads": 2, "torch": "x",
       "peak_flops": {"fp32": 1e11, "bf16": 2e11}}


def rec(model, precision, runner, ms, loss, **kw):
    return {"model": model, "precision": precision, "resolved_precision": precision, "runner": runner,
            "ms_per_step": ms, "ms_per_step_spread": 1.0, "final_loss": loss, "samples_per_step": 64,
            "tokens_per_step": None, "peak_mem_mb": 500.0, "state_bytes_per_param": 16.0, "flops_per_step": 2e10,
            "profile": None, **kw}


def rows():
    return [
        rec("cnn", "fp32", "ampkit", 200.0, 2.00, loop="ampkit Precision('fp32') hooks, channels_last"),
        rec("cnn", "bf16-mixed", "ampkit", 100.0, 2.02),
        rec("cnn", "bf16-master", "ampkit", 80.0, 1.98),
        rec("cnn", "fp32", "torch-loop", 400.0, 2.50),  # a different fp32 per runner
        rec("cnn", "bf16-mixed", "torch-loop", 120.0, 2.40),
        rec("gpt", "fp32", "ampkit", 1000.0, 5.0, tokens_per_step=4096),
        rec("gpt", "bf16-mixed", "ampkit", 1100.0, 5.1, tokens_per_step=4096),
        {"model": "gpt", "precision": "bf16-master", "runner": "ampkit", "error": "timed out after 9 s", "repeats": 0},
    ]


def test_ratios_are_against_fp32_of_same_model_and_runner():
    out = {(r["model"], r["precision"], r["runner"]): r for r in finalize(rows(), DEV)}
    assert out["cnn", "bf16-mixed", "ampkit"]["speedup_vs_fp32"] == 2.0
    assert out["cnn", "bf16-mixed", "torch-loop"]["speedup_vs_fp32"] == round(400 / 120, 4)
    assert out["cnn", "fp32", "ampkit"]["speedup_vs_fp32"] == 1.0
    assert abs(out["cnn", "bf16-mixed", "ampkit"]["loss_delta_vs_fp32"] - 0.02) < 1e-9
    assert abs(out["cnn", "bf16-mixed", "torch-loop"]["loss_delta_vs_fp32"] - -0.10) < 1e-9
    assert abs(out["cnn", "bf16-master", "ampkit"]["loss_rel_delta_vs_fp32"] - -0.01) < 1e-9
    # ampkit vs the plain loop in the same dtype: bf16-master against the bf16 autocast loop
    assert out["cnn", "bf16-master", "ampkit"]["vs_torch_loop"] == 1.5
    assert out["cnn", "fp32", "ampkit"]["vs_torch_loop"] == 2.0
    assert out["cnn", "bf16-mixed", "torch-loop"]["vs_torch_loop"] is None
    # throughput, FLOP/s and utilisation against the peak of the compute dtype
    r = out["cnn", "bf16-mixed", "ampkit"]
    assert r["samples_per_s"] == 640.0 and r["tflops"] == 0.2 and r["utilisation"] == 1.0
    assert out["cnn", "fp32", "ampkit"]["utilisation"] == 1.0  # 2e10 / 0.2 s = 1e11 = fp32 peak
    # no bf16 units: an emulated bf16 GEMM "peak" below fp32's is not the ceiling, fp32's is
    slow = finalize(rows(), {**DEV, "peak_flops": {"fp32": DEV["peak_flops"]["fp32"], "bf16": 1e9}})
    r_slow = next(r for r in slow if (r["model"], r["precision"], r["runner"]) == ("cnn", "bf16-mixed", "ampkit"))
    assert r_slow["utilisation"] == round(r["tflops"] * 1e12 / DEV["peak_flops"]["fp32"], 4)
    assert out["gpt", "bf16-mixed", "ampkit"]["tokens_per_s"] == round(4096 / 1.1, 1)
    # not faster -> one line why (no profile here: falls back to the no-profile line)
    assert out["gpt", "bf16-mixed", "ampkit"]["explanation"]
    assert out["cnn", "bf16-mixed", "ampkit"]["explanation"] is None
    failed = out["gpt", "bf16-master", "ampkit"]
    assert failed["speedup_vs_fp32"] is None and failed["explanation"] is None


def test_outputs(tmp_path):
    res = finalize(rows(), DEV)
    settings = {"steps": 3, "warmup": 1, "repeats": 2, "command": "ampkit bench --quick"}
    p = write_json(str(tmp_path / "bench.json"), DEV, res, settings, ["a note"])
    data = json.load(open(p))
    assert set(data) >= {"device", "results"} and len(data["results"]) == 8
    md = markdown(DEV, res, settings, ["a note"])
    assert "| cnn | bf16-master | ampkit | 80.0 | 1.0 | 2.50x | 1.50 |" in md
    assert "| gpt | bf16-master | ampkit | failed: timed out after 9 s |" in md
    assert "- cnn fp32 (ampkit): ampkit Precision('fp32') hooks, channels_last" in md  # what the row ran
    assert "## Not faster than fp32: why" in md and "- a note" in md and "`ampkit bench --quick`" in md
    write_markdown(str(tmp_path / "bench.md"), DEV, res, settings, [])
    png = write_png(str(tmp_path / "bench.png"), res, DEV)
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_noisy_rows_are_flagged_and_marked():
    rs = rows()
    rs[1].update(rep_ms=[90.0, 200.0])  # repetitions disagree by > 1.5x
    rs[2].update(ms_per_step_spread=50.0)  # IQR above half the median (80 ms)
    out = finalize(rs, DEV)
    assert [r["noisy"] for r in out[:3]] == [False, True, True]
    assert out[1]["explanation"] is None  # 2x faster: nothing to explain, noisy or not
    md = markdown(DEV, out, {}, [])
    assert "| cnn | bf16-mixed | ampkit | 100.0* |" in md and "\\* noisy" in md


def test_paired_ratios_attach_to_ampkit_rows_and_disagreement_is_called_out():
    from ampkit.bench.report import attach_paired

    paired = {"model": "cnn", "precision": "bf16-master", "runner": "paired", "vs_torch_loop_paired": 1.02,
              "paired_ratio_iqr": 0.01, "paired_rep_ratios": [1.01, 1.03], "loop_ms_per_step": 120.0,
              "ms_per_step": 118.0, "loop_precision": "bf16-mixed"}
    failed = {"model": "cnn", "precision": "bf16-mixed", "runner": "paired", "error": "timed out after 9 s"}
    everything = rows() + [paired, failed]
    kept = attach_paired(everything)
    assert len(kept) == len(everything) - 2 and all(r["runner"] != "paired" for r in kept)
    res = finalize(kept, DEV)
    master = next(r for r in res if (r["model"], r["precision"], r["runner"]) == ("cnn", "bf16-master", "ampkit"))
    assert master["vs_torch_loop_paired"] == 1.02 and master["paired_loop_ms"] == 120.0
    md = markdown(DEV, res, {"steps": 3}, [])
    assert "| cnn | bf16-master | bf16-mixed | 118.0 | 120.0 | 1.020 | 0.010 | 1.010, 1.030 | 1.50 |" in md
    assert "| cnn | bf16-mixed | failed: timed out after 9 s |" in md
    # per process 1.50x, paired 1.02x: the report says which to read
    assert "differ by more than 10% for cnn bf16-master" in md


def test_compiled_vs_eager_pairs_attach_to_ampkit_rows():
    """``--compile``: each ampkit row's paired-compile record (eager/compiled per step, in one process) moves
    onto the row and gets its own table; a failed pair says why."""
    from ampkit.bench.report import attach_paired

    pair = {"model": "cnn", "precision": "fp32", "runner": "paired-compile", "vs_torch_loop_paired": 0.87,
            "paired_ratio_iqr": 0.02, "paired_rep_ratios": [0.86, 0.88], "loop_ms_per_step": 190.0,
            "ms_per_step": 218.0, "loop_precision": "fp32"}
    failed = {"model": "gpt", "precision": "fp32", "runner": "paired-compile", "error": "InductorError: no compiler"}
    everything = rows() + [pair, failed]
    kept = attach_paired(everything)
    assert len(kept) == len(everything) - 2 and all(r["runner"] != "paired-compile" for r in kept)
    res = finalize(kept, DEV)
    cnn = next(r for r in res if (r["model"], r["precision"], r["runner"]) == ("cnn", "fp32", "ampkit"))
    assert cnn["compiled_vs_eager_paired"] == 0.87 and cnn["paired_eager_ms"] == 190.0
    assert "vs_torch_loop_paired" not in cnn  # not confused with the loop pairing
    md = markdown(DEV, res, {"steps": 3}, [])
    assert "## Compiled vs eager, paired in one process (`--compile`)" in md
    assert "| cnn | fp32 | 218.0 | 190.0 | 0.870 | 0.020 | 0.860, 0.880 |" in md
    assert "| gpt | fp32 | failed: InductorError: no compiler |" in md
