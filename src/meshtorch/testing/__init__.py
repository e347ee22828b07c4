"""Test helpers, importable by tests and benchmarks only (library modules never import this package;
import-linter checks it).

- :mod:`~meshtorch.testing.layouts`: ``check_layouts`` / ``OpCase``, the layout-invariance harness.
- :mod:`~meshtorch.testing.spmd`: ``run_spmd``, running functions in N gloo processes.
- :mod:`~meshtorch.testing.torch_lm`: ``TorchLM``, the plain-PyTorch twin of the meshtorch LM.
"""

from meshtorch.testing.layouts import (
    DEFAULT_MESHES,
    OpCase,
    assert_training_agrees,
    build_outputs,
    check_layouts,
    enumerate_layouts,
    reference_run,
    rel_error,
    run_layout,
)

__all__ = ["DEFAULT_MESHES", "OpCase", "assert_training_agrees", "build_outputs", "check_layouts",
           "enumerate_layouts", "reference_run", "rel_error", "run_layout"]
