"""A save that cannot be written (full disk, read-only or forbidden directory, full disk under
metrics.jsonl): the run stops with exit 2 and one line saying what happened, every checkpoint
already on disk stays byte-for-byte intact, no partial file is left, and ``--resume auto`` later
ends bitwise equal to an uninterrupted run.
"""
import json
import os
import shutil
import stat
import tempfile

import pytest

from ampkit.train.checkpoint import list_checkpoints

from .common import CONFIGS, ckpt_dir, compare_to_reference, file_hashes, temp_files, unloadable_checkpoints


def _one_error_line(stderr):
    errors = [l for l in stderr.splitlines() if l.startswith("ampkit train: error:")]
    assert len(errors) == 1, stderr
    assert "Traceback" not in stderr, stderr
    return errors[0]


@pytest.mark.parametrize("fault,nth,needles", [
    ("enospc", 5, ["could not write checkpoint", "step-00000005.pt", "No space left on device",
                   "earlier checkpoints are intact"]),
    ("enospc-zip", 5, ["could not write checkpoint", "step-00000005.pt", "No space left on device",
                       "earlier checkpoints are intact"]),
    ("readonly", 5, ["could not write checkpoint", "step-00000005.pt", "Read-only file system"]),
    ("metrics-enospc", 9, ["No space left on device", "metrics.jsonl", "checkpoints already written are intact"]),
])
def test_write_failure_keeps_checkpoints_and_explains(fault, nth, needles, forkserver, reference, ledger, tmp_path):
    ref = reference("fp32")
    out, snap = str(tmp_path / "run"), str(tmp_path / "snapshot.json")
    r = forkserver.run(CONFIGS["fp32"] + ["--out", out], fault=fault, nth=nth, env={"AMPKIT_FAULT_SNAPSHOT": snap})
    with ledger.trial("write failure during a run", note=fault) as trial:
        assert r["returncode"] == 2, r["stderr"]
        line = _one_error_line(r["stderr"])
        for needle in needles:
            assert needle in line, line
        before, now = json.load(open(snap)), file_hashes(ckpt_dir(out))
        changed = [f for f, h in before.items() if f.startswith("step-") and now.get(f) != h]
        trial.lost += len(changed)
        assert not changed, f"checkpoints changed or removed by a failed save: {changed}"
        assert not temp_files(out)
        bad = unloadable_checkpoints(out)
        trial.lost += len(bad)
        assert not bad and list_checkpoints(ckpt_dir(out))
        # the disk has room again: the run continues and ends as if nothing happened
        r = forkserver.run(CONFIGS["fp32"] + ["--out", out, "--resume", "auto"])
        assert r["returncode"] == 0, r["stderr"]
        lost, problems = compare_to_reference(out, ref)
        trial.lost += lost
        assert not problems, problems


def test_permission_denied_for_real(forkserver, ledger):
    """A real chmod'ed checkpoint directory (the child drops to uid 65534 when the suite runs as root)."""
    uid = 65534 if os.geteuid() == 0 else None
    base = tempfile.mkdtemp(prefix="ampkit-ro-")
    try:
        os.chmod(base, 0o777)  # reachable by the unprivileged child
        out = os.path.join(base, "run")
        args = CONFIGS["fp32"][:]
        args[args.index("--epochs") + 1] = "1"
        r = forkserver.run(args + ["--out", out], uid=uid)
        if r["returncode"] != 0 and uid is not None and ("ModuleNotFoundError" in r["stderr"] or
                                                         "PermissionError" in r["stderr"]):
            pytest.skip("an unprivileged process cannot read this Python installation")
        assert r["returncode"] == 0, r["stderr"]
        before = file_hashes(ckpt_dir(out))
        os.chmod(ckpt_dir(out), stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        with ledger.trial("write failure during a run", note="permission denied (real chmod 555)") as trial:
            # two more epochs: the first save after resuming hits the read-only directory
            r = forkserver.run(CONFIGS["fp32"] + ["--out", out, "--resume", "auto"], uid=uid)
            assert r["returncode"] == 2, r["stderr"]
            line = _one_error_line(r["stderr"])
            assert "could not write checkpoint" in line and "Permission denied" in line, line
            now = file_hashes(ckpt_dir(out))
            trial.lost += sum(1 for f, h in before.items() if now.get(f) != h)
            assert now == before
            os.chmod(ckpt_dir(out), 0o777)
            r = forkserver.run(CONFIGS["fp32"] + ["--out", out, "--resume", "auto"], uid=uid)
            assert r["returncode"] == 0, r["stderr"]
            assert not unloadable_checkpoints(out) and not temp_files(out)
    finally:
        shutil.rmtree(base, ignore_errors=True)
