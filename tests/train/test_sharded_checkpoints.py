"""Sharded checkpoints (ampkit/train/sharded.py): `ampkit train --strategy fsdp` on 2 gloo ranks writes one
shard per rank; the checkpoint resumes bitwise on 2 ranks (each rank reading only its half), continues on
1 process and on 4 (each reading a quarter), and a single-file checkpoint still resumes under FSDP; a block
model's 2-rank checkpoint loads bitwise into 1 process and into 4 ranks. A damaged shard is one line (exit 2,
on 2 and on 4 ranks); a .metadata that would run code is refused; a kill mid-save leaves the previous
checkpoint loadable. The 4-rank group (one spawn) also trains two modes against one process.
``get_state_dict``/``set_state_dict`` continue every mode bitwise under DDP (one process:
tests/precision/test_dcp_state_dict.py).
"""
import contextlib
import io
import json
import math
import os
import pickle
import shutil
import signal
import zlib

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from ampkit.cli import main
from ampkit.train import sharded
from ampkit.train.checkpoint import (CheckpointError, list_checkpoints, load_checkpoint, remove_partial_writes,
                                     sharded_path)
from dcp_state_helpers import CASES, IDS, continued, equal
from distributed_helpers import init_rank, leave_rank, run_ranks
from train.test_fsdp_modes import _Net, _data, _full, _max_diff, _one_process, _precision, _train

ARGS = ["train", "--data", "digits", "--model", "mlp", "--precision", "fp32", "--save-every", "3", "--keep-last", "5",
        "--no-progress", "--num-threads", "1", "--lr-schedule", "constant", "--seed", "3"]
FSDP = ARGS + ["--strategy", "fsdp", "--batch-size", "32"]


def _quiet(argv):
    """main(argv) -> (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def _flip(path, at=None):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2 if at is None else at] ^= 0x5A
    open(path, "wb").write(bytes(data))


def _worker(rank, tmp):
    init_rank(rank, tmp)
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType

    out = {"full": _quiet(FSDP + ["--max-steps", "6", "--out", f"{tmp}/full"]),
           "part": _quiet(FSDP + ["--max-steps", "3", "--out", f"{tmp}/part"])}
    if rank == 0:  # the 3-step run as it stands, for a resume in one plain process and one on 4 ranks
        shutil.copytree(f"{tmp}/part", f"{tmp}/part-for-one")
        shutil.copytree(f"{tmp}/part", f"{tmp}/part-for-four")
    dist.barrier()
    read, real = [], FileSystemReader.read_data

    def counting(self, plan, planner):  # tensor elements this rank reads from the shards
        read.append(sum(math.prod(r.lengths) for r in plan.items if r.type == LoadItemType.TENSOR))
        return real(self, plan, planner)

    FileSystemReader.read_data = counting
    out["resume"] = _quiet(["train", "--out", f"{tmp}/part", "--resume", "auto", "--max-steps", "6"])
    FileSystemReader.read_data = real
    out["read"] = sum(read)
    # fp8-tensorwise: its Linear weights gathered in fp8 (torchao's weight subclass inside the DTensor shards)
    fp8 = [a for a in FSDP if a != "fp32"]
    fp8[fp8.index("--precision") + 1:fp8.index("--precision") + 1] = ["fp8-tensorwise", "--fp8-filter", "all"]
    out["fp8_full"] = _quiet(fp8 + ["--max-steps", "6", "--out", f"{tmp}/fp8-full"])
    out["fp8_part"] = _quiet(fp8 + ["--max-steps", "3", "--out", f"{tmp}/fp8-part"])
    out["fp8_resume"] = _quiet(["train", "--out", f"{tmp}/fp8-part", "--resume", "auto", "--max-steps", "6"])
    # a single-file checkpoint (one process wrote it) resumes under FSDP
    out["from_single"] = _quiet(FSDP + ["--max-steps", "6", "--out", f"{tmp}/from-single",
                                        "--resume", f"{tmp}/single/checkpoints/step-00000003.pt"])
    # a damaged shard: the same one line on both ranks, exit 2
    if rank == 0:
        shutil.copytree(f"{tmp}/full", f"{tmp}/damaged")
        _flip(f"{tmp}/damaged/checkpoints/step-00000006/__1_0.distcp")
    dist.barrier()
    out["damaged"] = _quiet(["train", "--out", f"{tmp}/damaged", "--resume", "auto", "--max-steps", "9"])
    # a full disk on rank 1 alone: the same one line on both ranks, nothing left behind, no rank left waiting
    from torch.distributed.checkpoint import FileSystemWriter

    real_write = FileSystemWriter.write_data
    if rank == 1:
        def full_disk(self, plan, planner):
            raise OSError(28, "No space left on device")

        FileSystemWriter.write_data = full_disk
    try:
        sharded.save_sharded(*_tiny(), {}, sharded_path(f"{tmp}/full-disk", 1))
        out["full_disk"] = "written"
    except CheckpointError as e:
        out["full_disk"] = str(e)
    FileSystemWriter.write_data = real_write
    # get_state_dict / set_state_dict under DDP, every mode
    from torch.nn.parallel import DistributedDataParallel as DDP

    out["ddp_state_dict"] = {}
    for case, (mode, kw) in zip(IDS, CASES):
        try:
            (ref_model, ref_optim), (model, optim) = continued(mode, kw, wrap=DDP)
            out["ddp_state_dict"][case] = equal(model, ref_model) and equal(optim, ref_optim) or "not bitwise"
        except Exception as e:
            out["ddp_state_dict"][case] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    # a block model sharded per block in two modes, trained and saved: what the resharded loads must give back
    for mode in RESHARD_MODES:
        model, opt, _ = _block_run(mode, rank, 2, steps=2)
        sharded.save_sharded(model, opt, {}, f"{tmp}/blocks-{mode}")
        saved = _full_states(model, opt)
        if rank == 0:
            torch.save(saved, f"{tmp}/blocks-{mode}.pt")
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    leave_rank()  # DDP was used: exit without gloo's destructor


RESHARD_MODES = ("bf16-master", "bf16-pure")
FOUR_MODES = ("bf16-master", "fp16-pure")  # the modes also checked against one process on 4 ranks
# and with --slow, under FSDP2 and DDP: the rest of those with a loss scale, and bf16-pure
MORE_FOUR_MODES = ("fp16-mixed", "fp16-master", "bf16-pure")


def _block_run(mode, rank, world, steps):
    """The block model of tests/train/test_fsdp_modes.py sharded per block (``world`` > 1) or plain, AdamW
    wrapped by ``mode``, ``steps`` steps on this rank's share of the 8-sample batch."""
    import torch.distributed as dist

    from ampkit.train.distributed import shard_fsdp

    torch.manual_seed(0)
    prec = _precision(mode)
    if world > 1 and dist.is_initialized():
        prec._prepare_fsdp()
        model = shard_fsdp(prec.setup(_Net())[0], prec)
        opt = prec.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    else:
        model = _Net()
        model, opt = prec.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    x, y = _data()
    share = len(x) // world
    for _ in range(steps):
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(x[rank * share:(rank + 1) * share]).float(),
                                               y[rank * share:(rank + 1) * share])
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
    return model, opt, prec


def _full_states(model, opt):
    """(model, optimizer) state as full tensors keyed by parameter name, whatever the sharding (collective
    under a process group)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    full = {"model": {k: v.detach().clone() for k, v in msd.items()}, "optimizer": {}}
    for name, st in osd["state"].items():
        full["optimizer"][name] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
    return full


@contextlib.contextmanager
def _counting_reads():
    """Yields a list that receives the tensor elements this rank reads from the shards (DCP's reader patched)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType

    read, real = [], FileSystemReader.read_data

    def counting(self, plan, planner):
        read.append(sum(math.prod(r.lengths) for r in plan.items if r.type == LoadItemType.TENSOR))
        return real(self, plan, planner)

    FileSystemReader.read_data = counting
    try:
        yield read
    finally:
        FileSystemReader.read_data = real


def _four(rank, tmp):
    """4 ranks, one process group: a 2-rank run continued on 4 through the CLI, the 2-rank block checkpoints
    loaded on 4, a damaged shard, and two modes trained on 4 ranks against one process."""
    import torch.distributed as dist

    init_rank(rank, f"{tmp}/four", world=4)
    with _counting_reads() as read:
        out = {"resume": _quiet(["train", "--out", f"{tmp}/four-resume", "--resume", _ck(tmp, "part", 3),
                                 "--strategy", "fsdp", "--batch-size", "16", "--max-steps", "6"])}
    out["read"] = sum(read)
    for mode in RESHARD_MODES:
        model, opt, _ = _block_run(mode, rank, 4, steps=0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # nothing of the fresh run's own weights may survive the load
        sharded.load_sharded(model, opt, sharded.read_checkpoint(f"{tmp}/blocks-{mode}")["sharded"])
        out[f"blocks-{mode}"] = _full_states(model, opt)
    if rank == 0:
        shutil.copytree(f"{tmp}/full", f"{tmp}/damaged4")
        _flip(f"{tmp}/damaged4/checkpoints/step-00000006/__0_0.distcp")
    dist.barrier()
    out["damaged"] = _quiet(["train", "--out", f"{tmp}/damaged4", "--resume", "auto", "--batch-size", "16",
                             "--max-steps", "9"])
    out.update(_four_modes(rank, FOUR_MODES, ("fsdp",)))
    torch.save(out, os.path.join(tmp, f"four{rank}.pt"))
    dist.barrier()  # (every rank done before any closes its connections)
    dist.destroy_process_group()


def _four_modes(rank, modes, strategies):
    """Each mode trained on this rank's quarter of the batch (as tests/train/test_fsdp_modes.py on 2 ranks) under
    each strategy: FSDP2 sharded per block, or DDP after ``setup`` (SGD unfused, as the one-process run)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ampkit.train.distributed import shard_fsdp

    x, y = _data()
    out = {}
    for strategy in strategies:
        for mode in modes:
            torch.manual_seed(0)
            if strategy == "fsdp":
                prec = _precision(mode)
                prec._prepare_fsdp()
                model = shard_fsdp(prec.setup(_Net())[0], prec)
                opt = prec.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
                _train(model, opt, prec, x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2])
            else:
                prec = _precision(mode, strategy="ddp", fused_optimizer=False)
                model = _Net()
                model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
                _train(DDP(model), opt, prec, x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2])
            out[(mode, strategy)] = {"params": _full(model), "skipped": prec.skipped_steps, "scale": prec.loss_scale}
    return out


def _four_more(rank, tmp):
    """The slow 4-rank group: the other modes with a loss scale and bf16-pure under FSDP2, every mode under DDP,
    and a 4-rank FSDP run of 3 steps (4 x 16: the 2-rank run's global batch) that 2 ranks continue."""
    init_rank(rank, f"{tmp}/four-more", world=4)
    out = {"four_part": _quiet(FSDP[:-1] + ["16", "--max-steps", "3", "--out", f"{tmp}/four-part"])}
    out.update(_four_modes(rank, MORE_FOUR_MODES, ("fsdp",)))
    out.update(_four_modes(rank, FOUR_MODES + MORE_FOUR_MODES, ("ddp",)))
    torch.save(out, os.path.join(tmp, f"four-more{rank}.pt"))
    leave_rank()  # DDP was used: exit without gloo's destructor


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("sharded"))
    code, err = _quiet(ARGS + ["--batch-size", "64", "--max-steps", "3", "--out", f"{tmp}/single"])
    assert code == 0, err
    run_ranks(_worker, tmp, timeout=300.0)
    return {"tmp": tmp, "ranks": [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]}


def _on_four_ranks(runs, name, fn, timeout):
    """``fn`` on 4 ranks in ``runs``' folder (its group's store in ``name/``); each rank's ``name{rank}.pt``."""
    tmp = runs["tmp"]
    os.makedirs(f"{tmp}/{name}")
    run_ranks(fn, tmp, timeout=timeout, nprocs=4)
    return [torch.load(os.path.join(tmp, f"{name}{r}.pt"), weights_only=False) for r in range(4)]


@pytest.fixture(scope="module")
def four_more(runs):
    return _on_four_ranks(runs, "four-more", _four_more, 400.0)


@pytest.fixture(scope="module")
def four(runs):
    return _on_four_ranks(runs, "four", _four, 300.0)


def _ck(tmp, run, step):
    return sharded_path(os.path.join(tmp, run, "checkpoints"), step)


_equal = equal


def test_each_rank_writes_its_shard_and_a_resume_on_two_ranks_is_bitwise(runs):
    tmp = runs["tmp"]
    for r in (0, 1):
        for name in ("full", "part", "resume"):
            assert runs["ranks"][r][name][0] == 0, runs["ranks"][r][name][1]
    ck = _ck(tmp, "full", 6)
    assert sorted(os.listdir(ck)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "state.pt"]
    assert json.load(open(os.path.join(ck, "manifest.json")))["world_size"] == 2
    assert [os.path.basename(p) for p in list_checkpoints(os.path.join(tmp, "full", "checkpoints"))] == [
        "step-00000003", "step-00000006"]
    full, resumed = sharded.consolidate(ck), sharded.consolidate(_ck(tmp, "part", 6))
    assert _equal(full["model"], resumed["model"]) and _equal(full["optimizer"], resumed["optimizer"])
    assert _equal(full["precision"], resumed["precision"]) and full["progress"] == resumed["progress"]
    # no rank read the whole state: each read about its half of the tensor elements
    total = sum(t.numel() for t in full["model"].values()) + sum(
        t.numel() for s in full["optimizer"]["state"].values() for t in s.values() if isinstance(t, torch.Tensor))
    reads = [runs["ranks"][r]["read"] for r in (0, 1)]
    assert sum(reads) >= total and max(reads) < 0.7 * total, (reads, total)


def test_fp8_tensorwise_gathered_in_fp8_saves_and_resumes_its_shards_bitwise(runs):
    """``--strategy fsdp --precision fp8-tensorwise``: the weights FSDP gathers in fp8 are torchao's subclass
    inside each DTensor shard; DCP writes and reads them as plain fp32 shards, and a resume on 2 ranks ends
    bitwise where the uninterrupted run ends (the first forward after the load computes the scales the
    uninterrupted run had precomputed)."""
    tmp = runs["tmp"]
    for r in (0, 1):
        for name in ("fp8_full", "fp8_part", "fp8_resume"):
            assert runs["ranks"][r][name][0] == 0, runs["ranks"][r][name][1]
    assert "FSDP2 gathers the fp8 Linears' weights in fp8" in runs["ranks"][0]["fp8_full"][1]
    full, resumed = sharded.consolidate(_ck(tmp, "fp8-full", 6)), sharded.consolidate(_ck(tmp, "fp8-part", 6))
    assert all(v.dtype == torch.float32 for v in full["model"].values())
    assert _equal(full["model"], resumed["model"]) and _equal(full["optimizer"], resumed["optimizer"])


def test_one_process_continues_a_two_rank_checkpoint(runs, tmp_path):
    tmp = runs["tmp"]
    code, err = _quiet(["train", "--out", str(tmp_path / "one"), "--resume", _ck(tmp, "part", 3), "--strategy",
                        "ddp", "--batch-size", "64", "--max-steps", "6"])
    assert code == 0, err
    one = load_checkpoint(str(tmp_path / "one" / "checkpoints" / "step-00000006.pt"))  # one process: one file
    two = sharded.consolidate(_ck(tmp, "full", 6))
    assert one["progress"]["global_step"] == two["progress"]["global_step"] == 6
    for k, v in two["model"].items():  # the same global batch, summed in another order
        torch.testing.assert_close(one["model"][k], v, rtol=1e-5, atol=1e-6)


def _plain_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


def _continued_like_the_full_run(tmp, got):
    """A one-process continuation of the 2-rank run ends where the uninterrupted 2-rank run ends: the same global
    batch, its gradients summed in another order (1e-5)."""
    ref = sharded.consolidate(_ck(tmp, "full", 6))
    assert got["progress"]["global_step"] == ref["progress"]["global_step"] == 6
    for k, v in ref["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=1e-5, atol=1e-6)
    names = [n for g in ref["optimizer"]["param_groups"] for n in g["params"]]
    for i, name in enumerate(n for g in got["optimizer"]["param_groups"] for n in g["params"]):
        for k, v in ref["optimizer"]["state"][names[i]].items():
            torch.testing.assert_close(got["optimizer"]["state"][name][k], v, rtol=1e-4, atol=1e-7)


def test_resume_auto_in_one_plain_process_continues_a_two_rank_fsdp_run(runs, monkeypatch):
    """``ampkit train --out RUN --resume auto`` with no other flag, in one process outside torchrun, for a run
    trained with --strategy fsdp on 2 ranks x 32: it continues unsharded (said in one line) with the global batch
    of 64 in one process, the sharded checkpoint read whole, and ends where the uninterrupted 2-rank run ends."""
    tmp = runs["tmp"]
    _plain_process(monkeypatch)
    code, err = _quiet(["train", "--out", f"{tmp}/part-for-one", "--resume", "auto", "--max-steps", "6"])
    assert code == 0, err
    assert ("continues in this one process unsharded" in err and "--batch-size 32 -> 64 per process" in err
            and "resumed from" in err and "step-00000003" in err), err
    one = load_checkpoint(os.path.join(tmp, "part-for-one", "checkpoints", "step-00000006.pt"))  # one file now
    assert one["config"]["strategy"] == "ddp" and one["config"]["batch_size"] == 64
    assert one["progress"]["world_size"] == 1
    _continued_like_the_full_run(tmp, one)


def test_a_single_file_checkpoint_resumes_under_fsdp(runs):
    for r in (0, 1):
        assert runs["ranks"][r]["from_single"][0] == 0, runs["ranks"][r]["from_single"][1]
    got = sharded.consolidate(_ck(runs["tmp"], "from-single", 6))
    ref = sharded.consolidate(_ck(runs["tmp"], "full", 6))
    for k, v in ref["model"].items():  # 3 of the 6 steps summed in one process: Adam's 1/sqrt(v) amplifies the order
        torch.testing.assert_close(got["model"][k], v, rtol=1e-4, atol=1e-5)


def test_a_write_failing_on_one_rank_fails_on_every_rank_and_leaves_nothing(runs):
    errors = [runs["ranks"][r]["full_disk"] for r in (0, 1)]
    # the run's first checkpoint: no earlier one is promised
    assert errors[0] == errors[1] and "No space left on device; it was the run's first" in errors[0], errors
    assert os.listdir(os.path.join(runs["tmp"], "full-disk")) == []


def test_a_damaged_shard_is_one_line_exit_2_naming_the_earlier_checkpoint(runs):
    (code0, err0), (code1, err1) = (runs["ranks"][r]["damaged"] for r in (0, 1))
    assert code0 == code1 == 2
    lines = [l for l in err0.splitlines() if l.startswith("ampkit train: error:")]
    assert len(lines) == 1 and "Traceback" not in err0, err0
    assert "'__1_0.distcp'" in lines[0] and "CRC-32" in lines[0] and "step-00000003" in lines[0], lines[0]
    assert lines[0].split("error: ")[1] in err1  # the same error on both ranks (none left waiting in a collective)


# ---------------------------------------------------------------------- one process: the files themselves
def _tiny(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if seed == 0:
        model(torch.randn(3, 4)).square().sum().backward()
        opt.step()
    return model, opt


def test_round_trip_in_one_process_is_bitwise(tmp_path):
    model, opt = _tiny()
    path = sharded.save_sharded(model, opt, {"progress": {"epoch": 1}}, sharded_path(str(tmp_path), 7))
    ck = sharded.read_checkpoint(path)
    assert ck["progress"] == {"epoch": 1} and "model" not in ck
    model2, opt2 = _tiny(seed=1)
    sharded.load_sharded(model2, opt2, ck["sharded"])
    assert _equal(model.state_dict(), model2.state_dict()) and _equal(opt.state_dict(), opt2.state_dict())


@pytest.mark.parametrize("damage, said", [
    (lambda p: _flip(os.path.join(p, "__0_0.distcp")), "'__0_0.distcp' do not match their CRC-32"),
    (lambda p: os.truncate(os.path.join(p, "__0_0.distcp"), 10), "'__0_0.distcp' has 10 bytes"),
    (lambda p: os.unlink(os.path.join(p, "__0_0.distcp")), "file '__0_0.distcp' is missing"),
    (lambda p: _flip(os.path.join(p, ".metadata")), "'.metadata' do not match"),
    (lambda p: open(os.path.join(p, "manifest.json"), "w").write("{"), "manifest.json cannot be read"),
])
def test_damage_to_any_file_is_named(tmp_path, damage, said):
    model, opt = _tiny()
    path = sharded.save_sharded(model, opt, {}, sharded_path(str(tmp_path), 1))
    damage(path)
    with pytest.raises(CheckpointError, match=said) as e:
        sharded.load_sharded(*_tiny(seed=1), sharded.read_checkpoint(path)["sharded"])
    assert e.value.damaged


class _RunsCode:
    def __reduce__(self):
        return (exec, ("open(__import__('os').environ['AMPKIT_TEST_MARKER'], 'w').write('ran')",))


def test_metadata_that_would_run_code_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    monkeypatch.setenv("AMPKIT_TEST_MARKER", str(marker))
    model, opt = _tiny()
    path = sharded.save_sharded(model, opt, {}, sharded_path(str(tmp_path), 1))
    meta = os.path.join(path, ".metadata")
    with open(meta, "wb") as f:
        pickle.dump(_RunsCode(), f)
    manifest = json.load(open(os.path.join(path, "manifest.json")))  # checksums that match: only the unpickler guards
    data = open(meta, "rb").read()
    manifest["files"][".metadata"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    json.dump(manifest, open(os.path.join(path, "manifest.json"), "w"))
    with pytest.raises(CheckpointError, match=r"was refused: its .metadata names the Python object builtins.exec"):
        sharded.load_sharded(*_tiny(seed=1), sharded.read_checkpoint(path)["sharded"])
    assert not marker.exists()


def _killed_save(directory, point):
    """Save once more, SIGKILLed at ``point`` of the write."""
    import os as _os

    model, opt = _tiny()
    if point == "mid-shard":
        _os.fsync = lambda fd: _os.kill(_os.getpid(), signal.SIGKILL)  # the shard written, not yet synced
    else:
        _os.rename = lambda *a: _os.kill(_os.getpid(), signal.SIGKILL)  # everything written, before the rename
    sharded.save_sharded(model, opt, {"progress": {"epoch": 2}}, sharded_path(directory, 2))


@pytest.mark.parametrize("point", ["mid-shard", "before-rename"])
def test_a_kill_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, point):
    directory = str(tmp_path)
    model, opt = _tiny()
    first = sharded.save_sharded(model, opt, {"progress": {"epoch": 1}}, sharded_path(directory, 1))
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    p = mp.get_context(method).Process(target=_killed_save, args=(directory, point))
    p.start()
    p.join(120)
    assert p.exitcode == -signal.SIGKILL
    assert list_checkpoints(directory) == [first]  # the torn save is no checkpoint
    assert [n for n in os.listdir(directory) if n.startswith(".tmp-")]
    ck = sharded.read_checkpoint(first)
    model2, opt2 = _tiny(seed=1)
    sharded.load_sharded(model2, opt2, ck["sharded"])
    assert _equal(model.state_dict(), model2.state_dict()) and ck["progress"] == {"epoch": 1}
    remove_partial_writes(directory)
    assert os.listdir(directory) == ["step-00000001"]


def _killed_rank(rank, tmp):
    """The 6-step FSDP run of ``_worker`` on 2 ranks, rank 1 SIGKILLed while it writes its shard of the second
    checkpoint (step 6: its shard file written, nothing of the checkpoint finished)."""
    init_rank(rank, f"{tmp}/kill-store")
    from torch.distributed.checkpoint import FileSystemWriter

    if rank == 1:
        real, calls = FileSystemWriter.write_data, []

        def dying(self, plan, planner):
            calls.append(plan)
            if len(calls) == 2:
                real(self, plan, planner).wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, plan, planner)

        FileSystemWriter.write_data = dying
    try:
        code = main(FSDP + ["--max-steps", "6", "--out", f"{tmp}/killed"])
    except BaseException:  # rank 0: its peer's socket closed under a collective (torchrun would stop it too)
        code = 7
    os._exit(code)


@pytest.fixture(scope="module")
def killed(runs):
    tmp = runs["tmp"]
    os.makedirs(f"{tmp}/kill-store")
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    procs = [mp.get_context(method).Process(target=_killed_rank, args=(r, tmp)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(200)
    for p in procs:
        if p.is_alive():
            p.kill()
    return tmp, [p.exitcode for p in procs]


def test_one_rank_killed_mid_save_leaves_the_previous_checkpoint_and_the_resume_uses_it(killed, monkeypatch):
    """Rank 1 SIGKILLed in the middle of the sharded save at step 6: rank 0 stops (its collective fails: no rank
    waits forever), step 3 stays the latest checkpoint, whole, the torn save only a .tmp directory; the next
    ``--resume auto`` (here one plain process) continues from step 3, removes the torn save, and ends where the
    uninterrupted run ends."""
    tmp, codes = killed
    assert codes[1] == -signal.SIGKILL and codes[0] not in (None, 0), codes
    directory = os.path.join(tmp, "killed", "checkpoints")
    assert [os.path.basename(p) for p in list_checkpoints(directory)] == ["step-00000003"]
    torn = [n for n in os.listdir(directory) if n.startswith(".tmp-step-00000006")]
    assert torn and not os.path.exists(os.path.join(directory, torn[0], "manifest.json"))
    whole = sharded.read_checkpoint(_ck(tmp, "killed", 3))  # every file's CRC-32 checked
    assert whole["progress"]["global_step"] == 3 and whole["sharded"]["world_size"] == 2
    _plain_process(monkeypatch)
    code, err = _quiet(["train", "--out", os.path.join(tmp, "killed"), "--resume", "auto"])
    assert code == 0, err
    assert "resumed from" in err and "step-00000003" in err, err
    assert sorted(os.listdir(directory)) == ["step-00000003", "step-00000006.pt"]  # the torn save removed
    _continued_like_the_full_run(tmp, load_checkpoint(os.path.join(directory, "step-00000006.pt")))


@pytest.mark.parametrize("case", IDS)
def test_get_and_set_state_dict_under_ddp_continue_bitwise(runs, case):
    assert runs["ranks"][0]["ddp_state_dict"][case] is True
    assert runs["ranks"][1]["ddp_state_dict"][case] is True


def test_a_failed_write_changes_nothing(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    model, opt = _tiny()
    first = sharded.save_sharded(model, opt, {}, sharded_path(str(tmp_path), 1))

    def full_disk(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*step-00000002'?: No space left on device; "
                                              "earlier checkpoints are intact"):
        sharded.save_sharded(model, opt, {}, sharded_path(str(tmp_path), 2))
    assert os.listdir(tmp_path) == ["step-00000001"] and list_checkpoints(str(tmp_path)) == [first]


# ---------------------------------------------------------------------- another world size: 1 and 4 processes
def _same_state(got, saved):
    assert got["model"].keys() == saved["model"].keys() and got["optimizer"].keys() == saved["optimizer"].keys()
    for k, v in saved["model"].items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v), k
    for name, st in saved["optimizer"].items():
        assert got["optimizer"][name].keys() == st.keys(), name
        for k, v in st.items():
            same = torch.equal(got["optimizer"][name][k], v) if torch.is_tensor(v) else got["optimizer"][name][k] == v
            assert same, (name, k)


@pytest.mark.parametrize("mode", RESHARD_MODES)
def test_a_two_rank_checkpoint_loads_exactly_in_one_process(runs, mode):
    """Resharded to one process: each weight and each optimizer state (moments, step, bf16-pure's Kahan
    buffers) is bitwise what the two ranks held together when they saved."""
    tmp = runs["tmp"]
    model, opt, _ = _block_run(mode, 0, 1, steps=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    sharded.load_sharded(model, opt, sharded.read_checkpoint(f"{tmp}/blocks-{mode}")["sharded"])
    _same_state(_full_states(model, opt), torch.load(f"{tmp}/blocks-{mode}.pt", weights_only=False))


@pytest.mark.slow  # (one of make test's longest: 15-70 s on 2 cores; make test-slow and CI run it)
@pytest.mark.parametrize("mode", RESHARD_MODES)
def test_a_two_rank_checkpoint_loads_exactly_on_four_ranks(runs, four, mode):
    saved = torch.load(f"{runs['tmp']}/blocks-{mode}.pt", weights_only=False)
    for r in range(4):
        _same_state(four[r][f"blocks-{mode}"], saved)


@pytest.mark.slow  # (one of make test's longest: 15-70 s on 2 cores; make test-slow and CI run it)
def test_the_cli_continues_a_two_rank_run_on_four_ranks(runs, four):
    """``ampkit train --strategy fsdp`` saved on 2 ranks x 32, resumed on 4 ranks x 16 (the same global batch):
    each rank reads its quarter, and the run ends where the uninterrupted 2-rank run ends (the gradients of
    the same samples summed in another order: 1e-5)."""
    tmp = runs["tmp"]
    for r in range(4):
        assert four[r]["resume"][0] == 0, four[r]["resume"][1]
    ck = _ck(tmp, "four-resume", 6)
    assert json.load(open(os.path.join(ck, "manifest.json")))["world_size"] == 4
    assert sorted(f for f in os.listdir(ck) if f.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    got, ref = sharded.consolidate(ck), sharded.consolidate(_ck(tmp, "full", 6))
    assert got["progress"]["global_step"] == ref["progress"]["global_step"] == 6
    total = sum(t.numel() for t in ref["model"].values()) + sum(
        t.numel() for s in ref["optimizer"]["state"].values() for t in s.values() if isinstance(t, torch.Tensor))
    reads = [four[r]["read"] for r in range(4)]
    assert sum(reads) >= total and max(reads) < 0.4 * total, (reads, total)  # each rank about a quarter
    for k, v in ref["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=1e-5, atol=1e-6)
    for name, st in ref["optimizer"]["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(got["optimizer"]["state"][name][k], v, rtol=1e-4, atol=1e-7)


@pytest.mark.slow  # (one of make test's longest: 15-70 s on 2 cores; make test-slow and CI run it)
def test_a_damaged_shard_is_the_same_one_line_on_four_ranks(four):
    errors = [four[r]["damaged"] for r in range(4)]
    assert all(code == 2 for code, _ in errors), errors
    lines = [[l for l in err.splitlines() if l.startswith("ampkit train: error:")] for _, err in errors]
    assert all(len(ls) == 1 for ls in lines) and lines[0][0].count("\n") == 0, lines
    assert "'__0_0.distcp'" in lines[0][0] and "CRC-32" in lines[0][0] and "step-00000003" in lines[0][0], lines[0]
    assert all(ls == lines[0] for ls in lines)  # every rank says it, none left waiting in a collective


def _matches_one_process(ranks, mode, strategy):
    """As the 2-rank test in tests/train/test_fsdp_modes.py: within twice the mode's own one-process distance
    from fp32 (the batch split 4 ways and reduced in another order rounds differently in 16 bits); every rank
    holds the same weights, loss scale and skip count."""
    key = (mode, strategy)
    one, ref = _one_process(mode), _one_process("fp32")
    noise = _max_diff(one, ref)
    for r in range(4):
        assert ranks[r][key]["skipped"] == 0 and ranks[r][key]["scale"] == ranks[0][key]["scale"]
        assert _max_diff(ranks[r][key]["params"], one) <= 2 * noise + 1e-6
        assert all(torch.equal(ranks[0][key]["params"][k], ranks[r][key]["params"][k]) for k in one)


@pytest.mark.slow  # (one of make test's longest: 15-70 s on 2 cores; make test-slow and CI run it)
@pytest.mark.parametrize("mode", FOUR_MODES)
def test_four_ranks_match_one_process_within_the_modes_noise(four, mode):
    _matches_one_process(four, mode, "fsdp")


@pytest.mark.slow
@pytest.mark.parametrize("strategy, mode", [("fsdp", m) for m in MORE_FOUR_MODES] +
                         [("ddp", m) for m in FOUR_MODES + MORE_FOUR_MODES])
def test_four_ranks_match_one_process_in_every_mode_with_a_loss_scale_and_bf16_pure(four_more, strategy, mode):
    _matches_one_process(four_more, mode, strategy)


def _two_from_four(rank, tmp):
    init_rank(rank, f"{tmp}/two-from-four")
    out = _quiet(["train", "--out", f"{tmp}/four-part", "--resume", "auto", "--max-steps", "6"])
    torch.save(out, os.path.join(tmp, f"two-from-four{rank}.pt"))
    import torch.distributed as dist

    dist.barrier()  # (every rank done before any closes its connections)
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_four_rank_run_continues_on_two_ranks(runs, four_more):
    """4 ranks x 16 for 3 steps, then ``--resume auto`` on 2 ranks with no other flag: the batch per rank follows
    (32: the global batch kept, said on stderr), each rank reads its half of the 4 shards, and the run ends
    within 1e-4 of the uninterrupted 2-rank run (3 of its 6 steps summed over 4 ranks: Adam's 1/sqrt(v) amplifies
    the other order, as for a single-file checkpoint continued under FSDP)."""
    tmp = runs["tmp"]
    assert all(four_more[r]["four_part"][0] == 0 for r in range(4)), four_more[0]["four_part"][1]
    os.makedirs(f"{tmp}/two-from-four")
    run_ranks(_two_from_four, tmp, timeout=200.0)
    results = [torch.load(os.path.join(tmp, f"two-from-four{r}.pt")) for r in range(2)]
    assert all(code == 0 for code, _ in results), results[0][1]
    assert "--batch-size 16 -> 32 per process" in results[0][1] and "step-00000003" in results[0][1]
    ck = _ck(tmp, "four-part", 6)
    assert json.load(open(os.path.join(ck, "manifest.json")))["world_size"] == 2
    got, ref = sharded.consolidate(ck), sharded.consolidate(_ck(tmp, "full", 6))
    assert got["progress"]["global_step"] == 6
    for k, v in ref["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=1e-4, atol=1e-5)


def _four_from_two(rank, tmp):
    init_rank(rank, f"{tmp}/four-from-two", world=4)
    with _counting_reads() as read:
        out = _quiet(["train", "--out", f"{tmp}/part-for-four", "--resume", "auto", "--max-steps", "6"])
    torch.save({"result": out, "read": sum(read)}, os.path.join(tmp, f"four-from-two{rank}.pt"))
    import torch.distributed as dist

    dist.barrier()  # (every rank done before any closes its connections)
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_two_rank_run_continues_on_four_ranks_by_resume_auto_alone(runs):
    """2 ranks x 32 for 3 steps, then ``--resume auto`` on 4 ranks with no other flag (the counterpart of the 4 -> 2
    resume above): the batch per rank follows (16: the global batch of 64 kept, said on stderr), each rank
    reads about a quarter of the 2 shards, the checkpoint it writes has 4, and the run ends where the
    uninterrupted 2-rank run ends (the gradients of the same samples summed in another order)."""
    tmp = runs["tmp"]
    os.makedirs(f"{tmp}/four-from-two")
    run_ranks(_four_from_two, tmp, timeout=300.0, nprocs=4)
    ranks = [torch.load(os.path.join(tmp, f"four-from-two{r}.pt")) for r in range(4)]
    assert all(r["result"][0] == 0 for r in ranks), ranks[0]["result"][1]
    err = ranks[0]["result"][1]
    assert "--batch-size 32 -> 16 per process" in err and "step-00000003" in err, err
    ck = _ck(tmp, "part-for-four", 6)
    assert json.load(open(os.path.join(ck, "manifest.json")))["world_size"] == 4
    assert sorted(f for f in os.listdir(ck) if f.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    ref = sharded.consolidate(_ck(tmp, "full", 6))
    total = sum(t.numel() for t in ref["model"].values()) + sum(
        t.numel() for s in ref["optimizer"]["state"].values() for t in s.values() if isinstance(t, torch.Tensor))
    reads = [r["read"] for r in ranks]
    assert sum(reads) >= total and max(reads) < 0.4 * total, (reads, total)  # each rank about a quarter
    got = sharded.consolidate(ck)
    assert got["config"]["batch_size"] == 16 and got["progress"]["world_size"] == 4
    _continued_like_the_full_run(tmp, got)
