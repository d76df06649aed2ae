"""Tokenizers for MLM text: train a BERT-style WordPiece on the training text, or load a pretrained one."""

from __future__ import annotations

from collections.abc import Sequence

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def train_wordpiece(texts: Sequence[str], vocab_size: int):
    """Train a BERT-style WordPiece tokenizer (lower-cased) and return a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    # So that tokenizer("text") frames single texts like BERT does (packing adds its own framing).
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return tok


def _wrap(tok, seq_len: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=seq_len,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def load_tokenizer(name: str, tokenizer_json: str | None, seq_len: int):
    """``name="wordpiece"``: the trained WordPiece in ``tokenizer_json``; else a pretrained tokenizer by name or
    path, which must have the mask, CLS and SEP tokens that packing and masking need."""
    if name == "wordpiece":
        from tokenizers import Tokenizer

        return _wrap(Tokenizer.from_str(tokenizer_json), seq_len)
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(name)
    needed = {
        "mask_token": loaded.mask_token_id,
        "cls_token": loaded.cls_token_id,
        "sep_token": loaded.sep_token_id,
    }
    missing = [k for k, v in needed.items() if v is None]
    if missing:
        raise ValueError(f"tokenizer={name!r} lacks {missing}, which MLM packing and masking need")
    return loaded


def encode_documents(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each whole text, without special tokens (packing adds its own framing)."""
    # The backend tokenizer encodes whole documents without the "longer than max length" warnings.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
