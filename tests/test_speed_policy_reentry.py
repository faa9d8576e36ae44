"""The op policy's first measurement runs while its own swap of F.scaled_dot_product_attention is
active (inside a real training step); it must call torch's kernel, not re-enter the policy."""
import threading

import torch
from torch.nn import functional as F

from ampkit.precision import speed


def test_first_measurement_inside_the_policy_does_not_deadlock(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPKIT_OP_POLICY", "auto")
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(speed, "_MEMO", {})
    real = speed.measure_sdpa
    monkeypatch.setattr(speed, "measure_sdpa", lambda *a, **k: real(*a, reps=1))
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    done = []

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16), speed.OpSpeedPolicy():
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.float().sum().backward()
        done.append(True)

    t = threading.Thread(target=step, daemon=True)
    t.start()
    t.join(timeout=120)
    assert done, "the op policy deadlocked measuring attention inside its own swap"
    assert (tmp_path / "opspeed.json").exists()
