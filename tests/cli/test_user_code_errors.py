"""Whose error is it: the user's own code (model, data factory) keeps its traceback,
an OSError from it is not answered as a disk problem; a --device torch cannot run here is one line, exit 2, in
every verb; option ranges are said in the flags' words."""
import sys

import numpy as np
import pytest

from cli_helpers import FAST, InProcess, one_error

_USER = '''
import torch

class Net(torch.nn.Module):
    def __init__(self, fail):
        super().__init__()
        self.fc, self.calls, self.fail = torch.nn.Linear(4, 3), 0, fail
    def forward(self, x):
        self.calls += 1
        if self.calls > 3:  # past the check of the first batch: in training
            self.fail()
        return self.fc(x)

def _value():
    raise ValueError("my own bug")

def _os():
    open("/nonexistent-w50/weights.bin")

def value_net(**kw):
    return Net(_value)

def os_net(**kw):
    return Net(_os)

def broken(**kw):
    raise RuntimeError("boom")

def data(seed=0):
    raise OSError(28, "No space left on device")
'''


@pytest.fixture
def user(tmp_path, monkeypatch):
    r = np.random.RandomState(0)
    x = r.randn(64, 4).astype("float32")
    np.savez(tmp_path / "d.npz", x=x, y=(x[:, 0] > 0).astype("int64") + (x[:, 1] > 0))
    (tmp_path / "w50user.py").write_text(_USER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "w50user", raising=False)
    return tmp_path


@pytest.mark.parametrize("model, error, text", [("w50user:value_net", ValueError, "my own bug"),
                                                ("w50user:os_net", FileNotFoundError, "nonexistent-w50")])
def test_an_error_in_the_users_forward_keeps_its_traceback(user, capsys, model, error, text):
    from ampkit.cli import main

    with pytest.raises(error, match=text) as e:  # before: one line, exit 2, no file, line or type
        main(["train", "--data", "d.npz", "--model", model, "--epochs", "3", "--out", "run", *FAST])
    frames = [tb.tb_frame.f_code.co_filename for tb in _walk(e.value.__traceback__)]
    assert any(f.endswith("w50user.py") for f in frames)
    assert "checkpoints already written are intact" not in capsys.readouterr().err


def test_a_failing_factory_keeps_its_traceback(user, capsys):
    from ampkit.cli import main

    with pytest.raises(ValueError, match="model factory 'w50user:broken' failed") as e:
        main(["train", "--data", "d.npz", "--model", "w50user:broken", "--out", "run", *FAST])
    assert isinstance(e.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match="data factory 'w50user:data' failed: OSError"):
        main(["train", "--data", "w50user:data", "--out", "run", *FAST])
    assert "intact" not in capsys.readouterr().err


def test_ampkits_own_usage_errors_stay_one_line(user, capsys):
    line = one_error(InProcess(["train", "--data", "d.npz", "--epochs", "0", "--out", "run", *FAST], capsys))
    assert "--epochs must be >= 1" in line


def _walk(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


@pytest.mark.parametrize("verb", ["train", "check", "plan", "bench"])
@pytest.mark.parametrize("device", ["meta", "mps", "xpu"])
def test_a_device_torch_cannot_run_here_is_one_line_in_every_verb(verb, device, capsys):
    import torch

    backend = getattr(torch, device, None)
    if device != "meta" and backend is not None and backend.is_available():
        pytest.skip(f"{device} runs here")
    line = one_error(InProcess([verb, "--device", device], capsys))
    assert f"--device {device}: " in line and "use --device cpu" in line and "cannot run on this data" not in line


@pytest.mark.parametrize("argv, words, not_words", [
    (["--init-scale", "-4", "--precision", "fp16-mixed"], "--init-scale must be a positive number", "zeroes"),
    (["--max-consecutive-skips", "0"], "--max-consecutive-skips must be >= 1", "max_consecutive_skips"),
])
def test_option_ranges_in_the_flags_words(user, capsys, argv, words, not_words):
    line = one_error(InProcess(["train", "--data", "d.npz", "--out", "run", *FAST, *argv], capsys))
    assert words in line and not_words not in line
