"""docs/INTEGRATIONS.md's accelerate recipe, whole, on 2 gloo processes (accelerate's MULTI_CPU: DDP): the loader,
OneCycleLR and the model prepared by accelerate, ``register_for_checkpointing(precision)``, ``accumulate()``,
accelerate's clip helper, ampkit's backward and step (``ampkit.integrations.accelerate``). Each mode ends with the ranks equal and within twice the
mode's own distance from fp32 of the same steps in one process; ``save_state``/``load_state`` bring the weights
and the precision's state (the loss scale) back on every rank. accelerate's FSDP plugin on CPU processes is
checked to stay DDP (its state switches to FSDP only for the GPU-like device types: docs/DISTRIBUTED.md)."""
import os
import warnings

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")

MODES = ("bf16-master", "fp16-mixed")  # a master mode; a mode with a loss scale for save_state to hold
ACCUM, MICRO, PER_RANK, LR, TOTAL = 2, 8, 4, 1e-2, 16  # 8 micro-batches of 4 samples per rank, windows of 2


def _options(mode):
    """fp16-mixed's scale grows at every clean step, so the state saved differs from a fresh one's."""
    return {"init_scale": 1024.0, "growth_interval": 1} if mode == "fp16-mixed" else {}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def _data():
    g = torch.Generator().manual_seed(1)
    n = 2 * MICRO * PER_RANK
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _recipe(mode, out_dir=None):
    """The recipe as docs/INTEGRATIONS.md writes it (``cpu=True``: CPU processes); returns what it trained."""
    import ampkit
    from ampkit.integrations import accelerate as ampkit_accelerate
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerator = accelerate.Accelerator(cpu=True, mixed_precision="no", gradient_accumulation_steps=ACCUM)
        precision = ampkit.Precision(mode, "cpu", **_options(mode))
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=TOTAL)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=PER_RANK)
        model, optimizer = precision.setup(model, optimizer)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        accelerator.register_for_checkpointing(precision)
        for x, y in loader:
            with accelerator.accumulate(model):
                with precision.autocast():
                    loss = nn.functional.cross_entropy(model(x).float(), y)
                ampkit_accelerate.backward(precision, accelerator, loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                ampkit_accelerate.step(precision, optimizer)
                scheduler.step()
                optimizer.zero_grad()
        out = {"distributed": str(accelerator.distributed_type), "steps": precision.optimizer_steps,
               "skipped": precision.skipped_steps, "scale": precision.loss_scale, "params": _params(model)}
        if out_dir is not None:
            accelerator.save_state(out_dir)
            accelerator.wait_for_everyone()
            with torch.no_grad():  # nothing of the trained state may survive the load
                for p in accelerator.unwrap_model(model).parameters():
                    p.add_(1.0)
            precision.load_state_dict(ampkit.Precision(mode, "cpu", **_options(mode)).state_dict())
            accelerator.load_state(out_dir)
            out["loaded"] = {"params": _params(model), "scale": precision.loss_scale}
    return out


def _params(model):
    inner = getattr(model, "module", model)
    return {n: p.detach().float().clone() for n, p in inner.named_parameters()}


def _one_process(mode):
    """The same steps in one process, no accelerate: each micro-batch is both ranks' samples together (DDP
    averages the two halves' gradients), and the schedule advances once per process at each optimizer step
    (accelerate's ``AcceleratedScheduler`` with ``split_batches=False``)."""
    import ampkit
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # no Accelerator in this process
    GradientState._reset_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precision = ampkit.Precision(mode, "cpu", **_options(mode))
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=TOTAL)
        model, optimizer = precision.setup(model, optimizer)
        x, y = _data()
        for i in range(MICRO):
            xb, yb = x[2 * PER_RANK * i:2 * PER_RANK * (i + 1)], y[2 * PER_RANK * i:2 * PER_RANK * (i + 1)]
            with precision.autocast():
                loss = nn.functional.cross_entropy(model(xb).float(), yb) / ACCUM
            precision.backward(loss)
            if (i + 1) % ACCUM == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                precision.step(optimizer)
                for _ in range(2):
                    scheduler.step()
                optimizer.zero_grad()
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _two_ranks(rank, tmp):
    from distributed_helpers import init_rank, leave_rank

    init_rank(rank, tmp)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1", OMP_NUM_THREADS="1")
    out = {mode: _recipe(mode, out_dir=os.path.join(tmp, f"state-{mode}")) for mode in MODES}
    # accelerate's FSDP plugin on CPU processes: the state stays MULTI_CPU and prepare wraps in DDP
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = accelerate.Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        prepared = acc.prepare(_model())
    out["fsdp_plugin"] = (str(acc.distributed_type), type(prepared).__name__)
    torch.save(out, f"{tmp}/out{rank}.pt")
    leave_rank()  # accelerate's DDP models are alive: no destroy_process_group


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    from distributed_helpers import run_ranks

    tmp = tmp_path_factory.mktemp("accelerate-recipe")
    run_ranks(_two_ranks, str(tmp), timeout=300.0)
    return [torch.load(f"{tmp}/out{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.slow  # 2 processes importing accelerate, 16-bit steps emulated on an AVX2 CPU
@pytest.mark.parametrize("mode", MODES)
def test_the_docs_recipe_on_two_processes_matches_one_process_within_the_modes_noise(two, mode):
    r0, r1 = two[0][mode], two[1][mode]
    assert r0["distributed"].endswith("MULTI_CPU")
    assert r0["steps"] == r1["steps"] == MICRO // ACCUM and r0["skipped"] == r1["skipped"] == 0
    assert r0["scale"] == r1["scale"]
    one, ref = _one_process(mode), _one_process("fp32")
    noise = max((one[k] - ref[k]).abs().max().item() for k in one)
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in one)  # DDP keeps the ranks equal
    assert max((r0["params"][k] - one[k]).abs().max().item() for k in one) <= 2 * noise + 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_save_state_and_load_state_bring_back_weights_and_loss_scale_on_every_rank(two, mode):
    for r in (0, 1):
        got = two[r][mode]
        assert all(torch.equal(got["loaded"]["params"][k], got["params"][k]) for k in got["params"])
        assert got["loaded"]["scale"] == got["scale"]
    if mode == "fp16-mixed":  # grown at each of the 4 clean steps: the state held it, not a fresh scaler
        assert two[0][mode]["scale"] == 1024.0 * 2 ** (MICRO // ACCUM)


@pytest.mark.slow
def test_accelerates_fsdp_plugin_stays_ddp_on_cpu_processes(two):
    assert two[0]["fsdp_plugin"] == two[1]["fsdp_plugin"]
    distributed, wrapper = two[0]["fsdp_plugin"]
    assert distributed.endswith("MULTI_CPU") and wrapper == "DistributedDataParallel"
