"""scikit-learn and matplotlib are extras (ampkit[data], ampkit[plot]): ``import ampkit`` and the README's
five-line loop work without them, and each feature that needs one says which ``pip install`` adds it."""
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r'''
import sys
sys.modules["sklearn"] = None      # as if not installed: importing it raises ImportError
sys.modules["matplotlib"] = None
import torch
from torch import nn
import ampkit

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss_fn = nn.functional.cross_entropy
x0, y0 = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
precision = ampkit.Precision("bf16-mixed", "cpu")
precision = ampkit.tune(precision, model, x0, y0, loss_fn)
model, optimizer = precision.setup(model, optimizer)
for x, y in [(x0, y0)] * 2:
    with precision.autocast():
        loss = loss_fn(model(x), y)
    precision.backward(loss)
    precision.step(optimizer, max_norm=1.0)
    optimizer.zero_grad(set_to_none=True)
from ampkit.data import load_data
try:
    load_data("digits")
except ImportError as e:
    print("DIGITS:", e)
from ampkit.cli import main
sys.exit(main(["plot", "."]))
'''


def test_library_works_without_the_extras(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                       timeout=300)
    assert "DIGITS: the digits data set needs scikit-learn, which is not installed: pip install 'ampkit[data]'" \
        in r.stdout, r.stdout + r.stderr
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and err[-1] == ("ampkit plot: error: ampkit plot needs matplotlib, which is not "
                                             "installed: pip install 'ampkit[plot]'"), r.stderr


def test_classification_report_without_scikit_learn(monkeypatch):
    from sklearn.metrics import confusion_matrix

    from ampkit.train.evaluate import classification_text

    preds, targets = np.array([3, 1, 1, 2, 0, 3]), np.array([0, 1, 2, 2, 0, 3])
    assert classification_text(preds, targets)["confusion_matrix"] == confusion_matrix(targets, preds).tolist()
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.metrics", None)
    r = classification_text(np.array([0, 1, 1, 2]), np.array([0, 1, 2, 2]), ["a", "b", "c"])
    assert r["dict"] is None and "pip install 'ampkit[data]'" in r["text"]
    assert r["confusion_matrix"] == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
