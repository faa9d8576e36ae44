"""Random bits for stochastic rounding that torch.compile can trace: a counter-based hash.

A ``torch.Generator`` cannot be traced by dynamo (every ``random_(generator=...)`` is a graph break), and
compiled and eager code would not draw the same bits. :class:`RoundingNoise` draws none: the 16 bits
for an element are a hash of (seed, position), where the position is a counter on the device that
every draw advances. The same seed and position give the same bits in eager and compiled code, on any
device, and the state to save for a bit-exact resume is the seed and the counter.

The hash is the well-known ``0x45d9f3b`` integer mix (xor-shift, multiply, xor-shift, multiply,
xor-shift) on each position's low 32 bits, keyed by the seed before the first round and by the
position's high 32 bits (and the seed again) between the rounds. Every intermediate is an int64
holding a 32-bit value (masked after each multiply, and ``0x45d9f3b < 2**27``, so a product stays
below ``2**59``): no signed overflow in eager torch, inductor's C++ or Triton. One hash gives 32 bits,
read as two signed 16-bit lanes (a dtype view, no arithmetic; the int64's two low int16 lanes on the
little-endian machines torch runs on); draws are made in bounded chunks by the caller.
"""
from __future__ import annotations

from typing import Union

import torch

__all__ = ["RoundingNoise"]

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: a 32-bit value times it stays below 2**59


def _mix_int(x: int) -> int:
    """The hash on a Python int (for the keys, derived once from the seed)."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def _round_(x: torch.Tensor) -> torch.Tensor:
    """One round of the mix, in place, on an int64 tensor of 32-bit values: xor-shift, multiply, mask."""
    return x.bitwise_xor_(x >> 16).mul_(_MUL).bitwise_and_(_M32)


class RoundingNoise:
    """Uniform 16-bit random values from ``hash(seed, position)``; ``position`` is an int64 counter on
    ``device`` that each draw advances (one position per two values), in place, without a host read.

    Pass it where ``stochastic_round_`` takes a generator: the rounding is then traceable by
    ``torch.compile``, and compiled and eager runs draw the same bits. Save ``seed`` and ``position``
    to continue a stream exactly (the compensated optimizers do, in ``state_dict()``).
    """

    def __init__(self, seed: int, device: Union[str, torch.device, None] = None,
                 position: Union[int, torch.Tensor] = 0) -> None:
        self.position = torch.zeros((), dtype=torch.int64, device=device)
        self.load(seed, position)

    def load(self, seed: int, position: Union[int, torch.Tensor]) -> None:
        """Continue the stream ``seed`` from ``position`` (the counter is updated in place)."""
        self.seed = int(seed) % (1 << 64)
        # keys: hashes of the seed's halves, so seeds 0 and 1 give unrelated streams
        self._k1 = _mix_int((self.seed & _M32) ^ 0x5EED5EED)
        self._k2 = _mix_int(((self.seed >> 32) & _M32) ^ _mix_int(self._k1 ^ 0x9E3779B9))
        self.position.copy_(torch.as_tensor(position, dtype=torch.int64))  # map_location may have moved it

    def bits16(self, n: int) -> torch.Tensor:
        """``n`` values uniform in ``[-32768, 32767]`` (int16), and the counter advanced by ``ceil(n / 2)``.

        Add 32768 for a uniform value in ``[0, 65535]``. About 17 elementwise int64 passes over
        ``ceil(n / 2)`` values; under torch.compile inductor fuses them into one kernel.
        """
        m = (n + 1) // 2
        x = torch.arange(m, dtype=torch.int64, device=self.position.device).add_(self.position)
        self.position.add_(m)
        between = (x >> 32).bitwise_xor_(self._k2)  # the high half, keyed: mixed in between the rounds
        _round_(x.bitwise_and_(_M32).bitwise_xor_(self._k1))
        _round_(x.bitwise_xor_(between))
        del between
        x.bitwise_xor_(x >> 16)
        # the 32 hashed bits as two int16 lanes: the low two of the int64's four (little-endian)
        return x.view(torch.int16).view(m, 4)[:, :2].reshape(-1)[:n]

    def __repr__(self) -> str:
        return f"RoundingNoise(seed={self.seed}, device={self.position.device})"
