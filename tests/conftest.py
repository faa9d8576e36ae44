"""Suite-wide options: ``--slow`` (or AMPKIT_SLOW=1) turns on the long variants of tests; shared fixtures.

CPU kinds: every ampkit decision that depends on what 16-bit math buys on this CPU reads
``ampkit.precision.capability``'s measurement, which ``$AMPKIT_CPU_CAPS`` (a kind: amx | avx512_bf16 |
avx512_fp16 | avx512 | avx2, or ratios: bf16=0.55,fp16=1.0) overrides.
A test whose assertions depend on that pins it: ``@pytest.mark.cpu_caps("avx2")`` (subprocesses the test
starts inherit it), or takes the ``any_cpu_kind`` fixture to run once per kind. ``AMPKIT_CPU_CAPS=amx
pytest`` runs the rest of the suite as that kind would.
"""
import os

import pytest
import torch

from ampkit.precision.device import CPU_CAPS_ENV, CPU_KINDS


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="run the long variants (e.g. 20+ kill -9 trials in tests/faults); same as AMPKIT_SLOW=1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run with ``--slow``, ``AMPKIT_SLOW=1`` or ``-m slow`` (as the marker says), so ``make
    test`` stays under its 10 minutes on 2 cores; elsewhere they are skipped with that reason."""
    wanted = (config.getoption("--slow") or os.environ.get("AMPKIT_SLOW", "") not in ("", "0")
              or "slow" in (config.getoption("-m") or ""))
    if wanted:
        return
    skip = pytest.mark.skip(reason="long-running: AMPKIT_SLOW=1 make test (or pytest --slow) runs it")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_caps(kind): run the test as a CPU of this kind would "
                            f"(sets ${CPU_CAPS_ENV}; kinds: {', '.join(CPU_KINDS)})")


@pytest.fixture(autouse=True)
def _pinned_cpu_caps(request, monkeypatch):
    """``@pytest.mark.cpu_caps(kind)``: ``$AMPKIT_CPU_CAPS`` set for the test (and its subprocesses)."""
    mark = request.node.get_closest_marker("cpu_caps")
    if mark is not None:
        kind = mark.args[0]
        assert kind in CPU_KINDS, f"cpu_caps({kind!r}): use one of {', '.join(CPU_KINDS)}"
        monkeypatch.setenv(CPU_CAPS_ENV, kind)


@pytest.fixture(params=list(CPU_KINDS))
def any_cpu_kind(request, monkeypatch):
    """Runs the test once per CPU kind, ``$AMPKIT_CPU_CAPS`` set to it; the kind's name is the value."""
    monkeypatch.setenv(CPU_CAPS_ENV, request.param)
    return request.param


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread avoids oversubscribing the shared cores (results do not depend on it).
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """The op-speed / auto-mode / layout verdict caches of this test session, not the user's ~/.cache:
    a run of the suite neither depends on nor changes what earlier runs measured."""
    import os

    old = os.environ.get("AMPKIT_CACHE_DIR")
    os.environ["AMPKIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("ampkit-cache"))
    yield
    if old is None:
        os.environ.pop("AMPKIT_CACHE_DIR", None)
    else:
        os.environ["AMPKIT_CACHE_DIR"] = old
