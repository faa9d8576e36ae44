"""A model factory for ``ampkit train --model faults.storm:storm_mlp`` that injects NaN/inf gradients.

Test-only. The storm is read from $AMPKIT_TEST_STORM (JSON): ``{"steps": [micro-batch indices],
"value": "nan" | "inf"}``. On those training forwards a hook replaces the gradient flowing into
the hidden activations with NaN/inf, so every parameter below the head gets a non-finite
gradient while the loss itself stays finite (the trainer must look at the gradients).

The model also polices the trainer, at every training forward: its weights must be finite, and
when the previous step was a storm step (grad_accum 1), the weights must be exactly what they
were before it. A violation is appended to VIOLATIONS (the suite's summary counts them) and
raises AssertionError, which fails the test with a traceback.
"""
import json
import os

import torch
from torch import nn

VIOLATIONS = []  # (forward index, what the trainer did wrong), across all StormMLPs of the process


class StormMLP(nn.Module):
    def __init__(self, in_features=64, num_classes=10, steps=(), value="nan"):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, num_classes)
        self.storm = set(steps)
        self.value = float(value)
        self.forwards = 0
        self._previous = None  # weights seen at the previous training forward

    def _police(self):
        weights = torch.cat([p.detach().float().flatten() for p in self.parameters()])
        problem = None
        if not torch.isfinite(weights).all():
            problem = "the weights hold NaN/inf: the trainer applied a non-finite update"
        elif (self.forwards - 1) in self.storm and not torch.equal(weights, self._previous):
            problem = "the storm step before it changed the weights"
        if problem:
            VIOLATIONS.append((self.forwards, problem))
            raise AssertionError(f"forward {self.forwards}: {problem}")
        self._previous = weights

    def forward(self, x):
        bad = False
        if self.training:
            self._police()
            bad = self.forwards in self.storm
            self.forwards += 1
        h = self.body(torch.flatten(x, 1))
        if bad:
            h.register_hook(lambda g: torch.full_like(g, self.value))
        return self.head(h)


def storm_mlp(in_features=64, num_classes=10):
    spec = json.loads(os.environ.get("AMPKIT_TEST_STORM", "{}"))
    return StormMLP(in_features, num_classes, spec.get("steps", ()), spec.get("value", "nan"))
