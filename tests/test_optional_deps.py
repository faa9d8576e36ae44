"""scikit-learn and matplotlib are extras (.[data], .[plot]): ``import ampkit`` and the README's
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
    assert ("DIGITS: the digits data set needs scikit-learn, which is not installed: pip install scikit-learn (or, in "
            "ampkit's checkout, pip install '.[data]')") \
        in r.stdout, r.stdout + r.stderr
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and err[-1] == ("ampkit plot: error: ampkit plot needs matplotlib, which is not "
                                             "installed: pip install matplotlib (or, in ampkit's checkout, pip install "
                                             "'.[plot]')"), r.stderr


def test_classification_report_without_scikit_learn(monkeypatch):
    from sklearn.metrics import confusion_matrix

    from ampkit.train.evaluate import classification_text

    preds, targets = np.array([3, 1, 1, 2, 0, 3]), np.array([0, 1, 2, 2, 0, 3])
    assert classification_text(preds, targets)["confusion_matrix"] == confusion_matrix(targets, preds).tolist()
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.metrics", None)
    r = classification_text(np.array([0, 1, 1, 2]), np.array([0, 1, 2, 2]), ["a", "b", "c"])
    assert r["dict"] is None and "pip install '.[data]'" in r["text"]
    assert r["confusion_matrix"] == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]


_SPLIT = r'''
import sys
sys.modules["sklearn"] = None      # as if not installed
import numpy as np
from ampkit.data import load_data
r = np.random.RandomState(0)
np.savez("d.npz", x=r.randn(50, 4).astype("float32"), y=r.randint(0, 3, 50))
d = load_data("d.npz")
print("SPLIT", len(d.train), len(d.test), sorted(set(d.train.rows.tolist()) | set(d.test.rows.tolist())) == list(range(50)))
'''


def test_the_train_test_split_needs_no_scikit_learn(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", _SPLIT], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                       timeout=300)
    assert "SPLIT 40 10 True" in r.stdout, r.stdout + r.stderr


def test_the_split_draws_the_rows_scikit_learn_drew():
    """Runs split before ampkit wrote its own split keep their train and test sets."""
    from sklearn.model_selection import train_test_split

    from ampkit.data import split_indices

    r = np.random.RandomState(1)
    for trial in range(60):
        n, seed = int(r.randint(10, 300)), int(r.randint(0, 2**31))
        y = r.randint(0, int(r.randint(2, 9)), n) if trial % 3 else None
        strat = y if y is not None and np.unique(y, return_counts=True)[1].min() >= 2 and np.ceil(0.2 * n) >= len(
            np.unique(y)) else None
        want = train_test_split(np.arange(n), test_size=0.2, random_state=seed, stratify=strat)
        got = split_indices(n, 0.2, seed, y)
        assert all(np.array_equal(a, b) for a, b in zip(want, got)), (n, seed, trial)


def test_no_hint_says_pip_install_ampkit():
    """ampkit is on no package index: every hint installs from the checkout or names the package itself."""
    import re

    found = []
    for base in ("ampkit", "docs"):
        for d, _, names in os.walk(os.path.join(ROOT, base)):
            for n in names:
                if n.endswith((".py", ".md")):
                    text = open(os.path.join(d, n)).read()
                    found += [f"{n}: {m}" for m in re.findall(r"pip install '?ampkit\b[^`\n]*", text)
                              if "finds nothing" not in text[text.find(m):text.find(m) + 40]]
    readme = open(os.path.join(ROOT, "README.md")).read()
    found += re.findall(r"pip install '?ampkit\b[^`\n]*", readme)
    assert not found, found
    assert "pip install '.[data]'" in readme and "pip install ." in readme
