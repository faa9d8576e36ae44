"""An apex.amp training script (amp.initialize + amp.scale_loss), running on ampkit.

Only the import changed: ``from apex import amp`` -> ``from ampkit.compat.apex import amp``.
``--opt_level`` takes apex's levels: O0 fp32; O1 autocast (fp32 weights) + dynamic loss scale;
O2 16-bit compute with the fp32 weights as master weights (norms fp32) + dynamic loss scale; O3 pure 16-bit.

apex needed CUDA; this runs on CPU too. On CPU the 16-bit dtype defaults to bfloat16
(``dtype=torch.bfloat16``, an ampkit extension; bf16 needs no loss scaling so the scale is a
static 1.0); ``--dtype float16`` gives apex's fp16 exactly, slowly.

    python examples/apex_amp_initialize.py --opt_level O2
"""
import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

from ampkit.compat.apex import amp


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt_level", default="O1", help="O0, O1, O2 or O3")
    parser.add_argument("--loss_scale", default=None, help="'dynamic' or a number (default: the opt level's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default=None,
                        help="16-bit dtype (default: float16 on CUDA, bfloat16 on CPU)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float16 if device.type == "cuda" else torch.bfloat16)

    torch.manual_seed(0)
    digits = load_digits()
    x = (torch.tensor(digits.data, dtype=torch.float32) / 16.0).to(device)
    y = torch.tensor(digits.target).to(device)

    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, loss_scale=args.loss_scale,
                                      dtype=dtype)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    for epoch in range(args.epochs):
        perm = torch.randperm(1400, device=device)
        total = 0.0
        for i in range(0, 1400, args.batch_size):
            idx = perm[i:i + args.batch_size]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 5.0)
            optimizer.step()
            total += loss.item() * len(idx)
        scheduler.step()
        scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
        print(f"epoch {epoch + 1}: loss {total / 1400:.4f}, loss scale {scale:g}")

    model.eval()
    with torch.no_grad():
        accuracy = (model(x[1400:]).argmax(1) == y[1400:]).float().mean().item()
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    print(f"opt_level {args.opt_level}: params {'/'.join(dtypes)}, test accuracy {accuracy:.3f}")
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}
    amp.load_state_dict(checkpoint["amp"])  # how a resumed run restores the loss scale


if __name__ == "__main__":
    main()
