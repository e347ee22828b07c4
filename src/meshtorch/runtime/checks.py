"""Checks of command-line inputs, run by every command before it loads data or builds a model.

Each check raises :class:`~meshtorch.core.errors.UsageError` (exit status 2) naming the flag, the
value and what to give instead, so that a bad input costs seconds, never a training run.
"""

from __future__ import annotations

import math
import os
import tempfile

import torch

from meshtorch.core.dims import Shape
from meshtorch.core.errors import LayoutError, UsageError
from meshtorch.core.layout import LayoutRules, check_rules_strict
from meshtorch.core.pipeline import resolve_pipeline_fields


def number(flag: str, value, minimum=None, maximum=None, min_inclusive: bool = True, max_inclusive: bool = True):
    """``value`` if it is finite and within the bounds, else UsageError naming ``flag``."""
    if value is None:
        return value
    if not math.isfinite(value):
        raise UsageError(f"{flag} must be a finite number, got {value}.")
    if minimum is not None and (value < minimum if min_inclusive else value <= minimum):
        rel = ">=" if min_inclusive else ">"
        raise UsageError(f"{flag} must be {rel} {minimum}, got {value}.")
    if maximum is not None and (value > maximum if max_inclusive else value >= maximum):
        rel = "<=" if max_inclusive else "<"
        raise UsageError(f"{flag} must be {rel} {maximum}, got {value}.")
    return value


def positive(flag: str, value):
    """``value`` (int or float) if finite and > 0."""
    return number(flag, value, 0, min_inclusive=False)


def non_negative(flag: str, value):
    """``value`` if finite and >= 0."""
    return number(flag, value, 0)


def fraction(flag: str, value):
    """``value`` in ``[0, 1)`` (a dropout rate)."""
    return number(flag, value, 0, 1, max_inclusive=False)


def writable_dir(flag: str, path: str) -> str:
    """Create directory ``path`` (and parents) and check that a file can be written in it.

    Raises:
        UsageError: naming ``flag`` and the path, if it cannot be created or written.
    """
    if not path:
        return path
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".meshtorch-write-check-"):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path!r}: cannot create or write this directory ({e.strerror or e}); "
                         "give a writable path.") from None
    return path


def writable_file(flag: str, path: str) -> str:
    """Check that file ``path`` can be written: its directory is created and writable, it is not a directory."""
    if not path:
        return path
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a directory; give a file path.")
    writable_dir(flag, os.path.dirname(path) or ".")
    return path


def mesh_shape(flag: str, text: str) -> Shape:
    """The mesh shape of ``text`` (``"data:2,model:2"``; ``""`` = one processor).

    Raises:
        UsageError: naming ``flag`` and the entry, if an entry is not ``name:size`` with a positive integer
            size or a name repeats.
    """
    dims = []
    for part in [p for p in text.replace(";", ",").replace(" ", ",").split(",") if p]:
        name, sep, size = part.partition(":")
        if not sep or not name.strip():
            raise UsageError(f"{flag}: entry {part!r} is not of the form axis_name:size, e.g. \"data:2,model:2\".")
        try:
            n = int(size)
        except ValueError:
            n = None
        if n is None or n < 1:
            raise UsageError(f"{flag}: the size of mesh axis {name.strip()!r} must be a positive integer, "
                             f"got {size!r}.")
        dims.append((name.strip(), n))
    names = [d for d, _ in dims]
    if len(set(names)) != len(names):
        raise UsageError(f"{flag}: mesh axis names repeat in {text!r}.")
    return Shape(dims)


def mesh_fits_world(flag: str, text: str, shape: Shape, world: int) -> None:
    """Under torchrun (``world`` > 1 processes) each process holds one processor of the mesh, so the mesh
    ``shape`` (parsed from ``text``) must have ``world`` processors (as
    :class:`~meshtorch.mesh.spmd.SpmdMeshImpl` requires); one process simulates any mesh.

    Raises:
        UsageError: naming ``flag``, both counts and the two ways out.
    """
    if world > 1 and shape.size != world:
        raise UsageError(f"{flag} {text!r} has {shape.size} processor(s) but torchrun started {world} processes "
                         f"(WORLD_SIZE); launch {shape.size} (torchrun --nproc-per-node {shape.size}) or give a mesh "
                         f"of {world} processors.")


def device(flag: str, name: str | None) -> str | None:
    """``name`` (``"cpu"``, ``"cuda"``, ``"cuda:<index>"`` or None) if this torch can use it, else UsageError
    naming ``flag`` (CUDA unavailable: a CPU-only build of torch, or no GPU visible)."""
    if name is None or name == "cpu":
        return name
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"{flag} {name}: CUDA is not available here (torch {torch.__version__}, built for CUDA "
                             f"{torch.version.cuda or 'none'}; no GPU visible); use {flag} cpu or install a CUDA "
                             "build of torch.")
        idx = name.removeprefix("cuda").removeprefix(":")
        if idx and (not idx.isdigit() or int(idx) >= torch.cuda.device_count()):
            raise UsageError(f"{flag} {name}: there are {torch.cuda.device_count()} visible GPUs (cuda:0 .. "
                             f"cuda:{torch.cuda.device_count() - 1}).")
        return name
    raise UsageError(f"{flag} {name!r}: give cpu, cuda (every visible GPU) or cuda:<index>.")


def layout_rules(flag: str, text: str, dim_names, mesh: Shape) -> LayoutRules:
    """Layout rules of ``text``, each naming a dimension of the model and an axis of ``mesh`` (strict).

    Raises:
        LayoutError: naming ``flag`` and the rule, listing the model's dimensions and the mesh's axes.
    """
    try:
        rules = LayoutRules(text or "")
    except LayoutError as e:
        raise LayoutError(f"{flag}: {e}") from None
    return check_rules_strict(rules, dim_names, mesh, flag=flag)


def graph_dim_names(graph) -> set[str]:
    """Names of every dimension of every tensor in ``graph``."""
    names = set()
    for op in graph.operations:
        for t in list(op.inputs) + list(op.outputs):
            names.update(d.name for d in t.shape)
    return names


def input_files(flag: str, paths) -> list[str]:
    """Files of ``paths``: a directory stands for the ``.txt``/``.md``/``.rst`` files in it (sorted).

    Raises:
        UsageError: naming ``flag`` and the path, if it does not exist or a directory holds no text file.
    """
    out = []
    for p in paths or []:
        if os.path.isdir(p):
            files = sorted(os.path.join(p, f) for f in os.listdir(p)
                           if f.lower().endswith((".txt", ".md", ".rst")) and os.path.isfile(os.path.join(p, f)))
            if not files:
                raise UsageError(f"{flag} {p!r} is a directory without .txt, .md or .rst files; give text files "
                                 "or a directory holding them.")
            out += files
        elif not os.path.exists(p):
            raise UsageError(f"{flag}: text file {p!r} does not exist.")
        else:
            out.append(p)
    return out


#: a loss this many times the first step's is taken as divergence (healthy training never grows it so)
EXPLODED_FACTOR = 1000.0


def divergence(loss: float, first_loss: float | None) -> str | None:
    """Why ``loss`` means the run diverged: non-finite, or over :data:`EXPLODED_FACTOR` times the first
    step's loss ``first_loss`` (a cross-entropy starts near its maximum useful value); None if it is fine."""
    if not math.isfinite(loss):
        return f"the loss is {loss}"
    if first_loss is not None and first_loss > 0 and loss > EXPLODED_FACTOR * first_loss:
        return f"the loss is {loss:.4g}, over {EXPLODED_FACTOR:g} times the first step's {first_loss:.4g}"
    return None


def step_dirs(checkpoint_dir: str) -> list[str]:
    """``ckpt-<step>`` directories of ``checkpoint_dir``, newest first (complete or not)."""
    names = [d for d in os.listdir(checkpoint_dir) if d.startswith("ckpt-") and d[5:].isdigit()]
    return [os.path.join(checkpoint_dir, d) for d in sorted(names, key=lambda d: -int(d[5:]))]


def pipeline_fields(layout: str, mesh: Shape, stages: int | None, microbatches: int | None, repeats: int | None,
                    num_layers: int, batch_size: int, layers_flag: str = "--layers") -> dict:
    """``LMConfig``'s pipeline fields from ``--pipeline-stages``, ``--microbatches``, ``--pipeline-repeats`` and the
    layout (None: a flag not given).

    The defaults are :func:`meshtorch.core.pipeline.resolve_pipeline_fields`' (stages: the size of the mesh axis
    the layout maps ``stage`` to, no pipeline when it names none; microbatches: the stages; repeats:
    ``num_layers / stages``); this function checks the result. ``layers_flag``: where ``num_layers`` comes from
    (``--layers``, or an imported model's config.json).

    Returns:
        ``{"pipeline_stages": S, "microbatches": M, "pipeline_repeats": R}`` (S = 0: no pipeline).

    Raises:
        UsageError: naming the flag: a count below 1; ``--microbatches`` / ``--pipeline-repeats`` without a pipeline;
            stages not a multiple of the ``stage`` mesh axis; ``--layers`` other than stages x repeats; a batch
            size that ``--microbatches`` does not divide, or microbatches that the ``batch`` mesh axis does not;
            fewer microbatches than stages with repeats.
    """
    for flag, v in (("--pipeline-stages", stages), ("--microbatches", microbatches), ("--pipeline-repeats", repeats)):
        if v is not None:
            number(flag, v, 1)
    try:
        rules = {} if layout == "auto" else dict(LayoutRules(layout or "").pairs)  # auto: chosen later
    except LayoutError as e:
        raise LayoutError(f"--layout: {e}") from None

    def axis_size(dim):
        a = rules.get(dim)
        return mesh.get_dim_by_name(a).size if a is not None and a in mesh.dimension_names else 1

    axis, n = rules.get("stage"), axis_size("stage")
    pipe = resolve_pipeline_fields(n, stages, microbatches, repeats, num_layers)
    if not pipe:
        if (microbatches or 1) > 1 or (repeats or 1) > 1:
            raise UsageError("--microbatches / --pipeline-repeats need a pipeline: add 'stage:<mesh axis>' to --layout "
                             "or give --pipeline-stages > 1.")
        return {"pipeline_stages": 0, "microbatches": 1, "pipeline_repeats": 1}
    stages, microbatches, repeats = pipe["pipeline_stages"], pipe["microbatches"], pipe["pipeline_repeats"]
    if stages % n:
        raise UsageError(f"--pipeline-stages {stages} must be a multiple of the size {n} of mesh axis {axis!r} (the "
                         f"layout's 'stage:{axis}').")
    if num_layers != stages * repeats:
        raise UsageError(f"{layers_flag} {num_layers} must equal --pipeline-stages {stages} x --pipeline-repeats "
                         f"{repeats}; change {layers_flag}, the stage mesh axis or --pipeline-repeats.")
    if batch_size % microbatches:
        raise UsageError(f"--microbatches {microbatches} must divide --batch-size {batch_size}.")
    if (batch_size // microbatches) % axis_size("batch"):
        raise UsageError(f"--microbatches {microbatches}: each microbatch's {batch_size // microbatches} sequences "
                         f"must split over mesh axis {rules['batch']!r} ({axis_size('batch')}, the layout's "
                         f"'batch:{rules['batch']}'); use fewer microbatches or a larger --batch-size.")
    if repeats > 1 and microbatches < stages:
        raise UsageError(f"--microbatches {microbatches} must be >= --pipeline-stages {stages} with "
                         "--pipeline-repeats > 1 (circular schedule).")
    return {"pipeline_stages": stages, "microbatches": microbatches, "pipeline_repeats": repeats}
