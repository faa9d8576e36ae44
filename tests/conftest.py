"""Suite-wide options: ``--slow`` (or AMPKIT_SLOW=1) turns on the long variants of tests; shared fixtures."""
import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="run the long variants (e.g. 20+ kill -9 trials in tests/faults); same as AMPKIT_SLOW=1")


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
