"""The compensated optimizers' base class: bucketing, the device-side skip, RNG streams, state I/O.

Each ``step`` groups a param group's tensors by (device, dtype), cuts each group into batches of at
most ``bucket_numel`` elements, a fixed size (:data:`CPU_BATCH`, :data:`DEVICE_BATCH`;
:func:`~ampkit.optim.batches.pieces`), and hands each batch to the subclass's ``_update`` as lists for
``torch._foreach_*`` ops, with a :class:`~ampkit.optim.target._Target` saying where the update lands (the
params, their Kahan buffers, or fp32 copies rounded stochastically).

No host reads per step: step counts live on the params' device (as in torch's fused/capturable
Adam), a tensor ``lr`` stays a tensor, and the skip decision is taken on the device through torch's
amp protocol (``_step_supports_amp_scaling``: the scaler sets ``found_inf`` and ``grad_scale``).
A step whose ``found_inf`` is set leaves params, moments, Kahan buffers and step counts identical, bit for
bit: Adam/AdamW and SGD (``_skips_itself``) select every old bit inside their one-pass update (a final
``where``); a subclass that does not skip itself has its batch's state snapshotted and restored
(:class:`~ampkit.optim.batches._Undo`). Stochastic rounding draws its random bits before the outcome is known, so a
skipped step does consume draws (deterministically: the same run with the same seed skips and draws
the same way).

Stochastic rounding's bits come from a :class:`~ampkit.optim.noise.RoundingNoise` per device: a hash of
the seed and a counter on the device, so the step traces under torch.compile and compiled equals eager.
``state_dict()`` saves the seed and the counters (first param group, :data:`NOISE_KEY`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

import torch

from torch._subclasses.fake_tensor import is_fake

from . import bitcast, onepass, replicas
from .batches import _Undo, pieces
from .noise import RoundingNoise
from .target import _Target

__all__ = ["CompensatedOptimizer", "COMPENSATIONS", "LOW_PRECISION", "NOISE_KEY", "CPU_BATCH", "STEP_TEMPORARIES"]

COMPENSATIONS = ("kahan", "stochastic", None)
MOMENT_ROUNDINGS = ("stochastic", "nearest")
LOW_PRECISION = (torch.bfloat16, torch.float16)
_STATE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
#: the ``state_dict()`` param-group key holding the stochastic-rounding noise: seed and counters
NOISE_KEY = "rounding_noise"
#: elements per foreach batch on a CPU: a fixed size bounds the eager step's temporaries (its fp32 row and the update's
#: intermediates, 80 B per element at most: :data:`STEP_TEMPORARIES`), so an embedding-heavy model, whose
#: activations are small, peaks at its state plus a constant. (2**17 held 9-10 MiB, above plain bf16's peak by
#: 3 B/param on a 2.8M-param model; 2**15 is as fast here: the ops' host cost is small beside their bytes.)
CPU_BATCH = 1 << 15
#: bytes the eager step holds beyond the training state on a CPU, at most (``tests/optim/test_step_temporaries.py``
#: counts them: 64-80 B per element of a batch for Adam/AdamW, fewer for SGD): a fixed bound, whatever the model
STEP_TEMPORARIES = 3 << 20  # 3 MiB: 96 B per element of CPU_BATCH
#: elements per foreach batch on an accelerator (576 MiB of temporaries at most: launches, not bytes, bound a
#: GPU's step, and the step's temporaries live while the activations are freed)
DEVICE_BATCH = 1 << 24


def check_compensation(value: Any) -> None:
    if value not in COMPENSATIONS:
        raise ValueError(
            f"compensation={value!r} is not supported: use 'kahan' (a 16-bit buffer per param), "
            "'stochastic' (stochastic rounding, no extra state) or None (plain rounding)."
        )


def check_same_compensation(saved: Optional[str], mine: Optional[str]) -> None:
    """A checkpoint's compensation must be the one this optimizer runs: torch would silently take the
    saved groups' over the one asked for, and the run would do something other than what it reports."""
    if saved != mine:
        raise ValueError(
            f"Checkpoint's optimizer used compensation={saved!r}, this one uses {mine!r}: resume with the "
            f"same one (ampkit train --compensation {saved or 'none'}), or start a new run.")


def check_moment_rounding(value: Any) -> None:
    if value not in MOMENT_ROUNDINGS:
        raise ValueError(f"moment_rounding={value!r} is not supported: use 'stochastic' or 'nearest'.")


def scalar(value: Any) -> float:
    """A hyperparameter as a Python float (a tensor costs one read: for checks at construction only)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def lr_of(group: Dict[str, Any], device: torch.device) -> Any:
    """The group's lr: a Python float, or a tensor lr as a float32 tensor on ``device`` (no read)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        return lr.detach().to(device=device, dtype=torch.float32, non_blocking=True).reshape(())
    return lr



try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch without torch.distributed
    _DTensor = None


class _LocalState(dict):
    """A parameter's state as the local shards of its DTensor entries (FSDP2): the update runs on plain tensors
    (in place, so the DTensors see it); an entry the update sets anew is written to the parameter's state
    (as a plain tensor where the state had none, wrapped like its old DTensor otherwise)."""

    def __init__(self, state: Dict[str, Any]) -> None:
        super().__init__({k: v.to_local() if isinstance(v, _DTensor) else v for k, v in state.items()})
        self.owner = state

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        old = self.owner.get(key)
        if isinstance(old, _DTensor) and torch.is_tensor(value) and not isinstance(value, _DTensor):
            value = _DTensor.from_local(value, old.device_mesh, old.placements, run_check=False,
                                        shape=old.shape, stride=old.stride())
        self.owner[key] = value

class CompensatedOptimizer(torch.optim.Optimizer):
    """Base class: a ``torch.optim.Optimizer`` whose updates survive 16-bit params.

    Args:
        compensation: ``"kahan"`` (default), ``"stochastic"`` or None; a param-group key, so groups
            may differ. Applies to bf16/fp16 params only (stochastic: bf16 only); fp32 params are
            updated in fp32 with no buffer.
        state_dtype: dtype of the optimizer's moment buffers; None = bf16 for bf16 params (the
            memory saving), fp32 for fp16 params (fp16's range cannot hold squared gradients), fp32
            for fp32 params. Set, it applies to every param: ``torch.bfloat16`` halves fp32 params'
            moments too (updates computed in fp32, rounded stochastically: ``moment_rounding``).
        moment_rounding: how updates of bf16 optimizer state (Adam's moments, SGD's momentum)
            are rounded: ``"stochastic"`` (default: computed in fp32, rounded stochastically, so
            slow averages such as beta2=0.999 keep tracking) or ``"nearest"`` (cheaper, fine
            when 1 - beta is well above bf16's 2**-8 resolution). A param-group key.
        seed: seed of the stochastic-rounding noise; None derives it from ``torch.initial_seed()``
            when the optimizer is built (so ``torch.manual_seed`` makes runs reproducible). The seed and
            the noise counters are saved in ``state_dict()``.
    """

    #: elements per foreach batch (None: see ``_cap``: :data:`CPU_BATCH` on a CPU, :data:`DEVICE_BATCH`
    #: elsewhere). Batches bound the transient fp32 copies (and the skip's snapshot, where the update does not
    #: skip itself) to the batch: a param bigger than a batch (an embedding) is updated in slices.
    bucket_numel: Optional[int] = None

    #: whether ``_update`` honours ``target.skip`` and unscales by ``target.scale`` itself (no snapshot of the
    #: batch is taken and restored)
    _skips_itself = False

    #: torch's amp protocol: a scaler sets ``found_inf`` (and ``grad_scale`` when the grads are still
    #: scaled) and the step skips on the device, as torch's fused Adam does: no host read
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults: Dict[str, Any], *, compensation: Optional[str] = "kahan",
                 state_dtype: Optional[torch.dtype] = None, seed: Optional[int] = None,
                 compiled: Optional[bool] = None) -> None:
        check_compensation(compensation)
        if compiled not in (None, True, False):
            raise ValueError(f"compiled must be None (auto), True or False, got {compiled!r}.")
        #: whether the update runs as one compiled pass per tensor (None: where a bucket is big enough, see
        #: ``ampkit.optim.onepass``); the eager batches otherwise
        self.compiled = compiled
        if state_dtype not in _STATE_DTYPES:
            raise ValueError(f"state_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, got {state_dtype}.")
        self.state_dtype = state_dtype
        self.seed = seed
        self._noise_seed = (seed if seed is not None else torch.initial_seed() ^ 0x5EED5EED) % (1 << 64)
        #: the seed is the same on every rank (given, loaded, or agreed at the first step under DDP: ``replicas``)
        self._seed_agreed = seed is not None
        self._noise: Dict[str, RoundingNoise] = {}
        self._shard_rank: Optional[int] = None  # the rank, where the params are DTensor shards (FSDP2)
        #: per batch, the views its update pairs flat fp32 rows with (``flat.batch_of``); not state
        self._flat_cache: Dict[Any, Any] = {}
        super().__init__(params, {**defaults, "compensation": compensation})

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        check_compensation(param_group.get("compensation", self.defaults.get("compensation")))
        super().add_param_group(param_group)
        if self._shard_rank is None and _DTensor is not None and not self._noise \
                and any(isinstance(p, _DTensor) for p in self.param_groups[-1]["params"]):
            import torch.distributed as dist

            self._shard_rank = dist.get_rank() if dist.is_initialized() else 0
        for p in self.param_groups[-1]["params"]:  # counters made here, not inside a compiled step
            self.noise(p.device)

    # ------------------------------------------------------------------ helpers for subclasses
    def state_dtype_for(self, p: torch.Tensor) -> torch.dtype:
        """``state_dtype`` when set (any floating param: ``optimizer_state="bf16"`` over fp32 params);
        else bf16 for bf16 params, fp32 for fp16 params (fp16's range cannot hold squared gradients),
        the param's own dtype otherwise."""
        if self.state_dtype is not None and p.is_floating_point():
            return self.state_dtype
        if p.dtype not in LOW_PRECISION:
            return p.dtype
        return torch.bfloat16 if p.dtype == torch.bfloat16 else torch.float32

    def _init_state(self, p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> None:
        """Create the optimizer's own state for ``p`` (called once, at its first step)."""

    def init_state(self) -> None:
        """Create every parameter's state now, as its first step would (``_buckets``), without updating anything:
        the template ``torch.distributed.checkpoint`` loads a sharded checkpoint into. The next step is the same."""
        self._flat_cache.clear()
        for group in self.param_groups:
            kahan = group["compensation"] == "kahan"
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    self._init_state(p, state, group)
                if kahan and p.dtype in LOW_PRECISION and "compensation" not in state:
                    state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, group: Dict[str, Any], params: List[torch.Tensor], grads: List[torch.Tensor],
                states: List[Dict[str, Any]], target: _Target) -> None:
        raise NotImplementedError

    def noise(self, device: torch.device) -> RoundingNoise:
        """The stochastic-rounding noise of ``device`` (one counter per device, one seed)."""
        key = str(device)
        if key not in self._noise:
            self._noise[key] = RoundingNoise(self._stream_seed(), device)
        return self._noise[key]

    def _buckets(self, group: Dict[str, Any]) -> Dict[Tuple[torch.device, torch.dtype], tuple]:
        """Params with grads, grouped by (device, dtype), their state created on first sight."""
        kahan = group["compensation"] == "kahan"
        buckets: Dict[Tuple[torch.device, torch.dtype], tuple] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients.")
            state = self.state[p]
            if not state:
                self._init_state(p, state, group)
            if kahan and p.dtype in LOW_PRECISION and "compensation" not in state:
                state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params, grads, states = buckets.setdefault((p.device, p.dtype), ([], [], []))
            if _DTensor is not None and isinstance(p, _DTensor):  # an FSDP2 shard: its local part, state sharded
                params.append(p.to_local())
                grads.append(p.grad.to_local() if isinstance(p.grad, _DTensor) else p.grad)
                states.append(_LocalState(state))
            else:
                params.append(p)
                grads.append(p.grad)
                states.append(state)
        return buckets

    # ------------------------------------------------------------------ step
    def _cap(self, device: torch.device, total: int) -> int:
        """Elements per foreach batch: ``bucket_numel``, else :data:`CPU_BATCH` on a CPU, :data:`DEVICE_BATCH`
        elsewhere: a fixed size, so the ops of a step grow with the parameters' bytes beyond it, never with
        their count below it, and the step's temporaries stay under a fixed bound (see ``AdamW``)."""
        if self.bucket_numel:
            return self.bucket_numel
        return CPU_BATCH if device.type == "cpu" else DEVICE_BATCH

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not getattr(self, "_seed_agreed", True) and replicas.replicated():
            self._agree_seed()
        found_inf: Optional[torch.Tensor] = getattr(self, "found_inf", None)
        grad_scale: Optional[torch.Tensor] = getattr(self, "grad_scale", None)
        for gi, group in enumerate(self.param_groups):
            buckets = self._buckets(group)
            for (device, dtype) in buckets:  # (before anything changes)
                if group["compensation"] == "stochastic" and dtype == torch.float16:
                    raise ValueError("compensation='stochastic' rounds to bfloat16; found torch.float16 params. "
                                     "Use compensation='kahan' for float16 params.")
            on_device = self._on_devices(group, buckets, found_inf, grad_scale)
            offsets: Dict[torch.device, int] = {}  # elements updated so far, per device: where the draws' bits sit
            for (device, dtype), (params, grads, states) in buckets.items():
                mode = group["compensation"] if dtype in LOW_PRECISION else None
                noise = self.noise(device)
                skip, keep, scale, shared = on_device[device]
                numel = sum(p.numel() for p in params)
                offset = offsets.get(device, 0)
                offsets[device] = offset + numel
                if self._skips_itself:  # one pass per tensor (compiled, or inline in an outer compile)?
                    target = _Target(mode, params, states, noise, skip, keep=keep)
                    target.scale, target.shared, target.offset = scale, shared, offset
                    if self._one_pass(group, mode, params, grads, states, target):
                        self._after_update(group, states, keep)
                        continue
                cap = self._cap(device, numel)
                for index, (ps, gs, ss) in enumerate(pieces(params, grads, states, cap)):
                    target = _Target(mode, ps, ss, noise, skip, keep=keep, where=(gi, device, dtype, index))
                    target.offset = offset
                    offset += sum(p.numel() for p in ps)
                    if self._skips_itself:  # the update unscales and honours the skip itself
                        target.scale, target.shared = scale, shared
                        self._update(group, ps, gs, ss, target)
                        continue
                    if scale is not None:  # grads still scaled: unscale copies (the model's grads stay)
                        gs = torch._foreach_div(gs, scale)
                    undo = None if skip is None else _Undo.of_batch(ps, ss, skip)
                    self._update(group, ps, gs, ss, target)
                    if undo is not None:
                        undo()
                    del gs, undo
                self._after_update(group, states, keep)
        return loss

    def _on_devices(self, group: Dict[str, Any], buckets: Dict[Tuple[torch.device, torch.dtype], tuple],
                    found_inf: Optional[torch.Tensor], grad_scale: Optional[torch.Tensor]) -> Dict[torch.device, tuple]:
        """Once per step, group and device: the skip flag and its 0/1 keep factor, the loss scale, the step counts
        advanced (by keep), and what the batches share (``_prepare``): ``{device: (skip, keep, scale, shared)}``."""
        on_device: Dict[torch.device, tuple] = {}
        for device in dict.fromkeys(d for d, _ in buckets):
            skip = keep = None
            if found_inf is not None:
                skip = found_inf.to(device, non_blocking=True).reshape(()) > 0
                keep = (~skip).to(torch.float32)
            scale = None if grad_scale is None else grad_scale.to(device, non_blocking=True).reshape(())
            # step counts once per param (a param split into pieces shares its count), masked by the skip
            states = [s for (d, _), (_, _, ss) in buckets.items() if d == device for s in ss]
            steps = [s["step"] for s in states if "step" in s]
            if steps:
                if keep is None:
                    torch._foreach_add_(steps, 1.0)
                else:  # a list of 0-d tensors: the Tensor-scalar overload reads the scalar on CPU
                    torch._foreach_add_(steps, [keep] * len(steps))
            shared = self._prepare(group, device, states, skip, keep) if self._skips_itself else None
            on_device[device] = (skip, keep, scale, shared)
        return on_device

    def _compiles(self, device: torch.device, numel: int) -> bool:
        """Whether this bucket's update runs compiled: ``compiled`` (None: auto, a bucket of at least
        :data:`~ampkit.optim.onepass.COMPILE_MIN` elements), unless compiling failed here before (said once)."""
        if self.compiled is False or onepass.compile_broken(device) is not None or torch.compiler.is_compiling():
            return False
        return bool(self.compiled) or numel >= onepass.COMPILE_MIN

    def _one_pass(self, group: Dict[str, Any], mode: Optional[str], params: List[torch.Tensor],
                  grads: List[torch.Tensor], states: List[Dict[str, Any]], target: _Target) -> bool:
        """For an optimizer that ``_skips_itself``: update the whole (device, dtype) bucket as one pass per tensor
        (the rule's in-place update, ``ampkit.optim.onepass``): compiled (one kernel each), or traced inline under
        an outer ``torch.compile``; False: the eager batches (``_update``) run it. The subclass names the rule
        (``_rule``), each param's state tensors (``_pass_tensors``, None where absent) and per-param values
        (``_pass_scalars``); the call is ``(p, g, *tensors, *scalars, skip, scale, key, start)``."""
        device = params[0].device
        compiling = torch.compiler.is_compiling()
        if not compiling:
            compiles = self._compiles(device, sum(p.numel() for p in params))
            if params[0].is_meta or is_fake(params[0]):
                # the memory planner's tensors: a compiled pass writes in place and holds nothing of its own, so
                # the plan counts no update where the real step would compile; the eager batches' temporaries elsewhere
                return compiles
            if not compiles:
                return False
        shared = target.shared
        rule = self._rule(group, mode, params[0].dtype, states)
        eager = onepass.inplace(rule)
        fn = eager if compiling else onepass.compiled_update(rule)
        start = target.noise.k1 + 2 * target.offset
        with contextlib.nullcontext() if compiling else bitcast.vector_views():  # (once, not per call)
            for p, g, s in zip(params, grads, states):
                ts = [p, g] + self._pass_tensors(s, mode)
                if all(t is None or t.is_contiguous() for t in ts):
                    ts = [None if t is None else t.view(-1) for t in ts]
                args = ts + [*self._pass_scalars(s, shared), target.skip, target.scale, shared["key"], start]
                try:
                    fn(*args)
                except Exception as error:  # (a compile that failed: nothing of this tensor was written)
                    if fn is eager:
                        raise
                    onepass.mark_broken(device, error)
                    fn = eager  # the rest of this step, per tensor, eager; the next steps in eager batches
                    fn(*args)
                start += 2 * p.numel()
        return True

    def _rule(self, group: Dict[str, Any], mode: Optional[str], p_dtype: torch.dtype,
              states: List[Dict[str, Any]]) -> Any:
        """For an optimizer that ``_skips_itself``: the bucket's ``onepass`` rule (what its compiled pass keys on)."""
        raise NotImplementedError

    def _pass_tensors(self, s: Dict[str, Any], mode: Optional[str]) -> List[Optional[torch.Tensor]]:
        """For ``_one_pass``: one param's state tensors, in the order its rule's update takes them."""
        raise NotImplementedError

    def _pass_scalars(self, s: Dict[str, Any], shared: Any) -> tuple:
        """For ``_one_pass``: one param's per-step values after its tensors (factors, flags)."""
        raise NotImplementedError

    def _prepare(self, group: Dict[str, Any], device: torch.device, states: List[Dict[str, Any]],
                 skip: Optional[torch.Tensor], keep: Optional[torch.Tensor]) -> Any:
        """For an optimizer that ``_skips_itself``: what every batch of ``group`` on ``device`` shares (factors
        from the step counts, masks), made once per step after the counts advanced; ``target.shared``."""
        return None

    def _after_update(self, group: Dict[str, Any], states: List[Dict[str, Any]], keep: Optional[torch.Tensor]) -> None:
        """Per-param bookkeeping once all pieces are updated (``keep``: 0.0 on a skipped step, or None)."""

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        if sd["param_groups"]:
            # in the first param group, not beside the groups: torch's load_state_dict keeps group keys, so
            # the noise survives a load into the plain torch optimizer before precision.setup() converts
            # it (nanoGPT's resume order; compensated_from restores it)
            positions = {k: n.position.detach().clone() for k, n in self._noise.items()}
            sd["param_groups"][0] = {**sd["param_groups"][0],
                                     NOISE_KEY: {"seed": self._noise_seed, "positions": positions}}
        return sd

    def load_noise_state(self, saved: Optional[Dict[str, Any]]) -> None:
        """Restore the seed and counters from ``state_dict()``'s :data:`NOISE_KEY` entry (None: keep
        this optimizer's own)."""
        if not saved:
            return
        self._noise_seed = int(saved["seed"]) % (1 << 64)
        self._seed_agreed = True  # (a checkpoint's: every rank loads the same)
        positions = saved.get("positions", {})
        for key in set(self._noise) | set(positions):
            self.noise(torch.device(key)).load(self._stream_seed(), positions.get(key, 0))

    def _agree_seed(self) -> None:
        """Under DDP (several ranks, whole params: no FSDP shards), rank 0's seed on every rank, once (a seed left
        to ``torch.initial_seed()`` differs where each rank seeds torch apart, and replicas drawing other bits drift
        apart); the counters keep their positions."""
        self._seed_agreed = True
        if self._shard_rank is not None:  # FSDP2 shards: each draws its own bits
            return
        seed = replicas.agreed_seed(self._noise_seed)
        if seed != self._noise_seed:
            self._noise_seed = seed
            for n in self._noise.values():
                n.load(self._stream_seed(), n.position)

    def _stream_seed(self) -> int:
        """The noise stream's seed: the optimizer's, mixed with the rank where the params are FSDP2 shards, so
        each shard draws its own bits (reproducible: the same seed and rank give the same stream). Under DDP
        (whole params on every rank) every rank draws the same bits and the replicas stay identical."""
        if self._shard_rank is None:
            return self._noise_seed
        return (self._noise_seed ^ ((self._shard_rank + 1) * 0x9E3779B97F4A7C15)) % (1 << 64)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._flat_cache.clear()  # (views of the state tensors the load replaces)
        state_dict = dict(state_dict)
        for saved, group in zip(state_dict.get("param_groups", []), self.param_groups):
            if "compensation" in saved:
                check_same_compensation(saved["compensation"], group["compensation"])
        noise = None
        groups = [dict(g) for g in state_dict.get("param_groups", [])]
        for g in groups:
            noise = g.pop(NOISE_KEY, None) or noise
        state_dict["param_groups"] = groups
        super().load_state_dict(state_dict)
        # torch casts every floating state tensor to its param's dtype; fp32 moments of bf16
        # params (state_dtype=torch.float32) must come back as saved, not rounded to bf16
        saved_groups = state_dict["param_groups"]
        by_id = {pid: p for saved, group in zip(saved_groups, self.param_groups)
                 for pid, p in zip(saved["params"], group["params"])}
        for pid, saved in state_dict["state"].items():
            p = by_id.get(pid)
            if p is None:
                continue
            for key, value in saved.items():
                if key == "step":
                    # step counts live on the param's device as float32 (a checkpoint written when they
                    # were host tensors or numbers loads too)
                    self.state[p][key] = torch.as_tensor(value, dtype=torch.float32).to(p.device).clone()
                elif isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != p.dtype:
                    self.state[p][key] = value.to(device=p.device)
        self.load_noise_state(noise)
