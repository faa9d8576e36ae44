"""Everything the Trainer decides before its first step: config checks, the `Precision` (built,
then tuned on the model), the model checked against the data, the optimizer and LR schedule, and
the DDP/FSDP/compile wrapping."""
from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from ..data import check_labels
from ..precision import Precision, Tuned, compile_model, compile_step
from ..precision.auto import RESUMED, resumed_mode
from ..precision.convert import is_norm
from ..precision.modes import AUTO, MODES
from ..tuning import needs_tuning, tune
from ..utils.batch import batch_target, call_model
from ..utils.tree import to_device
from ..utils.warn import user_stacklevel
from . import distributed as _dist
from .batches import Batches
from .config import ONE_RESUME, TrainConfig
from .evaluate import default_loss
from .metrics import require_tensorboard
from .wording import continue_hint, opt

__all__ = ["build_optimizer", "build_scheduler", "check_config", "make_precision", "tune_for_run", "check_run_length", "task_note",
           "check_model_accepts_data", "infer_task", "wire"]

# TrainConfig.memory_format -> Precision(channels_last=...): None = measured on the model (ampkit.tune)
MEMORY_FORMATS = {"auto": None, "channels_last": True, "contiguous": False}


def _no_decay(name: str, param: torch.Tensor, module: nn.Module) -> bool:
    return param.dim() <= 1 or name.endswith(".bias") or is_norm(module)


def build_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float, device: torch.device,
                    sharded: bool = False, eps: Optional[float] = None):
    """AdamW/Adam/SGD with two param groups (no weight decay on biases and norm weights), fused where torch has it
    (for ``sharded`` DTensor parameters, torch has fused Adam/AdamW but no fused SGD: foreach then).
    ``eps``: Adam's epsilon (torch's 1e-8 when None; ``Precision._min_adam_eps`` for fp16 optimizer state)."""
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


def check_config(cfg: TrainConfig, train_data: Dataset) -> None:
    """Refuse what cannot train, before anything is built or written (the options' ranges: TrainConfig.checked)."""
    if len(train_data) == 0:
        raise ValueError("the training set is empty: it needs at least one sample.")
    if cfg.tensorboard:
        require_tensorboard()  # before the run directory exists: a failed start leaves nothing behind
    if cfg.strategy not in _dist.STRATEGIES:
        raise ValueError(f"Unknown strategy {cfg.strategy!r}: use {' or '.join(_dist.STRATEGIES)}.")
    if cfg.strategy == "fsdp" and not _dist.is_initialized():
        raise ValueError("strategy 'fsdp' needs torch.distributed: launch with "
                         "torchrun --nproc-per-node N -m ampkit train --strategy fsdp ..." +
                         (" (or --strategy ddp to continue an FSDP run's checkpoint in one process)" if cfg.resume else ""))
    if cfg.memory_format not in MEMORY_FORMATS:
        raise ValueError(f"Unknown memory_format {cfg.memory_format!r}: use {', '.join(MEMORY_FORMATS)}.")
    if not cfg.resume:  # the one-resume options mean nothing to a new run: said, not ignored
        defaults = TrainConfig()
        given = [opt(k, repr(getattr(cfg, k)), cli="" if isinstance(getattr(cfg, k), bool) else getattr(cfg, k))
                 for k in ONE_RESUME if getattr(cfg, k) != getattr(defaults, k)]
        if given:
            raise ValueError(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} only to a resume "
                             f"({continue_hint()} or a checkpoint's path): this run starts new; leave "
                             f"{'them' if len(given) > 1 else 'it'} out.")


def check_run_length(cfg: TrainConfig, micro_batches: int, total_steps: int) -> None:
    """Options the data makes meaningless: a window longer than an epoch is refused (each step would
    accumulate the epoch, not ``grad_accum`` micro-batches); a warm-up longer than the run is a warning."""
    if cfg.grad_accum > micro_batches:
        raise ValueError(f"--grad-accum {cfg.grad_accum} is more than the {micro_batches} micro-batch(es) of an epoch "
                         f"(batch size {cfg.batch_size}): a step would accumulate one epoch, not {cfg.grad_accum}. Use "
                         f"--grad-accum {micro_batches} or less, or a smaller --batch-size.")
    if cfg.warmup_steps > total_steps:
        warnings.warn(f"--warmup-steps {cfg.warmup_steps} is longer than the run ({total_steps} optimizer steps): the "
                      "learning rate never reaches --lr. Use fewer warm-up steps, or train longer.", stacklevel=3)


def run_strategy(cfg: TrainConfig, world_size: int) -> Optional[str]:
    """What the run is spread with: ``cfg.strategy`` under several processes (FSDP also on one), else None."""
    return cfg.strategy if world_size > 1 or cfg.strategy == "fsdp" else None


def make_precision(precision: Any, cfg: TrainConfig, world_size: int = 1) -> Precision:
    """A ready `Precision` as given (rebuilt with the run's ``strategy`` when built without it, before its
    ``setup``), else one built from a name (or the config's), the config's options and the run's strategy."""
    strategy = run_strategy(cfg, world_size)
    if isinstance(precision, Precision):
        if strategy is None or precision.strategy == strategy:
            return precision
        if precision.is_setup:
            raise ValueError(f"the Precision given was set up already, without strategy={strategy!r}: pass it "
                             f"before setup, or build it with ampkit.Precision(..., strategy={strategy!r}).")
        return precision.with_options(strategy=strategy)
    with warnings.catch_warnings(record=True) as caught:  # the mode's advice ("likely slower than fp32"...)
        warnings.simplefilter("always")
        built = Precision(
            precision or cfg.precision, _dist.run_device(cfg.device), strategy=strategy,
            loss_scale=cfg.loss_scale, init_scale=cfg.init_scale,
            max_consecutive_skips=cfg.max_consecutive_skips, fp32_modules=cfg.fp32_modules,
            compensation=cfg.compensation, optimizer_state=cfg.optimizer_state,
            channels_last=MEMORY_FORMATS[cfg.memory_format],
            **{k: getattr(cfg, k) for k in ("fp8_filter", "fp8_gpu", "fp8_tokens") if getattr(cfg, k, None) is not None},
        )
    for w in caught:  # ... said at the user's line that built the Trainer (the first frame outside ampkit)
        warnings.warn(w.message, stacklevel=user_stacklevel())
    return built


def tune_for_run(prec: Precision, model: nn.Module, cfg: TrainConfig, batches: Batches, loss_fn: Callable,
                 saved_mode: Optional[str], single_process: bool, saved_reason: Optional[str] = None) -> Precision:
    """Measure what the run left open on this model and its first batch (``ampkit.tune``; cached
    per machine): the mode for precision auto, the memory format of a conv model, attention kernels.
    A resumed auto run keeps its checkpoint's mode (``saved_mode``) and the reason it was chosen for
    (``saved_reason``, recorded when the run started; checkpoints before it: `RESUMED`); with no checkpoint yet, auto
    chooses as a fresh start does. Several processes keep the defaults
    (every rank must run the same mode and layout, and timings differ per rank)."""
    kept = resumed_mode(prec.requested, saved_mode)  # precision.auto: a resumed auto keeps its checkpoint's mode
    if kept in MODES:
        prec = prec._retuned(Tuned(mode=kept, mode_reason=saved_reason or RESUMED))
    modes = prec.requested == AUTO and kept is None
    if not needs_tuning(prec, model, modes) or not cfg.autotune or not single_process:
        return prec
    x, y = batches.first(cfg.batch_size)
    return tune(prec, model, x, y, loss_fn, grad_accum=cfg.grad_accum, modes=modes, refresh=cfg.retune,
                log=lambda msg: print(f"ampkit: {msg}", file=sys.stderr, flush=True))


def check_model_accepts_data(model: nn.Module, batches: Batches, loss_fn: Callable, task: str) -> None:
    """One fp32 forward and loss of the user's model on two training samples (eval mode, no grad) and
    the labels against its outputs: a model that does not fit the data is one ValueError naming the
    fix, before anything is timed or written."""
    x, y = batches.first(2)
    dev = next((p.device for p in model.parameters()), None)
    if dev is not None and dev != batches.device:
        x, y = to_device(x, dev), to_device(y, dev)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = call_model(model, x)
            loss_fn(out, y)
    except Exception as e:
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        hint = ""
        if isinstance(x, torch.Tensor):
            hint = f" (a sample of x has shape {tuple(x.shape[1:])}, dtype {str(x.dtype).replace('torch.', '')})"
            if not x.is_floating_point() and task != "lm":
                hint += ("; x holds integers: save it as float32 (e.g. x.astype('float32') / 255 for 8-bit "
                         "images)")
        raise ValueError(f"the model cannot train on this data: {type(e).__name__}: {text}{_raised_at(e)}{hint}. "
                         "Use a model that fits the data (--model), or fix the data.") from None
    finally:
        model.train(was_training)
    _check_last_batch(model, batches, x)
    if (loss_fn is default_loss and isinstance(out, torch.Tensor) and out.dim() >= 2
            and isinstance(y, torch.Tensor) and not y.is_floating_point()):
        check_labels(batches.train_data, out.shape[-1], "training")
        if batches.eval_data is not None:
            check_labels(batches.eval_data, out.shape[-1], "evaluation")


def _raised_at(error: BaseException) -> str:
    """Where the user's code raised ``error``: its innermost frame outside torch, ampkit and Python's own
    library (" (raised at file:line in name)"), or "" where every frame is theirs. The one-line error drops the
    traceback; this keeps the line to look at."""
    import os
    import sysconfig
    import traceback

    skip = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["ampkit"]))
    skip += tuple(sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib"))
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not frame.filename.startswith(skip) and not frame.filename.startswith("<"):
            return f" (raised at {frame.filename}:{frame.lineno} in {frame.name})"
    return ""


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _check_last_batch(model: nn.Module, batches: Batches, x: Any) -> None:
    """An epoch whose last batch holds one sample, with BatchNorm: a training forward of one sample (the
    norms' running statistics put back after it) shows whether BatchNorm can train on it; a ValueError
    naming the batch sizes that avoid it when it cannot (torch's error would come at the epoch's end)."""
    samples = math.ceil(len(batches.train_data) / batches.world_size)
    norms = [m for m in model.modules() if isinstance(m, _BATCH_NORMS)]
    if samples % batches.batch_size != 1 or samples == 1 or not norms:
        return
    one = next(iter(batches.eval_batches(batches.train_data, 1)))[0]
    dev = next((p.device for p in model.parameters()), None)
    if dev is not None and dev != batches.device:
        one = to_device(one, dev)
    saved = [{k: v.clone() for k, v in m.named_buffers(recurse=False)} for m in norms]
    was_training = model.training
    model.train()
    try:
        with torch.no_grad():
            call_model(model, one)
    except ValueError as e:
        if "Expected more than 1 value per channel" not in str(e):
            raise
        b = batches.batch_size
        fits = [c for c in range(max(2, b - 8), b + 9) if samples % c != 1]
        fits = sorted(fits, key=lambda c: abs(c - b))[:2]
        raise ValueError(f"the last batch of each epoch holds 1 sample ({samples} samples, batch size {b}) and the "
                         f"model's BatchNorm cannot train on a batch of one: use another batch size (e.g. "
                         f"{' or '.join(map(str, sorted(fits)))}), or drop a sample from the training data.") from None
    finally:
        model.train(was_training)
        for m, buffers in zip(norms, saved):
            for k, v in buffers.items():
                getattr(m, k).copy_(v)


def task_note(task: str, ds: Dataset) -> Optional[str]:
    """The line `fit` prints on stdout for a regression: which task, and why (float targets; whole
    numbers among them look like class labels saved as floats)."""
    if task != "regression":
        return None
    y = ds.tensors[1] if isinstance(ds, TensorDataset) and len(ds.tensors) >= 2 else None
    if y is not None and y.is_floating_point() and y.numel() and bool((y == y.round()).all()):
        distinct = torch.unique(y).numel()
        if distinct <= 100:
            return (f"task: regression (the targets are floats; they hold {distinct} whole numbers: if those are "
                    "class labels, save them as integers, e.g. y.astype('int64'), to train a classifier)")
    return "task: regression (the targets are floats: MSE loss; class labels must be integers)"


def infer_task(ds: Dataset) -> str:
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


def wire(model: nn.Module, optimizer, prec: Precision, cfg: TrainConfig, world_size: int):
    """(model to call, model as built, optimizer): the precision applied, then sharded (FSDP, the optimizer
    built on the shards) or wrapped (DDP), then compiled when asked."""
    device = prec.device
    if cfg.strategy == "fsdp":  # shard first: the optimizer must hold the sharded (DTensor) parameters
        if optimizer is not None:
            raise ValueError("strategy 'fsdp' shards the model before building the optimizer: pass "
                             "optimizer=None and set optimizer/lr/weight_decay in the config.")
        prec._fsdp_policy()  # the kind refuses what FSDP cannot shard (fp8); built with strategy="fsdp": contiguous
        model = _dist.shard_fsdp(prec.setup(model, None)[0], prec)
        optimizer = prec.wrap_optimizer(build_optimizer(model, cfg.optimizer, cfg.lr, cfg.weight_decay, device,
                                                        sharded=True, eps=prec._min_adam_eps))
        prec.scaler.register_names(model)
    else:
        if optimizer is None:
            optimizer = build_optimizer(model.to(device), cfg.optimizer, cfg.lr, cfg.weight_decay, device,
                                        eps=prec._min_adam_eps)
        model, optimizer = prec.setup(model, optimizer)
    raw_model = model
    if world_size > 1 and cfg.strategy != "fsdp":
        model = _dist.wrap_model(model, device)  # the precision was built with strategy="ddp": no found-inf collective
    if cfg.compile:  # regional (repeated blocks) or whole; the step: ``compiled_step``
        model, _ = compile_model(model)
    return model, raw_model, optimizer


def compiled_step(prec: Precision, optimizer, cfg: TrainConfig, world_size: int):
    """``precision.step`` compiled (tensor lr: no recompiles under the schedule) when ``cfg.compile``,
    single-process or DDP; None otherwise (FSDP's DTensor grads keep the eager step)."""
    if not cfg.compile or cfg.strategy == "fsdp":
        return None
    return compile_step(prec, optimizer)
