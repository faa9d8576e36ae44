"""A checkpoint crafted to run code when unpickled is refused, and no code runs.

Each payload would create a marker file when unpickled. The test first resumes from it (one
error line, the marker never appears, the run directory is unchanged), then proves the payload
is live by unpickling it the unsafe way (weights_only=False / pickle.load), which does create
the marker: so the refusal, not a dud payload, is what kept the code from running.
"""
import os
import pickle
import shutil

import pytest
import torch

from ampkit.cli import main
from ampkit.train.checkpoint import CheckpointError, list_checkpoints, load_checkpoint

from .common import CONFIGS, ckpt_dir, tree_bytes


class _Exec:
    """Unpickling this calls exec(code): arbitrary Python."""

    def __init__(self, marker):
        self.code = f"open({marker!r}, 'w').write('code ran')"

    def __reduce__(self):
        return exec, (self.code,)


class _System:
    """Unpickling this calls os.system(cmd): arbitrary shell."""

    def __init__(self, marker):
        self.cmd = f"touch '{marker}'"

    def __reduce__(self):
        return os.system, (self.cmd,)


def _inside_checkpoint(real, payload):
    ck = torch.load(real, weights_only=True)
    ck["config"] = payload  # a legit-looking ampkit checkpoint with one poisoned entry
    return ck


WRITERS = {
    "exec in an ampkit checkpoint": lambda path, real, m: torch.save(_inside_checkpoint(real, _Exec(m)), path),
    "os.system as the whole file": lambda path, real, m: torch.save(_System(m), path),
    "exec, legacy torch format": lambda path, real, m: torch.save(
        _inside_checkpoint(real, _Exec(m)), path, _use_new_zipfile_serialization=False),
    "exec, plain pickle file": lambda path, real, m: open(path, "wb").write(pickle.dumps(_Exec(m))),
}


@pytest.mark.parametrize("kind", list(WRITERS))
def test_code_executing_checkpoint_is_refused(kind, reference, tmp_path, capsys, ledger):
    run = str(tmp_path / "run")
    shutil.copytree(reference("fp32")["out"], run)
    marker = str(tmp_path / "marker")
    real = list_checkpoints(ckpt_dir(run))[-1]
    evil = os.path.join(ckpt_dir(run), "step-00000099.pt")  # the newest: --resume auto picks it
    WRITERS[kind](evil, real, marker)
    before = tree_bytes(run)
    with ledger.trial("code-executing checkpoint refused", note=kind):
        code = main(CONFIGS["fp32"] + ["--out", run, "--resume", "auto"])
        err = capsys.readouterr().err
        ran = os.path.exists(marker)
        ledger.counters["code executed from a checkpoint"] += int(ran)
        assert not ran, "the checkpoint's code ran"
        errors = [l for l in err.splitlines() if l.startswith("ampkit train: error:")]
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
        assert repr(evil) in errors[0] and "refused" in errors[0] and "nothing was executed" in errors[0]
        assert tree_bytes(run) == before
        # protocol-2 pickles (torch.save) reach the forbidden global; a protocol-4 pickle is stopped sooner
        reason = "would run code when unpickled" if kind != "exec, plain pickle file" else "safe \\(weights_only\\) loader refused it"
        with pytest.raises(CheckpointError, match=reason):
            load_checkpoint(evil)
        assert not os.path.exists(marker)
    # control: the payload is live; unpickled the unsafe way it does run
    if kind == "exec, plain pickle file":
        with open(evil, "rb") as f:
            pickle.load(f)
    else:
        torch.load(evil, weights_only=False)
    assert os.path.exists(marker), "the payload is a dud: this test would prove nothing"
    ledger.counters["payloads proven live (would have run code)"] += 1
