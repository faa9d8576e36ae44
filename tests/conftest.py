"""Suite-wide options: ``--slow`` (or AMPKIT_SLOW=1) turns on the long variants of tests."""


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="run the long variants (e.g. 20+ kill -9 trials in tests/faults); same as AMPKIT_SLOW=1")
