"""`ampkit plot` and a run whose metrics.jsonl lost records before a resume (a ``gap`` record): the lost
steps are shaded and named, and the loss line is not drawn across them."""
import json
import math

from .test_plot import figures  # noqa: F401  (the fixture: the figures plot_runs drew)


def test_a_gap_is_shaded_named_and_not_bridged(tmp_path, figures):
    from ampkit.plot import plot_runs

    d = tmp_path / "run"
    d.mkdir()
    steps = list(range(1, 6)) + list(range(27, 31))
    with open(d / "metrics.jsonl", "w") as f:
        for s in steps[:5]:
            f.write(json.dumps({"kind": "train", "step": s, "loss": 1.0, "scale": 1.0, "skipped": False}) + "\n")
        f.write(json.dumps({"kind": "gap", "step": 26, "missing_steps": [[6, 26]], "missing_eval_epochs": [1]}) + "\n")
        for s in steps[5:]:
            f.write(json.dumps({"kind": "train", "step": s, "loss": 0.5, "scale": 1.0, "skipped": False}) + "\n")
    plot_runs([str(d)], str(tmp_path / "c.png"), smooth=1)
    ax_loss = figures[0].axes[0]
    labels = ax_loss.get_legend_handles_labels()[1]
    assert any("records of steps 6-26 missing" in t for t in labels), labels
    x = list(ax_loss.lines[0].get_xdata())
    assert any(isinstance(v, float) and math.isnan(v) for v in x)  # the line breaks at the gap
