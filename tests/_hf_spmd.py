"""Run inside the 4 gloo processes of tests/test_hf_spmd.py (and of tests/test_hf_t5_train.py: T5 fine-tuning,
:func:`t5_train_worker`): import a Hugging Face directory onto
SpmdMeshImpl (FSDP storage layout), count the elements each rank reads from the safetensors files,
compute logits, and export back to a Hugging Face directory."""

from __future__ import annotations

MESH = "data:2;model:2"
LAYOUT = "batch:data;heads:model;kv_heads:model;d_ff:model;vocab:model"
STORAGE = "d_model:data"


def worker(jobs, ids):
    return [_one(path, ids, out_dir) for path, out_dir in jobs]


def _one(path: str, ids, out_dir: str):
    import meshtorch as mtf
    from meshtorch.checkpoint import hf, hf_read

    counter = [0]
    orig = hf_read.BoxReader.read

    def counting(self, key, ranges):
        t = orig(self, key, ranges)
        counter[0] += t.numel()
        return t

    hf_read.BoxReader.read = counting
    try:
        impl = mtf.SpmdMeshImpl(MESH, LAYOUT, storage=STORAGE)
        model, lw = hf.load(path, impl, batch_size=ids.shape[0], length=ids.shape[1])
    finally:
        hf_read.BoxReader.read = orig
    held = 0
    for v in lw.variables:
        out = v.outputs[0]
        shape = impl.slice_shape(out.shape, lw.tensor_layout(out))
        n = 1
        for s in shape:
            n *= s
        held += n
    total = sum(v.outputs[0].shape.size for v in lw.variables)
    logits = lw.run(model.logits, feeds={model.inputs: ids, model.targets: ids}).clone()
    written = hf.export(lw, model, out_dir)
    return {"read": counter[0], "held": held, "total": total, "logits": logits, "written": written}


def t5_train_worker(*argvs):
    """``meshtorch train`` with each of ``argvs`` in turn (a T5 fine-tuning run, then e.g. its ``--resume``) on a
    gloo rank: per run (train losses, validation losses, what this rank printed on stdout and stderr)."""
    import contextlib
    import io

    from meshtorch.cli import build_parser

    out = []
    for argv in argvs:
        buf = io.StringIO()
        args = build_parser().parse_args(argv)
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            h = args.func(args)["history"]
        out.append((h["loss"], h["val_loss"], buf.getvalue()))
    return out
