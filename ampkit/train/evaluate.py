"""Evaluation: loss and accuracy each epoch; scikit-learn's classification_report and a
confusion matrix at the end (for classification), perplexity and token accuracy for LMs."""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, Iterable, Optional

import numpy as np
import torch

from ..utils.batch import batch_size_of, call_model, output_logits, own_loss

__all__ = ["default_loss", "evaluate", "classification_text"]


def default_loss(output: Any, target: Optional[torch.Tensor]) -> torch.Tensor:
    """The loss the model returned itself (``output.loss``, Hugging Face style); else cross-entropy for
    integer targets (any number of leading dims, classes last), MSE for floating ones."""
    own = own_loss(output)
    if own is not None:
        return own
    if target is None:
        raise ValueError("the model returned no `loss` and the batch has no target: return a loss from the model "
                         "(e.g. pass labels=), give (inputs, target) samples, or pass loss_fn=.")
    output = output_logits(output)
    if target.is_floating_point():
        return torch.nn.functional.mse_loss(output.float().reshape(target.shape), target.float())
    return torch.nn.functional.cross_entropy(output.float().reshape(-1, output.shape[-1]), target.reshape(-1))


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
                out = call_model(model, x)
                loss = loss_fn(out, y)
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


def classification_text(preds: np.ndarray, targets: np.ndarray, class_names: Optional[list] = None) -> Dict[str, Any]:
    """scikit-learn's classification_report (text and dict) and confusion matrix."""
    from sklearn.metrics import classification_report, confusion_matrix

    labels = sorted(set(np.unique(targets)) | set(np.unique(preds)))
    names = [class_names[i] if class_names and i < len(class_names) else str(i) for i in labels]
    text = classification_report(targets, preds, labels=labels, target_names=names, digits=4, zero_division=0)
    as_dict = classification_report(targets, preds, labels=labels, target_names=names, output_dict=True, zero_division=0)
    cm = confusion_matrix(targets, preds, labels=labels)
    width = max(4, max(len(n) for n in names) + 1, len(str(cm.max())) + 1)
    header = " " * width + "".join(f"{n:>{width}}" for n in names)
    rows = [f"{n:>{width}}" + "".join(f"{v:>{width}}" for v in row) for n, row in zip(names, cm)]
    cm_text = "confusion matrix (rows: true, columns: predicted)\n" + "\n".join([header] + rows)
    return {"text": text, "dict": as_dict, "confusion_matrix": cm.tolist(), "confusion_text": cm_text}


def no_autocast():
    return contextlib.nullcontext()
