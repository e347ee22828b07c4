"""Generate ``tools/mtf_api_0.1.21.json``: mesh-tensorflow 0.1.21's public API as data.

Run once, by hand, on the unpacked wheel (pure Python; TensorFlow is never installed or imported):

    pip download --no-deps mesh-tensorflow==0.1.21 -d /tmp/mtf && (cd /tmp/mtf && unzip -o -q *.whl)
    python tools/gen_mtf_api.py /tmp/mtf/mesh_tensorflow > tools/mtf_api_0.1.21.json

The source text is read with :mod:`ast`: every module-level ``def`` / ``class`` whose name does not
start with ``_`` is public (``mtf`` star-imports ``ops.py``), with its parameter names, kinds and
default values (as source text). Classes are described by their ``__init__`` (without ``self``).
``EXCLUDED`` below marks names that are specific to TensorFlow or TPUs, or internal operation classes
(issue 15: "Internal operation classes need not be public"), each with its reason; the parity tool
(``tools/mtf_api_parity.py``) leaves them out of the coverage it reports.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

MODULES = {  # meshtorch module name -> source file(s) in the mesh_tensorflow package
    "mtf": ["ops.py"],
    "mtf.layers": ["layers.py"],
    "mtf.optimize": ["optimize.py"],
    "mtf.beam_search": ["beam_search.py"],
}

# ops_with_redefined_builtins.py: ``from mesh_tensorflow.ops import mtf_abs as abs`` etc.
BUILTIN_ALIASES = {"abs": "mtf_abs", "pow": "mtf_pow", "range": "mtf_range", "slice": "mtf_slice"}

TF = "specific to TensorFlow"
EXCLUDED = {
    "mtf": {
        "LazyAllreduceSum": "TF lowering internals: a lazily summed list of tf.Tensors (meshtorch keeps "
                            "pending sums inside Lowering: lw.get_lazy)",
        "compatible_lazy_allreduce_sums": "TF lowering internals (see LazyAllreduceSum)",
        "convert_args_to_laid_out_tensors": "TF lowering internals: wraps tf.Tensors as LaidOutTensors",
        "LazyLaidOutTensor": "TF lowering internals: a tf.Tensor slice list built on demand",
        "StackedVariable": "TPU optimisation: stacks tf.Variables to cut TPU variable count",
        "MtfCheckpointSaverListener": f"{TF}: tf.train.CheckpointSaverListener (use meshtorch.save)",
        "MtfRestoreHook": f"{TF}: tf.train.SessionRunHook (use meshtorch.restore)",
        "scalar_summary": f"{TF}: writes a tf.summary (fetch the tensor and log it instead)",
        "serialize_training_step": f"{TF}: orders tf ops with tf.control_dependencies; a meshtorch "
                                   "program is already a serial list of steps",
        "log_variable_sizes": f"{TF}: logs through tf.logging with TF variable-name regexes",
        "pnum_to_processor_coordinates_nd": "TPU-specific: coordinates from a TPU device_assignment",
        "processor_coordinates_to_pnum_map_nd": "TPU-specific: logical-to-physical map of a TPU device_assignment",
        "import_tf_tensor": None,  # kept: meshtorch's alias of import_tensor
    },
    "mtf.layers": {
        "summary_for_clip_activation_gradient": f"{TF}: writes tf.summary histograms",
        "attention_bias_local_2d_block": "cannot run in Mesh TF 0.1.21 either: it concatenates [w, memory_w] "
                                         "with [memory_h, memory_w] along memory_w (other dims differ)",
    },
    "mtf.optimize": {},
    "mtf.beam_search": {},
}
INTERNAL_OP = ("internal Operation subclass: the function that builds it is the API "
               "(issue 15: internal operation classes need not be public)")


def _default_text(node) -> str:
    return ast.unparse(node)


def _params(fn: ast.FunctionDef, drop_self: bool) -> list[dict]:
    a = fn.args
    out = []
    pos = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    for arg, d in zip(pos, defaults, strict=True):
        out.append({"name": arg.arg, "kind": "positional", **({} if d is None else {"default": _default_text(d)})})
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": "var_positional"})
    for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append({"name": arg.arg, "kind": "keyword_only", **({} if d is None else {"default": _default_text(d)})})
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": "var_keyword"})
    if drop_self and out and out[0]["name"] in ("self", "cls"):
        out = out[1:]
    return out


def _class_init(cls: ast.ClassDef, classes: dict) -> ast.FunctionDef | None:
    """The class's own ``__init__``, else the first one up its (same-module) base chain."""
    seen = set()
    while cls is not None and cls.name not in seen:
        seen.add(cls.name)
        for n in cls.body:
            if isinstance(n, ast.FunctionDef) and n.name == "__init__":
                return n
        bases = [b.id for b in cls.bases if isinstance(b, ast.Name)]
        cls = classes.get(bases[0]) if bases else None
    return None


def _is_operation(cls: ast.ClassDef, classes: dict) -> bool:
    seen = set()
    while cls is not None and cls.name not in seen:
        seen.add(cls.name)
        bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in cls.bases]
        if any(b in ("Operation", "mtf.Operation") for b in bases):
            return True
        cls = next((classes[b] for b in bases if b in classes), None)
    return False


def describe(path: Path, module: str) -> dict:
    tree = ast.parse(path.read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    api = {}
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and not n.name.startswith("_"):
            api[n.name] = {"kind": "function", "params": _params(n, drop_self=False)}
        elif isinstance(n, ast.ClassDef) and not n.name.startswith("_"):
            init = _class_init(n, classes)
            entry = {"kind": "class", "params": _params(init, drop_self=True) if init else []}
            if _is_operation(n, classes):
                entry["excluded"] = INTERNAL_OP
            api[n.name] = entry
        elif (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
              and isinstance(n.value, ast.Call) and ast.unparse(n.value.func) == "collections.namedtuple"):
            fields = [e.value for e in n.value.args[1].elts]
            api[n.targets[0].id] = {"kind": "class", "params": [{"name": f, "kind": "positional"} for f in fields]}
    return api


def main(pkg: str) -> None:
    pkg = Path(pkg)
    out = {"package": "mesh-tensorflow", "version": "0.1.21",
           "generated_by": "tools/gen_mtf_api.py (ast over the wheel's source text)", "modules": {}}
    for module, files in MODULES.items():
        api = {}
        for f in files:
            api.update(describe(pkg / f, module))
        if module == "mtf":
            for alias, target in BUILTIN_ALIASES.items():
                api[alias] = dict(api[target], alias_of=target)
        for name, reason in EXCLUDED[module].items():
            if reason is None:
                api[name].pop("excluded", None)
            else:
                api[name]["excluded"] = reason
        out["modules"][module] = dict(sorted(api.items()))
    # one API entry per line: small diffs, easy to read
    lines = ["{", f' "package": {json.dumps(out["package"])}, "version": {json.dumps(out["version"])},',
             f' "generated_by": {json.dumps(out["generated_by"])},', ' "modules": {']
    mods = list(out["modules"].items())
    for i, (module, api) in enumerate(mods):
        lines.append(f"  {json.dumps(module)}: {{")
        items = list(api.items())
        for j, (name, entry) in enumerate(items):
            lines.append(f"   {json.dumps(name)}: {json.dumps(entry)}" + ("," if j < len(items) - 1 else ""))
        lines.append("  }" + ("," if i < len(mods) - 1 else ""))
    lines += [" }", "}"]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
