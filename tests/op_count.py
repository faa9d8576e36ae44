"""Counting dispatched aten ops (each one a kernel launch on a GPU, where a small model's step is launch-bound):
``with OpCount() as c: ...; c.n``. Shared by the step-overhead and optimizer-step op-count tests."""
from torch.utils._python_dispatch import TorchDispatchMode


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))
