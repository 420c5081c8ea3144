"""Which result rows does a cuDNN SDPA graph leave unwritten? (H200 probe; decides where attnlib must zero-fill.)

Usage: python benchmarks/probe_unwritten_rows.py [--json out.json]

attnlib zero-fills results before a graph runs wherever cuDNN may leave rows unwritten (a memset of the whole
result). Whether cuDNN writes a row itself decides whether that memset is needed, so this probe runs attnlib's own
graphs (the blobs it embeds, deserialized by the frontend's Python API) on result buffers filled with NaN and reports,
per kind of row, whether the rows kept the NaN (unwritten), became 0 (written as zero), or hold other values:
- dense padding lengths: O and dQ rows past `seq_len_q`, dK / dV rows past `seq_len_kv`, O rows of a batch element
  with `seq_len_kv = 0`;
- THD: O rows past the last sequence, O rows of a sequence with `seq_len_kv = 0` (a "dummy" sequence covering
  padding rows could make the memset unnecessary if cuDNN writes zeros there), dQ / dK / dV rows past the last
  sequence, and the padded Stats rows.
"""

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cudnn import deserialized  # noqa: E402


def _run(spec, operands: dict, results: dict) -> None:
    """Execute the graph attnlib builds for `spec` on the given device buffers (results pre-filled by the caller)."""
    from cuda.bindings import runtime as cudart

    from attnlib._src.backends.cudnn import executor as cudnn_attention

    entry = cudnn_attention.get_entry(spec)
    graph, handle = deserialized(entry)
    workspace = jnp.zeros((max(entry.workspace_bytes, 1),), jnp.uint8)
    jax.block_until_ready((operands, results, workspace))
    pack = {int(uid): x.unsafe_buffer_pointer() for uid, x in {**operands, **results}.items()}
    graph.execute(pack, workspace.unsafe_buffer_pointer(), handle=handle)
    cudart.cudaDeviceSynchronize()


def _state(x: jax.Array) -> str:
    """'unwritten' (all NaN), 'zero' (all 0), 'values' (finite, not all 0), or 'mixed'."""
    a = np.asarray(x, np.float32)
    if a.size == 0:
        return "empty"
    if np.isnan(a).all():
        return "unwritten"
    if (a == 0).all():
        return "zero"
    if np.isfinite(a).all():
        return "values"
    return "mixed"


def _nan(shape, dtype) -> jax.Array:
    return jnp.full(shape, jnp.nan, dtype)


def dense_padding() -> dict:
    from attnlib._src.backends.cudnn.graphs import GraphSpec, Uid

    b, t, n, h = 6, 256, 4, 64
    # elements 3..5: no query rows (what attnlib's trimmed lengths give a sequence without keys) with 0, 1, 100 keys
    seq_q = jnp.asarray([200, 77, 256, 0, 0, 0], jnp.int32)
    seq_kv = jnp.asarray([180, 0, 256, 0, 1, 100], jnp.int32)
    fwd = GraphSpec("fwd", "bfloat16", b, t, t, n, n, h, h, 0.125, padding=True, right_bound=0)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (b, t, n, h), jnp.float32).astype(jnp.bfloat16) for key in keys)
    o, stats = _nan((b, t, n, h), jnp.bfloat16), _nan((b, n, t), jnp.float32)
    _run(fwd, {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.SEQ_Q: seq_q, Uid.SEQ_KV: seq_kv}, {Uid.O: o, Uid.STATS: stats})
    report = {
        "O rows past seq_len_q": _state(o[0, 200:]),
        "O rows of a batch element with seq_len_kv = 0": _state(o[1, :77]),
        "O rows below seq_len_q": _state(o[2]),
        "Stats rows past seq_len_q": _state(stats[0, :, 200:]),
        "O rows, seq_len_q = 0 and seq_len_kv = 0": _state(o[3]),
        "O rows, seq_len_q = 0 and seq_len_kv = 1": _state(o[4]),
        "O rows, seq_len_q = 0 and seq_len_kv = 100": _state(o[5]),
    }
    bwd = GraphSpec("bwd", "bfloat16", b, t, t, n, n, h, h, 0.125, padding=True, right_bound=0)
    stats_for_bwd = jnp.where(jnp.isfinite(stats), stats, 0.0)
    o_for_bwd = jnp.where(jnp.isnan(o), 0, o)
    dq, dk, dv = (_nan((b, t, n, h), jnp.bfloat16) for _ in range(3))
    _run(bwd, {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: o_for_bwd, Uid.DO: do, Uid.STATS: stats_for_bwd,
               Uid.SEQ_Q: seq_q, Uid.SEQ_KV: seq_kv}, {Uid.DQ: dq, Uid.DK: dk, Uid.DV: dv})  # fmt: skip
    report.update({
        "dQ rows past seq_len_q": _state(dq[0, 200:]),
        "dK rows past seq_len_kv": _state(dk[0, 180:]),
        "dV rows past seq_len_kv": _state(dv[0, 180:]),
        "dQ rows of a batch element with seq_len_kv = 0": _state(dq[1, :77]),
        "dK rows of a batch element with seq_len_kv = 0": _state(dk[1]),
        "dQ, dK, dV rows, seq_len_q = 0 and seq_len_kv = 0": _state(jnp.stack([dq[3], dk[3], dv[3]])),
        "dQ, dK, dV rows, seq_len_q = 0 and seq_len_kv = 1": _state(jnp.stack([dq[4], dk[4], dv[4]])),
        "dQ, dK, dV rows, seq_len_q = 0 and seq_len_kv = 100": _state(jnp.stack([dq[5], dk[5], dv[5]])),
    })  # fmt: skip
    return report


def thd() -> dict:
    from attnlib._src.backends.cudnn import ragged
    from attnlib._src.backends.cudnn.graphs import GraphSpec, Uid

    n, h, tokens, bound = 4, 64, 600, 256
    # sequences: 200 rows, 150 rows, then a "dummy" sequence of 100 query rows with no keys, then one of 50 keys
    # without query rows; query rows 450.. and key rows 400.. belong to none
    starts_q = jnp.asarray([0, 200, 350, 450, 450, 450, 450, 450, 450], jnp.int32)
    starts_kv = jnp.asarray([0, 200, 350, 350, 400, 400, 400, 400, 400], jnp.int32)
    seq_q = jnp.asarray([200, 150, 100, 0, 0, 0, 0, 0], jnp.int32)
    seq_kv = jnp.asarray([200, 150, 0, 50, 0, 0, 0, 0], jnp.int32)
    offsets = {uid: ragged.element_offsets(starts_q, n, h) for uid in (Uid.OFF_Q, Uid.OFF_O)}
    offsets.update({uid: ragged.element_offsets(starts_kv, n, h) for uid in (Uid.OFF_K, Uid.OFF_V)})
    common = dict(padding=True, right_bound=0, ragged=True)
    fwd = GraphSpec("fwd", "bfloat16", 8, bound, bound, n, n, h, h, 0.125, **common)
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, do = (jax.random.normal(key, (tokens, n, h), jnp.float32).astype(jnp.bfloat16) for key in keys)
    o, stats = _nan((tokens, n, h), jnp.bfloat16), _nan((8, n, bound), jnp.float32)
    _run(fwd, {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.SEQ_Q: seq_q, Uid.SEQ_KV: seq_kv, **offsets},
         {Uid.O: o, Uid.STATS: stats})  # fmt: skip
    report = {
        "O rows of the sequences": _state(o[:350]),
        "O rows of a sequence with seq_len_kv = 0": _state(o[350:450]),
        "O rows past the last sequence": _state(o[450:]),
        "Stats rows past a sequence's length (padded layout)": _state(stats[1, :, 150:]),
    }
    bwd = GraphSpec("bwd", "bfloat16", 8, bound, bound, n, n, h, h, 0.125, t_total=1024, s_total=1024, **common)
    stats_for_bwd = jnp.where(jnp.isfinite(stats), stats, 0.0)
    o_for_bwd = jnp.where(jnp.isnan(o), 0, o)
    dq, dk, dv = (_nan((tokens, n, h), jnp.bfloat16) for _ in range(3))
    _run(bwd, {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: o_for_bwd, Uid.DO: do, Uid.STATS: stats_for_bwd,
               Uid.SEQ_Q: seq_q, Uid.SEQ_KV: seq_kv, **offsets}, {Uid.DQ: dq, Uid.DK: dk, Uid.DV: dv})  # fmt: skip
    report.update({
        "dQ rows of the sequences": _state(dq[:350]),
        "dQ rows of a sequence with seq_len_kv = 0": _state(dq[350:450]),
        "dQ rows past the last sequence": _state(dq[450:]),
        "dK, dV rows of a sequence with seq_len_q = 0": _state(jnp.stack([dk[350:400], dv[350:400]])),
        "dK rows past the last sequence": _state(dk[400:]),
        "dV rows past the last sequence": _state(dv[400:]),
    })  # fmt: skip
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    results = {}
    for name, probe in (("dense padding", dense_padding), ("THD", thd)):
        try:
            results[name] = probe()
        except Exception as e:  # reported, never hidden
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        for row, state in results[name].items():
            print(f"{name:14s} {row:55s} {state}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
