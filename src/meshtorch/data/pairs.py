"""Input/target pairs for an encoder-decoder (T5) fine-tuning run: ``meshtorch train --init-from T5DIR --data
FILE`` where each line of FILE is ``input<TAB>target`` (UTF-8; empty lines skipped).

Each side is tokenized with the model's tokenizer, gets T5's EOS id (1) appended (as ``T5TokenizerFast`` adds
``</s>``), and is padded with T5's pad id (0) to ``length``; the decoder's loss skips padded targets (id 0),
as ``transformers``' ``labels=-100``. A batch row is the ``[2 * length]`` concatenation ``inputs | targets``.
"""

from __future__ import annotations

import torch

from meshtorch.core.errors import DataError
from meshtorch.data.text import PackedDataset

__all__ = ["EOS", "PAD", "PairsDataset", "read_pairs"]

PAD, EOS = 0, 1  # T5's pad_token_id (also decoder_start_token_id) and eos_token_id


def read_pairs(paths) -> list[tuple[str, str, str]]:
    """``(input, target, where)`` of every non-empty line of the files ``paths``; ``where`` is ``file:line``.

    Raises:
        DataError: a line without exactly one TAB, or no pairs at all (naming the file and line).
    """
    pairs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                line = line.rstrip("\r\n")
                if not line.strip():
                    continue
                if line.count("\t") != 1:
                    raise DataError(f"--data {path}:{n}: a T5 pair is one line 'input<TAB>target' (exactly one TAB); "
                                    f"this line has {line.count(chr(9))}.")
                a, b = line.split("\t")
                pairs.append((a, b, f"{path}:{n}"))
    if not pairs:
        raise DataError(f"--data {', '.join(paths)}: no 'input<TAB>target' lines.")
    return pairs


class PairsDataset(PackedDataset):
    """:class:`~meshtorch.data.text.PackedDataset` of int64 rows ``[2 * length]`` (``inputs | targets``, each
    EOS-terminated and 0-padded to ``length``)."""

    @classmethod
    def from_pairs(cls, pairs, tokenizer, length: int, batch_size: int) -> PairsDataset:
        """The last ``max(batch_size, 5%)`` pairs are the validation split; ``bytes_per_token`` is the validation
        targets' UTF-8 bytes per target position (padding included, as the loss divides), so bits per byte is
        the summed target cross entropy per target byte.

        Raises:
            DataError: a side longer than ``length - 1`` tokens (naming its ``file:line``), or fewer than
                ``2 * batch_size`` pairs (one batch each for training and validation).
        """
        if len(pairs) < 2 * batch_size:
            raise DataError(f"--data: {len(pairs)} pairs; a T5 run needs at least 2 x --batch-size ({2 * batch_size}) "
                            "pairs (one batch each for training and validation).")
        rows = torch.full((len(pairs), 2 * length), PAD, dtype=torch.int64)
        for r, (a, b, where) in enumerate(pairs):
            for k, (side, text) in enumerate((("input", a), ("target", b))):
                ids = [int(i) for i in tokenizer.encode(text)] + [EOS]
                if len(ids) > length:
                    raise DataError(f"--data {where}: the {side} is {len(ids)} tokens with EOS, more than --length "
                                    f"{length}; shorten it or give a longer --length.")
                rows[r, k * length:k * length + len(ids)] = torch.tensor(ids)
        n_val = max(batch_size, len(pairs) // 20)
        val_bytes = sum(len(b.encode("utf-8")) + 1 for _, b, _ in pairs[-n_val:])  # + 1: EOS
        if len(pairs) - n_val < batch_size:
            raise DataError(f"--data: {len(pairs)} pairs leave {len(pairs) - n_val} for training after "
                            f"{n_val} for validation; give at least {n_val + batch_size} or a smaller --batch-size.")
        return cls(rows[:-n_val].clone(), rows[-n_val:].clone(), 2 * length, val_bytes / (n_val * length))
