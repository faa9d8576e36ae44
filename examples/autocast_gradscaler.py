"""The classic mixed-precision loop: torch.autocast around forward + loss, a gradient scaler around backward + step.

ampkit.LossScaler is a drop-in for torch.amp.GradScaler (same arguments, same numbers), so this
is the loop from PyTorch's AMP recipe with one name changed. One code path serves every dtype
(nanoGPT's trick): fp16 needs the scaler (its narrow range makes small gradients underflow),
bf16 has fp32's range and does not, so the scaler is simply disabled there.

    python examples/autocast_gradscaler.py                    # fp16 on CUDA, bf16 on CPU
    python examples/autocast_gradscaler.py --dtype float16    # fp16 on CPU works, slowly
"""
import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

import ampkit


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default=None,
                        help="autocast dtype (default: float16 on CUDA, bfloat16 on CPU)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float16 if device.type == "cuda" else torch.bfloat16)

    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    x_train, y_train, x_test, y_test = x[:1400].to(device), y[:1400].to(device), x[1400:].to(device), y[1400:].to(device)

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)  # weights stay fp32
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = ampkit.LossScaler(device.type, enabled=dtype == torch.float16)

    for epoch in range(args.epochs):
        perm = torch.randperm(len(x_train), device=device)
        total = 0.0
        for i in range(0, len(perm), args.batch_size):
            idx = perm[i:i + args.batch_size]
            with torch.autocast(device_type=device.type, dtype=dtype):
                loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            scaler.scale(loss).backward()   # scale so small fp16 gradients survive
            scaler.step(optimizer)          # unscale; skip the step if a gradient is inf/NaN
            scaler.update()                 # grow or shrink the scale
            optimizer.zero_grad(set_to_none=True)
            total += loss.item() * len(idx)
        print(f"epoch {epoch + 1}: loss {total / len(x_train):.4f}  scale {scaler.get_scale():g}  "
              f"skipped {scaler.skipped_steps}")

    with torch.no_grad(), torch.autocast(device_type=device.type, dtype=dtype):
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(f"{dtype} autocast on {device}: test accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
