"""Text corpus reader, byte tokenizer and packed train/validation split."""

import pytest
import torch

from meshtorch.core.errors import DataError
from meshtorch.data.text import ByteTokenizer, PackedDataset, builtin_documents, load_documents


def test_byte_tokenizer_round_trip_unicode():
    tok = ByteTokenizer()
    text = "naïve café — 数据"
    ids = tok.encode(text)
    assert ids.max() < 256 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_builtin_corpus_is_substantial_english():
    docs = builtin_documents()
    assert sum(len(d) for d in docs) > 400_000 and len(docs) > 50
    assert " the " in docs[0] or " the " in docs[1]


@pytest.mark.parametrize("content,match", [(b"", "empty"), (b"  \n ", "empty"), (b"ok \xff\xfe bad", "UTF-8")])
def test_bad_files_name_the_file(tmp_path, content, match):
    p = tmp_path / "corpus.txt"
    p.write_bytes(content)
    with pytest.raises(DataError, match=f"corpus.txt.*{match}|{match}.*corpus.txt"):
        load_documents([str(p)])


def test_missing_file_named(tmp_path):
    with pytest.raises(DataError, match="nope.txt"):
        load_documents([str(tmp_path / "nope.txt")])


def test_validation_documents_are_held_out():
    docs = [f"document number {i} " * 40 for i in range(40)]
    ds = PackedDataset.from_documents(docs, ByteTokenizer(), 33, validation_fraction=0.1)
    tok = ByteTokenizer()
    val_text = "".join(tok.decode(r) for r in ds.validation)
    train_text = "".join(tok.decode(r) for r in ds.train)
    held = {i for i in range(40) if f"document number {i} " in val_text}
    assert held and all(f"document number {i} " not in train_text for i in held)
    assert ds.train.shape[1] == 33 and ds.validation.shape[1] == 33


def test_batches_depend_only_on_seed_and_epoch():
    ds = PackedDataset.from_text("abcdefgh" * 200, ByteTokenizer(), 17)
    a = torch.cat(list(ds.batches(4, seed=3, epoch=1)))
    b = torch.cat(list(ds.batches(4, seed=3, epoch=1)))
    c = torch.cat(list(ds.batches(4, seed=3, epoch=2)))
    assert torch.equal(a, b) and not torch.equal(a, c)
    rows = {tuple(r) for r in ds.train.tolist()}
    assert all(tuple(r) in rows for r in a.tolist())  # every batch row is a training sequence


def test_corpus_too_small():
    with pytest.raises(DataError, match="too small"):
        PackedDataset.from_text("tiny", ByteTokenizer(), 128)


def test_sentencepiece_tokenizer_round_trip_and_bits_per_byte(tmp_path):
    from meshtorch.data.text import SentencePieceTokenizer
    docs = builtin_documents()[:30]
    tok = SentencePieceTokenizer(docs, vocab_size=400)
    text = docs[0][:500]
    assert tok.decode(tok.encode(text)) == text
    ds = PackedDataset.from_documents(docs, tok, 33)
    assert ds.bytes_per_token > 1.2  # pieces cover more than one byte (400 pieces, 256 of them bytes)
    assert int(ds.train.max()) < tok.vocab_size == 400
    tok.save(str(tmp_path / "t.model"))
    again = SentencePieceTokenizer.from_file(str(tmp_path / "t.model"))
    assert again.encode(text).tolist() == tok.encode(text).tolist()
