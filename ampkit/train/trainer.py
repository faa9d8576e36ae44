"""`Trainer`: data -> forward -> loss -> backward -> step -> eval -> checkpoint.

The coordinator: it owns the run's state (model, optimizer, scheduler, precision, progress
counters) and hands each job to its module: `setup` (config checks, the precision and its tuning,
DDP/FSDP wiring), `batches` (data order and fetching), `rundir` (the run directory), `resume`
(which checkpoint, whether it fits), `signals` (Ctrl-C/SIGTERM), `loop` (the steps), `report`
(summary.json, report.txt). The loop (`TrainLoop`) gets the run's parts and its `save`/`evaluate`
callables; it never asks which precision it runs in: it calls the `Precision` hooks (autocast,
backward, step) and nothing else.

Exact resume: the data order of each epoch comes from a generator seeded with (seed, epoch),
so a resumed run regenerates the epoch's order and skips the micro-batches already consumed;
model (the fp32 masters in the master modes), optimizer, scaler, scheduler and RNG states come from the
checkpoint. On CPU a stopped-and-resumed run ends bitwise equal to an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from ..data import data_fingerprint
from ..precision import NonFiniteGradientsError, Precision
from ..utils.tree import to_device
from . import checkpoint as ckpt
from . import distributed as _dist
from . import change, resume, setup, sharded
from .batches import Batches, unwrap_loaders
from .config import TrainConfig, recorded_options
from .evaluate import default_loss, evaluate_shards
from .loop import Counters, Outcomes, RunState, Training, TrainLoop
from .metrics import MetricsLogger
from .report import (RunDivergedError, announce, build_summary, divergence, open_metrics, publish, set_aside_reports,
                     write_nonfinite_report)
from .rundir import RunDir, RunDirError, checkpoint_dir
from .setup import build_optimizer, build_scheduler
from .signals import StopSignal, TrainingInterrupted

__all__ = ["Trainer", "TrainingInterrupted", "RunDirError", "RunDivergedError", "build_optimizer", "build_scheduler"]


_DONE = {"convert": "converted", "reset": "reset"}


def _counter(name: str) -> property:
    """A field of the Trainer's `Counters` as its attribute (``trainer.global_step``...)."""
    return property(lambda self: getattr(self.counters, name), lambda self, v: setattr(self.counters, name, v))


class Trainer:
    """Train a model with one precision policy.

    Args:
        model: any nn.Module. A sample that is a dict (Hugging Face style: ``input_ids``,
            ``attention_mask``, ``labels``...) is passed as ``model(**batch)``; an ``(x, y)`` sample as
            ``model(x)`` (``model(*x)`` where x is a tuple of inputs).
        train_data: a Dataset (TensorDatasets are indexed directly, others collated), or a DataLoader:
            its dataset, ``collate_fn`` and ``batch_size`` (unless ``batch_size=`` is given) are used; the
            order stays the Trainer's own (seeded per epoch, so a resume is exact).
        eval_data: optional Dataset (or DataLoader) evaluated each epoch and at the end.
        optimizer, scheduler: optional; built from the config when None.
        loss_fn: ``loss_fn(output, target)``; default: the ``loss`` the model returned itself (a
            ``ModelOutput``, a dict), else cross-entropy (integer targets) or MSE.
        precision: a name/alias or a ready `Precision` (overrides ``config.precision``).
        config: a `TrainConfig`; keyword overrides (``epochs=3``...) are applied on top.
        task: "classification" | "lm" | "regression" (inferred from the targets when None).
        resume_plan: the `ResumePlan` of ``config.resume`` when the caller made it (``ampkit train``
            does): its one read of the checkpoint serves the Trainer too.
        planned_peak_bytes: ``ampkit.plan``'s peak for this run's step, when it was planned (``--batch-size
            auto``): written to the summary beside the measured peak.
    """

    epoch = _counter("epoch")
    batch_in_epoch = _counter("batch_in_epoch")  # micro-batches of the current epoch already consumed
    global_step = _counter("global_step")  # real optimizer steps
    attempted_steps = _counter("attempted_steps")  # optimizer steps attempted (real + skipped)

    def __init__(
        self,
        model: nn.Module,
        train_data: Dataset,
        eval_data: Optional[Dataset] = None,
        *,
        optimizer: Optional[torch.optim.Optimizer] = None,
        scheduler: Any = None,
        loss_fn: Optional[Callable] = None,
        precision: Any = None,
        config: Optional[TrainConfig] = None,
        task: Optional[str] = None,
        class_names: Optional[Sequence[str]] = None,
        resume_plan: Optional[resume.ResumePlan] = None, planned_peak_bytes: Optional[int] = None,
        **overrides: Any,
    ) -> None:
        if isinstance(optimizer, str):  # an optimizer *name* (config key), not an instance
            overrides["optimizer"], optimizer = optimizer, None
        train_data, eval_data, collate = unwrap_loaders(train_data, eval_data, overrides)
        self.config = cfg = (config or TrainConfig()).updated(**overrides).checked()
        setup.check_config(cfg, train_data)
        self.rank, self.world_size = _dist.rank_and_world()
        self._fsdp = cfg.strategy == "fsdp"
        self._plan_resume(cfg, precision, train_data, resume_plan)  # its refusals before anything is built
        self.precision = setup.make_precision(precision, cfg, self.world_size)
        self.device = self.precision.device
        self.train_data, self.eval_data = train_data, eval_data
        self.batches = Batches(train_data, eval_data, collate, cfg.batch_size, cfg.seed, self.rank, self.world_size,
                               self.device)
        self.task = task or setup.infer_task(train_data)
        self.class_names = list(class_names) if class_names else None
        self.loss_fn = loss_fn or default_loss
        setup.check_model_accepts_data(model, self.batches, self.loss_fn, self.task)  # before timing or writing
        if not isinstance(precision, Precision):  # not a ready Precision: measure what it left open
            saved_mode = self._resume.saved_mode if self._resume else None
            self.precision = setup.tune_for_run(self.precision, model, cfg, self.batches, self.loss_fn, saved_mode,
                                                single_process=self.world_size == 1 and not self._fsdp,
                                                saved_reason=self._resume.saved_reason if self._resume else None)
        self.model, self.raw_model, self.optimizer = setup.wire(model, optimizer, self.precision, cfg, self.world_size)
        self.compiled_step = setup.compiled_step(self.precision, self.optimizer, cfg, self.world_size)
        self.steps_per_epoch = math.ceil(self.batches.per_epoch() / cfg.grad_accum)
        total = cfg.max_steps or self.steps_per_epoch * cfg.epochs
        setup.check_run_length(cfg, self.batches.per_epoch(), total)
        self._own_schedule = scheduler is None  # built from the config (then a resume can say what changed)
        self._own_optimizer = optimizer is None
        self.scheduler = scheduler if scheduler is not None else build_scheduler(
            self.optimizer, cfg.lr_schedule, total, cfg.warmup_steps)
        self.counters = Counters()  # epoch, batch_in_epoch, global_step, attempted_steps (the loop moves them)
        self.history: List[Dict[str, Any]] = []
        self.run_dir: Optional[str] = None
        self.planned_peak_bytes = planned_peak_bytes  # ampkit.plan's peak for this step (--batch-size auto)
        self.stop = StopSignal(self.world_size, self.device)
        self.last_checkpoint: Optional[str] = None
        self._time_before = 0.0  # training seconds of the segments before a resume
        self._run_dir = RunDir(cfg.out)
        self._t_segment: Optional[float] = None
        self._fit_called = False
        self._kept_auto = False  # a resumed auto run: it kept the mode (and reason) chosen when it started
        self._training_started = False  # config.toml and metrics written: a failure keeps the run directory

    def _plan_resume(self, cfg: TrainConfig, precision: Any, train_data: Dataset,
                     resume_plan: Optional[resume.ResumePlan]) -> None:
        """The resume planned and checked before the precision is built (it may measure this machine) and before
        the data is tried on the model (another --data can make the model fail on it first, with a less useful
        message): no rewind of a run with later checkpoints, the saved options, the data's fingerprint, a change
        of precision (refused, or allowed and carried out at the load)."""
        self.data_fingerprint = data_fingerprint(train_data)  # in each checkpoint: a resume on other data is noticed
        self._data_changes: List[Dict[str, Any]] = []  # data changes accepted at resumes (allow_new_data), recorded
        self._data_change: Optional[str] = None
        self._precision_change: Optional[tuple] = None  # (old mode, new mode): allow_precision_change, this resume
        self._precision_changes: List[Dict[str, Any]] = []  # changes at resumes, recorded
        self._lr_changes: List[Dict[str, Any]] = []  # lr given on resumes after a divergence, recorded
        self._lr_change: Optional[Dict[str, Any]] = None  # this resume's
        if cfg.resume:  # an earlier checkpoint of a run with later ones: continuing in place would lose them
            resume.refuse_rewind(cfg.resume, cfg.out)
        self._resume = resume.ResumePlan.locate(cfg.resume, cfg.out, resume_plan) if cfg.resume else None
        if self._resume is None:
            return
        self._resume.check_options(cfg, self.world_size)
        ck = self._resume.peek()
        if ck is not None:
            self._data_change = resume.check_data(ck, self.data_fingerprint, cfg, self._resume.path)
            self._precision_change = change.check_precision_change(
                ck, *change.requested(precision, cfg), cfg, self._resume.path, self._fsdp)

    # ------------------------------------------------------------------ run directory
    def _prepare_run(self) -> Optional[str]:
        """Rank 0 checks the run directory and picks the checkpoint to resume; every rank gets its
        answer (or its error), so no rank waits in a collective for one that gave up."""
        cfg = self.config
        if not _dist.is_main_process():
            path, err = _dist.broadcast_object(None)
            if err is not None:
                raise (RunDirError if err[0] == "RunDirError" else RuntimeError)(err[1])
            self.run_dir = cfg.out
            return path
        try:
            if cfg.out:
                self._run_dir.prepare(resuming=bool(cfg.resume))
            self.run_dir = cfg.out
            path = resume.checkpoint_to_resume(cfg.resume, cfg.out, strict=True)
        except Exception as e:
            if self.world_size > 1:
                _dist.broadcast_object((None, (type(e).__name__, str(e))))
            raise
        if self.world_size > 1:
            _dist.broadcast_object((path, None))
        return path

    # ------------------------------------------------------------------ checkpoints
    def _model_optim_state(self):
        """Full model/optimizer state dicts; under FSDP a collective every rank takes part in."""
        if self._fsdp:
            return _dist.full_state(self.raw_model, self.optimizer)
        return self.raw_model.state_dict(), self.optimizer.state_dict()

    def state_dict(self) -> Dict[str, Any]:
        model_state, optim_state = self._model_optim_state()
        return {"model": model_state, "optimizer": optim_state, **self._run_state()}

    def _run_state(self) -> Dict[str, Any]:
        """Everything of a checkpoint but the model and the optimizer."""
        return {
            "precision": self.precision.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "progress": {"epoch": self.epoch, "batch": self.batch_in_epoch, "global_step": self.global_step,
                         "attempted_steps": self.attempted_steps, "world_size": self.world_size},
            # wall time of every segment so far (summary.json's train_time_s of a resumed run); not state
            "train_time_s": self._time_before + (time.perf_counter() - self._t_segment
                                                 if self._t_segment is not None else 0.0),
            "rng": ckpt.rng_state(),
            "config": {k: v for k, v in recorded_options(self.config).to_dict().items() if v is not None},
            "model_signature": ckpt.model_signature(self.raw_model),
            "precision_reason": self.precision.reason,  # why auto chose the mode: a resume keeps it
            "data_fingerprint": self.data_fingerprint,
            "data_changes": self._data_changes,
            "precision_changes": self._precision_changes,
            "lr_changes": self._lr_changes,
        }

    def save_checkpoint(self) -> Optional[str]:
        """Write a checkpoint of the run's state (every rank calls it); its path on the ranks that wrote it
        (under FSDP each rank writes its shard: `ampkit.train.sharded`; otherwise rank 0 writes one file)."""
        directory = checkpoint_dir(self.run_dir)
        if directory is None or not (self._fsdp or _dist.is_main_process()):
            _dist.barrier()
            return None
        path = (ckpt.sharded_path if self._fsdp else ckpt.checkpoint_path)(directory, self.attempted_steps)
        state = self._run_state() if self._fsdp else self.state_dict()
        with self.stop.writing():  # a second Ctrl-C here lets the write finish, then stops
            if self._fsdp:  # a collective: each rank writes its shard
                sharded.save_sharded(self.raw_model, self.optimizer, state, path)
            else:
                ckpt.save_checkpoint(state, path)
            if _dist.is_main_process():
                ckpt.prune_checkpoints(directory, self.config.keep_last)
        self.last_checkpoint = path
        _dist.barrier()
        if self.stop.forced:
            raise TrainingInterrupted(self.stop.signum or signal.SIGINT, path)
        return path

    def load_checkpoint(self, path: str) -> None:
        """Continue from the checkpoint at ``path``: its options and model checked, every state loaded."""
        self._apply_checkpoint(sharded.read_checkpoint(path, map_location=self.device), path)

    def _apply_checkpoint(self, ck: Dict[str, Any], path: str, plan: Optional[resume.ResumePlan] = None) -> None:
        switch = self._precision_change
        signature = ckpt.model_signature(self.raw_model)
        theirs = ck.get("model_signature")
        if switch and theirs and len(theirs) == len(signature):  # the dtypes change with the mode, not the tensors
            signature = [[name, shape, t[2]] for (name, shape, _), t in zip(signature, theirs)]
        # after a divergence stop, --lr on the resume applies (the way the stop advises to continue)
        lr_applies = self._own_optimizer and self._own_schedule and resume.after_divergence(path, self.config.out)
        saved_lr = (ck.get("config") or {}).get("lr")
        self.config = resume.check_checkpoint(ck, path, self.config, self.world_size, signature,
                                              self.steps_per_epoch if self._own_schedule else None, plan, lr_applies)
        if self.device.type != "cpu":
            ck = to_device(ck, self.device)  # a plan reads on the CPU: where map_location would have put it
        built = [g["weight_decay"] for g in self.optimizer.param_groups] if self._own_optimizer else []
        try:
            if switch:  # another mode: its weights carried over, its optimizer state converted or reset
                change.carry_over(self.raw_model, self.optimizer, ck, self.config.change_optimizer)
            else:
                self.precision.load_state_dict(ck["precision"])
                sharded.load_model_and_optimizer(self.raw_model, self.optimizer, ck, self._fsdp)
            if self.scheduler is not None and ck.get("scheduler"):
                self.scheduler.load_state_dict(ck["scheduler"])
        except ckpt.CheckpointError:  # a damaged or refused shard: said as it is
            raise
        except (KeyError, RuntimeError, ValueError) as e:
            raise ckpt.CheckpointError(f"checkpoint {path!r} does not match this run: {str(e).splitlines()[0]}") from e
        self.epoch, self.batch_in_epoch, self.global_step, self.attempted_steps = resume.saved_position(
            ck, self.config, self.world_size, path)
        if self._own_schedule:  # --weight-decay / schedule options given on the resume: applied, as recorded
            resume.apply_given_options(self.optimizer, built, self.scheduler, resume.schedule_changed(
                self.config, ck.get("config") or {}, self.steps_per_epoch), self.global_step, bool(ck.get("scheduler")))
        self._data_changes = list(ck.get("data_changes") or [])
        if self._data_change:  # accepted with allow_new_data: recorded in the checkpoints, config.toml, metrics
            self._data_changes.append({"step": self.attempted_steps, "change": self._data_change,
                                       "data": self.config.data})
        self._lr_changes = list(ck.get("lr_changes") or [])
        if lr_applies and saved_lr and saved_lr != self.config.lr:  # the schedule's curve on from the new base lr
            resume.scale_lr(self.optimizer, self.scheduler, self.config.lr / saved_lr)
            self._lr_change = {"step": self.attempted_steps, "from": saved_lr, "to": self.config.lr}
            self._lr_changes.append(self._lr_change)
        self._precision_changes = list(ck.get("precision_changes") or [])
        if switch:
            self._precision_changes.append({"step": self.attempted_steps, "from": switch[0], "to": switch[1],
                                            "optimizer": self.config.change_optimizer})
        self._time_before = float(ck.get("train_time_s", 0.0))
        ckpt.set_rng_state(ck["rng"])
        self.last_checkpoint = path

    def _load_resumed(self, path: str) -> None:
        """Load the checkpoint to resume (the plan's one read of it); a damaged latest one names the
        earlier one to continue from."""
        plan = self._resume if self._resume is not None else resume.ResumePlan(path)
        try:
            self._apply_checkpoint(plan.load(path), path, plan)
        except ckpt.CheckpointError as e:
            older = ckpt.list_checkpoints(os.path.dirname(path))[:-1] if self.config.resume == "auto" else []
            if older and e.damaged:
                raise ckpt.CheckpointError(f"{e} An earlier checkpoint is {older[-1]!r}: move the damaged one out of "
                                           f"{os.path.dirname(path)!r} and continue with --resume auto, or train from "
                                           f"the earlier one in a new run directory with --resume {older[-1]} "
                                           "--out NEW_DIR.") from e
            raise
        finally:
            plan.release()

    def _already_finished(self) -> Optional[Dict[str, Any]]:
        """Resuming a run that already reached its epochs/max-steps: its summary (no file changed), else None."""
        return resume.finished_summary(self.config, self.run_dir, self.epoch, self.global_step,
                                       announce=_dist.is_main_process())

    # ------------------------------------------------------------------ training
    def fit(self) -> Dict[str, Any]:
        """Train for the configured epochs/steps; returns the summary dict."""
        if self._fit_called:
            raise RuntimeError(
                f"Trainer.fit() already ran on this Trainer (it reached epoch {self.epoch}, optimizer step "
                f"{self.global_step}): a Trainer trains once. To train further, build a new Trainer with "
                f"resume='auto' and the same out= ({self.config.out!r}) and a larger epochs= or max_steps=; "
                "to start over, build a new Trainer with another out=.")
        self._fit_called = True
        resume_path = self._prepare_run()
        try:
            return self._fit(resume_path)
        except BaseException:
            if _dist.is_main_process() and not self.last_checkpoint and self.run_dir:
                self._run_dir.failed(self._training_started)
            raise
        finally:
            self._run_dir.release()

    def _fit(self, resume_path: Optional[str]) -> Dict[str, Any]:
        cfg = self.config
        if resume_path:
            self._load_resumed(resume_path)
            done = self._already_finished()
            if done is not None and done.get("diverged"):  # nothing to train, and what it trained is no model
                raise RunDivergedError(done["diverged"], done)
            if done is not None:
                return done
        else:
            torch.manual_seed(cfg.seed)
            if cfg.resume == "auto" and _dist.is_main_process():
                print(f"ampkit: --resume auto: no checkpoint in {checkpoint_dir(self.run_dir)}: starting a new run there",
                      file=sys.stderr)
        self.batches.check_finite(self.epoch)
        if cfg.resume and self.run_dir and _dist.is_main_process():  # a checkpoint (if any) loaded: clear
            ckpt.remove_partial_writes(checkpoint_dir(self.run_dir))  # what a crash left
            if resume_path:  # an earlier attempt's report (it diverged) no longer describes the run: kept, renamed
                for name in set_aside_reports(self.run_dir, self.attempted_steps):
                    print(f"ampkit: an earlier attempt's report is kept as {os.path.join(self.run_dir, name)}",
                          file=sys.stderr)
        logger, kept = open_metrics(self.run_dir, cfg.tensorboard,
                                    (self.attempted_steps, self.epoch) if resume_path else None, self.world_size,
                                    resume.run_of(resume_path) if resume_path else None,
                                    evaluates=self.eval_data is not None)
        if kept is not None:
            self.history = kept
        self._kept_auto = bool(resume_path) and self.precision.requested == "auto"  # kept the mode chosen at the start
        if _dist.is_main_process():
            self._announce(logger, resume_path)
        t_start = self._t_segment = time.perf_counter()
        self._training_started = True
        loop = TrainLoop(
            cfg, Training(self.model, self.raw_model, self.precision, self.optimizer,
                          self.compiled_step or self.precision.step, self.loss_fn, self.scheduler, self._fsdp),
            self.batches, RunState(self.counters, self.history, self.stop),
            Outcomes(self.save_checkpoint, (lambda: self._evaluate(collect=False)) if self.eval_data is not None
                     else None, checkpoints=bool(self.run_dir)),
            world_size=self.world_size, device=self.device)
        try:
            with self.stop.guard():
                peak_memory_bytes = loop.run(logger)
        except NonFiniteGradientsError as e:
            loop.flush(logger)  # the steps up to the stopping one, with their throughput
            logger.close()
            if self.run_dir and _dist.is_main_process():
                write_nonfinite_report(self.run_dir, str(e), self.counters, self.precision.skipped_steps,
                                       cfg.grad_accum, self.last_checkpoint)
            raise
        except TrainingInterrupted:
            logger.close()
            raise
        train_time = self._time_before + time.perf_counter() - t_start  # all segments of a resumed run
        summary = self._finish(logger, train_time, peak_memory_bytes)
        logger.close()
        if summary["diverged"]:  # written and reported as it is, then a failure (`ampkit train` exits 3)
            raise RunDivergedError(summary["diverged"], summary)
        return summary

    def _announce(self, logger: MetricsLogger, resume_path: Optional[str]) -> None:
        """Rank 0, at the start of training: config.toml (with what resumes changed, as comments), the precision
        line, where a resume continues from, and this resume's data or precision change in metrics.jsonl."""
        changes = {f"data changed at step {c['step']}": f"{c['change']} (--allow-new-data; data {c['data']!r})"
                   for c in self._data_changes}
        changes.update({f"precision changed at step {c['step']}": f"{c['from']} -> {c['to']} (--allow-precision-"
                        f"change; the weights carried over, the optimizer state {_DONE[c['optimizer']]})"
                        for c in self._precision_changes})
        changes.update({f"lr changed at step {c['step']}": f"{c['from']:g} -> {c['to']:g} (--lr on the resume after "
                        "a divergence stop)" for c in self._lr_changes})
        announce(self.precision, self.config, self.run_dir, setup.task_note(self.task, self.train_data),
                 resume_path and resume.position_text(resume_path, self.counters, self.config), changes,
                 kept=self._kept_auto)
        if self._precision_change:
            logger.event({"kind": "precision_change", "step": self.attempted_steps, "from": self._precision_change[0],
                          "to": self._precision_change[1], "optimizer": self.config.change_optimizer})
        if self._lr_change:
            logger.event({"kind": "lr_change", **self._lr_change})
            print(f"ampkit: the run stopped on non-finite gradients before: lr {self._lr_change['to']:g} applies "
                  f"from step {self._lr_change['step']} on (it was {self._lr_change['from']:g})", file=sys.stderr)
        if self._data_change:
            logger.event({"kind": "data_change", "step": self.attempted_steps, "change": self._data_change,
                          "data": self.config.data, "fingerprint": self.data_fingerprint})

    # ------------------------------------------------------------------ evaluation and the summary
    def _evaluate(self, collect: bool) -> Dict[str, Any]:
        autocast = self.precision.autocast if self.config.eval_precision == "train" else contextlib.nullcontext
        return evaluate_shards(self.raw_model, self.batches, self.loss_fn, autocast, self.task,
                               self.config.batch_size * 4, collect, reshard=self._fsdp)

    def _finish(self, logger: MetricsLogger, train_time: float, peak_memory_bytes: int) -> Dict[str, Any]:
        final = self._evaluate(collect=True) if self.eval_data is not None else None
        summary, report = build_summary(
            self.precision, self.history, final, device=self.device, task=self.task, epochs=self.epoch,
            optimizer_steps=self.global_step, train_time=train_time, world_size=self.world_size,
            strategy=self.config.strategy if (self.world_size > 1 or self._fsdp) else None,
            class_names=self.class_names, peak_memory_bytes=peak_memory_bytes,
            planned_peak_bytes=self.planned_peak_bytes)
        summary["diverged"] = divergence(summary, self.attempted_steps)
        if _dist.is_main_process():
            publish(logger, self.run_dir, self.precision, summary, report, self.attempted_steps, self._kept_auto)
        return summary
