"""Live tensor bytes under ``FakeTensorMode``: what a step would hold, without the memory or the compute.

``fake_mode()`` is torch's ``FakeTensorMode`` (tensors carry shape, dtype, device and storage, never data).
``LiveBytes`` is a ``TorchDispatchMode`` stacked on it, as torch's own ``MemTracker``
(torch/distributed/_tools/mem_tracker.py) does: every op's output storage is counted when it appears and
uncounted by a weakref finalizer when the storage dies, so the running total follows the live tensors
and its maximum is the peak. Each storage keeps a record (bytes, dtype, the phase that created it, a
category set later by the tracer: weights, grads, optimizer state...); the records live at the peak are
kept, so the peak can be broken down once the step is over. Buffers a kernel allocates inside itself
(CPU convolutions' im2col columns and oneDNN reorders, the fp32 accumulator of torch's own 16-bit GEMM,
gloo's copies in its reduce-scatter and all-gather: ``workspace.py``) are added to the running total for
the op that holds them.
"""
from __future__ import annotations

import weakref
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .workspace import workspace_bytes

__all__ = ["fake_mode", "LiveBytes", "Record"]

# CUDA's caching allocator hands out blocks in multiples of 512 bytes (MemTracker rounds the same way)
_CUDA_BLOCK = 512
# op namespaces of the process group's collectives (their tensors are communication buffers)
_COLLECTIVES = ("c10d", "_c10d_functional")


def fake_mode() -> FakeTensorMode:
    """A ``FakeTensorMode`` whose op outputs are not memoised by weak reference.

    torch 2.13's converter keeps a weakref to every fake op output (``from_meta_and_device``), and
    ``torch.utils.swap_tensors`` (which ``nn.Module.to`` uses for fake parameters) refuses a tensor with a
    weakref: ``model.to(torch.bfloat16)`` fails on fake parameters. The memo only serves lookups of the
    fresh meta tensor it was just given, so building the ``FakeTensor`` directly changes nothing else.
    Real tensors met under the mode (a user's constant) are converted as torch does.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def from_meta_and_device(fake, t, device, pytype=None, dispatch_keys=None):
        return FakeTensor(fake, t, device, pytype=pytype, dispatch_keys=dispatch_keys)

    mode.fake_tensor_converter.from_meta_and_device = from_meta_and_device
    return mode


class Record:
    """One storage: its bytes, first dtype, the phase that created it, and its category once known."""

    __slots__ = ("ref", "nbytes", "dtype", "phase", "category", "__weakref__")

    def __init__(self, ref, nbytes: int, dtype: torch.dtype, phase: str) -> None:
        self.ref, self.nbytes, self.dtype, self.phase, self.category = ref, nbytes, dtype, phase, None


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live storages; ``peak`` and ``at_peak`` (the records live then).

    ``phase`` is set by the caller ("setup", "forward", "backward", "step") and stamped on new storages.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.live: Dict[int, Record] = {}
        self.current = 0
        self.peak = 0
        self.peak_phase = "setup"
        self.at_peak: List[Tuple[Record, int]] = []  # (record, its bytes at the peak)
        self.phase = "setup"
        self._raised = False

    # ------------------------------------------------------------------ counting
    def _bytes(self, st: torch.UntypedStorage) -> int:
        n = st.nbytes()
        if self.device.type == "cuda":
            return -(-n // _CUDA_BLOCK) * _CUDA_BLOCK
        return n

    def track(self, t) -> Optional[Record]:
        """Count ``t``'s storage if it is new; returns its record (None for non-tensors)."""
        if not isinstance(t, torch.Tensor):
            return None
        local = getattr(t, "_local_tensor", None)  # a DTensor (FSDP2's shards): this rank's local tensor
        if isinstance(local, torch.Tensor):
            t = local
        if t.device.type == "meta" and not isinstance(t, FakeTensor):
            return None
        st = t.untyped_storage()
        key = id(st)
        rec = self.live.get(key)
        if rec is not None and rec.ref() is st:
            return rec
        n = self._bytes(st)

        def gone(_ref, key=key) -> None:
            r = self.live.get(key)
            if r is not None and r.ref is _ref:
                del self.live[key]
                self.current -= r.nbytes

        rec = Record(weakref.ref(st, gone), n, t.dtype, self.phase)
        self.live[key] = rec
        self.current += n
        if self.current > self.peak:
            self.peak, self.peak_phase, self._raised = self.current, self.phase, True
        return rec

    def track_all(self, tensors: Iterable, category: Optional[str] = None) -> None:
        """Count these tensors (if new) and, given a category, tag their storages with it."""
        for t in tensors:
            rec = self.track(t)
            if rec is not None and category is not None:
                rec.category = category

    def resized(self, t: torch.Tensor, category: Optional[str] = None) -> None:
        """``t``'s storage was resized in place (FSDP2 frees and re-allocates its unsharded parameters with
        ``untyped_storage().resize_``, no new storage): count its new size."""
        st = t.untyped_storage()
        rec = self.live.get(id(st))
        if rec is None or rec.ref() is not st:
            rec = self.track(t)
        else:
            n = self._bytes(st)
            self.current += n - rec.nbytes
            rec.nbytes = n
            if self.current > self.peak:
                self.peak, self.peak_phase, self._raised = self.current, self.phase, True
        self._snapshot_if_raised()
        if rec is not None and category is not None and rec.category is None:
            rec.category = category

    def restart_peak(self, phase: str) -> None:
        """Count the peak again from the bytes live now (a kept step run at another batch size)."""
        self.peak, self.peak_phase, self._raised = self.current, phase, False
        self.at_peak = [(r, r.nbytes) for r in self.live.values()]

    def _snapshot_if_raised(self) -> None:
        if self._raised:  # one copy per op that raised the peak, not per storage
            self.at_peak = [(r, r.nbytes) for r in self.live.values()]
            self._raised = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.track(t)
        if getattr(func, "namespace", "") in _COLLECTIVES:  # the buffers a collective sends or receives
            for t in tree_flatten((args, kwargs, out))[0]:
                rec = self.track(t)
                if rec is not None and rec.category is None:
                    rec.category = "comm_buffers"
        self._snapshot_if_raised()
        extra = workspace_bytes(func, args, self.device)
        if extra and self.current + extra > self.peak:  # the kernel's own buffers, live while it ran
            self.peak, self.peak_phase = self.current + extra, self.phase
            ws = Record(None, extra, args[0].dtype, self.phase)
            ws.category = "comm_buffers" if getattr(func, "namespace", "") in _COLLECTIVES else "workspace"
            self.at_peak = [*((r, r.nbytes) for r in self.live.values()), (ws, extra)]
        return out

    # ------------------------------------------------------------------ reading
    def breakdown(self) -> Dict[str, int]:
        """Bytes live at the peak, by category. Storages never tagged are ``activations`` (made by the
        forward: kept for backward) or ``temporaries`` (made by backward or the optimizer step); fp8
        storages are ``fp8_casts`` (the weight and activation casts of the fp8 GEMMs)."""
        out: Dict[str, int] = {}
        for rec, nbytes in self.at_peak:
            cat = rec.category
            if cat is None:
                if "float8" in str(rec.dtype):
                    cat = "fp8_casts"
                elif rec.phase == "forward":
                    cat = "activations"
                elif rec.phase == "setup":
                    cat = "other"
                else:
                    cat = "temporaries"
            out[cat] = out.get(cat, 0) + nbytes
        return out
