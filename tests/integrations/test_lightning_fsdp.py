"""ampkit's Lightning plugins under FSDP2 on 2 gloo processes: the Trainer with ``ModelParallelStrategy`` (the
module sharded in ``configure_model`` by ``plugin.shard``) and Fabric with ``ModelParallelStrategy(parallelize_fn=
plugin.shard)``, each mode against the same global batch in one process within the mode's noise (as
tests/train/test_fsdp_modes.py); the Trainer's sharded checkpoint resumes bf16-pure bit for bit. Lightning's ``strategy="fsdp"`` is FSDP1, which Lightning and torch run on CUDA
only (docs/DISTRIBUTED.md, "Lightning")."""
import functools
import os
import warnings

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")
pytest.importorskip("torch.distributed.fsdp")

from distributed_helpers import init_rank, leave_rank, run_ranks  # noqa: E402
from train.test_fsdp_modes import STEPS, _Net, _data, _full, _max_diff, _one_process  # noqa: E402

TRAINER_MODES = ("bf16-master", "bf16-pure", "fp16-pure")
FABRIC_MODES = ("bf16-master", "bf16-pure")
# the rest of what FSDP2 takes, both engines (slow: tests/train/test_fsdp_modes.py covers them without Lightning)
MORE_MODES = ("fp32", "bf16-mixed", "fp16-mixed", "fp16-master", "fp8-tensorwise", "fp8-rowwise", "fp8-delayed")
_one = functools.lru_cache(maxsize=None)(_one_process)  # each mode's one-process run once per module


def _plugin(cls, mode):  # as tests/train/test_fsdp_modes.py's _precision: its one-process runs are the reference
    return cls(mode, "cpu", **({"init_scale": 1024.0} if "fp16" in mode else {}),
               **({"fp8_filter": "ends"} if mode.startswith("fp8") else {}))


class _Module(L.LightningModule):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = _Net()

    def configure_model(self):
        self.trainer.precision_plugin.shard(self.net, self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _strategy(**kwargs):
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, **kwargs)


def _trainer(mode, steps=STEPS, save=None, resume=None, seed=0, cls=_Module):
    """``steps`` steps (from the checkpoint ``resume``), then the checkpoint ``save`` if given."""
    from ampkit.integrations.lightning import AmpkitPrecision

    plugin = _plugin(AmpkitPrecision, mode)
    # each rank's 4 samples are one batch: every step is the 8-sample batch of the one-process run
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=_strategy(), plugins=plugin, max_steps=steps,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    module = cls(seed)
    trainer.fit(module, data, ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)  # Lightning's sharded (DCP) checkpoint: each rank its shard
    return {"params": _full(module.net), "skipped": plugin.skipped_steps, "steps": plugin.optimizer_steps,
            "dtypes": {n: p.dtype for n, p in module.net.named_parameters()}}


def _fabric(mode, rank, steps=STEPS, save=None, resume=None, seed=0):
    """``steps`` steps (from ``fabric.load(resume)``), then ``fabric.save(save)`` if given."""
    from lightning.fabric.strategies import ModelParallelStrategy

    from ampkit.integrations.lightning import AmpkitFabricPrecision

    plugin = _plugin(AmpkitFabricPrecision, mode)
    fabric = L.Fabric(accelerator="cpu", devices=2, plugins=plugin, strategy=ModelParallelStrategy(
        parallelize_fn=plugin.shard, data_parallel_size=2, tensor_parallel_size=1))
    fabric.launch()
    torch.manual_seed(seed)
    model = fabric.setup_module(_Net())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume:
        plugin.prepare_optimizer(optimizer)  # set up by setup_optimizers: prepared before the load
        fabric.load(resume, state)
    x, y = _data()
    for _ in range(state["step"], steps):
        # the loss in fp32, as the one-process reference computes it (an fp16 model's logits: fp16 otherwise)
        loss = nn.functional.cross_entropy(model(x[rank * 4:(rank + 1) * 4]).float(), y[rank * 4:(rank + 1) * 4])
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    if save:
        fabric.save(save, {**state, "step": steps})  # DCP shards: model, the optimizer ampkit steps, its state
    return {"params": _full(model.module), "skipped": plugin.skipped_steps, "steps": plugin.optimizer_steps}


def _join(rank, tmp):
    init_rank(rank, tmp)  # Lightning finds the group initialised and joins it
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")


def _ranks(rank, tmp):
    _join(rank, tmp)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in TRAINER_MODES:
            out[("trainer", mode)] = _trainer(mode)
        # bf16-pure stopped at step 2 and resumed from Lightning's checkpoint (Kahan buffers in the shards)
        _trainer("bf16-pure", steps=2, save=f"{tmp}/ckpt")
        out["resumed"] = _trainer("bf16-pure", resume=f"{tmp}/ckpt", seed=1)  # other weights until the load
        for mode in FABRIC_MODES:
            out[("fabric", mode)] = _fabric(mode, rank)
        _fabric("bf16-pure", rank, steps=2, save=f"{tmp}/fabric-ckpt")
        out["fabric-resumed"] = _fabric("bf16-pure", rank, resume=f"{tmp}/fabric-ckpt", seed=1)
        try:  # a parameter outside the module given to plugin.shard: one line, before any step
            _trainer("bf16-master", cls=_WithExtra)
            out["outside"] = "trained"
        except ValueError as e:
            out["outside"] = str(e)
        try:  # shards made by fully_shard alone: a pure mode cannot cast them, and says how to shard
            _trainer("bf16-pure", cls=_ShardedByHand)
            out["plain"] = "trained"
        except ValueError as e:
            out["plain"] = str(e)
    torch.save(out, f"{tmp}/out{rank}.pt")
    leave_rank()


class _WithExtra(_Module):
    def __init__(self, seed=0):
        super().__init__(seed)
        self.extra = nn.Parameter(torch.zeros(3))


class _ShardedByHand(_Module):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        for block in self.net.blocks:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lightning_fsdp")
    run_ranks(_ranks, str(tmp), timeout=240)
    return [torch.load(f"{tmp}/out{r}.pt", weights_only=False) for r in (0, 1)]


def _matches_one_process(r0, r1, mode):
    """Rank 0's run within twice the mode's noise (its one-process distance from fp32) of one process, every
    step taken, both ranks one model; returns the one-process weights and the noise."""
    one = _one(mode)
    noise = _max_diff(one, _one("fp32"))
    assert r0["skipped"] == 0 and r0["steps"] == STEPS
    assert _max_diff(r0["params"], one) <= 2 * noise + 1e-6
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in one)  # ranks hold one model
    return one, noise


@pytest.mark.parametrize("engine, mode", [("trainer", m) for m in TRAINER_MODES] + [("fabric", m) for m in FABRIC_MODES])
def test_lightning_model_parallel_matches_one_process_within_the_modes_noise(ranks, engine, mode):
    one, noise = _matches_one_process(ranks[0][(engine, mode)], ranks[1][(engine, mode)], mode)
    untrained = _full(_Net()) if torch.manual_seed(0) is not None else None
    assert _max_diff(one, untrained) > 3 * noise  # the bound is below what the updates moved


def test_trainer_keeps_the_modes_dtypes_under_fsdp(ranks):
    for mode in TRAINER_MODES:
        dtypes = ranks[0][("trainer", mode)]["dtypes"]
        assert dtypes["blocks.0.ln.weight"] == torch.float32
        low = torch.float16 if "fp16" in mode else torch.bfloat16
        assert dtypes["blocks.0.fc.weight"] == (low if "pure" in mode else torch.float32)


def test_a_pure_mode_on_shards_made_by_fully_shard_says_how_to_shard(ranks):
    for r in (0, 1):
        said = ranks[r]["plain"]
        assert "precision_plugin.shard(module" in said and "instead of fully_shard" in said, said


@pytest.mark.parametrize("engine", ["trainer", "fabric"])
def test_bf16_pure_resumes_from_the_engines_sharded_checkpoint_bitwise(ranks, engine):
    """``trainer.save_checkpoint`` / ``fabric.save`` under ModelParallelStrategy write DCP shards of the model and of
    the optimizer ampkit steps (the compensated one, its Kahan buffers); ``fit(ckpt_path=...)`` / ``fabric.load``
    into a run started from other weights continue bit for bit."""
    for r in (0, 1):
        whole = ranks[r][(engine, "bf16-pure")]["params"]
        resumed = ranks[r]["resumed" if engine == "trainer" else "fabric-resumed"]["params"]
        assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_lightnings_fsdp1_strategy_takes_only_its_own_plugin():
    """What docs/DISTRIBUTED.md says of ``strategy="fsdp"``: Lightning's FSDP1 strategy refuses any precision
    plugin but its FSDPPrecision (and needs CUDA), so ampkit's modes go through ModelParallelStrategy."""
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
    from lightning.pytorch.strategies import FSDPStrategy

    from ampkit.integrations.lightning import AmpkitFabricPrecision, AmpkitPrecision

    with pytest.raises(TypeError, match="FSDPPrecision"):
        FSDPStrategy(precision_plugin=AmpkitPrecision("bf16-master", "cpu"))
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        L.Trainer(accelerator="cpu", devices=1, strategy="fsdp", plugins=AmpkitPrecision("bf16-master", "cpu"))
    with pytest.raises(TypeError, match="FSDPPrecision"):  # Fabric's FSDP1 strategy alike
        FabricFSDPStrategy(precision=AmpkitFabricPrecision("bf16-master", "cpu"))
    with pytest.raises(ValueError, match="FSDP is only available on GPU"):
        L.Fabric(accelerator="cpu", devices=1, strategy="fsdp", plugins=AmpkitFabricPrecision("bf16-master", "cpu"))


def test_a_parameter_outside_the_sharded_module_is_one_line(ranks):
    for r in (0, 1):
        said = ranks[r]["outside"]
        assert "1 parameters lie outside it ('extra', ...)" in said and "shard the module that holds" in said, said


@pytest.mark.cpu_caps("amx")  # a CPU where the rule puts 16-bit conv weights in channels_last
def test_shard_refuses_weights_fabric_put_in_channels_last():
    """Fabric converts before its parallelize_fn: a conv model the rule put in channels_last (CPU, 16-bit compute)
    cannot be sharded, and ``shard`` says how to avoid it, before any collective."""
    from ampkit.integrations.lightning import AmpkitFabricPrecision

    plugin = AmpkitFabricPrecision("bf16-master", "cpu")
    model = plugin.convert_module(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)))
    assert not all(p.is_contiguous() for p in model.parameters())
    with pytest.raises(ValueError, match="channels_last=False"):
        plugin.shard(model)


def _more_ranks(rank, tmp):
    _join(rank, tmp)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in MORE_MODES:
            out[("trainer", mode)] = _trainer(mode)
            out[("fabric", mode)] = _fabric(mode, rank)
    torch.save(out, f"{tmp}/out{rank}.pt")
    leave_rank()


@pytest.fixture(scope="module")
def more_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lightning_fsdp_more")
    run_ranks(_more_ranks, str(tmp), timeout=600)
    return [torch.load(f"{tmp}/out{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["trainer", "fabric"])
@pytest.mark.parametrize("mode", MORE_MODES)
def test_every_other_fsdp2_mode_through_lightning_matches_one_process(more_ranks, engine, mode):
    """The modes the fast tests above leave out (fp32, the autocast modes with and without a loss scale,
    fp16-master, the three fp8 recipes), through the Trainer's and Fabric's ModelParallelStrategy with ampkit's
    plugins: the same global batch as one process within the mode's noise, both ranks one model."""
    _matches_one_process(more_ranks[0][(engine, mode)], more_ranks[1][(engine, mode)], mode)
