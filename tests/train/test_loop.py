"""TrainLoop on its own: the loop decides when to save and evaluate, the callables it is handed decide how
(the Trainer hands it its checkpoint writer and evaluation; here plain functions stand in for an owner)."""
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ampkit.precision import Precision
from ampkit.train.batches import Batches
from ampkit.train.config import TrainConfig
from ampkit.train.loop import Counters, Outcomes, RunState, Training, TrainLoop
from ampkit.train.metrics import MetricsLogger
from ampkit.train.signals import StopSignal

CPU = torch.device("cpu")


def _data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    return TensorDataset(x, (x @ torch.randn(10, 3, generator=g)).argmax(1))


def _loop(cfg, save, evaluate, precision="fp32"):
    torch.manual_seed(0)
    prec = Precision(precision, CPU)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batches = Batches(_data(), _data(16, seed=1), {}, cfg.batch_size, cfg.seed, 0, 1, CPU)
    counters, history = Counters(), []
    loop = TrainLoop(cfg, Training(model, model, prec, opt, prec.step, nn.functional.cross_entropy), batches,
                     RunState(counters, history, StopSignal(1, CPU)), Outcomes(save, evaluate), device=CPU)
    return loop, counters, history


def test_saves_see_every_step_resolved_and_the_final_state_is_saved_once():
    """save_every 3 over 2 epochs of 5 steps: saves at steps 3, 6, 9 and the final 10, each after the
    pending step's outcome was applied (global_step counts the step just taken)."""
    saves, evals = [], []
    cfg = TrainConfig(batch_size=8, epochs=2, save_every=3, log_every=2, progress=False)
    loop, counters, history = _loop(cfg, lambda: saves.append((counters.attempted_steps, counters.global_step)),
                                    lambda: evals.append(counters.epoch) or {"loss": 1.0, "accuracy": 0.5})
    loop.run(MetricsLogger(None))
    assert saves == [(3, 3), (6, 6), (9, 9), (10, 10)]
    assert evals == [1, 2]  # after each epoch, the epoch counter already moved on
    assert counters.epoch == 2 and counters.batch_in_epoch == 0 and loop.pending is None
    train = [r for r in history if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 11)) and all(isinstance(r["loss"], float) for r in train)
    assert [r["step"] for r in history if r["kind"] == "eval"] == [5, 10]


def test_epoch_end_saves_make_the_final_save_unneeded():
    """Without save_every a checkpoint is written at each epoch end; the last one is the final state."""
    saves = []
    cfg = TrainConfig(batch_size=8, epochs=2, progress=False)
    loop, counters, _ = _loop(cfg, lambda: saves.append(counters.attempted_steps), None)
    loop.run(MetricsLogger(None))
    assert saves == [5, 10]


def test_max_steps_stops_inside_an_epoch_and_evaluates_there():
    saves, evals = [], []
    cfg = TrainConfig(batch_size=8, epochs=3, max_steps=7, progress=False)
    loop, counters, _ = _loop(cfg, lambda: saves.append(counters.attempted_steps),
                              lambda: evals.append((counters.epoch, counters.batch_in_epoch)) or
                              {"loss": 1.0, "accuracy": None})
    loop.run(MetricsLogger(None))
    assert counters.global_step == 7 and evals == [(1, 0), (1, 2)] and saves == [5, 7]
