"""ampkit in the Hugging Face `Trainer` (ampkit.integrations.hf.AmpkitTrainer), written as HF users write it:
TrainingArguments, a dataset of dicts, a tiny GPT-2 from a config, CPU, HF's own checkpoints and resume."""
import json
import math
import os

import pytest
import torch

T = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ampkit  # noqa: E402
from ampkit.integrations.hf import PRECISION_STATE_NAME, AmpkitTrainer, AmpkitTrainerMixin  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]
VOCAB = 64


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=32, seed=0):
        self.ids = torch.randint(0, VOCAB, (n, 12), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2(seed=0):
    torch.manual_seed(seed)
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                          bos_token_id=0, eos_token_id=0))


def _fp8_ends(mode):
    """The mode, or for fp8 a Precision with the first/last rule (the default roofline filter converts none of
    these 32-wide layers)."""
    return ampkit.Precision(mode, "cpu", fp8_filter="ends") if mode.startswith("fp8") else mode


def targs(out, **kw):
    kw = {"use_cpu": True, "report_to": [], "max_steps": 6, "per_device_train_batch_size": 4, "learning_rate": 1e-3,
          "logging_steps": 1, "save_strategy": "no", "seed": 0, "disable_tqdm": True, "max_grad_norm": 1.0, **kw}
    return T.TrainingArguments(str(out), **kw)


def train_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad[:5]


def test_bf16_mixed_is_bitwise_hfs_own_bf16(tmp_path):
    """Where the modes overlap, AmpkitTrainer(precision='bf16-mixed') is HF's own TrainingArguments(bf16=True)."""
    hf = T.Trainer(model=gpt2(), args=targs(tmp_path / "hf", bf16=True), train_dataset=Tokens())
    hf.train()
    ours = AmpkitTrainer(model=gpt2(), args=targs(tmp_path / "ampkit"), train_dataset=Tokens(), precision="bf16-mixed")
    ours.train()
    assert_bitwise(weights(hf.model), weights(ours.model))
    for a, b in zip(train_logs(hf), train_logs(ours)):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])


def test_gradient_accumulation_and_evaluate_match_hfs_own_bf16(tmp_path):
    """Two micro-batches per step (HF's accumulation, the loss divided by HF) and evaluate() under the same
    autocast: bitwise HF's bf16=True again."""
    kw = {"max_steps": 3, "gradient_accumulation_steps": 2, "per_device_eval_batch_size": 8}
    hf = T.Trainer(model=gpt2(), args=targs(tmp_path / "hf", bf16=True, **kw), train_dataset=Tokens(),
                   eval_dataset=Tokens(8, seed=1))
    hf.train()
    ours = AmpkitTrainer(model=gpt2(), args=targs(tmp_path / "ampkit", **kw), train_dataset=Tokens(),
                         eval_dataset=Tokens(8, seed=1), precision="bf16-mixed")
    ours.train()
    assert_bitwise(weights(hf.model), weights(ours.model))
    assert hf.evaluate()["eval_loss"] == ours.evaluate()["eval_loss"]


def _scores_loss(model, inputs):
    """A loss the client computes outside the model (sentence-transformers' in-batch negatives, a distillation):
    a matmul of the model's outputs, which a 16-bit autocast around it would run in 16 bits."""
    h = model(input_ids=inputs["input_ids"]).logits[:, -1]
    return torch.nn.functional.cross_entropy(h @ h.T / 8, torch.arange(len(h)))


class ScoresTrainer(T.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return _scores_loss(model, inputs)


class AmpkitScoresTrainer(AmpkitTrainerMixin, ScoresTrainer):
    pass


def test_a_loss_computed_outside_the_model_runs_in_fp32_as_under_hfs_bf16(tmp_path):
    """Only the model's forward runs under autocast, as with HF's bf16=True, whose outputs reach the loss in fp32:
    a custom compute_loss is bitwise HF's own (a bf16 autocast around the whole compute_loss is not)."""
    hf = ScoresTrainer(model=gpt2(), args=targs(tmp_path / "hf", bf16=True), train_dataset=Tokens())
    hf.train()
    ours = AmpkitScoresTrainer(model=gpt2(), args=targs(tmp_path / "ampkit"), train_dataset=Tokens(),
                               precision="bf16-mixed")
    ours.train()
    assert_bitwise(weights(hf.model), weights(ours.model))
    assert [h["loss"] for h in train_logs(hf)] == [h["loss"] for h in train_logs(ours)]
    with torch.no_grad():  # the model's outputs reach the client in fp32 (accelerate's convert_outputs_to_fp32)
        assert ours.model(input_ids=Tokens()[0]["input_ids"][None]).logits.dtype == torch.float32


MODES = ["fp32", "fp16-mixed", "bf16-mixed", "fp16-master", "bf16-master", "bf16-pure", "fp16-pure", "fp8-delayed"]


@pytest.fixture(scope="module")
def fp32_reference(tmp_path_factory):
    trainer = AmpkitTrainer(model=gpt2(), args=targs(tmp_path_factory.mktemp("ref"), max_steps=3),
                            train_dataset=Tokens(), precision="fp32")
    trainer.train()
    return train_logs(trainer)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_clips_the_unscaled_gradients(mode, tmp_path, fp32_reference):
    """max_grad_norm clips (and logs the norm of) the real gradients in every mode: in the loss-scaled modes
    the scaled gradients' norm would be ~65536x; clipping those would zero every update."""
    trainer = AmpkitTrainer(model=gpt2(), args=targs(tmp_path, max_steps=3), train_dataset=Tokens(),
                            precision=_fp8_ends(mode))
    before = {k: v.float() for k, v in weights(trainer.model).items()}
    trainer.train()
    logs = train_logs(trainer)
    assert [h["skipped_steps"] for h in logs] == [0, 0, 0]
    assert ("loss_scale" in logs[0]) == trainer.precision.scales_loss
    for ours, ref in zip(logs, fp32_reference):  # the true norm, to the mode's rounding
        assert math.isclose(ours["grad_norm"], ref["grad_norm"], rel_tol=0.05), (ours, ref)
        assert math.isclose(ours["loss"], ref["loss"], rel_tol=0.02)
    after = trainer.precision.fp32_state_dict(trainer.model)
    key = "transformer.h.0.attn.c_attn.weight"
    assert not torch.equal(before[key], after[key].float())


def test_nonfinite_step_is_skipped_counted_and_not_scheduled(tmp_path):
    """An inf gradient: the step is skipped (weights unchanged), counted, and the scheduler does not step."""
    model = gpt2()
    calls = {"n": 0}

    def poison(grad):  # the 2nd backward's gradient gets an inf
        calls["n"] += 1
        return grad.masked_fill(torch.zeros_like(grad, dtype=torch.bool).index_fill_(0, torch.tensor([0]), True),
                                float("inf")) if calls["n"] == 2 else grad

    model.transformer.wpe.weight.register_hook(poison)
    seen = []

    class Watch(T.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, lr_scheduler=None, **kw):
            seen.append((model.transformer.h[0].mlp.c_fc.weight.detach().clone(), lr_scheduler.last_epoch))

    trainer = AmpkitTrainer(model=model, args=targs(tmp_path, max_steps=4, lr_scheduler_type="linear"),
                            train_dataset=Tokens(), precision="bf16-master", callbacks=[Watch()])
    trainer.train()
    assert trainer.precision.skipped_steps == 1 and trainer.precision.optimizer_steps == 3
    assert torch.equal(seen[0][0], seen[1][0]) and not torch.equal(seen[1][0], seen[2][0])
    assert [epoch for _, epoch in seen] == [1, 1, 2, 3]  # the skipped step did not advance the schedule
    assert [h["skipped_steps"] for h in train_logs(trainer)] == [0, 1, 1, 1]


RESUME = [("fp16-mixed", {"init_scale": 2.0**20, "growth_interval": 2}), ("fp16-master", {}),
          ("bf16-master", {}), ("bf16-pure", {}), ("bf16-mixed", {}), ("fp16-pure", {}), ("fp8-delayed", {"fp8_filter": "ends"})]


@pytest.mark.parametrize("mode,options", RESUME, ids=[m for m, _ in RESUME])
def test_resume_from_hf_checkpoint_is_bitwise(mode, options, tmp_path):
    """HF's own checkpoint-N/ + resume_from_checkpoint continue exactly as the uninterrupted run: weights,
    optimizer state (masters, moments, Kahan buffers) and the loss scale with its counters."""
    args = targs(tmp_path, max_steps=6, save_strategy="steps", save_steps=3, lr_scheduler_type="linear")
    whole = AmpkitTrainer(model=gpt2(), args=args, train_dataset=Tokens(),
                          precision=ampkit.Precision(mode, "cpu", **options))
    whole.train()
    ckpt = tmp_path / "checkpoint-3"
    assert (ckpt / PRECISION_STATE_NAME).is_file()
    resumed = AmpkitTrainer(model=gpt2(seed=1), args=args, train_dataset=Tokens(),
                            precision=ampkit.Precision(mode, "cpu", **options))
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert_bitwise(whole.precision.fp32_state_dict(whole.model), resumed.precision.fp32_state_dict(resumed.model))
    assert_bitwise(weights(whole.model), weights(resumed.model))
    assert whole.precision.scaler.state_dict() == resumed.precision.scaler.state_dict()
    assert [h["loss"] for h in train_logs(whole)][3:] == [h["loss"] for h in train_logs(resumed)][-3:]
    if mode == "fp16-mixed":  # the scale moved in the first half, so a fresh scale would have drifted
        saved = torch.load(ckpt / PRECISION_STATE_NAME, weights_only=True)["precision"]
        assert saved["name"] == "fp16-mixed" and saved["scaler"]["scale"] != 2.0**20
    if mode.startswith("fp8"):  # the amax histories travel along (the model's checkpoint holds weights only)
        assert torch.load(ckpt / PRECISION_STATE_NAME, weights_only=True)["fp8_buffers"]


def test_resume_refuses_another_modes_checkpoint(tmp_path):
    args = targs(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    AmpkitTrainer(model=gpt2(), args=args, train_dataset=Tokens(), precision="fp16-mixed").train()
    other = AmpkitTrainer(model=gpt2(), args=targs(tmp_path, max_steps=3), train_dataset=Tokens(),
                          precision="bf16-mixed")
    with pytest.raises(ValueError, match="saved by precision='fp16-mixed'"):
        other.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


@pytest.mark.parametrize("mode", ["bf16-master", "fp16-master", "bf16-mixed", "fp8-delayed"])
def test_save_model_is_full_precision_and_says_so(mode, tmp_path):
    """save_model writes the fp32 weights (the masters in the master modes) and a config.json saying float32,
    so a plain from_pretrained(dir) gets them, bitwise."""
    trainer = AmpkitTrainer(model=gpt2(), args=targs(tmp_path, max_steps=2), train_dataset=Tokens(),
                            precision=_fp8_ends(mode))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["dtype"] == "float32"
    loaded = T.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"))
    assert loaded.dtype == torch.float32
    truth = trainer.precision.fp32_state_dict(trainer.model)
    got = loaded.state_dict()
    assert truth.keys() <= got.keys() and all(torch.equal(got[k], v) for k, v in truth.items())


def test_save_model_pure_mode_writes_its_16bit_weights(tmp_path):
    """fp16-pure (and bf16-pure without Kahan) keep no better weights than their 16-bit ones: those are written."""
    trainer = AmpkitTrainer(model=gpt2(), args=targs(tmp_path, max_steps=2), train_dataset=Tokens(),
                            precision=ampkit.Precision("bf16-pure", "cpu", compensation="stochastic"))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    loaded = T.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"), dtype="auto")
    assert loaded.transformer.h[0].mlp.c_fc.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.transformer.h[0].mlp.c_fc.weight, trainer.model.transformer.h[0].mlp.c_fc.weight)


def test_save_model_bf16_pure_folds_the_kahan_buffers_in(tmp_path):
    """bf16-pure with Kahan: save_model writes weight + buffer in fp32 (precision.fp32_state_dict, the trained
    value) and a config saying float32 (the bf16 weights alone are ~1% of the movement off)."""
    trainer = AmpkitTrainer(model=gpt2(), args=targs(tmp_path, max_steps=3), train_dataset=Tokens(),
                            precision="bf16-pure")
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    assert json.loads((tmp_path / "final" / "config.json").read_text())["dtype"] == "float32"
    loaded = T.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final")).state_dict()
    truth = trainer.precision.fp32_state_dict(trainer.model)
    w = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(truth[w], trainer.model.state_dict()[w].float())  # the buffers hold something
    assert all(torch.equal(loaded[k], v) for k, v in truth.items() if k in loaded)


def test_refusals_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="leave fp16/bf16 False and pass precision="):
        AmpkitTrainer(model=gpt2(), args=targs(tmp_path, bf16=True), train_dataset=Tokens(), precision="bf16-mixed")
    with pytest.raises(ValueError, match="LOMO optimizers step inside the backward"):
        AmpkitTrainer(model=gpt2(), args=targs(tmp_path, optim="lomo"), train_dataset=Tokens(), precision="bf16-mixed")
    used = ampkit.Precision("bf16-mixed", "cpu")
    used.setup(gpt2())
    with pytest.raises(ValueError, match="already set up another model"):
        AmpkitTrainer(model=gpt2(), args=targs(tmp_path), train_dataset=Tokens(), precision=used)


def test_checkpoint_without_precision_state_warns_in_scaled_modes(tmp_path):
    args = targs(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    T.Trainer(model=gpt2(), args=args, train_dataset=Tokens()).train()  # HF's own run: no ampkit state
    assert not os.path.exists(tmp_path / "checkpoint-2" / PRECISION_STATE_NAME)
    trainer = AmpkitTrainer(model=gpt2(), args=targs(tmp_path, max_steps=3), train_dataset=Tokens(),
                            precision="fp16-mixed")
    with pytest.warns(UserWarning, match="loss scale starts again"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


@pytest.mark.parametrize("mode", ["bf16-pure", "fp16-master"])
def test_optimizer_and_scheduler_passed_in_are_the_ones_stepped(mode, tmp_path):
    """optimizers=(opt, scheduler) built by the user before the Trainer: ampkit steps that very object (bf16-pure's
    compensated form in place), and the user's scheduler still drives the learning rate the step uses."""
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    trainer = AmpkitTrainer(model=model, args=targs(tmp_path, max_steps=3), train_dataset=Tokens(),
                            optimizers=(opt, sched), precision=mode)
    trainer.train()
    stepped = trainer.optimizer.optimizer.optimizer  # accelerate's wrapper -> AmpkitOptimizer -> ampkit's
    assert stepped is opt
    assert [g["lr"] for g in stepped.param_groups] == [1e-3 * 0.5 ** 3] * len(stepped.param_groups)
    assert trainer.precision.optimizer_steps == 3 and [h["learning_rate"] for h in train_logs(trainer)] == \
        [1e-3, 5e-4, 2.5e-4]


def test_says_once_that_ampkit_clips(tmp_path, caplog):
    logging = T.utils.logging
    logging.enable_propagation()
    before = logging.get_verbosity()
    logging.set_verbosity_info()
    try:
        trainer = AmpkitTrainer(model=gpt2(), args=targs(tmp_path, max_steps=2), train_dataset=Tokens(),
                                precision="fp16-mixed")
        with caplog.at_level("INFO"):
            trainer.train()
    finally:
        logging.set_verbosity(before)
        logging.disable_propagation()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AmpkitTrainer:")]
    assert len(said) == 1 and "fp16-mixed" in said[0] and "max_grad_norm=1 is clipped by ampkit" in said[0], said


# ---------------------------------------------------------------------- 2 processes (torchrun's environment, gloo)
HF2_MODES = ("bf16-mixed", "bf16-pure")


def _two_ranks(rank, tmp):
    """HF's Trainer in each of 2 processes as torchrun starts them (the environment says rank and world size;
    the group is up): HF's own bf16=True, then AmpkitTrainer in bf16-mixed and bf16-pure; HF wraps the model in DDP."""
    from distributed_helpers import init_rank, leave_rank

    init_rank(rank, tmp)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1", OMP_NUM_THREADS="1")
    hf = T.Trainer(model=gpt2(), args=targs(f"{tmp}/hf", bf16=True, max_steps=3), train_dataset=Tokens())
    hf.train()
    out = {"hf": weights(hf.model), "wrapped": type(hf.model_wrapped).__name__}
    for mode in HF2_MODES:
        t = AmpkitTrainer(model=gpt2(), args=targs(f"{tmp}/{mode}", max_steps=3), train_dataset=Tokens(),
                          precision=mode)
        t.train()
        out[mode] = {"weights": weights(t.model), "steps": t.precision.optimizer_steps,
                     "wrapped": type(t.model_wrapped).__name__}
    torch.save(out, f"{tmp}/out{rank}.pt")
    leave_rank()  # HF's DDP models are alive: no destroy_process_group


@pytest.mark.slow  # (one of make test's longest: 15-70 s on 2 cores; make test-slow and CI run it)
def test_two_processes_under_hfs_ddp(tmp_path):
    """Each mode trains under HF's DDP with the ranks equal; bf16-mixed is bitwise HF's own bf16=True there too."""
    from distributed_helpers import run_ranks

    run_ranks(_two_ranks, str(tmp_path), timeout=240)
    r0, r1 = (torch.load(tmp_path / f"out{r}.pt") for r in (0, 1))
    assert r0["wrapped"] == "DistributedDataParallel"
    assert_bitwise(r0["bf16-mixed"]["weights"], r0["hf"])
    start = weights(gpt2())
    for mode in HF2_MODES:
        assert r0[mode]["wrapped"] == "DistributedDataParallel" and r0[mode]["steps"] == r1[mode]["steps"] == 3
        assert_bitwise(r0[mode]["weights"], r1[mode]["weights"])
        assert not torch.equal(r0[mode]["weights"]["transformer.h.0.mlp.c_fc.weight"].float(),
                               start["transformer.h.0.mlp.c_fc.weight"].float())
