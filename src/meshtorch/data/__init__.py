"""Data readers: MNIST IDX files, text corpora."""
