"""Interchange with plain PyTorch: variables <-> a ``state_dict`` of full tensors.

Name mapping (``name_map``), one entry per meshtorch variable name:

* absent ``name_map`` (None): every variable, torch name = the variable name with ``/`` -> ``.``,
  full tensor with the variable's dims in declared order;
* ``"torch.name"``: that torch name, dims in the variable's order;
* ``("torch.name", "pattern")``: that name and the torch tensor's layout written as the variable's
  dim names in torch order, parentheses merging dims (row-major, like einops): for a dense kernel
  ``w1 [rows, cols, hidden]`` the ``nn.Linear`` weight ``[out, in]`` is ``"hidden (rows cols)"``;
* ``None``: skip the variable (e.g. optimizer slots).

With a ``name_map``, only the variables it names (with a non-None value) are exported or loaded.
"""

from __future__ import annotations

import re

import torch

from meshtorch.core.errors import CheckpointError

__all__ = ["to_torch_state_dict", "from_torch_state_dict"]

_TOKEN = re.compile(r"\(|\)|[^\s()]+")


def _parse_pattern(pattern: str, var_name: str, dims: list[str]) -> list[list[str]]:
    """``"hidden (rows cols)"`` -> ``[["hidden"], ["rows", "cols"]]``; checks each dim appears once."""
    groups, cur = [], None
    for tok in _TOKEN.findall(pattern):
        if tok == "(":
            if cur is not None:
                raise CheckpointError(f"name_map for variable {var_name!r}: nested '(' in pattern {pattern!r}.")
            cur = []
        elif tok == ")":
            if cur is None:
                raise CheckpointError(f"name_map for variable {var_name!r}: unmatched ')' in pattern {pattern!r}.")
            groups.append(cur)
            cur = None
        elif cur is not None:
            cur.append(tok)
        else:
            groups.append([tok])
    if cur is not None:
        raise CheckpointError(f"name_map for variable {var_name!r}: unclosed '(' in pattern {pattern!r}.")
    flat = [n for g in groups for n in g]
    if sorted(flat) != sorted(dims):
        raise CheckpointError(f"name_map for variable {var_name!r}: pattern {pattern!r} must name each of the "
                              f"variable's dims {dims} exactly once.")
    return groups


def _entries(lowering, name_map, trainable_only: bool = False) -> list:
    """``[(variable op, torch name, groups or None)]`` for the variables in scope."""
    out = []
    if name_map is None:
        for var in lowering.variables:
            if trainable_only and not var.trainable:
                continue
            out.append((var, var.name.replace("/", "."), None))
        return out
    by_name = {v.name: v for v in lowering.variables}
    for vname, spec in name_map.items():
        if vname not in by_name:
            raise CheckpointError(f"name_map names variable {vname!r}, which the graph does not declare "
                                  f"(it has {sorted(by_name)[:8]}).")
        if spec is None:
            continue
        var = by_name[vname]
        dims = [d.name for d in var.outputs[0].shape]
        if isinstance(spec, str):
            out.append((var, spec, None))
        else:
            tname, pattern = spec
            out.append((var, tname, _parse_pattern(pattern, vname, dims)))
    return out


def _torch_shape(var, groups) -> list[int]:
    shape = var.outputs[0].shape
    if groups is None:
        return shape.to_integer_list()
    sizes = []
    for g in groups:
        n = 1
        for d in g:
            n *= shape.get_dim_by_name(d).size
        sizes.append(n)
    return sizes


def to_torch_state_dict(lowering, name_map: dict | None = None,
                        trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """``{torch name: full tensor}`` of the lowering's variables (see the module doc for ``name_map``).

    ``trainable_only`` (with the default naming) leaves out optimizer slots and step counters, so
    the result loads into the equivalent ``nn.Module`` with ``strict=True``.

    Each value is the variable's full logical tensor (gathered from its slices), permuted and
    reshaped as the name map says, on the CPU, contiguous. Ready for ``nn.Module.load_state_dict``.

    Raises:
        CheckpointError: if ``name_map`` names an unknown variable or has a malformed pattern, or two
            variables map to one torch name.
    """
    sd = {}
    for var, tname, groups in _entries(lowering, name_map, trainable_only):
        if tname in sd:
            raise CheckpointError(f"to_torch_state_dict: two variables map to torch name {tname!r} "
                                  f"(the second is {var.name!r}).")
        full = lowering.variable_value(var).detach().to("cpu")
        if groups is not None:
            names = [d.name for d in var.outputs[0].shape]
            perm = [names.index(d) for g in groups for d in g]
            full = full.permute(perm).reshape(_torch_shape(var, groups))
        sd[tname] = full.contiguous().clone()
    return sd


def from_torch_state_dict(lowering, state_dict: dict, name_map: dict | None = None, strict: bool = True,
                          trainable_only: bool = False) -> dict:
    """Set the lowering's variables from a torch ``state_dict`` of full tensors (inverse of
    :func:`to_torch_state_dict` with the same ``name_map``).

    Each tensor is reshaped/permuted back to the variable's dims, cast to its dtype and sliced
    onto the variable's processors.

    Args:
        strict: if True, every variable in scope must have its torch name in ``state_dict`` and
            every key of ``state_dict`` must be used.
        trainable_only: with the default naming, leave optimizer slots and step counters as they are.

    Returns:
        ``{"loaded": [...], "missing": [...], "unexpected": [...]}`` (variable names; torch keys).

    Raises:
        CheckpointError: naming the variable and torch key, on a shape mismatch; on a missing or
            unexpected key when ``strict``.
    """
    entries = _entries(lowering, name_map, trainable_only)
    used = {tname for _, tname, _ in entries}
    missing = [v.name for v, tname, _ in entries if tname not in state_dict]
    unexpected = sorted(k for k in state_dict if k not in used)
    if strict and (missing or unexpected):
        raise CheckpointError(f"from_torch_state_dict: variables {missing} have no tensor in the state dict "
                              f"(torch names {[t for v, t, _ in entries if v.name in missing]}); unexpected keys "
                              f"{unexpected}. Pass strict=False to load what matches.")
    loaded = []
    for var, tname, groups in entries:
        if tname not in state_dict:
            continue
        t = torch.as_tensor(state_dict[tname]).detach()
        want = _torch_shape(var, groups)
        if list(t.shape) != want:
            raise CheckpointError(f"from_torch_state_dict: torch tensor {tname!r} has shape {list(t.shape)} but "
                                  f"variable {var.name!r} {var.outputs[0].shape} maps to shape {want}.")
        if groups is not None:
            flat = [d for g in groups for d in g]
            shape = var.outputs[0].shape
            t = t.reshape([shape.get_dim_by_name(d).size for d in flat])
            names = [d.name for d in shape]
            t = t.permute([flat.index(n) for n in names])
        lowering.set_variable_value(var, t.to("cpu").contiguous())
        loaded.append(var.name)
    return {"loaded": loaded, "missing": missing, "unexpected": unexpected}
