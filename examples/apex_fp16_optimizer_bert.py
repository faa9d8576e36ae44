"""BERT-style fine-tuning the apex way (FP16_Optimizer + FusedAdam), running on ampkit.

This is the shape of the 2019 BERT fine-tuning scripts (pytorch-pretrained-BERT's
run_classifier.py) with a tiny transformer and generated data. Only the apex imports changed:

    from apex.optimizers import FP16_Optimizer, FusedAdam         # before
    from ampkit.compat.apex.optimizers import FP16_Optimizer, FusedAdam   # after

What the recipe does: ``--fp16`` casts the model to 16 bits (``model.half()``); FP16_Optimizer
keeps fp32 master weights and scales the loss (``--loss_scale 0``: dynamic, else that static
scale); parameters split into two groups, weight decay 0.01 except biases and LayerNorm
weights; FusedAdam without bias correction, gradients clipped to norm 1.0; a linear warm-up
then decay set by hand each step; ``optimizer.backward(loss)`` replaces ``loss.backward()``.

On CPU ``--fp16`` casts to bfloat16 by default (torch's CPU fp16 kernels are slow; bf16 runs
on AMX/AVX512-BF16): ``--half_dtype float16`` gives apex's exact fp16 recipe, slowly.

    python examples/apex_fp16_optimizer_bert.py --fp16
    python examples/apex_fp16_optimizer_bert.py --fp16 --loss_scale 128 --half_dtype float16
"""
import argparse
import math

import torch
from torch import nn
from tqdm import tqdm

from ampkit.compat.apex.normalization import FusedLayerNorm as BertLayerNorm
from ampkit.compat.apex.optimizers import FP16_Optimizer, FusedAdam


class BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.attention_LayerNorm = BertLayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.output = nn.Linear(intermediate, hidden)
        self.LayerNorm = BertLayerNorm(hidden, eps=1e-12)

    def forward(self, h, pad_mask):
        attended, _ = self.attention(h, h, h, key_padding_mask=pad_mask, need_weights=False)
        h = self.attention_LayerNorm(h + attended)
        return self.LayerNorm(h + self.output(nn.functional.gelu(self.intermediate(h))))


class TinyBertForSequenceClassification(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 2, max_len: int = 32,
                 labels: int = 2) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_len, hidden)
        self.LayerNorm = BertLayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(hidden, heads, 4 * hidden) for _ in range(layers))
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, labels)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(positions))
        pad_mask = input_ids == 0
        for layer in self.layers:
            h = layer(h, pad_mask)
        return self.classifier(torch.tanh(self.pooler(h[:, 0])))


def generated_task(n: int, seq_len: int, vocab: int, seed: int):
    """[CLS]=1 then random tokens; label 1 when the 'keyword' token 5 appears in the sentence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, vocab, (n, seq_len), generator=g)
    ids[:, 0] = 1
    labels = torch.randint(0, 2, (n,), generator=g)
    where = torch.randint(1, seq_len, (n,), generator=g)
    ids[labels == 1, where[labels == 1]] = 5
    return ids, labels


def warmup_linear(x: float, warmup: float = 0.002) -> float:
    return x / warmup if x < warmup else 1.0 - x


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp16", action="store_true", help="16-bit model with fp32 master weights (FP16_Optimizer)")
    parser.add_argument("--loss_scale", type=float, default=0,
                        help="0 (default): dynamic loss scaling; a positive power of 2: that static scale")
    parser.add_argument("--half_dtype", choices=["float16", "bfloat16"], default=None,
                        help="what --fp16 casts to (default: float16 on CUDA, bfloat16 on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--warmup_proportion", type=float, default=0.1)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--train_batch_size", type=int, default=32)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--num_examples", type=int, default=512)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    half = getattr(torch, args.half_dtype) if args.half_dtype else (torch.float16 if device.type == "cuda" else torch.bfloat16)
    torch.manual_seed(args.seed)

    train_ids, train_labels = generated_task(args.num_examples, 16, 64, args.seed)
    eval_ids, eval_labels = generated_task(256, 16, 64, args.seed + 1)
    batch = args.train_batch_size // args.gradient_accumulation_steps
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(train_ids, train_labels),
                                         batch_size=batch, shuffle=True)
    t_total = len(loader) // args.gradient_accumulation_steps * args.num_train_epochs

    model = TinyBertForSequenceClassification().to(device)
    if args.fp16:
        model.to(half)  # the recipe's model.half()

    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]
    named = list(model.named_parameters())
    grouped = [
        {"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    if args.fp16:
        optimizer = FusedAdam(grouped, lr=args.learning_rate, bias_correction=False, max_grad_norm=args.max_grad_norm)
        if args.loss_scale == 0:
            optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)
        else:
            optimizer = FP16_Optimizer(optimizer, static_loss_scale=args.loss_scale)
    else:  # the fp32 branch used BertAdam: the same update, in fp32
        optimizer = FusedAdam(grouped, lr=args.learning_rate, bias_correction=False, max_grad_norm=args.max_grad_norm)

    global_step, first_loss = 0, None
    model.train()
    for epoch in range(args.num_train_epochs):
        running = 0.0
        for step, (input_ids, labels) in enumerate(tqdm(loader, desc=f"Epoch {epoch + 1}", mininterval=1.0)):
            logits = model(input_ids.to(device))
            loss = nn.functional.cross_entropy(logits.float(), labels.to(device))
            if args.gradient_accumulation_steps > 1:
                loss = loss / args.gradient_accumulation_steps
            if args.fp16:
                optimizer.backward(loss)
            else:
                loss.backward()
            running += loss.item()
            first_loss = loss.item() if first_loss is None else first_loss
            if (step + 1) % args.gradient_accumulation_steps == 0:
                lr_this_step = args.learning_rate * warmup_linear(global_step / t_total, args.warmup_proportion)
                for group in optimizer.param_groups:
                    group["lr"] = lr_this_step
                optimizer.step()
                optimizer.zero_grad()
                global_step += 1
        extra = f", loss scale {optimizer.loss_scale:g}" if args.fp16 else ""
        print(f"epoch {epoch + 1}: mean loss {running / len(loader):.4f}{extra}")

    model.eval()
    with torch.no_grad():
        accuracy = (model(eval_ids.to(device)).argmax(1).cpu() == eval_labels).float().mean().item()
    kind = f"{half} model + fp32 master weights" if args.fp16 else "fp32"
    print(f"{kind} on {device}: first loss {first_loss:.4f}, eval accuracy {accuracy:.3f}, steps {global_step}")
    if not math.isfinite(first_loss):
        raise SystemExit("non-finite loss")


if __name__ == "__main__":
    main()
