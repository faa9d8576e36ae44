"""The step loop: micro-batches -> forward/backward under the precision's hooks -> one step per
accumulation window, with the sync-free, one-step-late skip resolution and the LR schedule.

Gradient accumulation divides each micro-batch loss by the size of its window (the last, partial
window of an epoch by its own size), makes one unscale/clip/step per window, and advances the
scheduler and step counters only on real (non-skipped) optimizer steps. A step's skip flag is read
on the host one step late (its copy finished while the next window was queued), so steady-state
training never waits on the device. The functions work on a `Trainer`'s progress counters.
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Dict, List

import torch
from torch.utils.data import TensorDataset

from ..precision import NonFiniteGradientsError
from ..utils.batch import batch_size_of, call_model
from . import distributed as _dist
from .evaluate import label_error
from .metrics import MetricsLogger, Progress
from .signals import TrainingInterrupted

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["train_epochs", "resolve_step", "mean_loss_over_ranks"]


def train_epochs(tr: "Trainer", logger: MetricsLogger, is_main: bool) -> int:
    """Train until the configured epochs/max_steps (or a signal); returns the samples seen."""
    cfg = tr.config
    model, precision, optimizer = tr.model, tr.precision, tr.optimizer
    accum = cfg.grad_accum
    samples_seen = 0
    # TensorDatasets are checked for NaN/inf upfront; other datasets when a step is skipped
    check_skipped_inputs = not isinstance(tr.train_data, TensorDataset)
    window_inputs: List[tuple] = []
    model.train()
    while tr.epoch < cfg.epochs:
        order = tr.batches.epoch_order(tr.epoch)
        n = len(order)
        progress = Progress(n, cfg.progress and is_main, f"epoch {tr.epoch + 1}/{cfg.epochs}", tr.batch_in_epoch)
        t_flush, samples_flush = time.perf_counter(), 0
        window_loss = torch.zeros((), device=tr.device)
        i = tr.batch_in_epoch
        while i < n:
            window_start = (i // accum) * accum
            window = min(accum, n - window_start)
            last_in_window = (i - window_start) == window - 1
            x, y = tr.batches.fetch(tr.train_data, order[i])
            if check_skipped_inputs:
                window_inputs.append((i, order[i], x, y))
            with _sync_context(tr, last_in_window):
                with precision.autocast():
                    out = call_model(model, x)
                    try:
                        loss = tr.loss_fn(out, y) / window
                    except IndexError as e:  # a label the output cannot take (classes counted from a prefix)
                        err = label_error(e, out, y, f"training data (epoch {tr.epoch + 1}, batch {i})")
                        if err is None:
                            raise
                        raise err from None
                precision.backward(loss)
            window_loss += loss.detach()
            n_samples = batch_size_of(y, x)
            samples_flush += n_samples
            samples_seen += n_samples
            i += 1
            tr.batch_in_epoch = i
            progress.advance()
            if not last_in_window:
                continue
            # the previous step's skip flag, one step late: its copy to the host finished while this
            # window's forward/backward was queued, so reading it does not wait for this step
            resolve_step(tr)
            result = (tr.compiled_step or precision.step)(optimizer, max_norm=cfg.max_norm)
            tr.attempted_steps += 1
            record = _log_step(tr, logger, window_loss)
            tr._pending_step = (record, result.to_host(), window_inputs, tr.batch_in_epoch)
            window_inputs = []
            window_loss = torch.zeros((), device=tr.device)
            log_due = tr.attempted_steps % cfg.log_every == 0 or i == n
            save_due = bool(cfg.save_every) and tr.attempted_steps % cfg.save_every == 0
            # a signal is local to a rank: with several, they flush (a collective) and stop only at
            # log boundaries, where all agree
            stop_pending = tr.stop.pending
            if log_due or save_due or stop_pending or (cfg.max_steps and tr.attempted_steps >= cfg.max_steps):
                resolve_step(tr)  # global_step can reach max_steps only once attempted_steps has
            optimizer.zero_grad(set_to_none=True)  # after: a skip-limit error names the bad grads
            if log_due or save_due or stop_pending:
                # metrics reach the file before any checkpoint: a kill never loses logged steps
                now = time.perf_counter()
                rate = samples_flush * tr.world_size / max(now - t_flush, 1e-9)
                records = logger.flush(samples_per_s=rate)
                if records:
                    tr.history.extend(records)
                    last = records[-1]
                if records and log_due:
                    progress.show({"step": tr.global_step, "loss": f"{last['loss']:.4f}",
                                   "scale": f"{last['scale']:g}", "skipped": precision.skipped_steps,
                                   "lr": f"{last['lr']:.2e}", "samples/s": f"{rate:.0f}"})
                t_flush, samples_flush = now, 0
            if save_due:
                tr.save_checkpoint()
            if tr.stop.stop_now(log_due):
                progress.close()
                path = tr.save_checkpoint()
                raise TrainingInterrupted(tr.stop.signum, path)
            if cfg.max_steps and tr.global_step >= cfg.max_steps:
                break
        progress.close()
        logger.flush()
        finished_epoch = tr.batch_in_epoch >= n
        if finished_epoch:
            tr.epoch += 1
            tr.batch_in_epoch = 0
        if tr.eval_data is not None:
            tr.log_evaluation(logger, is_main)
        if not cfg.save_every:
            tr.save_checkpoint()
        if cfg.max_steps and tr.global_step >= cfg.max_steps:
            break
    if tr._saved_state != (tr.epoch, tr.batch_in_epoch, tr.attempted_steps):
        tr.save_checkpoint()  # the final state, whatever --save-every said
    return samples_seen


def _log_step(tr: "Trainer", logger: MetricsLogger, window_loss: torch.Tensor) -> Dict[str, Any]:
    """Queue this step's record; ``optimizer_step``, ``skipped`` and ``lr`` are filled in when the
    skip flag is resolved (`resolve_step`, always before the record is written)."""
    scaler = tr.precision.scaler
    record = {
        "kind": "train", "step": tr.attempted_steps, "optimizer_step": None,
        "epoch": tr.epoch, "loss": window_loss.clone(),
        "scale": scaler.scale_tensor.clone() if scaler.scale_tensor is not None else 1.0,
        "skipped": None, "lr": None,
    }
    logger.step(record)
    return record


def resolve_step(tr: "Trainer") -> None:
    """Apply the last step's outcome on the host: count it, advance the LR schedule only on a real
    step, check a skipped window's inputs, stop at the skip limit. Called before the next optimizer
    step (the copy of the flag is done by then: no wait in steady state) and at log/save points."""
    pending, tr._pending_step = tr._pending_step, None
    if pending is None:
        return
    record, flag, window_inputs, batch_in_epoch = pending
    stepped = True if flag is None else not flag.value() > 0
    if stepped:
        tr.global_step += 1
        if tr.scheduler is not None:
            tr.scheduler.step()
    record.update(optimizer_step=tr.global_step, skipped=not stepped, lr=float(tr.optimizer.param_groups[0]["lr"]))
    if not stepped:
        try:
            tr.batches.check_window_inputs(window_inputs, tr.epoch)  # bad data explains a skip better
            tr.precision.scaler.check_skip_limit(tr.optimizer)
        except NonFiniteGradientsError:
            tr.batch_in_epoch = batch_in_epoch  # where the stopping step was (for the report)
            raise


def _sync_context(tr: "Trainer", last_in_window: bool):
    """DDP/FSDP: reduce gradients only on the last micro-batch of a window."""
    if tr._fsdp:
        tr.raw_model.set_requires_gradient_sync(last_in_window)
        return contextlib.nullcontext()
    if not last_in_window and hasattr(tr.model, "no_sync"):
        return tr.model.no_sync()
    return contextlib.nullcontext()


def mean_loss_over_ranks(values: torch.Tensor, keys: List[str]) -> torch.Tensor:
    """MetricsLogger reduce hook: the logged train loss is the mean over ranks (one collective per flush)."""
    if "loss" in keys:
        col = keys.index("loss")
        values[:, col] = _dist.reduce_mean_(values[:, col].contiguous())
    return values
