"""A CPU emulation of attnlib's cuDNN graphs: `implementation="cudnn"` runs end to end without a GPU.

attnlib's cuDNN wrapper (support policy, graph specs, operand layout, trimmed lengths, zero-filling, masking of rows,
custom VJP) runs for real; only the built graph is replaced, through the injection points of `attnlib.Cudnn`: an
`EmulatedExecutor` (a stand-in built graph, `entry_for`, and a plain-JAX graph call) as its `executor`, and an H200
with a given cuDNN version as its `device`.

- `emulate`: a plain-JAX dense cuDNN SDPA graph with padding lengths. It never writes rows past `seq_len_q` (O, dQ)
  or `seq_len_kv` (dK, dV), so those rows hold zeros when the wrapper asked for them to be zero-filled and NaN
  otherwise, and rows that see no key come out NaN (0 / 0), the worst a real kernel could do.
- `emulate_graph`: any graph attnlib builds for the 16-bit paths: ragged (THD / packed rows) and paged graphs through
  `test_cudnn_ragged.emulate`, score-modifier graphs through `test_score_mod_emulated.emulate`, dense ones through
  `emulate`. It does not model cuDNN's dropout (its generator is cuDNN's own).
- `emulated_cudnn(graph, ...)`: an `attnlib.Cudnn` running `graph` (pass it as `implementation=`).
- `install(monkeypatch, ...)`: the same, and the name `"cudnn"` (and automatic dispatch) standing for it in one test.

What this cannot show is that cuDNN behaves like the model: the GPU suites check that.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from test_cudnn_ragged import _mask, emulate as emulate_ragged, softmax_rows

import attnlib
from attnlib._src import dispatch
from attnlib._src.backends.cudnn import cache, support
from attnlib._src.backends.cudnn.graphs import GraphSpec, Uid


def _unwritten(x: jax.Array, rows: int, lengths: jax.Array, zero_filled: bool, seq_kv: jax.Array | None = None):
    """`x` `[b, rows, ...]` with the rows at or past `lengths` as the kernel leaves them: zero-filled by a memset, or
    (`seq_kv` given: a graph without the memset) written as zeros by the kernel except in batch elements without
    keys, which it skips (NaN), or else never written (NaN)."""
    expand = lambda m: m.reshape(m.shape + (1,) * (x.ndim - m.ndim))
    keep = expand(jnp.arange(rows)[None, :] < lengths[:, None])
    if zero_filled:
        return jnp.where(keep, x, 0.0)
    if seq_kv is None:
        return jnp.where(keep, x, jnp.nan)
    return jnp.where(expand(seq_kv[:, None] > 0), jnp.where(keep, x, 0.0), jnp.nan)


def emulate(spec: GraphSpec, entry, *operands, tokens=None):
    """A plain-JAX dense cuDNN SDPA graph, in `spec.out_uids()` order."""
    del entry, tokens
    vals = dict(zip(spec.in_uids(), operands))
    b, t, s, g = spec.b, spec.t, spec.s, spec.n // spec.k
    seq_q = vals.get(Uid.SEQ_Q, jnp.full((b,), t, jnp.int32))
    seq_kv = vals.get(Uid.SEQ_KV, jnp.full((b,), s, jnp.int32))
    heads_first = lambda x: jnp.transpose(x.astype(jnp.float32), (0, 2, 1, 3))
    q = heads_first(vals[Uid.Q])
    k = jnp.repeat(heads_first(vals[Uid.K]), g, axis=1)
    v = jnp.repeat(heads_first(vals[Uid.V]), g, axis=1)
    # a runtime scale (`spec.scale` None) is the float32 [1] operand `Uid.ATTN_SCALE`
    scale = spec.scale if spec.scale is not None else vals[Uid.ATTN_SCALE][0]
    logits = jnp.einsum("bnih,bnjh->bnij", q, k, precision="highest") * scale
    if spec.bias_b:
        logits = logits + vals[Uid.BIAS].astype(jnp.float32)
    mask = _mask(spec, seq_q, seq_kv)
    logits = jnp.where(mask, logits, -jnp.inf)
    filled = {spec.out_uids()[i] for i in spec.zero_fill()}
    # attnlib relies on cuDNN's zeros only for top-left padded graphs without the memset; elsewhere: never written.
    kernel_zeros = seq_kv if spec.rows_by_length and not spec.memset_rows else None
    rows_first = lambda x: jnp.transpose(x, (0, 2, 1, 3))
    if spec.direction == "fwd":
        o, stats = softmax_rows(logits, v, vals.get(Uid.SINK))
        out = _unwritten(rows_first(o), t, seq_q, Uid.O in filled, kernel_zeros).astype(spec.dtype)
        rows = jnp.arange(t)[None, None, :] < seq_q[:, None, None]
        stats = jnp.where(rows, stats, jnp.nan)
        if spec.row_max:  # cuDNN's score_max and score_sum_exp instead of Stats
            top = jnp.max(logits, axis=-1)
            sum_exp = jnp.sum(jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)[..., None]), axis=-1)
            return out, jnp.where(rows, top, jnp.nan), jnp.where(rows, sum_exp, jnp.nan)
        return (out, stats) if spec.stats else (out,)
    o, do = heads_first(vals[Uid.O]), heads_first(vals[Uid.DO])
    p = jnp.where(mask, jnp.exp(logits - vals[Uid.STATS][..., None]), 0.0)
    dp = jnp.einsum("bnih,bnjh->bnij", do, v, precision="highest")
    d_logits = p * (dp - jnp.sum(do * o, axis=-1, keepdims=True))
    dq = jnp.einsum("bnij,bnjh->bnih", d_logits, k, precision="highest") * scale
    dk = jnp.einsum("bnij,bnih->bnjh", d_logits, q, precision="highest") * scale
    dv = jnp.einsum("bnij,bnih->bnjh", p, do, precision="highest")
    fold = lambda x: rows_first(jnp.sum(jnp.reshape(x, (b, spec.k, g) + x.shape[2:]), axis=2))
    grads = [
        _unwritten(rows_first(dq), t, seq_q, Uid.DQ in filled, kernel_zeros),
        _unwritten(fold(dk), s, seq_kv, Uid.DK in filled, kernel_zeros),
        _unwritten(fold(dv), s, seq_kv, Uid.DV in filled, kernel_zeros),
    ]
    if spec.bias_b:
        dbias = jnp.sum(d_logits, axis=(0,), keepdims=True) if spec.bias_b == 1 else d_logits
        grads.append(jnp.sum(dbias, axis=1, keepdims=True) if spec.bias_n == 1 else dbias)
    return tuple(x.astype(spec.dtype) for x in grads)


def entry_for(spec: GraphSpec) -> cache.GraphEntry:
    """A stand-in built graph (the emulator needs only the spec)."""
    return cache.GraphEntry(
        blob=b"{}", workspace_bytes=0, in_uids=tuple(map(int, spec.in_uids())),
        out_uids=tuple(map(int, spec.out_uids())), zero_fill=spec.zero_fill(), label=spec.label,
    )  # fmt: skip


def emulate_graph(spec: GraphSpec, entry, *operands, tokens=None):
    """Any 16-bit graph of attnlib's cuDNN paths (dense, score modifier, ragged, paged), in `spec.out_uids()` order."""
    if spec.ragged or spec.pages:
        return emulate_ragged(spec, list(operands), tokens)
    if spec.modifier is not None:
        from test_score_mod_emulated import emulate as emulate_modifier  # imports this module: not at the top

        return emulate_modifier(spec, entry, *operands, tokens=tokens)
    return emulate(spec, entry, *operands, tokens=tokens)[: len(spec.out_uids())]  # no dBias without `bias_grad`


@dataclasses.dataclass(frozen=True)
class EmulatedExecutor:
    """A graph executor (`attnlib.Cudnn(executor=...)`) that builds nothing: `get_entry` is `entry` (default
    `entry_for`) and `call` runs `graph` (an `ffi_graph_call` stand-in: `(spec, entry, *operands, tokens=None)`)."""

    graph: Callable = emulate
    entry: Callable = entry_for

    def get_entry(self, spec: GraphSpec) -> cache.GraphEntry:
        return self.entry(spec)

    def call(self, spec: GraphSpec, entry, *operands, tokens=None):
        return self.graph(spec, entry, *operands, tokens=tokens)


def h200(version: int = 91900, capability: tuple[int, int] = (9, 0)) -> support.Device:
    """An H200 (or a GPU of `capability`) with cuDNN `version` as `attnlib.Cudnn(device=...)` takes it."""
    return support.Device(compute_capability=capability, name="NVIDIA H200", cudnn_version=version)


def emulated_cudnn(
    graph: Callable = emulate, *, version: int = 91900, capability: tuple[int, int] = (9, 0), entry=entry_for, **fields
) -> attnlib.Cudnn:
    """`attnlib.Cudnn` running `graph` as on an H200 with cuDNN `version` (9.19 writes zeros in padded rows itself;
    with a cuDNN not known to, attnlib zero-fills them first: `support.writes_padding_zeros`); `fields` are its other
    options (`ragged_stats=...`)."""
    return attnlib.Cudnn(executor=EmulatedExecutor(graph, entry), device=h200(version, capability), **fields)


def install(monkeypatch, graph: Callable = emulate, **options) -> attnlib.Cudnn:
    """`emulated_cudnn(graph, **options)`, which the name `"cudnn"` (and automatic dispatch) stands for until the
    test ends; returned for tests that pass it as `implementation=` themselves."""
    cudnn = emulated_cudnn(graph, **options)
    monkeypatch.setitem(dispatch.REGISTRY, "cudnn", lambda: cudnn)
    return cudnn
