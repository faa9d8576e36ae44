"""What the device can do in 16 bits, and the choice `auto` makes from it."""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

import torch

__all__ = ["DeviceInfo", "device_info", "resolve_device", "auto_mode", "cpu_name", "measured_on", "machine_key",
           "CPU_CAPS_ENV", "CPU_KINDS", "forced_cpu_kind", "cpu_kind"]

#: Run as another CPU kind would (CI, tests, "what would ampkit do on an AMX Xeon?"): every decision that
#: depends on the CPU's bf16 support reads the flags below instead of /proc/cpuinfo. Only ampkit's
#: decisions change (auto's mode, the emulated-bf16 warning, bench's plan, check's verdicts); torch's
#: kernels still run at this CPU's speed.
CPU_CAPS_ENV = "AMPKIT_CPU_CAPS"
#: the CPU kinds ampkit tells apart, fastest bf16 first, each with the /proc/cpuinfo flags it stands for
CPU_KINDS = {
    "amx": frozenset({"amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx512bw", "avx2"}),
    "avx512_bf16": frozenset({"avx512_bf16", "avx512f", "avx512bw", "avx2"}),
    "avx2": frozenset({"avx2"}),
}
_KIND_ALIASES = {"amx_bf16": "amx", "avx512bf16": "avx512_bf16", "avx512-bf16": "avx512_bf16"}


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


def forced_cpu_kind() -> Optional[str]:
    """The CPU kind ``$AMPKIT_CPU_CAPS`` forces (``amx``, ``avx512_bf16`` or ``avx2``), or None (detect).
    A value that names no kind is a ValueError naming the valid ones."""
    raw = os.environ.get(CPU_CAPS_ENV, "")
    value = raw.strip().lower()
    if not value:
        return None
    kind = _KIND_ALIASES.get(value, value)
    if kind not in CPU_KINDS:
        raise ValueError(f"{CPU_CAPS_ENV}={raw!r} names no CPU kind: use {', '.join(CPU_KINDS)}, "
                         "or unset it to use this CPU's own flags.")
    return kind


def _cpu_flags() -> frozenset:
    """The CPU's flags, or the forced kind's (``$AMPKIT_CPU_CAPS``): the one source of every bf16 decision."""
    kind = forced_cpu_kind()
    return CPU_KINDS[kind] if kind else frozenset(_cpuinfo("flags").split())


def cpu_kind() -> str:
    """This CPU's kind as ampkit sees it (forced by ``$AMPKIT_CPU_CAPS`` or detected): ``amx``,
    ``avx512_bf16``, ``avx2``, or the widest other ISA found (``avx512f``, ``asimd``, the machine name)."""
    flags = _cpu_flags()
    if "amx_bf16" in flags:
        return "amx"
    return next((f for f in ("avx512_bf16", "avx512f", "avx2", "asimd") if f in flags), platform.machine())


def cpu_name() -> str:
    """The CPU's model name (``platform`` where /proc/cpuinfo has none)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def measured_on(device: torch.device) -> str:
    """What a cached speed verdict depends on: the CPU's name and its widest matrix/vector units, or the
    GPU's name. Model names alone are not enough ("AMD EPYC" has named both an AVX2-only and an
    AVX512-BF16 machine here, where bf16 speeds differ by ~100x). A forced kind says so: its verdicts
    are kept apart from the CPU's own."""
    return _measured_on(device, forced_cpu_kind())


@functools.lru_cache(maxsize=None)
def _measured_on(device: torch.device, forced: Optional[str]) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    flags = _cpu_flags()
    isa = next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "asimd") if f in flags), platform.machine())
    return f"{cpu_name()} [{isa}{', forced' if forced else ''}]"


def machine_key(device: torch.device) -> str:
    """The prefix of every cached speed verdict: where it was measured, with which torch, on how many
    threads (``"AMD EPYC [avx2]|torch2.13.0+cpu|threads2"``)."""
    return f"{measured_on(device)}|torch{torch.__version__}|threads{torch.get_num_threads()}"


@dataclass
class DeviceInfo:
    type: str
    name: str
    bf16_supported: bool
    bf16_fast: bool
    fp16_fast: bool
    matrix_units: str
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=None)
def _device_info(dev_type: str, index: Optional[int], forced: Optional[str]) -> DeviceInfo:
    if dev_type == "cuda":
        idx = index or 0
        major, minor = torch.cuda.get_device_capability(idx)
        name = torch.cuda.get_device_name(idx)
        bf16 = torch.cuda.is_bf16_supported()
        units = "tensor cores" if major >= 7 else "none"
        notes = [f"compute capability {major}.{minor}"]
        return DeviceInfo("cuda", name, bf16, bf16 and major >= 8, major >= 7, units, notes)
    flags = _cpu_flags()
    amx = "amx_bf16" in flags
    avx512_bf16 = "avx512_bf16" in flags
    mkldnn_bf16 = False
    try:  # oneDNN's own verdict (AVX512 without bf16 instructions counts): for the real CPU only
        mkldnn_bf16 = forced is None and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        pass
    units = "AMX-BF16" if amx else ("AVX512-BF16" if avx512_bf16 else "none")
    units += f" (forced by ${CPU_CAPS_ENV})" if forced else ""  # every report that names the units says so
    notes = [f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}"]
    if forced:
        notes.append(f"CPU kind forced to {forced} by ${CPU_CAPS_ENV}: decisions as on such a CPU, speed as on this one")
    if "avx512_fp16" in flags or "amx_fp16" in flags:
        notes.append("fp16 instructions present, but torch's CPU fp16 kernels are far slower than fp32")
    return DeviceInfo(
        "cpu", cpu_name(), True,
        amx or avx512_bf16 or mkldnn_bf16, False, units, notes,
    )


def device_info(device: Union[str, torch.device, None] = None) -> DeviceInfo:
    dev = resolve_device(device)
    return _device_info(dev.type, dev.index, forced_cpu_kind() if dev.type == "cpu" else None)


def auto_mode(device: Union[str, torch.device, None] = None) -> tuple:
    """(canonical mode name, one-line reason) chosen for this device.

    CUDA: bf16 where the GPU has it (no loss scaling to tune), else fp16 with dynamic scaling.
    CPU: a bf16 mode where the CPU has bf16 units (AMX / AVX512-BF16); never fp16 (torch's CPU
    fp16 kernels run far slower than fp32), else fp32.
    """
    info = device_info(device)
    if info.type == "cuda":
        if info.bf16_fast:
            return "bf16-mixed", f"{info.name} has bf16 tensor cores: bf16 autocast, no loss scaling needed"
        if info.fp16_fast:
            return "fp16-mixed", f"{info.name} has fp16 tensor cores but no fast bf16: fp16 autocast with dynamic loss scaling"
        return "fp32", f"{info.name} has no 16-bit matrix units: mixed precision would not be faster"
    if info.bf16_fast:
        return "bf16-mixed", f"CPU has {info.matrix_units}: bf16 matmuls/convs run ~2x faster than fp32"
    return "fp32", "CPU has no bf16 units (AMX/AVX512-BF16) and torch's CPU fp16 is slow: fp32 is fastest"
