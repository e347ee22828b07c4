"""Optimizers as graph operations: ``apply_grads`` returns assign operations to fetch."""

from meshtorch.optim.sgd import MomentumOptimizer, Optimizer, SgdOptimizer

__all__ = ["Optimizer", "SgdOptimizer", "MomentumOptimizer"]
