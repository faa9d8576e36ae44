"""Memory format, measured: channels_last only where it is timed faster on this model (with a margin),
cached per model and machine, the user's model and random stream left untouched; the Trainer and the
CLI measure it unless told (`memory_format`), and refuse a bad value in one line."""
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ampkit import Precision, Trainer
from ampkit.cli import main
import ampkit
from ampkit.tuning import layout
from ampkit.precision.device import measured_on

pytestmark = [__import__("pytest").mark.usefixtures("one_thread"),
              __import__("pytest").mark.machine_kind]  # memory format timed on this CPU


def _conv():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def _batch(n=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _fake(monkeypatch, ms):
    calls = []

    def fake(model, inputs, target, loss_fn, candidates, device=None, **kw):
        calls.append({k: v["channels_last"] for k, v in candidates.items()})
        return dict(ms)

    import ampkit.tuning.autotune as autotune

    monkeypatch.setattr(autotune, "time_precisions", fake)
    return calls


def _is_cl(model):
    w = next(m for m in model.modules() if isinstance(m, nn.Conv2d)).weight
    return w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()


def test_faster_layout_margin_and_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    x, y = _batch()
    calls = _fake(monkeypatch, {"contiguous": 100.0, "channels_last": 98.0})  # within the 3% margin
    r = layout.faster_layout(_conv(), x, y, nn.functional.cross_entropy, "fp32", "cpu")
    assert r["channels_last"] is False and not r["cached"] and "contiguous" in r["reason"]
    assert calls == [{"contiguous": False, "channels_last": True}]
    again = layout.faster_layout(_conv(), x, y, nn.functional.cross_entropy, "fp32", "cpu")
    assert again["cached"] and len(calls) == 1  # timed once per model and mode
    # another mode, another batch shape: measured again
    calls2 = _fake(monkeypatch, {"contiguous": 100.0, "channels_last": 80.0})
    r2 = layout.faster_layout(_conv(), *_batch(16), nn.functional.cross_entropy, "fp32", "cpu")
    assert r2["channels_last"] is True and "80.0 ms vs 100 ms" in r2["reason"] and len(calls2) == 1


def test_real_timing_leaves_the_model_alone(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    model, (x, y) = _conv(), _batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = layout.faster_layout(model, x, y, nn.functional.cross_entropy, "fp32", "cpu")
    assert set(r["ms"]) == {"contiguous", "channels_last"} and all(v > 0 for v in r["ms"].values())
    assert isinstance(r["channels_last"], bool)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not _is_cl(model)


def test_real_timing_keeps_the_random_stream(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    model, (x, y) = _conv(), _batch()
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    layout.faster_layout(model, x, y, nn.functional.cross_entropy, "fp32", "cpu")
    assert torch.equal(torch.rand(3), expected)


def test_precision_tune_measures_only_what_is_left_open(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    x, y = _batch()
    calls = _fake(monkeypatch, {"contiguous": 100.0, "channels_last": 70.0})
    p = ampkit.tune(Precision("fp32", "cpu"), _conv(), x, y, nn.functional.cross_entropy)
    assert p.channels_last is True and "channels_last" in p.describe() and len(calls) == 1
    model, _ = p.setup(_conv())
    assert _is_cl(model)
    # told explicitly, or nothing 4-D to convert: no timing
    for prec, net, inp in ((Precision("fp32", "cpu", channels_last=False), _conv(), x),
                           (Precision("fp32", "cpu"), nn.Linear(4, 4), torch.randn(2, 4))):
        ampkit.tune(prec, net, inp, torch.zeros(2, dtype=torch.long), nn.functional.cross_entropy)
    assert len(calls) == 1
    assert Precision("fp32", "cpu").layout_reason is None


def test_trainer_memory_format(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path / "cache"))
    x, y = _batch(32)
    data = TensorDataset(x, y)
    kw = dict(epochs=1, batch_size=8, progress=False, device="cpu", precision="fp32")
    calls = _fake(monkeypatch, {"contiguous": 100.0, "channels_last": 60.0})
    t = Trainer(_conv(), data, **kw, out=str(tmp_path / "a"))
    assert t.precision.channels_last is True and _is_cl(t.model) and len(calls) == 1
    assert capsys.readouterr().err.count("timing NCHW vs channels_last in fp32") == 1  # told, before timing
    t.fit()
    Trainer(_conv(), data, **kw)  # cached: nothing timed, nothing said
    assert len(calls) == 1 and "timing NCHW" not in capsys.readouterr().err
    for fmt, cl in (("contiguous", False), ("channels_last", True)):
        t2 = Trainer(_conv(), data, **kw, memory_format=fmt)
        assert _is_cl(t2.model) is cl
    off = Trainer(_conv(), data, **kw, autotune=False)
    assert not _is_cl(off.model) and len(calls) == 1  # the rule: fp32 keeps NCHW, nothing timed
    try:
        Trainer(_conv(), data, **kw, memory_format="nhwc")
    except ValueError as e:
        assert "memory_format" in str(e) and "channels_last" in str(e)
    else:
        raise AssertionError("a bad memory_format was accepted")


def test_cli_refuses_bad_memory_format(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('memory_format = "nhwc"\n')
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--epochs", "1", "--device", "cpu", "--out", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "memory_format" in err[0] and not out.exists()


def test_cache_key_names_the_units():
    key = measured_on(torch.device("cpu"))
    assert key.endswith("]") and "[" in key  # e.g. "AMD EPYC [avx2]": same model name, other units, other key


def test_timing_failure_falls_back_to_the_rule(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    import ampkit.tuning.autotune as autotune
    import pytest

    def boom(*a, **k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(autotune, "time_precisions", boom)
    p = Precision("fp32", "cpu")
    with pytest.warns(UserWarning, match="could not time both layouts.*out of memory.*--memory-format"):
        p = ampkit.tune(p, _conv(), *_batch(), nn.functional.cross_entropy)
    assert p.channels_last is None and p.layout_reason is None
    model, _ = p.setup(_conv())
    assert not _is_cl(model)  # the rule: fp32 keeps NCHW


class _Uncopyable(nn.Module):
    """A conv model that refuses copy.deepcopy itself (TypeError), so nothing can be timed. (A model that merely
    holds a lock is copied with the lock shared: tests/utils/test_copying.py.)"""

    def __init__(self):
        super().__init__()
        self.body = _conv()

    def __deepcopy__(self, memo):
        raise TypeError("this model cannot be copied")

    def forward(self, x):
        return self.body(x)


def test_a_model_that_cannot_be_copied_trains_with_the_defaults(monkeypatch, tmp_path):
    import pytest

    from tests.tuning.test_autotune import _bf16_cpu

    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    x, y = _batch(16)
    with pytest.warns(UserWarning, match="could not time both layouts.*cannot be deep-copied"):
        t = Trainer(_Uncopyable(), TensorDataset(x, y), epochs=1, batch_size=8, progress=False, device="cpu",
                    precision="fp32")
    assert not _is_cl(t.model)
    t.fit()
    _bf16_cpu(monkeypatch)  # auto would time bf16-mixed / bf16-master / fp32: it keeps the default instead
    p = Precision("auto", "cpu", channels_last=False)
    with pytest.warns(UserWarning, match="precision auto: the model cannot be deep-copied.*keeping the device's "
                                         "default, 'bf16-mixed'"):
        assert ampkit.tune(p, _Uncopyable(), x, y, nn.functional.cross_entropy).name == "bf16-mixed"
