"""``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict`` in every ampkit mode, one
process: 2 steps, the state taken with get_state_dict, set into a fresh run (whose weights were moved), 2 more
steps: bitwise the uninterrupted 4 steps, model and optimizer state (bf16-pure's Kahan buffers and its
stochastic-rounding position included). DDP on 2 ranks: tests/train/test_sharded_checkpoints.py."""
import pytest

from dcp_state_helpers import CASES, IDS, continued, equal


@pytest.mark.parametrize("mode, kw", CASES, ids=IDS)
def test_get_and_set_state_dict_continue_bitwise(mode, kw):
    (ref_model, ref_optim), (model, optim) = continued(mode, kw)
    assert equal(model, ref_model)
    assert equal(optim, ref_optim)
