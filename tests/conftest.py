"""Suite-wide options: ``--slow`` (or AMPKIT_SLOW=1) turns on the long variants of tests; shared fixtures.

CPU kinds: every ampkit decision that depends on what 16-bit math buys on this CPU reads
``ampkit.precision.capability``'s measurement, which ``$AMPKIT_CPU_CAPS`` (a kind: amx | avx512_bf16 |
avx512_fp16 | avx512 | avx2, or ratios: bf16=0.55,fp16=1.0) overrides.
A test whose assertions depend on that pins it: ``@pytest.mark.cpu_caps("avx2")`` (subprocesses the test
starts inherit it), or takes the ``any_cpu_kind`` fixture to run once per kind. ``AMPKIT_CPU_CAPS=amx
pytest`` runs the rest of the suite as that kind would.

Order: ``make test`` runs the tests in a random order (pytest-randomly, a new seed each run, printed at the end
of the run with the line that replays it); ``_process_state`` below puts back, after every test, each
process-wide thing ampkit or a test may change (global policies, once-per-process memos, torch's defaults),
so no test depends on what ran before it in the same worker.
"""
import os
import zlib

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


def _native_bf16_missing() -> str:
    """Why this process has no native bf16, or ''. torch's own check (``_is_mkldnn_bf16_supported``) is also true
    where oneDNN emulates bf16 (``ONEDNN_MAX_CPU_ISA=AVX512_CORE``, AVX-512 without bf16): ampkit's check, which
    reads the CPU's flags and oneDNN's cap, decides."""
    from ampkit.precision.device import onednn_native_bf16
    try:
        if torch.ops.mkldnn._is_mkldnn_bf16_supported() and onednn_native_bf16():
            return ""
    except (AttributeError, RuntimeError):
        pass
    return (f"not run: needs native bf16 (AVX512-BF16 or AMX) and oneDNN allowed to use it; here torch's kernels "
            f"are {torch.backends.cpu.get_cpu_capability()}, ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '<unset>')}")


@pytest.fixture(autouse=True)
def _needs_native_bf16(request):
    """``@pytest.mark.native_bf16``: skipped, with the reason, where oneDNN does not run bf16 natively."""
    if request.node.get_closest_marker("native_bf16") is not None:
        why = _native_bf16_missing()
        if why:
            pytest.skip(why)


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


def pytest_terminal_summary(terminalreporter, config):
    """The random order's seed, last (``-q`` hides pytest's header, where pytest-randomly prints it): a failure
    that depends on the order replays with it (in one process, ``-n 0``, the workers' tests in one sequence)."""
    seed = getattr(config.option, "randomly_seed", None)
    if config.pluginmanager.hasplugin("randomly") and isinstance(seed, int):
        terminalreporter.write_line(f"tests ran in a random order: replay it with -p randomly --randomly-seed={seed} "
                                    "(-p no:randomly: file order)")


@pytest.fixture(autouse=True)
def _process_state(request):
    """Every process-wide thing a test may change, put back after it (the suite passes in any order):
    ampkit's and Keras-style global policies, apex's ``amp`` state, the op-speed memo, the in-memory
    capability answers (the session's cache file keeps the measured one: read again, not measured again),
    and torch's default dtype, grad mode and thread count. torch's random generator starts each test from a seed
    of the test's own id, so what a test draws does not depend on what drew before it."""
    import importlib
    import sys

    from ampkit.precision import choice

    cap_mod = importlib.import_module("ampkit.precision.capability")  # the module (the package's name is the function)
    policy = choice._GLOBAL_POLICY
    dtype, grad, threads = torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads()
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield
    choice._GLOBAL_POLICY = policy
    keras = sys.modules.get("ampkit.compat.keras")
    if keras is not None:
        keras._last_set = None
    amp = sys.modules.get("ampkit.compat.apex.amp")
    if amp is not None:
        amp._amp_state = amp._AmpState()
    opspeed = sys.modules.get("ampkit.tuning.opspeed")
    if opspeed is not None:
        opspeed._MEMO.clear()
    cap_mod._capability.cache_clear()
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
