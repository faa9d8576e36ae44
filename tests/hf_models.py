"""Tiny Hugging Face models built from configs (no download) and matching batches, for the tests."""
import pytest
import torch

T = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 64, 12, 4


def _ids(seed: int, n: int = BATCH):
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def _lm_batch(seed, n=BATCH):
    ids = _ids(seed, n)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _cls_batch(seed, n=BATCH):
    ids = _ids(seed, n)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids),
            "labels": torch.arange(n) % 3}


def _seq2seq_batch(seed, n=BATCH):
    ids = _ids(seed, n)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids[:, :6].flip(1).contiguous()}


def _image_batch(seed, n=BATCH):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 3
    x = torch.randn(n, 3, 16, 16, generator=g) + labels.view(-1, 1, 1, 1).float()  # learnable
    return {"pixel_values": x, "labels": labels}


MODELS = {
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)),
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=0, pad_token_id=0)),
    "bert": lambda: T.BertForSequenceClassification(T.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=3)),
    "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1)),
    "vit": lambda: T.ViTForImageClassification(T.ViTConfig(
        image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3)),
}
BATCHES = {"gpt2": _lm_batch, "llama": _lm_batch, "bert": _cls_batch, "t5": _seq2seq_batch, "vit": _image_batch}
ARCHS = list(MODELS)


def build(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    return MODELS[arch]()


class DictDataset(torch.utils.data.Dataset):
    """One dict per sample, as a tokenised Hugging Face dataset yields them."""

    def __init__(self, arch: str, n: int, seed: int = 0):
        batch = BATCHES[arch](seed, n)
        self.samples = [{k: v[i] for k, v in batch.items()} for i in range(n)]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def word_tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary ("t0".."t63"; t0 pads and ends), built here (no
    download): what TRL's and sentence-transformers' trainers need to tokenize text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t1", pad_token="t0", eos_token="t0")


def word_texts(n: int, words: int = 10, seed: int = 0):
    """``n`` synthetic sentences of the tokenizer's words."""
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"t{int(i)}" for i in torch.randint(2, VOCAB, (words,), generator=g)) for _ in range(n)]
