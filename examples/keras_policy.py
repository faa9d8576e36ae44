"""Keras-style mixed precision in PyTorch: set a global policy once, the rest of the code follows it.

    from tensorflow.keras import mixed_precision            # Keras
    from ampkit.compat import keras as mixed_precision      # ampkit

``mixed_float16`` / ``mixed_bfloat16``: variables (weights) stay fp32, computation runs in 16
bits; ``mixed_float16`` also scales the loss dynamically (Keras' LossScaleOptimizer). Every
``ampkit.Precision()`` built without a name uses the global policy, and the training loop
below has no precision branches: the policy object owns autocast, scaling and the step.

    python examples/keras_policy.py                        # mixed_bfloat16 on CPU, mixed_float16 on CUDA
    python examples/keras_policy.py --policy float32
"""
import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

import ampkit
from ampkit.compat import keras as mixed_precision


def main(argv=None):
    default = "mixed_float16" if torch.cuda.is_available() else "mixed_bfloat16"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default=default, help="float32, mixed_float16, mixed_bfloat16, ...")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)

    mixed_precision.set_global_policy(args.policy)
    policy = mixed_precision.global_policy()
    print(f"{policy}: compute dtype {policy.compute_dtype}, variable dtype {policy.variable_dtype}")

    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)

    precision = ampkit.Precision(device=args.device)  # no name: the global policy
    print(precision.describe())
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = precision.setup(model, optimizer)
    x, y = x.to(precision.device), y.to(precision.device)

    for epoch in range(args.epochs):
        perm = torch.randperm(1400, device=precision.device)
        total = 0.0
        for i in range(0, 1400, 64):
            idx = perm[i:i + 64]
            with precision.autocast():
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            precision.backward(loss)
            precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            total += loss.item() * len(idx)
        print(f"epoch {epoch + 1}: loss {total / 1400:.4f}")

    with torch.no_grad(), precision.autocast():
        logits = model(x[1400:])
    accuracy = (logits.argmax(1) == y[1400:]).float().mean().item()
    weights = {str(p.dtype).replace("torch.", "") for p in model.parameters()}
    print(f"logits computed in {str(logits.dtype).replace('torch.', '')}, weights in {'/'.join(sorted(weights))}, "
          f"test accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
