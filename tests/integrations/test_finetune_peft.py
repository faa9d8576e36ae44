"""PEFT/LoRA under ampkit as its users write it: a bf16 (or fp32) frozen base with fp32 adapters, in a
plain loop and in AmpkitTrainer, inside and outside ``precision.autocast()`` (train, eval, ``generate``, a callback's
forward), saves that cost only what they write, bf16-pure adapters saved with their Kahan buffers folded in.
Tiny Llama from a config (tests/hf_models.py), synthetic tokens, CPU."""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampkit
from ampkit.precision.modes import MODES

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]


# ---------------------------------------------------------------- one gating rule, on a model mixing dtypes
class RMSNorm(nn.Module):
    """Llama's: statistics in fp32, the weight times the input's dtype."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class Lora(nn.Module):
    """PEFT's LoRA Linear: the frozen base, plus fp32 adapters fed the input in their dtype, added back in the
    base's output dtype."""

    def __init__(self, base, r=4):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)

    def forward(self, x):
        y = self.base(x)
        return y + self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))).to(y.dtype)


def mixed_model():
    """bf16 frozen base (embedding, norms, linears), fp32 trainable adapters: PEFT's default layout."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 32), RMSNorm(32), Lora(nn.Linear(32, 32)), nn.GELU(), RMSNorm(32),
                          Lora(nn.Linear(32, 32)))
    for name, p in model.named_parameters():
        if "lora_" not in name:
            p.requires_grad_(False)
            p.data = p.data.to(torch.bfloat16)
    return model


def _cast_hooks(model):
    return [h for m in model.modules() for hooks in (m._forward_pre_hooks, m._forward_hooks)
            for h in hooks.values() if type(h).__name__ in ("ComputeCopies", "CastInputs", "CastOutput")]


@pytest.mark.parametrize("mode", [m for m in MODES if not MODES[m].fp8] + ["fp8-tensorwise"])
def test_every_cast_hook_has_one_gate_and_the_model_runs_outside_autocast(mode):
    """Every cast hook setup adds carries the same gate (the device in the master modes, none where the weights
    were cast); outside autocast a master-mode model computes as the plain model it holds, bit for bit (an
    ungated norm input cast beside a gated output cast hands fp32 to a bf16 Linear there: a crash)."""
    plain = mixed_model()
    model = mixed_model()
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    prec = ampkit.Precision(mode, "cpu", **({"fp8_filter": "all"} if MODES[mode].fp8 else {}))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = prec.setup(model, opt)
    gates = {getattr(h, "gate", None) for h in _cast_hooks(model)}
    assert gates == ({"cpu"} if prec.kind == "master" else {None}) or not gates
    for _ in range(2):
        with prec.autocast():
            loss = model(ids).float().pow(2).mean()
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
    assert torch.isfinite(loss)
    with torch.no_grad():
        out = model(ids)  # an eval loop, a callback's forward: no autocast
    assert torch.isfinite(out.float()).all()
    if prec.kind == "master":  # the model holds the plain model: it computes as that one
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert torch.equal(out, plain(ids))


# ---------------------------------------------------------------- PEFT
peft = pytest.importorskip("peft", reason="pip install -e '.[finetune]' (peft, trl, sentence-transformers, "
                                          "diffusers) runs these")
T = pytest.importorskip("transformers")
from hf_models import BATCHES, DictDataset, build  # noqa: E402


def lora_llama(base_dtype=torch.bfloat16, seed=0):
    model = build("llama", seed).to(base_dtype)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


#: every mode on a bf16 base by default (fp8: tensorwise; the other recipes and the fp32 base with --slow)
PLAIN = [pytest.param(m, d, id=f"{m}-{str(d)[6:]}",
                      marks=() if d == torch.bfloat16 and (not MODES[m].fp8 or m == "fp8-tensorwise")
                      else pytest.mark.slow)
         for d in (torch.bfloat16, torch.float32) for m in MODES]


@pytest.mark.parametrize("mode,base", PLAIN)
def test_lora_trains_evaluates_and_generates_in_every_mode(mode, base):
    """Train inside precision.autocast(); eval and generate outside it; only the adapters move."""
    model = lora_llama(base)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    prec = ampkit.Precision(mode, "cpu", **({"fp8_filter": "all"} if MODES[mode].fp8 else {}))
    model, opt = prec.setup(model, opt)
    batch = BATCHES["llama"](0)
    with prec.autocast():
        loss = model(**batch).loss
    prec.backward(loss)
    prec.step(opt)
    with torch.no_grad():
        assert torch.isfinite(model(**batch).loss)
        model.generate(input_ids=batch["input_ids"][:, :4], attention_mask=batch["attention_mask"][:, :4],
                       max_new_tokens=3, do_sample=False)
    if prec.kind != "pure":  # pure modes round the frozen base (test_bf16_pure_says_it_rounds_the_frozen_base)
        now = dict(model.named_parameters())
        assert all(torch.equal(now[n], v) for n, v in frozen.items())


def targs(out, **kw):
    kw = {"use_cpu": True, "report_to": [], "max_steps": 4, "per_device_train_batch_size": 4, "learning_rate": 1e-2,
          "logging_steps": 1, "save_strategy": "no", "seed": 0, "disable_tqdm": True, "max_grad_norm": 1.0, **kw}
    return T.TrainingArguments(str(out), **kw)


class ForwardAtStepEnd(T.TrainerCallback):
    """A callback's sample: a forward outside autocast (and outside the Trainer's context) at each step end."""

    def __init__(self):
        self.losses = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            self.losses.append(float(model(**BATCHES["llama"](5)).loss))


@pytest.mark.parametrize("mode", ["bf16-master", "fp16-master", "bf16-mixed", "bf16-pure"])
def test_trainer_with_a_bf16_base_evaluates_generates_and_calls_back(mode, tmp_path):
    from ampkit.integrations.hf import AmpkitTrainer

    seen = ForwardAtStepEnd()
    trainer = AmpkitTrainer(model=lora_llama(), args=targs(tmp_path, eval_strategy="steps", eval_steps=2),
                            train_dataset=DictDataset("llama", 16), eval_dataset=DictDataset("llama", 8, seed=1),
                            callbacks=[seen], precision=mode)
    trainer.train()
    assert len(seen.losses) == 4 and all(map(torch.isfinite, torch.tensor(seen.losses)))
    assert torch.isfinite(torch.tensor(trainer.evaluate()["eval_loss"]))
    trainer.model.generate(input_ids=BATCHES["llama"](0)["input_ids"][:, :4], max_new_tokens=2, do_sample=False)


# ---------------------------------------------------------------- saving costs what it saves
class NewFp32Bytes(TorchDispatchMode):
    """Bytes of the fp32 tensors ops make (outputs sharing no storage with an input: no views)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.untyped_storage().data_ptr() not in ins:
                self.bytes += t.untyped_storage().nbytes()
        return out


def _adapter_bytes(model):
    return sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("mode", ["bf16-master", "bf16-mixed", "bf16-pure"])
def test_saving_a_lora_model_allocates_at_most_the_adapters_fp32_bytes(mode, tmp_path):
    """save_model (what each checkpoint calls too) and the docs' loop recipe cast no frozen base tensor (casting
    the whole bf16 base to fp32 to save the adapters costs 11x their bytes here)."""
    from ampkit.integrations.hf import AmpkitTrainer

    trainer = AmpkitTrainer(model=lora_llama(), args=targs(tmp_path, max_steps=2),
                            train_dataset=DictDataset("llama", 8), precision=mode)
    trainer.train()
    model, adapters = trainer.model, _adapter_bytes(trainer.model)
    base = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    assert base > 5 * adapters  # a bound the old behaviour breaks
    with NewFp32Bytes() as counted:
        trainer.save_model(str(tmp_path / "final"))
    assert counted.bytes <= adapters
    with NewFp32Bytes() as counted:  # the plain loop's recipe (docs/INTEGRATIONS.md, PEFT/LoRA)
        model.save_pretrained(str(tmp_path / "loop"), state_dict=trainer.precision.fp32_state_dict(model, cast_frozen=False))
    assert counted.bytes <= adapters


def _saved_adapters(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def _truth(trainer):
    truth = trainer.precision.fp32_state_dict(trainer.model, cast_frozen=False)
    return {k.replace(".default.", "."): v for k, v in truth.items() if "lora_" in k}


def test_bf16_pure_adapters_are_saved_with_the_kahan_buffers_and_resume_bitwise(tmp_path):
    """save_model, each checkpoint and the loop's save_pretrained write weight + Kahan buffer in fp32 (within 1e-6
    of precision.fp32_state_dict); a run resumed from such a checkpoint ends bit for bit as the whole run."""
    from ampkit.integrations.hf import AmpkitTrainer

    args = targs(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    whole = AmpkitTrainer(model=lora_llama(), args=args, train_dataset=DictDataset("llama", 16), precision="bf16-pure")
    whole.train()
    whole.save_model(str(tmp_path / "final"))
    whole.model.save_pretrained(str(tmp_path / "loop"),
                                state_dict=whole.precision.fp32_state_dict(whole.model, cast_frozen=False))
    truth = _truth(whole)
    bf16 = {k.replace(".default.", "."): v for k, v in whole.model.state_dict().items() if "lora_" in k}
    assert any(not torch.equal(truth[k], bf16[k].float()) for k in truth)  # the buffers hold something
    for where in ("final", "loop", "checkpoint-4"):
        saved = _saved_adapters(str(tmp_path / where))
        assert saved.keys() == truth.keys()
        assert all(saved[k].dtype == torch.float32 and (saved[k] - truth[k]).abs().max() <= 1e-6 for k in truth)
    resumed = AmpkitTrainer(model=lora_llama(), args=args, train_dataset=DictDataset("llama", 16),
                            precision="bf16-pure")
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(v, _truth(resumed)[k]) for k, v in truth.items())


@pytest.mark.slow  # a second Python importing torch, transformers and peft: ~30 s
def test_exported_adapters_load_where_ampkit_is_not_installed(tmp_path):
    """The adapters save_model wrote load with plain PEFT in a process that cannot import ampkit."""
    from ampkit.integrations.hf import AmpkitTrainer

    trainer = AmpkitTrainer(model=lora_llama(), args=targs(tmp_path, max_steps=2),
                            train_dataset=DictDataset("llama", 8), precision="bf16-master")
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    torch.save(_truth(trainer), tmp_path / "truth.pt")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = textwrap.dedent(f"""
        import sys
        sys.modules["ampkit"] = None  # import ampkit fails here
        sys.path.insert(0, {tests!r})
        import torch, peft
        from hf_models import build
        model = peft.PeftModel.from_pretrained(build("llama").to(torch.bfloat16), {str(tmp_path / "final")!r})
        truth = torch.load({str(tmp_path / "truth.pt")!r})
        got = {{k.replace(".default.", "."): v for k, v in model.state_dict().items() if "lora_" in k}}
        assert got.keys() == truth.keys() and all(torch.equal(got[k], truth[k]) for k in truth)
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.stdout.strip().endswith("ok"), run.stderr[-2000:]


# ---------------------------------------------------------------- bf16-pure and a frozen fp32 base
def test_bf16_pure_says_it_rounds_the_frozen_base_and_keep_leaves_it():
    """bf16-pure rounds a frozen fp32 base in place and says so once at setup (what, and that merges go into the
    rounded base); frozen='keep' leaves it fp32, trains the same, and merge_and_unload merges into the fp32 base."""
    runs = {}
    for frozen in ("cast", "keep"):
        model = lora_llama(torch.float32)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        prec = ampkit.Precision("bf16-pure", "cpu", frozen=frozen)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, opt = prec.setup(model, opt)
        said = [str(w.message) for w in caught if "frozen parameters" in str(w.message)]
        assert len(said) == (1 if frozen == "cast" else 0)
        if said:
            assert "from float32 to bfloat16 in place" in said[0] and "merge_and_unload" in said[0]
            assert "frozen='keep'" in said[0]
        base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
        assert base.dtype == (torch.bfloat16 if frozen == "cast" else torch.float32)
        batch = BATCHES["llama"](0)
        for _ in range(2):
            with prec.autocast():
                loss = model(**batch).loss
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            runs[frozen] = (loss.detach(), model(**batch).loss)  # outside autocast too
        merged = model.merge_and_unload()
        assert merged.model.layers[0].self_attn.q_proj.weight.dtype == base.dtype
    assert torch.equal(runs["cast"][0], runs["keep"][0]) and torch.equal(runs["cast"][1], runs["keep"][1])
    with pytest.raises(ValueError, match="frozen='fp32' is not supported: use 'cast'"):
        ampkit.Precision("bf16-pure", "cpu", frozen="fp32")


@pytest.mark.parametrize("mode", ["bf16-master", "fp16-master", "bf16-pure", "fp8-tensorwise"])
def test_lora_with_checkpointed_blocks_equals_without(mode):
    """torch.utils.checkpoint around each block (HF's gradient_checkpointing_enable, non-reentrant, as PEFT users
    turn it on) on a bf16 base: the recompute runs under the autocast state and compute copies of the forward, so
    the adapters end bit for bit as without it (fp8: fp8_filter='all', the base's Linears in fp8)."""
    ends = []
    for checkpointing in (False, True):
        model = lora_llama()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        prec = ampkit.Precision(mode, "cpu", **({"fp8_filter": "all"} if MODES[mode].fp8 else {}))
        model, opt = prec.setup(model, opt)
        model.train()
        for step in range(2):
            with prec.autocast():
                loss = model(**BATCHES["llama"](step)).loss
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad(set_to_none=True)
        ends.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    assert ends[0] and all(torch.equal(ends[0][n], ends[1][n]) for n in ends[0])
