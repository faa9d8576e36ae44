"""`Trainer`: data -> forward -> loss -> backward -> step -> eval -> checkpoint.

The loop never asks which precision it runs in: it calls the `Precision` hooks (autocast,
backward, step) and nothing else. Gradient accumulation divides each micro-batch loss by the
size of its window (the last, partial window of an epoch by its own size), makes one
unscale/clip/step per window, and advances the scheduler and step counters only on real
(non-skipped) optimizer steps.

Exact resume: the data order of each epoch comes from a generator seeded with (seed, epoch),
so a resumed run regenerates the epoch's order and skips the micro-batches already consumed;
model, optimizer (fp32 masters included), scaler, scheduler and RNG states come from the
checkpoint. On CPU a stopped-and-resumed run ends bitwise equal to an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from ..precision import NonFiniteGradientsError, Precision, Tuned
from ..precision.convert import is_norm
from ..precision.modes import AUTO, MODES
from ..tuning import needs_tuning, tune
from . import checkpoint as ckpt
from . import distributed as _dist
from .config import TrainConfig, write_config
from .evaluate import classification_text, default_loss, evaluate
from .metrics import MetricsLogger, Progress, require_tensorboard
from ..utils.batch import batch_size_of, batch_target, call_model
from ..utils.tree import iter_tensors, to_device

__all__ = ["Trainer", "TrainingInterrupted", "RunDirError", "build_optimizer", "build_scheduler"]


class TrainingInterrupted(Exception):
    """Raised after a signal (Ctrl-C, SIGTERM) once the checkpoint has been written."""

    def __init__(self, signum: int, path: Optional[str]) -> None:
        self.signum = signum
        self.path = path
        name = signal.Signals(signum).name
        where = f"checkpoint saved to {path}" if path else "no run directory, nothing saved"
        super().__init__(f"{name} received: stopped at a step boundary; {where}. Resume with --resume auto.")


# options that define what the saved progress (epoch, micro-batch, optimizer state) refers to
_RESUME_MUST_MATCH = ("data", "batch_size", "grad_accum", "seed", "optimizer")


class RunDirError(ValueError):
    """The output directory cannot be used (holds another run, not writable...)."""


def is_run_dir(path: str) -> bool:
    """Does ``path`` hold an ampkit run (a config.toml of ours, metrics.jsonl, or checkpoints/)?"""
    if not os.path.isdir(path):
        return False
    if os.path.isdir(os.path.join(path, "checkpoints")) or os.path.isfile(os.path.join(path, "metrics.jsonl")):
        return True
    try:
        with open(os.path.join(path, "config.toml")) as f:
            return f.readline().startswith("# ampkit train config")
    except OSError:
        return False


# TrainConfig.memory_format -> Precision(channels_last=...): None = measured on the model (ampkit.tune)
_MEMORY_FORMATS = {"auto": None, "channels_last": True, "contiguous": False}


def _no_decay(name: str, param: torch.Tensor, module: nn.Module) -> bool:
    return param.dim() <= 1 or name.endswith(".bias") or is_norm(module)


def build_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float, device: torch.device,
                    sharded: bool = False, eps: Optional[float] = None):
    """AdamW/Adam/SGD with two param groups (no weight decay on biases and norm weights), fused where torch has it
    (for ``sharded`` DTensor parameters, torch has fused Adam/AdamW but no fused SGD: foreach then).
    ``eps``: Adam's epsilon (torch's 1e-8 when None; ``Precision.min_adam_eps`` for fp16 optimizer state)."""
    decay, no_decay, seen = [], [], set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:  # a tied weight (embedding = LM head) is stepped once
                continue
            seen.add(id(p))
            (no_decay if _no_decay(p_name, p, module) else decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
              if g["params"]]
    if not groups:
        raise ValueError("the model has no trainable parameters.")
    key = name.lower()
    fused = {"fused": True} if device.type in ("cpu", "cuda") else {}
    adam = {**fused, **({} if eps is None else {"eps": eps})}
    if key == "adamw":
        return torch.optim.AdamW(groups, lr=lr, **adam)
    if key == "adam":
        return torch.optim.Adam(groups, lr=lr, **adam)
    if key == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, **({} if sharded else fused))
    raise ValueError(f"Unknown optimizer {name!r}: use adamw, adam or sgd (or pass your own to Trainer).")


def build_scheduler(optimizer, kind: str, total_steps: int, warmup_steps: int):
    """constant | cosine | linear, each with an optional linear warm-up; None for constant without warm-up."""
    kind = kind.lower()
    if kind not in ("constant", "cosine", "linear"):
        raise ValueError(f"Unknown lr schedule {kind!r}: use constant, cosine or linear.")
    if kind == "constant" and warmup_steps <= 0:
        return None
    total = max(1, total_steps)

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _dist_info():
    return _dist.rank_and_world()


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
    """

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
        **overrides: Any,
    ) -> None:
        if isinstance(optimizer, str):  # an optimizer *name* (config key), not an instance
            overrides["optimizer"], optimizer = optimizer, None
        self._collate = {}
        if isinstance(train_data, DataLoader):
            if train_data.batch_size and "batch_size" not in overrides:
                overrides["batch_size"] = train_data.batch_size
            self._collate[id(train_data.dataset)] = train_data.collate_fn
            train_data = train_data.dataset
        if isinstance(eval_data, DataLoader):
            self._collate[id(eval_data.dataset)] = eval_data.collate_fn
            eval_data = eval_data.dataset
        self.config = (config or TrainConfig()).updated(**overrides).checked()
        cfg = self.config
        if cfg.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {cfg.grad_accum}.")
        if cfg.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {cfg.batch_size}.")
        if cfg.epochs < 1 and not cfg.max_steps:
            raise ValueError(f"epochs must be >= 1, got {cfg.epochs}.")
        if len(train_data) == 0:
            raise ValueError("the training set is empty: it needs at least one sample.")
        if cfg.tensorboard:
            require_tensorboard()  # before the run directory exists: a failed start leaves nothing behind
        self.rank, self.world_size = _dist_info()
        if cfg.strategy not in _dist.STRATEGIES:
            raise ValueError(f"Unknown strategy {cfg.strategy!r}: use {' or '.join(_dist.STRATEGIES)}.")
        self._fsdp = cfg.strategy == "fsdp"
        if self._fsdp and not _dist.is_initialized():
            raise ValueError("strategy 'fsdp' needs torch.distributed: launch with "
                             "torchrun --nproc-per-node N -m ampkit train --strategy fsdp ...")
        if cfg.memory_format not in _MEMORY_FORMATS:
            raise ValueError(f"Unknown memory_format {cfg.memory_format!r}: use {', '.join(_MEMORY_FORMATS)}.")
        if isinstance(precision, Precision):
            self.precision = precision
        else:
            self.precision = Precision(
                precision or cfg.precision, _dist.default_device(cfg.device),
                loss_scale=cfg.loss_scale, init_scale=cfg.init_scale,
                max_consecutive_skips=cfg.max_consecutive_skips, fp32_modules=cfg.fp32_modules,
                compensation=cfg.compensation, channels_last=_MEMORY_FORMATS[cfg.memory_format],
            )
        self.device = self.precision.device
        self.train_data, self.eval_data = train_data, eval_data
        self.task = task or _infer_task(train_data)
        self.class_names = list(class_names) if class_names else None
        self.loss_fn = loss_fn or default_loss
        self._peek_resume_options()
        self._check_model_accepts_data(model)  # before timing or writing anything
        if not isinstance(precision, Precision):
            self._tune(model)
        if self._fsdp:  # shard first: the optimizer must hold the sharded (DTensor) parameters
            if optimizer is not None:
                raise ValueError("strategy 'fsdp' shards the model before building the optimizer: pass "
                                 "optimizer=None and set optimizer/lr/weight_decay in the config.")
            _dist.mixed_precision_policy(self.precision)  # refuses modes that cast parameters
            _dist.fsdp_memory_format(self.precision)  # FSDP shards contiguous parameters only
            model = _dist.shard_fsdp(self.precision.setup(model, None)[0], self.precision)
            optimizer = build_optimizer(model, cfg.optimizer, cfg.lr, cfg.weight_decay, self.device, sharded=True,
                                        eps=self.precision.min_adam_eps)
            self.precision.scaler.register_names(model)
            self.model, self.optimizer = model, optimizer
        else:
            if optimizer is None:
                optimizer = build_optimizer(model.to(self.device), cfg.optimizer, cfg.lr, cfg.weight_decay, self.device,
                                            eps=self.precision.min_adam_eps)
            self.model, self.optimizer = self.precision.setup(model, optimizer)
        self.raw_model = self.model
        if self.world_size > 1 and not self._fsdp:
            self.model = _dist.wrap_model(self.model, self.device)
            # DDP all-reduces gradients: every rank sees the same ones, so found-inf needs no collective
            self.precision.scaler.distributed = False
        if cfg.compile:
            self.model = torch.compile(self.model)
        n_batches = self._batches_per_epoch()
        self.steps_per_epoch = math.ceil(n_batches / cfg.grad_accum)
        total = cfg.max_steps or self.steps_per_epoch * cfg.epochs
        self._own_schedule = scheduler is None  # built from the config (then a resume can say what changed)
        self.scheduler = scheduler if scheduler is not None else build_scheduler(
            self.optimizer, cfg.lr_schedule, total, cfg.warmup_steps)
        # progress counters
        self.epoch = 0
        self.batch_in_epoch = 0  # micro-batches of the current epoch already consumed
        self.global_step = 0  # real optimizer steps
        self.attempted_steps = 0  # optimizer steps attempted (real + skipped)
        self.history: List[Dict[str, Any]] = []
        self.run_dir: Optional[str] = None
        self._stop_signal: Optional[int] = None
        self.last_checkpoint: Optional[str] = None
        self._saved_state: Optional[tuple] = None
        self._time_before = 0.0  # training seconds of the segments before a resume
        self._created_dir: Optional[str] = None
        self._t_segment: Optional[float] = None
        self._pending_step: Optional[tuple] = None  # the last step, its skip flag not yet read

    def _tune(self, model: nn.Module) -> None:
        """Measure what the run left open on this model and its first batch (``ampkit.tune``; cached
        per machine): the mode for precision auto, the memory format of a conv model, attention kernels.
        A resumed auto run keeps its checkpoint's mode. Several processes keep the defaults (every rank
        must run the same mode and layout, and timings differ per rank)."""
        cfg, prec = self.config, self.precision
        modes = prec.requested == AUTO
        if modes and cfg.resume:
            try:
                path = cfg.resume
                if path == "auto":
                    path = ckpt.latest_checkpoint(os.path.join(cfg.out, "checkpoints")) if cfg.out else None
                saved = ckpt.load_checkpoint(path, map_location="cpu").get("precision", {}).get("name") if path else None
            except Exception:
                saved = None  # fit() reports a bad checkpoint with the full message
            if saved and saved != prec.name and saved in MODES:
                prec = self.precision = prec.retuned(Tuned(mode=saved, mode_reason="the resumed run's precision"))
            modes = False
        if not needs_tuning(prec, model, modes) or not cfg.autotune or self.world_size > 1 or self._fsdp:
            return
        idx = torch.arange(min(cfg.batch_size, len(self.train_data)))
        x, y = self._fetch(self.train_data, idx)
        self.precision = tune(prec, model, x, y, self.loss_fn, grad_accum=cfg.grad_accum, modes=modes,
                              log=lambda msg: print(f"ampkit: {msg}", file=sys.stderr, flush=True))

    # ------------------------------------------------------------------ data
    def _batches_per_epoch(self) -> int:
        n = math.ceil(len(self.train_data) / self.world_size)
        return math.ceil(n / self.config.batch_size)

    def _epoch_order(self, epoch: int) -> List[torch.Tensor]:
        g = torch.Generator().manual_seed(self.config.seed * 100_003 + epoch)
        perm = torch.randperm(len(self.train_data), generator=g)
        if self.world_size > 1:  # shard like DistributedSampler (pad by wrapping around)
            per = math.ceil(len(perm) / self.world_size)
            perm = torch.cat([perm, perm[: per * self.world_size - len(perm)]])[self.rank::self.world_size]
        return list(torch.split(perm, self.config.batch_size))

    def _fetch(self, dataset: Dataset, idx: torch.Tensor):
        """``(inputs, target)`` of the samples ``idx``: a dict batch is its own inputs (target: its labels)."""
        if isinstance(dataset, TensorDataset):
            x, y = (t[idx] for t in dataset.tensors[:2])
        else:
            batch = self._collate.get(id(dataset), default_collate)([dataset[int(i)] for i in idx])
            if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
                x, y = batch[0], (batch[1] if len(batch) > 1 else None)
            else:
                x, y = batch, batch_target(batch)
        nb = self.device.type == "cuda"
        x = to_device(x, self.device, non_blocking=nb)
        return x, (batch_target(x) if isinstance(x, Mapping) else to_device(y, self.device, non_blocking=nb))

    def _eval_batches(self, dataset: Dataset):
        size = self.config.batch_size * 4
        for start in range(0, len(dataset), size):
            yield self._fetch(dataset, torch.arange(start, min(start + size, len(dataset))))

    # ------------------------------------------------------------------ run directory
    def _prepare_run_dir(self) -> Optional[str]:
        cfg = self.config
        if not cfg.out or self.rank != 0:
            return cfg.out
        out = cfg.out
        holds_run = is_run_dir(out)
        if os.path.exists(out) and not os.path.isdir(out):
            raise RunDirError(f"--out {out!r} is a file, not a directory: choose another --out.")
        if not holds_run and os.path.isdir(out) and os.listdir(out):
            shown = ", ".join(sorted(os.listdir(out))[:3]) + (", ..." if len(os.listdir(out)) > 3 else "")
            raise RunDirError(f"--out {out!r} is a directory that is not an ampkit run and is not empty (it holds "
                              f"{shown}): ampkit writes only into a new or empty directory or a run of its own: "
                              "choose a new --out (nothing was written).")
        if holds_run and not cfg.resume:
            raise RunDirError(
                f"--out {out!r} already holds a run: continue it with --resume auto, or choose another --out "
                "(nothing was overwritten).")
        try:
            if not os.path.isdir(out) or not os.listdir(out):
                self._created_dir = out  # emptied again when this invocation fails before its first checkpoint
                self._dir_existed = os.path.isdir(out)
            os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
            probe = os.path.join(out, ".write-test")
            with open(probe, "w") as f:
                f.write("ok")
            os.unlink(probe)
        except OSError as e:
            raise RunDirError(f"--out {out!r} is not writable ({e.strerror}): choose another --out.") from e
        return out

    def _prepare_run(self) -> Optional[str]:
        """Rank 0 checks the run directory and picks the checkpoint to resume; every rank gets its
        answer (or its error), so no rank waits in a collective for one that gave up."""
        if self.world_size == 1:
            self.run_dir = self._prepare_run_dir()
            return self._resolve_resume()
        answer = None
        if self.rank == 0:
            try:
                self.run_dir = self._prepare_run_dir()
                answer = (self._resolve_resume(), None)
            except Exception as e:
                _dist.broadcast_object((None, (type(e).__name__, str(e))))
                raise
        path, err = _dist.broadcast_object(answer)
        if err is not None:
            raise (RunDirError if err[0] == "RunDirError" else RuntimeError)(err[1])
        self.run_dir = self.config.out
        return path

    def _check_model_accepts_data(self, model: nn.Module) -> None:
        """One fp32 forward and loss of the user's model on two training samples (eval mode, no grad) and
        the labels against its outputs: a model that does not fit the data is one ValueError naming the
        fix, before anything is timed or written."""
        from ..data import check_labels

        x, y = self._fetch(self.train_data, torch.arange(min(2, len(self.train_data))))
        dev = next((p.device for p in model.parameters()), None)
        if dev is not None and dev != self.device:
            x, y = to_device(x, dev), to_device(y, dev)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = call_model(model, x)
                self.loss_fn(out, y)
        except Exception as e:
            text = (str(e).strip().splitlines() or [type(e).__name__])[0]
            hint = ""
            if isinstance(x, torch.Tensor):
                hint = f" (a sample of x has shape {tuple(x.shape[1:])}, dtype {str(x.dtype).replace('torch.', '')})"
                if not x.is_floating_point() and self.task != "lm":
                    hint += ("; x holds integers: save it as float32 (e.g. x.astype('float32') / 255 for 8-bit "
                             "images)")
            raise ValueError(f"the model cannot train on this data: {type(e).__name__}: {text}{hint}. Use a model "
                             "that fits the data (--model), or fix the data.") from None
        finally:
            model.train(was_training)
        if (self.loss_fn is default_loss and isinstance(out, torch.Tensor) and out.dim() >= 2
                and isinstance(y, torch.Tensor) and not y.is_floating_point()):
            check_labels(self.train_data, out.shape[-1], "training")
            if self.eval_data is not None:
                check_labels(self.eval_data, out.shape[-1], "evaluation")

    def _finished(self) -> bool:
        cfg = self.config
        return self.epoch >= cfg.epochs or bool(cfg.max_steps and self.global_step >= cfg.max_steps)

    def _already_finished(self) -> Optional[Dict[str, Any]]:
        """Resuming a run that already reached its epochs/max-steps: say so, change no file, return its summary."""
        path = os.path.join(self.run_dir, "summary.json") if self.run_dir else None
        if not path or not os.path.isfile(path):
            return None  # it stopped before writing its summary: the normal path finishes it
        if self.rank == 0:
            print(f"ampkit: the run in {self.run_dir} already finished ({self.epoch} epoch(s), {self.global_step} "
                  f"optimizer steps; epochs={self.config.epochs}, max_steps={self.config.max_steps}): nothing to "
                  "train and no file changed. Pass a larger --epochs or --max-steps to train it further.",
                  file=sys.stderr)
        with open(path) as f:
            return json.load(f)

    def _checkpoint_dir(self) -> Optional[str]:
        return os.path.join(self.run_dir, "checkpoints") if self.run_dir else None

    # ------------------------------------------------------------------ checkpoints
    def _model_optim_state(self):
        """Full model/optimizer state dicts; under FSDP a collective every rank takes part in."""
        if self._fsdp:
            return _dist.full_state(self.raw_model, self.optimizer)
        return self.raw_model.state_dict(), self.optimizer.state_dict()

    def state_dict(self) -> Dict[str, Any]:
        model_state, optim_state = self._model_optim_state()
        return {
            "model": model_state,
            "optimizer": optim_state,
            "precision": self.precision.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "progress": {"epoch": self.epoch, "batch": self.batch_in_epoch, "global_step": self.global_step,
                         "attempted_steps": self.attempted_steps, "world_size": self.world_size},
            # wall time of every segment so far (summary.json's train_time_s of a resumed run); not state
            "train_time_s": self._time_before + (time.perf_counter() - self._t_segment
                                                 if self._t_segment is not None else 0.0),
            "rng": ckpt.rng_state(),
            "config": {k: v for k, v in self.config.to_dict().items() if v is not None},
            "model_signature": ckpt.model_signature(self.raw_model),
        }

    def save_checkpoint(self) -> Optional[str]:
        self._resolve_step()
        directory = self._checkpoint_dir()
        if directory is not None:  # every rank: all must agree on whether the final save is due
            self._saved_state = (self.epoch, self.batch_in_epoch, self.attempted_steps)
        if directory is None or self.rank != 0:
            if directory is not None and self._fsdp:
                self._model_optim_state()  # rank 0 gathers the shards: take part
            self._barrier()
            return None
        path = ckpt.checkpoint_path(directory, self.attempted_steps)
        ckpt.save_checkpoint(self.state_dict(), path)
        ckpt.prune_checkpoints(directory, self.config.keep_last)
        self.last_checkpoint = path
        self._barrier()
        return path

    def _barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        ck = ckpt.load_checkpoint(path, map_location=self.device)
        missing = [k for k in ("model", "optimizer", "precision", "progress", "rng") if k not in ck]
        if missing:
            raise ckpt.CheckpointError(f"checkpoint {path!r} has no {', '.join(map(repr, missing))} entry: it is "
                                       "incomplete or was not written by the ampkit Trainer.")
        saved = ck.get("config") or {}
        self._check_saved_options(ck, path)
        mine, theirs = ckpt.model_signature(self.raw_model), ck.get("model_signature")
        if theirs is not None and [list(x) for x in theirs] != mine:
            diff = next(((a, b) for a, b in zip(theirs, mine) if list(a) != list(b)), None)
            detail = (f"first difference: checkpoint {diff[0][0]} {diff[0][1]} {diff[0][2]} vs model "
                      f"{diff[1][0]} {diff[1][1]} {diff[1][2]}" if diff else
                      f"checkpoint has {len(theirs)} tensors, model has {len(mine)}")
            raise ckpt.CheckpointError(f"checkpoint {path!r} is from a different model ({detail}).")
        note = self._schedule_change(saved) if self._own_schedule and saved else None
        if note:
            warnings.warn(note, stacklevel=2)
        try:
            self.precision.load_state_dict(ck["precision"])
            if self._fsdp:
                _dist.load_full_state(self.raw_model, self.optimizer, ck["model"], ck["optimizer"])
            else:
                self.raw_model.load_state_dict(ck["model"])
                self.optimizer.load_state_dict(_dist.keep_implementation(ck["optimizer"], self.optimizer))
            if self.scheduler is not None and ck.get("scheduler"):
                self.scheduler.load_state_dict(ck["scheduler"])
        except (KeyError, RuntimeError, ValueError) as e:
            raise ckpt.CheckpointError(f"checkpoint {path!r} does not match this run: {str(e).splitlines()[0]}") from e
        p = ck["progress"]
        self.epoch, self.batch_in_epoch = p["epoch"], p["batch"]
        saved_batch = p.get("world_size", 1) * int(ck.get("config", {}).get("batch_size", self.config.batch_size))
        if saved_batch != self.world_size * self.config.batch_size and self.batch_in_epoch:
            self.batch_in_epoch = _dist.rescale_position(
                self.batch_in_epoch, saved_batch, self.world_size * self.config.batch_size, path)
        self.global_step, self.attempted_steps = p["global_step"], p.get("attempted_steps", p["global_step"])
        self._time_before = float(ck.get("train_time_s", 0.0))
        ckpt.set_rng_state(ck["rng"])
        self.last_checkpoint = path

    def _check_saved_options(self, ck: Dict[str, Any], path: str) -> None:
        """The options that define what a checkpoint's position means must match this run's."""
        saved = ck.get("config") or {}
        saved_world = int(ck.get("progress", {}).get("world_size", 1))
        for key in _RESUME_MUST_MATCH:
            if key == "batch_size" and key in saved:  # the global batch must match; the world size may change
                theirs, ours = saved[key] * saved_world, self.config.batch_size * self.world_size
                if theirs != ours:
                    fix = (f"resume with --batch-size {theirs // self.world_size} ({theirs} = "
                           f"{theirs // self.world_size} x {self.world_size} process(es))" if theirs % self.world_size == 0
                           else f"resume on a number of processes that divides {theirs}")
                    raise ckpt.CheckpointError(
                        f"checkpoint {path!r} was written with a global batch of {theirs} (batch_size={saved[key]} x "
                        f"{saved_world} process(es)), this run has {ours} (batch_size={self.config.batch_size} x "
                        f"{self.world_size}): its saved position would not match the data. Keep the global batch: "
                        f"{fix}; or start a new run.")
                continue
            if key in saved and saved[key] != getattr(self.config, key):
                raise ckpt.CheckpointError(
                    f"checkpoint {path!r} was written with {key}={saved[key]!r}, this run has "
                    f"{key}={getattr(self.config, key)!r}: its saved position would not match the data. Resume "
                    f"without --{key.replace('_', '-')} (a resumed run keeps its saved options), or start a new run.")

    def _peek_resume_options(self) -> None:
        """Resuming: refuse options that contradict the checkpoint before the data is even tried on the
        model (another --data can make the model fail on it first, with a less useful message)."""
        cfg = self.config
        if not cfg.resume:
            return
        path = cfg.resume
        if path == "auto":
            path = ckpt.latest_checkpoint(os.path.join(cfg.out, "checkpoints")) if cfg.out else None
        try:
            ck = ckpt.load_checkpoint(path, map_location="cpu") if path else None
        except Exception:
            return  # fit() reports a bad checkpoint with the full message
        if ck is not None:
            self._check_saved_options(ck, path)

    def _schedule_change(self, saved: Dict[str, Any]) -> Optional[str]:
        """What a resume with other schedule options changes, in one sentence, or None.

        The schedule's length comes from epochs/max_steps, so resuming with more epochs stretches a
        cosine/linear curve mid-run; the checkpoint's lr (optimizer and scheduler state) wins over --lr.
        """
        cfg = self.config
        changes = []
        for key in ("lr_schedule", "warmup_steps"):
            if key in saved and saved[key] != getattr(cfg, key):
                changes.append(f"{key} {saved[key]!r} -> {getattr(cfg, key)!r}")
        if cfg.lr_schedule != "constant" and ("epochs" in saved or "max_steps" in saved):
            before = saved.get("max_steps") or self.steps_per_epoch * int(saved.get("epochs", cfg.epochs))
            now = cfg.max_steps or self.steps_per_epoch * cfg.epochs
            if before != now:
                changes.append(f"the {cfg.lr_schedule} schedule now spans {now} optimizer steps, not {before} "
                               "(its length comes from --epochs/--max-steps)")
        if "lr" in saved and saved["lr"] != cfg.lr:
            changes.append(f"--lr {cfg.lr:g} does not apply: the checkpoint's lr {saved['lr']:g} continues")
        if not changes:
            return None
        return ("resuming with other learning-rate options: " + "; ".join(changes) + ". The learning rate will "
                "differ from the uninterrupted run's; resume without those flags (a resumed run keeps its saved "
                "options) to keep it.")

    def _resolve_resume(self) -> Optional[str]:
        spec = self.config.resume
        if not spec:
            return None
        if spec == "auto":
            directory = self._checkpoint_dir() or (os.path.join(self.config.out, "checkpoints") if self.config.out else None)
            if directory is None:
                raise RunDirError("--resume auto needs --out DIR (the run directory to continue).")
            return ckpt.latest_checkpoint(directory)
        return spec

    # ------------------------------------------------------------------ signals
    @contextlib.contextmanager
    def _signal_guard(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {}

        def handler(signum, frame):
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # second Ctrl-C: stop now
            self._stop_signal = signum

        for s in (signal.SIGINT, signal.SIGTERM):
            previous[s] = signal.signal(s, handler)
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    # ------------------------------------------------------------------ training
    def fit(self) -> Dict[str, Any]:
        """Train for the configured epochs/steps; returns the summary dict."""
        cfg = self.config
        resume_path = self._prepare_run()
        try:
            return self._fit(resume_path)
        except BaseException:
            self._remove_stub_run_dir()
            raise

    def _remove_stub_run_dir(self) -> None:
        """A run directory this invocation created (or found empty) that holds no checkpoint yet is emptied on
        failure, so the retry does not find 'a run' in its way; one that held anything is never touched."""
        out = getattr(self, "_created_dir", None)
        if not out or self.rank != 0 or self.last_checkpoint or not os.path.isdir(out):
            return
        if ckpt.list_checkpoints(os.path.join(out, "checkpoints")):
            return
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        if getattr(self, "_dir_existed", False):  # the user's empty directory stays, empty
            os.makedirs(out, exist_ok=True)

    def _fit(self, resume_path: Optional[str]) -> Dict[str, Any]:
        cfg = self.config
        if resume_path:
            try:
                self.load_checkpoint(resume_path)
            except ckpt.CheckpointError as e:
                older = ckpt.list_checkpoints(os.path.dirname(resume_path))[:-1] if cfg.resume == "auto" else []
                if older and e.damaged:
                    raise ckpt.CheckpointError(f"{e} An earlier checkpoint is {older[-1]!r}: continue from it "
                                               f"with --resume {older[-1]}") from e
                raise
        else:
            torch.manual_seed(cfg.seed)
            if cfg.resume == "auto" and self.rank == 0:
                print(f"ampkit: --resume auto: no checkpoint in {self._checkpoint_dir()}: starting a new run there",
                      file=sys.stderr)
        if resume_path and self._finished():
            done = self._already_finished()
            if done is not None:
                return done
        self._check_inputs_finite()
        is_main = self.rank == 0
        metrics_path = os.path.join(self.run_dir, "metrics.jsonl") if (self.run_dir and is_main) else None
        if cfg.resume and metrics_path:  # the checkpoint (if any) loaded: clear what a crash left
            ckpt.remove_partial_writes(self._checkpoint_dir())
        if resume_path and metrics_path:
            # before the logger opens the file: truncation replaces it with a new one
            self.history = _truncate_metrics(metrics_path, self.attempted_steps, self.epoch)
        logger = MetricsLogger(
            metrics_path,
            os.path.join(self.run_dir, "tensorboard") if (self.run_dir and is_main and cfg.tensorboard) else None,
            append=bool(resume_path),
            reduce=_mean_loss_over_ranks if self.world_size > 1 else None,
        )
        if self.run_dir and is_main:
            write_config(cfg.updated(resume=None), os.path.join(self.run_dir, "config.toml"),
                         {"precision (resolved)": self.precision.describe()})
        if is_main:
            print(f"ampkit: {self.precision.describe()}", file=sys.stderr)
            if resume_path:
                print(f"ampkit: resumed from {resume_path} (epoch {self.epoch}, step {self.global_step})", file=sys.stderr)
        t_start = self._t_segment = time.perf_counter()
        samples_seen = 0
        try:
            with self._signal_guard():
                samples_seen = self._train_epochs(logger, is_main)
        except NonFiniteGradientsError as e:
            logger.close()
            self._write_nonfinite_report(str(e))
            raise
        except TrainingInterrupted:
            logger.close()
            raise
        train_time = self._time_before + time.perf_counter() - t_start  # all segments of a resumed run
        summary = self._finish(logger, samples_seen, train_time, is_main)
        logger.close()
        return summary

    def _train_epochs(self, logger: MetricsLogger, is_main: bool) -> int:
        cfg = self.config
        model, precision, optimizer = self.model, self.precision, self.optimizer
        accum = cfg.grad_accum
        samples_seen = 0
        # TensorDatasets are checked for NaN/inf upfront; other datasets when a step is skipped
        check_skipped_inputs = not isinstance(self.train_data, TensorDataset)
        window_inputs: List[tuple] = []
        model.train()
        while self.epoch < cfg.epochs:
            order = self._epoch_order(self.epoch)
            n = len(order)
            progress = Progress(n, cfg.progress and is_main, f"epoch {self.epoch + 1}/{cfg.epochs}", self.batch_in_epoch)
            t_flush, samples_flush = time.perf_counter(), 0
            window_loss = torch.zeros((), device=self.device)
            i = self.batch_in_epoch
            while i < n:
                window_start = (i // accum) * accum
                window = min(accum, n - window_start)
                last_in_window = (i - window_start) == window - 1
                x, y = self._fetch(self.train_data, order[i])
                if check_skipped_inputs:
                    window_inputs.append((i, order[i], x, y))
                with self._sync_context(last_in_window):
                    with precision.autocast():
                        out = call_model(model, x)
                        loss = self.loss_fn(out, y) / window
                    precision.backward(loss)
                window_loss += loss.detach()
                n_samples = batch_size_of(y, x)
                samples_flush += n_samples
                samples_seen += n_samples
                i += 1
                self.batch_in_epoch = i
                progress.advance()
                if not last_in_window:
                    continue
                # the previous step's skip flag, one step late: its copy to the host finished while this
                # window's forward/backward was queued, so reading it does not wait for this step
                self._resolve_step()
                result = precision.step(optimizer, max_norm=cfg.max_norm)
                self.attempted_steps += 1
                record = self._log_step(logger, window_loss)
                self._pending_step = (record, result.to_host(), window_inputs, self.batch_in_epoch)
                window_inputs = []
                window_loss = torch.zeros((), device=self.device)
                log_due = self.attempted_steps % cfg.log_every == 0 or i == n
                save_due = bool(cfg.save_every) and self.attempted_steps % cfg.save_every == 0
                # a signal is local to a rank: with several, they flush (a collective) and stop only at
                # log boundaries, where all agree
                stop_pending = self._stop_signal is not None and self.world_size == 1
                if log_due or save_due or stop_pending or (cfg.max_steps and self.attempted_steps >= cfg.max_steps):
                    self._resolve_step()  # global_step can reach max_steps only once attempted_steps has
                optimizer.zero_grad(set_to_none=True)  # after: a skip-limit error names the bad grads
                if log_due or save_due or stop_pending:
                    # metrics reach the file before any checkpoint: a kill never loses logged steps
                    now = time.perf_counter()
                    rate = samples_flush * self.world_size / max(now - t_flush, 1e-9)
                    records = logger.flush(samples_per_s=rate)
                    if records:
                        self.history.extend(records)
                        last = records[-1]
                    if records and log_due:
                        progress.show({"step": self.global_step, "loss": f"{last['loss']:.4f}",
                                       "scale": f"{last['scale']:g}", "skipped": precision.skipped_steps,
                                       "lr": f"{last['lr']:.2e}", "samples/s": f"{rate:.0f}"})
                    t_flush, samples_flush = now, 0
                if save_due:
                    self.save_checkpoint()
                if self._stop_now(log_due):
                    progress.close()
                    path = self.save_checkpoint()
                    raise TrainingInterrupted(self._stop_signal, path)
                if cfg.max_steps and self.global_step >= cfg.max_steps:
                    break
            progress.close()
            logger.flush()
            finished_epoch = self.batch_in_epoch >= n
            if finished_epoch:
                self.epoch += 1
                self.batch_in_epoch = 0
            ev = self._evaluate(collect=False) if self.eval_data is not None else None
            if ev is not None and is_main:
                rec = {"kind": "eval", "step": self.attempted_steps, "epoch": self.epoch,
                       "loss": ev["loss"], "accuracy": ev["accuracy"]}
                logger.event(rec)
                self.history.append(rec)
                acc = f", accuracy {ev['accuracy']:.4f}" if ev["accuracy"] is not None else ""
                print(f"epoch {self.epoch}/{cfg.epochs}: eval loss {ev['loss']:.4f}{acc}, "
                      f"steps {self.global_step}, skipped {precision.skipped_steps}", file=sys.stderr)
            if not cfg.save_every:
                self.save_checkpoint()
            if cfg.max_steps and self.global_step >= cfg.max_steps:
                break
        if self._saved_state != (self.epoch, self.batch_in_epoch, self.attempted_steps):
            self.save_checkpoint()  # the final state, whatever --save-every said
        return samples_seen

    def _log_step(self, logger: MetricsLogger, window_loss: torch.Tensor) -> Dict[str, Any]:
        """Queue this step's record; ``optimizer_step``, ``skipped`` and ``lr`` are filled in when the
        skip flag is resolved (``_resolve_step``, always before the record is written)."""
        scaler = self.precision.scaler
        record = {
            "kind": "train", "step": self.attempted_steps, "optimizer_step": None,
            "epoch": self.epoch, "loss": window_loss.clone(),
            "scale": scaler.scale_tensor.clone() if scaler.scale_tensor is not None else 1.0,
            "skipped": None, "lr": None,
        }
        logger.step(record)
        return record

    def _resolve_step(self) -> None:
        """Apply the last step's outcome on the host: count it, advance the LR schedule only on a real
        step, check a skipped window's inputs, stop at the skip limit. Called before the next optimizer
        step (the copy of the flag is done by then: no wait in steady state) and at log/save points."""
        pending, self._pending_step = self._pending_step, None
        if pending is None:
            return
        record, flag, window_inputs, batch_in_epoch = pending
        stepped = True if flag is None else not flag.value() > 0
        if stepped:
            self.global_step += 1
            if self.scheduler is not None:
                self.scheduler.step()
        record.update(optimizer_step=self.global_step, skipped=not stepped, lr=self.optimizer.param_groups[0]["lr"])
        if not stepped:
            try:
                self._check_window_inputs(window_inputs)  # bad data explains a skip better
                self.precision.scaler.check_skip_limit(self.optimizer)
            except NonFiniteGradientsError:
                self.batch_in_epoch = batch_in_epoch  # where the stopping step was (for the report)
                raise

    def _stop_now(self, boundary: bool) -> bool:
        """Stop after a signal. Ranks get signals at different steps, so with several they agree at
        log boundaries (one tiny collective there) and all stop at the same step."""
        if self.world_size == 1:
            return self._stop_signal is not None
        if not boundary:
            return False
        signum = _dist.any_rank(self._stop_signal or 0, self.device)
        self._stop_signal = signum or None
        return bool(signum)

    def _sync_context(self, last_in_window: bool):
        """DDP/FSDP: reduce gradients only on the last micro-batch of a window."""
        if self._fsdp:
            self.raw_model.set_requires_gradient_sync(last_in_window)
            return contextlib.nullcontext()
        if not last_in_window and hasattr(self.model, "no_sync"):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _evaluate(self, collect: bool) -> Dict[str, Any]:
        autocast = self.precision.autocast if self.config.eval_precision == "train" else contextlib.nullcontext
        if self.world_size == 1:
            batches = self._eval_batches(self.eval_data)
        else:  # each rank evaluates its shard; sums (loss, correct, count) are all-reduced
            shards = _dist.shard_indices(len(self.eval_data), self.rank, self.world_size, self.config.batch_size * 4)
            batches = (self._fetch(self.eval_data, idx) for idx in shards)
        result = evaluate(self.raw_model, batches, self.loss_fn, autocast, self.task, collect)
        if self._fsdp:  # FSDP's root stays unsharded (compute dtype) after a forward: back to the fp32 shards
            self.raw_model.reshard()
        return _dist.reduce_eval(result, len(self.eval_data), self.task, collect, self.device)

    def _check_window_inputs(self, window: List[tuple]) -> None:
        """After a skipped step: NaN/inf in that window's inputs or targets is one clear error with the batch index."""
        for b, idx, x, y in window:
            for what, t in [("inputs", t) for t in iter_tensors(x)] + [("targets", t) for t in iter_tensors(y)]:
                if t.is_floating_point() and t.dim() > 0 and len(t) == len(idx):
                    bad = ~torch.isfinite(t.reshape(len(t), -1)).all(dim=1)
                    if bad.any():
                        first = int(idx[int(bad.nonzero()[0])])
                        raise ValueError(
                            f"the training data holds NaN/inf in its {what}: epoch {self.epoch + 1}, batch {b}, "
                            f"{_row_of(self.train_data, first)} ({int(bad.sum())} bad sample(s) in that batch); the step was skipped. "
                            "Clean or filter the data before training.")

    def _check_inputs_finite(self) -> None:
        """NaN/inf in the training inputs: one clear error naming the first bad sample (and its batch)."""
        for name, ds in (("training", self.train_data), ("evaluation", self.eval_data)):
            if not isinstance(ds, TensorDataset):
                continue
            for what, x in zip(("inputs", "targets"), ds.tensors[:2]):
                if x.is_floating_point():
                    bad = ~torch.isfinite(x.reshape(len(x), -1)).all(dim=1)
                    if bad.any():
                        first = int(bad.nonzero()[0])
                        where = ""
                        if name == "training":
                            for b, idx in enumerate(self._epoch_order(self.epoch)):
                                if (idx == first).any():
                                    where = f" (epoch {self.epoch + 1}, batch {b})"
                                    break
                        raise ValueError(
                            f"the {name} data holds NaN/inf in the {what} of {int(bad.sum())} sample(s); first at "
                            f"{_row_of(ds, first)}{where}. Clean or filter the data before training.")

    def _finish(self, logger: MetricsLogger, samples_seen: int, train_time: float, is_main: bool) -> Dict[str, Any]:
        final = self._evaluate(collect=True) if self.eval_data is not None else None
        rates = [r["samples_per_s"] for r in self.history if r.get("kind") == "train" and "samples_per_s" in r]
        train_losses = [r["loss"] for r in self.history if r.get("kind") == "train" and not r.get("skipped")]
        summary = {
            "precision": self.precision.name,
            "precision_requested": self.precision.requested,
            "precision_reason": self.precision.reason,
            "device": str(self.device),
            "task": self.task,
            "accuracy": final["accuracy"] if final else None,
            "eval_loss": final["loss"] if final else None,
            "final_train_loss": train_losses[-1] if train_losses else None,
            "epochs": self.epoch,
            "optimizer_steps": self.global_step,
            "skipped_steps": self.precision.skipped_steps,
            "final_loss_scale": self.precision.loss_scale,
            "samples_per_s": (sorted(rates)[len(rates) // 2] if rates else None),
            "train_time_s": train_time,
            "world_size": self.world_size,
            "strategy": self.config.strategy if (self.world_size > 1 or self._fsdp) else None,
        }
        if final and "perplexity" in final:
            summary["perplexity"] = final["perplexity"]
        report = None
        if final and "preds" in final:
            report = classification_text(final["preds"], final["targets"], self.class_names)
            summary["classification_report"] = report["dict"]
            summary["confusion_matrix"] = report["confusion_matrix"]
        if is_main:
            logger.event({"kind": "summary", "step": self.attempted_steps,
                          **{k: v for k, v in summary.items() if k not in ("classification_report", "confusion_matrix")}})
            text = self._report_text(summary, report)
            print(text)
            if self.run_dir:
                with open(os.path.join(self.run_dir, "report.txt"), "w") as f:
                    f.write(text + "\n")
                tmp = os.path.join(self.run_dir, "summary.json.tmp")
                with open(tmp, "w") as f:
                    json.dump(summary, f, indent=2)
                os.replace(tmp, os.path.join(self.run_dir, "summary.json"))
        return summary

    def _report_text(self, summary: Dict[str, Any], report: Optional[Dict[str, Any]]) -> str:
        lines = [f"precision: {self.precision.describe()}",
                 f"optimizer steps: {summary['optimizer_steps']} (skipped {summary['skipped_steps']}), "
                 f"final loss scale: {summary['final_loss_scale']:g}, epochs: {summary['epochs']}"]
        if summary["samples_per_s"]:
            lines.append(f"throughput: {summary['samples_per_s']:.0f} samples/s (median), train time {summary['train_time_s']:.1f} s")
        if summary["eval_loss"] is not None:
            acc = f", accuracy {summary['accuracy']:.4f}" if summary["accuracy"] is not None else ""
            ppl = f", perplexity {summary['perplexity']:.3f}" if "perplexity" in summary else ""
            lines.append(f"eval loss {summary['eval_loss']:.4f}{acc}{ppl}")
        if report:
            lines += ["", "classification report (scikit-learn)", report["text"], report["confusion_text"]]
        return "\n".join(lines)

    def _write_nonfinite_report(self, message: str) -> None:
        """The scaler's message (which parameters) plus where in the run it stopped and how to go on."""
        if not self.run_dir or self.rank != 0:
            return
        last = self.batch_in_epoch - 1
        first = last - (last % self.config.grad_accum)
        lines = [
            "training stopped: gradients stayed non-finite (no update was applied on any of those steps)",
            message,
            f"stopped at: step {self.attempted_steps} ({self.global_step} applied, "
            f"{self.precision.skipped_steps} skipped in all), epoch {self.epoch + 1}, "
            f"micro-batches {first}-{last} of that epoch",
            f"last checkpoint: {self.last_checkpoint or 'none'}",
            "continue after fixing the cause: the same command with --resume auto",
        ]
        with open(os.path.join(self.run_dir, "nonfinite_report.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


def _row_of(dataset: Dataset, index: int) -> str:
    from ..data import row_of

    return row_of(dataset, index)


def _mean_loss_over_ranks(values: torch.Tensor, keys: List[str]) -> torch.Tensor:
    """MetricsLogger reduce hook: the logged train loss is the mean over ranks (one collective per flush)."""
    if "loss" in keys:
        col = keys.index("loss")
        values[:, col] = _dist.reduce_mean_(values[:, col].contiguous())
    return values


def _infer_task(ds: Dataset) -> str:
    sample = ds[0]
    if isinstance(sample, Mapping) or not isinstance(sample, (list, tuple)):
        y = batch_target(sample)  # a dict sample: its labels (token labels: lm; one label: classification)
        if y is None:
            return "lm"  # the model's own loss on unlabeled inputs (e.g. causal LM with labels built inside)
        y = torch.as_tensor(y)
        return "regression" if y.is_floating_point() else ("lm" if y.dim() >= 1 else "classification")
    x, y = sample[0], sample[1]
    y = torch.as_tensor(y)
    if y.is_floating_point():
        return "regression"
    return "lm" if y.dim() == 1 and not torch.as_tensor(x).is_floating_point() else "classification"


def _truncate_metrics(path: str, upto_step: int, upto_epoch: int) -> List[Dict[str, Any]]:
    """Drop records written after the checkpoint we resume from (they will be produced again).

    Returns the records kept (the run's history so far). An evaluation is logged after its epoch
    counter advanced, so one with a later epoch than the checkpoint's came after it, even at the
    same step (a checkpoint saved on an epoch's last step, before that epoch's evaluation).
    """
    if not os.path.exists(path):
        return []
    keep, records = [], []
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash
            if r.get("kind") == "summary" or r.get("step", 0) > upto_step:
                continue
            if r.get("kind") == "eval" and r.get("epoch", 0) > upto_epoch:
                continue
            keep.append(line if line.endswith("\n") else line + "\n")
            records.append(r)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)
    return records
