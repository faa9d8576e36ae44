"""Hugging Face `transformers` models (built from tiny configs, no download) in every precision mode:
the README's five-line loop, the Trainer on dict datasets (exact resume), and `ampkit.check`."""
import math
import warnings

import pytest
import torch

import ampkit
from ampkit.precision.modes import AUTO, MODES
from ampkit.train import Trainer

from hf_models import ARCHS, BATCHES, DictDataset, build
from precision_helpers import fp8_ends

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]
ALL_MODES = list(MODES) + [AUTO]
TIED = {"gpt2": ("transformer.wte.weight", "lm_head.weight"), "llama": ("model.embed_tokens.weight", "lm_head.weight"),
        "t5": ("shared.weight", "lm_head.weight")}


def _non_float_state(model):
    return {n: (t.dtype, t.clone()) for n, t in list(model.named_buffers()) + list(model.named_parameters())
            if not t.is_floating_point()}


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_five_line_loop_trains_in_every_mode(arch, mode):
    model = build(arch)
    out_type = type(model(**BATCHES[arch](0)))
    non_float = _non_float_state(model)
    batch = BATCHES[arch](0)
    ints = {k: v.clone() for k, v in batch.items() if not v.is_floating_point()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-4)
    precision = ampkit.Precision(mode, "cpu", **fp8_ends(mode))
    model, optimizer = precision.setup(model, optimizer)
    losses = []
    for _ in range(6):
        with precision.autocast():
            out = model(**batch)
        precision.backward(out.loss)
        precision.step(optimizer, max_norm=1.0)
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    assert type(out) is out_type  # the ModelOutput, not a dict: `.loss` / `.logits` work in every mode
    assert out.logits is out["logits"]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert precision.skipped_steps <= (2 if precision.mode.scaled else 0)  # dynamic scaling may back off once or twice
    # integer inputs (input_ids, attention_mask, labels) are never cast
    assert all(torch.equal(batch[k], v) and batch[k].dtype == v.dtype for k, v in ints.items())
    converted = precision._convert_input(batch)
    assert type(converted) is dict and all(converted[k].dtype == v.dtype for k, v in ints.items())
    # integer buffers/params (e.g. BERT's position_ids) survive the conversion unchanged
    for name, (dtype, value) in non_float.items():
        t = model.get_buffer(name) if name in dict(model.named_buffers()) else model.get_parameter(name)
        assert t.dtype == dtype and torch.equal(t, value), name
    if arch in TIED:  # tied embedding / LM head stay one tensor (and the optimizer stepped it once)
        a, b = TIED[arch]
        assert model.get_parameter(a) is model.get_parameter(b)
    if precision.param_dtype != torch.float32:
        assert any(p.dtype == precision.param_dtype for p in model.parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_trainer_trains_dict_datasets_in_every_mode(arch):
    """The Trainer on a dataset of dicts and a model that returns its own loss: no loss_fn needed."""
    for mode in ALL_MODES:
        trainer = Trainer(build(arch), DictDataset(arch, 16), DictDataset(arch, 8, seed=1), precision=mode,
                          **fp8_ends(mode), batch_size=4, epochs=2, lr=3e-3, autotune=False, progress=False)
        summary = trainer.fit()
        losses = [r["loss"] for r in trainer.history if r.get("kind") == "train"]
        assert summary["optimizer_steps"] + summary["skipped_steps"] == 8 and summary["skipped_steps"] <= 2, (mode, summary)
        assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], (mode, losses)
        assert math.isfinite(summary["eval_loss"])
        if arch in ("bert", "vit"):  # logits line up with one label per sample: accuracy is measured
            assert 0.0 <= summary["accuracy"] <= 1.0
        else:  # a model that shifts/decodes its labels inside: no accuracy is claimed
            assert summary["accuracy"] is None


@pytest.mark.parametrize("arch,mode", [("gpt2", "fp32"), ("vit", "fp32"), ("gpt2", "bf16-master"), ("vit", "fp16-mixed"), ("t5", "bf16-pure")])
def test_trainer_resume_is_exact_on_hf_models(tmp_path, arch, mode):
    kw = dict(precision=mode, batch_size=4, lr=3e-3, autotune=False, progress=False, seed=3, lr_schedule="constant")
    train, test = DictDataset(arch, 16), DictDataset(arch, 8, seed=1)
    # attention kernels are measured before training (ampkit.tune) and never change a run's result: no warm-up
    ref = Trainer(build(arch), train, test, epochs=2, **kw)
    ref.fit()
    out = str(tmp_path / "run")
    Trainer(build(arch), train, test, epochs=1, out=out, **kw).fit()
    resumed = Trainer(build(arch, seed=99), train, test, epochs=2, out=out, resume="auto", **kw)
    resumed.fit()
    assert resumed.global_step == ref.global_step and resumed.attempted_steps == ref.attempted_steps == 8
    for (name, a), b in zip(ref.raw_model.state_dict().items(), resumed.raw_model.state_dict().values()):
        assert torch.equal(a, b), name


def test_trainer_takes_a_dataloader_and_its_collate_fn():
    """A DataLoader's dataset, collate_fn and batch_size are used (the order stays the Trainer's own)."""
    calls = []

    def collate(samples):
        calls.append(len(samples))
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}

    loader = torch.utils.data.DataLoader(DictDataset("gpt2", 12), batch_size=3, collate_fn=collate)
    trainer = Trainer(build("gpt2"), loader, precision="bf16-mixed", epochs=1, autotune=False, progress=False)
    summary = trainer.fit()
    # 4 training batches of 3; the one other call is the fp32 probe of two samples before training
    assert summary["optimizer_steps"] == 4 and calls.count(3) == 4 and sorted(set(calls) - {3}) in ([], [2])


@pytest.mark.parametrize("arch", ARCHS)
def test_check_runs_on_hf_models(arch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = ampkit.check(build(arch), BATCHES[arch](0), precisions=("fp16-mixed", "bf16-mixed"), device="cpu")
    assert set(report["verdicts"]) == {"fp16-mixed", "bf16-mixed"}
    assert math.isfinite(report["reference"]["loss"])  # the model's own loss, found without a loss_fn
    for p in ("fp16-mixed", "bf16-mixed"):
        assert report["verdicts"][p]["verdict"] in ("ok", "risky", "unsafe")
    assert "verdict" in str(report).lower()


def test_cli_trains_a_model_factory_on_dict_data_factory(tmp_path, monkeypatch, capsys):
    """`ampkit train --model pkg:make_model --data pkg:make_data` where the data yields dicts (a DataLoader
    with its own collate_fn too) and the model returns its own loss; `ampkit check` on the same."""
    import json

    from ampkit.cli import main

    (tmp_path / "hfmods.py").write_text(
        "import torch, sys\n"
        f"sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parents[1])!r})\n"
        "from hf_models import DictDataset, build\n"
        "def make_model():\n    return build('bert')\n"
        "def make_data():\n    return DictDataset('bert', 16), DictDataset('bert', 8, seed=1)\n"
        "def make_loaders():\n"
        "    collate = lambda s: {k: torch.stack([x[k] for x in s]) for k in s[0]}\n"
        "    return (torch.utils.data.DataLoader(DictDataset('bert', 16), batch_size=8, collate_fn=collate),\n"
        "            torch.utils.data.DataLoader(DictDataset('bert', 8, seed=1), batch_size=8, collate_fn=collate))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    fast = ["--no-autotune", "--no-progress", "--epochs", "2", "--lr", "3e-3"]
    assert main(["train", "--model", "hfmods:make_model", "--data", "hfmods:make_data", "--precision", "bf16-pure",
                 "--batch-size", "4", "--out", "a"] + fast) == 0
    summary = json.load(open(tmp_path / "a" / "summary.json"))
    assert summary["optimizer_steps"] == 8 and summary["task"] == "classification" and summary["accuracy"] is not None
    assert main(["train", "--model", "hfmods:make_model", "--data", "hfmods:make_loaders", "--precision", "fp16-master",
                 "--out", "b"] + fast) == 0
    assert json.load(open(tmp_path / "b" / "summary.json"))["optimizer_steps"] == 4  # the loader's batch_size 8
    capsys.readouterr()
    assert main(["train", "--data", "hfmods:make_data", "--out", "c"] + fast) == 2
    assert "pass the model for them with --model" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    assert main(["check", "--model", "hfmods:make_model", "--data", "hfmods:make_data", "--precision", "bf16",
                 "--batch-size", "4"]) == 0
    assert "bf16-mixed" in capsys.readouterr().out


def test_auto_timing_drives_dict_batches():
    """precision auto's timing (and the Trainer's tune) calls model(**batch) and trains on the model's loss."""
    from ampkit.tuning.autotune import time_modes
    from ampkit.train.evaluate import default_loss

    batch = BATCHES["gpt2"](0)
    ms = time_modes(build("gpt2"), batch, batch["labels"], default_loss, ["fp32", "bf16-mixed"], "cpu",
                    warmup=0, rounds=1)
    assert set(ms) == {"fp32", "bf16-mixed"} and all(v > 0 for v in ms.values())
