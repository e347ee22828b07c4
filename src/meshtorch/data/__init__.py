"""Data readers: MNIST IDX files, text corpora."""

from meshtorch.data.mnist import DEFAULT_DATA_DIR, load_idx, load_mnist

__all__ = ["DEFAULT_DATA_DIR", "load_idx", "load_mnist"]
