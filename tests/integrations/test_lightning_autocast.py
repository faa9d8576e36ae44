"""Fabric's ``fabric.autocast()`` is the plugin's ``forward_context()``: torch's own ``autocast``, kept and re-entered
(as code that holds ``ctx = fabric.autocast()`` does), it autocasts on every entry; a model the tuning layer switched
the CPU attention policy on for is rerouted on every entry."""
import pytest
import torch
from torch.nn import functional as F

from ampkit.tuning import attention

L = pytest.importorskip("lightning")
pytestmark = pytest.mark.filterwarnings("ignore:precision=.*:UserWarning")


def test_fabric_autocast_kept_and_reentered(monkeypatch):
    from ampkit.integrations.lightning import AmpkitFabricPrecision

    monkeypatch.setenv("AMPKIT_OP_POLICY", "split")  # forced: the same on every CPU, nothing timed
    calls = []
    real = attention.sdpa_split_backward
    monkeypatch.setattr(attention, "sdpa_split_backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    plugin = AmpkitFabricPrecision("bf16-mixed", "cpu")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=plugin)
    ctx = fabric.autocast()
    lin = torch.nn.Linear(8, 8)

    class Attn(torch.nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    model = attention.switch_on(Attn(), plugin.ampkit)
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    for _ in range(3):
        with ctx:
            assert lin(torch.randn(2, 8)).dtype == torch.bfloat16
            model(q)
    assert len(calls) == 3 and not torch.is_autocast_enabled("cpu")
