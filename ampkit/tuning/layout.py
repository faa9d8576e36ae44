"""Memory format, measured: channels_last for a conv model only where it is faster on this device.

Whether NHWC (channels_last) beats NCHW depends on the device, the dtype *and* the model: on a
2-core AVX2 EPYC in fp32, one training step of the reference ResNet ran ~1.2x faster in
channels_last, the two-conv SimpleCNN ~0.9x (slower); on AMX CPUs bf16 convolutions want
channels_last (the oneDNN kernels are blocked for it). A fixed rule is wrong for some model, so
when a batch is at hand (``ampkit.tune``: the Trainer, the bench's ampkit runner) and the
user did not say, ``setup`` uses the layout measured on deep copies of the model: a few optimizer
steps in each, alternating, in the mode that will train. channels_last is kept only when at least
3% faster (a tie keeps the default layout). Verdicts are cached with the auto-mode timings
(``$AMPKIT_CACHE_DIR`` or ``~/.cache/ampkit/layout.json``), keyed by device, torch version,
threads, mode, and the model and batch signature, so a model is timed once per machine.

Without a batch (``Precision.setup`` called alone) the rule stays: channels_last on a CPU with
16-bit compute for models with 2-D convolutions, where it was measured to pay on AMX.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

from torch import nn

from ..precision.device import machine_key, resolve_device
from . import autotune
from .autotune import fmt_ms, signature
from ..utils.cache import cache_file, load_entries, store_entry

__all__ = ["has_conv2d", "faster_layout", "layout_cache_path", "MARGIN"]

MARGIN = 0.97  # channels_last must take at most 97% of the default layout's time


def layout_cache_path() -> str:
    return cache_file("layout.json")


def has_conv2d(model: nn.Module) -> bool:
    """channels_last changes only 4-D tensors: worth measuring for models with 2-D convolutions."""
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def faster_layout(model: nn.Module, inputs: Any, target: Any, loss_fn: Callable, mode: str, device: Any = None,
                  steps: int = 1, warmup: int = 1, rounds: int = 6, log: Optional[Callable[[str], None]] = None,
                  refresh: bool = False, **precision_kwargs: Any) -> Dict[str, Any]:
    """``{"channels_last": bool, "ms": {"contiguous", "channels_last"}, "cached": bool, "reason": str}``
    for training ``model`` on this batch in ``mode``; ``model`` itself is left untouched.

    The two layouts alternate step by step (C L | L C | ...) and each keeps the median of its steps,
    so a burst of other work on a shared machine hits both: with two steps per layout per round, one
    such burst once made channels_last look 2.2x slower (846 vs 386 ms) on a ResNet where it is
    1.2x faster.

    ``precision_kwargs`` are the rest of the ``Precision`` settings the run uses (fp32 modules...);
    ``log`` is told once before a measurement is taken (not when the verdict is cached); ``refresh``
    times again whatever the cache holds (and replaces its entry).
    """
    dev = resolve_device(device)
    key = f"{machine_key(dev)}|{mode}|{signature(model, inputs, target)}"
    hit = None if refresh else load_entries(layout_cache_path()).get(key)
    cached = bool(hit and {"contiguous", "channels_last"} <= set(hit.get("ms", {})))
    if cached:
        ms = hit["ms"]
    else:
        if log:
            log(f"timing NCHW vs channels_last in {mode} on the first batch (at most {2 * (warmup + steps * rounds)} "
                "steps, once per model on this machine; --memory-format skips it)")
        kwargs = {k: v for k, v in precision_kwargs.items() if k != "channels_last"}
        ms = autotune.time_precisions(model, inputs, target, loss_fn,
                             {"contiguous": {"name": mode, "channels_last": False, **kwargs},
                              "channels_last": {"name": mode, "channels_last": True, **kwargs}},
                             dev, steps=steps, warmup=warmup, rounds=rounds)
        store_entry(layout_cache_path(), key, {"ms": ms, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")})
    use = ms["channels_last"] < MARGIN * ms["contiguous"]
    reason = (f"{'channels_last' if use else 'contiguous (NCHW)'}: measured per step, channels_last "
              f"{fmt_ms(ms['channels_last'])} vs {fmt_ms(ms['contiguous'])}{', cached' if cached else ''}")
    return {"channels_last": use, "ms": ms, "cached": cached, "reason": reason}
