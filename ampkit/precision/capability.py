"""What 16-bit math buys on this device, measured: fp32 / bf16 / fp16 throughput of a few GEMM and
convolution shapes that stand for training, taken once per machine and cached.

CPU flags say which instructions exist, not what is fast: an Intel Xeon whose flags list AVX512-BF16 and
AVX512-FP16 but no AMX runs bf16 matmuls at ~0.55x fp32 and fp16 at ~1.0x; an AVX512 Xeon without bf16
instructions runs oneDNN's emulated bf16 at ~0.25x; an AMX Xeon ~2x; an AVX512-BF16 EPYC 2.3-2.6x; an
AVX2-only EPYC ~0.01x. So every decision that asks "is bf16 (fp16) fast here" reads :func:`capability`:
`auto`'s mode and candidates, the slow-mode warnings, the channels_last rule, `ampkit check`'s
recommendation and the bench's plan. The flags only decide what is worth timing: a dtype whose smallest
probe already runs many times slower than fp32 (scalar emulation) is not timed at the larger shapes.

The probe takes a fraction of a second and is cached in ``$AMPKIT_CACHE_DIR/capability.json`` (default
``~/.cache/ampkit``), keyed by the CPU's name and ISA (or the GPU's name), torch's version and the thread
count; delete that file (or set ``AMPKIT_CACHE_DIR``) to measure again. ``$AMPKIT_CPU_CAPS`` forces the
answer for tests and what-ifs: a CPU kind (``amx``, ``avx512_bf16``, ``avx512_fp16``, ``avx512``, ``avx2``:
that kind's measured ratios) or the ratios themselves (``bf16=0.55,fp16=1.0``).
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F

from ..utils.cache import cache_file, load_entries, store_entry
from .device import CPU_CAPS_ENV, cpu_flags, cpu_name, forced_cpu_caps, forced_cpu_kind, machine_key, resolve_device

__all__ = ["Capability", "capability", "measure_again", "DeviceInfo", "device_info", "capability_cache_path", "FAST", "SLOW", "DTYPES", "dtype_name"]

#: a 16-bit dtype whose probe runs at least this many times fp32's throughput is "fast": a mixed step also
#: pays casts and fp32 norms, so a GEMM only a few percent faster does not make the step faster
FAST = 1.15
#: below this the dtype is slower than fp32 beyond noise: choosing it by hand gets a one-line warning
SLOW = 0.9
#: where the smallest probe of a dtype runs this many times slower than fp32, it is emulated in scalar code:
#: the larger shapes are not timed (they would take seconds); so is a dtype whose calls have used up
#: its time budget
_EMULATED = 6.0
_BUDGET_S = 0.25
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_PROBE_VERSION = 1  # bump when the probe's shapes or method change: older cached answers are measured again


def dtype_name(dtype: torch.dtype) -> str:
    return next((k for k, v in DTYPES.items() if v == dtype), str(dtype).replace("torch.", ""))


def capability_cache_path() -> str:
    return cache_file("capability.json")


@dataclass(frozen=True)
class Capability:
    """Throughput of each 16-bit dtype relative to fp32 on one device.

    Attributes:
        speed: ``{"bf16": r, "fp16": r}``: geometric mean over the probe's GEMMs and convolutions of
            fp32's time over the dtype's (2.0: twice as fast as fp32); a dtype the device cannot run is 0.
        gemm, conv: the same over GEMMs only / convolutions only.
        gflops: ``{"fp32": x, "bf16": y, ...}`` the largest GEMM's GFLOP/s per dtype (0 where not timed there).
        source: ``"measured"``, ``"cached"`` (measured earlier on this machine, with the date) or
            ``"forced by $AMPKIT_CPU_CAPS"``.
    """

    device_type: str
    speed: Mapping[str, float]
    gemm: Mapping[str, float] = field(default_factory=dict)
    conv: Mapping[str, float] = field(default_factory=dict)
    gflops: Mapping[str, float] = field(default_factory=dict)
    source: str = "measured"
    measured_at: str = ""

    def ratio(self, name: str) -> float:
        """Throughput of ``name`` ("bf16", "fp16", "fp32") relative to fp32."""
        return 1.0 if name == "fp32" else float(self.speed.get(name, 0.0))

    def fast(self, name: str) -> bool:
        return self.ratio(name) >= FAST

    def slow(self, name: str) -> bool:
        return self.ratio(name) < SLOW

    def conv_fast(self, name: str) -> bool:
        return float(self.conv.get(name, self.ratio(name))) >= FAST

    def fastest(self) -> str:
        """The dtype that runs the probe fastest here ("fp32" unless a 16-bit one is :data:`FAST`)."""
        best = max(("bf16", "fp16"), key=self.ratio)
        return best if self.fast(best) else "fp32"

    def phrase(self, name: str) -> str:
        """``"bf16 matmuls/convs 0.55x fp32 here (measured)"``."""
        return f"{name} matmuls/convs {_x(self.ratio(name))} fp32 here ({self.how()})"

    def summary(self) -> str:
        """``"bf16 0.55x, fp16 1.01x fp32 (measured)"``: every 16-bit dtype's ratio."""
        return f"{', '.join(f'{n} {_x(self.ratio(n))}' for n in ('bf16', 'fp16'))} fp32 ({self.how()})"

    def how(self) -> str:
        return self.source if not self.measured_at or self.source != "cached" else f"measured {self.measured_at}"

    def as_dict(self) -> Dict:
        return asdict(self)


def _x(r: float) -> str:
    return "n/a" if r <= 0 else (f"{r:.2f}x" if r < 10 else f"{r:.0f}x")


def capability(device=None) -> Capability:
    """This device's measured :class:`Capability` (forced by ``$AMPKIT_CPU_CAPS`` on a CPU); measured
    at most once per machine, torch version and thread count (cached on disk), once per process in memory."""
    dev = resolve_device(device)
    forced = forced_cpu_caps() if dev.type == "cpu" else None
    return _capability(dev.type, dev.index, forced, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _capability(dev_type: str, index: Optional[int], forced: Optional[Tuple[Tuple[str, float], ...]],
                threads: int) -> Capability:
    if forced is not None:
        speed = dict(forced)
        return Capability(dev_type, speed, dict(speed), dict(speed), {}, f"forced by ${CPU_CAPS_ENV}")
    dev = torch.device(dev_type, index) if index is not None else torch.device(dev_type)
    key = f"{machine_key(dev)}|probe{_PROBE_VERSION}"
    hit = load_entries(capability_cache_path()).get(key)
    if isinstance(hit, dict):
        try:
            return Capability(dev_type, hit["speed"], hit["gemm"], hit["conv"], hit["gflops"], "cached",
                              hit.get("measured_at", ""))
        except (KeyError, TypeError):
            pass  # an older or damaged entry: measured again
    cap = _measure(dev)
    store_entry(capability_cache_path(), key, _entry(cap))
    return cap


def measure_again(device=None) -> Capability:
    """Measure this device now whatever the cache holds, store the answer and use it from here on (a
    forced ``$AMPKIT_CPU_CAPS`` answer is not measured: it is returned as it is)."""
    dev = resolve_device(device)
    if dev.type == "cpu" and forced_cpu_caps() is not None:
        return capability(dev)
    _capability.cache_clear()
    cap = _measure(dev)
    store_entry(capability_cache_path(), f"{machine_key(dev)}|probe{_PROBE_VERSION}", _entry(cap))
    return capability(dev)


def _entry(cap: Capability) -> Dict:
    return {"speed": dict(cap.speed), "gemm": dict(cap.gemm), "conv": dict(cap.conv), "gflops": dict(cap.gflops),
            "measured_at": cap.measured_at}


# ---------------------------------------------------------------------------------------------- the probe
def _probes(dev: torch.device) -> List[Tuple[str, str, float, Callable[[torch.dtype], Callable[[], object]]]]:
    """(kind, name, flops, make(dtype) -> a no-argument call) for each probe shape, smallest first.

    Shapes that stand for training: a square GEMM, a Linear forward (x @ W^T), its weight gradient
    (dY^T @ X, a transposed operand), a 3x3 convolution in NCHW and in channels_last (oneDNN's 16-bit
    kernels prefer the latter: the faster of the two counts). Sizes are small on a CPU (milliseconds in
    fp32) and large on a GPU (where small shapes measure launch overhead, not the math)."""
    big = dev.type == "cuda"
    s = 4096 if big else 512
    m, k, n = (8192, 4096, 4096) if big else (256, 1024, 1024)
    b, c, hw = (64, 256, 56) if big else (8, 64, 32)
    out: List = []

    def gemm(shape_a, shape_b, fn, flops, name, kind="gemm"):
        def make(dt):
            a, w = torch.randn(*shape_a, device=dev, dtype=dt), torch.randn(*shape_b, device=dev, dtype=dt)
            return lambda: fn(a, w)
        out.append((kind, name, flops, make))

    gemm((256, 256), (256, 256), torch.matmul, 2 * 256 ** 3, "matmul256", "small")
    gemm((s, s), (s, s), torch.matmul, 2 * s ** 3, f"matmul{s}")
    gemm((m, k), (n, k), F.linear, 2 * m * k * n, "linear")
    gemm((k, m), (m, n), lambda g, x: g @ x, 2 * m * k * n, "linear_wgrad")
    conv_flops = 2 * b * c * c * 9 * hw * hw
    for fmt in (torch.contiguous_format, torch.channels_last):
        def make(dt, fmt=fmt):
            x = torch.randn(b, c, hw, hw, device=dev, dtype=dt).contiguous(memory_format=fmt)
            w = torch.randn(c, c, 3, 3, device=dev, dtype=dt).contiguous(memory_format=fmt)
            return lambda: F.conv2d(x, w, padding=1)
        out.append(("conv", "conv3x3_nhwc" if fmt == torch.channels_last else "conv3x3", conv_flops, make))
    return out


def _runs(dev: torch.device, dt: torch.dtype) -> bool:
    if dt == torch.float32:
        return True
    if dev.type == "cuda":
        return dt != torch.bfloat16 or torch.cuda.is_bf16_supported()
    try:
        torch.ones(2, 2, dtype=dt) @ torch.ones(2, 2, dtype=dt)
        return True
    except RuntimeError:
        return False


def _timer(dev: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Seconds per call of ``fn`` over ``reps`` calls (the device synchronised around them)."""
    def run(fn, reps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) / reps
    return run


def _measure(dev: torch.device, rounds: int = 3, target_s: float = 0.004) -> Capability:
    """Times every probe in every dtype the device runs: one warm-up call, then ``rounds`` rounds that
    alternate the dtypes (so a burst of other work hits all alike), each a few calls long; the fastest
    round counts (other work on the machine only ever slows a round down)."""
    run = _timer(dev)
    names = [n for n in DTYPES if _runs(dev, DTYPES[n])]
    per: Dict[str, Dict[str, float]] = {}  # probe name -> dtype -> seconds per call
    kinds: Dict[str, str] = {}
    flops: Dict[str, float] = {}
    emulated = set()
    spent: Dict[str, float] = {}
    # fork_rng: the probe's random operands are not the run's draws (a first Precision must not move the seed)
    with torch.no_grad(), torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        for kind, pname, fl, make in _probes(dev):
            kinds[pname], flops[pname] = kind, fl
            live = [n for n in names if n not in emulated]
            calls = {n: make(DTYPES[n]) for n in live}
            first = {n: run(calls[n], 1) for n in live}  # warm-up (kernel selection, allocator)
            for n in live:
                spent[n] = spent.get(n, 0.0) + first[n]
            reps = {n: max(1, min(50, int(target_s / max(first[n], 1e-6)))) for n in live}
            samples: Dict[str, List[float]] = {n: [] for n in live}
            for r in range(rounds):
                for n in (live if r % 2 == 0 else live[::-1]):
                    samples[n].append(run(calls[n], reps[n]))
                    spent[n] += samples[n][-1] * reps[n]
            per[pname] = {n: min(v) for n, v in samples.items()}  # the least disturbed round: what the unit can do
            if kind == "small":  # far slower than fp32 already here: emulated, the larger shapes are not timed
                emulated = {n for n in live if n != "fp32" and per[pname][n] > _EMULATED * per[pname]["fp32"]}
            emulated |= {n for n in live if n != "fp32" and spent[n] > _BUDGET_S}
            del calls

    def mean(dt: str, kind: Optional[str]) -> float:
        if dt not in names:
            return 0.0
        rs = [t["fp32"] / t[dt] for p, t in per.items() if dt in t and (kind is None or kinds[p] == kind)
              and (kinds[p] != "small" or dt in emulated)]
        if not rs:  # emulated: only the small probe was timed
            rs = [t["fp32"] / t[dt] for p, t in per.items() if dt in t]
        return round(math.exp(sum(math.log(r) for r in rs) / len(rs)), 3)

    low = [n for n in DTYPES if n != "fp32"]
    largest = max((p for p in per if kinds[p] == "gemm"), key=lambda p: flops[p])
    return Capability(
        dev.type,
        speed={n: mean(n, None) for n in low},
        gemm={n: mean(n, "gemm") for n in low},
        conv={n: mean(n, "conv") for n in low},
        gflops={n: round(flops[largest] / per[largest][n] / 1e9, 1) for n in names if n in per[largest]},
        source="measured",
        measured_at=time.strftime("%Y-%m-%d %H:%M"),
    )


# --------------------------------------------------------------------------------- the device's answer
@dataclass
class DeviceInfo:
    """What a device is and what it does fast: ``bf16_fast`` / ``fp16_fast`` are measured
    (:class:`Capability`), ``matrix_units`` names what its flags or compute capability list."""

    type: str
    name: str
    bf16_supported: bool
    bf16_fast: bool
    fp16_fast: bool
    matrix_units: str
    speed: Dict[str, float] = field(default_factory=dict)
    speed_source: str = ""
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def device_info(device=None) -> DeviceInfo:
    dev = resolve_device(device)
    cap = capability(dev)
    return _device_info(dev.type, dev.index, forced_cpu_kind() if dev.type == "cpu" else None, cap)


def _device_info(dev_type: str, index: Optional[int], forced: Optional[str], cap: Capability) -> DeviceInfo:
    speed = {"bf16": cap.ratio("bf16"), "fp16": cap.ratio("fp16")}
    notes = [f"16-bit speed: {cap.summary()}"]
    if dev_type == "cuda":
        idx = index or 0
        major, minor = torch.cuda.get_device_capability(idx)
        units = "tensor cores" if major >= 7 else "none"
        notes.append(f"compute capability {major}.{minor}")
        return DeviceInfo("cuda", torch.cuda.get_device_name(idx), torch.cuda.is_bf16_supported(),
                          cap.fast("bf16"), cap.fast("fp16"), units, speed, cap.source, notes)
    flags = cpu_flags()
    units = ", ".join(u for f, u in (("amx_bf16", "AMX-BF16"), ("amx_fp16", "AMX-FP16"),
                                    ("avx512_bf16", "AVX512-BF16"), ("avx512_fp16", "AVX512-FP16")) if f in flags)
    units = units or "none"
    units += f" (forced by ${CPU_CAPS_ENV})" if forced else ""  # every report that names the units says so
    notes.append(f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    if forced:
        notes.append(f"CPU kind forced to {forced} by ${CPU_CAPS_ENV}: decisions as on such a CPU, speed as on this one")
    return DeviceInfo("cpu", cpu_name(), True, cap.fast("bf16"), cap.fast("fp16"), units, speed, cap.source, notes)
