"""Every ampkit precision mode in Lightning (the ``lightning`` package): Fabric and Trainer plugins.

.. code-block:: python

    from ampkit.integrations.lightning import AmpkitPrecision, AmpkitFabricPrecision

    trainer = lightning.Trainer(plugins=AmpkitPrecision("bf16-master"))          # or "bf16-true", "16-mixed", ...
    fabric = lightning.Fabric(plugins=AmpkitFabricPrecision("bf16-pure", compensation="stochastic"))

Both take an ampkit mode or any alias (Lightning's strings too: ``"16-mixed"``, ``"bf16-mixed"``,
``"bf16-true"`` (= bf16-pure, with Kahan-compensated updates), ``"16-true"``, ``"32-true"``, and
``16``/``"16"``/``"bf16"``/``32``) plus :class:`ampkit.Precision`'s keyword arguments (``loss_scale``
static or dynamic, ``init_scale``, ``max_consecutive_skips``, ``fp32_modules``, ``compensation``, ...).
They are built on ampkit's public ``Precision`` API: ``setup`` converts the module, ``autocast`` is
the forward context, ``backward`` scales, ``unscale_``/``step`` unscale, skip non-finite steps and
update the scale. Modes that change the optimizer get it changed once: fp32 master weights
(fp16/bf16-master; the masters start from the fp32 weights the module had before conversion) or the
compensated optimizer of bf16-pure. Skip telemetry: ``plugin.skipped_steps``, ``plugin.loss_scale``,
``plugin.optimizer_steps``; the Trainer plugin saves the scaler (and counters) in checkpoints.

Fabric: outputs come back in fp32 (``torch.get_default_dtype()``) in every 16-bit mode, as Lightning's own
plugins return them, so a loss computed after the forward is fp32. The optimizers given to ``fabric.setup``
are prepared there, and what their ``state_dict()`` returns (so what ``fabric.save`` writes) is the state of
the optimizer ampkit steps (fp32 masters, moments, Kahan buffers, rounding noise) plus the precision's own
(mode, loss scale and its counters) under ``"ampkit_precision"``; ``fabric.load`` (their ``load_state_dict``)
restores both. ``plugin.fp32_state_dict(model)`` is the full-precision export (masters, Kahan-folded weights).

FSDP: Lightning's FSDP2 route, ``ModelParallelStrategy``, with ``plugin.shard`` sharding the model the way the mode
needs (every mode but fp8-delayed): in ``configure_model`` (Trainer,
``self.trainer.precision_plugin.shard(self.net, self.device_mesh["data_parallel"])``) or as the Fabric strategy's
``parallelize_fn``. ``strategy="fsdp"`` is FSDP1, which accepts only Lightning's ``FSDPPrecision`` and which
Lightning and torch run on CUDA only (docs/DISTRIBUTED.md).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

try:
    from lightning.fabric import Fabric as _Fabric
    from lightning.fabric.wrappers import _FabricOptimizer
    from lightning.fabric.plugins.precision import Precision as _FabricPrecision
    from lightning.pytorch.plugins.precision import Precision as _TrainerPrecision
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("ampkit.integrations.lightning needs the `lightning` package: "
                      "pip install lightning (or, in ampkit's checkout, pip install '.[lightning]').") from e

from ..precision import Precision, resolve
from ..utils.tree import cast_floating

__all__ = ["AmpkitPrecision", "AmpkitFabricPrecision", "lightning_precision_name", "PRECISION_KEY"]

#: where the precision's own state (mode, loss scale, counters) travels in a Fabric optimizer's ``state_dict``
PRECISION_KEY = "ampkit_precision"

# Lightning's short spellings (its _PRECISION_INPUT_STR_ALIAS_CONVERSION) -> the strings ampkit resolves
_SHORT = {"16": "16-mixed", "32": "32-true", "bf16": "bf16-mixed"}
# what Lightning reports as `trainer.precision` for each ampkit mode (parameter dtype, then compute)
_LIGHTNING_NAME = {"fp32": "32-true", "fp16-mixed": "16-mixed", "bf16-mixed": "bf16-mixed", "fp16-master": "16-true",
                   "bf16-master": "bf16-true", "bf16-pure": "bf16-true", "fp16-pure": "16-true"}


def lightning_precision_name(precision: Any) -> str:
    """An ampkit mode name or alias (Lightning's precision strings and ints accepted) -> ampkit's canonical name."""
    key = str(precision).strip().lower()
    if key in ("64", "64-true", "transformer-engine", "transformer-engine-float16"):
        raise ValueError(f"precision={precision!r} is a Lightning mode ampkit does not provide: use Lightning's own "
                         "plugin for it, or an ampkit mode (fp32, 16-mixed, bf16-mixed, fp16-master, bf16-master, "
                         "bf16-true/bf16-pure, 16-true/fp16-pure, auto).")
    return resolve(_SHORT.get(key, key))


class _Core:
    """The shared part: one ampkit Precision, the module conversion and the once-per-optimizer change."""

    def _init_core(self, precision: Any, device: Any, kwargs: Dict[str, Any]) -> None:
        # Lightning builds and steps the optimizer: its kernel stays the one the user chose (as Lightning's own
        # plugins leave it) unless fused_optimizer=True is given
        self.ampkit = Precision(lightning_precision_name(precision), device, **{"fused_optimizer": False, **kwargs})
        self.precision = _LIGHTNING_NAME.get(self.ampkit.name, "bf16-mixed" if self.ampkit.fp8 is not None
                                             else "32-true")  # fp8 modes: fp32 params, bf16-mixed around fp8 GEMMs
        self._prepared: Dict[int, torch.optim.Optimizer] = {}
        self._converted: set = set()  # ids of the modules converted, and of those `shard` sharded
        self._sharded: set = set()

    # -- telemetry
    @property
    def skipped_steps(self) -> int:
        return self.ampkit.skipped_steps

    @property
    def optimizer_steps(self) -> int:
        return self.ampkit.optimizer_steps

    @property
    def loss_scale(self) -> float:
        return self.ampkit.loss_scale

    # -- module
    def convert_module(self, module: nn.Module) -> nn.Module:
        sharded = [m for m in module.modules() if id(m) in self._sharded]
        if sharded:  # converted and sharded by `shard` (in configure_model): the rest must be inside it
            _check_covered(module, sharded)
            return module
        try:
            module = self.ampkit.convert_module(module)
        except ValueError as e:
            if "fully_shard" not in str(e):
                raise
            raise ValueError(f"precision={self.ampkit.name!r} casts the parameters, which fully_shard already "
                             "sharded: in configure_model, shard with self.trainer.precision_plugin.shard(module, "
                             "self.device_mesh['data_parallel']) instead of fully_shard (Fabric: "
                             "ModelParallelStrategy(parallelize_fn=plugin.shard)).") from e
        self._converted.add(id(module))
        return module

    def shard(self, module: nn.Module, mesh: Any = None) -> nn.Module:
        """FSDP2 for Lightning's ``ModelParallelStrategy``, every mode: ``module`` converted (unless this plugin
        converted it already: Fabric converts before its ``parallelize_fn``) and then ``fully_shard`` per block
        and root with the mode's policy, the modules the mode keeps fp32 as fp32 groups of their own
        (ampkit's FSDP sharding), ranks starting from rank 0's weights. ``mesh``: the strategy's
        ``device_mesh["data_parallel"]`` (the whole mesh: its data-parallel part; default: every rank). Trainer: call it in ``configure_model``;
        Fabric: ``ModelParallelStrategy(parallelize_fn=plugin.shard)``. Returns ``module``, sharded in place."""
        import torch.distributed as dist

        from ..precision.sharding import shard_units

        self.ampkit._prepare_fsdp()  # the kind's FSDP check, contiguous parameters
        if id(module) not in self._converted:
            module = _Core.convert_module(self, module)
        elif any(not p.is_contiguous() for p in module.parameters()):  # Fabric converted it first
            raise ValueError("plugin.shard: the module's weights were put in channels_last, which FSDP cannot shard: "
                             "build the plugin with channels_last=False.")
        if mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.ampkit.device.type, (dist.get_world_size(),))
        elif mesh.ndim > 1:  # Fabric passes ModelParallelStrategy's whole mesh: shard over its data-parallel part
            if "data_parallel" not in (mesh.mesh_dim_names or ()):
                raise ValueError(f"plugin.shard: the mesh has {mesh.ndim} dimensions and none named 'data_parallel': "
                                 "pass the data-parallel mesh (mesh['data_parallel']).")
            mesh = mesh["data_parallel"]
        group = mesh.get_group()
        with torch.no_grad():  # FSDP does not broadcast, unlike DDP
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, group=group, group_src=0)
        shard_units(module, self.ampkit, mesh)
        self._sharded.add(id(module))
        return module

    def forward_context(self):
        return self.ampkit.autocast()

    def convert_input(self, data: Any) -> Any:
        return self.ampkit._convert_input(data)

    def convert_output(self, data: Any) -> Any:
        """Floating outputs in ``torch.get_default_dtype()`` (fp32) in every 16-bit mode, autocast ones included,
        as Lightning's MixedPrecision returns them: the loss computed after the forward is then fp32."""
        if self.ampkit.mode.low_dtype is None:
            return data
        return cast_floating(data, torch.get_default_dtype())

    # -- optimizer
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer ampkit steps for ``optimizer``: fp32 masters or the compensated version (made once)."""
        made = self._prepared.get(id(optimizer))
        if made is not None:
            return made
        if any(o is optimizer for o in self._prepared.values()):
            return optimizer  # already the one ampkit steps
        made = self.ampkit.wrap_optimizer(optimizer)
        self._prepared[id(optimizer)] = made
        if made is not optimizer and getattr(made, "optimizer", None) is not optimizer:
            _share_groups(optimizer, made)
        if len({id(o) for o in self._prepared.values()}) == 1:  # precision.fp32_state_dict(model) finds it
            self.ampkit._optimizer = made
        return made

    def fp32_state_dict(self, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        """The module's full-precision weights (:meth:`ampkit.Precision.fp32_state_dict`): the fp32 masters or the
        Kahan-folded weights of the optimizer prepared for it (the only one; pass ``optimizer`` when several)."""
        module = getattr(module, "_original_module", None) or module  # Fabric's wrapper: the user's module
        if optimizer is None:
            made = {id(o): o for o in self._prepared.values()}
            if len(made) > 1:
                raise ValueError("fp32_state_dict: several optimizers were prepared: pass optimizer=... (the one "
                                 "that updates this module).")
            optimizer = next(iter(made.values()), None)
        else:
            optimizer = self.prepare_optimizer(getattr(optimizer, "optimizer", optimizer))
        return self.ampkit.fp32_state_dict(module, optimizer)

    def main_params(self, optimizer):
        for group in self.prepare_optimizer(optimizer).param_groups:
            yield from group["params"]

    def unscale_gradients(self, optimizer) -> None:
        self.ampkit.unscale_(self.prepare_optimizer(optimizer))

    # -- state
    def state_dict(self) -> Dict[str, Any]:
        return self.ampkit.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if state_dict:
            self.ampkit.load_state_dict(state_dict)


def _check_covered(module: nn.Module, sharded: List[nn.Module]) -> None:
    """Every parameter of ``module`` lies in a module `shard` converted: else one line saying what to shard."""
    inside = {id(p) for m in sharded for p in m.parameters()}
    left = [n for n, p in module.named_parameters() if id(p) not in inside]
    if left:
        raise ValueError(f"plugin.shard(...) converted part of the model; {len(left)} parameters lie outside it "
                         f"({left[0]!r}, ...): shard the module that holds every trained parameter.")


class AmpkitFabricPrecision(_Core, _FabricPrecision):
    """``lightning.Fabric(plugins=AmpkitFabricPrecision(mode, **ampkit_kwargs))``.

    ``optimizer.step()`` of a Fabric-wrapped optimizer unscales, skips a non-finite step, steps the fp32
    masters or the compensated optimizer where the mode has them, and updates the loss scale; it returns
    what :meth:`ampkit.Precision.step` returns (whether the step was applied).
    """

    def __init__(self, precision: Any = "auto", device: Any = None, **kwargs: Any) -> None:
        self._init_core(precision, device, kwargs)

    def convert_module(self, module: nn.Module) -> nn.Module:
        module = super().convert_module(module)
        for optimizer in _optimizers_of_fabric_setup():  # prepared now, before a fabric.load can reach them
            self.prepare_optimizer(optimizer)
        return module

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """As the Trainer plugin's; also takes the optimizer ``fabric.setup_optimizers`` returned. An optimizer
        set up that way (``ModelParallelStrategy`` needs it: it is built over the shards) is prepared at its
        first step: call this on it before a ``fabric.load`` that comes first."""
        if isinstance(optimizer, _FabricOptimizer):
            optimizer = optimizer.optimizer
        known = id(optimizer) in self._prepared or any(o is optimizer for o in self._prepared.values())
        made = super().prepare_optimizer(optimizer)
        if not known:
            _StateRoute(self, optimizer, made)
        return made

    def backward(self, tensor: torch.Tensor, model: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        if args:  # torch.Tensor.backward's positional gradient / retain_graph
            kwargs = dict(zip(("gradient", "retain_graph", "create_graph", "inputs"), args), **kwargs)
        self.ampkit.backward(tensor, **kwargs)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        if kwargs.get("closure") is not None:
            raise ValueError("ampkit's precision plugin steps without a closure: call fabric.backward(loss) and "
                             "then optimizer.step().")
        return self.ampkit.step(self.prepare_optimizer(optimizer))


class _Relink:
    """A replacement optimizer (bf16-pure's compensated one) steps with the groups a scheduler built on the
    original changes: the original's ``param_groups`` is the replacement's list, also after a
    ``load_state_dict`` gives the replacement new group dicts (a load post-hook)."""

    def __init__(self, original: torch.optim.Optimizer, made: torch.optim.Optimizer) -> None:
        self.original, self.made = original, made

    def __call__(self, _optimizer: Any = None) -> None:
        self.original.param_groups = self.made.param_groups


def _share_groups(original: torch.optim.Optimizer, made: torch.optim.Optimizer) -> None:
    relink = _Relink(original, made)
    relink()
    made.register_load_state_dict_post_hook(relink)


def _optimizers_of_fabric_setup() -> List[torch.optim.Optimizer]:
    """The optimizers being passed to ``Fabric.setup``, which calls ``convert_module`` (our caller's caller):
    Fabric gives a precision plugin no hook with the optimizers, and a ``fabric.load`` before the first step
    must already find the state routed to the optimizer ampkit steps. Empty elsewhere (``setup_module``, a
    Lightning version that calls it differently): the optimizers are then prepared at their first use."""
    frame = sys._getframe(1)
    for _ in range(4):  # convert_module (a subclass's too), then Fabric.setup
        frame = frame.f_back
        if frame is None:
            return []
        if frame.f_code.co_name == "setup" and isinstance(frame.f_locals.get("self"), _Fabric):
            return [o for o in frame.f_locals.get("optimizers", ()) if isinstance(o, torch.optim.Optimizer)]
    return []


class _StateRoute:
    """Makes ``original.state_dict()`` / ``load_state_dict()`` (what ``fabric.save`` / ``fabric.load`` call on the
    optimizer the user holds) carry the state of ``made``, the optimizer ampkit steps, and the precision's own
    state under :data:`PRECISION_KEY`, through torch's optimizer state-dict hooks. ``made`` may wrap
    ``original`` (fp32 masters: its state dict calls the original's), so a nested call runs torch's own."""

    def __init__(self, plugin: "AmpkitFabricPrecision", original: torch.optim.Optimizer,
                 made: torch.optim.Optimizer) -> None:
        self.plugin, self.original, self.made = plugin, original, made
        self.busy = False
        original.register_state_dict_post_hook(self.saved)
        original.register_load_state_dict_pre_hook(self.loading)
        if getattr(made, "optimizer", made) is not original:  # a replacement, not a wrapper
            original.register_load_state_dict_post_hook(_Relink(original, made))

    def saved(self, _optimizer: Any, state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        if self.busy:
            return None
        self.busy = True
        try:
            if not self.made.state and hasattr(self.made, "init_state"):
                # not stepped yet: its state as the first step makes it (Kahan buffers included), so that the
                # template a sharded fabric.load (DCP's get_optimizer_state_dict) reads into has every entry
                self.made.init_state()
            out = self.made.state_dict() if self.made is not self.original else state_dict
        finally:
            self.busy = False
        return {**out, PRECISION_KEY: self.plugin.state_dict()}

    def loading(self, _optimizer: Any, state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        if self.busy:
            return None
        state_dict = dict(state_dict)
        own = state_dict.pop(PRECISION_KEY, None)
        if own:
            self.plugin.load_state_dict(own)
        if self.made is self.original:
            return state_dict
        self.busy = True
        try:
            self.made.load_state_dict(state_dict)
            return self.original.state_dict()  # torch then loads the original's own state back: a no-op
        finally:
            self.busy = False


class AmpkitPrecision(_Core, _TrainerPrecision):
    """``lightning.Trainer(plugins=AmpkitPrecision(mode, **ampkit_kwargs))``.

    ``gradient_clip_val`` clips the unscaled gradients (of the fp32 masters where the mode has them);
    the optimizers the LightningModule configures are given fp32 masters or made compensated once,
    when the Trainer connects them, so checkpoints hold the masters and the compensation state.
    """

    def __init__(self, precision: Any = "auto", device: Any = None, **kwargs: Any) -> None:
        self._init_core(precision, device, kwargs)

    def connect(self, model, optimizers, lr_schedulers):
        return model, [self.prepare_optimizer(o) for o in optimizers], lr_schedulers

    def pre_backward(self, tensor: torch.Tensor, module) -> torch.Tensor:
        if self.ampkit.mode.scaled:
            tensor = self.ampkit.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        optimizer = self.prepare_optimizer(optimizer)
        closure_result = closure()  # forward + backward (scaled in pre_backward)
        skip = closure_result is None and getattr(model, "automatic_optimization", True)
        if skip:  # training_step returned None: nothing to step (Lightning's convention)
            return closure_result
        self.ampkit.unscale_(optimizer)  # masters' grads, unscaled: what clipping and the hooks see
        self._after_closure(model, optimizer)  # on_before_optimizer_step, gradient_clip_val
        self.ampkit.step(optimizer)
        return closure_result
