"""One training step traced on fake tensors: the Trainer's step, with the precision's own hooks.

``trace_step`` copies the model with fake parameters (the user's model is not touched; a model built on
the meta device, ``with torch.device("meta"): model = ...``, works the same and may be far larger than
this machine's memory), builds the optimizer as ``ampkit train`` does, runs ``Precision.setup`` (the
mode's conversion: 16-bit params, the master modes' fp32 params and their 16-bit compute copies, the
compensated optimizer, fp8 module swaps) and two
steps of forward under ``precision.autocast()``, loss, ``precision.backward``, ``precision.step`` and
``zero_grad(set_to_none=True)``, counting live storage bytes (``LiveBytes``). Two steps: the optimizer
creates its state in the first, so the second is the steady state every later step repeats.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Dict, Optional, Union

import torch
from torch import nn

from ..utils.loss import default_loss
from ..precision import Precision
from ..precision.convert import ComputeCopies
from ..utils.batch import batch_size_of, batch_target, call_model
from ..utils.copying import copy_model
from ..utils.tree import iter_tensors, map_tensors
from .ranks import check_strategy, ddp_bucket_bytes, fake_group, fsdp_storage_counted, shard_fake
from .tracker import LiveBytes, fake_mode

__all__ = ["trace_step", "StepTracer", "layout_of", "run_steps", "start_steps", "one_step", "split_batch",
           "make_precision", "build_optimizer"]

STEPS = 2


def split_batch(batch: Any):
    """``(inputs, targets)`` as the Trainer takes a batch: a Mapping is the model's keyword inputs (its
    target ``labels``), a 2-sequence is ``(inputs, targets)``, anything else inputs without a target."""
    if isinstance(batch, Mapping):
        return batch, batch_target(batch)
    if isinstance(batch, (list, tuple)) and len(batch) == 2 and not hasattr(batch, "_fields"):
        return batch[0], batch[1]
    return batch, None


def make_precision(precision: Union[str, Precision], device: Any, strategy: Optional[str] = None) -> Precision:
    """A fresh ``Precision`` (``setup`` runs once per object) for one rank of ``strategy`` (as the Trainer builds
    it): from a name, or a copy of a given one."""
    if isinstance(precision, Precision):
        opts = precision.options()
        if device is not None:
            opts["device"] = device
        return Precision(precision.requested, **{**opts, "strategy": strategy}, tuned=precision.tuned)
    return Precision(precision, device=device, strategy=strategy)


def build_optimizer(name: Union[str, Callable], params, device: torch.device, sharded: bool = False):
    """The optimizer ``ampkit train`` builds (fused where torch has the kernel; for ``sharded`` DTensor
    parameters torch has fused Adam/AdamW but no fused SGD), or ``name(params)``."""
    if callable(name):
        return name(params)
    fused = {"fused": True} if device.type in ("cpu", "cuda") else {}
    key = str(name).lower()
    if key == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, **fused)
    if key == "adam":
        return torch.optim.Adam(params, lr=1e-3, **fused)
    if key == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **({} if sharded else fused))
    raise ValueError(f"Unknown optimizer {name!r}: use adamw, adam or sgd, or a callable params -> optimizer.")


def _fake_like(mode, t: torch.Tensor, device: torch.device, shape=None) -> torch.Tensor:
    with mode:
        return torch.empty(tuple(shape if shape is not None else t.shape), dtype=t.dtype, device=device)


def fake_model(model: nn.Module, mode, device: torch.device) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors on ``device`` (ties kept)."""
    memo: Dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo:
            continue
        fake = _fake_like(mode, t, device)
        memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
    return copy_model(model, memo)


def fake_batch(batch: Any, mode, device: torch.device, size: Optional[int] = None) -> Any:
    """The batch as fake tensors, with ``size`` samples: every tensor whose leading size is the batch's
    gets the new one (inputs, targets, attention masks); the others keep their shape."""
    n0 = batch_size_of(batch)

    def one(t: torch.Tensor) -> torch.Tensor:
        shape = list(t.shape)
        if size is not None and shape and shape[0] == n0:
            shape[0] = size
        return _fake_like(mode, t, device, shape)

    return map_tensors(one, batch)


def trace_step(model: nn.Module, batch: Any, *, precision: Union[str, Precision] = "auto",
               optimizer: Union[str, Callable] = "adamw", loss_fn: Optional[Callable] = None,
               device: Any = None, batch_size: Optional[int] = None, world_size: int = 1,
               strategy: Optional[str] = None) -> Dict[str, Any]:
    """Trace ``STEPS`` training steps on fake tensors; returns the peak, its breakdown and more.

    With ``strategy`` (``ddp`` | ``fsdp``) the step is one rank's of ``world_size`` (``ranks.py``);
    ``batch_size`` is then the batch per rank. A :class:`StepTracer` keeps the set-up step for more
    batch sizes (what ``ampkit.plan`` does); this traces once, from the start."""
    return StepTracer(model, batch, precision=precision, optimizer=optimizer, loss_fn=loss_fn, device=device,
                      world_size=world_size, strategy=strategy).at(batch_size)


class StepTracer:
    """One mode's training step traced on fake tensors, kept for more batch sizes.

    The first :meth:`at` traces from the start: the model copied with fake parameters, the optimizer built,
    ``Precision.setup``, ``STEPS`` steps. The second step is the steady state (the optimizer's state exists,
    every later step repeats it), so :meth:`at` another batch size runs one more step on the same set-up
    model and optimizer, counted from the bytes live between steps (the setup's own peak, its batch
    resized, is kept when it is the higher): the same peak, breakdown and bytes at rest as a trace from the
    start, for a step's cost instead of setup and two steps. Under FSDP (a fake process group per trace)
    every batch size traces from the start. ``traced`` counts the traces run; answers are cached per size.
    """

    def __init__(self, model: nn.Module, batch: Any, *, precision: Union[str, Precision] = "auto",
                 optimizer: Union[str, Callable] = "adamw", loss_fn: Optional[Callable] = None,
                 device: Any = None, world_size: int = 1, strategy: Optional[str] = None) -> None:
        self.model, self.batch, self.precision, self.optimizer = model, batch, precision, optimizer
        self.loss_fn, self.world_size = loss_fn or default_loss, world_size
        self.strategy = check_strategy(world_size, strategy)
        target = torch.device(device) if device is not None else None
        self.remote = target is not None and target.type == "cuda" and not torch.cuda.is_available()
        self.target = target
        self.traced = 0
        self.layout: Optional[tuple] = None  # what decides the bytes of the steps, once traced (see layout_of)
        self._answers: Dict[Optional[int], Dict[str, Any]] = {}
        self._kept: Optional[Dict[str, Any]] = None

    def at(self, batch_size: Optional[int] = None) -> Dict[str, Any]:
        """The trace at ``batch_size`` samples (None: the batch's own size), as :func:`trace_step` returns it."""
        if batch_size not in self._answers:
            again = self._kept is not None and self.strategy != "fsdp"
            self._answers[batch_size] = self._again(batch_size) if again else self._first(batch_size)
            self.traced += 1
        return self._answers[batch_size]

    def _precision(self) -> Precision:
        if self.remote:  # a CUDA target planned from a machine without one
            return remote_cuda_precision(self.precision, self.strategy)
        return make_precision(self.precision, self.target, self.strategy)

    def _first(self, batch_size: Optional[int]) -> Dict[str, Any]:
        prec = self._precision()
        dev = prec.device
        mode = fake_mode()
        live = LiveBytes(torch.device("cuda", self.target.index or 0) if self.remote else dev)  # CUDA's blocks
        fmodel = fake_model(self.model, mode, dev)
        fbatch = fake_batch(self.batch, mode, dev, batch_size)
        extra: Dict[str, int] = {}
        if self.strategy == "fsdp":
            at_rest = _trace_fsdp(fmodel, fbatch, prec, self, live, mode)
        else:
            with mode, live:
                live.track_all(fmodel.parameters(), "weights")
                live.track_all(fmodel.buffers(), "weights")
                live.track_all(iter_tensors(fbatch), "inputs")
                inputs, targets = split_batch(fbatch)
                stepped, opt, runner = start_steps(fmodel, prec, self.optimizer, live)
                setup = {"peak": live.peak, "phase": live.peak_phase, "breakdown": live.breakdown(),
                         "inputs": _nbytes(live, fbatch)}
                for _ in range(STEPS):
                    one_step(stepped, runner, opt, inputs, targets, prec, self.loss_fn, live)
                at_rest = live.current
            if self.strategy == "ddp":  # held from the wrap on: on top of every moment of the step
                extra["ddp_buckets"] = ddp_bucket_bytes(stepped, live.device)
            self._kept = {"mode": mode, "live": live, "model": stepped, "opt": opt, "runner": runner,
                          "prec": prec, "extra": extra, "setup": setup}
            self.layout = layout_of(stepped, opt, prec)
        return self._answer(live.peak, live.peak_phase, live.breakdown(), at_rest, extra, prec, live.device,
                            batch_size)

    def _again(self, batch_size: Optional[int]) -> Dict[str, Any]:
        k = self._kept
        mode, live, prec, setup = k["mode"], k["live"], k["prec"], k["setup"]
        fbatch = fake_batch(self.batch, mode, prec.device, batch_size)
        with mode, live:
            live.track_all(iter_tensors(fbatch), "inputs")
            live.restart_peak("forward")  # the bytes live between steps, this batch's inputs among them
            inputs, targets = split_batch(fbatch)
            one_step(k["model"], k["runner"], k["opt"], inputs, targets, prec, self.loss_fn, live)
            at_rest = live.current
        peak, phase, breakdown = live.peak, live.peak_phase, live.breakdown()
        grown = _nbytes(live, fbatch) - setup["inputs"]
        if setup["peak"] + grown >= peak:  # setup's own peak (with this batch's inputs) stays the higher
            peak, phase = setup["peak"] + grown, setup["phase"]
            breakdown = {**setup["breakdown"], "inputs": setup["breakdown"].get("inputs", 0) + grown}
        return self._answer(peak, phase, breakdown, at_rest, k["extra"], prec, live.device, batch_size)

    def _answer(self, peak, phase, breakdown, at_rest, extra, prec, device, batch_size) -> Dict[str, Any]:
        breakdown = {**breakdown, **extra}
        n_params = sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())
        return {"peak_bytes": int(peak) + sum(extra.values()), "peak_phase": phase,
                "breakdown": breakdown, "at_rest_bytes": int(at_rest) + sum(extra.values()),
                "num_params": int(n_params), "mode": prec.name, "device": str(device),
                "batch_size": batch_size if batch_size is not None else batch_size_of(self.batch),
                "world_size": self.world_size, "strategy": self.strategy,
                "unseen": REMOTE_CUDA_UNSEEN if self.remote else None}


def _trace_fsdp(fmodel, fbatch, prec: Precision, tracer: StepTracer, live: LiveBytes, mode) -> int:
    """The FSDP rank's steps under a fake process group; the bytes at rest after them."""
    prec._fsdp_policy()  # the kind refuses what FSDP cannot shard (built with strategy="fsdp": contiguous)
    with fake_group(tracer.world_size) as group:
        from torch.distributed.device_mesh import DeviceMesh

        # a name of its own: DTensor caches its plans per mesh, and an unnamed mesh of the same ranks
        # would equal the run's own (a cached plan would then name the fake group, gone by then)
        mesh = DeviceMesh.from_group(group, prec.device.type, mesh_dim_names=("ampkit_plan",))
        with mode:  # set up and sharded before the count: the rank's step, not the model's loading
            fmodel = shard_fake(prec.setup(fmodel, None)[0], prec, mesh)
        with mode, live, fsdp_storage_counted(live):
            live.track_all(fmodel.parameters(), "weights")
            live.track_all(fmodel.buffers(), "weights")
            live.track_all(iter_tensors(fbatch), "inputs")
            run_steps(fmodel, fbatch, prec, tracer.optimizer, tracer.loss_fn, live, sharded=True)
            return live.current


def _nbytes(live: LiveBytes, batch: Any) -> int:
    """Bytes of the batch's storages, as the counter counts them (each once)."""
    seen = {id(t.untyped_storage()): live._bytes(t.untyped_storage()) for t in iter_tensors(batch)}
    return sum(seen.values())


def layout_of(model: nn.Module, opt, prec: Precision) -> tuple:
    """What decides the bytes of a set-up step besides the model's code and the batch: each parameter's and
    buffer's shape, element size and gradient flag, the modules' and hooks' classes (fp8 swaps, compute
    copies), the optimizer's class and settings, autocast's element size and the loss scaler. Two modes
    with the same layout and the same first trace trace the same at every batch size (``ampkit.plan``'s
    ``shared``)."""
    def tensors(named):
        return tuple((n, tuple(t.shape), t.element_size(), t.requires_grad) for n, t in named)

    modules = tuple((n, type(m).__name__, tuple(type(h).__name__ for h in m._forward_pre_hooks.values()),
                     tuple(type(h).__name__ for h in m._forward_hooks.values())) for n, m in model.named_modules())
    groups = tuple(tuple(sorted((k, repr(v)) for k, v in g.items() if k != "params")) for g in opt.param_groups)
    fast = prec.mode.autocast_dtype
    return (tensors(model.named_parameters()), tensors(model.named_buffers()), modules, type(opt).__name__, groups,
            None if fast is None else torch.empty((), dtype=fast).element_size(), bool(prec.scales_loss))


REMOTE_CUDA_UNSEEN = ("planned without a GPU (CPU fake tensors, CUDA's 512-byte blocks, CPU autocast's op lists): "
                      "not seen: the CUDA context, the caching allocator's reserved-but-free blocks and "
                      "fragmentation, cuBLAS/cuDNN workspaces")


def remote_cuda_precision(precision: Union[str, Precision], strategy: Optional[str] = None) -> Precision:
    """The precision of a CUDA target on a machine without CUDA: the mode built for the CPU, whose
    conversion of model and optimizer is the same code (torch cannot run autograd on fake CUDA tensors
    in a build without CUDA, so the trace stays on CPU fake tensors)."""
    name = precision.requested if isinstance(precision, Precision) else str(precision)
    if name.strip().lower() in ("auto", "none", ""):
        raise ValueError("precision 'auto' measures the device it runs on: name the mode to plan a CUDA target "
                         "from a machine without one (e.g. bf16-mixed).")
    return make_precision(precision, "cpu", strategy)


class _NoTracker:
    phase = ""

    def track_all(self, tensors, category=None) -> None:
        pass


def run_steps(model: nn.Module, batch: Any, prec: Precision, optimizer: Union[str, Callable] = "adamw",
              loss_fn: Optional[Callable] = None, live: Optional[LiveBytes] = None, steps: int = STEPS,
              sharded: bool = False, wrap: Optional[Callable[[nn.Module], nn.Module]] = None):
    """The Trainer's steps (ampkit/train/loop.py, one micro-batch per step): optimizer built, model and
    optimizer set up by the precision, then forward under autocast, loss, backward, step, zero_grad.
    ``sharded``: the model is already set up and sharded with ``fully_shard`` (as ``ampkit train
    --strategy fsdp`` does it): the optimizer is built over its shards and wrapped by the precision. ``wrap``: applied to the model once
    set up (DDP, as ``ampkit train`` wraps it), for the measured calibration on real process groups.
    The same code runs on fake tensors (traced) and on real ones (``benchmarks/plan_calibration.py``)."""
    live = live if live is not None else _NoTracker()
    inputs, targets = split_batch(batch)
    model, opt, runner = start_steps(model, prec, optimizer, live, sharded, wrap)
    for _ in range(steps):
        one_step(model, runner, opt, inputs, targets, prec, loss_fn or default_loss, live)
    return model, opt


def start_steps(model: nn.Module, prec: Precision, optimizer: Union[str, Callable] = "adamw", live=None,
                sharded: bool = False, wrap: Optional[Callable[[nn.Module], nn.Module]] = None):
    """The optimizer built and the model and optimizer set up (``run_steps``' start): ``(model, opt, runner)``,
    ``runner`` the model as the steps call it (wrapped by ``wrap``)."""
    live = live if live is not None else _NoTracker()
    opt = build_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad], prec.device, sharded)
    if sharded:  # as the Trainer under --strategy fsdp: the kind's optimizer over the shards
        opt = prec.wrap_optimizer(opt)
        prec.scaler.register_names(model)
    else:
        model, opt = prec.setup(model, opt)
    model.train()
    _tag_state(live, model, opt)
    _tag_compute_copies(live, model)
    return model, opt, (wrap(model) if wrap is not None else model)


def one_step(model: nn.Module, runner: nn.Module, opt, inputs: Any, targets: Any, prec: Precision,
             loss_fn: Callable, live) -> None:
    """One training step: forward under autocast, loss, backward, step, ``zero_grad(set_to_none=True)``."""
    live.phase = "forward"
    with prec.autocast():
        out = call_model(runner, inputs)
        loss = loss_fn(out, targets)
    del out
    live.phase = "backward"
    prec.backward(loss)
    del loss
    live.track_all((p.grad for p in model.parameters() if p.grad is not None), "grads")
    live.phase = "step"
    prec.step(opt)
    _tag_state(live, model, opt)
    opt.zero_grad(set_to_none=True)


class _TagCopies:
    """Forward pre-hook run after ``ComputeCopies``: tags the module's 16-bit compute copies."""

    def __init__(self, live, names) -> None:
        self.live, self.names = live, names

    def __call__(self, module: nn.Module, args) -> None:
        self.live.track_all((module.__dict__[k] for k in self.names if k in module.__dict__), "compute_copies")


def _tag_compute_copies(live, model: nn.Module) -> None:
    """The master modes' per-forward 16-bit copies of the fp32 params get their own category."""
    if isinstance(live, _NoTracker):
        return
    for module in model.modules():
        copies = [h for h in module._forward_pre_hooks.values() if isinstance(h, ComputeCopies)]
        if copies:
            module.register_forward_pre_hook(_TagCopies(live, copies[0].params + copies[0].buffers))


def _tag_state(live: LiveBytes, model: nn.Module, opt) -> None:
    """Tag the storages that make up training state (after setup, and after each step before zero_grad): the
    model's params are ``weights`` (in the master modes the fp32 masters themselves)."""
    live.track_all(model.parameters(), "weights")
    live.track_all(model.buffers(), "weights")
    live.track_all((p.grad for p in model.parameters() if p.grad is not None), "grads")
    for per_param in (getattr(opt, "state", None) or {}).values():
        if isinstance(per_param, dict):
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor):
                    live.track_all([value], "compensation" if key == "compensation" else "optimizer_state")
