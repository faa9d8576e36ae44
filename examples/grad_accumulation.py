"""Gradient accumulation with a loss scaler: 2 micro-batches of 16 emulate a batch of 32.

Scale + backward on every micro-batch (gradients add up, all multiplied by the same scale);
step + update only every N micro-batches, so the scale changes between optimizer steps, never
inside one. The loss is divided by N so the accumulated gradient is the mean over the big batch.
A tqdm bar shows progress; scikit-learn's classification_report gives per-class metrics.

    python examples/grad_accumulation.py --accum-steps 2 --micro-batch 16
"""
import argparse

import torch
from sklearn.datasets import load_digits
from sklearn.metrics import classification_report
from torch import nn
from tqdm import tqdm

import ampkit


class SimpleCNN(nn.Module):
    def __init__(self, in_channels: int = 1, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3), nn.ReLU(), nn.Conv2d(64, 128, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(128, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default=None,
                        help="autocast dtype (default: float16 on CUDA, bfloat16 on CPU)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--accum-steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float16 if device.type == "cuda" else torch.bfloat16)

    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    train = torch.utils.data.TensorDataset(x[:1400], y[:1400])
    loader = torch.utils.data.DataLoader(train, batch_size=args.micro_batch, shuffle=True, drop_last=True)

    model = SimpleCNN().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = ampkit.LossScaler(device.type, enabled=dtype == torch.float16)
    n = args.accum_steps

    for epoch in range(args.epochs):
        bar = tqdm(loader, total=len(loader), desc=f"epoch {epoch + 1}", mininterval=1.0)
        for i, (xb, yb) in enumerate(bar):
            xb, yb = xb.to(device), yb.to(device)
            with torch.autocast(device_type=device.type, dtype=dtype):
                loss = nn.functional.cross_entropy(model(xb), yb) / n
            scaler.scale(loss).backward()              # every micro-batch
            if (i + 1) % n == 0:                       # every n micro-batches
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                bar.set_postfix(loss=f"{loss.item() * n:.3f}", scale=f"{scaler.get_scale():g}")
        print(f"epoch {epoch + 1}: last loss {loss.item() * n:.4f}, optimizer steps {scaler.optimizer_steps}")

    model.eval()
    with torch.no_grad(), torch.autocast(device_type=device.type, dtype=dtype):
        pred = model(x[1400:].to(device)).argmax(1).cpu()
    print(classification_report(y[1400:].numpy(), pred.numpy(), digits=3, zero_division=0))


if __name__ == "__main__":
    main()
