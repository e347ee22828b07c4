"""Kernels and plain data: what a program step may hold, and its JSON form.

A step's local computation is a *kernel*: a module-level function, or a ``functools.partial`` of
one whose bound arguments are plain data (None, bool, int, float, str, lists/tuples/dicts of them,
``torch.dtype``, small ``torch.Tensor`` constants, ``slice``, and references to other kernels or
torch functions). Because a kernel is named by ``module:qualname`` and its arguments are data, a
program can be written to JSON and read back, by another process, with nothing else shared.

:func:`to_data` / :func:`from_data` convert such values to and from JSON-compatible structures
(``to_data`` raises :class:`NotDataError` saying why a callable is not a kernel).
"""

from __future__ import annotations

import functools
import importlib
import math

import torch

from meshtorch.core.errors import MeshtorchError

_TORCH_NAMESPACES = ("torch", "torch.nn.functional", "torch.special", "torch.linalg", "torch.Tensor")


class NotDataError(MeshtorchError):
    """A program step holds something that is not plain data (e.g. a lambda), so it cannot be serialised."""


def _resolve(ref: str):
    module, _, qualname = ref.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def function_ref(fn) -> str | None:
    """``"module:qualname"`` naming the module-level function ``fn``, or None if it has no such name."""
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if not qual or "<" in qual:
        return None
    candidates = [getattr(fn, "__module__", None)] + list(_TORCH_NAMESPACES)
    for mod in candidates:
        if not mod:
            continue
        for q in (qual, qual.rsplit(".", 1)[-1]):
            ref = f"{mod}:{q}"
            try:
                if _resolve(ref) is fn:
                    return ref
            except (ImportError, AttributeError):
                continue
    return None


def to_data(x):
    """A JSON-compatible form of plain data ``x`` (see the module docstring).

    Raises:
        NotDataError: naming what is not plain data.
    """
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"__float__": repr(x)}
    if isinstance(x, list):
        return [to_data(v) for v in x]
    if isinstance(x, tuple):
        return {"__tuple__": [to_data(v) for v in x]}
    if isinstance(x, dict):
        if not all(isinstance(k, str) for k in x):
            raise NotDataError(f"a dict with non-string keys {list(x)[:3]} is not plain data")
        return {"__dict__": {k: to_data(v) for k, v in x.items()}}
    if isinstance(x, torch.dtype):
        return {"__dtype__": str(x).replace("torch.", "")}
    if isinstance(x, torch.Size):
        return {"__tuple__": list(x)}
    if isinstance(x, slice):
        return {"__slice__": [to_data(x.start), to_data(x.stop), to_data(x.step)]}
    if isinstance(x, torch.Tensor):
        return {"__tensor__": to_data(x.detach().cpu().tolist()), "dtype": to_data(x.dtype)}
    if isinstance(x, functools.partial):
        return {"__partial__": to_data(x.func), "args": [to_data(a) for a in x.args],
                "kwargs": {k: to_data(v) for k, v in x.keywords.items()}}
    if callable(x):
        ref = function_ref(x)
        if ref is None:
            raise NotDataError(f"{x!r} is a lambda or a nested function (closure); a kernel must be a module-level "
                               "function or a functools.partial of one with plain-data arguments")
        return {"__fn__": ref}
    raise NotDataError(f"{type(x).__name__} value {x!r} is not plain data")


def from_data(x):
    """Inverse of :func:`to_data`."""
    if isinstance(x, list):
        return [from_data(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__float__" in x:
        return float(x["__float__"])
    if "__tuple__" in x:
        return tuple(from_data(v) for v in x["__tuple__"])
    if "__dict__" in x:
        return {k: from_data(v) for k, v in x["__dict__"].items()}
    if "__dtype__" in x:
        return getattr(torch, x["__dtype__"])
    if "__slice__" in x:
        return slice(*[from_data(v) for v in x["__slice__"]])
    if "__tensor__" in x:
        return torch.tensor(from_data(x["__tensor__"]), dtype=from_data(x["dtype"]))
    if "__partial__" in x:
        return functools.partial(from_data(x["__partial__"]), *[from_data(a) for a in x["args"]],
                                 **{k: from_data(v) for k, v in x["kwargs"].items()})
    if "__fn__" in x:
        return _resolve(x["__fn__"])
    raise ValueError(f"from_data: unknown record {sorted(x)}")
