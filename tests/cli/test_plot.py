"""`ampkit plot`: a diverged run still shows its skips and scale, the evaluation axis says what
it shows, a run without metrics is a one-line error."""
import json
import math
import os

import pytest

def _run_dir(path, train, evals=()):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for r in train:
            f.write(json.dumps({"kind": "train", **r}) + "\n")
        for r in evals:
            f.write(json.dumps({"kind": "eval", **r}) + "\n")
    return str(path)


@pytest.fixture
def figures(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    return kept


def test_diverged_run_draws_its_skips_and_scale(tmp_path, figures):
    from ampkit.plot import plot_runs

    train = [{"step": i, "loss": 1.0 if i < 3 else math.nan, "scale": 2.0 ** (10 - i) if i < 3 else 0.0,
              "skipped": i >= 3} for i in range(1, 9)]
    d = _run_dir(tmp_path / "div", train)
    plot_runs([d], str(tmp_path / "c.png"), smooth=3)
    ax_loss, _, ax_scale = figures[0].axes
    skip_marks = [ln for ln in ax_loss.lines if ln.get_marker() == "x"]
    assert skip_marks and len(skip_marks[0].get_xdata()) == 6
    zero_marks = [ln for ln in ax_scale.lines if ln.get_marker() == "v"]
    assert zero_marks and len(zero_marks[0].get_xdata()) == 6
    assert any(len(ln.get_xdata()) == 2 for ln in ax_scale.lines)  # the positive scales, on a log axis
    assert ax_scale.get_yscale() == "log"


def test_eval_axis_is_labelled_by_what_it_shows(tmp_path, figures):
    from ampkit.plot import plot_runs

    train = [{"step": 1, "loss": 1.0, "scale": 1.0, "skipped": False}]
    cls = _run_dir(tmp_path / "cls", train, [{"step": 1, "epoch": 1, "loss": 0.5, "accuracy": 0.9}])
    reg = _run_dir(tmp_path / "reg", train, [{"step": 1, "epoch": 1, "loss": 0.25, "accuracy": None}])
    plot_runs([cls, reg], str(tmp_path / "c.png"))
    ax_eval = figures[0].axes[1]
    assert ax_eval.get_ylabel() == "eval loss"
    assert sorted(float(ln.get_ydata()[0]) for ln in ax_eval.lines) == [0.25, 0.5]  # both losses, no accuracy
    plot_runs([cls], str(tmp_path / "d.png"))
    assert figures[1].axes[1].get_ylabel() == "eval accuracy"


def test_run_without_metrics_is_one_line_and_exit_2(tmp_path, capsys):
    from ampkit.cli import main

    d = _run_dir(tmp_path / "empty", [])
    code = main(["plot", d])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0 and "no metrics records yet" in err
    assert not os.path.exists(os.path.join(d, "curves.png"))


def test_several_runs_never_replace_a_users_curves_png(tmp_path, monkeypatch, capsys):
    from ampkit.cli import main

    train = [{"step": 1, "loss": 1.0, "scale": 1.0, "skipped": False}]
    a, b = _run_dir(tmp_path / "a", train), _run_dir(tmp_path / "b", train)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "curves.png").write_bytes(b"mine")
    assert main(["plot", a, b]) == 2
    assert (tmp_path / "curves.png").read_bytes() == b"mine"


def test_a_diverged_run_beside_a_normal_one_keeps_both_readable(tmp_path, figures):
    """A run whose loss climbs to 1e6 before NaN would flatten a normal run's curve on a linear axis: the
    loss panel goes to a log axis (and says so); a loss that goes negative gets a clipped range instead."""
    from ampkit.plot import plot_runs

    normal = _run_dir(tmp_path / "ok", [{"step": i, "loss": 2.0 / i, "scale": 1.0, "skipped": False}
                                        for i in range(1, 21)])
    blown = _run_dir(tmp_path / "div", [{"step": i, "loss": 2.0 * 10 ** min(i / 3, 6) if i < 19 else math.nan,
                                         "scale": 1.0, "skipped": i >= 19} for i in range(1, 21)])
    plot_runs([normal, blown], str(tmp_path / "c.png"), smooth=1)
    ax_loss = figures[0].axes[0]
    assert ax_loss.get_yscale() == "log" and ax_loss.get_ylabel() == "loss (log scale)"
    plot_runs([normal], str(tmp_path / "d.png"), smooth=1)
    assert figures[1].axes[0].get_yscale() == "linear" and figures[1].axes[0].get_ylabel() == "loss"
    signed = _run_dir(tmp_path / "neg", [{"step": i, "loss": -1.0 + 0.01 * i if i < 59 else 1e6, "scale": 1.0,
                                          "skipped": False} for i in range(1, 61)])
    plot_runs([signed], str(tmp_path / "e.png"), smooth=1)
    ax = figures[2].axes[0]
    assert ax.get_ylim()[1] < 10 and "clipped" in ax.get_ylabel()


@pytest.mark.parametrize("given_out", [False, True])
def test_a_place_it_cannot_write_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, figures, given_out):
    """A read-only run directory (simulated: root ignores chmod): the file system's refusal, one line."""
    import errno

    from matplotlib.figure import Figure

    from ampkit.cli import main

    def refuse(self, fname, *a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(fname))

    monkeypatch.setattr(Figure, "savefig", refuse)
    d = _run_dir(tmp_path / "ro", [{"step": 1, "loss": 1.0, "scale": 1.0, "skipped": False}])
    code = main(["plot", d, *(["--out", str(tmp_path / "c.png")] if given_out else [])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "cannot write" in err and "Read-only file system" in err, err
    assert ("pass --out to a writable place" in err) != given_out


def test_plot_replaces_its_own_file_not_anothers(tmp_path, monkeypatch, capsys):
    import matplotlib

    matplotlib.use("Agg")
    from ampkit.cli import main

    monkeypatch.chdir(tmp_path)
    train = [{"step": i, "loss": 1.0 / i, "scale": 1.0, "skipped": False} for i in range(1, 5)]
    a, b = _run_dir(tmp_path / "a", train), _run_dir(tmp_path / "b", train)
    assert main(["plot", a, b]) == 0
    first = (tmp_path / "curves.png").stat().st_mtime_ns
    assert main(["plot", a, b]) == 0  # its own curves.png: replaced
    assert (tmp_path / "curves.png").stat().st_mtime_ns >= first
    (tmp_path / "mine.png").write_bytes(b"\x89PNG\r\n\x1a\n a picture of the user's")
    capsys.readouterr()
    assert main(["plot", a, b, "--out", "mine.png"]) == 2
    err = capsys.readouterr().err
    assert "was not written by ampkit plot" in err and "--force" in err, err
    assert (tmp_path / "mine.png").read_bytes().endswith(b"the user's")
    assert main(["plot", a, b, "--out", "mine.png", "--force"]) == 0


def test_jpeg_nan_loss_and_a_run_without_summary(tmp_path, figures):
    """--out x.jpg writes a JPEG (matplotlib takes no metadata for it); a NaN loss of a step that was
    not skipped is a gap in the curve and a mark on the floor, not the last finite loss carried across it; a run
    without summary.json (stopped, or still running) keeps its mode label from config.toml."""
    from ampkit.plot import plot_runs

    train = [{"step": i, "loss": [1.0, 7e21][i - 1] if i <= 2 else math.nan, "scale": 1.0, "skipped": False}
             for i in range(1, 13)]
    d = _run_dir(tmp_path / "blown", train)
    (tmp_path / "blown" / "config.toml").write_text('precision = "bf16-mixed"\nepochs = 1\n')
    out = plot_runs([d], str(tmp_path / "x.jpg"), smooth=10)
    assert open(out, "rb").read(3) == b"\xff\xd8\xff"
    ax_loss = figures[0].axes[0]
    curve = next(ln for ln in ax_loss.lines if ln.get_label().startswith("blown"))
    assert curve.get_label() == "blown (bf16-mixed)"
    assert all(math.isnan(v) for v in curve.get_ydata()[2:])  # before: 3.5e21 for the 8 steps after
    marks = [ln for ln in ax_loss.lines if "non-finite loss" in ln.get_label()]
    assert marks and len(marks[0].get_xdata()) == 10
