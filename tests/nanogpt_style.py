"""A tiny GPT written the way nanoGPT's model.py is (its own LayerNorm with an optional bias,
``F.scaled_dot_product_attention(is_causal=True)``, a weight-tied head), and nanoGPT's train.py
precision lines: ``ctx`` built once, entered on every micro-step."""
import torch
from torch import nn
from torch.nn import functional as F

VOCAB, BLOCK, EMBD, HEADS = 32, 16, 32, 2


class LayerNorm(nn.Module):
    """nanoGPT's: LayerNorm with an optional bias (torch's had no bias=False then)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD, bias=bias)
        self.c_proj = nn.Linear(EMBD, EMBD, bias=bias)

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(EMBD, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(EMBD, bias), CausalSelfAttention(bias)
        self.ln_2 = LayerNorm(EMBD, bias)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD, bias=bias), nn.GELU(), nn.Linear(4 * EMBD, EMBD, bias=bias))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer=2, bias=False):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, EMBD), wpe=nn.Embedding(BLOCK, EMBD),
            h=nn.ModuleList([Block(bias) for _ in range(n_layer)]), ln_f=LayerNorm(EMBD, bias)))
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx, targets=None):
        t = idx.size(1)
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t, device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def get_batch(seed, batch_size=4):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (batch_size, BLOCK + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()
