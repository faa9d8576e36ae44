"""Which device this is: its name, its CPU flags and kind, the key every cached measurement is filed under,
and what ``$AMPKIT_CPU_CAPS`` forces. What the device does fast is measured, not read from here:
``ampkit.precision.capability``."""
from __future__ import annotations

import functools
import os
import platform
from typing import Optional, Tuple, Union

import torch

__all__ = ["resolve_device", "cpu_name", "measured_on", "machine_key", "CPU_CAPS_ENV", "CPU_KINDS",
           "CPU_KIND_SPEED", "forced_cpu_kind", "forced_cpu_caps", "cpu_kind", "cpu_flags", "onednn_native_bf16"]

#: Run as another CPU would (CI, tests, "what would ampkit do on an AMX Xeon?"): a CPU kind below, or the
#: measured ratios themselves (``bf16=0.55,fp16=1.0``). Every decision that depends on what 16-bit math
#: buys here (auto's mode, the slow-mode warnings, bench's plan, check's verdicts) reads the forced answer
#: instead of this machine's measurement; torch's kernels still run at this CPU's speed.
CPU_CAPS_ENV = "AMPKIT_CPU_CAPS"
#: the CPU kinds seen under this project, each with the /proc/cpuinfo flags it stands for ...
CPU_KINDS = {
    "amx": frozenset({"amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx512bw", "avx2"}),
    "avx512_bf16": frozenset({"avx512_bf16", "avx512f", "avx512bw", "avx2"}),
    "avx512_fp16": frozenset({"avx512_bf16", "avx512_fp16", "avx512f", "avx512bw", "avx2"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx2"}),
    "avx2": frozenset({"avx2"}),
}
#: ... and what its 16-bit GEMMs/convs measured against fp32 there (2 cores, torch 2.13 CPU): an Intel Xeon
#: with AMX-BF16 ~2x; an AMD EPYC with AVX512-BF16 2.3-2.6x; an Intel Xeon listing AVX512-BF16 and
#: AVX512-FP16 but no AMX: bf16 0.51-0.62x, fp16 0.88-1.07x; an Intel Xeon with AVX512 but no bf16
#: instructions (oneDNN emulates bf16): bf16 ~0.25x, fp16 ~0.01x; an AMD EPYC with AVX2 only: ~0.01x.
CPU_KIND_SPEED = {
    "amx": {"bf16": 2.0, "fp16": 0.1},
    "avx512_bf16": {"bf16": 2.4, "fp16": 0.1},
    "avx512_fp16": {"bf16": 0.55, "fp16": 1.0},
    "avx512": {"bf16": 0.25, "fp16": 0.01},
    "avx2": {"bf16": 0.01, "fp16": 0.01},
}
_KIND_ALIASES = {"amx_bf16": "amx", "avx512bf16": "avx512_bf16", "avx512-bf16": "avx512_bf16",
                 "avx512fp16": "avx512_fp16", "avx512-fp16": "avx512_fp16", "avx512f": "avx512"}


def resolve_device(device: Union[str, torch.device, None] = None) -> torch.device:
    """`None` -> cuda if available else cpu; strings are parsed; a bad name is a ValueError."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"Unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'.") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"Device {device!r} was asked for but CUDA is not available here: use --device cpu.")
    return dev


@functools.lru_cache(maxsize=None)
def _cpuinfo(field: str) -> str:
    """The value of the first ``field`` line of /proc/cpuinfo, or '' (no such file: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _parse_caps(raw: str) -> Optional[Tuple[Optional[str], Tuple[Tuple[str, float], ...]]]:
    """``$AMPKIT_CPU_CAPS`` -> (kind or None, ((dtype, ratio), ...)), None where unset; a value that is
    neither a kind nor ``bf16=R,fp16=R`` is a ValueError naming both forms."""
    value = raw.strip().lower()
    if not value:
        return None
    kind = _KIND_ALIASES.get(value, value)
    if kind in CPU_KINDS:
        return kind, tuple(sorted(CPU_KIND_SPEED[kind].items()))
    ratios = {}
    for part in value.split(","):
        name, _, num = part.partition("=")
        try:
            r = float(num)
        except ValueError:
            r = -1.0
        if name.strip() not in ("bf16", "fp16") or not (r >= 0 and r == r):
            raise ValueError(f"{CPU_CAPS_ENV}={raw!r} names no CPU kind: use {', '.join(CPU_KINDS)}, or the "
                             "measured ratios to fp32 (e.g. 'bf16=0.55,fp16=1.0'), or unset it to measure this CPU.")
        ratios[name.strip()] = r
    return None, tuple(sorted({"bf16": 0.0, "fp16": 0.0, **ratios}.items()))


def forced_cpu_kind() -> Optional[str]:
    """The CPU kind ``$AMPKIT_CPU_CAPS`` forces (a key of :data:`CPU_KINDS`), ``"custom"`` for forced
    ratios, or None (this CPU is measured). A value that names no kind is a ValueError naming the valid ones."""
    parsed = _parse_caps(os.environ.get(CPU_CAPS_ENV, ""))
    return None if parsed is None else (parsed[0] or "custom")


def forced_cpu_caps() -> Optional[Tuple[Tuple[str, float], ...]]:
    """The 16-bit speed ratios ``$AMPKIT_CPU_CAPS`` forces (``(("bf16", 2.0), ("fp16", 0.1))``), or None."""
    parsed = _parse_caps(os.environ.get(CPU_CAPS_ENV, ""))
    return None if parsed is None else parsed[1]


def cpu_flags() -> frozenset:
    """The CPU's flags, or the forced kind's (``$AMPKIT_CPU_CAPS``). They name the units a report shows
    and decide what is worth measuring; they decide nothing about speed."""
    kind = forced_cpu_kind()
    return CPU_KINDS.get(kind, frozenset()) if kind else frozenset(_cpuinfo("flags").split())


def cpu_kind() -> str:
    """This CPU's kind by its flags (forced by ``$AMPKIT_CPU_CAPS``, ``custom`` for forced ratios): ``amx``,
    ``avx512_fp16``, ``avx512_bf16``, ``avx512``, ``avx2``, or the widest other ISA (``asimd``, the machine name)."""
    forced = forced_cpu_kind()
    if forced:
        return forced
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "amx"
    kind = next((f for f in ("avx512_fp16", "avx512_bf16", "avx512f", "avx2", "asimd") if f in flags), platform.machine())
    return _KIND_ALIASES.get(kind, kind)


#: oneDNN's ISA caps (``ONEDNN_MAX_CPU_ISA``, or its older name ``DNNL_MAX_CPU_ISA``) that keep its bf16 instructions
_ONEDNN_BF16_CAPS = frozenset({"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX",
                               "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "ALL", "DEFAULT"})


def onednn_native_bf16() -> bool:
    """Does oneDNN run bf16 in bf16 instructions in this process: the CPU has them (AVX512-BF16, AMX-BF16,
    AVX-NE-CONVERT) and oneDNN's ISA cap, where set, keeps them? torch's own check
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) is also true where oneDNN *emulates* bf16 (AVX-512 without
    them, or a cap at ``AVX512_CORE``): there a bf16 matmul holds an fp32 copy of its output (measured, an AMX
    Xeon capped at AVX512_CORE, torch 2.13: 4 B per output element in every transposition pattern; none uncapped).
    The real CPU's flags, not a forced kind's: this is about which kernel runs, not what it is worth."""
    flags = frozenset(_cpuinfo("flags").split())
    if not flags & {"avx512_bf16", "amx_bf16", "avx_ne_convert"}:
        return False
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    if cap == "AVX2_VNNI_2":
        return "avx_ne_convert" in flags
    return not cap or cap in _ONEDNN_BF16_CAPS


def cpu_name() -> str:
    """The CPU's model name (``platform`` where /proc/cpuinfo has none)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def measured_on(device: torch.device) -> str:
    """What a cached speed verdict depends on: the CPU's name and its widest matrix/vector units, or the
    GPU's name. Model names alone are not enough ("AMD EPYC" has named both an AVX2-only and an
    AVX512-BF16 machine here, where bf16 speeds differ by ~100x). A forced kind says so: its verdicts
    are kept apart from the CPU's own."""
    forced = forced_cpu_kind()
    if forced == "custom":  # forced ratios: verdicts kept apart per ratio set
        forced = ",".join(f"{k}={v:g}" for k, v in forced_cpu_caps() or ())
    return _measured_on(device, forced)


@functools.lru_cache(maxsize=None)
def _measured_on(device: torch.device, forced: Optional[str]) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if forced:
        return f"{cpu_name()} [{forced}, forced]"
    flags = cpu_flags()
    isa = next((f for f in ("amx_bf16", "avx512_fp16", "avx512_bf16", "avx512f", "avx2", "asimd") if f in flags),
               platform.machine())
    return f"{cpu_name()} [{isa}]"


def machine_key(device: torch.device) -> str:
    """The prefix of every cached speed verdict: where it was measured, with which torch, on how many
    threads (``"AMD EPYC [avx2]|torch2.13.0+cpu|threads2"``)."""
    return f"{measured_on(device)}|torch{torch.__version__}|threads{torch.get_num_threads()}"
