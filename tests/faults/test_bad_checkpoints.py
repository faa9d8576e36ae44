"""Truncated, corrupted, foreign, wrong-version and wrong-model checkpoints.

Each is refused with exit 2 and one line that names the file and what is wrong, and nothing in
the run directory changes (byte-for-byte). Where the run holds an earlier checkpoint the line
names it, and resuming from it ends bitwise equal to an uninterrupted run.
"""
import os
import random
import shutil

import pytest
import torch

from ampkit.cli import main
from ampkit.train.checkpoint import list_checkpoints

from .common import CONFIGS, ckpt_dir, compare_to_reference, tree_bytes


@pytest.fixture
def run_copy(reference, tmp_path):
    """A finished fp32 run (latest checkpoint step 46, an earlier one at step 45) to damage."""
    out = str(tmp_path / "run")
    shutil.copytree(reference("fp32")["out"], out)
    return out


def _refused(capsys, argv, run_dir):
    before = tree_bytes(run_dir)
    code = main(argv)
    err = capsys.readouterr().err
    errors = [l for l in err.splitlines() if l.startswith("ampkit train: error:")]
    assert code == 2, err
    assert len(errors) == 1 and "Traceback" not in err, err
    after = tree_bytes(run_dir)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    return errors[0], changed


def _truncate(path, n):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: n if n >= 0 else len(data) + n])


def _flip(path, where):
    data = bytearray(open(path, "rb").read())
    if where == "pickle":
        at = 200  # inside archive/data.pkl, the first member
    elif where == "tensor":
        at = len(data) // 2  # inside a weight or Adam moment
    else:
        at = len(data) - 22  # the zip's end-of-central-directory record
    data[at] ^= 0x5A
    open(path, "wb").write(bytes(data))


DAMAGE = {
    "empty": (lambda p: _truncate(p, 0), "is empty (0 bytes)"),
    "truncated-64-bytes": (lambda p: _truncate(p, 64), "corrupt or truncated"),
    "truncated-half": (lambda p: _truncate(p, os.path.getsize(p) // 2), "corrupt or truncated"),
    "truncated-last-byte": (lambda p: _truncate(p, -1), "corrupt or truncated"),
    "bit-flip-pickle": (lambda p: _flip(p, "pickle"), "corrupt"),
    "bit-flip-tensor-data": (lambda p: _flip(p, "tensor"), "CRC-32"),
    "bit-flip-end-of-directory": (lambda p: _flip(p, "directory"), "corrupt"),
    "random-bytes": (lambda p: open(p, "wb").write(random.Random(0).randbytes(4096)), "corrupt"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_latest_checkpoint(damage, run_copy, capsys, ledger, reference):
    latest, earlier = list_checkpoints(ckpt_dir(run_copy))[-2:][::-1]
    apply, needle = DAMAGE[damage]
    apply(latest)
    with ledger.trial("damaged or foreign checkpoint refused", note=damage) as trial:
        line, changed = _refused(capsys, CONFIGS["fp32"] + ["--out", run_copy, "--resume", "auto"], run_copy)
        trial.lost += len(changed)
        assert not changed, f"a refused resume changed files: {changed}"
        assert repr(latest) in line and needle in line, line
        assert f"An earlier checkpoint is {earlier!r}" in line, line
        if damage in ("truncated-half", "bit-flip-tensor-data"):
            # the advice works: continuing from the earlier checkpoint ends as if nothing happened
            os.unlink(latest)
            assert main(CONFIGS["fp32"] + ["--out", run_copy, "--resume", earlier]) == 0
            lost, problems = compare_to_reference(run_copy, reference("fp32"))
            trial.lost += lost
            assert not problems, problems


def _rewrite(path, **changes):
    ck = torch.load(path, weights_only=True)
    for k, v in changes.items():
        if v is None:
            ck.pop(k, None)
        else:
            ck[k] = v
    torch.save(ck, path)


@pytest.mark.parametrize("case,edit,needle", [
    ("version 2", lambda p: _rewrite(p, version=2), "has format version 2; this ampkit reads version 1"),
    ("version 0", lambda p: _rewrite(p, version=0), "has format version 0; this ampkit reads version 1"),
    ("no version", lambda p: _rewrite(p, version=None), "has no format version; this ampkit reads version 1"),
    ("not ampkit", lambda p: torch.save({"net.0.weight": torch.zeros(3)}, p), "is not an ampkit checkpoint"),
    ("no model", lambda p: _rewrite(p, model=None), "has no 'model' entry"),
    ("no progress", lambda p: _rewrite(p, progress=None, rng=None), "has no 'progress', 'rng' entry"),
])
def test_foreign_or_other_version_checkpoint(case, edit, needle, run_copy, capsys, ledger):
    latest = list_checkpoints(ckpt_dir(run_copy))[-1]
    edit(latest)
    with ledger.trial("damaged or foreign checkpoint refused", note=case) as trial:
        line, changed = _refused(capsys, CONFIGS["fp32"] + ["--out", run_copy, "--resume", "auto"], run_copy)
        trial.lost += len(changed)
        assert not changed
        assert repr(latest) in line and needle in line, line
        assert "An earlier checkpoint" not in line  # it would fail the same way


@pytest.mark.parametrize("case,flags,needle", [
    ("other model", ["--model", "cnn"], "is from a different model (first difference: checkpoint net.0.weight"),
    ("other precision", ["--precision", "bf16-mixed"], "trained in precision fp32, this run asks for bf16-mixed"),
    ("other batch size", ["--batch-size", "32"], "global batch of 64 (batch_size=64 x 1 process(es)), this run has 32"),
    ("other seed", ["--seed", "4"], "was written with seed=3, this run has seed=4"),
    ("other accumulation", ["--grad-accum", "2"], "was written with grad_accum=1"),
    ("other optimizer", ["--optimizer", "sgd"], "was written with optimizer='adamw'"),
    # the MLP built for `images` has the digits MLP's shapes: only the config check sees it
    ("other data", ["--data", "images", "--model", "mlp"], "was written with data='digits', this run has data='images'"),
])
def test_checkpoint_of_another_run_setup(case, flags, needle, run_copy, capsys, ledger):
    latest = list_checkpoints(ckpt_dir(run_copy))[-1]
    argv = CONFIGS["fp32"][:]
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    with ledger.trial("damaged or foreign checkpoint refused", note=case) as trial:
        line, changed = _refused(capsys, argv + ["--out", run_copy, "--resume", "auto"], run_copy)
        trial.lost += len(changed)
        assert not changed
        assert repr(latest) in line and needle in line, line
        assert "An earlier checkpoint" not in line  # it would fail the same way


def test_resume_from_a_directory_or_missing_file(run_copy, capsys, tmp_path):
    line, changed = _refused(capsys, CONFIGS["fp32"] + ["--out", str(tmp_path / "new"), "--resume", run_copy], run_copy)
    assert "is a directory" in line and "--resume auto" in line and not changed
    missing = os.path.join(ckpt_dir(run_copy), "step-00000999.pt")
    line, changed = _refused(capsys, CONFIGS["fp32"] + ["--out", str(tmp_path / "new2"), "--resume", missing], run_copy)
    assert repr(missing) in line and "does not exist" in line and not changed
