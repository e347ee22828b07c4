"""Variable scopes and name scopes (TF1's ``tf.variable_scope`` / ``tf.name_scope`` as Mesh TF uses them).

Mesh TF names variables by the enclosing ``tf.variable_scope``s: inside
``with variable_scope("transformer"): with variable_scope("block_000/layer_000"):`` the call
``get_variable(mesh, "q", ...)`` creates ``transformer/block_000/layer_000/q``. Layer code ported
from Mesh TF therefore produces Mesh TF's variable (and checkpoint) names unchanged.

Semantics kept from TF1 / Mesh TF 0.1.21:

* ``variable_scope(name)`` appends ``name`` (which may itself contain ``/``) to the current scope;
  entering the same name twice reuses the same prefix (no uniquifying), as TF does.
* ``variable_scope(None, default_name="dense")`` picks ``dense``, ``dense_1``, ... : the first name
  not yet entered under the current scope (TF's ``default_name`` rule). The counters are process
  wide (TF's are per default graph); call :func:`reset_scope_counters` between unrelated graphs if
  the default names must restart at ``dense``.
* ``variable_scope(scope_object)`` re-enters a captured :class:`VariableScope` by its full name.
* ``mtf.get_variable`` returns the existing variable when the scoped name is already a variable
  of the graph (Mesh TF's ``graph.name_to_variable`` lookup), whatever ``reuse`` says;
  ``reuse`` is recorded for code that reads ``get_variable_scope().reuse``.
* ``name_scope(name)`` is accepted and tracked (``current_name_scope()``), but operation names are
  meshtorch's own (unique per graph, not prefixed): only variable names key checkpoints, and a
  prefixed operation could take the name a later variable needs. Porting note in the docs.

The scope stack is per thread.
"""

from __future__ import annotations

import contextlib
import functools
import threading

__all__ = ["VariableScope", "variable_scope", "get_variable_scope", "name_scope", "current_name_scope",
           "scoped_variable_name", "reset_scope_counters", "AUTO_REUSE"]

#: ``reuse=AUTO_REUSE`` (TF's ``tf.AUTO_REUSE``): create if missing, else reuse.
AUTO_REUSE = "auto_reuse"


class VariableScope:
    """A variable scope: its full ``name`` ("" at the top) and ``reuse`` flag (TF ``tf.VariableScope``)."""

    def __init__(self, name: str, reuse=None, custom_getter=None):
        self.name = name
        self.reuse = reuse
        #: ``custom_getter(getter, mesh, full_name, shape, **kwargs)`` wrapping variable creation (TF1), or None
        self.custom_getter = custom_getter
        #: name of the name scope opened with it (ops created inside are prefixed by it)
        self.original_name_scope = name + "/" if name else ""

    def __repr__(self):
        return f"VariableScope({self.name!r}, reuse={self.reuse!r})"


class _State(threading.local):
    def __init__(self):
        self.var_stack: list[VariableScope] = []
        self.name_stack: list[str] = []
        self.counters: dict[str, int] = {}


_STATE = _State()


def get_variable_scope() -> VariableScope:
    """The innermost variable scope (``name == ""`` outside every scope). TF ``tf.get_variable_scope``."""
    if _STATE.var_stack:
        return _STATE.var_stack[-1]
    return VariableScope("")


def current_name_scope() -> str:
    """The current name-scope prefix ("" or ``"a/b"``)."""
    return _STATE.name_stack[-1] if _STATE.name_stack else ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def scoped_variable_name(name: str) -> str:
    """``name`` prefixed by the current variable scope (how ``get_variable`` names a variable)."""
    return _join(get_variable_scope().name, name)


def reset_scope_counters() -> None:
    """Forget which default names were used (TF does this when the default graph is reset)."""
    _STATE.counters.clear()


def _unique_default(parent: str, default_name: str) -> str:
    key = _join(parent, default_name)
    n = _STATE.counters.get(key, 0)
    _STATE.counters[key] = n + 1
    return default_name if n == 0 else f"{default_name}_{n}"


@contextlib.contextmanager
def variable_scope(name_or_scope=None, default_name: str | None = None, values=None, reuse=None, custom_getter=None,
                   **unused_kwargs):
    """Context manager naming the variables created inside it (TF1 ``tf.variable_scope``, as Mesh TF uses it).

    Args:
        name_or_scope: a string appended to the current scope, a captured :class:`VariableScope`
            (re-entered by its full name), or None to use ``default_name``.
        default_name: used (made unique: ``dense``, ``dense_1``, ...) when ``name_or_scope`` is None.
        values: ignored (TF uses it to find the graph).
        reuse: True, :data:`AUTO_REUSE` or None (inherit). ``mtf.get_variable`` returns an existing
            variable of the same full name in every case, as Mesh TF does.
        custom_getter: TF1's ``custom_getter``: ``get_variable`` inside the scope returns
            ``custom_getter(getter, mesh, full_name, shape, dtype=..., initializer=..., trainable=...)``
            instead of the variable, where ``getter`` (same arguments) creates or finds the variable. Nested
            scopes inherit it; a nested scope's own getter wraps the outer one (TF1 composes them).
            meshtorch's pipelined layer stacks use it to stack each layer's weights on a ``stage`` dim.
        **unused_kwargs: TF's other arguments (initializer, dtype, ...) are accepted and ignored.

    Yields:
        the entered :class:`VariableScope`.

    Raises:
        ValueError: if both ``name_or_scope`` and ``default_name`` are None.
    """
    del values, unused_kwargs
    parent = get_variable_scope()
    if isinstance(name_or_scope, VariableScope):
        full = name_or_scope.name
    elif name_or_scope is not None:
        name = str(name_or_scope)
        full = _join(parent.name, name) if name else parent.name
    elif default_name is not None:
        full = _join(parent.name, _unique_default(parent.name, default_name))
    else:
        raise ValueError("variable_scope: give a name (or a VariableScope) or a default_name.")
    getter = parent.custom_getter
    if custom_getter is not None:
        getter = custom_getter if getter is None else functools.partial(_compose_getters, custom_getter, getter)
    scope = VariableScope(full, reuse if reuse is not None else parent.reuse, getter)
    _STATE.var_stack.append(scope)
    _STATE.name_stack.append(full)
    try:
        yield scope
    finally:
        _STATE.name_stack.pop()
        _STATE.var_stack.pop()


def _compose_getters(inner, outer, getter, *args, **kwargs):
    """``inner``'s view of variable creation is ``outer`` wrapping ``getter`` (TF1's nesting of custom getters)."""
    return inner(functools.partial(outer, getter), *args, **kwargs)


@contextlib.contextmanager
def name_scope(name: str | None, default_name: str | None = None, values=None):
    """Context manager for a name scope (TF ``tf.name_scope``): tracked, not applied to op names.

    Variables are not affected (TF: ``tf.get_variable`` ignores name scopes either). Operation
    names stay meshtorch's unique names (see the module docstring). ``name=None`` uses
    ``default_name``; an empty name resets to the top level.

    Yields:
        the new name-scope prefix (a string).
    """
    del values
    name = name if name is not None else default_name
    full = "" if not name else _join(current_name_scope(), name.rstrip("/"))
    _STATE.name_stack.append(full)
    try:
        yield full
    finally:
        _STATE.name_stack.pop()
