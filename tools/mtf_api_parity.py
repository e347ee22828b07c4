"""Compare meshtorch's public API with mesh-tensorflow 0.1.21's, kept as data in ``tools/mtf_api_0.1.21.json``.

    python tools/mtf_api_parity.py            # coverage per module and every missing name with its reason
    python tools/mtf_api_parity.py --json     # the same as JSON

A Mesh TF name counts as present when meshtorch's module has it and its signature is compatible
(``inspect.signature``): the same positional parameter names in the same order; every extra
meshtorch parameter has a default; every Mesh TF default is a default here too, equal to it when
Mesh TF's is a Python literal (``0.0``, ``None``, ``'name'``; a TF expression such as ``tf.float32``
only needs some default; so does ``name``, whose default only names the op);
``*args`` and keyword-only parameters are accepted where Mesh TF accepts them (Mesh TF's
``**kwargs`` are forwarded to TensorFlow functions; meshtorch names the ones it supports instead).
Names the data marks ``excluded`` (TensorFlow- or TPU-specific, internal operation classes) are
listed with their reason and left out of the coverage. TensorFlow is never imported.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import sys
from pathlib import Path

API_FILE = Path(__file__).with_name("mtf_api_0.1.21.json")
MESHTORCH_MODULE = {"mtf": "meshtorch", "mtf.layers": "meshtorch.layers", "mtf.optimize": "meshtorch.optimize",
                    "mtf.beam_search": "meshtorch.beam_search"}
_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)


def load_api(path: Path = API_FILE) -> dict:
    return json.loads(Path(path).read_text())


def _literal(text: str):
    """(True, value) if Mesh TF's default is a Python literal, else (False, None)."""
    try:
        return True, ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return False, None


def signature_problems(obj, params: list[dict]) -> list[str]:
    """Why ``obj``'s signature is not compatible with Mesh TF's ``params`` (empty list: compatible)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError) as e:
        return [f"no inspectable signature ({e})"]
    ours = list(sig.parameters.values())
    our_pos = [p for p in ours if p.kind in _POSITIONAL]
    by_name = {p.name: p for p in ours}
    has_var = any(p.kind == _P.VAR_POSITIONAL for p in ours)
    has_kw = any(p.kind == _P.VAR_KEYWORD for p in ours)
    problems = []
    theirs_pos = [p for p in params if p["kind"] == "positional"]
    got = [p.name for p in our_pos[:len(theirs_pos)]]
    want = [p["name"] for p in theirs_pos]
    if got != want:
        problems.append(f"positional parameters {got} != Mesh TF's {want}")
    for p in our_pos[len(theirs_pos):]:
        if p.default is _P.empty:
            problems.append(f"extra parameter {p.name!r} has no default")
    for p in ours:
        if p.kind == _P.KEYWORD_ONLY and p.default is _P.empty and p.name not in {q["name"] for q in params}:
            problems.append(f"extra keyword-only parameter {p.name!r} has no default")
    for q in params:
        if q["kind"] == "var_positional":
            if not has_var:
                problems.append(f"Mesh TF takes *{q['name']}")
            continue
        if q["kind"] == "var_keyword":  # forwarded to a TF function: meshtorch names what it supports
            continue
        mine = by_name.get(q["name"])
        if mine is None or mine.kind == _P.POSITIONAL_ONLY:
            if not has_kw:
                problems.append(f"parameter {q['name']!r} missing")
            continue
        if "default" in q:
            if mine.default is _P.empty:
                problems.append(f"{q['name']!r} has no default (Mesh TF: {q['default']})")
                continue
            is_lit, value = _literal(q["default"])
            if is_lit and q["name"] != "name" and not _same_default(mine.default, value):
                problems.append(f"{q['name']!r} defaults to {mine.default!r}, Mesh TF to {q['default']}")
    return problems


def _same_default(ours, theirs) -> bool:
    if isinstance(theirs, bool) or isinstance(ours, bool):
        return ours is theirs or (type(ours) is type(theirs) and ours == theirs)
    if isinstance(theirs, int | float) and isinstance(ours, int | float):
        return float(ours) == float(theirs)
    if isinstance(theirs, list | tuple) and isinstance(ours, list | tuple):
        return list(ours) == list(theirs)
    return ours == theirs


def compare(api: dict | None = None) -> dict:
    """Per Mesh TF module: ``{"total", "present", "coverage", "missing": {name: reason}, "excluded": {...}}``."""
    api = api or load_api()
    report = {}
    for module, names in api["modules"].items():
        try:
            ours = importlib.import_module(MESHTORCH_MODULE[module])
        except ImportError as e:
            ours, why = None, f"module {MESHTORCH_MODULE[module]} missing ({e})"
        missing, excluded, present = {}, {}, []
        for name, entry in names.items():
            if "excluded" in entry:
                excluded[name] = entry["excluded"]
                continue
            obj = getattr(ours, name, None) if ours is not None else None
            if ours is None:
                missing[name] = why
            elif obj is None:
                missing[name] = f"absent from {MESHTORCH_MODULE[module]}"
            elif not callable(obj):
                missing[name] = f"{MESHTORCH_MODULE[module]}.{name} is not callable"
            else:
                problems = signature_problems(obj, entry["params"])
                if problems:
                    missing[name] = "signature: " + "; ".join(problems)
                else:
                    present.append(name)
        total = len(present) + len(missing)
        report[module] = {"total": total, "present": len(present), "coverage": len(present) / total if total else 1.0,
                          "present_names": present, "missing": missing, "excluded": excluded}
    return report


def format_report(report: dict, show_excluded: bool = True) -> str:
    lines = []
    for module, r in report.items():
        lines.append(f"{module}: {r['present']}/{r['total']} = {100 * r['coverage']:.1f}% "
                     f"({len(r['excluded'])} excluded)")
    for module, r in report.items():
        if r["missing"]:
            lines.append(f"\nmissing in {module}:")
            lines += [f"  {n}: {why}" for n, why in r["missing"].items()]
    if show_excluded:
        for module, r in report.items():
            if r["excluded"]:
                lines.append(f"\nexcluded from {module} (not counted):")
                lines += [f"  {n}: {why}" for n, why in r["excluded"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--no-excluded", action="store_true", help="do not list the excluded names")
    args = ap.parse_args(argv)
    report = compare()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report, show_excluded=not args.no_excluded))
    return 0


if __name__ == "__main__":
    sys.exit(main())
