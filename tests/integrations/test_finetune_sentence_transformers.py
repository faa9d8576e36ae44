"""sentence-transformers' trainer with ``AmpkitTrainerMixin`` as its users write it: a
``SentenceTransformer`` of a Transformer module and mean pooling (a tiny BertModel from a config, saved to a folder
and loaded by name, as a hub model would be), (anchor, positive) pairs, ``MultipleNegativesRankingLoss``. The loss
is computed outside the model: only the model's forward runs in bf16, as under ST's own ``bf16=True``."""
import pytest
import torch

st = pytest.importorskip("sentence_transformers", reason="pip install -e '.[finetune]' (peft, trl, "
                                                         "sentence-transformers, diffusers) runs these")
datasets = pytest.importorskip("datasets")
T = pytest.importorskip("transformers")

from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer  # noqa: E402

from ampkit.integrations.hf import AmpkitTrainerMixin  # noqa: E402
from hf_models import VOCAB, word_texts, word_tokenizer  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]


class AmpkitSentenceTransformerTrainer(AmpkitTrainerMixin, st.SentenceTransformerTrainer):
    pass


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-bert"))
    torch.manual_seed(0)
    T.BertModel(T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=32)).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


def pairs():
    return datasets.Dataset.from_dict({"anchor": word_texts(16, 8, seed=0), "positive": word_texts(16, 8, seed=1)})


def train(trainer_class, bert_dir, out, **kw):
    torch.manual_seed(0)
    model = st.SentenceTransformer(modules=[Transformer(bert_dir), Pooling(32)], device="cpu")
    precision = {"precision": kw.pop("precision")} if "precision" in kw else {}
    args = st.SentenceTransformerTrainingArguments(str(out), use_cpu=True, report_to=[], max_steps=4, seed=0,
                                                   per_device_train_batch_size=8, logging_steps=1,
                                                   save_strategy="no", disable_tqdm=True, learning_rate=1e-3, **kw)
    trainer = trainer_class(model=model, args=args, train_dataset=pairs(), loss=MultipleNegativesRankingLoss(model),
                            **precision)
    trainer.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, [
        h for h in trainer.state.log_history if "loss" in h]


def test_bf16_mixed_is_bitwise_sentence_transformers_own_bf16(bert_dir, tmp_path):
    """In-batch negatives scored outside the model: ampkit's bf16-mixed equals ST's bf16=True bit for bit (a bf16
    autocast around the whole compute_loss scores in bf16: another loss from step 1)."""
    theirs = train(st.SentenceTransformerTrainer, bert_dir, tmp_path / "st", bf16=True)
    ours = train(AmpkitSentenceTransformerTrainer, bert_dir, tmp_path / "ampkit", precision="bf16-mixed")
    assert [h["loss"] for h in theirs[1]] == [h["loss"] for h in ours[1]]
    assert all(torch.equal(theirs[0][k], ours[0][k]) for k in theirs[0])

