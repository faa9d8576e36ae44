"""RoundingNoise, the counter-based random bits of stochastic rounding: uniform over 16 bits, determined
by (seed, position) alone, the same compiled and eager, saved and restored with the optimizer, and an
older checkpoint holding ``torch.Generator`` states still loads."""
import io

import pytest
import torch

from ampkit.optim import AdamW, RoundingNoise, compensated_from, stochastic_round_
from ampkit.optim.base import NOISE_KEY


def _chi2(values: torch.Tensor, bins: int) -> float:
    counts = torch.bincount(values.long(), minlength=bins).double()
    expected = values.numel() / bins
    return ((counts - expected) ** 2 / expected).sum().item()


def test_bits_are_uniform_over_16_bits():
    """Chi-square over all 65536 values (df 65535, sd 362), for the whole draw and for each lane of a
    hash (even and odd elements), and for single bits; a fixed seed, so deterministic."""
    lanes = RoundingNoise(0).bits16(1 << 21)  # 32 draws per value expected
    assert lanes.dtype == torch.int16
    bits = lanes.int() + 32768  # the addend stochastic_round_ uses
    assert 0 <= bits.min() and bits.max() <= 65535
    df, sd = 65535, (2 * 65535) ** 0.5
    for sample in (bits, bits[0::2], bits[1::2]):
        assert abs(_chi2(sample, 65536) - df) < 5 * sd
    ones = torch.stack([(bits >> b) & 1 for b in range(16)]).double().mean(1)
    assert ((ones - 0.5).abs() < 5 * 0.5 / bits.numel() ** 0.5).all(), ones
    # consecutive values are not correlated (within a hash and across hashes)
    a, b = bits[:-1].double(), bits[1:].double()
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 5 / bits.numel() ** 0.5


def test_int32_hash_is_the_32_bit_mix():
    """The hash runs in int32 with wrapping products and masked shifts; its bits are those of the ``0x45d9f3b`` mix
    on integers masked to 32 bits after each product (Python's ints here), counters past 2**31 (negative int32s)
    included."""
    from ampkit.optim.noise import as_int32, counters, hash32, high16, low16, mix32

    def mix(x, key):
        for r in range(2):
            x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
            if r == 0:
                x ^= key
        return x

    start, key = 0xFFFFFF00, 0xDEADBEEF  # the counters wrap past 2**32 inside the draw
    x = counters(start, 300)
    assert x.dtype == torch.int32 and int(x[0]) == as_int32(start) and int(x[200]) == as_int32(start + 400)
    k = torch.tensor(as_int32(key), dtype=torch.int32)
    got, mixed = hash32(x, k), mix32(x, k)
    for i in (0, 1, 127, 128, 299):
        want = mix((start + 2 * i) & 0xFFFFFFFF, key)
        assert int(got[i]) & 0xFFFFFFFF == want ^ (want >> 16), i
        assert int(high16(mixed)[i]) == want >> 16  # v's lane: the hash's high half, before the last shift
        assert int(low16(mixed)[i]) == (want ^ (want >> 16)) & 0xFFFF  # m's lane
    assert RoundingNoise(5).next_key().dtype == torch.int32


def test_stream_is_seed_and_position():
    """A draw's bits are a hash of (seed, draw number, index): the counter advances by one per draw whatever its
    size, the same seed and counter give the same bits, and draws, seeds and neighbouring seeds are unrelated."""
    a, b = RoundingNoise(7), RoundingNoise(7)
    first = a.bits16(1000)
    assert a.position.item() == 1  # one draw
    assert torch.equal(first, b.bits16(1000))
    second = a.bits16(1 << 20)
    assert a.position.item() == 2
    # a prefix of a draw is the smaller draw (index-keyed); a restored counter continues exactly
    assert torch.equal(RoundingNoise(7).bits16(600), first[:600])
    assert torch.equal(RoundingNoise(7, position=1).bits16(1000), second[:1000])
    assert torch.equal(RoundingNoise(7).lanes(500).reshape(-1), first)  # the no-copy view: the same values
    # the next draw, other seeds, even neighbouring ones: unrelated streams
    for other in (second[:1000], RoundingNoise(6).bits16(1000), RoundingNoise(8).bits16(1000),
                  RoundingNoise(7 + (1 << 32)).bits16(1000)):
        assert (other == first).double().mean() < 0.01


def test_consecutive_draws_are_uncorrelated():
    """Draw k and draw k+1 (the optimizer's moments, then its params) at the same indices: no correlation,
    and each value of 16 bits equally likely across draws at a fixed index (chi-square over 4096 draws of 256
    bins)."""
    noise = RoundingNoise(3)
    draws = torch.stack([noise.bits16(64).int() + 32768 for _ in range(4096)])  # (draw, index)
    a, b = draws[:-1].double().reshape(-1), draws[1:].double().reshape(-1)
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 5 / a.numel() ** 0.5
    for column in (0, 1, 63):
        counts = torch.bincount(draws[:, column] >> 8, minlength=256).double()
        assert abs(((counts - 16) ** 2 / 16).sum().item() - 255) < 5 * (2 * 255) ** 0.5


@pytest.mark.slow
def test_inductor_rounds_bitwise_like_eager():
    """Integer ops only: inductor's C++ kernel gives the very bits eager gives, and advances the counter."""
    x = torch.randn(3 * (1 << 19) + 5)  # several chunks and an odd tail
    eager_noise, compiled_noise = RoundingNoise(3), RoundingNoise(3)
    eager = stochastic_round_(x.clone(), eager_noise)
    compiled = torch.compile(stochastic_round_, backend="inductor", fullgraph=True)(x.clone(), compiled_noise)
    assert torch.equal(eager.view(torch.int32), compiled.view(torch.int32))
    assert compiled_noise.position.item() == eager_noise.position.item()


def _train(opt, w, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        w.grad = torch.randn(w.shape, generator=g).bfloat16()
        opt.step()


def _saved(opt):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_saves_seed_and_counter():
    w = torch.randn(64, 8).bfloat16().requires_grad_()
    opt = AdamW([w], lr=1e-2, compensation="stochastic", seed=11)
    _train(opt, w, 2)
    sd = _saved(opt)
    noise = sd["param_groups"][0][NOISE_KEY]
    assert noise["seed"] == 11
    assert noise["positions"]["cpu"].item() == opt.noise(w.device).position.item() > 0
    # a new optimizer built with another seed continues the saved stream
    w2 = w.detach().clone().requires_grad_()
    opt2 = AdamW([w2], lr=1e-2, compensation="stochastic", seed=99)
    opt2.load_state_dict(sd)
    _train(opt, w, 3, seed=1)
    _train(opt2, w2, 3, seed=1)
    assert torch.equal(w, w2)


