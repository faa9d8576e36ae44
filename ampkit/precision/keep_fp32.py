"""What a 16-bit-parameter mode keeps in fp32, and why: the plan ``convert_model`` follows and
``Precision.describe()`` / the Trainer's summary.json report.

* norms (``ampkit.precision.norms``): params fp32; inputs cast up and outputs back to the compute dtype (in
  the pure modes, a norm that computes its statistics in fp32 itself runs on 16-bit copies of its weights
  instead: ``convert_model``);
* Hugging Face's ``_keep_in_fp32_modules`` (honoured in fp16, as transformers does: it guards fp16
  overflow, e.g. T5's ``wo``) and ``_keep_in_fp32_modules_strict`` (fp16 and bf16): a module whose
  name matches runs whole in fp32 (an fp32 island whose outputs go back to the compute dtype); a
  parameter or buffer whose name matches (``e_score_correction_bias``, ``query_tokens``) is stored
  fp32. Patterns match whole dotted name components (``wo`` matches ``...DenseReluDense.wo``, not
  ``word_embeddings``), ``*`` any run of characters, as transformers' globs;
* ``fp32_modules`` given to ``Precision``: fp32 islands (``ampkit.precision.islands``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Tuple

import torch
from torch import nn

from .norms import norm_reason

__all__ = ["Fp32Plan", "fp32_plan", "kept_text", "hf_keep_patterns"]

_HF_ATTRS = (("_keep_in_fp32_modules", (torch.float16,)),
             ("_keep_in_fp32_modules_strict", (torch.float16, torch.bfloat16)))


@dataclass
class Fp32Plan:
    norms: Dict[str, str] = field(default_factory=dict)  # module name -> why it is a norm
    islands: Dict[str, str] = field(default_factory=dict)  # module name -> the attribute that listed it
    tensors: Dict[str, str] = field(default_factory=dict)  # param/buffer name -> the attribute that listed it
    skip: Tuple[str, ...] = ()  # the user's fp32_modules

    def kept(self) -> Dict[str, str]:
        """Every name kept fp32 -> why (``fp32_modules``, ``norm (...)``, the Hugging Face attribute)."""
        out = dict.fromkeys(self.skip, "fp32_modules")
        out.update({n: f"norm ({why})" for n, why in self.norms.items()})
        out.update(self.islands)
        out.update(self.tensors)
        return out


def _under(name: str, roots: Iterable[str]) -> bool:
    return any(r and (name == r or name.startswith(r + ".")) for r in roots)


def _regex(pattern: str) -> "re.Pattern[str]":
    body = re.escape(pattern).replace(r"\*", ".*")
    return re.compile(rf"(?:^|\.){body}(?:\.|$)")


def hf_keep_patterns(model: nn.Module, dtype: torch.dtype) -> List[Tuple[str, "re.Pattern[str]", str]]:
    """``(module prefix, name regex, attribute)`` for every ``_keep_in_fp32_modules[_strict]`` entry of
    ``model`` and its submodules that applies to ``dtype``."""
    out = []
    for prefix, module in model.named_modules():
        for attr, dtypes in _HF_ATTRS:
            names = getattr(module, attr, None)
            if dtype not in dtypes or not isinstance(names, (list, tuple, set, frozenset)):
                continue
            out += [(prefix, _regex(p), attr) for p in sorted(n for n in names if isinstance(n, str) and n)]
    return out


def _match(patterns, name: str):
    for prefix, regex, attr in patterns:
        if prefix and not name.startswith(prefix + "."):
            continue
        if regex.search(name[len(prefix) + 1:] if prefix else name):
            return attr
    return None


def fp32_plan(model: nn.Module, dtype: torch.dtype, keep_norm_fp32: bool = True, skip: Iterable[str] = ()) -> Fp32Plan:
    """What casting ``model`` to ``dtype`` keeps in fp32 (nothing when ``dtype`` is fp32)."""
    plan = Fp32Plan(skip=tuple(s for s in skip if s))
    if dtype == torch.float32:
        return plan
    patterns = hf_keep_patterns(model, dtype)
    for name, module in model.named_modules():
        if _under(name, plan.skip) or _under(name, plan.islands):
            continue
        attr = _match(patterns, name) if patterns and name else None
        if attr is not None:
            plan.islands[name] = attr
            continue
        why = norm_reason(module) if keep_norm_fp32 else None
        if why is not None:
            plan.norms[name] = why
    if patterns:
        named = list(model.named_parameters()) + list(model.named_buffers())
        for name, t in named:
            if t.is_floating_point() and not _under(name, plan.skip + tuple(plan.islands)):
                attr = _match(patterns, name)
                if attr is not None:
                    plan.tensors[name] = attr
    return plan


def kept_text(kept: Dict[str, str], limit: int = 6) -> str:
    """``describe()``'s clause: how many, of which kind, and the first names."""
    if not kept:
        return "no module kept fp32"
    kinds: Dict[str, int] = {}
    for why in kept.values():
        kind = "norms" if why.startswith("norm") else why
        kinds[kind] = kinds.get(kind, 0) + 1
    names = list(kept)
    shown = ", ".join(names[:limit]) + (f", ... (+{len(names) - limit} more)" if len(names) > limit else "")
    by_kind = ", ".join(f"{k}: {n}" for k, n in kinds.items())
    return f"{len(kept)} {'module' if len(kept) == 1 else 'modules'} kept fp32 ({by_kind}): {shown}"
