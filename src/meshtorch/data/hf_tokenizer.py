"""A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (the ``hf`` extra), with the
interface of :class:`meshtorch.data.text.ByteTokenizer` (``encode``, ``decode``, ``vocab_size``)."""

from __future__ import annotations

import numpy as np

from meshtorch.core.errors import DataError

__all__ = ["HFTokenizer"]


class HFTokenizer:
    """``tokenizers.Tokenizer.from_file(path)``: a model's own vocabulary (GPT-2 byte-level BPE,
    Llama's SentencePiece-BPE, ...). Text is encoded without added special tokens, as
    ``transformers``' ``tokenizer(text, add_special_tokens=False)``.

    Raises:
        DataError: if ``tokenizers`` is not installed (``pip install meshtorch[hf]``) or the file is unreadable.
    """

    def __init__(self, path: str):
        try:
            import tokenizers
        except ImportError:
            raise DataError(f"{path!r}: reading tokenizer.json needs the 'tokenizers' package: "
                            "pip install tokenizers (or meshtorch[hf]).") from None
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:
            raise DataError(f"{path!r} is not a readable tokenizers file ({e}).") from e
        self.path = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def unknown_characters(self, text: str) -> list[str]:
        """The distinct characters of ``text`` (in order) that encode to the model's unknown token (e.g.
        ``[UNK]``, ``<unk>``); [] when the tokenizer has none (byte-level BPE encodes every character)."""
        unk = getattr(self._tok.model, "unk_token", None)
        unk_id = self._tok.token_to_id(unk) if unk else None
        if unk_id is None:
            return []
        enc = self._tok.encode(text, add_special_tokens=False)
        out = []
        for i, (a, b) in zip(enc.ids, enc.offsets, strict=True):
            for ch in text[a:b] if i == unk_id else "":
                if ch not in out and not ch.isspace():
                    out.append(ch)
        return out

    def decode(self, ids) -> str:
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        return self._tok.decode(ids, skip_special_tokens=False)
