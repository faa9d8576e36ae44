"""bf16-pure under DDP on 2 gloo ranks: the replicas stay bitwise equal, with Kahan (its moments rounded
stochastically) and with stochastic rounding, where each rank seeds torch apart before building its model and
optimizer (nanoGPT's ``torch.manual_seed(1337 + rank)``; DDP broadcasts rank 0's parameters, not its RNG): every rank
draws rank 0's rounding bits. An explicit ``seed=`` is the user's and is kept."""
import os
import warnings

import torch
from torch import nn

from tests.distributed_helpers import init_rank, leave_rank, run_ranks

STEPS = 6
CASES = ("kahan", "stochastic", "optim-stochastic")  # the last: ampkit.optim.AdamW itself, no Precision


def _net():
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))


def _setup(case, model):
    import ampkit

    if case == "optim-stochastic":
        model = model.to(torch.bfloat16)
        return None, model, ampkit.optim.AdamW(model.parameters(), lr=1e-2, compensation="stochastic")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precision = ampkit.Precision("bf16-pure", "cpu", compensation=case)
        model, optimizer = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return precision, model, optimizer


def _worker(rank, tmp):
    init_rank(rank, tmp)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    x, y = x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]
    out = {}
    for case in CASES:
        torch.manual_seed(1337 + rank)  # each rank its own seed, as nanoGPT's DDP loop does
        precision, model, optimizer = _setup(case, _net())
        seed = optimizer._noise_seed
        ddp = nn.parallel.DistributedDataParallel(model)  # rank 0's parameters on every rank
        for _ in range(STEPS):
            with precision.autocast() if precision else torch.autocast("cpu", enabled=False):
                loss = nn.functional.cross_entropy(ddp(x.to(next(model.parameters()).dtype)).float(), y)
            if precision:
                precision.backward(loss)
                precision.step(optimizer, max_norm=1.0)
            else:
                loss.backward()
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out[case] = {"params": [p.detach().clone() for p in model.parameters()], "seed_at_build": seed,
                     "seed": optimizer._noise_seed, "positions": [n.position.item() for n in optimizer._noise.values()]}
    explicit = __import__("ampkit").optim.AdamW(_net().to(torch.bfloat16).parameters(), seed=100 + rank)
    out["explicit"] = explicit._noise_seed
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    leave_rank()  # DDP was used: exit without gloo's destructor


def test_ddp_replicas_stay_equal_when_ranks_seed_torch_apart(tmp_path):
    run_ranks(_worker, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for case in CASES:
        a, b = r0[case], r1[case]
        assert a["params"][0].dtype == torch.bfloat16
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])), f"{case}: the DDP replicas differ"
        assert a["seed_at_build"] != b["seed_at_build"], case  # the ranks did build their optimizers apart
        assert a["seed"] == b["seed"] == a["seed_at_build"], case  # rank 0's, on both
        assert a["positions"] == b["positions"] == [STEPS], case
    assert (r0["explicit"], r1["explicit"]) == (100, 101)
