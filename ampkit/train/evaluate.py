"""Evaluation: loss and accuracy each epoch; scikit-learn's classification_report and a
confusion matrix at the end (for classification), perplexity and token accuracy for LMs."""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, Iterable, NoReturn, Optional

import numpy as np
import torch

from .._optional import MissingDependency, require
from ..utils.loss import default_loss  # the one default loss (re-exported: the Trainer's default)
from ..utils.batch import batch_size_of, call_model, output_logits, own_loss
from . import distributed as _dist

__all__ = ["default_loss", "evaluate", "evaluate_shards", "classification_text", "label_error", "input_error",
           "raise_named"]


def raise_named(err: IndexError, named: Optional[ValueError]) -> NoReturn:
    """Raise ``named`` (:func:`input_error`'s or :func:`label_error`'s one-line ValueError) in place of torch's
    ``err``, or ``err`` itself where they found nothing to name."""
    if named is None:
        raise err
    raise named from None


def label_error(err: IndexError, out: Any, y: Any, where: str) -> Optional[ValueError]:
    """torch's 'Target 12 is out of bounds' (a class label the model's output cannot take, found by the
    loss: a Dataset whose labels could not all be counted upfront) as one ValueError naming the fix;
    None when ``err`` is another IndexError. Only on this error path is the label read on the host."""
    logits = output_logits(out)
    if not isinstance(y, torch.Tensor) or y.is_floating_point() or logits is None or "out of bounds" not in str(err):
        return None
    n = logits.shape[-1]
    bad = y[(y >= n) | ((y < 0) & (y != -100))]
    value = int(bad.flatten()[0]) if bad.numel() else "?"
    return ValueError(f"the {where} holds label {value}, but the model has {n} outputs: labels must be class ids "
                      f"0..{n - 1}. A Dataset without `targets` (or `tensors`) has its classes counted from its first "
                      "samples only: give it a `targets` attribute (all labels), or use a model with as many outputs "
                      "as classes.")


def input_error(err: IndexError, model: torch.nn.Module, x: Any, where: str) -> Optional[ValueError]:
    """torch's IndexError from inside the model's forward (an id beyond an embedding's rows, ``index out of
    range in self``; a label beyond the classes in a loss the model computes itself, ``out of bounds``) as one
    ValueError naming the input, its value and the model's size; None for another IndexError. Only on this
    error path are the inputs read on the host."""
    text = str(err)
    if "index out of range" not in text and "out of bounds" not in text:
        return None
    named = x.items() if isinstance(x, dict) else (enumerate(x) if isinstance(x, (list, tuple)) else [("x", x)])
    ints = {str(k): v for k, v in named if isinstance(v, torch.Tensor) and v.numel() and not v.is_floating_point()
            and v.dtype != torch.bool}
    rows = [m.num_embeddings for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))]
    limit = max(rows) if rows else None
    for name, t in ints.items():
        lo, hi = int(t.min()), int(t.max())
        bad = hi if limit is not None and hi >= limit else (lo if lo < 0 and lo != -100 else None)
        if bad is not None and "label" not in name:
            return ValueError(f"the {where} holds {name} {bad}, but the model's largest embedding has {limit} rows "
                              f"(ids 0..{limit - 1}): use a model whose vocabulary covers the data's ids (e.g. "
                              f"vocab_size >= {hi + 1}), or fix the data.")
    seen = ", ".join(f"{k} {int(v.min())}..{int(v.max())}" for k, v in ints.items())
    if seen and rows:
        seen += f"; largest embedding: {limit} rows"
    first = (text.strip().splitlines() or ["IndexError"])[0]
    return ValueError(f"the model's forward on the {where} failed: IndexError: {first}"
                      + (f" (integer inputs: {seen})" if seen else "")
                      + ". An id or label beyond what the model takes: check them against its vocabulary size and "
                      "number of classes.")


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Iterable,
    loss_fn: Callable,
    autocast: Callable[[], Any],
    task: str,
    collect: bool = False,
) -> Dict[str, Any]:
    """Mean loss (weighted by samples), accuracy, and (if collect) predictions and targets."""
    was_training = model.training
    model.eval()
    total_loss = torch.zeros((), dtype=torch.float64)
    correct = torch.zeros((), dtype=torch.int64)
    count = 0
    scored_any = False
    preds, targets = [], []
    try:
        for x, y in batches:
            with autocast():
                try:
                    out = call_model(model, x)
                except IndexError as e:
                    raise_named(e, input_error(e, model, x, "evaluation data"))
                try:
                    loss = loss_fn(out, y)
                except IndexError as e:
                    raise_named(e, label_error(e, out, y, "evaluation data"))
            logits = output_logits(out)
            # accuracy where the predictions line up with the targets (a causal LM that shifts its labels
            # inside, e.g. Hugging Face's, has logits for the next token: no accuracy is claimed for it)
            scored = task in ("classification", "lm") and y is not None and logits is not None and (
                own_loss(out) is None or (task == "classification" and logits.shape[:-1] == y.shape))
            n = y.numel() if (task == "lm" and y is not None) else batch_size_of(y, x)
            total_loss += loss.detach().double().cpu() * n
            count += n
            if scored:
                p = logits.argmax(-1)
                correct += (p == y).sum().cpu()
                scored_any = True
                if collect and task == "classification":
                    preds.append(p.cpu())
                    targets.append(y.cpu())
    finally:
        model.train(was_training)
    if count == 0:
        return {"loss": float("nan"), "accuracy": None, "samples": 0}
    loss = (total_loss / count).item()
    result: Dict[str, Any] = {"loss": loss, "samples": count}
    result["accuracy"] = (correct.item() / count) if scored_any else None
    if task == "lm":
        result["perplexity"] = math.exp(min(loss, 50.0))
    if collect and preds:
        result["preds"] = torch.cat(preds).numpy()
        result["targets"] = torch.cat(targets).numpy()
    return result


def evaluate_shards(model: torch.nn.Module, batches, loss_fn: Callable, autocast: Callable[[], Any], task: str,
                    batch_size: int, collect: bool, reshard: bool) -> Dict[str, Any]:
    """`evaluate` over a `Batches`' evaluation set: each rank evaluates its shard, the sums (loss, correct,
    count) are all-reduced. ``reshard``: an FSDP root, unsharded after a forward, back to its shards."""
    data = batches.eval_data
    rank, world = _dist.rank_and_world()
    if world == 1:
        parts = batches.eval_batches(data, batch_size)
    else:
        parts = (batches.fetch(data, idx) for idx in _dist.shard_indices(len(data), rank, world, batch_size))
    result = evaluate(model, parts, loss_fn, autocast, task, collect)
    if reshard:  # FSDP's root stays unsharded (compute dtype) after a forward: back to the fp32 shards
        model.reshard()
    return _dist.reduce_eval(result, len(data), task, collect, batches.device)


def classification_text(preds: np.ndarray, targets: np.ndarray, class_names: Optional[list] = None) -> Dict[str, Any]:
    """scikit-learn's classification_report (text and dict) and the confusion matrix. Without scikit-learn
    (``ampkit[data]``) the report's text says so, its dict is None, and the confusion matrix stays."""
    labels = sorted(set(np.unique(targets)) | set(np.unique(preds)))
    names = [class_names[i] if class_names and i < len(class_names) else str(i) for i in labels]
    try:
        metrics = require("sklearn.metrics", "the classification report")
    except MissingDependency as e:
        text, as_dict = f"classification report: {e}\n", None
    else:
        text = metrics.classification_report(targets, preds, labels=labels, target_names=names, digits=4,
                                             zero_division=0)
        as_dict = metrics.classification_report(targets, preds, labels=labels, target_names=names, output_dict=True,
                                                zero_division=0)
    index = {label: i for i, label in enumerate(labels)}
    cm = np.zeros((len(labels), len(labels)), dtype=np.int64)
    np.add.at(cm, ([index[t] for t in targets], [index[p] for p in preds]), 1)
    width = max(4, max(len(n) for n in names) + 1, len(str(cm.max())) + 1)
    header = " " * width + "".join(f"{n:>{width}}" for n in names)
    rows = [f"{n:>{width}}" + "".join(f"{v:>{width}}" for v in row) for n, row in zip(names, cm)]
    cm_text = "confusion matrix (rows: true, columns: predicted)\n" + "\n".join([header] + rows)
    return {"text": text, "dict": as_dict, "confusion_matrix": cm.tolist(), "confusion_text": cm_text}


def no_autocast():
    return contextlib.nullcontext()
