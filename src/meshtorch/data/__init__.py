"""Data readers: MNIST IDX files, text corpora; which examples each process reads (``sharding``)."""

from meshtorch.data.mnist import DEFAULT_DATA_DIR, load_idx, load_mnist

__all__ = ["DEFAULT_DATA_DIR", "load_idx", "load_mnist"]
