"""Norm-like classes as model zoos write them, shared by the precision tests."""
import torch
from torch import nn


class LlamaStyleRMSNorm(nn.Module):
    """As Hugging Face's LlamaRMSNorm / MistralRMSNorm / Qwen2RMSNorm."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Normalizer(nn.Linear):
    """Named like a norm, holds a weight matrix: a projection, not a norm."""


class NaiveLayerNorm(nn.Module):
    """A LayerNorm written out in its input's dtype: its mean and variance are 16-bit values in a 16-bit model."""

    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x):
        centered = x - x.mean(-1, keepdim=True)
        return centered / torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias
