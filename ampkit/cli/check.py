"""`ampkit check`: is mixed precision safe for this model, and which layer goes wrong when it is not.

Runs :func:`ampkit.check` on one batch of the data and prints the readable report, or the
report as JSON with ``--json`` (see docs/CHECK.md for every field and threshold).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, List, Tuple

from . import UsageError

__all__ = ["add_parser", "run"]


def add_parser(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to check")
    g.add_argument("--model", default=None,
                   help="cnn | simple_cnn | resnet | gpt | mlp | pkg.module:factory (default: the data's own model)")
    g.add_argument("--data", default="digits",
                   help="digits | images | sequences | file.npz | pkg.module:factory (default: digits)")
    g.add_argument("--batch-size", type=int, default=8, help="samples in the checked batch (default: 8)")
    g.add_argument("--seed", type=int, default=0, help="data split and model init seed (default: 0)")
    g = p.add_argument_group("how")
    g.add_argument("--precision", default="fp16-mixed,bf16-mixed",
                   help="comma list of precisions to compare with fp32 (names or aliases; 'auto' = the "
                        "device's choice; block-scaled formats mxfp8, mxfp4, nvfp4, fp8-blockwise or their "
                        "Transformer Engine names add the per-layer what-if; default: fp16-mixed,bf16-mixed)")
    g.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    g.add_argument("--fp32-modules", default="",
                   help="comma list of module names kept in fp32 in every checked precision")
    g.add_argument("--fp8-skip", default="",
                   help="with fp8 precisions: comma list of Linear names kept in bf16 (see docs/FP8.md)")
    g.add_argument("--fp8-filter", default=None, choices=("ends", "auto", "all"),
                   help="with fp8 precisions: which Linears convert: 'auto' (default: dims multiples of 16, not "
                        "first/last, and the per-layer roofline predicts a gain), 'ends' (the same without the "
                        "roofline), 'all'")
    g.add_argument("--fp8-gpu", default=None,
                   help="GPU class the fp8 roofline judges for (h100, h200, b200, l40s, a100, mi300x; default: "
                        "this GPU's, on a CPU h100, b200 for mxfp8)")
    g.add_argument("--fp8-tokens", type=int, default=None,
                   help="tokens per GEMM of the training run (batch x sequence) for the roofline (default: 8192)")
    g.add_argument("--loss-scale", type=float, default=2.0**16,
                   help="loss scale at which fp16 gradient underflow is measured (default: 65536)")
    g.add_argument("--lr", type=float, default=1e-4,
                   help="learning rate of the simulated step for stale 16-bit updates (default: 1e-4)")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    g.add_argument("--top", type=int, default=10, help="modules shown in the text report (default: 10)")


def _split(value: str) -> List[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _batch(dataset: Any, n: int) -> Any:
    from torch.utils.data import DataLoader, default_collate

    collate = default_collate
    if isinstance(dataset, DataLoader):
        dataset, collate = dataset.dataset, dataset.collate_fn
    size = min(n, len(dataset))
    if size == 0:
        raise UsageError("the dataset is empty: it needs at least one sample.")
    return collate([dataset[i] for i in range(size)])


def _load(args) -> Tuple[Any, Any, str, str]:
    """(model, batch, model spec, data name) from --model/--data, with one-line errors."""
    import torch

    from ..data import load_data
    from ..diagnose.runner import default_forward
    from ..models import build_model

    try:
        data = load_data(args.data, seed=args.seed)
    except ValueError as e:
        raise UsageError(_first_line(e)) from None
    spec = args.model or data.default_model
    if not spec:
        raise UsageError(f"--data {args.data} yields dict samples (keyword inputs, Hugging Face style): pass the "
                         "model for them with --model pkg.module:factory.")
    torch.manual_seed(args.seed)
    try:
        model = build_model(spec, **(data.model_kwargs or {}))
    except ValueError as e:
        raise UsageError(_first_line(e)) from None
    batch = _batch(data.train, args.batch_size)
    try:
        with torch.no_grad():
            out = default_forward(model, batch)
    except Exception as e:  # a user model/data mismatch shows up as any error in forward
        raise UsageError(f"model {spec!r} cannot run on a batch of {args.data!r} "
                         f"({type(e).__name__}: {_first_line(e)}): pick a --model that fits the --data.") from None
    if isinstance(out, torch.Tensor) and out.dim() >= 2 and data.task in ("classification", "lm"):
        from ..data import check_labels

        try:  # class ids the model has no output for: one line naming the file row, not torch's IndexError
            check_labels(data.train, out.shape[-1])
        except ValueError as e:
            raise UsageError(_first_line(e)) from None
    return model, batch, spec, getattr(data, "name", args.data) or args.data


def run(args) -> int:
    from ..diagnose.blockscale import block_only
    from ..diagnose.check import check
    from ..utils.batch import batch_size_of
    from ..precision import resolve, resolve_device

    precisions = _split(args.precision)
    if not precisions:
        raise UsageError("--precision is empty: give e.g. --precision fp16-mixed,bf16-mixed.")
    for p in precisions:
        if block_only(p):  # a block-scaled format: judged in the what-if, not run as a mode
            continue
        try:
            resolve(p)
        except ValueError as e:
            raise UsageError(_first_line(e)) from None
    from ..precision.fp8 import GPUS

    if args.fp8_gpu is not None and args.fp8_gpu not in GPUS:
        raise UsageError(f"--fp8-gpu {args.fp8_gpu} is not a GPU class the roofline knows: use one of "
                         f"{', '.join(GPUS)}.")
    if args.fp8_tokens is not None and args.fp8_tokens < 1:
        raise UsageError(f"--fp8-tokens must be a positive number of tokens per GEMM (e.g. 8192), got {args.fp8_tokens}.")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}.")
    if not (args.loss_scale > 0 and args.loss_scale != float("inf")):
        raise UsageError(f"--loss-scale must be a positive number (e.g. 65536), got {args.loss_scale:g}.")
    if not args.lr > 0:
        raise UsageError(f"--lr must be positive, got {args.lr:g}.")
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise UsageError(_first_line(e)) from None

    model, batch, spec, data_name = _load(args)
    try:
        report = check(model, batch, precisions=precisions, device=device, loss_scale=args.loss_scale,
                       fp32_modules=_split(args.fp32_modules), lr=args.lr,
                       fp8_skip=_split(args.fp8_skip), fp8_filter=args.fp8_filter, fp8_gpu=args.fp8_gpu,
                       fp8_tokens=args.fp8_tokens)
    except ValueError as e:
        raise UsageError(_first_line(e)) from None
    n_params = sum(p.numel() for p in model.parameters())
    size = batch_size_of(batch)
    report["input"] = {"model": spec, "data": data_name, "batch_size": size, "parameters": n_params}
    if args.json:
        print(report.to_json(indent=2))
    else:
        print(f"ampkit check: model {spec} ({n_params:,} parameters), a batch of {size} from {data_name}\n")
        print(report.text(top=max(1, args.top)))
    sys.stdout.flush()
    if report["reference"]["nonfinite"] is not None:
        where = report["reference"].get("first_nonfinite") or {}
        module = where.get("module") if isinstance(where, dict) else None
        print(f"ampkit check: error: the model is non-finite in fp32 already ({report['reference']['nonfinite']}"
              f"{', first in ' + str(module) if module else ''}): fix the model, its init or the data first; "
              "no precision can.", file=sys.stderr)
        return 3
    return 0
