"""A Hugging Face model (GPT-2 built from a tiny config: no download) trained by ampkit.

Three ways, each a few steps on CPU:

1. the README's five-line loop (``out = model(**batch)``, ``precision.backward(out.loss)``),
2. ``ampkit.Trainer`` on a dataset of dicts (the model returns its own loss: no loss_fn),
3. ``ampkit train --model examples.hf_model:make_model --data examples.hf_model:make_data``.

    python examples/hf_model.py --precision bf16-master --steps 8
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch

import ampkit

VOCAB, SEQ = 96, 16


def make_model(seed: int = 0):
    """A 2-layer GPT-2 (hidden 32) from a config: nothing is downloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


class Sequences(torch.utils.data.Dataset):
    """Token sequences that count up modulo VOCAB from a random start (learnable), one dict per sample,
    as a tokenised Hugging Face dataset yields them."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def make_data(seed: int = 0):
    """(train, eval) datasets of dicts: what ``ampkit train --data examples.hf_model:make_data`` loads."""
    return Sequences(256, seed), Sequences(64, seed + 1)


def five_line_loop(precision_name: str, steps: int) -> list:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-4)
    precision = ampkit.Precision(precision_name, "cpu")
    model, optimizer = precision.setup(model, optimizer)
    loader = torch.utils.data.DataLoader(make_data()[0], batch_size=16, shuffle=True)
    losses = []
    for step, batch in zip(range(steps), loader):
        with precision.autocast():
            out = model(**batch)
        precision.backward(out.loss)
        precision.step(optimizer, max_norm=1.0)
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    print(f"five-line loop, {precision.name}: {type(out).__name__}, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
          f"in {len(losses)} steps")
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="bf16-master")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)

    five_line_loop(args.precision, args.steps)

    train, test = make_data()
    trainer = ampkit.Trainer(make_model(), train, test, precision=args.precision, batch_size=16,
                             max_steps=args.steps, lr=3e-3, autotune=False, progress=False)
    summary = trainer.fit()
    print(f"Trainer, {summary['precision']}: {summary['optimizer_steps']} steps, eval loss {summary['eval_loss']:.3f}, "
          f"perplexity {summary['perplexity']:.1f}")

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "ampkit", "train", "--model", "examples.hf_model:make_model",
               "--data", "examples.hf_model:make_data", "--precision", args.precision, "--max-steps", str(args.steps),
               "--batch-size", "16", "--no-autotune", "--no-progress", "--out", os.path.join(out, "run")]
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"ampkit train failed ({done.returncode}):\n{done.stderr}")
        print("ampkit train:", done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
