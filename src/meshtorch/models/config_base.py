"""What the native model configs share: the Transformer sizes (:class:`TransformerSizes`) and the vocabulary
padding for partitioning (:func:`padded_size`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["TransformerSizes", "padded_size"]


def padded_size(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple`` (< 1 counts as 1): the graph's ``vocab`` size, so that a
    mesh axis splits it (Megatron-LM's ``--make-vocab-size-divisible-by``, Haliax's
    ``round_axis_for_partitioning``); the padded rows are zero and their logits masked."""
    m = max(1, multiple)
    return (size + m - 1) // m * m


@dataclass(frozen=True)
class TransformerSizes:
    """The sizes of the named dims ``vocab`` (``vocab_size``, before padding), ``d_model``, ``heads``
    (``num_heads``), ``d_kv``, ``d_ff`` and ``batch`` (``batch_size``), the dropout rate and the feed-forward
    activation's name, first in every native config (:class:`~meshtorch.models.transformer.LMConfig`,
    :class:`~meshtorch.models.encdec.EncDecConfig`; a subclass may declare a field again for its own default);
    subclasses declare ``vocab_multiple``."""

    vocab_size: int = 256
    d_model: int = 256
    num_heads: int = 8
    d_kv: int = 32
    d_ff: int = 1024
    batch_size: int = 16
    dropout: float = 0.0
    activation: str = "relu"

    @property
    def padded_vocab(self) -> int:
        """``vocab_size`` padded to the config's ``vocab_multiple`` (:func:`padded_size`)."""
        return padded_size(self.vocab_size, getattr(self, "vocab_multiple", 1))

    def to_dict(self) -> dict:
        """The config's fields as a dict (``dataclasses.asdict``: run records, checkpoints)."""
        return asdict(self)
