"""CPU tests of the cuDNN ragged (THD / packed rows) and paged paths, without a GPU.

- Bucketing and the support policy are pure Python.
- The on-device sequence metadata (`ragged.thd_batch`, `ragged.segment_batch`) is checked against the masking rule
  of `positions.py`: the key tokens each query token sees through cuDNN's ragged batch must be exactly the ones the
  `xla` reference lets it see.
- The whole wrapper (offsets, virtual slicing, masking of rows, lse gather, custom VJP, sinks, NaN on overflow,
  paged decode and the gradient rules) runs end to end with the graph call replaced by `emulate`, a plain-JAX model
  of a cuDNN SDPA graph that reads and writes the packed buffers through the *element* offsets exactly as cuDNN
  does, and writes NaN into rows a real kernel may leave undefined (so the wrapper's masking is exercised). What this
  cannot show is that cuDNN itself behaves like the model: `test_cudnn_ragged_gpu.py` checks that on the GPU.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import attnlib
from attnlib._src import logs, positions
from attnlib._src.backends.cudnn import autotune, cache, executor, graph_spec, ragged, row_fill, support, varlen
from attnlib._src.backends.cudnn.graphs import GraphSpec, Uid
from attnlib._src.config import AttentionConfig


# ------------------------------------------------------------------------------------------------------------------
# bucketing


def test_bucket_sequences():
    assert [ragged.bucket_sequences(n) for n in (0, 1, 8, 9, 16, 17, 300, 512, 513, 1025)] == [
        8, 8, 8, 16, 16, 32, 512, 512, 1024, 1536,
    ]


def test_bucket_length_and_tokens():
    assert [ragged.bucket_length(n) for n in (1, 64, 65, 4096, 4097)] == [64, 64, 128, 4096, 8192]
    assert [ragged.bucket_tokens(n) for n in (1, 1024, 1025, 32768, 32769)] == [1024, 1024, 2048, 32768, 65536]


def test_random_training_lengths_build_few_graph_shapes():
    """200 steps of 32k-token batches with lengths 64..4096: the (bucketed) graph keys stay few."""
    rng = np.random.default_rng(0)
    keys = set()
    for _ in range(200):
        total, lengths = 0, []
        while total < 32768:
            n = int(min(rng.integers(64, 4097), 32768 - total))
            lengths.append(n)
            total += n
        keys.add((ragged.bucket_sequences(len(lengths)), ragged.bucket_length(4096), ragged.bucket_tokens(32768)))
    assert len(keys) <= 3, keys


# ------------------------------------------------------------------------------------------------------------------
# policy


BASE = AttentionConfig(
    layout="thd", batch_shape=(), unbatched=False, q_len=512, kv_len=512, num_q_heads=8, num_kv_heads=2,
    head_dim=128, value_head_dim=128, dtype=np.dtype(ml_dtypes.bfloat16), scale=0.125, is_causal=True,
    diagonal_alignment="top_left", window=None, bias_shape=None, mask_shape=None, has_q_lengths=False,
    has_kv_lengths=False, has_segments=False, max_segments_per_row=None, num_sequences=4, max_seqlen_q=512,
    max_seqlen_kv=512, page_size=None, pages_per_seq=None, num_pages=None, logits_soft_cap=None, has_sinks=False,
    dropout_rate=0.0, return_residual=False, deterministic_backward=False,
)  # fmt: skip
SEGMENTS = dataclasses.replace(BASE, layout="dense", batch_shape=(2,), num_sequences=None, max_seqlen_q=None,
                               max_seqlen_kv=None, has_segments=True, max_segments_per_row=8)  # fmt: skip
PAGED = dataclasses.replace(BASE, layout="paged", batch_shape=(4,), q_len=1, kv_len=1024, num_sequences=4,
                            max_seqlen_q=None, max_seqlen_kv=None, page_size=64, pages_per_seq=16, num_pages=64,
                            has_kv_lengths=True, diagonal_alignment="bottom_right")  # fmt: skip


def _reason(config, capability=(9, 0), version=91900):
    return support.policy_reason(config, capability, version)


@pytest.mark.parametrize(
    "config",
    [
        BASE,
        dataclasses.replace(BASE, diagonal_alignment="bottom_right"),
        dataclasses.replace(BASE, window=(32, 0)),
        dataclasses.replace(BASE, is_causal=False, window=(16, 8)),
        dataclasses.replace(BASE, head_dim=192),
        dataclasses.replace(BASE, has_sinks=True),
        dataclasses.replace(BASE, dropout_rate=0.1),
        dataclasses.replace(BASE, q_len=1, max_seqlen_q=1, has_sinks=True),  # graph dims are bucketed to >= 64
        SEGMENTS,
        dataclasses.replace(SEGMENTS, has_q_lengths=True, diagonal_alignment="bottom_right"),
        PAGED,
        dataclasses.replace(PAGED, q_len=64, head_dim=192),
        dataclasses.replace(PAGED, is_causal=False, window=(100, 0)),
    ],
    ids=["thd", "thd_bottom_right", "thd_window", "thd_two_sided", "thd_mla", "thd_sinks", "thd_dropout",
         "thd_decode_sinks", "segments", "segments_lengths_bottom_right", "paged_decode", "paged_prefill_mla",
         "paged_window"],
)  # fmt: skip
def test_served_on_hopper(config):
    assert _reason(config) is None


def test_packed_rows_without_a_bound_are_served():
    assert _reason(dataclasses.replace(SEGMENTS, max_segments_per_row=None)) is None


@pytest.mark.parametrize(
    "config,match",
    [
        (dataclasses.replace(BASE, bias_shape=(8, 512, 512)), "`bias` with THD"),
        (dataclasses.replace(SEGMENTS, bias_shape=(8, 512, 512)), "`bias` with packed rows"),
        (dataclasses.replace(BASE, is_causal=False, window=(4, 4), diagonal_alignment="bottom_right"), "right <= 0"),
        (dataclasses.replace(BASE, diagonal_alignment="bottom_right", dropout_rate=0.1), "dropout"),
        (dataclasses.replace(BASE, q_len=1 << 22, kv_len=1 << 22), "2**31"),
        (dataclasses.replace(PAGED, has_sinks=True), "`sinks` with a paged"),
        (dataclasses.replace(PAGED, dropout_rate=0.1), "dropout with a paged"),
        (dataclasses.replace(PAGED, bias_shape=(1, 1024)), "`bias` with a paged"),
        (dataclasses.replace(PAGED, q_len=2048), "T <= pages_per_seq * page_size"),
        (dataclasses.replace(PAGED, has_kv_lengths=False), "`key_value_seq_lengths`"),
    ],
    ids=["thd_bias", "segments_bias", "bottom_right_right_window", "bottom_right_dropout",
         "offset_overflow", "paged_sinks", "paged_dropout", "paged_bias", "paged_t_gt_s", "paged_no_lengths"],
)  # fmt: skip
def test_declined_with_reason(config, match):
    reason = _reason(config)
    assert reason is not None and match in reason, reason
    assert reason.startswith("cudnn: ") and reason.endswith(".")


def test_version_gates():
    assert "9.6" in _reason(BASE, (9, 0), 90500)
    assert "9.5" in _reason(PAGED, (9, 0), 90400)
    assert "compute capability 9.0" in _reason(BASE, (8, 0), 91800)
    assert _reason(BASE, (8, 0), 91900) is None
    assert "deterministic" in _reason(dataclasses.replace(BASE, deterministic_backward=True), (8, 9), 91900)


def test_ragged_graph_specs():
    """THD graphs: offsets per packed tensor, packed results fixed after the graph (or zero-filled before it), no
    sink in the backward."""
    config = dataclasses.replace(BASE, has_sinks=True, max_seqlen_q=300, max_seqlen_kv=700)
    plan = varlen.make_ragged_plan(config, 5, (300, 700), (1000, 1500), ragged_stats="padded")
    fwd, bwd = plan.fwd, plan.bwd
    assert (fwd.b, fwd.t, fwd.s) == (8, 512, 1024) and fwd.ragged and fwd.sinks and not bwd.sinks
    assert (bwd.t_total, bwd.s_total) == (1024, 2048)
    assert fwd.in_uids() == (Uid.Q, Uid.K, Uid.V, Uid.OFF_Q, Uid.OFF_K, Uid.OFF_V, Uid.OFF_O, Uid.SEQ_Q, Uid.SEQ_KV,
                             Uid.SINK)  # fmt: skip
    assert fwd.zero_fill() == () and bwd.zero_fill() == ()  # rows outside the sequences: `row_fill` afterwards
    with_memset = lambda spec: dataclasses.replace(spec, memset_rows=True)
    assert with_memset(fwd).zero_fill() == () and with_memset(bwd).zero_fill() == ()  # a dense-only fallback
    assert fwd.shape(Uid.O, (1000, 1500)) == ((1000, 8, 128), "bfloat16")
    assert fwd.shape(Uid.OFF_K, (1000, 1500)) == ((9, 2), "int32")
    assert graph_spec.graph_data_type(Uid.OFF_K, fwd) == "int64"
    assert fwd.shape(Uid.STATS, (1000, 1500)) == ((8, 8, 512), "float32")
    dims, strides = graph_spec._layout(Uid.Q, fwd)
    assert dims == [8, 8, 512, 128] and strides == [512 * 8 * 128, 128, 8 * 128, 1]


def test_ragged_stats_graph_specs():
    """With per-token statistics forced (`attnlib.Cudnn(ragged_stats="per_token")`), Stats are `[Tq, N]` per token,
    bound through their own element offsets."""
    plan = varlen.make_ragged_plan(BASE, 5, (300, 700), (1000, 1500), ragged_stats="per_token")
    fwd, bwd = plan.fwd, plan.bwd
    assert fwd.ragged_stats and bwd.ragged_stats
    assert Uid.OFF_STATS in fwd.in_uids() and Uid.OFF_STATS in bwd.in_uids()
    assert Uid.OFF_STATS not in dataclasses.replace(fwd, stats=False).in_uids()
    assert fwd.shape(Uid.STATS, (1000, 1500)) == ((1000, 8), "float32")
    assert fwd.shape(Uid.OFF_STATS, (1000, 1500)) == ((9, 2), "int32")
    assert graph_spec.graph_data_type(Uid.OFF_STATS, fwd) == "int64"
    dims, strides = graph_spec._layout(Uid.STATS, fwd)
    assert dims == [8, 8, 512, 1] and strides == [8 * 512, 1, 8, 1]  # token-major: the N stats of a token together
    timed = {uid: (size, contents) for uid, size, contents in autotune.timing_tensors(fwd)}
    offsets = np.frombuffer(timed[int(Uid.OFF_STATS)][1], np.int64)
    assert offsets[1] - offsets[0] == (65536 // 8 if fwd.t > 65536 // 8 else fwd.t) * fwd.n


def test_paged_graph_spec_layouts():
    spec = GraphSpec("fwd", "bfloat16", 4, 1, 1024, 8, 2, 128, 64, 0.1, padding=True, pages=(64, 64, 16),
                     stats=False)  # fmt: skip
    assert spec.out_uids() == (Uid.O,)
    assert spec.in_uids() == (Uid.Q, Uid.K, Uid.V, Uid.PT_K, Uid.PT_V, Uid.SEQ_Q, Uid.SEQ_KV)
    assert graph_spec._layout(Uid.K, spec) == ([64, 2, 64, 128], [64 * 2 * 128, 128, 2 * 128, 1])
    assert graph_spec._layout(Uid.V, spec) == ([64, 2, 64, 64], [64 * 2 * 64, 64, 2 * 64, 1])
    assert graph_spec._layout(Uid.PT_K, spec) == ([4, 1, 16, 1], [16, 16, 1, 1])
    assert spec.shape(Uid.V) == ((64, 64, 2, 64), "bfloat16")


# ------------------------------------------------------------------------------------------------------------------
# metadata vs the positions rule

# Jitted, as under attnlib's call: one compile per shape instead of one per operation (CPU time).
_BOUNDS = ("num_buckets", "t_bound", "s_bound", "slice_right")
thd_batch = jax.jit(ragged.thd_batch, static_argnums=(2, 3), static_argnames=_BOUNDS)
segment_batch = jax.jit(ragged.segment_batch, static_argnames=("max_segments",) + _BOUNDS)
thd_positions = jax.jit(positions.thd_positions, static_argnums=(2, 3), static_argnames="bottom_right")
dense_positions = jax.jit(positions.dense_positions, static_argnums=(0, 1, 2), static_argnames="bottom_right")


def _visible_through_batch(batch, Tq, Tkv, left, right, bottom_right, t_bound):
    """bool [Tq, Tkv]: which key tokens each query token sees through cuDNN's ragged batch (numpy)."""
    b = {k: np.asarray(v) for k, v in batch._asdict().items()}
    seen = np.zeros((Tq, Tkv), bool)
    for tok in range(Tq):
        s = b["tok_seq"][tok]
        i = b["tok_pos"][tok]
        if s < 0 or i < 0 or b["q_nan"][tok]:
            continue
        nq, nkv = b["seq_q"][s], b["seq_kv"][s]
        assert i < nq <= t_bound, (tok, s, i, nq)
        assert b["off_q"][s] + i == tok, "the token is not where its sequence's offset puts it"
        diag = i + (nkv - nq if bottom_right else 0)
        for j in range(nkv):
            if (left is None or j >= diag - left) and (right is None or j <= diag + right):
                seen[tok, b["off_kv"][s] + j] = True
    return seen


def _visible_reference(pos: positions.TokenPositions, left, right):
    q_seg, kv_seg = np.asarray(pos.q_segment), np.asarray(pos.kv_segment)
    qp, kp = np.asarray(pos.q_position), np.asarray(pos.kv_position)
    ok = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] != 0)
    if left is not None:
        ok &= kp[:, None, :] >= qp[:, :, None] - left
    if right is not None:
        ok &= kp[:, None, :] <= qp[:, :, None] + right
    return ok


MASKS = [(None, None, False), (None, 0, False), (None, 0, True), (5, 0, False), (3, 0, True), (4, 2, False),
         (2, -1, True)]  # fmt: skip


@pytest.mark.parametrize("left,right,bottom_right", MASKS)
@pytest.mark.parametrize("seed", range(4))
def test_thd_batch_matches_positions(seed, left, right, bottom_right):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    q_lens = rng.integers(0, 9, n)
    kv_lens = q_lens if seed % 2 else rng.integers(0, 9, n)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    Tq, Tkv = int(cu_q[-1]) + 3, int(cu_kv[-1]) + 2  # padding rows past cu[-1]
    slice_right = right if bottom_right and right is not None and right <= 0 else None
    batch = thd_batch(jnp.asarray(cu_q), jnp.asarray(cu_kv), Tq, Tkv, num_buckets=8, t_bound=64, s_bound=64,
                      slice_right=slice_right)  # fmt: skip
    seen = _visible_through_batch(batch, Tq, Tkv, left, right, bottom_right, 64)
    ref = _visible_reference(thd_positions(cu_q, cu_kv, Tq, Tkv, bottom_right=bottom_right), left, right)[0]
    np.testing.assert_array_equal(seen, ref)
    assert not np.asarray(batch.q_nan).any()
    # Key tokens count as run when their sequence has a visible (query, key) pair: cuDNN's backward writes no rows
    # of a sequence without query rows.
    runs = np.zeros(Tkv, bool)
    for b in range(n):
        runs[cu_kv[b]:cu_kv[b + 1]] = ref[cu_q[b]:cu_q[b + 1], cu_kv[b]:cu_kv[b + 1]].any()
    np.testing.assert_array_equal(np.asarray(batch.kv_in), runs)


def _random_segments(rng, B, L, max_runs, ids_from=1):
    rows = []
    for _ in range(B):
        row = np.zeros(L, np.int32)
        j, run = int(rng.integers(0, 3)), 0
        while j < L and run < max_runs:
            n = int(rng.integers(1, 7))
            row[j : j + n] = ids_from + run
            j += n + int(rng.integers(0, 3))  # gaps of padding between segments
            run += 1
        rows.append(row)
    return np.stack(rows)


@pytest.mark.parametrize("left,right,bottom_right", MASKS)
@pytest.mark.parametrize("seed", range(4))
def test_segment_batch_matches_positions(seed, left, right, bottom_right):
    rng = np.random.default_rng(100 + seed)
    B, T = 3, 24
    q_ids = _random_segments(rng, B, T, 4)
    if seed % 2:
        kv_ids, S = q_ids, T
    else:  # cross attention: other lengths, a missing id, ids in another order
        S = 30
        kv_ids = _random_segments(rng, B, S, 4)
        kv_ids[0] = np.where(kv_ids[0] == 2, 0, kv_ids[0])
        kv_ids[1] = np.where(kv_ids[1] > 0, 5 - kv_ids[1], 0)
    slice_right = right if bottom_right and right is not None and right <= 0 else None
    batch = segment_batch(jnp.asarray(q_ids), jnp.asarray(kv_ids), max_segments=4, num_buckets=16,
                          t_bound=64, s_bound=64, slice_right=slice_right)  # fmt: skip
    seen = _visible_through_batch(batch, B * T, B * S, left, right, bottom_right, 64)
    pos = dense_positions(B, T, S, bottom_right=bottom_right, query_seq_lengths=None, key_value_seq_lengths=None,
                          q_segment_ids=jnp.asarray(q_ids), kv_segment_ids=jnp.asarray(kv_ids))  # fmt: skip
    ref = _visible_reference(pos, left, right)  # [B, T, S]
    block = np.zeros((B * T, B * S), bool)
    for r in range(B):
        block[r * T : (r + 1) * T, r * S : (r + 1) * S] = ref[r]
    np.testing.assert_array_equal(seen, block)


def test_segment_overflow_marks_whole_row_nan():
    q_ids = np.array([[1, 1, 2, 3, 3, 4, 0, 0], [1, 1, 1, 2, 2, 0, 0, 0]], np.int32)
    batch = segment_batch(jnp.asarray(q_ids), jnp.asarray(q_ids), max_segments=3, num_buckets=8,
                          t_bound=64, s_bound=64, slice_right=None)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(batch.q_nan), np.repeat([True, False], 8))
    np.testing.assert_array_equal(np.asarray(batch.kv_nan), np.repeat([True, False], 8))
    assert np.asarray(batch.seq_q)[:3].tolist() == [0, 0, 0]  # the overflowing row does not run
    assert np.asarray(batch.seq_q)[3:5].tolist() == [3, 2]


def test_thd_sequence_longer_than_bound_is_nan():
    cu = jnp.asarray([0, 10, 90, 100], jnp.int32)
    batch = thd_batch(cu, cu, 100, 100, num_buckets=8, t_bound=64, s_bound=64, slice_right=None)
    nan = np.asarray(batch.q_nan)
    assert not nan[:10].any() and nan[10:90].all() and not nan[90:].any()
    assert np.asarray(batch.seq_q)[:3].tolist() == [10, 0, 10]


def test_element_offsets_are_int64_pairs():
    pairs = np.asarray(ragged.element_offsets(jnp.asarray([0, 3, 1000], jnp.int32), 8, 128))
    as_int64 = pairs.astype(np.int32).view(np.int64)[:, 0]  # little-endian (low, high)
    assert as_int64.tolist() == [0, 3 * 1024, 1000 * 1024]


# ------------------------------------------------------------------------------------------------------------------
# the wrapper end to end against an emulated cuDNN graph


def _mask(spec: GraphSpec, seq_q, seq_kv):
    """bool [b, 1, t, s]: cuDNN's padding + band mask with per-sequence lengths."""
    i = jnp.arange(spec.t)[None, :, None]
    j = jnp.arange(spec.s)[None, None, :]
    nq, nkv = seq_q[:, None, None], seq_kv[:, None, None]
    diag = i + (nkv - nq if spec.alignment == "bottom_right" else 0)
    ok = (i < nq) & (j < nkv)  # [b, t, s]
    if spec.left_bound is not None:
        ok &= j > diag - spec.left_bound
    if spec.right_bound is not None:
        ok &= j <= diag + spec.right_bound
    return ok[:, None]


def _gather(buf, offsets, rows, lens):
    """Packed `[T, heads, dim]` read through INT64 element offsets (int32 pairs) -> `[b, heads, rows, dim]`."""
    heads, dim = buf.shape[1:]
    start = offsets[:-1, 0]
    idx = start[:, None, None, None] + (jnp.arange(rows)[None, :, None, None] * heads * dim
                                        + jnp.arange(heads)[None, None, :, None] * dim
                                        + jnp.arange(dim)[None, None, None, :])  # fmt: skip
    inside = jnp.broadcast_to((jnp.arange(rows)[None, :] < lens[:, None])[:, :, None, None], idx.shape)
    flat = jnp.reshape(buf, (-1,))
    x = jnp.where(inside, flat[jnp.clip(idx, 0, flat.shape[0] - 1)], 0).astype(jnp.float32)
    return jnp.transpose(x, (0, 2, 1, 3)), idx, inside


def _scatter(shape, dtype, values, idx, inside):
    """Write `[b, heads, rows, dim]` back into a packed buffer, NaN where nothing is written (what an unwritten
    buffer may hold)."""
    values = jnp.transpose(values, (0, 2, 1, 3))
    flat = jnp.zeros((math.prod(shape),), jnp.float32)
    index = jnp.where(inside, idx, flat.shape[0])
    flat = flat.at[index].add(values, mode="drop")
    written = jnp.zeros(flat.shape, bool).at[index].set(True, mode="drop")
    flat = jnp.where(written, flat, jnp.nan)
    return jnp.reshape(flat, shape).astype(dtype)


def softmax_rows(logits, v, sinks):
    """`(o [b, n, t, hv], stats [b, n, t])` of masked logits `[b, n, t, s]`: NaN on rows that see nothing (without
    sinks), as a kernel that divides by a zero denominator."""
    m = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks[None, :, None, None])
    e = jnp.exp(logits - m)
    den = jnp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        den = den + jnp.exp(sinks[None, :, None, None] - m)
    return jnp.einsum("bnij,bnjh->bnih", e / den, v, precision="highest"), (m + jnp.log(den))[..., 0]


def emulate(spec: GraphSpec, operands, tokens):
    """A plain-JAX cuDNN SDPA graph (ragged or paged): NaN wherever a real kernel leaves rows undefined."""
    vals = dict(zip(spec.in_uids(), operands))
    g = spec.n // spec.k
    seq_q, seq_kv = vals[Uid.SEQ_Q], vals[Uid.SEQ_KV]
    if spec.ragged:
        q, qidx, qin = _gather(vals[Uid.Q], vals[Uid.OFF_Q], spec.t, seq_q)
        k, kidx, kin = _gather(vals[Uid.K], vals[Uid.OFF_K], spec.s, seq_kv)
        v, vidx, vin = _gather(vals[Uid.V], vals[Uid.OFF_V], spec.s, seq_kv)
    else:  # paged: dense query, keys through the page table
        q = jnp.transpose(vals[Uid.Q].astype(jnp.float32), (0, 2, 1, 3))
        page = spec.pages[1]
        j = jnp.arange(spec.s)
        pt = vals[Uid.PT_K]
        k = jnp.transpose(vals[Uid.K][pt[:, j // page], j % page].astype(jnp.float32), (0, 2, 1, 3))
        v = jnp.transpose(vals[Uid.V][vals[Uid.PT_V][:, j // page], j % page].astype(jnp.float32), (0, 2, 1, 3))
    k = jnp.repeat(k, g, axis=1)
    v = jnp.repeat(v, g, axis=1)
    mask = _mask(spec, seq_q, seq_kv)
    s = jnp.where(mask, jnp.einsum("bnih,bnjh->bnij", q, k, precision="highest") * spec.scale, -jnp.inf)
    if spec.direction == "fwd":
        o, stats = softmax_rows(s, v, vals.get(Uid.SINK))
        row_in = jnp.arange(spec.t)[None, None, :] < seq_q[:, None, None]
        stats = jnp.where(row_in, stats, jnp.nan)  # padded stats rows: undefined
        if spec.ragged_stats:
            stats = _ragged_stats_out(vals, stats, seq_q, tokens[0])
        if spec.ragged:
            out = _ragged_out(spec, vals, o, seq_q)
        else:
            out = jnp.where(row_in[..., None], o, jnp.nan).transpose(0, 2, 1, 3).astype(spec.dtype)
        return (out, stats) if spec.stats else (out,)
    # Backward as cuDNN computes it, from the given O and Stats.
    o, _, _ = _gather(vals[Uid.O], vals[Uid.OFF_O], spec.t, seq_q)
    do, _, _ = _gather(vals[Uid.DO], vals[Uid.OFF_O], spec.t, seq_q)
    stats = vals[Uid.STATS]
    if spec.ragged_stats:  # [Tq, N] read through the stats offsets -> [b, n, t]
        stats = _gather(stats[..., None], vals[Uid.OFF_STATS], spec.t, seq_q)[0][..., 0]
    p = jnp.where(mask, jnp.exp(s - stats[..., None]), 0.0)
    dv = jnp.einsum("bnij,bnih->bnjh", p, do, precision="highest")
    dp = jnp.einsum("bnih,bnjh->bnij", do, v, precision="highest")
    d = jnp.sum(do * o, axis=-1, keepdims=True)
    ds = p * (dp - d) * spec.scale
    dq = jnp.einsum("bnij,bnjh->bnih", ds, k, precision="highest")
    dk = jnp.einsum("bnij,bnih->bnjh", ds, q, precision="highest")
    fold = lambda x: jnp.sum(jnp.reshape(x, (x.shape[0], spec.k, g) + x.shape[2:]), axis=2)
    dk, dv = fold(dk), fold(dv)
    # The worst a kernel could do: skip the keys of a sequence without query rows.
    runs = (seq_q > 0)[:, None, None, None]
    kin, vin = kin & runs, vin & runs
    return (
        _scatter(vals[Uid.Q].shape, spec.dtype, dq, qidx, qin),
        _scatter(vals[Uid.K].shape, spec.dtype, dk, kidx, kin),
        _scatter(vals[Uid.V].shape, spec.dtype, dv, vidx, vin),
    )


def _ragged_stats_out(vals, stats, seq_q, tq):
    """`[b, n, t]` stats written per token into `[Tq, N]` through the stats offsets; rows no sequence writes are NaN
    (what an unwritten buffer may hold)."""
    n, t = stats.shape[1:]
    _, idx, inside = _gather(jnp.zeros((tq, n, 1), jnp.float32), vals[Uid.OFF_STATS], t, seq_q)
    flat = jnp.full((tq * n,), jnp.nan, jnp.float32)
    flat = flat.at[jnp.where(inside, idx, tq * n)].set(jnp.transpose(stats[..., None], (0, 2, 1, 3)), mode="drop")
    return jnp.reshape(flat, (tq, n))


def _ragged_out(spec, vals, o, seq_q):
    _, idx, inside = _gather(jnp.zeros(vals[Uid.Q].shape[:1] + (spec.n, spec.hv), jnp.float32), vals[Uid.OFF_O],
                             spec.t, seq_q)  # fmt: skip
    return _scatter(vals[Uid.Q].shape[:1] + (spec.n, spec.hv), spec.dtype, o, idx, inside)


@pytest.fixture
def ragged_stats():
    """`attnlib.Cudnn(ragged_stats=...)` of the emulated cuDNN; a test parametrized over `ragged_stats` overrides it."""
    return "auto"


@pytest.fixture
def emulated(monkeypatch, ragged_stats):
    """Route `implementation="cudnn"` through `emulate` (`cudnn_emulation.emulate_graph`) as on an H200 with cuDNN
    9.19, keeping ragged statistics as `ragged_stats` says."""
    from cudnn_emulation import emulate_graph, install  # imports this module: not at the top

    return install(monkeypatch, emulate_graph, ragged_stats=ragged_stats)


PER_TOKEN_TOO = pytest.mark.parametrize(
    "ragged_stats", ["auto", pytest.param("per_token", marks=pytest.mark.full)]
)  # the per-token layout is forced in the full matrix; the fast tier runs it through `auto` where it is chosen
"""Run a wrapper test with the statistics' layout chosen by the rule and forced per token."""


def _eps(dtype):
    return float(ml_dtypes.finfo(dtype).eps)


def _close(actual, expected, atol, rtol, what):
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    assert a.shape == e.shape, (what, a.shape, e.shape)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=f"{what}: NaNs differ")
    np.testing.assert_array_equal(np.isinf(a), np.isinf(e), err_msg=f"{what}: infinities differ")
    fin = np.isfinite(e)
    np.testing.assert_allclose(a[fin], e[fin], atol=atol, rtol=rtol, err_msg=what)


def _value_and_grads(impl, q, k, v, kw, diff_sinks=False, lse_grad=False):
    sinks = kw.pop("sinks", None)

    def f(q, k, v, sinks):
        return attnlib.attention(q, k, v, sinks=sinks, implementation=impl, return_residual=True, **kw)

    ko = jax.random.normal(jax.random.key(5), q.shape[:-1] + (v.shape[-1],), jnp.float32)
    kl = jax.random.normal(jax.random.key(6), q.shape[:-1], jnp.float32)

    def loss(q, k, v, sinks):
        out, lse = f(q, k, v, sinks)
        total = jnp.sum(jnp.where(jnp.isnan(out), 0.0, out.astype(jnp.float32)) * ko)
        if lse_grad:
            total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * kl)
        return total

    argnums = (0, 1, 2, 3) if diff_sinks else (0, 1, 2)
    with jax.default_matmul_precision("highest"):
        out, lse = jax.jit(f)(q, k, v, sinks)
        grads = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, sinks)
    return out, lse, grads


def _compare(q, k, v, kw, diff_sinks=False, lse_grad=False):
    dtype = q.dtype
    e = _eps(dtype)
    out, lse, grads = _value_and_grads("cudnn", q, k, v, dict(kw), diff_sinks, lse_grad)
    f32 = lambda x: x.astype(jnp.float32)
    ref_kw = dict(kw)
    r_out, r_lse, r_grads = _value_and_grads("xla", f32(q), f32(k), f32(v), ref_kw, diff_sinks, lse_grad)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    _close(out, r_out, 2 * e, e, "out")
    _close(lse, r_lse, 2 * e, 0, "lse")
    for name, g, rg in zip(("dq", "dk", "dv", "dsinks"), grads, r_grads):
        scale = max(float(np.max(np.abs(np.nan_to_num(np.asarray(rg, np.float32))))), 1e-30)
        _close(g, rg, 8 * e * scale, e, name)
    return out, lse, grads


def _packed(seed, tq, tkv, n, kh, h, hv, dtype=jnp.bfloat16):
    a, b, c = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(a, (tq, n, h)).astype(dtype), jax.random.normal(b, (tkv, kh, h)).astype(dtype),
            jax.random.normal(c, (tkv, kh, hv)).astype(dtype))  # fmt: skip


THD_CASES = [
    ("causal_gqa", [0, 5, 5, 17, 18, 40], None, 8, 2, 64, 64, {"is_causal": True}),
    ("cross_bottom_right", [0, 4, 9, 20, 21], [0, 10, 12, 30, 31], 4, 2, 64, 64,
     {"is_causal": True, "diagonal_alignment": "bottom_right"}),
    ("cross_top_left", [0, 4, 9, 20, 21], [0, 10, 12, 30, 31], 4, 4, 64, 64, {"is_causal": True}),
    ("window", [0, 13, 40], None, 4, 2, 64, 64, {"local_window_size": (3, 0), "is_causal": True}),
    ("two_sided", [0, 13, 40], None, 4, 1, 64, 64, {"local_window_size": (3, 2)}),
    ("mla", [0, 7, 20], None, 4, 4, 96, 64, {"is_causal": True}),
    ("full_padding_rows", [0, 3, 11], None, 2, 2, 64, 64, {}),
    # Top-left rows past `kv_len + left` (and a sequence without keys) see nothing: cuDNN gets trimmed lengths.
    ("cross_window_rows_past_keys", [0, 12, 20, 33], [0, 3, 3, 20], 4, 2, 64, 64,
     {"is_causal": True, "local_window_size": (2, 0)}),
    ("cross_two_sided_rows_past_keys", [0, 12, 20, 33], [0, 3, 3, 20], 4, 2, 64, 64, {"local_window_size": (4, 1)}),
    # A sequence with keys but no query rows: its key gradients are zero.
    ("cross_keys_without_queries", [0, 4, 4, 15], [0, 6, 13, 20], 4, 2, 64, 64, {"is_causal": True}),
]  # fmt: skip


@PER_TOKEN_TOO
@pytest.mark.parametrize("case", THD_CASES, ids=[c[0] for c in THD_CASES])
def test_thd_wrapper_matches_reference(emulated, case):
    _, cu_q, cu_kv, n, kh, h, hv, kw = case
    tq, tkv = cu_q[-1] + 3, (cu_kv or cu_q)[-1] + 2
    q, k, v = _packed(1, tq, tkv if cu_kv else tq, n, kh, h, hv)
    kw = dict(kw, cu_seqlens_q=jnp.asarray(cu_q, jnp.int32))
    if cu_kv:
        kw["cu_seqlens_kv"] = jnp.asarray(cu_kv, jnp.int32)
    out, lse, grads = _compare(q, k, v, kw)
    assert np.all(np.asarray(out)[cu_q[-1]:] == 0) and np.all(np.isneginf(np.asarray(lse)[cu_q[-1]:]))
    assert np.all(np.asarray(grads[0])[cu_q[-1]:] == 0)


@PER_TOKEN_TOO
def test_thd_sinks_and_lse_gradient(emulated):
    q, k, v = _packed(2, 30, 30, 4, 2, 64, 64)
    sinks = jnp.asarray([0.5, -1.0, 0.0, 2.0], jnp.float32)
    kw = {"cu_seqlens_q": jnp.asarray([0, 9, 9, 25], jnp.int32), "is_causal": True, "sinks": sinks}
    _compare(q, k, v, kw, diff_sinks=True, lse_grad=True)


@PER_TOKEN_TOO
def test_segments_wrapper_matches_reference(emulated):
    rng = np.random.default_rng(7)
    ids = jnp.asarray(_random_segments(rng, 3, 24, 3))
    q, k, v = (x.reshape((3, 24) + x.shape[1:]) for x in _packed(3, 72, 72, 4, 2, 64, 64))
    kw = {"q_segment_ids": ids, "max_segments_per_row": 3, "is_causal": True,
          "query_seq_lengths": jnp.asarray([24, 20, 17], jnp.int32)}  # fmt: skip
    _compare(q, k, v, kw)


def test_segments_cross_top_left_with_key_lengths(emulated):
    rng = np.random.default_rng(9)
    q_ids = _random_segments(rng, 2, 16, 3)
    q, _, _ = (x.reshape((2, 16) + x.shape[1:]) for x in _packed(4, 32, 32, 4, 2, 64, 64))
    _, k, v = (x.reshape((2, 16) + x.shape[1:]) for x in _packed(5, 32, 32, 4, 2, 64, 64))
    kw = {"q_segment_ids": jnp.asarray(q_ids), "max_segments_per_row": 3, "is_causal": True,
          "local_window_size": (3, 0), "key_value_seq_lengths": jnp.asarray([5, 16], jnp.int32)}  # fmt: skip
    _compare(q, k, v, kw)


@PER_TOKEN_TOO
def test_segments_cross_bottom_right(emulated):
    rng = np.random.default_rng(8)
    q_ids = _random_segments(rng, 2, 16, 3)
    kv_ids = _random_segments(rng, 2, 28, 3)
    q, _, _ = (x.reshape((2, 16) + x.shape[1:]) for x in _packed(4, 32, 32, 4, 2, 64, 64))
    _, k, v = (x.reshape((2, 28) + x.shape[1:]) for x in _packed(5, 56, 56, 4, 2, 64, 64))
    kw = {"q_segment_ids": jnp.asarray(q_ids), "kv_segment_ids": jnp.asarray(kv_ids), "max_segments_per_row": 3,
          "is_causal": True, "diagonal_alignment": "bottom_right"}  # fmt: skip
    _compare(q, k, v, kw)


def _many_segments(rows: int, length: int, runs: list[int]) -> jnp.ndarray:
    """`[rows, length]` ids: row `r` holds `runs[r]` segments of 1-3 tokens (padding after them)."""
    rng = np.random.default_rng(sum(runs))
    out = np.zeros((rows, length), np.int32)
    for r, n in enumerate(runs):
        sizes = rng.integers(1, 4, n)
        out[r, : sizes.sum()] = np.repeat(np.arange(1, n + 1), sizes)
    return jnp.asarray(out)


@pytest.mark.parametrize("runs,fused", [([3, 16], True), ([2, 17], False)])
def test_segments_without_a_bound_under_jit(emulated, runs, fused):
    """Under `jit` (ids traced) without `max_segments_per_row`, cuDNN runs with a bound of
    `DEFAULT_SEGMENTS_PER_ROW` (16) when every row fits, and the call runs on xla_chunked otherwise (cuDNN with the
    bound would give NaN rows): exact either way, forward and backward."""
    ids = _many_segments(2, 40, runs)
    q, k, v = (x.reshape((2, 40) + x.shape[1:]) for x in _packed(11, 80, 80, 4, 2, 64, 64))
    ko = jax.random.normal(jax.random.key(5), q.shape, jnp.float32)

    def run(impl, q, k, v, **extra):
        def loss(q, k, v, ids):
            out = attnlib.attention(q, k, v, q_segment_ids=ids, is_causal=True, implementation=impl, **extra)
            return jnp.sum(out.astype(jnp.float32) * ko), out

        with jax.default_matmul_precision("highest"):
            (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, ids)
        return [np.asarray(x, np.float32) for x in (out, *grads)]

    got = run("cudnn", q, k, v)
    # Fused: the same bits as the bound given. Fallback: xla_chunked on the packed arrays, equal to its direct call
    # up to float32 rounding (checked against the reference below).
    twin = run("cudnn", q, k, v, max_segments_per_row=16) if fused else got
    reference = run("xla", *(x.astype(jnp.float32) for x in (q, k, v)))
    e = _eps(jnp.bfloat16)
    for name, x, t, r in zip(("out", "dq", "dk", "dv"), got, twin, reference, strict=True):
        np.testing.assert_array_equal(x, t, err_msg=name)
        _close(x, r, (2 if name == "out" else 8 * float(np.max(np.abs(r)))) * e, e, name)


@pytest.mark.full  # heavy; its feature runs in the fast tier elsewhere
def test_segments_without_a_bound_take_it_from_concrete_ids(emulated):
    """Outside `jit` the bound is the rows' own segment count rounded up to a power of two (here 20 -> 32): no
    fallback, no NaN, the same numbers as that bound given explicitly."""
    ids = _many_segments(2, 48, [20, 5])
    q, k, v = (x.reshape((2, 48) + x.shape[1:]) for x in _packed(12, 96, 96, 4, 2, 64, 64))
    with jax.default_matmul_precision("highest"):
        out = attnlib.attention(q, k, v, q_segment_ids=ids, is_causal=True, implementation="cudnn")
        given = attnlib.attention(q, k, v, q_segment_ids=ids, is_causal=True, implementation="cudnn",
                                  max_segments_per_row=32)  # fmt: skip
        reference = attnlib.attention(*(x.astype(jnp.float32) for x in (q, k, v)), q_segment_ids=ids,
                                      is_causal=True, implementation="xla")  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(given, np.float32))
    _close(out, reference, 2 * _eps(jnp.bfloat16), _eps(jnp.bfloat16), "out")


def test_segment_overflow_gives_nan_rows_only(emulated):
    ids = jnp.asarray([[1, 1, 2, 2, 3, 3, 0, 0], [1, 1, 1, 1, 2, 2, 2, 0]], jnp.int32)
    q, k, v = (x.reshape((2, 8) + x.shape[1:]) for x in _packed(6, 16, 16, 2, 2, 64, 64))
    kw = {"q_segment_ids": ids, "max_segments_per_row": 2, "is_causal": True}
    out, lse, grads = _value_and_grads("cudnn", q, k, v, dict(kw))
    r_out, r_lse, r_grads = _value_and_grads("xla", q.astype(jnp.float32), k.astype(jnp.float32),
                                             v.astype(jnp.float32), dict(kw))  # fmt: skip
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert np.isnan(out[0]).all() and np.isnan(lse[0]).all() and np.isnan(np.asarray(grads[0], np.float32)[0]).all()
    e = _eps(jnp.bfloat16)
    _close(out[1], r_out[1], 2 * e, e, "row 1 out")
    _close(np.asarray(grads[1], np.float32)[1], r_grads[1][1], 8 * e * 4, e, "row 1 dk")


@PER_TOKEN_TOO
def test_thd_sequence_over_the_bound_is_nan_and_spares_the_rest(emulated):
    """A sequence longer than `max_seqlen_q` gets NaN rows and gradients; the others, the sink gradient and `lse`
    elsewhere stay exact. With no overflow in the batch the results carry no NaN at all."""
    q, k, v = _packed(9, 160, 160, 4, 2, 64, 64)
    sinks = jnp.asarray([0.5, -1.0, 0.0, 2.0], jnp.float32)
    # max_seqlen 28 gives graphs bounded by 64 rows: an 80-row sequence overflows, 40, 60 and 50 do not.
    for cu, bad in (([0, 20, 100, 150], (20, 100)), ([0, 40, 100, 150], None)):
        kw = {"cu_seqlens_q": jnp.asarray(cu, jnp.int32), "is_causal": True, "max_seqlen_q": 28,
              "max_seqlen_kv": 28, "sinks": sinks}  # fmt: skip
        out, lse, grads = _value_and_grads("cudnn", q, k, v, dict(kw), diff_sinks=True, lse_grad=True)
        f32 = lambda x: x.astype(jnp.float32)
        r_out, r_lse, r_grads = _value_and_grads("xla", f32(q), f32(k), f32(v), dict(kw), diff_sinks=True,
                                                 lse_grad=True)  # fmt: skip
        rows = np.zeros(160, bool)
        if bad:
            rows[bad[0]:bad[1]] = True
        out, lse, dq, dk, dv = (np.asarray(x, np.float32) for x in (out, lse, *grads[:3]))
        assert np.isnan(out[rows]).all() and np.isnan(lse[rows]).all()
        assert np.isnan(dq[rows]).all() and np.isnan(dk[rows]).all() and np.isnan(dv[rows]).all()
        e = _eps(jnp.bfloat16)
        _close(out[~rows], np.asarray(r_out)[~rows], 2 * e, e, "out elsewhere")
        _close(lse[~rows], np.asarray(r_lse)[~rows], 2 * e, 0, "lse elsewhere")
        if not bad:  # every gradient, the sink's included, is exact when nothing overflows
            for name, g, rg in zip(("dq", "dk", "dv", "dsinks"), grads, r_grads):
                scale = max(float(np.max(np.abs(np.asarray(rg, np.float32)))), 1e-30)
                _close(g, rg, 8 * e * scale, e, name)
        assert np.isfinite(np.asarray(grads[3])).all(), "the sink gradient must not see the NaN rows"


def test_thd_all_sequences_empty(emulated):
    q, k, v = _packed(9, 12, 12, 2, 2, 64, 64)
    cu = jnp.asarray([0, 0, 0], jnp.int32)  # two empty sequences
    out, lse = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, cu_seqlens_q=cu, implementation="cudnn",
                                                         return_residual=True))(q, k, v)  # fmt: skip
    assert np.all(np.asarray(out, np.float32) == 0) and np.all(np.isneginf(np.asarray(lse)))


PAGED_CASES = [
    ("decode_gqa", 1, 8, 2, 64, 64, {}),
    ("prefill_bottom_right", 5, 4, 2, 64, 64, {}),
    ("prefill_mla", 4, 4, 4, 96, 64, {}),
    ("window", 3, 4, 2, 64, 64, {"local_window_size": (6, 0)}),
]


@pytest.mark.parametrize("case", PAGED_CASES, ids=[c[0] for c in PAGED_CASES])
def test_paged_wrapper_matches_reference(emulated, case):
    _, T, n, kh, h, hv, kw = case
    B, P, page = 3, 12, 4
    a, b, c = jax.random.split(jax.random.key(11), 3)
    q = jax.random.normal(a, (B, T, n, h)).astype(jnp.bfloat16)
    kp = jax.random.normal(b, (P, page, kh, h)).astype(jnp.bfloat16)
    vp = jax.random.normal(c, (P, page, kh, hv)).astype(jnp.bfloat16)
    table = jnp.asarray([[3, 0, 7, 7], [11, 2, 5, 1], [3, 0, 9, 4]], jnp.int32)  # unordered, shared pages
    lengths = jnp.asarray([9, 16, 2], jnp.int32)
    kw = dict(kw, page_table=table, key_value_seq_lengths=lengths, is_causal=True, diagonal_alignment="bottom_right")
    f = lambda impl, *a: attnlib.attention(*a, implementation=impl, return_residual=True, **kw)
    out, lse = jax.jit(lambda *a: f("cudnn", *a))(q, kp, vp)
    r_out, r_lse = f("xla", q.astype(jnp.float32), kp.astype(jnp.float32), vp.astype(jnp.float32))
    e = _eps(jnp.bfloat16)
    _close(out, r_out, 2 * e, e, "out")
    _close(lse, r_lse, 2 * e, 0, "lse")


@pytest.mark.full  # heavy; its feature runs in the fast tier elsewhere
def test_paged_gradient_rules(emulated):
    B, P, page = 2, 6, 4
    q = jax.random.normal(jax.random.key(1), (B, 1, 2, 64)).astype(jnp.bfloat16)
    kp = jax.random.normal(jax.random.key(2), (P, page, 2, 64)).astype(jnp.bfloat16)
    table = jnp.asarray([[1, 4, 0], [5, 2, 3]], jnp.int32)
    kw = dict(page_table=table, key_value_seq_lengths=jnp.asarray([7, 10], jnp.int32), is_causal=True,
              diagonal_alignment="bottom_right")  # fmt: skip
    loss = lambda impl: lambda q, kp: jnp.sum(attnlib.attention(q, kp, kp, implementation=impl, **kw).astype(
        jnp.float32))  # fmt: skip
    with pytest.raises(NotImplementedError, match="paged key/value attention"):
        jax.grad(loss("cudnn"))(q, kp)
    assert attnlib.explain(q, kp, kp, **kw).implementation == "cudnn"
    g = jax.jit(jax.grad(loss(None), argnums=(0, 1)))(q, kp)
    rg = jax.jit(jax.grad(loss("xla"), argnums=(0, 1)))(q, kp)
    for a, b in zip(g, rg):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # A sequence takes the first that can serve and falls back like automatic dispatch (API §3), eager and jitted.
    for differentiate in (jax.grad(loss(("cudnn", "xla")), argnums=(0, 1)),
                          jax.jit(jax.grad(loss(["cudnn", "xla_chunked"]), argnums=(0, 1)))):  # fmt: skip
        for a, b in zip(differentiate(q, kp), rg):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_paged_cache_decoding_matches_dense_causal(emulated):
    B, K, N, H, steps = 2, 2, 4, 64, 9
    cache = attnlib.PagedKVCache.create(B, num_pages=16, page_size=4, num_kv_heads=K, head_dim=H,
                                        max_pages_per_seq=4)  # fmt: skip
    keys = jax.random.normal(jax.random.key(3), (3, B, steps, K, H)).astype(jnp.bfloat16)
    queries = jax.random.normal(jax.random.key(4), (B, steps, N, H)).astype(jnp.bfloat16)
    step = jax.jit(lambda cache, q, k, v: (lambda c: (c, attnlib.attention(
        q, c.k_pages, c.v_pages, page_table=c.page_table, key_value_seq_lengths=c.lengths, is_causal=True,
        diagonal_alignment="bottom_right", implementation="cudnn")))(cache.append(k, v)))  # fmt: skip
    outs = []
    for t in range(steps):
        cache, out = step(cache, queries[:, t : t + 1], keys[0, :, t : t + 1], keys[1, :, t : t + 1])
        outs.append(out)
    dense = attnlib.attention(queries.astype(jnp.float32), keys[0].astype(jnp.float32), keys[1].astype(jnp.float32),
                              is_causal=True, implementation="xla")  # fmt: skip
    e = _eps(jnp.bfloat16)
    _close(jnp.concatenate(outs, axis=1), dense, 2 * e, e, "decode vs dense causal")


# ------------------------------------------------------------------------------------------------------------------
# CUDA lowering (no GPU: a stand-in graph entry)


@dataclasses.dataclass(frozen=True)
class StandInEntries(executor.FfiExecutor):
    """The real FFI call of stand-in built graphs (no cuDNN here): what the CUDA lowering shows."""

    def get_entry(self, spec: GraphSpec) -> cache.GraphEntry:
        return cache.GraphEntry(
            blob=b"{blob-" + spec.label.encode(), workspace_bytes=4096,
            in_uids=tuple(int(u) for u in spec.in_uids()), out_uids=tuple(int(u) for u in spec.out_uids()),
            zero_fill=spec.zero_fill(), label=spec.label,
        )  # fmt: skip


@pytest.fixture
def fake_entries(monkeypatch):
    """`attnlib.Cudnn` lowering stand-in built graphs as on an H200 with cuDNN 9.19."""
    device = support.Device(compute_capability=(9, 0), name="NVIDIA H200", cudnn_version=91900)
    # Lowered for a GPU on this CPU host: the row-fill kernel, as JAX picks it there.
    monkeypatch.setattr(row_fill, "set_rows", row_fill.set_rows_kernel)
    monkeypatch.setattr(row_fill, "set_rows_many", row_fill.set_rows_kernel_many)
    return attnlib.Cudnn(executor=StandInEntries(), device=device)


def _custom_calls(fn, *args):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [line for line in text.splitlines() if "stablehlo.custom_call @attnlib_cudnn_graph" in line]


def test_thd_lowers_to_forward_and_backward_graph_calls(fake_entries):
    cudnn = dataclasses.replace(fake_entries, ragged_stats="padded")
    q = jax.ShapeDtypeStruct((1000, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1500, 2, 128), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((6,), jnp.int32)
    loss = lambda q, k, v, cu_q, cu_kv: jnp.sum(attnlib.attention(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, is_causal=True, implementation=cudnn,
        max_seqlen_q=300, max_seqlen_kv=600).astype(jnp.float32))  # fmt: skip
    fwd = _custom_calls(loss, q, kv, kv, cu, cu)
    assert len(fwd) == 1
    assert "in_uids = dense<[1, 2, 3, 14, 15, 16, 17, 12, 13]>" in fwd[0]
    assert "zero_fill = dense<> : tensor<0xi64>" in fwd[0]  # no memset: the rows are fixed after the graph
    # operands: packed q/k/v, four [b+1, 2] offset pairs (b = 8), lengths [8]; results O [Tq, N, Hv], stats
    assert "(tensor<1000x8x128xbf16>, tensor<1500x2x128xbf16>, tensor<1500x2x128xbf16>, tensor<9x2xi32>" in fwd[0]
    assert "-> (tensor<1000x8x128xbf16>, tensor<8x8x512xf32>, tensor<4096xui8>)" in fwd[0]
    both = _custom_calls(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, cu, cu)
    assert len(both) == 2
    bwd = next(c for c in both if "sdpa_thd_bwd" in c)
    assert "-> (tensor<1000x8x128xbf16>, tensor<1500x2x128xbf16>, tensor<1500x2x128xbf16>, tensor<4096xui8>)" in bwd
    assert "zero_fill = dense<> : tensor<0xi64>" in bwd
    # On a GPU the rows outside the sequences are set by the row-fill kernel (O, then dQ, dK, dV in one call), never
    # by an XLA scatter, which costs a pass over the whole result.
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, cu, cu).lower(
        lowering_platforms=("cuda",)).as_text()  # fmt: skip
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 2 and "stablehlo.scatter" not in text


def test_paged_decode_lowers_to_one_graph_call(fake_entries):
    q = jax.ShapeDtypeStruct((64, 1, 64, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((8192, 64, 8, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((64, 128), jnp.int32)
    lengths = jax.ShapeDtypeStruct((64,), jnp.int32)
    f = lambda q, k, v, t, n: attnlib.attention(q, k, v, page_table=t, key_value_seq_lengths=n, is_causal=True,
                                                diagonal_alignment="bottom_right", implementation=fake_entries)
    calls = _custom_calls(f, q, pool, pool, table, lengths)
    assert len(calls) == 1 and "sdpa_paged_fwd_nostats_b64_t1_s8192" in calls[0]
    assert "in_uids = dense<[1, 2, 3, 19, 20, 12, 13]>" in calls[0]
    assert "-> (tensor<64x1x64x128xbf16>, tensor<4096xui8>)" in calls[0]  # no stats without return_residual


def test_large_padded_stats_are_logged_once(fake_entries, monkeypatch, caplog):
    """A THD call without `max_seqlen_q` sizes its statistics by the token count: large ones (over 1 GiB; traced
    here, nothing is allocated) get a WARNING (once per shape) that names the size and the remedy; a bound, or small
    statistics, log nothing."""
    cudnn = dataclasses.replace(fake_entries, ragged_stats="padded")  # by default these go per token
    monkeypatch.setattr(logs, "_logged", set())
    q = jax.ShapeDtypeStruct((300_000, 64, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((300_000, 8, 64), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((10,), jnp.int32)
    call = lambda **kw: jax.make_jaxpr(lambda q, k, v, cu: attnlib.attention(
        q, k, v, cu_seqlens_q=cu, is_causal=True, implementation=cudnn, **kw))(q, kv, kv, cu)  # fmt: skip
    with caplog.at_level("WARNING", logger="attnlib"):
        call()
        call()
        call(max_seqlen_q=4096, max_seqlen_kv=4096)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "[16 sequences, 64 heads, 524288 rows] = 2.00 GiB" in warnings[0], warnings[0]
    assert "the token count (max_seqlen_q's default)" in warnings[0]


def test_stats_go_per_token_when_padded_ones_would_be_much_larger():
    """The layout rule: per-token stats when the padded rows `b * t` exceed 4x the query tokens (no `max_seqlen`, or
    many short sequences), padded stats when a bound keeps them close to the token count."""
    config = dataclasses.replace(BASE, max_seqlen_q=None, max_seqlen_kv=None)
    unbounded = varlen.make_ragged_plan(config, 16, (32768, 32768), (32768, 32768))
    assert unbounded.fwd.ragged_stats and unbounded.bwd.ragged_stats  # 16 x 32768 rows for 32768 tokens
    bounded = varlen.make_ragged_plan(config, 16, (4096, 4096), (32768, 32768))
    assert not bounded.fwd.ragged_stats and not bounded.bwd.ragged_stats  # 16 x 4096 = 2x the tokens
    assert varlen.make_ragged_plan(config, 5, (400, 400), (300 * 5, 300 * 5)).fwd.ragged_stats is False


@pytest.mark.parametrize("layout", ["thd", "segments"])
def test_ragged_calls_lower_without_control_flow(fake_entries, layout):
    """The sequence metadata and the row fixes are straight-line ops: an XLA `while` or conditional on a GPU reads its
    predicate back to the host (`ragged._sequence_of`)."""
    if layout == "thd":
        q, kv, meta = (jax.ShapeDtypeStruct((1000, 8, 64), jnp.bfloat16),
                       jax.ShapeDtypeStruct((1000, 2, 64), jnp.bfloat16),
                       jax.ShapeDtypeStruct((6,), jnp.int32))  # fmt: skip
        kw = lambda m: dict(cu_seqlens_q=m, max_seqlen_q=300, max_seqlen_kv=300)
    else:
        q, kv, meta = (jax.ShapeDtypeStruct((2, 500, 8, 64), jnp.bfloat16),
                       jax.ShapeDtypeStruct((2, 500, 2, 64), jnp.bfloat16),
                       jax.ShapeDtypeStruct((2, 500), jnp.int32))  # fmt: skip
        kw = lambda m: dict(q_segment_ids=m, max_segments_per_row=4)
    loss = lambda q, k, v, m: jnp.sum(attnlib.attention(q, k, v, is_causal=True, implementation=fake_entries,
                                                        **kw(m)).astype(jnp.float32))  # fmt: skip
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, meta).lower(lowering_platforms=("cuda",))
    text = text.as_text()
    assert text.count("stablehlo.custom_call @attnlib_cudnn_graph") == 2
    assert "stablehlo.while" not in text and "stablehlo.case" not in text and "stablehlo.if" not in text


@pytest.mark.parametrize("runs", [[3, 16], [2, 17]], ids=["fits", "over_default"])
def test_segments_without_a_bound_sinks_and_lse_gradient(emulated, runs):
    """Both branches of the traced default carry sinks and gradients flowing into `lse`."""
    ids = _many_segments(2, 40, runs)
    q, k, v = (x.reshape((2, 40) + x.shape[1:]) for x in _packed(13, 80, 80, 4, 2, 64, 64))
    sinks = jnp.asarray([0.5, -1.0, 0.0, 2.0], jnp.float32)
    ko = jax.random.normal(jax.random.key(5), q.shape, jnp.float32)
    kl = jax.random.normal(jax.random.key(6), q.shape[:-1], jnp.float32)

    def run(impl, q, k, v):
        def loss(q, k, v, sinks, ids):
            out, lse = attnlib.attention(q, k, v, q_segment_ids=ids, sinks=sinks, is_causal=True,
                                         implementation=impl, return_residual=True)  # fmt: skip
            finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
            return jnp.sum(out.astype(jnp.float32) * ko) + jnp.sum(finite * kl), (out, lse)

        with jax.default_matmul_precision("highest"):
            (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
                q, k, v, sinks, ids)
        return [np.asarray(x, np.float32) for x in (out, lse, *grads)]

    got = run("cudnn", q, k, v)
    reference = run("xla", *(x.astype(jnp.float32) for x in (q, k, v)))
    e = _eps(jnp.bfloat16)
    for name, x, r in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, reference, strict=True):
        scale = 1.0 if name in ("out", "lse") else 8 * float(np.max(np.abs(r)))
        _close(x, r, 2 * e * scale, e if name != "lse" else 0, name)
