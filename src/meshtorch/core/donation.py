"""What a slicewise kernel declares about in-place updates (read by the program's passes and the backends).

A kernel (a function, possibly under ``functools.partial`` layers binding its parameters) may carry
``donates``: the input positions it can update in place when called with ``donate=True`` (returned as its
first outputs, in that order), a tuple or a function of its bound keyword parameters. The program marks the
calls that may (:func:`meshtorch.lowering.donate.donate_inputs`); a backend holding several processors'
slices checks that no call writes a slice another call reads (:mod:`meshtorch.mesh.placement`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

__all__ = ["donatable_positions", "kernel_of"]


def kernel_of(fn: Callable) -> Callable:
    """The function under ``functools.partial`` layers (a kernel with its bound parameters)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def donatable_positions(fn: Callable) -> tuple[int, ...]:
    """Input positions a slicewise kernel may update in place when called with ``donate=True``: its ``donates``
    attribute, a tuple or a function of the kernel's bound keyword parameters (a multi-tensor update's positions
    depend on how many tensors it takes); ``()`` for other kernels. The program marks the calls that may
    (:func:`meshtorch.lowering.donate.donate_inputs`); the kernel's ``donate`` keyword is then True or a tuple
    of bools, one per position."""
    d = getattr(kernel_of(fn), "donates", ())
    if callable(d):
        return tuple(d(**fn.keywords)) if isinstance(fn, functools.partial) else ()
    return tuple(d)
