"""TRL's ``SFTTrainer`` with ``AmpkitTrainerMixin`` as TRL's users write it: its default ``SFTConfig``
(bf16 on unless told, gradient checkpointing on), a text dataset, a tokenizer, a LoRA ``peft_config``. Tiny Llama
from a config and a word-level tokenizer built here (no download), CPU."""
import warnings

import pytest
import torch

trl = pytest.importorskip("trl", reason="pip install -e '.[finetune]' (peft, trl, sentence-transformers, diffusers) "
                                        "runs these")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")
T = pytest.importorskip("transformers")

from ampkit.integrations.hf import AmpkitTrainerMixin  # noqa: E402
from hf_models import build, word_texts, word_tokenizer  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]


class AmpkitSFTTrainer(AmpkitTrainerMixin, trl.SFTTrainer):
    pass


def texts(n=16):
    return datasets.Dataset.from_dict({"text": word_texts(n)})


def config(out, **kw):
    """TRL's defaults (bf16 left to TRL, gradient checkpointing on), what a CPU run and a short test need."""
    return trl.SFTConfig(str(out), use_cpu=True, report_to=[], max_steps=3, per_device_train_batch_size=4,
                         logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, **kw)


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_sft_default_config_is_taken_over_said_once_and_bitwise_trls_own_bf16(tmp_path):
    """SFTConfig() turns bf16 on by default: AmpkitTrainerMixin takes it over with one warning naming TRL's default
    and the argument to pass (not a refusal saying "leave fp16/bf16 False" to a user who never wrote bf16), and
    precision='bf16-mixed' then trains bit for bit as TRL's own bf16 does."""
    own = trl.SFTTrainer(model=build("llama"), args=config(tmp_path / "trl"), train_dataset=texts(),
                         processing_class=word_tokenizer())
    assert own.args.bf16
    own.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = AmpkitSFTTrainer(model=build("llama"), args=config(tmp_path / "ampkit"), train_dataset=texts(),
                                processing_class=word_tokenizer(), precision="bf16-mixed")
    said = [str(w.message) for w in caught if "TRL" in str(w.message)]
    assert len(said) == 1 and "bf16=None" in said[0] and "pass bf16=False" in said[0]
    assert not ours.args.bf16 and ours.accelerator.mixed_precision == "no"
    ours.train()
    a, b = weights(own.model), weights(ours.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sft_fp16_the_user_asked_for_is_still_refused(tmp_path):
    """Only TRL's default is taken over: fp16 (which the user wrote) is accelerate's mixed precision, refused."""
    args = config(tmp_path, bf16=False)
    args.fp16 = True  # (set after building: transformers' own checks refuse fp16 with use_cpu)
    with pytest.raises(ValueError, match="leave fp16/bf16 False"):
        AmpkitSFTTrainer(model=build("llama"), args=args, train_dataset=texts(), processing_class=word_tokenizer(),
                         precision="bf16-mixed")


@pytest.mark.parametrize("mode", ["bf16-master", "bf16-pure"])
def test_sft_lora_on_a_bf16_base_with_gradient_checkpointing_equals_without(mode, tmp_path):
    """A LoRA peft_config on a bf16 base, TRL's gradient checkpointing on (its default) and off: the same adapters
    bit for bit (checkpointing recomputes each block under the autocast state it was saved with)."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    runs = []
    for checkpointing in (True, False):
        trainer = AmpkitSFTTrainer(model=build("llama").to(torch.bfloat16), args=config(
            tmp_path / str(checkpointing), gradient_checkpointing=checkpointing, learning_rate=1e-2),
            train_dataset=texts(), processing_class=word_tokenizer(), peft_config=lora, precision=mode)
        trainer.train()
        runs.append({k: v for k, v in weights(trainer.model).items() if "lora_" in k})
    assert runs[0] and all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert any(v.dtype == (torch.bfloat16 if mode == "bf16-pure" else torch.float32) for v in runs[0].values())
