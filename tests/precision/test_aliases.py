"""One alias table (``ampkit.precision.modes``): every name means the same mode through every entry point
(Precision, set_global_policy, the CLI, apex's opt levels), except the two Keras names whose Keras meaning
differs (``KERAS_DIFFERENCES``), which mean that only through ``ampkit.compat.keras``."""
import warnings

import pytest

import ampkit
from ampkit.cli import _build_parser
from ampkit.cli.train import _config_from_args
from ampkit.compat import keras
from ampkit.compat.apex.opt_levels import OPT_LEVELS, resolve_properties
from ampkit.precision.modes import ALIASES, KERAS_DIFFERENCES, MODES, resolve

NAMES = sorted(set(ALIASES) | set(MODES))


@pytest.fixture(autouse=True)
def _reset_global_policy():
    yield
    keras.set_global_policy(None)


@pytest.mark.parametrize("name", NAMES)
def test_every_alias_through_every_entry_point(name):
    mode = resolve(name)
    assert mode in MODES
    for spelling in (name, name.upper()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fp16 on CPU
            assert ampkit.Precision(spelling, "cpu").name == mode
            ampkit.set_global_policy(spelling)
            assert ampkit.global_policy() == mode and ampkit.Precision(device="cpu").name == mode
            args = _build_parser().parse_args(["train", "--precision", spelling])
            assert ampkit.Precision(_config_from_args(args)[0].precision, "cpu").name == mode  # what the Trainer builds
            keras_mode = KERAS_DIFFERENCES.get(name.lower(), mode)
            assert keras.Policy(spelling).mode == keras_mode
            keras.set_global_policy(spelling)
            assert ampkit.Precision(device="cpu").name == keras_mode


def test_keras_differs_only_where_stated():
    assert set(KERAS_DIFFERENCES) == {"float16", "bfloat16"}
    assert ampkit.Precision("bfloat16", "cpu").name == "bf16-mixed" == resolve("bf16")
    assert keras.Policy("bfloat16").mode == "bf16-pure" and keras.Policy("float16").mode == "fp16-pure"
    assert keras.Policy("mixed_bfloat16").mode == "bf16-mixed"


@pytest.mark.parametrize("level", sorted(OPT_LEVELS))
def test_apex_opt_levels_agree_with_the_alias_table(level):
    assert resolve_properties(level).mode == resolve(level)
    assert resolve(level.lower()) == resolve(level)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="Unknown precision 'bfloat17'.*bf16-mixed"):
        ampkit.Precision("bfloat17", "cpu")


def test_an_unknown_name_offers_the_nearest_ones_not_every_alias():
    with pytest.raises(ValueError) as e:
        ampkit.Precision("fp8", "cpu")
    text = str(e.value)
    assert "did you mean fp8-tensorwise, fp8-rowwise, fp8-delayed?" in text
    assert "mixed_float16" not in text and len(text) < 400  # the modes and a pointer to the alias table


def test_a_suggested_alias_names_its_mode():
    """'nonsense' is spelled like the alias 'none': offered as 'none (= fp32)', never as if 'none' were a mode."""
    with pytest.raises(ValueError) as e:
        ampkit.Precision("nonsense", "cpu")
    assert "did you mean none (= fp32)?" in str(e.value)


def test_half_is_float16s_other_name():
    """torch.half is float16; like fp16/float16, a bare dtype name means autocast in it."""
    assert resolve("half") == "fp16-mixed" == resolve("HALF")


def test_a_loss_scale_with_auto_says_what_auto_chose():
    """--precision auto --loss-scale 128: the refusal names auto's choice, not a mode the user never asked for."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError) as e:
            ampkit.Precision("auto", "cpu", loss_scale=128)
    text = str(e.value)
    assert text.startswith("precision auto chose ") and "does not use loss scaling" in text, text
    assert "precision='" not in text
