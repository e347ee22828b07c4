"""Text corpora for language modelling: a byte-level tokenizer and packed fixed-length sequences.

The built-in corpus is the English prose that ships with CPython (``pydoc_data.topics``, about
465 kB), so the main job needs no download. ``load_corpus(paths)`` reads the user's UTF-8 files
instead; empty or undecodable input raises :class:`~meshtorch.core.errors.DataError` naming the file.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pydoc_data import topics as _pydoc_topics

import numpy as np
import torch

from meshtorch.core.errors import DataError


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255, ``vocab_size`` 256. Lossless; no training needed."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def bytes_per_token(self, text: str) -> float:
        return 1.0


class SentencePieceTokenizer:
    """A SentencePiece model (Kudo & Richardson 2018) trained on the corpus, with byte fallback.

    Needs the optional ``sentencepiece`` package (``pip install meshtorch[spm]``).

    Args:
        texts: training documents.
        vocab_size: number of pieces (>= 260 with byte fallback).
        model_type: ``"unigram"`` (SentencePiece's default) or ``"bpe"``.
    """

    def __init__(self, texts: Sequence[str], vocab_size: int = 1024, model_type: str = "unigram"):
        try:
            import sentencepiece as spm
        except ImportError:
            raise DataError("the SentencePiece tokenizer needs the 'sentencepiece' package: "
                            "pip install sentencepiece (or meshtorch[spm]).") from None
        model = io.BytesIO()
        lines = [line for t in texts for line in t.splitlines() if line.strip()]
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                                       model_type=model_type, byte_fallback=True, character_coverage=1.0,
                                       minloglevel=2, num_threads=1, add_dummy_prefix=False,
                                       remove_extra_whitespaces=False, normalization_rule_name="identity")
        self._load(model.getvalue())

    def _load(self, proto: bytes):
        import sentencepiece as spm
        self._proto = proto
        self._sp = spm.SentencePieceProcessor(model_proto=proto)
        self.vocab_size = self._sp.get_piece_size()

    @classmethod
    def from_file(cls, path: str) -> SentencePieceTokenizer:
        """Load a model written by :meth:`save`."""
        try:
            import sentencepiece  # noqa: F401
        except ImportError:
            raise DataError("the SentencePiece tokenizer needs the 'sentencepiece' package.") from None
        tok = cls.__new__(cls)
        with open(path, "rb") as f:
            tok._load(f.read())
        return tok

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as f:
            f.write(self._proto)

    def encode(self, text: str) -> np.ndarray:
        # line by line, newlines as explicit byte pieces, so packed sequences keep the text's layout
        nl = self._sp.piece_to_id("<0x0A>")
        out: list[int] = []
        for i, line in enumerate(text.split("\n")):
            if i:
                out.append(nl)
            if line:
                out.extend(self._sp.encode(line))
        return np.asarray(out, dtype=np.int64)

    def decode(self, ids) -> str:
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        return self._sp.decode(ids)


def builtin_documents() -> list[str]:
    """CPython's pydoc topic texts (English prose about Python), one document per topic, in a fixed order."""
    return [_pydoc_topics.topics[k] for k in sorted(_pydoc_topics.topics)]


def builtin_corpus() -> str:
    return "\n\n".join(builtin_documents())


def load_documents(paths: Sequence[str] | None = None) -> list[str]:
    """One document per file of ``paths`` (UTF-8), or the built-in topics if ``paths`` is empty.

    Raises:
        DataError: naming the file, if it is missing, empty, or not valid UTF-8.
    """
    if not paths:
        return builtin_documents()
    texts = []
    for p in paths:
        if not os.path.isfile(p):
            raise DataError(f"Text file {p!r} does not exist.")
        raw = open(p, "rb").read()
        if not raw.strip():
            raise DataError(f"Text file {p!r} is empty; give a file with some text.")
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"Text file {p!r} is not valid UTF-8 (byte {e.start}: {e.reason}); "
                            "convert it to UTF-8 first.") from None
    return texts


def load_corpus(paths: Sequence[str] | None = None) -> str:
    """The concatenated text of :func:`load_documents`."""
    return "\n\n".join(load_documents(paths))


@dataclass
class PackedDataset:
    """Token ids packed into ``[num_sequences, length]`` training and validation arrays.

    Validation holds out whole documents (a seeded random ``validation_fraction`` of the bytes),
    so no validation text is seen in training; with a single document its tail is held out. No
    sequence straddles the split. Batches are drawn in an order fixed by the seed alone, so every
    layout and every process sees the same examples.
    """

    train: torch.Tensor  # int64 [n_train, length]
    validation: torch.Tensor  # int64 [n_val, length]
    length: int
    bytes_per_token: float = 1.0  # UTF-8 bytes per token on the validation text (for bits per byte)

    @classmethod
    def from_documents(cls, docs: Sequence[str], tokenizer, length: int, validation_fraction: float = 0.05,
                       seed: int = 0) -> PackedDataset:
        """Hold out whole documents for validation (seeded), pack both parts into sequences."""
        if len(docs) < 2:
            return cls.from_text("\n\n".join(docs), tokenizer, length, validation_fraction)
        order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
        total = sum(len(d) for d in docs)
        val, n = [], 0
        for i in order:
            if n >= validation_fraction * total:
                break
            val.append(i)
            n += len(docs[i])
        train_text = "\n\n".join(docs[i] for i in range(len(docs)) if i not in set(val))
        val_text = "\n\n".join(docs[i] for i in sorted(val))
        enc = lambda t: torch.from_numpy(np.asarray(tokenizer.encode(t), dtype=np.int64))  # noqa: E731
        train_ids, val_ids = enc(train_text), enc(val_text)
        if len(train_ids) < length or len(val_ids) < length:
            raise DataError(f"Corpus too small for sequences of length {length} with a validation split; "
                            "give more text or a shorter --length.")
        bpt = len(val_text.encode("utf-8")) / max(len(val_ids), 1)
        return cls(_pack(train_ids, length), _pack(val_ids, length), length, bpt)

    @classmethod
    def from_text(cls, text: str, tokenizer, length: int, validation_fraction: float = 0.05) -> PackedDataset:
        """Hold out the tail of one text for validation."""
        if not 0 < validation_fraction < 1:
            raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}.")
        ids = torch.from_numpy(np.asarray(tokenizer.encode(text), dtype=np.int64))
        n_val = max(int(len(ids) * validation_fraction), length)
        if len(ids) - n_val < length:
            raise DataError(f"Corpus of {len(ids)} tokens is too small for sequences of length {length} "
                            "with a validation split; give more text or a shorter --length.")
        train_ids, val_ids = ids[: len(ids) - n_val], ids[len(ids) - n_val:]
        bpt = len(text.encode("utf-8")) / max(len(ids), 1)
        return cls(_pack(train_ids, length), _pack(val_ids, length), length, bpt)

    def batches(self, batch_size: int, seed: int, epoch: int = 0, split: str = "train") -> Iterator[torch.Tensor]:
        """Shuffled (train) or in-order (validation) ``[batch_size, length]`` batches; the tail is dropped."""
        data = self.train if split == "train" else self.validation
        if split == "train":
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed * 1000003 + epoch))
        else:
            order = torch.arange(len(data))
        for i in range(0, len(data) - batch_size + 1, batch_size):
            yield data[order[i:i + batch_size]]


    def position(self, batch_size: int, batches_done: int) -> tuple[int, int]:
        """Where :meth:`stream` stands after ``batches_done`` training batches from the start (of ``batch_size``
        sequences each): ``(epoch, batches of that epoch done)``, to pass to :meth:`stream` to continue there.

        Raises:
            DataError: if the training split holds fewer than ``batch_size`` sequences (no batch at all).
        """
        per_epoch = len(self.train) // batch_size  # :meth:`batches` drops the tail
        if per_epoch == 0:
            raise self._too_small(batch_size)
        return divmod(batches_done, per_epoch)

    def _too_small(self, batch_size: int) -> DataError:
        return DataError(f"the training data has {len(self.train)} sequence(s), fewer than one batch of "
                         f"{batch_size}; give more text, a smaller --batch-size or a shorter --length.")

    def stream(self, batch_size: int, seed: int, epoch: int = 0, start: int = 0) -> Iterator[tuple]:
        """Training batches epoch after epoch, without end: yields ``(epoch, batches of that epoch done, batch)``
        (what a checkpoint records to resume), beginning ``start`` batches into ``epoch``; each epoch is
        :meth:`batches` with its own shuffle.

        Raises:
            DataError: if the training split holds fewer than ``batch_size`` sequences (no batch at all).
        """
        while True:
            done = 0
            for done, batch in enumerate(self.batches(batch_size, seed, epoch), start=1):
                if done > start:
                    yield epoch, done, batch
            if done == 0:
                raise self._too_small(batch_size)
            epoch, start = epoch + 1, 0


def _pack(ids: torch.Tensor, length: int) -> torch.Tensor:
    n = len(ids) // length
    return ids[: n * length].view(n, length).clone()
