"""The step loop: micro-batches -> forward/backward under the precision's hooks -> one step per
accumulation window, with the sync-free, one-step-late skip resolution and the LR schedule.

Gradient accumulation divides each micro-batch loss by the size of its window (the last, partial
window of an epoch by its own size), makes one unscale/clip/step per window, and advances the
scheduler and step counters only on real (non-skipped) optimizer steps. A step's skip flag is read
on the host one step late (its copy finished while the next window was queued), so steady-state
training never waits on the device.

`TrainLoop` owns the loop's state (the pending step, the accumulation window, the throughput timer,
step and evaluation records); the run's position lives in a `Counters` object it shares with its
owner (the Trainer checkpoints it). Saving and evaluating are callables handed in: the loop decides
when, its owner how.
"""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils.data import TensorDataset

from ..memory import measure as memory_measure
from ..precision import NonFiniteGradientsError
from ..utils.batch import batch_size_of, call_model
from . import distributed as _dist
from .evaluate import input_error, label_error, raise_named
from .metrics import MetricsLogger, Progress
from .signals import TrainingInterrupted

__all__ = ["Counters", "Training", "RunState", "Outcomes", "TrainLoop"]


@dataclass
class Counters:
    """Where a run is: its epoch, the micro-batches of that epoch consumed, real and attempted optimizer steps."""
    epoch: int = 0
    batch_in_epoch: int = 0
    global_step: int = 0  # real optimizer steps
    attempted_steps: int = 0  # optimizer steps attempted (real + skipped)

    def position(self) -> tuple:
        return self.epoch, self.batch_in_epoch, self.attempted_steps


@dataclass
class Training:
    """What a step runs: ``model`` as the step calls it (DDP- or FSDP-wrapped) and ``raw_model`` unwrapped, the
    precision, the optimizer and its scheduler, ``step`` (``precision.step`` or its compiled version), the loss."""
    model: Any
    raw_model: Any
    precision: Any
    optimizer: Any
    step: Callable
    loss_fn: Callable
    scheduler: Any = None
    fsdp: bool = False


@dataclass
class RunState:
    """What the loop shares with its owner, who checkpoints it: where the run is (``counters``), every record
    written to the metrics logger (``history``), and the stop signal the loop polls."""
    counters: Counters
    history: List[Dict[str, Any]]
    stop: Any


@dataclass
class Outcomes:
    """What the loop hands back to its owner: ``save()`` writes a checkpoint of the run's state (every rank calls
    it; it returns the path on the rank that wrote one; ``checkpoints`` False without a run directory, where
    saves write nothing); ``evaluate()`` evaluates the model and returns ``loss``/``accuracy`` (None: no
    evaluation data)."""
    save: Callable[[], Optional[str]]
    evaluate: Optional[Callable[[], Dict[str, Any]]] = None
    checkpoints: bool = True


class TrainLoop:
    """Trains until the config's epochs/max_steps (or a signal), moving the run state's counters on: the
    :class:`Training` parts over ``batches``, its :class:`Outcomes` called when the config says, on
    ``world_size`` ranks of ``device``."""

    def __init__(self, config, training: Training, batches, state: RunState, outcomes: Outcomes, *,
                 world_size: int = 1, device: torch.device) -> None:
        self.config = config
        t = training
        self.model, self.raw_model, self.fsdp = t.model, t.raw_model, t.fsdp
        self.precision, self.optimizer, self.scheduler, self.step = t.precision, t.optimizer, t.scheduler, t.step
        self.batches, self.loss_fn = batches, t.loss_fn
        self.stop, self.counters, self.history = state.stop, state.counters, state.history
        self.save, self.evaluate, self.checkpoints = outcomes.save, outcomes.evaluate, outcomes.checkpoints
        self.world_size, self.device = world_size, device
        self.pending: Optional[tuple] = None  # the last step, its skip flag not yet read (`resolve`)
        self.saved_at: Optional[tuple] = None  # the position of the last checkpoint
        # TensorDatasets are checked for NaN/inf upfront; other datasets when a step is skipped
        self.check_skipped_inputs = not isinstance(batches.train_data, TensorDataset)
        self._t_flush, self._samples_flush = time.perf_counter(), 0  # the throughput since the last flush
        self._logger: Optional[MetricsLogger] = None  # the run's, while `run` runs (fsynced before each save)

    def run(self, logger: MetricsLogger) -> int:
        """Train until the configured epochs/max_steps (or a signal); returns the peak memory of the steps in
        bytes: what they added on the device (off CUDA plus the model's and optimizer's tensors, resident
        before the meter started)."""
        cfg, c = self.config, self.counters
        self._logger = logger
        meter = memory_measure.PeakMeter(self.device).start()  # peak memory of the training steps, beside the plan's
        resident = memory_measure.resident_bytes(self.raw_model, self.optimizer) if self.device.type != "cuda" else 0
        self.model.train()
        self._t_flush, self._samples_flush = time.perf_counter(), 0
        while c.epoch < cfg.epochs:
            done = self._epoch(logger)
            self.flush(logger)  # a --max-steps stop inside a log window: its records, with their throughput
            if c.batch_in_epoch >= done:  # the epoch finished (--max-steps may stop inside one)
                c.epoch += 1
                c.batch_in_epoch = 0
            if self.evaluate is not None:
                self._log_evaluation(logger)
            if not cfg.save_every:
                self._save()
            if self._max_steps_reached():
                break
        if self.saved_at != c.position():
            self._save()  # the final state, whatever --save-every said
        return meter.peak() + resident

    def _epoch(self, logger: MetricsLogger) -> int:
        """The micro-batches of the current epoch from where the counters are; returns the epoch's length."""
        cfg, c, precision = self.config, self.counters, self.precision
        accum = cfg.grad_accum
        order = self.batches.epoch_order(c.epoch)
        n = len(order)
        progress = Progress(n, cfg.progress and _dist.is_main_process(), f"epoch {c.epoch + 1}/{cfg.epochs}",
                            c.batch_in_epoch)
        window_loss = torch.zeros((), device=self.device)
        window_inputs: List[tuple] = []
        i = c.batch_in_epoch
        while i < n:
            window_start = (i // accum) * accum
            window = min(accum, n - window_start)
            last_in_window = (i - window_start) == window - 1
            x, y = self.batches.fetch(self.batches.train_data, order[i])
            if self.check_skipped_inputs:
                window_inputs.append((i, order[i], x, y))
            with self._sync_context(last_in_window):
                with precision.autocast():
                    try:
                        out = call_model(self.model, x)
                    except IndexError as e:  # an id beyond the model's embedding (dict data: model(**batch))
                        raise_named(e, input_error(e, self.raw_model, x,
                                                   f"training data (epoch {c.epoch + 1}, batch {i})"))
                    try:
                        loss = self.loss_fn(out, y) / window
                    except IndexError as e:  # a label the output cannot take (classes counted from a prefix)
                        raise_named(e, label_error(e, out, y, f"training data (epoch {c.epoch + 1}, batch {i})"))
                precision.backward(loss)
            window_loss += loss.detach()
            self._samples_flush += batch_size_of(y, x)
            i += 1
            c.batch_in_epoch = i
            progress.advance()
            if not last_in_window:
                continue
            # the previous step's skip flag, one step late: its copy to the host finished while this
            # window's forward/backward was queued, so reading it does not wait for this step
            self.resolve()
            result = self.step(self.optimizer, max_norm=cfg.max_norm)
            c.attempted_steps += 1
            record = self._log_step(logger, window_loss)
            self.pending = (record, result.to_host(), window_inputs, c.batch_in_epoch)
            window_inputs = []
            window_loss = torch.zeros((), device=self.device)
            log_due = c.attempted_steps % cfg.log_every == 0 or i == n
            save_due = bool(cfg.save_every) and c.attempted_steps % cfg.save_every == 0
            # a signal is local to a rank: with several, they flush (a collective) and stop only at
            # log boundaries, where all agree
            stop_pending = self.stop.pending
            if log_due or save_due or stop_pending or (cfg.max_steps and c.attempted_steps >= cfg.max_steps):
                self.resolve()  # global_step can reach max_steps only once attempted_steps has
            self.optimizer.zero_grad(set_to_none=True)  # after: a skip-limit error names the bad grads
            if log_due or save_due or stop_pending:
                # metrics reach the file before any checkpoint: a kill never loses logged steps
                records = self.flush(logger)
                if records and log_due:
                    last = records[-1]
                    progress.show({"step": c.global_step, "loss": f"{last['loss']:.4f}",
                                   "scale": f"{last['scale']:g}", "skipped": precision.skipped_steps,
                                   "lr": f"{last['lr']:.2e}", "samples/s": f"{last['samples_per_s']:.0f}"})
            if save_due:
                self._save()
            if self.stop.stop_now(log_due):
                progress.close()
                path = self._save()
                raise TrainingInterrupted(self.stop.signum, path)
            if self._max_steps_reached():
                break
        progress.close()
        return n

    def flush(self, logger: MetricsLogger) -> List[Dict[str, Any]]:
        """Write the queued step records (their skip flags resolved first), each with the throughput since the
        previous flush (``samples_per_s``), into the run's history too; returns them. The loop calls it at log,
        save and signal points and at an epoch's end; its owner before closing the logger on a stop."""
        self.resolve()
        now = time.perf_counter()
        rate = self._samples_flush * self.world_size / max(now - self._t_flush, 1e-9)
        records = logger.flush(samples_per_s=rate)
        self.history.extend(records)
        if records:
            self._t_flush, self._samples_flush = now, 0
        return records

    def _max_steps_reached(self) -> bool:
        return bool(self.config.max_steps) and self.counters.global_step >= self.config.max_steps

    def _save(self) -> Optional[str]:
        """A checkpoint of the state after the last step (its skip flag read first)."""
        self.resolve()
        if self.checkpoints:  # every rank: all must agree on whether the final save is due
            self.saved_at = self.counters.position()
            if self._logger is not None:  # the records up to here (flushed at every save point) durable first
                self._logger.sync()
        return self.save()

    def _log_step(self, logger: MetricsLogger, window_loss: torch.Tensor) -> Dict[str, Any]:
        """Queue this step's record; ``optimizer_step``, ``skipped`` and ``lr`` are filled in when the
        skip flag is resolved (`resolve`, always before the record is written)."""
        scaler = self.precision.scaler
        record = {
            "kind": "train", "step": self.counters.attempted_steps, "optimizer_step": None,
            "epoch": self.counters.epoch + 1, "loss": window_loss.clone(),  # 1-based, as the console counts
            "scale": scaler.scale_tensor.clone() if scaler.scale_tensor is not None else 1.0,
            "skipped": None, "lr": None,
        }
        logger.step(record)
        return record

    def resolve(self) -> None:
        """Apply the last step's outcome on the host: count it, advance the LR schedule only on a real
        step, check a skipped window's inputs, stop at the skip limit. Called before the next optimizer
        step (the copy of the flag is done by then: no wait in steady state) and at log/save points."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        record, flag, window_inputs, batch_in_epoch = pending
        c = self.counters
        stepped = True if flag is None else not flag.value() > 0
        if stepped:
            c.global_step += 1
            if self.scheduler is not None:
                self.scheduler.step()
        record.update(optimizer_step=c.global_step, skipped=not stepped,
                      lr=float(self.optimizer.param_groups[0]["lr"]))
        if not stepped:
            try:
                self.batches.check_window_inputs(window_inputs, c.epoch)  # bad data explains a skip better
                self.precision.scaler.check_skip_limit(self.optimizer)
            except NonFiniteGradientsError:
                c.batch_in_epoch = batch_in_epoch  # where the stopping step was (for the report)
                raise

    def _log_evaluation(self, logger: MetricsLogger) -> None:
        """The evaluation at the end of an epoch (or a max-steps stop): logged and printed on rank 0."""
        ev = self.evaluate()
        if not _dist.is_main_process():
            return
        c, epochs = self.counters, self.config.epochs
        # the epoch evaluated, 1-based: the one just finished, or the one --max-steps stopped inside
        rec = {"kind": "eval", "step": c.attempted_steps, "epoch": c.epoch + (1 if c.batch_in_epoch else 0),
               "loss": ev["loss"], "accuracy": ev["accuracy"]}
        logger.event(rec)
        self.history.append(rec)
        acc = f", accuracy {ev['accuracy']:.4f}" if ev["accuracy"] is not None else ""
        where = f"epoch {c.epoch}/{epochs}"
        if c.batch_in_epoch:  # --max-steps stopped inside an epoch: name that epoch and how far it got
            where = (f"epoch {c.epoch + 1}/{epochs} (stopped by --max-steps after micro-batch "
                     f"{c.batch_in_epoch} of {self.batches.per_epoch()})")
        print(f"{where}: eval loss {ev['loss']:.4f}{acc}, "
              f"steps {c.global_step}, skipped {self.precision.skipped_steps}", file=sys.stderr)

    def _sync_context(self, last_in_window: bool):
        """DDP/FSDP: reduce gradients only on the last micro-batch of a window."""
        if self.fsdp:
            self.raw_model.set_requires_gradient_sync(last_in_window)
            return contextlib.nullcontext()
        if not last_in_window and hasattr(self.model, "no_sync"):
            return self.model.no_sync()
        return contextlib.nullcontext()

