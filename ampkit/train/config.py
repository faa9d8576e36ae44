"""Training configuration: one dataclass, readable from TOML/YAML, written back next to the run."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

__all__ = ["TrainConfig", "load_config_file", "write_config", "recorded_options", "ONE_RESUME"]


@dataclass
class TrainConfig:
    # what
    model: Optional[str] = None  # None = the data set's default model
    data: str = "digits"
    # precision
    precision: str = "auto"
    loss_scale: Optional[str] = None  # apex convention: dynamic | 0 | N
    init_scale: Optional[float] = None
    max_consecutive_skips: Optional[int] = 50
    compensation: Optional[str] = None  # bf16-pure only: kahan (default) | stochastic | none
    optimizer_state: Optional[str] = None  # moments in fp32 | bf16 | 8bit (torchao); None = the mode's
    fp32_modules: List[str] = field(default_factory=list)
    fp8_filter: Optional[str] = None  # fp8 modes: auto (default: per-layer roofline) | ends | all
    fp8_gpu: Optional[str] = None  # fp8 modes: the GPU class the roofline judges for (default: this one's; on CPU h100, b200 for mxfp8)
    fp8_tokens: Optional[int] = None  # fp8 modes: tokens per GEMM (batch x sequence) the roofline assumes (default 8192)
    memory_format: str = "auto"  # conv models: auto (measured, the faster) | channels_last | contiguous
    eval_precision: str = "train"  # "train" or "fp32" (autocast off)
    # optimisation
    epochs: int = 20
    batch_size: int = 32
    grad_accum: int = 1
    max_norm: Optional[float] = None
    lr: float = 3e-3
    weight_decay: float = 0.01
    optimizer: str = "adamw"
    lr_schedule: str = "cosine"  # constant | cosine | linear
    warmup_steps: int = 0
    max_steps: Optional[int] = None  # stop after this many optimizer steps
    seed: int = 0
    # run
    out: Optional[str] = None
    resume: Optional[str] = None  # auto | PATH
    save_every: Optional[int] = None  # optimizer steps; None = each epoch
    keep_last: int = 3
    progress: bool = True
    log_every: int = 10
    compile: bool = False
    autotune: bool = True  # time what is left open on this model (cached): auto's mode, a conv model's memory format
    retune: bool = False  # measure again what the per-machine caches hold (16-bit speed, auto's timings, layout)
    strategy: str = "ddp"  # under torchrun: ddp | fsdp (fully_shard + MixedPrecisionPolicy)
    tensorboard: bool = False
    device: Optional[str] = None
    num_threads: Optional[int] = None
    # resuming: continue on other data than the checkpoint's (its size, samples or classes differ); one resume
    allow_new_data: bool = False
    # resuming: continue in another precision mode than the checkpoint's (weights carried over); one resume
    allow_precision_change: bool = False
    # with allow_precision_change: "convert" the optimizer state (moments cast to the new mode's) or "reset" it;
    # None: convert (None, not "convert", so a new run given either is told the option means nothing to it)
    precision_change_optimizer: Optional[str] = None

    @property
    def change_optimizer(self) -> str:
        """What a precision change does to the optimizer state: "convert" (the default) or "reset"."""
        return self.precision_change_optimizer or "convert"

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> List[str]:
        return [f.name for f in fields(cls)]

    def checked(self) -> "TrainConfig":
        """Each value of the type its key takes (numbers written as strings are read as numbers); a
        ValueError naming the key otherwise."""
        out = {}
        for f in fields(self):
            v, kind = getattr(self, f.name), str(f.type)
            if v is None and (kind.startswith("Optional") or f.default is None):
                out[f.name] = v
                continue
            if f.name == "loss_scale":  # 'dynamic', 0 or a number: parsed by the precision
                out[f.name] = v if isinstance(v, str) else _number(f.name, v, float)
                continue
            base = kind.replace("Optional[", "").rstrip("]")
            if base == "int":
                v = _number(f.name, v, int)
            elif base == "float":
                v = _number(f.name, v, float)
            elif base == "bool":
                if not isinstance(v, bool):
                    raise ValueError(f"option {f.name} = {v!r}: use true or false.")
            elif base == "str":
                if not isinstance(v, str):
                    raise ValueError(f"option {f.name} = {v!r}: it takes a string (in quotes).")
            elif base.startswith("List"):
                if isinstance(v, str):
                    v = [x for x in v.split(",") if x]
                if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
                    raise ValueError(f"option {f.name} = {v!r}: it takes a list of names, e.g. [\"head\"].")
                v = list(v)
            out[f.name] = v
        _check_ranges(out)
        return dataclasses.replace(self, **out)

    def updated(self, **overrides) -> "TrainConfig":
        unknown = set(overrides) - set(self.field_names())
        if unknown:
            raise ValueError(f"unknown config key(s): {', '.join(sorted(unknown))}; valid: {', '.join(self.field_names())}")
        return dataclasses.replace(self, **overrides)


# options that apply to one resume only: a config.toml or checkpoint records them at their defaults (what they
# changed is recorded as such), so the next resume is checked afresh
ONE_RESUME = ("allow_new_data", "allow_precision_change", "precision_change_optimizer")


def recorded_options(config: TrainConfig) -> TrainConfig:
    """``config`` as a run records it: the one-resume options at their defaults."""
    defaults = TrainConfig()
    return config.updated(**{k: getattr(defaults, k) for k in ONE_RESUME})


_FLOAT32_MAX = 3.4028234663852886e38
_SEED_MAX = 2**32 - 1  # numpy's and scikit-learn's seeds (the train/test split) take 0 .. 2**32-1


def _check_ranges(out: Dict[str, Any]) -> None:
    """Every range rule of the options, in one place (the CLI, a config file and the Python API share it)."""
    for key in ("epochs", "batch_size", "grad_accum", "keep_last", "log_every", "save_every", "max_steps",
                "num_threads"):
        if out[key] is not None and out[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1 (option {key}), got {out[key]}.")
    for key, ok, rule in (("max_norm", lambda v: v > 0, "> 0 (or leave it out: no clipping)"),
                          ("weight_decay", lambda v: v >= 0, ">= 0"), ("warmup_steps", lambda v: v >= 0, ">= 0")):
        if out[key] is not None and not ok(out[key]):
            raise ValueError(f"--{key.replace('_', '-')} must be {rule}, got {out[key]:g}.")
    if out["init_scale"] is not None and not isinstance(out["init_scale"], bool) and not out["init_scale"] > 0:
        raise ValueError(f"--init-scale must be a positive number of the dynamic loss scale to start from (e.g. "
                         f"65536 = 2**16, the default), got {out['init_scale']:g}.")
    if out["max_consecutive_skips"] is not None and out["max_consecutive_skips"] < 1:
        raise ValueError(f"--max-consecutive-skips must be >= 1 (the run stops after that many non-finite steps in a "
                         f"row; default 50), got {out['max_consecutive_skips']}.")
    if out.get("precision_change_optimizer") not in (None, "convert", "reset"):
        raise ValueError(f"--precision-change-optimizer must be convert or reset, got {out.get('precision_change_optimizer')!r}.")
    cpus = os.cpu_count() or 1
    if out["num_threads"] and out["num_threads"] > cpus:  # thousands of threads exhaust memory before training
        raise ValueError(f"--num-threads {out['num_threads']} is more than the {cpus} CPU(s) here: use at most {cpus}.")
    if not out["lr"] > 0:
        raise ValueError(f"--lr must be > 0, got {out['lr']}.")
    if not 0 <= out["seed"] <= _SEED_MAX:
        raise ValueError(f"--seed must be between 0 and {_SEED_MAX} (it also seeds numpy and the train/test split), "
                         f"got {out['seed']}.")
    for key in ("loss_scale", "init_scale"):
        v = out[key]
        try:
            value = float(v) if v is not None and not isinstance(v, bool) else None
        except ValueError:
            continue  # 'dynamic' (or a typo, refused by the precision with its own message)
        if value is not None and abs(value) > _FLOAT32_MAX:
            raise ValueError(f"--{key.replace('_', '-')} {v} is beyond what float32 holds (at most 3.4e38): use "
                             "'dynamic' or a static scale such as 65536 (= 2**16)." if key == "loss_scale" else
                             f"--{key.replace('_', '-')} {v} is beyond what float32 holds (at most 3.4e38): use a "
                             "scale such as 65536 (= 2**16, the default).")


def _number(key: str, v: Any, kind: type) -> Any:
    what = "a whole number" if kind is int else "a number"
    if isinstance(v, str):
        try:
            v = kind(float(v)) if kind is float else int(v)
        except ValueError:
            raise ValueError(f"option {key} = {v!r} (--{key.replace('_', '-')}, or {key} in a config file): it takes {what}.") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise ValueError(f"option {key} = {v!r} (--{key.replace('_', '-')}, or {key} in a config file): it takes {what}.")
    if not math.isfinite(v):
        raise ValueError(f"option {key} = {v!r} (--{key.replace('_', '-')}, or {key} in a config file): it takes a finite number.")
    return kind(v)


def load_config_file(path: str) -> Dict[str, Any]:
    """Read a flat TOML (.toml) or YAML (.yaml/.yml) mapping of TrainConfig keys ('-' or '_')."""
    if not os.path.exists(path):
        raise ValueError(f"config file {path!r} does not exist.")
    try:
        if path.endswith(".toml"):
            try:
                import tomllib
            except ModuleNotFoundError:  # Python < 3.11
                import tomli as tomllib
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        elif path.endswith((".yaml", ".yml")):
            try:
                import yaml
            except ModuleNotFoundError:
                raise ValueError("YAML config needs PyYAML: pip install pyyaml (or use a .toml config).") from None
            with open(path) as f:
                raw = yaml.safe_load(f) or {}
        elif path.endswith(".json"):
            with open(path) as f:
                raw = json.load(f)
        else:
            raise ValueError(f"config file {path!r}: use a .toml, .yaml/.yml or .json file.")
    except ValueError as e:  # TOML/JSON syntax errors are ValueErrors too: name the file
        if str(e).startswith(("config file", "YAML config")):
            raise
        raise ValueError(f"config file {path!r} could not be parsed: {_one_line(e)}") from e
    except Exception as e:  # a YAML error spans several lines (a caret under the spot): one line here
        raise ValueError(f"config file {path!r} could not be parsed: {_one_line(e)}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path!r} must hold a mapping of keys to values.")
    raw = {str(k).replace("-", "_"): v for k, v in raw.items()}
    unknown = set(raw) - set(TrainConfig.field_names())
    if unknown:
        raise ValueError(f"config file {path!r} has unknown key(s): {', '.join(sorted(unknown))}.")
    return raw


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def write_config(config: TrainConfig, path: str, extra: Optional[Dict[str, Any]] = None) -> None:
    """Write the config as TOML (None values are omitted: TOML has no null), loadable by --config."""
    lines = ["# ampkit train config (continue this run: ampkit train --config THIS_FILE --resume auto; a new run with "
             "these options: ampkit train --config THIS_FILE --out NEW_DIR)"]
    for k, v in config.to_dict().items():
        if v is not None and k not in ONE_RESUME:  # one resume's options are not the run's
            lines.append(f"{k} = {_toml_value(v)}")
    if extra:
        lines.append("")
        for k, v in extra.items():
            lines.append(f"# {k}: {v}")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)
