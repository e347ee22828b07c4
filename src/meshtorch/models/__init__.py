"""Models built from meshtorch ops."""

from meshtorch.models.mnist import MnistModel, build_mnist_model

__all__ = ["MnistModel", "build_mnist_model"]
