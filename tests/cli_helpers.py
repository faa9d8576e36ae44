"""What the CLI tests share (tests/cli/, tests/faults/): the quick flags of a training run, ``ampkit``'s ``main()``
run in this process, and the check that a mistake ends in one error line."""

# the quickest run that still trains: no progress bar, one thread, fp32, nothing measured before training
FAST = ["--no-progress", "--num-threads", "1", "--no-autotune", "--precision", "fp32"]


class InProcess:
    """``ampkit.cli.main(argv)`` in this process (cheaper than a new interpreter, for the mistakes found before
    any work): ``returncode``, and ``stdout``/``stderr`` as captured by pytest's ``capsys``."""

    def __init__(self, argv, capsys):
        from ampkit.cli import main

        self.returncode = main(argv)
        captured = capsys.readouterr()
        self.stdout, self.stderr = captured.out, captured.err


def one_error(r, code=2):
    """The one ``... : error: ...`` line of a run (``r``: a subprocess result or :class:`InProcess`) that exited
    with ``code`` and printed no traceback."""
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 1, r.stderr[-2000:]
    return errors[0]
