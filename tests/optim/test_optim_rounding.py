"""Rounding primitives: stochastic rounding is unbiased; Kahan keeps increments plain bf16 drops.

The stochastic-rounding tests run with both sources of random bits: a ``torch.Generator`` and the
counter-based :class:`~ampkit.optim.RoundingNoise` the optimizers use."""
import pytest
import torch

from ampkit.optim import RoundingNoise, kahan_add_, stochastic_round, stochastic_round_

SOURCES = {"generator": lambda seed: torch.Generator().manual_seed(seed), "hash": RoundingNoise}
source = pytest.mark.parametrize("noise", list(SOURCES))


def _neighbours(x: torch.Tensor):
    """The bf16 values just below and above each fp32 value (by magnitude truncation)."""
    bits = x.view(torch.int32)
    lo = (bits & -65536).view(torch.float32)
    hi = ((bits & -65536) + 65536).view(torch.float32)
    return lo, hi


@source
def test_stochastic_rounding_is_unbiased(noise):
    # values at known fractions between bf16 neighbours, across exponents and signs
    g = SOURCES[noise](0)
    base = torch.tensor([1.0, 3.0, -1.5, 0.0123, -250.0, 7e-30], dtype=torch.float32)
    fracs = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.97])
    lo = (base.view(torch.int32) & -65536).view(torch.float32)
    hi = ((lo.view(torch.int32)) + 65536).view(torch.float32)
    x = (lo[:, None] + fracs[None, :] * (hi - lo)[:, None]).reshape(-1)  # fp32, between lo and hi
    n = 20000
    out = stochastic_round(x.repeat(n, 1), generator=g).float()  # (n, values)
    lo_x, hi_x = _neighbours(x)
    # only the two neighbours are ever produced
    assert torch.all((out == lo_x) | (out == hi_x))
    f = ((x - lo_x) / (hi_x - lo_x)).double()
    up = (out == hi_x).double().mean(0)
    # binomial test per value: 5 standard errors (fixed seed, so this is deterministic)
    se = torch.sqrt(f * (1 - f) / n)
    assert torch.all((up - f).abs() <= 5 * se + 1e-12), (up - f) / se
    # and so the mean equals the exact value in expectation
    err = (out.double().mean(0) - x.double()).abs()
    assert torch.all(err <= 5 * se * (hi_x - lo_x).abs().double() + 1e-30)


@source
def test_stochastic_rounding_differs_from_nearest_and_accumulates(noise):
    # 1.0 + 1e-4, many times: round-to-nearest never moves, stochastic rounding gets there on average
    g = SOURCES[noise](1)
    w_near = torch.ones(4096, dtype=torch.bfloat16)
    w_sr = torch.ones(4096, dtype=torch.bfloat16)
    for _ in range(1000):
        w_near = (w_near.float() + 1e-4).to(torch.bfloat16)
        w_sr = stochastic_round(w_sr.float() + 1e-4, generator=g)
    assert torch.all(w_near == 1.0)
    assert w_sr.float().mean().item() == pytest.approx(1.1, abs=0.01)


@source
def test_stochastic_rounding_keeps_exact_and_special_values(noise):
    x = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), float("nan"), 3.3895e38])
    x[:4] = x[:4].bfloat16().float()
    for seed in range(5):
        y = stochastic_round(x, generator=SOURCES[noise](seed))
        assert y.dtype == torch.bfloat16
        assert torch.equal(y[:6].float(), x[:6])
        assert torch.isnan(y[6])
        assert y[7].float() >= 3.38e38  # largest finite bf16 or, rounded up, inf


def test_stochastic_round_in_place_needs_contiguous_fp32():
    with pytest.raises(ValueError, match="contiguous float32"):
        stochastic_round_(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="non-contiguous"):
        stochastic_round_(torch.zeros(4, 4).t())
    x = torch.randn(3, 5)
    y = x.clone()
    stochastic_round_(y, torch.Generator().manual_seed(0))
    assert torch.equal(y, y.bfloat16().float())  # exactly representable now
    assert torch.all((y - x).abs() < x.abs() * 2 ** -7)


def test_kahan_add_keeps_small_increments():
    n_steps, inc = 1000, 1e-4  # each increment is 1/39 of bf16's half-ulp at 1.0
    plain = [torch.ones(8, dtype=torch.bfloat16)]
    params = [torch.ones(8, dtype=torch.bfloat16)]
    comps = [torch.zeros(8, dtype=torch.bfloat16)]
    for _ in range(n_steps):
        plain[0].add_(inc)
        comps[0].add_(inc)
        kahan_add_(params, comps)
    assert torch.all(plain[0] == 1.0)  # plain bf16 lost all of the 0.1
    exact = 1 + n_steps * inc
    # the weight is the bf16 value nearest the exact sum; weight + buffer (the buffer has 8 bits
    # too, so each add rounds at ~2**-16) keeps the sum of increments to within 5% (measured 2.7%)
    assert torch.all(params[0] == torch.tensor(exact).to(torch.bfloat16))
    assert torch.all((params[0].float() + comps[0].float() - exact).abs() < 0.05 * n_steps * inc)


def test_hash_noise_keeps_positive_nans_with_a_full_payload():
    """The int32 view of such a NaN plus a 16-bit addend would overflow (what random_'s path wraps into
    -0.0); the hash path clamps first, so every positive NaN stays NaN, and the sign of -NaN is kept."""
    bits = torch.tensor([0x7FFFFFFF, 0x7FFF8000, 0x7FC00000, -0x400000], dtype=torch.int32)
    x = bits.view(torch.float32).repeat(1000)
    y = stochastic_round(x, generator=RoundingNoise(0))
    assert torch.isnan(y).all()
