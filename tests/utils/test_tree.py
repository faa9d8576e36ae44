"""ampkit.utils.tree: one structure-keeping walk over batches and outputs (torch's pytree + dataclasses/Mappings)."""
import collections
import dataclasses
import types
from collections.abc import Mapping

import pytest
import torch

from ampkit.utils import batch_size_of, call_model, cast_floating, iter_tensors, output_logits, own_loss, to_device

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    n: int = 3
    tag: str = "t"


@dataclasses.dataclass
class WithDerived:
    x: torch.Tensor
    derived: torch.Tensor = dataclasses.field(init=False, default=None)


class ReadOnly(Mapping):
    """A Mapping whose constructor does not take items: rebuilt as a plain dict."""

    def __init__(self, **kw):
        self._d = dict(kw)

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


def test_cast_keeps_every_container_type_and_leaves_integers():
    f, i = torch.ones(2), torch.arange(3)
    tree = {"od": collections.OrderedDict(a=f), "dd": collections.defaultdict(list, b=f), "nt": Pair(f, [i, (f,)]),
            "dc": Frozen(f), "mp": types.MappingProxyType({"q": f}), "ro": ReadOnly(z=f), "s": "text", "n": None}
    out = cast_floating(tree, torch.bfloat16)
    assert type(out["od"]) is collections.OrderedDict and out["od"]["a"].dtype == torch.bfloat16
    assert type(out["dd"]) is collections.defaultdict and out["dd"].default_factory is list
    assert type(out["nt"]) is Pair and out["nt"].b[0] is i and out["nt"].b[1][0].dtype == torch.bfloat16
    assert type(out["dc"]) is Frozen and out["dc"].x.dtype == torch.bfloat16 and out["dc"].n == 3
    assert type(out["mp"]) is types.MappingProxyType and out["mp"]["q"].dtype == torch.bfloat16
    assert type(out["ro"]) is dict and out["ro"]["z"].dtype == torch.bfloat16
    assert out["s"] == "text" and out["n"] is None
    assert [t.dtype for t in iter_tensors(tree)] == [torch.float32] * 3 + [torch.int64] + [torch.float32] * 4


def test_unchanged_dataclass_is_returned_as_is_and_init_false_fields_kept():
    d = WithDerived(torch.arange(2))
    assert cast_floating(d, torch.float16) is d  # nothing floating: no rebuild
    e = WithDerived(torch.ones(2))
    assert cast_floating(e, torch.float16).x.dtype == torch.float16


def test_model_output_round_trips():
    mo = pytest.importorskip("transformers.modeling_outputs")
    out = mo.Seq2SeqLMOutput(loss=torch.ones(()), logits=torch.ones(2, 3))
    cast = cast_floating(out, torch.float16)
    assert type(cast) is mo.Seq2SeqLMOutput and cast.loss.dtype == torch.float16 and list(cast.keys()) == ["loss", "logits"]
    assert own_loss(cast) is cast.loss and output_logits(cast) is cast.logits
    assert own_loss(torch.ones(2)) is None and own_loss({"loss": 1.0}) is None


def test_batch_helpers():
    calls = []

    def model(*args, **kwargs):
        calls.append((len(args), sorted(kwargs)))
        return torch.ones(1)

    call_model(model, {"input_ids": torch.ones(1)})
    call_model(model, (torch.ones(1), torch.ones(1)))
    call_model(model, torch.ones(1))
    call_model(model, Pair(torch.ones(1), 2))  # a namedtuple is one argument
    assert calls == [(0, ["input_ids"]), (2, []), (1, []), (1, [])]
    assert batch_size_of(None, {"ids": torch.zeros(5, 3)}) == 5
    moved = to_device({"a": [torch.ones(1)]}, "cpu")
    assert type(moved["a"]) is list
