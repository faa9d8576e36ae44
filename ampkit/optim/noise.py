"""Random bits for stochastic rounding made inside the update: a counter-based hash, no RNG state per element.

A ``torch.Generator`` cannot be traced by dynamo (every ``random_(generator=...)`` is a graph break), and
compiled and eager code would not draw the same bits. :class:`RoundingNoise` draws none: the bits for
element ``i`` of a draw are a hash of (seed, draw number, ``i``), as llm.c's and torchao's stochastic
rounding hash (seed, index). The draw number is a counter on the device that every draw advances by one,
so a draw is a fixed handful of elementwise ops whatever its size (no chunks, no host read), the same
seed and counter give the same bits in eager and compiled code on any device, and the state to save for
a bit-exact resume is the seed and the counter.

The hash is the well-known ``0x45d9f3b`` integer mix (xor-shift, multiply, mask; twice; then a last
xor-shift) on ``i + k1``, with the draw's key ``(draw * 0x9E3779B1 + k2) mod 2**32`` xor-ed in between
the two rounds (``k1``, ``k2``: hashes of the seed). Every intermediate is an int64 holding a value below
``2**33`` (masked after each multiply, and ``0x45d9f3b < 2**27``, so a product stays below ``2**60``): no
signed overflow in eager torch, inductor's C++ or Triton. One hash gives 32 bits, read as two signed
16-bit lanes (a dtype view, no arithmetic; the int64's two low int16 lanes on the little-endian machines
torch runs on). A draw of ``n`` values costs ``ceil(n / 2)`` int64s (4 B per value) and one temporary of
that size. Up to ``2**31`` draws and ``2**32`` values per draw keep every stream distinct.
"""
from __future__ import annotations

from typing import Union

import torch

__all__ = ["RoundingNoise"]

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: a 33-bit value times it stays below 2**60
_GOLDEN = 0x9E3779B1  # spreads consecutive draw numbers over the 32-bit keys


def _mix_int(x: int) -> int:
    """The hash on a Python int (for the keys, derived once from the seed)."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def _round_(x: torch.Tensor) -> torch.Tensor:
    """One round of the mix, in place, on an int64 tensor of values below 2**33: xor-shift, multiply, mask."""
    return x.bitwise_xor_(x >> 16).mul_(_MUL).bitwise_and_(_M32)


def hash32(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The draw's hash of the int64 counters ``x`` (values below 2**33: ``k1`` plus an element's index) under
    ``key`` (the draw's 0-d int64 key, :meth:`RoundingNoise.next_key`): 32 uniform bits per value, out of place
    (what a compiled one-pass update inlines: ``ampkit.optim.onepass``). Equal to :meth:`RoundingNoise.hashes`."""
    x = ((x ^ (x >> 16)) * _MUL) & _M32
    x = (((x ^ key) ^ ((x ^ key) >> 16)) * _MUL) & _M32
    return x ^ (x >> 16)


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
        """The next draw's key (0-d int64 on the device; the counter advances by one): with :func:`hash32`,
        the bits of element ``i`` of that draw are ``hash32(k1 + i, key)``."""
        key = self.position.mul(_GOLDEN).add_(self._k2).bitwise_and_(_M32)
        self.position.add_(1)
        return key

    def hashes(self, m: int) -> torch.Tensor:
        """``m`` int64 values holding 32 uniform bits each (one draw: the counter advances by one).

        Sixteen elementwise ops (four of them on the 0-d key), whatever ``m``; under torch.compile inductor
        fuses them into one kernel."""
        key = self.next_key()
        x = torch.arange(self._k1, self._k1 + m, dtype=torch.int64, device=self.position.device)
        _round_(x)
        _round_(x.bitwise_xor_(key))
        return x.bitwise_xor_(x >> 16)

    def bits16(self, n: int) -> torch.Tensor:
        """``n`` values uniform in ``[-32768, 32767]`` (int16) from one draw. Add 32768 for a uniform value in
        ``[0, 65535]``."""
        m = (n + 1) // 2
        # the 32 hashed bits as two int16 lanes: the low two of the int64's four (little-endian)
        return self.hashes(m).view(torch.int16).view(m, 4)[:, :2].reshape(-1)[:n]

    def lanes(self, m: int) -> torch.Tensor:
        """``2 * m`` values as :meth:`bits16` gives them, shaped ``(m, 2)`` and without a copy (a view of the
        hashes): what an int32 tensor viewed as ``(m, 2)`` adds in place."""
        return self.hashes(m).view(torch.int16).view(m, 4)[:, :2]

    def __repr__(self) -> str:
        return f"RoundingNoise(seed={self.seed}, device={self.position.device})"
