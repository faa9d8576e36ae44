"""Random bits for stochastic rounding made inside the update: a counter-based hash, no RNG state per element.

A ``torch.Generator`` cannot be traced by dynamo (every ``random_(generator=...)`` is a graph break), and
compiled and eager code would not draw the same bits. :class:`RoundingNoise` draws none: the bits for
element ``i`` of a draw are a hash of (seed, draw number, ``i``), as llm.c's and torchao's stochastic
rounding hash (seed, index). The draw number is a counter on the device that every draw advances by one,
so a draw is a fixed handful of elementwise ops whatever its size (no chunks, no host read), the same
seed and counter give the same bits in eager and compiled code on any device, and the state to save for
a bit-exact resume is the seed and the counter.

The hash is the well-known ``0x45d9f3b`` integer mix (xor-shift, multiply; twice; then a last xor-shift) on the
int32 counter ``k1 + i`` (mod ``2**32``), with the draw's key ``(draw * 0x9E3779B1 + k2) mod 2**32`` xor-ed in
between the two rounds (``k1``, ``k2``: hashes of the seed). It runs in int32 with two's-complement wrapping
products, which every backend torch uses gives (eager kernels, inductor's C++ vectors, Triton), and logical
shifts as an arithmetic shift and a mask: vector int32 ops on every CPU, where int64 counters went through a
scalar conversion path in inductor's C++ (the hash of a step cost twice as much). The bits are those of the
same mix on 64-bit integers masked to 32 bits after each product. One hash gives 32 bits, read as two signed
16-bit lanes (a dtype view, no arithmetic: the low lane first on the little-endian machines torch runs on). A
draw of ``n`` values costs ``ceil(n / 2)`` int32s (2 B per value) and one temporary of that size. Up to
``2**31`` draws and ``2**31`` values per draw keep every stream distinct.
"""
from __future__ import annotations

from typing import Union

import torch

__all__ = ["RoundingNoise", "hash32", "mix32", "low16", "high16", "counters", "as_int32"]

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B
_GOLDEN = 0x9E3779B1  # spreads consecutive draw numbers over the 32-bit keys
_LOW16 = 0xFFFF


def _mix_int(x: int) -> int:
    """The hash on a Python int (for the keys, derived once from the seed)."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def as_int32(x: int) -> int:
    """``x mod 2**32`` as a two's-complement int32 value (a counter or key in the hash's ring)."""
    return (x + (1 << 31)) % (1 << 32) - (1 << 31)  # (%, not &: also on a SymInt under torch.compile)


def _shr16(x: torch.Tensor) -> torch.Tensor:
    """A logical shift right by 16 of int32 values (the arithmetic shift and a mask)."""
    return (x >> 16) & _LOW16


def mix32(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The hash's two rounds on the int32 counters ``x`` under ``key``, before its last xor-shift: the high 16 bits
    are already :func:`hash32`'s (that shift leaves them as they are), so a pass that needs only those stops
    here."""
    x = (x ^ _shr16(x)) * _MUL
    x = x ^ key
    return (x ^ _shr16(x)) * _MUL


def hash32(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The draw's hash of the int32 counters ``x`` (``k1`` plus an element's index, mod ``2**32``) under ``key``
    (the draw's 0-d int32 key, :meth:`RoundingNoise.next_key`): 32 uniform bits per value as an int32, out of
    place (what a compiled one-pass update inlines: ``ampkit.optim.onepass``). Equal to
    :meth:`RoundingNoise.hashes`."""
    x = mix32(x, key)
    return x ^ _shr16(x)


def low16(mixed: torch.Tensor) -> torch.Tensor:
    """The low 16 bits of :func:`hash32` from :func:`mix32`'s value, as a value in [0, 65535]."""
    return (mixed ^ _shr16(mixed)) & _LOW16


def high16(mixed: torch.Tensor) -> torch.Tensor:
    """The high 16 bits of :func:`hash32` from :func:`mix32`'s value (its last xor-shift leaves them as they are),
    as a value in [0, 65535]."""
    return _shr16(mixed)


def counters(start: int, n: int, device: Union[str, torch.device, None] = None) -> torch.Tensor:
    """The int32 counters ``start + 2 * i`` (mod ``2**32``) for ``i < n``: element ``i``'s in a draw that
    gives each element two (``ampkit.optim.onepass``: the moments' bits and the param's)."""
    return torch.arange(n, dtype=torch.int32, device=device) * 2 + as_int32(start)


class RoundingNoise:
    """Uniform 16-bit random values from ``hash(seed, draw, index)``; ``position`` is the int64 draw counter
    on ``device``, advanced by one per draw, in place, without a host read.

    Pass it where ``stochastic_round_`` takes a generator: the rounding is then traceable by
    ``torch.compile``, and compiled and eager runs draw the same bits. Save ``seed`` and ``position``
    to continue a stream exactly (the compensated optimizers do, in ``state_dict()``).
    """

    def __init__(self, seed: int, device: Union[str, torch.device, None] = None,
                 position: Union[int, torch.Tensor] = 0) -> None:
        self.position = torch.zeros((), dtype=torch.int64, device=device)
        self.load(seed, position)

    def load(self, seed: int, position: Union[int, torch.Tensor]) -> None:
        """Continue the stream ``seed`` from draw ``position`` (the counter is updated in place)."""
        self.seed = int(seed) % (1 << 64)
        # keys: hashes of the seed's halves, so seeds 0 and 1 give unrelated streams
        self._k1 = _mix_int((self.seed & _M32) ^ 0x5EED5EED)
        self._k2 = _mix_int(((self.seed >> 32) & _M32) ^ _mix_int(self._k1 ^ 0x9E3779B9))
        self.position.copy_(torch.as_tensor(position, dtype=torch.int64))  # map_location may have moved it

    @property
    def k1(self) -> int:
        """The stream's first key: element ``i`` of a draw hashes ``k1 + i``."""
        return self._k1

    def next_key(self) -> torch.Tensor:
        """The next draw's key (0-d int32 on the device; the counter advances by one): with :func:`hash32`,
        the bits of element ``i`` of that draw are ``hash32(as_int32(k1 + i), key)``."""
        key = self.position.mul(_GOLDEN).add_(self._k2 + (1 << 31)).bitwise_and_(_M32).sub_(1 << 31)
        self.position.add_(1)
        return key.to(torch.int32)

    def hashes(self, m: int) -> torch.Tensor:
        """``m`` int32 values holding 32 uniform bits each (one draw: the counter advances by one).

        A fixed handful of elementwise ops whatever ``m``; under torch.compile inductor fuses them into one
        kernel."""
        key = self.next_key()
        x = torch.arange(m, dtype=torch.int32, device=self.position.device).add_(as_int32(self._k1))
        # hash32 in place (one temporary of m int32s at a time): the two rounds with the key between, the last shift
        x.bitwise_xor_(_shr16(x)).mul_(_MUL).bitwise_xor_(key)
        x.bitwise_xor_(_shr16(x)).mul_(_MUL)
        return x.bitwise_xor_(_shr16(x))

    def bits16(self, n: int) -> torch.Tensor:
        """``n`` values uniform in ``[-32768, 32767]`` (int16) from one draw. Add 32768 for a uniform value in
        ``[0, 65535]``."""
        return self.hashes((n + 1) // 2).view(torch.int16)[:n]  # each hash's two int16 lanes

    def lanes(self, m: int) -> torch.Tensor:
        """``2 * m`` values as :meth:`bits16` gives them, shaped ``(m, 2)`` and without a copy (a view of the
        hashes): what an int32 tensor viewed as ``(m, 2)`` adds in place."""
        return self.hashes(m).view(torch.int16).view(m, 2)

    def __repr__(self) -> str:
        return f"RoundingNoise(seed={self.seed}, device={self.position.device})"
