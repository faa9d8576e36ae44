"""ampkit's warnings point at the user's line (the first frame outside the package), however deep they are raised."""
import warnings

import pytest
import torch
from torch import nn

import ampkit


@pytest.mark.cpu_caps("avx2")  # 16-bit matmuls measured slower than fp32: every 16-bit mode warns
@pytest.mark.parametrize("mode", ["bf16-pure", "bf16-mixed", "bf16-master", "fp16-pure", "fp16-mixed"])
def test_slow_mode_warning_points_at_the_users_line(mode):
    with pytest.warns(UserWarning, match="likely slower than fp32") as caught:
        ampkit.Precision(mode, "cpu")
    assert [w.filename for w in caught if "slower" in str(w.message)] == [__file__]


def test_setup_warning_points_at_the_users_line():
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = ampkit.Precision("fp16-pure", "cpu")
    with pytest.warns(UserWarning, match="eps raised") as caught:
        prec.setup(model, opt)
    assert [w.filename for w in caught if "eps raised" in str(w.message)] == [__file__]


@pytest.mark.cpu_caps("avx2")
def test_the_trainers_slow_mode_warning_points_at_the_users_line(tmp_path):
    x = torch.randn(8, 4)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    with pytest.warns(UserWarning, match="likely slower than fp32") as caught:
        ampkit.Trainer(nn.Linear(4, 2), data, precision="bf16-pure", progress=False, out=str(tmp_path / "run"))
    assert [w.filename for w in caught if "slower" in str(w.message)] == [__file__]
