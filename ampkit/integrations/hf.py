"""Every ampkit precision mode in the Hugging Face ``transformers.Trainer``.

.. code-block:: python

    from ampkit.integrations.hf import AmpkitTrainer

    args = TrainingArguments("out", max_grad_norm=1.0, ...)        # leave fp16/bf16 False: ampkit replaces them
    trainer = AmpkitTrainer(model=model, args=args, train_dataset=ds, precision="fp16-master")
    trainer.train()                                                  # or train(resume_from_checkpoint=True)
    trainer.save_model("final")                                      # full precision, config.json says so

``precision`` is an ampkit mode or alias (``"bf16-mixed"``, ``"fp16-master"``, ``"bf16-pure"``, ...) or a
built :class:`ampkit.Precision` (for its options: ``loss_scale``, ``init_scale``, ``compensation``, ...).
:class:`AmpkitTrainerMixin` gives the same to another ``Trainer`` subclass (``class T(AmpkitTrainerMixin,
Seq2SeqTrainer)``). What it changes in the Trainer:

* the model and the optimizer the Trainer builds (or was given) go through ``precision.setup`` when
  training starts (masters, the compensated optimizer, fused kernels); the model's forward (only it, as
  accelerate's ``bf16=True``/``fp16=True`` wraps it) runs under ``precision.autocast()`` and hands its 16-bit
  floating outputs on in fp32, so a loss computed outside the model (a custom ``compute_loss``,
  sentence-transformers' losses) runs in fp32 as under HF's own mixed precision;
* the backward scales the loss where the mode scales; each optimizer step is ``precision.step``: unscale,
  non-finite check, step or skip, scale update. A skipped step is counted (``trainer.precision.skipped_steps``,
  ``skipped_steps`` and ``loss_scale`` in the logs) and the learning-rate scheduler is not stepped for it
  (accelerate's ``optimizer_step_was_skipped``, as with HF's own fp16); reading the skip is one host read
  per optimizer step, as with HF's own fp16;
* ``max_grad_norm`` is ampkit's clipping: the unscaled gradients (the fp32 master gradients where the
  mode has them) are clipped and their norm is the ``grad_norm`` logged;
* checkpoints (``checkpoint-N/``) hold ``ampkit_precision.pt`` beside HF's own files: ``precision.state_dict()``
  (mode, loss scale and its counters, optimizer state precision, fp8 recipe) and the fp8 modules' amax
  histories; ``resume_from_checkpoint`` restores them; a checkpoint of another mode is refused;
* ``save_model`` (and the model in each checkpoint) is written in full precision where the mode keeps fp32
  weights (fp32, the autocast modes, fp16/bf16-master, fp8) and in bf16-pure with Kahan buffers (weight +
  buffer: ``precision.fp32_state_dict``), with a ``config.json`` whose ``dtype`` says float32, so a plain
  ``from_pretrained(dir)`` gets the fp32 weights; fp16-pure writes its 16-bit weights, the truth there. The
  casts are made on the CPU and a PEFT model's frozen base is not cast (its ``save_pretrained`` writes the
  adapters only); a resume takes bf16-pure's restored buffers off the saved sums (the bf16 weights, bitwise);
* TRL's configs, which turn bf16 on by default, are taken over (bf16 set False) with one warning;

Refused in one line: ``TrainingArguments(fp16=True/bf16=True)`` (accelerate's own mixed precision, which
ampkit replaces), DeepSpeed and FSDP (they own the optimizer and the parameters), optimizers that need the
closure or the learning rate in the backward (LOMO).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import warnings
from typing import Any, Dict, Optional

import torch

try:
    from transformers import Trainer, TrainerCallback
    from transformers.utils import logging as hf_logging
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("ampkit.integrations.hf needs the `transformers` package (and `accelerate`): "
                      "pip install transformers accelerate.") from e

from ..precision import Precision
from ..precision.export import fp8_recipe_keys, has_kahan
from ..utils.tree import map_tensors

__all__ = ["AmpkitTrainer", "AmpkitTrainerMixin", "AmpkitOptimizer", "PRECISION_STATE_NAME"]

logger = hf_logging.get_logger(__name__)

#: the file in each ``checkpoint-N/`` folder holding ``precision.state_dict()``
PRECISION_STATE_NAME = "ampkit_precision.pt"


class AmpkitOptimizer(torch.optim.Optimizer):
    """The optimizer the Trainer holds: ``step()`` is ``precision.step(optimizer)`` on the optimizer ampkit
    steps (fp32 masters, compensated, or the one given); groups, state and ``state_dict`` are that one's, so
    schedulers and HF's ``optimizer.pt`` see the masters, moments and Kahan buffers."""

    def __init__(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        self.optimizer = optimizer
        self.precision = precision
        #: what the last ``precision.step`` returned (a StepResult: falsy when the step was skipped)
        self.last_result: Any = None
        self._optimizer_step_pre_hooks = getattr(optimizer, "_optimizer_step_pre_hooks", {})
        self._optimizer_step_post_hooks = getattr(optimizer, "_optimizer_step_post_hooks", {})

    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, v: setattr(self.optimizer, "param_groups", v))
    state = property(lambda self: self.optimizer.state, lambda self, v: setattr(self.optimizer, "state", v))
    defaults = property(lambda self: self.optimizer.defaults, lambda self, v: setattr(self.optimizer, "defaults", v))

    def __repr__(self) -> str:
        return f"AmpkitOptimizer({self.optimizer!r}, {self.precision!r})"

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("AmpkitTrainer steps without a closure (the Trainer runs the backward itself): "
                             "use an optimizer whose step() needs no closure.")
        self.last_result = self.precision.step(self.optimizer)
        self._opt_called = True  # what torch's LR schedulers check, as their step wrapper would set it
        return self.last_result

    step._wrapped_by_lr_sched = True  # a scheduler over this optimizer finds its step tracked (above)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def train(self) -> None:  # schedule-free optimizers (the Trainer calls these when present)
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()

    def eval(self) -> None:
        if callable(getattr(self.optimizer, "eval", None)):
            self.optimizer.eval()


def _ampkit_optimizer(optimizer: Any) -> Optional[AmpkitOptimizer]:
    """The AmpkitOptimizer inside accelerate's wrappers, or None."""
    while optimizer is not None and not isinstance(optimizer, AmpkitOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


class _SkippedStepsToScheduler(TrainerCallback):
    """Tells accelerate's optimizer wrapper whether ampkit skipped the step, so the Trainer does not step the
    learning-rate scheduler for it (``accelerator.optimizer_step_was_skipped``, HF's fp16 convention)."""

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        stepped = _ampkit_optimizer(optimizer)
        if stepped is None or stepped.last_result is None:
            return
        if not hasattr(type(optimizer), "step_was_skipped"):
            raise RuntimeError("AmpkitTrainer: accelerate's optimizer wrapper has no step_was_skipped: this "
                               "accelerate version is not supported (pip install 'accelerate>=1.0').")
        optimizer._is_overflow = not bool(stepped.last_result)  # the one host read of the step


class _ForwardInAutocast:
    """A model's ``forward`` replaced: the original under ``precision.autocast()``, its fp16/bf16 floating outputs
    cast to fp32 (accelerate's ``convert_outputs_to_fp32``). An ampkit object: ``precision.export`` drops it."""

    def __init__(self, forward: Any, precision: Precision) -> None:
        self.forward, self.precision = forward, precision
        functools.update_wrapper(self, forward)  # signature and name: the Trainer reads forward's parameters

    def __deepcopy__(self, memo: dict) -> "_ForwardInAutocast":  # a copy of the model (EMA, export): the same
        return type(self)(copy.deepcopy(self.forward, memo), self.precision)  # precision, the copy's forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision.autocast():
            out = self.forward(*args, **kwargs)
        return map_tensors(_to_fp32, out)


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _trl_default_bf16(targs: Any) -> bool:
    """A TRL config (``SFTConfig``, ``DPOConfig``, ...) whose bf16 is TRL's default (on wherever fp16 is off):
    one whose fields default bf16 to None and that holds bf16 True, accelerate's bf16 not asked by the environment
    (``ACCELERATE_MIXED_PRECISION``). A bf16=True the user wrote looks the same: the warning says what to pass."""
    field = getattr(type(targs), "__dataclass_fields__", {}).get("bf16")
    return (type(targs).__module__.split(".")[0] == "trl" and field is not None and field.default is None
            and targs.bf16 and not targs.fp16 and os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "no")


def _has_adapters(model: Any) -> bool:
    """A PEFT model (``PeftModel``, or a transformers model given adapters with ``add_adapter``): its
    ``save_pretrained`` writes the adapters, not the base."""
    return getattr(model, "peft_config", None) is not None or getattr(model, "_hf_peft_config_loaded", False)


def _keeps_fp32_weights(precision: Precision) -> bool:
    """Whether the mode's true weights are fp32 (fp32, autocast, master and fp8 modes; not the pure modes)."""
    return precision.param_dtype == torch.float32


class AmpkitTrainerMixin:
    """Give a ``transformers.Trainer`` (sub)class every ampkit mode: ``precision=`` (see the module docstring)."""

    def __init__(self, *args: Any, precision: Any = "auto", **kwargs: Any) -> None:
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if targs is not None and _trl_default_bf16(targs):  # TRL's configs turn bf16 on unless told: ampkit's
            warnings.warn(f"AmpkitTrainer: {type(targs).__name__} turns bf16 on by default (TRL's bf16=None); "
                          "ampkit's precision replaces it (bf16 set False here): pass bf16=False to say so "
                          "yourself.", stacklevel=2)
            targs.bf16, targs.mixed_precision = False, "no"
        if targs is not None and (targs.fp16 or targs.bf16):
            which = "fp16" if targs.fp16 else "bf16"
            raise ValueError(f"AmpkitTrainer: TrainingArguments({which}=True) turns on accelerate's own mixed "
                             f"precision, which ampkit replaces: leave fp16/bf16 False and pass precision=... "
                             f"(e.g. precision='{which}-mixed').")
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("AmpkitTrainer does not run under DeepSpeed or FSDP (they own the optimizer and the "
                             "parameters): use their own mixed precision there, or train without them.")
        if self.args.optim in ("lomo", "adalomo"):
            raise ValueError("AmpkitTrainer: LOMO optimizers step inside the backward, which ampkit's step "
                             "replaces: pick another optim.")
        device = self.args.device
        if isinstance(precision, Precision):
            if precision.device.type != torch.device(device).type:
                raise ValueError(f"AmpkitTrainer: precision was built for {precision.device}, the Trainer runs on "
                                 f"{device}: build it with ampkit.Precision(..., device={str(device)!r}).")
            if precision.is_setup:
                raise ValueError("AmpkitTrainer: this precision already set up another model: pass a new "
                                 "ampkit.Precision (or the mode's name).")
            self.precision = precision
        else:
            self.precision = Precision(precision, device)
        self.add_callback(_SkippedStepsToScheduler())
        self._forward_in_autocast()
        if self.precision.scales_loss:  # the Trainer's backward goes through accelerate: scale there
            self._scale_accelerator_backward()

    # -- backward
    def _scale_accelerator_backward(self) -> None:
        accelerator, precision = self.accelerator, self.precision

        def backward(loss, **kwargs):  # accelerate's backward for a single process, with the loss scaled
            precision.backward(loss / accelerator.gradient_accumulation_steps, **kwargs)

        accelerator.backward = backward

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if getattr(self, "precision", None) is not None and self.precision.scales_loss:
            self._scale_accelerator_backward()  # a recreated accelerator (auto_find_batch_size)

    # -- forward
    def _forward_in_autocast(self) -> None:
        """The model's forward (only it) runs under ``precision.autocast()`` and hands 16-bit floating outputs on
        in fp32, as accelerate wraps it for ``bf16=True``/``fp16=True``: a loss the client computes outside the
        model (a custom ``compute_loss``, sentence-transformers' losses, distillation) runs in fp32. Once per
        model object (the one ``setup`` returns, a ``model_init``'s)."""
        model = self.model
        if model is not None and not isinstance(vars(model).get("forward"), _ForwardInAutocast):
            model.forward = _ForwardInAutocast(model.forward, self.precision)

    def autocast_smart_context_manager(self, cache_enabled: Optional[bool] = True):
        return contextlib.nullcontext()  # HF's own: autocast lives in the model's forward (above)

    # -- optimizer
    def create_optimizer(self, model=None):
        if _ampkit_optimizer(self.optimizer) is not None:
            return self.optimizer
        super().create_optimizer(model)
        given = self.optimizer
        if self.precision.is_setup:  # a later train() call on the same model: the kind's optimizer change only
            stepped = self.precision.wrap_optimizer(self.optimizer)
        else:
            model, stepped = self.precision.setup(self.model, self.optimizer)
            if model is not self.model:
                self.model = self.model_wrapped = model
            self._forward_in_autocast()
            clip = (f"max_grad_norm={self.args.max_grad_norm:g} is clipped by ampkit, on the unscaled gradients"
                    if self.args.max_grad_norm > 0 else "no clipping (max_grad_norm=0)")
            logger.info(f"AmpkitTrainer: {self.precision.describe()}; {clip}.")
        self.optimizer = AmpkitOptimizer(stepped, self.precision)
        if getattr(self.lr_scheduler, "optimizer", None) is given:  # optimizers=(opt, scheduler): the scheduler
            self.lr_scheduler.optimizer = self.optimizer  # drives the groups of the optimizer that steps
        return self.optimizer

    def _stepped_optimizer(self) -> torch.optim.Optimizer:
        made = _ampkit_optimizer(self.optimizer)
        if made is None:
            raise RuntimeError("AmpkitTrainer: the optimizer was replaced after create_optimizer(): ampkit cannot "
                               "step it; build it in create_optimizer (or pass optimizers=(opt, sched)).")
        return made.optimizer

    def _clip_grad_norm(self, model, max_norm: Optional[float] = None):
        """Clip the unscaled gradients: the model's, as HF clips them (same order and kernel, so bf16-mixed is
        HF's bf16 bitwise), where the optimizer steps the model's parameters; the fp32 master gradients where
        it steps masters. In the unscaled modes the norm is also the step's non-finite check."""
        max_norm = self.args.max_grad_norm if max_norm is None else max_norm
        optimizer, precision = self._stepped_optimizer(), self.precision
        own = {id(p) for p in model.parameters()}
        if not all(id(p) in own for g in optimizer.param_groups for p in g["params"]):
            return precision.clip_grad_norm_(optimizer, max_norm)
        if precision.scales_loss:
            precision.unscale_(optimizer)
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        precision.unscale_(optimizer, norm)
        return norm

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # max_grad_norm=0: the norm logged, of the unscaled gradients (not clipped)
            grad_norm = self._clip_grad_norm(model, float("inf"))
        return grad_norm

    # -- logs
    def log(self, logs: Dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs and self.precision.is_setup:  # training logs: read at logging time only
            logs["skipped_steps"] = self.precision.skipped_steps
            if self.precision.scales_loss:
                logs["loss_scale"] = self.precision.loss_scale
        super().log(logs, *args, **kwargs)

    # -- checkpoints
    def _save_scaler(self, output_dir: str) -> None:
        if self.args.should_save:
            model = self.model
            recipe = {k: model.get_buffer(k).detach().clone() for k in sorted(fp8_recipe_keys(model))}
            torch.save({"precision": self.precision.state_dict(), "fp8_buffers": recipe},
                       os.path.join(output_dir, PRECISION_STATE_NAME))

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, PRECISION_STATE_NAME)
        if not os.path.isfile(path):
            if self.precision.scales_loss:
                warnings.warn(f"{checkpoint} has no {PRECISION_STATE_NAME} (not saved by AmpkitTrainer): the loss "
                              "scale starts again from its initial value.", stacklevel=2)
            return
        saved = torch.load(path, map_location="cpu", weights_only=True)
        self.precision.load_state_dict(saved["precision"])
        self._unfold_kahan(checkpoint)
        with torch.no_grad():  # the fp8 modules' amax histories (the model's checkpoint holds the weights only)
            for key, value in saved.get("fp8_buffers", {}).items():
                self.model.get_buffer(key).copy_(value)

    def _unfold_kahan(self, checkpoint: str) -> None:
        """bf16-pure: the checkpoint's weights are weight + Kahan buffer in fp32 (``_save``); HF loaded them rounded,
        which may differ from the bf16 weight by one ulp. With the buffer back (``optimizer.pt``), each weight is
        the saved sum minus its buffer, rounded: the bf16 weight bit for bit (the sum was exact to ~2^-16 of an
        ulp)."""
        optimizer = getattr(_ampkit_optimizer(self.optimizer), "optimizer", None)
        if not has_kahan(optimizer):
            return
        from safetensors import safe_open  # (transformers' own dependency)

        files = [os.path.join(checkpoint, f) for f in sorted(os.listdir(checkpoint)) if f.endswith(".safetensors")]
        adapter = f".{getattr(self.model, 'active_adapter', None) or 'default'}."
        comps = {n: optimizer.state[p]["compensation"] for n, p in self.model.named_parameters()
                 if "compensation" in optimizer.state.get(p, {})}
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for path in files:
                with safe_open(path, framework="pt") as f:
                    keys = set(f.keys())
                    for name, comp in comps.items():  # PEFT writes its keys without the adapter's name
                        key = next((k for k in (name, name.replace(adapter, ".")) if k in keys), None)
                        if key is None:
                            continue
                        folded = f.get_tensor(key)
                        if folded.dtype == torch.float32:
                            p = params[name]
                            p.copy_(folded.to(p.device).sub_(comp.float()))

    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[dict] = None) -> None:
        precision = self.precision
        stepped = _ampkit_optimizer(self.optimizer)
        full = precision.is_setup and (_keeps_fp32_weights(precision) or has_kahan(getattr(stepped, "optimizer", None)))
        if full and state_dict is None:  # a PEFT model writes its adapters only: its frozen base is not cast,
            adapters = _has_adapters(self.model)  # and each cast (Kahan sum) is made on the CPU, where it is written
            state_dict = precision.fp32_state_dict(self.model, cast_frozen=not adapters, device="cpu")
        super()._save(output_dir, state_dict=state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        config = os.path.join(output_dir, "config.json")
        if full and self.args.should_save and os.path.isfile(config):
            _say_float32(config)


def _say_float32(path: str) -> None:
    """Rewrite a saved ``config.json`` so that its dtype says float32 (the weights beside it are fp32)."""
    with open(path) as f:
        config = json.load(f)
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "float32"
    if "dtype" not in config and "torch_dtype" not in config:
        config["dtype"] = "float32"
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


class AmpkitTrainer(AmpkitTrainerMixin, Trainer):
    """``transformers.Trainer`` with ``precision=``: every ampkit mode (see :mod:`ampkit.integrations.hf`)."""

