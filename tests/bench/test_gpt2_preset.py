"""The GPT-2 small bench preset: the real config's size and FLOPs (built on the meta device, no memory),
and the preset end to end at a tiny size through $AMPKIT_BENCH_GPT2 (the 124M model never runs here)."""
import math

import pytest
import torch

from ampkit.bench import configs
from ampkit.bench.configs import Settings, gpt2_batch_size, plan
from ampkit.bench.flops import count_flops
from ampkit.bench.report import finalize, markdown
from ampkit.bench.worker import measure, measure_paired
from ampkit.bench.workload import GPT2_ENV, build_workload
from ampkit.models import GPT2_SMALL, build_model, count_params, gpt2

TINY = "n_layers=2,d_model=64,n_heads=2,block_size=32,vocab_size=100"


def test_gpt2_small_is_124m_with_tied_head():
    with torch.device("meta"):
        m = gpt2()
    assert count_params(m) == 124_439_808  # GPT-2 small's published count (tied LM head)
    assert abs(count_params(m) / 124.4e6 - 1) < 0.01
    assert m.head.weight is m.tok.weight and m.block_size == 1024 and len(m.blocks.layers) == 12
    assert m.tok.num_embeddings == 50257 and m.tok.embedding_dim == 768
    assert m.blocks.layers[0].self_attn.num_heads == 12 and m.blocks.layers[0].norm_first
    # 6N + 12*L*d*T per token: N = 12 layers x 12 d^2 matrices + the (tied) 50257 x 768 head
    n = 12 * 12 * 768**2 + 50257 * 768
    assert m.model_flops_per_token(1024) == 6 * n + 12 * 12 * 768 * 1024 == 854_438_400
    assert sorted(GPT2_SMALL.items()) == sorted(
        {"vocab_size": 50257, "block_size": 1024, "d_model": 768, "n_layers": 12, "n_heads": 12}.items())


def test_model_flops_match_torchs_counter_but_for_the_flash_recompute():
    L, d, T, V, B = 2, 64, 32, 100, 3
    torch.manual_seed(0)
    m = gpt2(vocab_size=V, block_size=T, d_model=d, n_layers=L, n_heads=2)
    x = torch.randint(0, V, (B, T))

    def step():
        m(x).float().logsumexp(-1).mean().backward()

    counted = count_flops(step)
    model = m.model_flops_per_token(T) * B * T
    assert model == (6 * (L * 12 * d * d + V * d) + 12 * L * d * T) * B * T
    # torch counts the score matmul a flash backward recomputes: 14*L*d*T per token where MFU counts 12
    assert counted == model + 2 * L * d * T * B * T
    # the untied GPT (the `gpt` preset) counts its separate head once as well
    g = build_model("gpt", vocab_size=V, d_model=d, n_layers=L, n_heads=2, block_size=T)
    assert g.head.weight is not g.tok.weight and g.model_flops_per_token(T) == m.model_flops_per_token(T)


def test_batch_fills_the_gpu_by_memory_and_is_small_on_cpu(monkeypatch):
    assert gpt2_batch_size(torch.device("cpu")) == 1

    class Props:
        total_memory = 0

    for gib, want in ((79.2, 16), (39.4, 9), (23.6, 5), (7.8, 1), (2.0, 1)):
        Props.total_memory = int(gib * 2**30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props)
        assert gpt2_batch_size(torch.device("cuda")) == want, gib
    cfgs, _ = plan(Settings(models=["gpt2"], precisions=["fp32"], device="cpu"))
    assert {c["batch_size"] for c in cfgs} == {1} and {c["model"] for c in cfgs} == {"gpt2"}
    cfgs, _ = plan(Settings(models=["GPT2"], precisions=["fp32"], device="cpu", batch_size=4, compile=True))
    assert {c["batch_size"] for c in cfgs} == {4} and all(c["compile"] for c in cfgs)


@pytest.mark.parametrize("value, needle", [("n_layer=2", "n_layer=2"), ("d_model=x", "d_model=x"),
                                           ("d_model=0", "d_model=0"), ("d_model=64,n_heads=3", "multiple")])
def test_bad_size_override_is_an_input_error(monkeypatch, value, needle):
    monkeypatch.setenv(GPT2_ENV, value)
    with pytest.raises(ValueError, match=needle) as e:
        plan(Settings(models=["gpt2"], precisions=["fp32"], device="cpu"))
    assert GPT2_ENV in str(e.value) and "\n" not in str(e.value)


def test_preset_trains_and_reports_mfu_at_a_tiny_size(monkeypatch):
    monkeypatch.setenv(GPT2_ENV, TINY)
    wl = build_workload("gpt2", 2, 2, 0, torch.device("cpu"))
    (x,), y = wl.batches[0]
    assert x.shape == (2, 32) and int(x.max()) < 100 and wl.tokens_per_step == 64
    assert wl.model.head.weight is wl.model.tok.weight
    assert wl.model_flops_per_step == wl.model.model_flops_per_token(32) * 64
    cfg = {"model": "gpt2", "precision": "fp32", "runner": "ampkit", "batch_size": 2, "steps": 2, "warmup": 1,
           "device": "cpu", "lr": 1e-3, "seed": 0, "count_flops": True, "profile": False}
    r = measure(cfg)
    assert r["tokens_per_step"] == 64 and r["model_flops_per_step"] == wl.model_flops_per_step
    # torch's count: + the flash backward's recomputed scores (2*L*d*T per token); a GEMM attention has none
    extra = 2 * 2 * 64 * 32 * 64
    assert r["flops_per_step"] in (r["model_flops_per_step"], r["model_flops_per_step"] + extra)
    assert math.isfinite(r["final_loss"])
    assert r["n_params"] == count_params(wl.model)
    p = measure_paired({**cfg, "runner": "paired", "loop_precision": "fp32"})
    assert len(p["ratios"]) == 2 and math.isfinite(p["final_loss"])
    # MFU: model FLOPs per second over the measured peak of the mode's dtype
    row = {**r, "ms_per_step": 10.0, "ms_per_step_spread": 0.0}
    device = {"type": "cpu", "peak_flops": {"fp32": 2e12, "bf16": 1e12}}
    finalize([row], device)
    assert row["mfu"] == pytest.approx(r["model_flops_per_step"] * 100 / 2e12, rel=1e-3)
    assert row["mfu"] <= row["utilisation"]
    md = markdown(device, [row], {"steps": 2, "warmup": 1, "repeats": 1, "command": "ampkit bench --models gpt2"}, [])
    assert "## Model FLOPs utilisation" in md and "| gpt2 | fp32 | ampkit | 6400 |" in md
    assert configs.REFERENCE_MODELS["gpt2"]["what"].startswith("GPT-2 small (124M)")


def test_cli_bad_size_override_exits_2_writing_nothing(capsys, tmp_path, monkeypatch):
    from ampkit.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(GPT2_ENV, "layers=2")
    code = main(["bench", "--device", "cpu", "--models", "gpt2", "--compile", "--out", "out"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("ampkit bench: error:") and GPT2_ENV in err[0], err
    assert not (tmp_path / "out").exists()
