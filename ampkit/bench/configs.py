"""What `ampkit bench` measures: models, precisions, runners, defaults, the `--quick` preset.

`plan()` turns the user's choices into the list of configurations the runner schedules, and
raises ValueError (one line, saying how to fix it) for anything it cannot run. Nothing here
imports the user's model or touches the device beyond asking what it supports.
"""
from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..precision.modes import AUTO, MODES, resolve

__all__ = ["Settings", "DEFAULTS", "QUICK", "RUNNERS", "REFERENCE_MODELS", "plan", "default_precisions",
           "gpt2_batch_size",
           "baseline_precision", "has_compensated_optim", "config_key", "quick_skips"]

#: reference workloads: batch size and what one sample is (DESIGN.md's measured shapes)
REFERENCE_MODELS: Dict[str, Dict] = {
    "cnn": {"batch_size": 64, "what": "SimpleCNN, 3x32x32 images, 10 classes, AdamW"},
    "resnet": {"batch_size": 64, "what": "ResNet (3 stages, width 32, BatchNorm), 3x32x32 images, AdamW"},
    "gpt": {"batch_size": 16, "what": "GPT d=384, 4 layers, 6 heads, 256 tokens, vocab 256, AdamW"},
    "mlp": {"batch_size": 64, "what": "MLP 3x32x32 -> 256 -> 256 -> 10, AdamW"},
    # the GPU-sized preset: batch from the device's memory (gpt2_batch_size), 1 sequence on a CPU
    "gpt2": {"batch_size": 1, "what": "GPT-2 small (124M): 12 layers, 12 heads, d=768, 1024 tokens, vocab 50257, "
             "tied LM head, AdamW"},
}
USER_BATCH_SIZE = 32

#: GPU memory budgeted per 1024-token GPT-2 sequence, and the batch cap. Estimated, not measured here: fp32
#: keeps ~0.75 GB of activations per sequence (12 layers x 1024 tokens x ~20 d_model fp32 values) plus ~0.6 GB
#: of logits and their softmax; the 3 GiB budget also covers the paired rows' second model and fragmentation.
#: 16 x 1024 tokens per step is where nanoGPT-class runs are (12-16 sequences x 1024 per GPU).
GPT2_GIB_PER_SEQUENCE = 3.0
GPT2_MAX_BATCH = 16


def gpt2_batch_size(device: torch.device) -> int:
    """Sequences per step for the gpt2 preset: on CUDA ~3/4 of the GPU's memory at GPT2_GIB_PER_SEQUENCE
    each, capped at GPT2_MAX_BATCH (an 80 GB H100 -> 16, 40 GB -> 9, 24 GB -> 5); on a CPU 1."""
    if device.type != "cuda":
        return REFERENCE_MODELS["gpt2"]["batch_size"]
    total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    return max(1, min(GPT2_MAX_BATCH, int(0.75 * total_gib / GPT2_GIB_PER_SEQUENCE)))

#: ampkit = Precision hooks (the Trainer's code path); torch-loop = plain nanoGPT-style loop
RUNNERS = ("ampkit", "torch-loop")

#: the plain loop only knows autocast + GradScaler: a mode's baseline is autocast in its dtype
_LOOP_MODES = {None: "fp32", torch.bfloat16: "bf16-mixed", torch.float16: "fp16-mixed"}


@dataclass
class Settings:
    models: List[str] = field(default_factory=lambda: ["cnn", "resnet", "gpt"])
    precisions: Optional[List[str]] = None  # None = every mode that makes sense on the device
    runners: List[str] = field(default_factory=lambda: list(RUNNERS))
    steps: int = 10
    warmup: int = 2
    repeats: int = 3
    batch_size: Optional[int] = None  # None = per-model default (or the preset's batch_sizes)
    batch_sizes: Dict[str, int] = field(default_factory=dict)  # per-model override of the default
    device: str = "cpu"
    compile: bool = False
    lr: float = 1e-3
    seed: int = 0
    timeout_s: float = 900.0  # per worker process
    quick: bool = False
    paired: bool = False  # also time each ampkit mode against its plain loop in one process, alternating
    data: Optional[str] = None  # --data as ampkit train reads it: the models' batches (None: each model's own)
    fp8_filter: Optional[str] = None  # --fp8-filter for the fp8 rows: auto (the modes' default) | ends | all

    def as_dict(self) -> Dict:
        return asdict(self)


DEFAULTS = Settings()
#: --quick: two models, fp32 vs bf16 autocast, both runners, few steps; still interleaved + repeated.
#: The GPT runs 4x256 tokens (not 16x256) so the whole preset fits 2 minutes on a 2-core CPU; where bf16
#: measured slow (emulated) it times the fp32 rows only (:func:`quick_skips`, with a note saying so).
QUICK = Settings(models=["cnn", "gpt"], precisions=["fp32", "bf16-mixed"], steps=3, warmup=2, repeats=2,
                 batch_sizes={"gpt": 4}, timeout_s=300.0, quick=True)


def has_compensated_optim() -> bool:
    """bf16-pure needs ampkit.optim (Kahan-compensated optimizers), built separately."""
    try:
        return importlib.util.find_spec("ampkit.optim") is not None
    except (ImportError, ValueError):
        return False


def baseline_precision(mode: str) -> str:
    """The torch-loop mode a user would write for this ampkit mode: autocast in the same dtype."""
    return _LOOP_MODES[MODES[mode].low_dtype]


def default_precisions(device: torch.device) -> Tuple[List[str], List[str]]:
    """(modes worth measuring on this device, notes on the ones left out and why)."""
    from ..precision.capability import device_info

    info = device_info(device)
    modes, notes = ["fp32"], []
    if device.type == "cuda":
        modes += ["fp16-mixed", "fp16-master"]
        if info.bf16_supported:
            modes[2:2] = ["bf16-mixed"]
            modes += ["bf16-master"]
        else:
            notes.append(f"bf16 modes skipped: {info.name} does not support bf16.")
    else:
        from ..precision.capability import capability

        cap = capability(device)
        slow = _slow_low_precision(device)
        modes += ["bf16-mixed"] if slow else ["bf16-mixed", "bf16-master"]
        if cap.fast("fp16"):
            modes += ["fp16-mixed"]
        else:
            notes.append(f"fp16 modes skipped: {cap.phrase('fp16')} (ask for them with --precisions fp16-mixed "
                         "to measure it).")
        if slow:
            notes.append(f"bf16-master and bf16-pure skipped: {slow}, so only bf16-mixed is measured, to show "
                         "the cost (ask for the others with --precisions).")
            return modes, notes
    if info.bf16_supported or device.type == "cpu":
        if has_compensated_optim():
            modes.append("bf16-pure")
        else:
            notes.append("bf16-pure skipped: it needs ampkit.optim (compensated optimizers), not in this build.")
    notes.append("fp16-pure skipped: no master copy and no compensation, small updates underflow "
                 "(ask for it explicitly).")
    return modes, notes


#: a 16-bit dtype measured below this ratio to fp32 makes a step several times an fp32 one: --quick leaves
#: its rows out (an AVX2 EPYC, bf16 ~0.01x: the CNN's 2.3 s against 0.25 s, the GPT's 12 s against 0.44 s)
QUICK_MIN_RATIO = 0.5


def _slow_low_precision(device: torch.device, dtype: str = "bf16") -> Optional[str]:
    """Why ``dtype``'s steps are several times slower than fp32 here, or None: its matmuls/convs measured
    below :data:`QUICK_MIN_RATIO` of fp32's speed on this machine (emulated, or no fast kernels)."""
    from ..precision.capability import capability

    cap = capability(device)
    if device.type == "cpu" and cap.ratio(dtype) < QUICK_MIN_RATIO:
        return cap.phrase(dtype)
    return None


def _dtype(mode: str) -> Optional[str]:
    low = MODES[mode].low_dtype
    return None if low is None else ("bf16" if low == torch.bfloat16 else "fp16")


def quick_skips(device: torch.device, modes: List[str]) -> Tuple[Optional[str], List[str]]:
    """(why ``--quick`` leaves some 16-bit rows out on this device, their 16-bit dtypes), or (None, []).

    Quick must stay quick on every CPU: where a 16-bit dtype measured below :data:`QUICK_MIN_RATIO` of
    fp32, its rows take several times an fp32 one (minutes where bf16 is emulated), so ``--quick`` times
    them only where they can be fast, and says what it left out."""
    slow = {d: _slow_low_precision(device, d) for d in {_dtype(m) for m in modes} - {None}}
    slow = {d: r for d, r in slow.items() if r}
    left = [m for m in modes if _dtype(m) in slow]
    if not left:
        return None, []
    return (f"--quick left out {', '.join(left)}: {'; '.join(slow.values())}, so a step takes several times an "
            f"fp32 one. Time them without --quick, e.g. `ampkit bench --models cnn --precisions {left[0]}` "
            "(minutes per row here).", sorted(slow))


def _check_model(spec: str) -> str:
    from ..models import REFERENCE, load_factory

    key = spec.strip()
    if key.lower() in REFERENCE:
        if key.lower() == "gpt2":
            from .workload import gpt2_size

            gpt2_size()  # a bad $AMPKIT_BENCH_GPT2 is an input error before any measurement
        return "cnn" if key.lower() == "simple_cnn" else key.lower()
    if ":" in key:
        import os
        import sys

        if os.getcwd() not in sys.path:  # the workers import user modules from the working directory too
            sys.path.insert(0, os.getcwd())
        load_factory(key, "model")  # raises ValueError with the fix
        return key
    raise ValueError(f"Unknown model {spec!r}: use cnn, resnet, gpt, gpt2, mlp or 'pkg.module:factory'.")


def config_key(cfg: Dict) -> Tuple[str, str, str]:
    return cfg["model"], cfg["precision"], cfg["runner"]


def _row_options(s: Settings, mode: str) -> Dict:
    """The settings a row passes on only where given: ``--data``; ``--fp8-filter`` to the fp8 modes' rows."""
    return {**({"data": s.data} if s.data else {}),
            **({"fp8_filter": s.fp8_filter} if s.fp8_filter and mode in MODES and MODES[mode].kind == "fp8" else {})}


def plan(s: Settings) -> Tuple[List[Dict], List[str]]:
    """Configurations to measure (one dict each, sent to a worker) and notes for the report."""
    for name in ("steps", "repeats"):
        if int(getattr(s, name)) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(s, name)}.")
    if s.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {s.warmup}.")
    if s.batch_size is not None and s.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {s.batch_size}.")
    if not s.models:
        raise ValueError("--models is empty: name at least one (cnn, resnet, gpt or pkg.module:factory).")
    bad = [r for r in s.runners if r not in RUNNERS]
    if bad or not s.runners:
        raise ValueError(f"Unknown runner {bad[0] if bad else ''!r}: use {', '.join(RUNNERS)} (comma-separated).")
    from ..precision import resolve_device
    from ..precision.auto import canonical

    device = resolve_device(s.device)
    notes: List[str] = []
    if s.precisions is None:
        precisions, notes = default_precisions(device)
    else:
        precisions = []
        for p in s.precisions:
            name = resolve(p)  # ValueError lists the valid names
            if name == "bf16-pure" and not has_compensated_optim():
                raise ValueError("precision 'bf16-pure' needs ampkit.optim (compensated optimizers), which this "
                                 "ampkit does not have yet: leave bf16-pure out.")
            if name not in precisions:
                precisions.append(name)
        if "fp32" not in precisions:
            precisions.insert(0, "fp32")
            notes.append("fp32 added: every speedup and loss delta is against fp32 of the same model and runner.")
        slow16 = _slow_low_precision(device, "fp16")
        if slow16 and any(_dtype(p) == "fp16" for p in precisions if p != AUTO):
            notes.append(f"fp16 asked for: {slow16}; expect long steps (each worker stops after its timeout).")
    resolved = {p: canonical(p, device) for p in precisions}
    models = []
    for m in s.models:
        key = _check_model(m)
        if key not in models:
            models.append(key)
    skipped, slow_dtypes = quick_skips(device, [resolved[p] for p in precisions]) if s.quick else (None, [])
    if skipped:
        notes.append(skipped)
    configs = []
    for model in models:
        default = (gpt2_batch_size(device) if model == "gpt2"
                   else REFERENCE_MODELS.get(model, {}).get("batch_size", USER_BATCH_SIZE))
        batch = s.batch_size or s.batch_sizes.get(model) or default
        for runner in s.runners:
            if runner == "ampkit":
                modes = precisions
            else:  # the plain loop: autocast in each asked-for dtype (bf16-master -> bf16-mixed)
                modes = list(dict.fromkeys(baseline_precision(resolved[p]) for p in precisions))
            for p in modes:
                if _dtype(resolved.get(p, p)) in slow_dtypes:
                    continue
                configs.append({
                    "model": model, "precision": p, "resolved_precision": resolved.get(p, p), "runner": runner,
                    "batch_size": batch, "steps": s.steps, "warmup": s.warmup, "device": str(device),
                    "compile": bool(s.compile), "lr": s.lr, "seed": s.seed, **_row_options(s, resolved.get(p, p)),
                })
    if s.paired:
        if set(s.runners) != set(RUNNERS):
            raise ValueError("--paired compares ampkit with the plain loop: it needs both runners (leave --runners "
                             "out, or pass --runners ampkit,torch-loop).")
        # one more configuration per ampkit row: both steps in one process, alternating step by step
        configs += [{**c, "runner": "paired", "loop_precision": baseline_precision(c["resolved_precision"])}
                    for c in list(configs) if c["runner"] == "ampkit"]
    if s.compile:
        # with --compile every row is compiled: one more configuration per ampkit row times its compiled
        # step against the same eager step in one process, alternating (the eager side is never compiled)
        configs += [{**c, "runner": "paired-compile"} for c in list(configs) if c["runner"] == "ampkit"]
    if "torch-loop" in s.runners and any(baseline_precision(resolved[p]) != p for p in precisions):
        notes.append("torch-loop rows use plain autocast in the same dtype as the ampkit modes it is the "
                     "baseline for (bf16-master/bf16-pure -> bf16-mixed): that is what a user writes by hand.")
    return configs, notes
