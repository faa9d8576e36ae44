"""ampkit.optim.bitcast: inductor's C++ float32/int32 views in vector form, inside the wrapped calls only."""
import pytest
import torch

from ampkit.optim import bitcast
from ampkit.optim.onepass import _sr
from optim_helpers import copies_bit_views_by_element


def _round(x: torch.Tensor, r: torch.Tensor, out: torch.Tensor) -> None:
    """The update's stochastic rounding: two views per value (fp32 bits to int32, and back)."""
    out.copy_(_sr(x, r).to(torch.bfloat16))


def _compiled_code(fn, *args):
    """The C++ generated for ``fn(*args)`` here: in a cache of its own (a hit in the FX graph or AOTAutograd cache,
    which any earlier run may have filled, generates no code)."""
    from torch._inductor.utils import fresh_inductor_cache, run_and_get_code

    with fresh_inductor_cache():
        _, codes = run_and_get_code(fn, *args)
    assert codes, "inductor generated no code"
    return "\n".join(codes)


@pytest.mark.machine_kind  # (inductor's ISA follows the CPU: AVX-512, AVX2, or scalar code without vectors)
def test_the_rounding_compiles_to_vector_views_with_eager_bits():
    torch._dynamo.reset()
    x = torch.randn(1000) * torch.logspace(-30, 30, 1000)  # (not a multiple of the vector width: the tail too)
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    r = torch.randint(0, 1 << 16, (1000,), dtype=torch.int32)
    want = torch.empty(1000, dtype=torch.bfloat16)
    _round(x, r, want)
    got = torch.empty_like(want)
    fn = bitcast.vector_bitcasts(torch.compile(_round, dynamic=True))
    code = _compiled_code(fn, x, r, got)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # no copy element by element through c10::bit_cast inside a vector kernel (inductor's fallback: a store, a
    # loop and a load per view); a scalar kernel (no vector ISA) bit-casts each value, which costs nothing
    assert not copies_bit_views_by_element(code), code
    if bitcast.available() and "at::vec::Vectorized" in code:  # (a torch that vectorized them would keep its own)
        assert "at::vec::cast<int32_t>" in code and "at::vec::cast<float>" in code


def test_inductor_is_left_as_it_was_outside_the_wrapped_calls():
    from torch._inductor import config
    from torch._inductor.codegen import cpp

    before, marks = cpp.CppVecOverrides.__dict__["to_dtype_bitcast"], config.unsafe_marked_cacheable_functions
    seen = []

    def probe(*args):
        seen.append(cpp.CppVecOverrides.__dict__["to_dtype_bitcast"])
        raise ValueError("the compiled call failed")

    fn = bitcast.vector_bitcasts(probe)
    try:
        fn()
    except ValueError:
        pass
    assert cpp.CppVecOverrides.__dict__["to_dtype_bitcast"] is before  # restored, also when the call raised
    assert config.unsafe_marked_cacheable_functions is marks
    if bitcast.available():
        assert seen[0] is not before
    else:
        assert fn is probe


def test_overlapping_and_nested_calls_restore_inductor_once_all_have_ended():
    """A call on another thread starts first and ends while this thread's call (with a wrapped call nested in it)
    still runs: the override stays until the last call ends, which puts back what the first one found."""
    import threading

    from torch._inductor.codegen import cpp

    def current():
        return cpp.CppVecOverrides.__dict__["to_dtype_bitcast"]

    before = current()
    inside, release, seen = threading.Event(), threading.Event(), []
    other = threading.Thread(target=bitcast.vector_bitcasts(lambda: (inside.set(), release.wait(10))))
    other.start()
    assert inside.wait(10)

    def mine():
        release.set()
        other.join(10)  # the other thread's call has ended; this one still runs
        seen.append(current())
        bitcast.vector_bitcasts(lambda: seen.append(current()))()
        seen.append(current())

    bitcast.vector_bitcasts(mine)()
    assert not other.is_alive()
    assert current() is before
    if bitcast.available():
        assert all(s is not before for s in seen)


def _round_again(x: torch.Tensor, r: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`_round` under another code object (dynamo keeps no state between the two; inductor's caches may)."""
    out.copy_(_sr(x, r).to(torch.bfloat16))


@pytest.mark.skipif(not bitcast.available(), reason="this torch keeps its own bit views: nothing is overridden")
def test_a_kernel_cached_with_scalar_views_is_not_reused_by_a_wrapped_call():
    """inductor's FX graph and AOTAutograd caches key on the graph and inductor's config, which the override is not
    part of: the wrapped calls put a mark in that config, so a kernel compiled without the vector views (by a
    torch.compile of the same graph, or an ampkit that predates them) is not taken from the cache."""
    from torch._inductor.utils import fresh_inductor_cache, run_and_get_code

    torch._dynamo.reset()
    x, r = torch.randn(1000), torch.randint(0, 1 << 16, (1000,), dtype=torch.int32)
    out = torch.empty(1000, dtype=torch.bfloat16)
    with fresh_inductor_cache():
        _, plain = run_and_get_code(torch.compile(_round, dynamic=True), x, r, out)
        torch._dynamo.reset()
        _, wrapped = run_and_get_code(bitcast.vector_bitcasts(torch.compile(_round_again, dynamic=True)), x, r, out)
    assert plain and copies_bit_views_by_element("\n".join(plain)) == ("at::vec::Vectorized" in "\n".join(plain))
    assert wrapped, "a cache hit: the scalar views' kernel was reused"
    assert not copies_bit_views_by_element("\n".join(wrapped))
