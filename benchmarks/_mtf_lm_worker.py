"""Mesh TensorFlow side of ``benchmarks/vs_mesh_tensorflow.py``; runs under the Mesh TF venv's python.

Not importable from meshtorch's venv (it imports TensorFlow 2.12 and mesh-tensorflow 0.1.21; see
``benchmarks/mtf_venv.sh``). The parent starts one worker per (thread count, mesh, layout) and talks
JSON lines over stdin/stdout:

    parent -> {"cfg": {...}, "mesh_shape": "all:4", "layout": "batch:all", "threads": 1,
               "inter_op": 1, "ids": [[...], ...],           (ids: int [batch, length + 1])
               "init": "/tmp/.../init.npz"}   (optional: initial values by variable name; else random)
    worker -> {"params": N, "build_s": s, "tf": "2.12.1", "mtf": "0.1.21"}
    parent -> {"steps": k}
    worker -> {"times": [s, ...], "losses": [nats, ...]}      (one session.run per step)
    parent -> {"gemm": [[m, k, n], ...], "repeats": 10}     (optional: tf.matmul float32 GEMM rates)
    worker -> {"flops": [median FLOP/s per shape]}            (same thread settings as the LM's session)
    parent -> {"quit": true}   (or EOF)

The model is a hand-written Mesh TF LM with the same structure, parameters and FLOPs as meshtorch's
``meshtorch.models.transformer.build_lm`` (mtf.transformer itself needs tensorflow-datasets, which
the pinned venv does not have): gather embedding [vocab, d_model] + position embedding
[length, d_model]; per layer pre-norm RMS norm (scale [d_model], eps 1e-6) -> attention with
q/k/v [d_model, heads, d_kv] and o [heads, d_kv, d_model], logits scaled by d_kv^-0.5, causal
mask ``mtf.layers.attention_mask_autoregressive`` -> residual; RMS norm -> ``mtf.layers.dense``
wi [d_model, d_ff] (no bias, relu) -> wo [d_ff, d_model] -> residual; final RMS norm; logits
[d_model, vocab] without bias; ``mtf.layers.softmax_cross_entropy_with_logits`` against a one-hot
target, mean over batch and length. ``mtf.optimize.AdafactorOptimizer()`` with its defaults; the
global step is incremented in the same run, as Mesh TF's own training loop does
(``transformer/utils.py``). No dropout, no clipping. Graph mode through ``tf.compat.v1.Session``.
"""

import json
import os
import sys
import time
from importlib.metadata import version

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf


def _protocol_out():
    """A private copy of stdout for the protocol; fd 1 then points at stderr so TF's prints cannot corrupt it."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


_INIT = {}  # variable name -> initial value (numpy), when the parent sent meshtorch's initial weights


def _init(name, default):
    """``tf.constant_initializer`` of the parent's value for ``name`` if one was sent, else ``default``."""
    return tf.constant_initializer(_INIT[name]) if _INIT else default


def _rms_norm(x, d_model, name):
    scale = mtf.get_variable(x.mesh, name + "/scale", [d_model],
                             initializer=_init(name + "/scale", tf.ones_initializer()))
    ms = mtf.reduce_mean(mtf.square(x), reduced_dim=d_model)
    return x * mtf.rsqrt(ms + 1e-6) * scale


def _attention(x, d, name):
    """Causal multi-head self-attention with meshtorch's variable shapes (no biases)."""
    d_model, heads, d_kv = d["d_model"], d["heads"], d["d_kv"]
    init = tf.random_normal_initializer(stddev=d_model.size ** -0.5)
    wq, wk, wv = (mtf.get_variable(x.mesh, f"{name}/{p}", [d_model, heads, d_kv],
                                   initializer=_init(f"{name}/{p}", init)) for p in "qkv")
    wo = mtf.get_variable(x.mesh, f"{name}/o", [heads, d_kv, d_model], initializer=_init(
        f"{name}/o", tf.random_normal_initializer(stddev=(heads.size * d_kv.size) ** -0.5)))
    qkv_shape = [d["batch"], d["length"], heads, d_kv]
    mem_shape = [d["batch"], d["memory_length"], heads, d_kv]
    q = mtf.einsum([x, wq], output_shape=qkv_shape)
    mem = mtf.rename_dimension(x, "length", "memory_length")
    k = mtf.einsum([mem, wk], output_shape=mem_shape)
    v = mtf.einsum([mem, wv], output_shape=mem_shape)
    logits = mtf.einsum([q, k], output_shape=[d["batch"], heads, d["length"], d["memory_length"]])
    logits = logits * (d_kv.size ** -0.5)
    pos = mtf.range(x.mesh, d["length"], tf.int32)
    logits += mtf.layers.attention_mask_autoregressive(pos, dtype=logits.dtype)
    weights = mtf.softmax(logits, d["memory_length"])
    o = mtf.einsum([weights, v], output_shape=qkv_shape)
    return mtf.einsum([o, wo], output_shape=x.shape)


def build(msg):
    """Build graph, lowering, session; return (session, fetches, feed_dict, parameter count)."""
    c = msg["cfg"]
    tf.set_random_seed(0)
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    d = {k: mtf.Dimension(k, c[v]) for k, v in (
        ("batch", "batch_size"), ("length", "length"), ("memory_length", "length"), ("d_model", "d_model"),
        ("heads", "num_heads"), ("d_kv", "d_kv"), ("d_ff", "d_ff"), ("vocab", "vocab"))}
    ids = np.asarray(msg["ids"], dtype=np.int32)
    _INIT.clear()
    if msg.get("init"):
        with np.load(msg["init"]) as z:
            _INIT.update({k: z[k] for k in z.files})
    tf_in = tf.placeholder(tf.int32, [c["batch_size"], c["length"]], name="inputs")
    tf_tg = tf.placeholder(tf.int32, [c["batch_size"], c["length"]], name="targets")
    inputs = mtf.import_tf_tensor(mesh, tf_in, mtf.Shape([d["batch"], d["length"]]))
    targets = mtf.import_tf_tensor(mesh, tf_tg, mtf.Shape([d["batch"], d["length"]]))
    emb = mtf.get_variable(mesh, "embedding", [d["vocab"], d["d_model"]],
                           initializer=_init("embedding", tf.random_normal_initializer(stddev=1.0)))
    pos = mtf.get_variable(mesh, "pos_embedding", [d["length"], d["d_model"]],
                           initializer=_init("pos_embedding", tf.random_normal_initializer(stddev=0.02)))
    x = mtf.gather(emb, inputs, d["vocab"]) + pos
    for i in range(c["num_layers"]):
        h = _rms_norm(x, d["d_model"], f"layer_{i}/attention_norm")
        x = x + _attention(h, d, f"layer_{i}/attention")
        h = _rms_norm(x, d["d_model"], f"layer_{i}/ffn_norm")
        h = mtf.layers.dense(h, d["d_ff"], reduced_dims=[d["d_model"]], use_bias=False, activation=mtf.relu,
                             kernel_initializer=_init(f"layer_{i}/ffn/wi/kernel", None), name=f"layer_{i}/ffn/wi")
        x = x + mtf.layers.dense(h, d["d_model"], reduced_dims=[d["d_ff"]], use_bias=False,
                                 kernel_initializer=_init(f"layer_{i}/ffn/wo/kernel", None), name=f"layer_{i}/ffn/wo")
    x = _rms_norm(x, d["d_model"], "final_norm")
    logits = mtf.layers.dense(x, d["vocab"], reduced_dims=[d["d_model"]], use_bias=False,
                              kernel_initializer=_init("logits/kernel", None), name="logits")
    soft = mtf.one_hot(targets, d["vocab"], dtype=logits.dtype)
    loss = mtf.reduce_mean(mtf.layers.softmax_cross_entropy_with_logits(logits, soft, d["vocab"]))
    variables = graph.trainable_variables
    if _INIT and sorted(_INIT) != sorted(v.name for v in variables):
        raise ValueError(f"initial values for {sorted(set(_INIT) ^ {v.name for v in variables})} do not match "
                         "the Mesh TF model's variables")
    params = int(sum(v.outputs[0].shape.size for v in variables))
    grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
    update_ops = mtf.optimize.AdafactorOptimizer().apply_grads(grads, variables)

    shape = mtf.convert_to_shape(msg["mesh_shape"])
    layout = mtf.convert_to_layout_rules(msg["layout"])
    mesh_impl = mtf.placement_mesh_impl.PlacementMeshImpl(shape, layout, [""] * max(1, shape.size))
    lowering = mtf.Lowering(graph, {mesh: mesh_impl})
    global_step = tf.train.get_or_create_global_step()
    tf_loss = lowering.export_to_tf_tensor(loss)
    tf_updates = [lowering.lowered_operation(op) for op in update_ops]
    tf_updates.append(tf.assign_add(global_step, 1))
    train_op = tf.group(tf_updates)
    config = tf.ConfigProto(intra_op_parallelism_threads=msg["threads"],
                            inter_op_parallelism_threads=msg["inter_op"],
                            allow_soft_placement=True)
    init, copy = tf.global_variables_initializer(), lowering.copy_masters_to_slices()
    sess = tf.Session(config=config)
    sess.run(init)
    sess.run(copy)
    feed = {tf_in: ids[:, :-1], tf_tg: ids[:, 1:]}
    return sess, [tf_loss, train_op], feed, params


def gemm_rates(shapes, repeats, threads, inter_op):
    """Median float32 ``tf.matmul`` FLOP/s of each ``[m, k, n]`` (operands in variables; the product's op
    is run, not fetched, so no copy to numpy is timed)."""
    rates = []
    rng = np.random.default_rng(0)
    for m, k, n in shapes:
        with tf.Graph().as_default():
            a = tf.Variable(rng.standard_normal((m, k), dtype=np.float32))
            b = tf.Variable(rng.standard_normal((k, n), dtype=np.float32))
            prod = tf.matmul(a, b).op
            config = tf.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=inter_op)
            with tf.Session(config=config) as sess:
                sess.run(tf.global_variables_initializer())
                sess.run(prod)
                ts = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    sess.run(prod)
                    ts.append(time.perf_counter() - t0)
        rates.append(2.0 * m * k * n / float(np.median(ts)))
    return rates


def main():
    out = _protocol_out()
    tf.disable_v2_behavior()
    sess, threads = None, (1, 1)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("quit"):
            break
        if "cfg" in msg:
            t0 = time.perf_counter()
            sess, fetches, feed, params = build(msg)
            threads = (msg["threads"], msg["inter_op"])
            reply = {"params": params, "build_s": time.perf_counter() - t0, "tf": version("tensorflow-cpu"),
                     "mtf": version("mesh-tensorflow")}
        elif "gemm" in msg:
            reply = {"flops": gemm_rates(msg["gemm"], int(msg.get("repeats", 10)), *threads)}
        else:
            times, losses = [], []
            for _ in range(int(msg["steps"])):
                t0 = time.perf_counter()
                loss, _ = sess.run(fetches, feed_dict=feed)
                times.append(time.perf_counter() - t0)
                losses.append(float(loss))
            reply = {"times": times, "losses": losses}
        out.write(json.dumps(reply) + "\n")
    if sess is not None:
        sess.close()


if __name__ == "__main__":
    main()
