"""An independent float64 NumPy reference for `attnlib.attention`, written from the maths of docs/semantics.md.

Deliberately loop-level: one Python loop over (batch row, query head, query token), NumPy over the key axis only.
It shares no code with attnlib (it must not import it): the visibility rules (padding, causal / window with both
diagonal alignments, segments, THD, paged) are spelled out again here from the contract.

Forward, for one query row `i` of batch row `b` and query head `n` (key/value head `n // (N // K)`):

    s_j   = scale * q_i . k_j + bias[b, n, i, j]        (float64)
    s_j   = score_mod(s_j, batch, n, q_idx, kv_idx_j, *args[b, n, i, j])   (when given; see below)
    s_j   = c * tanh(s_j / c)                           (logits_soft_cap c, when given)
    vis_j = "query i may attend to key j"               (mask, padding, causal/window, segments, THD, paged,
                                                         mask_mod(batch, n, q_idx, kv_idx_j, *args[b, n, i, j]),
                                                         and score_mod's result != -inf)
    lse   = log(exp(sink_n) + sum_{vis} exp(s_j))        (no sink term without sinks; -inf when that sum is empty)
    p_j   = exp(s_j - lse) if vis_j else 0
    out_i = sum_j p_j * keep_j / (1 - rate) * v_j         (out = 0 for a row with no visible key)

Backward (analytic softmax backward, derived in `reference_attention_vjp`):

    dp_j  = keep_j / (1 - rate) * (dO_i . v_j)          gradient w.r.t. the undropped probability p_j
    D     = sum_j p_j dp_j                              (= dO_i . out_i)
    ds_j  = p_j (dp_j - D) + dlse_i p_j                 gradient w.r.t. the capped, biased logit
    ds_j *= 1 - tanh(s_raw_j / c)**2                    (through the soft cap)
    dbias[b, n, i, j] = ds_j;  dq_i = scale sum_j ds_j k_j;  dk_j += scale ds_j q_i;  dv_j += p_j keep_j/(1-rate) dO_i
    dsink_n += p_sink (dlse_i - D),  p_sink = exp(sink_n - lse)
    with score_mod f: the ds above is w.r.t. f's output; ds_raw_j = ds_j * df/dscore, and the float
    score_mod_args get ds_j * df/darg at [b, n, i, j] (summed back to their broadcast shapes)

`score_mod` / `mask_mod` (docs/flex_attention.md) are the caller's functions written for one element; the reference
calls them once per (visible) element on NumPy scalars: the float64 score, int32 `batch` (flattened row; THD: the
query's 0-based sequence), `head`, `q_idx` (the query's position in its sequence plus the bottom-right offset) and
`kv_idx` (the key's position in its sequence), and one element of each `score_mod_args` (float ones as float64), with
`jax_enable_x64` and standard dtype promotion so that the function computes in float64. `df/dscore` and `df/darg` come
from `jax.grad` of the same scalar function. The analytic backward is itself checked against central finite differences
of the forward in `tests/test_conformance.py::test_reference_vjp_matches_finite_differences`.
"""

import math

import jax
import ml_dtypes
import numpy as np


__all__ = [
    "e4m3",
    "reference_attention",
    "reference_attention_vjp",
    "reference_fp8_attention",
    "reference_max_logit",
    "visibility",
]


class _float64_jax:
    """`jax_enable_x64`, standard dtype promotion and the CPU while the caller's functions run in float64."""

    def __enter__(self):
        cpu = jax.devices("cpu")[0]  # a row at a time: not worth a dispatch to an accelerator
        self._contexts = [jax.enable_x64(True), jax.numpy_dtype_promotion("standard"), jax.default_device(cpu)]
        for c in self._contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self._contexts):
            c.__exit__(*exc)


def _f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


def _int(x):
    return None if x is None else np.asarray(x).astype(np.int64)


class _Problem:
    """The call canonicalised to one flat batch `[B, T, N, H]` / `[B, S, K, H|Hv]` plus per-token bookkeeping."""

    def __init__(
        self,
        query,
        key,
        value,
        bias,
        mask,
        *,
        scale,
        is_causal,
        query_seq_lengths,
        key_value_seq_lengths,
        local_window_size,
        diagonal_alignment,
        q_segment_ids,
        kv_segment_ids,
        cu_seqlens_q,
        cu_seqlens_kv,
        page_table,
        logits_soft_cap,
        sinks,
        dropout_rate,
        dropout_keep,
        score_mod=None,
        mask_mod=None,
        score_mod_args=(),
    ):
        query, key, value = _f64(query), _f64(key), _f64(value)
        self.layout = "dense"
        if cu_seqlens_q is not None or cu_seqlens_kv is not None:
            self.layout = "thd"
        elif page_table is not None:
            self.layout = "paged"

        if self.layout == "thd":
            assert query.ndim == 3 and key.ndim == 3 and value.ndim == 3
            self.batch_shape = ()
            self.out_batch_shape = ()
            q = query[None]
            k = key[None]
            v = value[None]
        elif self.layout == "paged":
            # Pools [P, page_size, K, H]; query [B, T, N, H] (or [T, N, H] with a one-row table).
            page_table = _int(page_table)
            assert page_table.ndim == 2
            if query.ndim == 3:
                query = query[None]
                self.out_batch_shape = ()
            else:
                self.out_batch_shape = query.shape[:-3]
            self.batch_shape = query.shape[:-3]
            q = query.reshape((-1,) + query.shape[-3:])
            B = q.shape[0]
            assert page_table.shape[0] == B
            P, page_size = key.shape[0], key.shape[1]
            pages_per_seq = page_table.shape[1]
            S = pages_per_seq * page_size
            k = np.zeros((B, S) + key.shape[2:])
            v = np.zeros((B, S) + value.shape[2:])
            for b in range(B):
                for j in range(S):
                    page = page_table[b, j // page_size]
                    assert 0 <= page < P
                    k[b, j] = key[page, j % page_size]
                    v[b, j] = value[page, j % page_size]
            self.page_table = page_table
            self.page_size = page_size
            self.num_pages = P
        else:
            if query.ndim == 3:
                self.batch_shape = ()
                self.out_batch_shape = ()
                q, k, v = query[None], key[None], value[None]
            else:
                self.batch_shape = query.shape[:-3]
                self.out_batch_shape = self.batch_shape
                q = query.reshape((-1,) + query.shape[-3:])
                k = key.reshape((-1,) + key.shape[-3:])
                v = value.reshape((-1,) + value.shape[-3:])

        self.q, self.k, self.v = q, k, v
        B, T, N, H = q.shape
        S, K = k.shape[1], k.shape[2]
        Hv = v.shape[3]
        assert N % K == 0 and k.shape[3] == H and v.shape[:3] == k.shape[:3]
        self.B, self.T, self.S, self.N, self.K, self.H, self.Hv = B, T, S, N, K, H, Hv
        self.scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
        self.cap = None if logits_soft_cap is None else float(logits_soft_cap)
        self.sinks = _f64(sinks)
        self.rate = float(dropout_rate)
        if self.rate > 0:
            assert dropout_keep is not None, "pass the library's keep mask as `dropout_keep`"
            keep = np.asarray(dropout_keep, dtype=bool)
            assert keep.shape == (B, N, T, S), (keep.shape, (B, N, T, S))
            self.keep_scaled = keep.astype(np.float64) / (1.0 - self.rate)
        else:
            self.keep_scaled = None

        # bias / mask, broadcast to [*B, N, T, S] and flattened to [B, N, T, S].
        full = tuple(self.batch_shape) + (N, T, S)
        self.bias_shape = None if bias is None else np.shape(bias)
        self.bias = None if bias is None else np.broadcast_to(_f64(bias), full).reshape(B, N, T, S)
        if mask is not None:
            mask = np.asarray(mask)
            assert mask.dtype == np.bool_
            self.mask = np.broadcast_to(mask, full).reshape(B, N, T, S)
        else:
            self.mask = None

        # Per-token "sequence" ids and lengths. Segments and THD both become ids (0 = padding); a dense row without
        # them is one sequence of length T (queries) / S (keys), shortened by the padding lengths.
        qlen = None if query_seq_lengths is None else _int(query_seq_lengths).reshape(-1)
        kvlen = None if key_value_seq_lengths is None else _int(key_value_seq_lengths).reshape(-1)
        if self.layout == "thd":
            cu_q, cu_kv = _int(cu_seqlens_q), _int(cu_seqlens_kv)
            assert cu_q is not None and cu_kv is not None and cu_q.shape == cu_kv.shape
            qseg = np.zeros((1, T), np.int64)
            kvseg = np.zeros((1, S), np.int64)
            for s in range(len(cu_q) - 1):
                qseg[0, cu_q[s] : cu_q[s + 1]] = s + 1
                kvseg[0, cu_kv[s] : cu_kv[s + 1]] = s + 1
            self.segmented = True
        elif q_segment_ids is not None:
            qseg = _int(q_segment_ids).reshape(B, T)
            kvseg = qseg if kv_segment_ids is None else _int(kv_segment_ids).reshape(B, S)
            self.segmented = True
        else:
            assert kv_segment_ids is None
            qseg = kvseg = None
            self.segmented = False
        self.qseg, self.kvseg = qseg, kvseg
        self.qlen, self.kvlen = qlen, kvlen
        self.is_causal = bool(is_causal)
        assert diagonal_alignment in ("top_left", "bottom_right")
        self.bottom_right = diagonal_alignment == "bottom_right"
        if local_window_size is None:
            self.window = None
        elif isinstance(local_window_size, int):
            self.window = (local_window_size, local_window_size)
        else:
            self.window = tuple(int(w) for w in local_window_size)

        # score_mod / mask_mod and their arguments, broadcast to [*B, N, T, S] and flattened to [B, N, T, S]
        assert score_mod_args == () or score_mod is not None or mask_mod is not None
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.args = []
        self.arg_shapes = []
        for a in score_mod_args:
            a = np.asarray(a)
            if np.issubdtype(a.dtype, np.floating):
                a = a.astype(np.float64)
            self.arg_shapes.append(a.shape)
            self.args.append(np.broadcast_to(a, full).reshape(B, N, T, S))
        self.float_args = [m for m, a in enumerate(self.args) if np.issubdtype(a.dtype, np.floating)]
        if score_mod is not None or mask_mod is not None:
            # The caller's functions are written for one element; each runs over a row's keys under `vmap`.
            per_key = (0,) * len(self.args)
            over_row = lambda f, first: jax.jit(jax.vmap(f, in_axes=(*first, None, None, None, 0, *per_key)))
            with _float64_jax():
                self._score = None if score_mod is None else over_row(score_mod, (0,))
                argnums = (0,) + tuple(5 + m for m in self.float_args)
                self._score_grad = None if score_mod is None else over_row(jax.grad(score_mod, argnums), (0,))
                self._mask = None if mask_mod is None else over_row(mask_mod, ())

    def positions(self, b: int, i: int) -> tuple[int, np.ndarray]:
        """`(q_idx, kv_idx [S])`: query `i`'s aligned position and the keys' positions within its sequence."""
        j = np.arange(self.S)
        if self.segmented:
            sid = self.qseg[b, i]
            # positions restart at each segment; lengths are the segment's token counts.
            q_members = np.flatnonzero(self.qseg[b] == sid)
            k_members = np.flatnonzero(self.kvseg[b] == sid)
            q_pos = i - q_members[0]
            k_pos = j - (k_members[0] if len(k_members) else 0)
            q_len, k_len = len(q_members), len(k_members)
        else:
            q_pos, k_pos = i, j
            q_len = self.T if self.qlen is None else int(self.qlen[b])
            k_len = self.S if self.kvlen is None else int(self.kvlen[b])
        # the query's aligned position on the key axis
        return int(q_pos + (k_len - q_len if self.bottom_right else 0)), k_pos

    def batch_index(self, b: int, i: int) -> int:
        """The `batch` a score_mod / mask_mod sees: the flattened row; THD: the query's 0-based sequence (0 past
        the last one)."""
        if self.layout == "thd":
            return max(int(self.qseg[0, i]) - 1, 0)
        return b

    def visible(self, b: int, n: int, i: int) -> np.ndarray:
        """Boolean `[S]`: which keys query token `i` of batch row `b`, head `n`, may attend to (built-in rules,
        `mask` and `mask_mod`; not `score_mod`'s -inf, see `row_scores`)."""
        S = self.S
        j = np.arange(S)
        vis = np.ones(S, dtype=bool)
        if self.qlen is not None and i >= self.qlen[b]:
            return np.zeros(S, dtype=bool)
        if self.kvlen is not None:
            vis &= j < self.kvlen[b]
        if self.mask is not None:
            vis &= self.mask[b, n, i]
        if self.segmented:
            sid = self.qseg[b, i]
            if sid == 0:
                return np.zeros(S, dtype=bool)
            vis &= self.kvseg[b] == sid
        diag, k_pos = self.positions(b, i)
        if self.is_causal:
            vis &= k_pos <= diag
        if self.window is not None:
            left, right = self.window
            vis &= (k_pos >= diag - left) & (k_pos <= diag + right)
        if self.mask_mod is not None:
            with _float64_jax():
                vis &= np.asarray(self._mask(*self._row(b, n, i, diag, k_pos)))
        return vis

    def _row(self, b, n, i, q_idx, kv_idx):
        """`(batch, head, q_idx, kv_idx [S], *args [S])` of row `(b, n, i)` for score_mod / mask_mod: the scalars
        each element sees, the per-key ones along the row."""
        idx = (np.int32(self.batch_index(b, i)), np.int32(n), np.int32(q_idx), np.asarray(kv_idx, np.int32))
        return idx + tuple(a[b, n, i] for a in self.args)

    def row_scores(self, b: int, n: int, i: int):
        """`(s_raw, s_mod, s, vis)`: float64 `[S]` logits of one row with bias; after score_mod (= s_raw without
        it); after the soft cap; and which keys are visible (incl. mask_mod and score_mod's -inf)."""
        kh = n // (self.N // self.K)
        s_raw = self.scale * (self.k[b, :, kh, :] @ self.q[b, i, n, :])
        if self.bias is not None:
            s_raw = s_raw + self.bias[b, n, i]
        vis = self.visible(b, n, i)
        s_mod = s_raw.copy()
        if self.score_mod is not None:
            diag, k_pos = self.positions(b, i)
            with _float64_jax():
                s_mod = np.where(vis, np.asarray(self._score(s_raw, *self._row(b, n, i, diag, k_pos))), s_raw)
            vis = vis & (s_mod != -np.inf)
        s = s_mod if self.cap is None else self.cap * np.tanh(s_mod / self.cap)
        return s_raw, s_mod, s, vis

    def score_mod_grads(self, b: int, n: int, i: int, s_raw, vis):
        """`(df/dscore [S], [df/darg [S] for each float arg])` of score_mod at the visible keys (0 elsewhere)."""
        diag, k_pos = self.positions(b, i)
        with _float64_jax():
            g = self._score_grad(s_raw, *self._row(b, n, i, diag, k_pos))
        dscore, *dargs = (np.where(vis, np.asarray(x, np.float64), 0.0) for x in g)
        return dscore, dargs

    def row_softmax(self, b: int, n: int, i: int):
        """`(p, lse, vis, s_mod)` of one row; `p` is zero off `vis`; lse is -inf for an empty row without sinks;
        `s_mod` the logits before the soft cap."""
        _, s_mod, s, vis = self.row_scores(b, n, i)
        terms = list(s[vis])
        if self.sinks is not None:
            terms.append(self.sinks[n])
        if not terms:
            return np.zeros(self.S), -np.inf, vis, s_mod
        terms = np.asarray(terms)
        m = terms.max()
        lse = m + math.log(np.exp(terms - m).sum())
        p = np.where(vis, np.exp(np.where(vis, s, 0.0) - lse), 0.0)
        return p, lse, vis, s_mod

    def dropped(self, p, b, n, i):
        return p if self.keep_scaled is None else p * self.keep_scaled[b, n, i]


def _problem(query, key, value, bias, mask, kwargs) -> _Problem:
    kwargs = dict(kwargs)
    for unused in ("return_residual", "max_segments_per_row", "max_seqlen_q", "max_seqlen_kv"):
        kwargs.pop(unused, None)
    kwargs.pop("deterministic_backward", None)
    defaults = dict(
        scale=None,
        is_causal=False,
        query_seq_lengths=None,
        key_value_seq_lengths=None,
        local_window_size=None,
        diagonal_alignment="top_left",
        q_segment_ids=None,
        kv_segment_ids=None,
        cu_seqlens_q=None,
        cu_seqlens_kv=None,
        page_table=None,
        logits_soft_cap=None,
        sinks=None,
        dropout_rate=0.0,
        dropout_keep=None,
        score_mod=None,
        mask_mod=None,
        score_mod_args=(),
    )
    unknown = set(kwargs) - set(defaults)
    assert not unknown, f"reference: unknown arguments {unknown}"
    defaults.update(kwargs)
    return _Problem(query, key, value, bias, mask, **defaults)


def reference_attention(query, key, value, bias=None, mask=None, **kwargs):
    """float64 `(out, lse)`: out `[*B, T, N, Hv]` (THD `[T, N, Hv]`), lse `[*B, T, N]` (THD `[T, N]`).

    Takes the keyword arguments of `attnlib.attention` (docs/semantics.md) except `implementation` and `dropout_key`;
    dropout takes `dropout_rate` and an explicit boolean keep mask `dropout_keep` `[B, N, T, S]` (flattened `*B`).
    `return_residual` is accepted and ignored: both are always returned.
    """
    pr = _problem(query, key, value, bias, mask, kwargs)
    out = np.zeros((pr.B, pr.T, pr.N, pr.Hv))
    lse = np.full((pr.B, pr.T, pr.N), -np.inf)
    for b in range(pr.B):
        for n in range(pr.N):
            kh = n // (pr.N // pr.K)
            for i in range(pr.T):
                p, row_lse, _, _ = pr.row_softmax(b, n, i)
                lse[b, i, n] = row_lse
                out[b, i, n] = pr.dropped(p, b, n, i) @ pr.v[b, :, kh, :]
    return _unflatten(pr, out), _unflatten(pr, lse)


def reference_max_logit(query, key, value, bias=None, mask=None, **kwargs):
    """float64 `max_logit` (docs/semantics.md, `return_max_logit`): per batch row and query head `[*B, N]` (THD: per
    sequence `[B, N]`), the largest logit (after bias, score_mod and soft cap) of any visible query-key pair; -inf
    where none is."""
    pr = _problem(query, key, value, bias, mask, kwargs)
    rows = pr.B if pr.layout != "thd" else int(pr.qseg.max(initial=0))
    out = np.full((rows, pr.N), -np.inf)
    for b in range(pr.B):
        for n in range(pr.N):
            for i in range(pr.T):
                _, _, s, vis = pr.row_scores(b, n, i)
                if not vis.any():
                    continue
                row = b if pr.layout != "thd" else int(pr.qseg[0, i]) - 1
                out[row, n] = max(out[row, n], s[vis].max())
    return out if pr.layout == "thd" else out.reshape(tuple(pr.out_batch_shape) + (pr.N,))


def e4m3(x):
    """float64 values rounded to the nearest float8_e4m3fn (saturating at ±448), as float64."""
    return np.clip(np.asarray(x, np.float64), -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def reference_fp8_attention(query8, key8, value8, bias=None, mask=None, *, scales, **kwargs):
    """float64 `(out, lse)` of FP8 attention (docs/fp8.md) on E4M3 values `query8`, `key8`, `value8`
    (any float arrays holding E4M3 values) with dequantization scales `scales = (d_q, d_k, d_v)`.

    For one row, on the dequantized inputs `x̂ = x8 · d_x`: `p` and `lse` as `reference_attention`; with `m` the
    row's largest logit (or sink), `p̃ = exp(s - m) = p / max(p, p_sink)`, `P8 = e4m3(448 p̃) / 448`,
    `o = (P8 · v̂) / Σ p̃` (the sum including the sink term), `out = e4m3(o · c) / c` with
    `c = 448 / (1.25 · max|v̂|)`. Dropout is not part of it.
    """
    d_q, d_k, d_v = (float(x) for x in scales)
    q = np.asarray(query8, np.float64) * d_q
    k = np.asarray(key8, np.float64) * d_k
    v = np.asarray(value8, np.float64) * d_v
    pr = _problem(q, k, v, bias, mask, kwargs)
    vmax = np.max(np.abs(pr.v))
    c = 448.0 / (1.25 * vmax) if vmax > 0 else 1.0
    out = np.zeros((pr.B, pr.T, pr.N, pr.Hv))
    lse = np.full((pr.B, pr.T, pr.N), -np.inf)
    for b in range(pr.B):
        for n in range(pr.N):
            kh = n // (pr.N // pr.K)
            for i in range(pr.T):
                p, row_lse, _, _ = pr.row_softmax(b, n, i)
                lse[b, i, n] = row_lse
                if row_lse == -np.inf:
                    continue
                p_sink = 0.0 if pr.sinks is None else math.exp(pr.sinks[n] - row_lse)
                largest = max(p.max(), p_sink)  # exp(m - lse)
                p8 = e4m3(448.0 * p / largest) / 448.0
                o = (p8 @ pr.v[b, :, kh, :]) * largest
                out[b, i, n] = e4m3(o * c) / c
    return _unflatten(pr, out), _unflatten(pr, lse)


def _unflatten(pr: _Problem, x):
    if pr.layout == "thd":
        return x[0]
    return x.reshape(tuple(pr.out_batch_shape) + x.shape[1:])


def _unbroadcast(g, shape):
    """Sum a broadcast gradient `g` back to `shape` (NumPy broadcasting rules)."""
    g = np.asarray(g)
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    for ax, size in enumerate(shape):
        if size == 1 and g.shape[ax] != 1:
            g = g.sum(axis=ax, keepdims=True)
    assert g.shape == tuple(shape)
    return g


def reference_attention_vjp(query, key, value, bias=None, mask=None, *, d_out, d_lse=None, **kwargs):
    """float64 gradients of `<d_out, out> + <d_lse, lse>` for the arguments of `reference_attention`.

    Returns a dict with `query`, `key`, `value` (for paged layouts: gradients w.r.t. the page pools), and `bias`,
    `sinks` when given, and `score_mod_args` (a list: the gradient of each float argument, None for the others)
    when score_mod_args are given. `d_out` has the shape of `out`; `d_lse` (optional) the shape of `lse`.

    Derivation for one row (all sums over visible keys j; p_j = exp(s_j - lse), p_sink = exp(sink - lse),
    so sum_j p_j + p_sink = 1; o = sum_j p_j m_j v_j with m_j = keep_j / (1 - rate)):
        d lse / d s_j = p_j,   d lse / d sink = p_sink
        d p_k / d s_j = p_k (delta_kj - p_j),   d p_k / d sink = -p_k p_sink
        dL/dp_k = m_k (dO . v_k) =: dp_k,   D := sum_k p_k dp_k
        dL/ds_j = p_j (dp_j - D) + d_lse p_j,   dL/dsink = -p_sink D + d_lse p_sink
    then through the soft cap (d/dx c tanh(x / c) = 1 - tanh(x / c)**2) and the linear logits
    s_raw_j = scale q . k_j + bias_j.
    """
    pr = _problem(query, key, value, bias, mask, kwargs)
    d_out = _f64(d_out)
    if pr.layout == "thd":
        d_out = d_out[None]
        d_lse = None if d_lse is None else _f64(d_lse)[None]
    else:
        d_out = d_out.reshape((pr.B, pr.T, pr.N, pr.Hv))
        d_lse = None if d_lse is None else _f64(d_lse).reshape((pr.B, pr.T, pr.N))

    dq = np.zeros_like(pr.q)
    dk = np.zeros_like(pr.k)
    dv = np.zeros_like(pr.v)
    dbias = np.zeros((pr.B, pr.N, pr.T, pr.S))
    dsinks = np.zeros(pr.N)
    dargs = [np.zeros((pr.B, pr.N, pr.T, pr.S)) for _ in pr.float_args]
    for b in range(pr.B):
        for n in range(pr.N):
            kh = n // (pr.N // pr.K)
            for i in range(pr.T):
                p, lse, vis, s_mod = pr.row_softmax(b, n, i)
                g_lse = 0.0 if d_lse is None else d_lse[b, i, n]
                if lse == -np.inf:
                    continue  # no visible key and no sink: out = 0 and lse = -inf are constants
                do = d_out[b, i, n]
                pd = pr.dropped(p, b, n, i)
                dv[b, :, kh, :] += np.outer(pd, do)
                dp = pr.v[b, :, kh, :] @ do
                if pr.keep_scaled is not None:
                    dp = dp * pr.keep_scaled[b, n, i]
                D = float(np.sum(p * dp))
                ds = p * (dp - D) + g_lse * p
                if pr.sinks is not None:
                    p_sink = math.exp(pr.sinks[n] - lse)
                    dsinks[n] += p_sink * (g_lse - D)
                if pr.cap is not None:
                    ds = ds * (1.0 - np.tanh(np.where(vis, s_mod, 0.0) / pr.cap) ** 2)
                ds = np.where(vis, ds, 0.0)
                if pr.score_mod is not None:
                    # ds is w.r.t. score_mod's output: chain to the raw score and the float arguments
                    s_raw = pr.row_scores(b, n, i)[0]
                    dscore, dfargs = pr.score_mod_grads(b, n, i, s_raw, vis)
                    for m, df in enumerate(dfargs):
                        dargs[m][b, n, i] = ds * df
                    ds = ds * dscore
                dbias[b, n, i] = ds
                dq[b, i, n] = pr.scale * (ds @ pr.k[b, :, kh, :])
                dk[b, :, kh, :] += pr.scale * np.outer(ds, pr.q[b, i, n])

    grads = {}
    if pr.layout == "thd":
        grads["query"], grads["key"], grads["value"] = dq[0], dk[0], dv[0]
    elif pr.layout == "paged":
        grads["query"] = dq.reshape(np.shape(query))
        pool_k = np.zeros(np.shape(key))
        pool_v = np.zeros(np.shape(value))
        for b in range(pr.B):
            for j in range(pr.S):
                page = pr.page_table[b, j // pr.page_size]
                pool_k[page, j % pr.page_size] += dk[b, j]
                pool_v[page, j % pr.page_size] += dv[b, j]
        grads["key"], grads["value"] = pool_k, pool_v
    else:
        grads["query"] = dq.reshape(np.shape(query))
        grads["key"] = dk.reshape(np.shape(key))
        grads["value"] = dv.reshape(np.shape(value))
    if bias is not None:
        full = tuple(pr.batch_shape) + (pr.N, pr.T, pr.S)
        grads["bias"] = _unbroadcast(dbias.reshape(full), np.shape(bias))
    if pr.sinks is not None:
        grads["sinks"] = dsinks
    if pr.args:
        full = tuple(pr.batch_shape) + (pr.N, pr.T, pr.S)
        grads["score_mod_args"] = [None] * len(pr.args)
        for m, k in enumerate(pr.float_args):
            grads["score_mod_args"][k] = _unbroadcast(dargs[m].reshape(full), pr.arg_shapes[k])
    return grads


def visibility(query, key, value, bias=None, mask=None, **kwargs) -> np.ndarray:
    """Boolean `[B, N, T, S]` (flattened `*B`): the reference's "may attend" relation, for test bookkeeping."""
    pr = _problem(query, key, value, bias, mask, kwargs)
    vis = np.zeros((pr.B, pr.N, pr.T, pr.S), dtype=bool)
    for b in range(pr.B):
        for n in range(pr.N):
            for i in range(pr.T):
                vis[b, n, i] = pr.visible(b, n, i)
    return vis
