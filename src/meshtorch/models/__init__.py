"""Models built from meshtorch layers."""

from meshtorch.models.mnist import MnistModel, build_mnist_model

__all__ = ["MnistModel", "build_mnist_model"]
