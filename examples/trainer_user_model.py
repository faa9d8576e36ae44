"""Your own PyTorch model and data, trained through ampkit.Trainer in whatever precision fits the device.

The model and the data set below are plain PyTorch (nothing from ampkit). The Trainer owns the
loop: autocast, loss scaling where the mode needs it, the inf/NaN guard, clipping, evaluation
and (with ``--out``) checkpoints. ``--precision auto`` picks bf16 autocast on a CPU with bf16
units or a bf16-capable GPU, fp16 + dynamic loss scaling on older GPUs, fp32 otherwise; any
name works (``fp32``, ``bf16-mixed``, ``16-mixed``, ``O2``, ``mixed_float16``...).

    python examples/trainer_user_model.py --precision auto --epochs 10
"""
import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ampkit


class Regressor(nn.Module):
    """A user's model: two outputs regressed from ten features."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 2))

    def forward(self, x):
        return self.net(x)


def make_data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    w = torch.linspace(-1, 1, 20).view(10, 2)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, 2, generator=g)
    return TensorDataset(x, y)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default=None, help="run directory for checkpoints and metrics (optional)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = Regressor()
    trainer = ampkit.Trainer(
        model, make_data(1024, 0), make_data(256, 1),
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        loss_fn=nn.MSELoss(),
        precision=args.precision, device=args.device,
        epochs=args.epochs, batch_size=64, max_norm=1.0, lr_schedule="constant",
        out=args.out, progress=False,
    )
    summary = trainer.fit()
    first = next(r["loss"] for r in trainer.history if r.get("kind") == "train")
    print(f"trained {summary['optimizer_steps']} steps in {summary['precision']}: train loss {first:.4f} -> "
          f"{summary['final_train_loss']:.4f}, eval MSE {summary['eval_loss']:.4f}")


if __name__ == "__main__":
    main()
