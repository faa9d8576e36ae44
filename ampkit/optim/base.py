"""Shared machinery of the compensated optimizers: bucketing, where updates land, RNG, state I/O.

Each ``step`` groups a param group's tensors by (device, dtype), in batches of at most
``bucket_numel`` elements, and hands each batch to the subclass's ``_update`` as lists for
``torch._foreach_*`` ops. The subclass adds its update to
``target.tensors``, which are

* the params themselves: fp32/fp64 params, or ``compensation=None`` (plain rounding);
* the params' Kahan buffers (``compensation="kahan"``): the update is summed there and
  :func:`~ampkit.optim.rounding.kahan_add_` moves what fits into the params;
* fp32 copies of the params (``compensation="stochastic"``): rounded back unbiasedly.

So one update rule serves every dtype and compensation, and fp32 params keep plain fp32 updates
(no buffer) next to bf16 ones in the same optimizer.

Why ~330 lines: bucketing, the device-side skip (snapshot and bit-exact restore, so a skip needs no
host read), the RNG streams and state I/O all act on the same per-bucket state lists; split apart they
would pass those lists between modules on every step.

No host reads per step: step counts live on the params' device (as in torch's fused/capturable
Adam), a tensor ``lr`` stays a tensor, and the skip decision is taken on the device through torch's
amp protocol (``_step_supports_amp_scaling``: the scaler sets ``found_inf`` and ``grad_scale``).
A step whose ``found_inf`` is set computes its update and then selects, bit for bit, the state it
started from (:func:`_Undo`): params, moments, Kahan buffers and step counts come back identical.
Stochastic rounding draws its random bits before the outcome is known, so a skipped step does
consume draws (deterministically: the same run with the same seed skips and draws the same way,
and the generator state is saved in ``state_dict``).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .rounding import kahan_add_, stochastic_round_

__all__ = ["CompensatedOptimizer", "COMPENSATIONS", "LOW_PRECISION", "RNG_KEY"]

COMPENSATIONS = ("kahan", "stochastic", None)
MOMENT_ROUNDINGS = ("stochastic", "nearest")
LOW_PRECISION = (torch.bfloat16, torch.float16)
_STATE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
#: the ``state_dict()`` param-group key holding the stochastic-rounding generators' states
RNG_KEY = "rng_states"


def spans(numels: List[int], cap: int) -> List[Tuple[int, int]]:
    """Consecutive index ranges whose numels sum to at most ``cap`` (a bigger tensor stands alone)."""
    out, lo, total = [], 0, 0
    for i, n in enumerate(numels):
        if i > lo and total + n > cap:
            out.append((lo, i))
            lo, total = i, 0
        total += n
    if numels:
        out.append((lo, len(numels)))
    return out


#: per-param state that is not split with the param (counts, flags): shared by its pieces, never undone
_SHARED = ("step", "momentum_pending")


def _splittable(p: torch.Tensor, g: torch.Tensor, state: Dict[str, Any]) -> bool:
    return p.is_contiguous() and g.is_contiguous() and all(
        v.is_contiguous() for k, v in state.items() if isinstance(v, torch.Tensor) and k not in _SHARED)


def pieces(params: List[torch.Tensor], grads: List[torch.Tensor], states: List[Dict[str, Any]],
           cap: int) -> List[Tuple[List[torch.Tensor], List[torch.Tensor], List[Dict[str, Any]]]]:
    """Foreach batches of at most ``cap`` elements: params (with their grads and state) packed in order,
    and a param larger than ``cap`` cut into flat slices of its storage (when it, its grad and its state
    are contiguous; elementwise updates do not care where a slice ends). A slice's state dict holds slices
    of the param-shaped state and the param's own counts and flags (:data:`_SHARED`)."""
    flat_p, flat_g, flat_s = [], [], []
    for p, g, st in zip(params, grads, states):
        n = p.numel()
        if n <= cap or not _splittable(p, g, st):
            flat_p.append(p), flat_g.append(g), flat_s.append(st)
            continue
        pv, gv = p.view(-1), g.view(-1)
        sv = {k: (v.view(-1) if isinstance(v, torch.Tensor) and k not in _SHARED else v) for k, v in st.items()}
        for lo in range(0, n, cap):
            flat_p.append(pv[lo:lo + cap])
            flat_g.append(gv[lo:lo + cap])
            flat_s.append({k: (v[lo:lo + cap] if isinstance(v, torch.Tensor) and k not in _SHARED else v)
                           for k, v in sv.items()})
    return [(flat_p[lo:hi], flat_g[lo:hi], flat_s[lo:hi]) for lo, hi in spans([p.numel() for p in flat_p], cap)]


def check_compensation(value: Any) -> None:
    if value not in COMPENSATIONS:
        raise ValueError(
            f"compensation={value!r} is not supported: use 'kahan' (a 16-bit buffer per param), "
            "'stochastic' (stochastic rounding, no extra state) or None (plain rounding)."
        )


def foreach_cast(tensors: List[torch.Tensor], dtype: torch.dtype) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Copies of ``tensors`` in ``dtype`` as views of one flat buffer: one allocation, one foreach copy.

    Returns ``(flat, views)``.
    """
    numels = [t.numel() for t in tensors]
    flat = torch.empty(sum(numels), dtype=dtype, device=tensors[0].device)
    views = [c.view(t.shape) for c, t in zip(flat.split(numels), tensors)]
    torch._foreach_copy_(views, tensors)
    return flat, views


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


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Undo:
    """Bit-exact ``x = old if skip else x`` for the tensors one bucket's step writes, with foreach ops.

    The tensors are seen as integers of their width: ``snapshot = bits * skip`` before the step,
    ``bits = bits * (1 - skip) + snapshot`` after it. Integer products by 0/1 and a sum where one
    side is 0 are exact, so a skipped step leaves every bit as it was (NaN payloads, -0.0 included)
    and a taken step every bit as computed.
    """

    def __init__(self, tensors: List[torch.Tensor], skip: torch.Tensor) -> None:
        self.groups: Dict[torch.dtype, Tuple[List[torch.Tensor], List[torch.Tensor], torch.Tensor]] = {}
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(_INT_VIEW[t.element_size()], []).append(t.view(_INT_VIEW[t.element_size()]))
        for idt, views in by_dtype.items():
            s = skip.to(idt)
            self.groups[idt] = (views, torch._foreach_mul(views, s), 1 - s)

    def __call__(self) -> None:
        for views, saved, keep in self.groups.values():
            torch._foreach_mul_(views, keep)
            torch._foreach_add_(views, saved)


class _Target:
    """Where one bucket's update accumulates, and how it lands in the params (see module doc)."""

    def __init__(self, mode: Optional[str], params: List[torch.Tensor], states: List[dict],
                 generator_fn: Callable[[], torch.Generator], skip: Optional[torch.Tensor] = None) -> None:
        self.mode = mode
        self.params = params
        #: the step's skip flag on the device (bool, 0-dim) or None: the bucket is restored after the
        #: update when it is set; state created during the update must honour it itself
        self.skip = skip
        self._generator_fn = generator_fn
        self._flat: Optional[torch.Tensor] = None
        if mode == "kahan":
            self.tensors = [s["compensation"] for s in states]
        elif mode == "stochastic":
            self._flat, self.tensors = foreach_cast(params, torch.float32)  # exact upcast
        else:
            self.tensors = params

    @property
    def generator(self) -> torch.Generator:
        """The stochastic-rounding generator of this bucket's device (created on first use)."""
        return self._generator_fn()

    def decay_(self, amount: Any) -> None:
        """Decoupled weight decay ``w -= amount * w``: multiplied into a weight, added to a Kahan buffer.
        ``amount`` may be a device tensor (a tensor lr)."""
        if isinstance(amount, torch.Tensor):
            if self.mode == "kahan":
                torch._foreach_add_(self.tensors, torch._foreach_mul(self.params, -amount))
            else:
                torch._foreach_mul_(self.tensors, 1.0 - amount)
        elif self.mode == "kahan":
            torch._foreach_add_(self.tensors, self.params, alpha=-amount)
        else:
            torch._foreach_mul_(self.tensors, 1.0 - amount)

    def finish(self) -> None:
        """Move the accumulated update into the params."""
        if self.mode == "kahan":
            kahan_add_(self.params, self.tensors)
        elif self.mode == "stochastic":
            stochastic_round_(self._flat, self.generator)
            torch._foreach_copy_(self.params, self.tensors)  # exact: low bits are zero
            self._flat = None


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
        seed: seed of the stochastic-rounding generator; None derives it from
            ``torch.initial_seed()`` (so ``torch.manual_seed`` makes runs reproducible). The
            generator state is saved in ``state_dict()``.
    """

    #: elements per foreach batch (None: see ``_cap``: a 32nd of the params, at most 2**20 on CPU, 2**24
    #: elsewhere). The compensated update makes ~20 passes over fp32 copies; batches that stay in cache ran
    #: 2.4x faster on CPU than one pass over all params, and they bound the transient fp32 copies (and the
    #: skip's snapshot) to the batch: a param bigger than a batch (an embedding) is updated in slices.
    bucket_numel: Optional[int] = None

    #: torch's amp protocol: a scaler sets ``found_inf`` (and ``grad_scale`` when the grads are still
    #: scaled) and the step skips on the device, as torch's fused Adam does: no host read
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults: Dict[str, Any], *, compensation: Optional[str] = "kahan",
                 state_dtype: Optional[torch.dtype] = None, seed: Optional[int] = None) -> None:
        check_compensation(compensation)
        if state_dtype not in _STATE_DTYPES:
            raise ValueError(f"state_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, got {state_dtype}.")
        self.state_dtype = state_dtype
        self.seed = seed
        self._generators: Dict[str, torch.Generator] = {}
        super().__init__(params, {**defaults, "compensation": compensation})

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        check_compensation(param_group.get("compensation", self.defaults.get("compensation")))
        super().add_param_group(param_group)

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

    def _update(self, group: Dict[str, Any], params: List[torch.Tensor], grads: List[torch.Tensor],
                states: List[Dict[str, Any]], target: _Target) -> None:
        raise NotImplementedError

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            seed = self.seed if self.seed is not None else torch.initial_seed() ^ 0x5EED5EED
            gen.manual_seed(seed % (1 << 63))
            self._generators[key] = gen
        return gen

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
            params.append(p)
            grads.append(p.grad)
            states.append(state)
        return buckets

    # ------------------------------------------------------------------ step
    def _cap(self, device: torch.device, total: int) -> int:
        """Elements per foreach batch: ``bucket_numel``, else a 32nd of the params (at least 2**15), at most
        2**20 on CPU (2**24 elsewhere). The update's fp32 temporaries (~20 B per element at most, the skip's
        snapshot included) then stay under ~0.6 B per parameter of the model."""
        if self.bucket_numel:
            return self.bucket_numel
        return max(1 << 15, min(total // 32, 1 << 20 if device.type == "cpu" else 1 << 24))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf: Optional[torch.Tensor] = getattr(self, "found_inf", None)
        grad_scale: Optional[torch.Tensor] = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            for (device, dtype), (params, grads, states) in self._buckets(group).items():
                mode = group["compensation"] if dtype in LOW_PRECISION else None
                if mode == "stochastic" and dtype != torch.bfloat16:
                    raise ValueError(
                        f"compensation='stochastic' rounds to bfloat16; found {dtype} params. "
                        "Use compensation='kahan' for float16 params."
                    )
                gen = functools.partial(self._generator, device)
                skip = keep = None
                if found_inf is not None:
                    skip = found_inf.to(device, non_blocking=True).reshape(()) > 0
                    keep = (~skip).to(torch.float32)
                scale = None if grad_scale is None else grad_scale.to(device, non_blocking=True).reshape(())
                # step counts once per param (a param split into pieces shares its count), masked by the skip
                steps = [s["step"] for s in states if "step" in s]
                if steps:
                    if keep is None:
                        torch._foreach_add_(steps, 1.0)
                    else:  # a list of 0-d tensors: the Tensor-scalar overload reads the scalar on CPU
                        torch._foreach_add_(steps, [keep] * len(steps))
                for ps, gs, ss in pieces(params, grads, states, self._cap(device, sum(p.numel() for p in params))):
                    if scale is not None:  # grads still scaled: unscale copies (the model's grads stay)
                        gs = torch._foreach_div(gs, scale)
                    undo = None
                    if skip is not None:
                        undo = _Undo(ps + [v for st in ss for k, v in st.items()
                                           if isinstance(v, torch.Tensor) and k not in _SHARED], skip)
                    self._update(group, ps, gs, ss, _Target(mode, ps, ss, gen, skip))
                    if undo is not None:
                        undo()
                    del gs, undo
                self._after_update(group, states, keep)
        return loss

    def _after_update(self, group: Dict[str, Any], states: List[Dict[str, Any]], keep: Optional[torch.Tensor]) -> None:
        """Per-param bookkeeping once all pieces are updated (``keep``: 0.0 on a skipped step, or None)."""

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        if self._generators and sd["param_groups"]:
            # in the first param group, not beside the groups: torch's load_state_dict keeps group keys, so
            # the generators survive a load into the plain torch optimizer before precision.setup() converts
            # it (nanoGPT's resume order; compensated_from restores them)
            sd["param_groups"][0] = {**sd["param_groups"][0],
                                     RNG_KEY: {k: g.get_state() for k, g in self._generators.items()}}
        return sd

    def load_rng_states(self, rng_states: Optional[Dict[str, torch.Tensor]]) -> None:
        """Restore the stochastic-rounding generators from ``state_dict()``'s (per device name)."""
        for key, rng in (rng_states or {}).items():
            self._generator(torch.device(key)).set_state(rng.cpu())  # map_location may have moved it

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        for saved, group in zip(state_dict.get("param_groups", []), self.param_groups):
            if "compensation" in saved:
                check_same_compensation(saved["compensation"], group["compensation"])
        rng_states = state_dict.pop("rng_states", None)  # where they were saved before they moved into a group
        groups = [dict(g) for g in state_dict.get("param_groups", [])]
        for g in groups:
            rng_states = g.pop(RNG_KEY, None) or rng_states
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
        self.load_rng_states(rng_states)
