"""The eager compensated step's temporaries are a fixed number of bytes, whatever the model: counted (a
``LiveBytes`` dispatch mode, every op's new storages while they live) over one step of a bucket much bigger than
a CPU batch, beyond the params, grads and state it starts with. docs/BF16_PURE.md promises bf16-pure's peak at
plain bf16 + 2 B/param + :data:`~ampkit.optim.base.STEP_TEMPORARIES`; ``test_peak_memory.py`` measures it."""
import pytest
import torch

from ampkit.memory.tracker import LiveBytes
from ampkit.optim import SGD, AdamW
from ampkit.optim.base import CPU_BATCH, STEP_TEMPORARIES


def _temporaries(make, dtype, scaled=False):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(12 * CPU_BATCH // 4, 4).to(dtype)),  # an embedding: cut into slices
              *(torch.nn.Parameter(torch.randn(300, 7).to(dtype)) for _ in range(3))]
    opt = make(params)
    for i in range(2):  # the second step's (state made, views cached)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.found_inf = torch.zeros(())  # the skip flag every precision.step hands over
        if scaled:
            opt.grad_scale = torch.tensor(1024.0)
        if i == 0:
            opt.step()
            continue
        live = LiveBytes(torch.device("cpu"))
        held = params + [p.grad for p in params] + [opt.found_inf] + [n.position for n in opt._noise.values()]
        held += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        live.track_all(held + ([opt.grad_scale] if scaled else []))
        before = live.current
        with live:
            opt.step()
        return live.peak - before


@pytest.mark.parametrize("name,make,dtype,scaled", [
    ("adamw kahan", lambda ps: AdamW(ps, compiled=False), torch.bfloat16, False),
    ("adamw stochastic", lambda ps: AdamW(ps, compensation="stochastic", compiled=False), torch.bfloat16, False),
    ("adamw none", lambda ps: AdamW(ps, compensation=None, compiled=False), torch.bfloat16, False),
    ("adamw fp32 moments", lambda ps: AdamW(ps, state_dtype=torch.float32, compiled=False), torch.bfloat16, False),
    ("adamw fp16 scaled", lambda ps: AdamW(ps, compiled=False), torch.float16, True),
    ("adamw fp32", lambda ps: AdamW(ps, compensation=None, compiled=False), torch.float32, False),
    ("sgd kahan", lambda ps: SGD(ps, lr=0.1, momentum=0.9, compiled=False), torch.bfloat16, False),
    ("sgd stochastic", lambda ps: SGD(ps, lr=0.1, momentum=0.9, compensation="stochastic", compiled=False),
     torch.bfloat16, False),
])
def test_eager_step_temporaries_are_a_fixed_bound(name, make, dtype, scaled):
    got = _temporaries(make, dtype, scaled)
    assert 0 < got <= STEP_TEMPORARIES, f"{name}: {got / 2**20:.2f} MiB of temporaries (bound {STEP_TEMPORARIES / 2**20} MiB)"
