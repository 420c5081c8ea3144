"""GPU probes of the cuDNN limits that name a version: each runs its case on the loaded cuDNN and checks support.py.

attnlib supports cuDNN 9.19 to 9.27. Several limits of `attnlib/_src/backends/cudnn/support.py` (and `modifier.py`,
`varlen.py`) were measured on cuDNN 9.19. Each test here takes one such case past attnlib's policy
(`support.decline_reason` patched to serve it, plus, where attnlib has no code path for the case, the smallest patch
of its graph plan that expresses it), runs cuDNN's graphs, and compares out, lse and the gradients with the `xla`
implementation in float32 on the same bfloat16 values (the tolerances of `test_cudnn_gpu._compare`: out `2 eps`,
`rtol eps`; lse `2 eps`; gradients `8 eps max|expected|`, `rtol eps`). The outcome is

- `"ok"`: cuDNN built the graphs and the results are within tolerance;
- `"wrong"`: it built them and a result is outside tolerance (or a row that must be zero is not);
- `"rejected: <message>"`: cuDNN (or the frontend) refused the graph (`graphs.GraphRejected`) or its execution.

With `ATTNLIB_LIMITS_JSON` set, each test appends one JSON line to that file:
`{"limit": <id>, "cudnn": <version int>, "outcome": ..., "policy": <support.py's reason, or null>, ...}`.
Then it asserts that the policy agrees with the outcome on the loaded version: a case support.py declines that
runs correctly fails with "the limit can be lifted from cuDNN X"; a case support.py serves that is wrong or rejected
fails. On cuDNN 9.19 every test passes with today's policy; on a newer cuDNN the failures name the limits to lift.

Limits probed (id: where, what):

- `score_mod_args_batch_dims`: support.py `_modifier_reason` ("cuDNN 9.19 reads score_mod tensors with a batch
  dimension wrongly"). Probe: a score_mod reading a `[B, N, 1, 1]` argument, bound to the graph with its batch dim.
- `modifier_per_sequence_offsets`: support.py `policy_reason` ("cuDNN 9.19 cannot compare index tensors against
  per-sequence offsets"; `modifier.visibility_as_bias`). Probe: a mask_mod comparing `q_idx + offset[b]` with
  `kv_idx`, the offsets a `[B, 1, 1, 1]` argument (what a per-sequence diagonal inside the modifier needs).
- `modifier_with_bias`: support.py `_modifier_reason` ("with a mask_mod alone the H200 gave wrong results with cuDNN
  9.19"). Probe: a mask_mod with a `bias` (the order of bias and modifier does not matter for a mask alone).
- `padding_mask_with_score_mod`: support.py `_layout_reason` (THD with `score_mod`/`mask_mod`/`logits_soft_cap`:
  "cuDNN 9.19 refuses its padding mask together with a score modifier"). Probe: a dense graph with cuDNN's own
  padding mask and a soft cap (keys past the lengths hidden only by that mask). Lifting it also needs varlen.py to
  wire the modifier into the ragged graphs.
- `causal_mask_with_score_mod` (report only): modifier.py ("cuDNN 9.19 refuses its own causal, window and padding
  masks together with a score_mod"): attnlib puts the causal mask into the modifier, which serves every call; cuDNN's
  own band would let it skip masked tiles natively. No policy to contradict: the outcome is reported, not asserted.
- `fp8_bottom_right_hopper`: support.py `fp8_reason` ("cuDNN 9.19 rejects it on sm_90: 'sdpa fp8 forward operation
  is only supported on Blackwell'"). Probe: an `fp8="current"` bottom-right causal call with T < S (Hopper or newer),
  judged as tests/test_fp8_gpu.py judges FP8 results.
- `writes_padding_zeros`: support.py `writes_padding_zeros` (9.19.x and 9.27.x: padded dense top-left graphs need
  no memset because cuDNN writes zeros past the lengths). Probe: attnlib's padded graphs run on result buffers
  pre-filled with NaN (aliased into the FFI call), then a padded call end to end with the memset off.

Version gates of cuDNN frontend 1.32.0 (the C++ headers under `native/third_party/cudnn_frontend/include` and the
`cudnn` Python package) that matter for attention on Hopper, and where attnlib stands (`h:N` is line N of
`cudnn_frontend/node/scaled_dot_product_flash_attention.h`, other files relative to `include/`):

- 9.21: MXFP8 SDPA (`sdpa_mxfp8`; node/scaled_dot_product_flash_attention.h:343, sdpa_fp8_bwd.h:358); the forward's
  softmax lowered to cuDNN's unified softmax operation (h:2595; whether that lifts 9.19's "Stats or
  score_max/sum_exp, not both" of graph_spec.py `row_max` is not checked here); override shapes on an operation
  graph (OperationGraph.h:296). attnlib: per-tensor FP8 only; graphs are bucketed instead of re-shaped. Not probed.
- 9.22: LOGICAL reshape mode (Operation.h:1808) and `COMPILE_TIME_CONST` scalars (score_mod_lowering/ops.py: attnlib
  binds its constants as RUNTIME_PARAM scalars, which every version takes). Not probed.
- 9.23: Blackwell backward with H = Hv = 256 (h:1409): support.py already gates it on 92300 (sm_100 only).
- 9.24: fused RoPE forward/backward nodes (node/rope.h:71, rope_backward.h:71) - attnlib takes rotated q and k and
  has no RoPE op, so there is nothing to fuse it with; cumulative sequence lengths (`cu_seq_len_q/kv`, `[B+1]` prefix
  sums) in the unified SDPA node (h:2799) - attnlib's THD graphs take 64-bit ragged offsets it builds on device
  (ragged.py), which serve every version; reduction group offsets (node/reduction.h:160). Not probed.
- 9.25: deterministic backward on Hopper by ordered dQ accumulation (STAGES = 4), workspace linear in the sequence
  length instead of the dP workspace `b * N * ceil64(T) * ceil128(S) * 2` bytes, opt-in through the environment
  variable `CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT` (h:1808-1840). attnlib serves `deterministic_backward=True` on
  Hopper with the default dP path; the ordered path would let long (THD) sequences train deterministically where
  the dP workspace does not fit. attnlib can express it (the variable is read when a graph is built): probed by
  `test_hopper_deterministic_ordered_dq`. Also 9.25: FP8/MXFP8 in the unified SDPA node (h:2997), BYTE_BOOLEAN
  tensors (utils.h:1107). Not probed.
- 9.26: ragged backward with a sink token (h:1372, sdpa_fp8_bwd.h:198) - attnlib does not need it: varlen.py runs
  a sink-free backward graph on the forward's Stats and computes the sink gradient in JAX (tests/
  test_cudnn_ragged_gpu.py `test_thd_sinks_and_lse_gradient` checks it on every version); the backward reading a
  non-ragged Stats input in a layout other than packed `[B, N, T]` (h:1570) - attnlib writes packed Stats and
  transposes to `[B, T, N]` lse, a small pass a token-major layout would save; probed by
  `test_token_major_stats_in_the_backward` (report only: attnlib does not use it yet). Also 9.26: FP8_E5M3
  (utils.h:1147), FP8 forward with H = Hv = 256 and Block_mask on sm_100 (sdpa_support_surface.h:115, 242).
- 9.27: `stats_use_log2` (base-2 Stats; sdpa_support_surface.h:494). attnlib's lse is natural-log by contract.
  Not probed.

The frontend's Python ("FROST") engines serve some of these without the backend's version; attnlib never runs them
(their plans cannot be serialized for its C++ executor: graphs.backend_plan_indices), so only the backend's gates
count.

Run on a GPU: `ATTNLIB_LIMITS_JSON=$OUT/limits.jsonl python3 -m pytest -q -m gpu
tests/test_cudnn_version_limits_gpu.py`.
"""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cudnn_gpu import _compare, _qkv


pytestmark = pytest.mark.gpu

# Small odd sizes, T != S, N != K (the whole file runs in well under a minute on an H200).
B, T, S, N, K, H = 2, 37, 53, 6, 2, 64
DTYPE = jnp.bfloat16


# ------------------------------------------------------------------------------------------------------------------
# probing and reporting


def _device():
    from attnlib._src.backends.cudnn import support

    return support.device()


def _version_text() -> str:
    from attnlib._src.backends.cudnn import support

    return support.version_string(_device().cudnn_version)


def _probe(run) -> tuple[str, str]:
    """`(outcome, detail)` of `run()`: "ok", "wrong" (an assertion of the comparison failed) or "rejected: ..."."""
    try:
        run()
    except NotImplementedError as e:  # graphs.GraphRejected: cuDNN or the frontend refused the graph
        return f"rejected: {e}", ""
    except jax.errors.JaxRuntimeError as e:  # the graph built but its execution failed
        return f"rejected: execution failed: {e}", ""
    except AssertionError as e:
        return "wrong", str(e).splitlines()[0][:500]
    return "ok", ""


def _report(limit: str, outcome: str, policy: str | None, **extra) -> None:
    """Append the probe's JSON line to `$ATTNLIB_LIMITS_JSON` (when set)."""
    path = os.environ.get("ATTNLIB_LIMITS_JSON")
    if not path:
        return
    line = {"limit": limit, "cudnn": _device().cudnn_version, "outcome": outcome, "policy": policy, **extra}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def _judge(limit: str, outcome: str, detail: str, policy: str | None, *, lift: str = "", **extra) -> None:
    """Report, then fail where support.py's `policy` (its reason to decline, None = it serves the case) disagrees
    with the probe's outcome on the loaded cuDNN.

    Args:
        lift: what lifting the limit involves, for the failure message.
    """
    _report(limit, outcome, policy, detail=detail or None, **extra)
    v = _version_text()
    if policy is not None and outcome == "ok":
        pytest.fail(
            f"{limit}: cuDNN {v} runs this case correctly, but support.py declines it ({policy}). The limit can be "
            f"lifted from cuDNN {v}{' (' + lift + ')' if lift else ''}."
        )
    if policy is None and outcome != "ok":
        pytest.fail(f"{limit}: support.py serves this case on cuDNN {v}, but the probe gave {outcome} {detail}")


def _policy(q, k, v, **kw) -> str | None:
    """support.py's reason to decline the call on this GPU and cuDNN (None: it serves it). Call before patching."""
    import attnlib

    return attnlib.explain(q, k, v, implementation="cudnn", **kw).declined.get("cudnn")


def _serve_everything(monkeypatch) -> None:
    """Let the cuDNN implementation build graphs for any call: cuDNN itself decides."""
    from attnlib._src.backends.cudnn import support

    monkeypatch.setattr(support, "decline_reason", lambda config, device=None: None)


def _bind_batch_args(monkeypatch) -> None:
    """Bind `score_mod_args` with a batch dim to the graph as `[B, N|1, T|1, S|1]` (attnlib binds `[1, ...]`, and its
    policy declines batch dims), with a fresh cache of composed modifiers (the library's is restored afterwards)."""
    from attnlib._src.backends.cudnn import attention as dense, modifier

    def arg_dims(config, t, s):
        if config.modifiers is None:
            return ()
        dims = []
        for shape in config.modifiers.arg_shapes:
            full = (1,) * (4 - min(len(shape), 3)) + tuple(shape[-3:])
            n, tt, ss = full[1:]
            b = config.batch_size if any(d != 1 for d in shape[:-3]) else 1
            dims.append((b, n, t if tt != 1 else 1, s if ss != 1 else 1))
        return tuple(dims)

    def modifier_args(config, inputs, t, s, skip):
        args = []
        for x, dims in zip(inputs.score_mod_args, arg_dims(config, t, s), strict=True):
            x = jnp.asarray(x)
            batch = int(np.prod(x.shape[:-3], dtype=np.int64)) if x.ndim > 3 else 1
            x = jnp.reshape(x, (batch,) + (1,) * (3 - min(x.ndim, 3)) + x.shape[-3:])
            if x.shape[2] != 1:
                x = x[:, :, skip:, :]
            args.append(jnp.broadcast_to(x, dims).astype(jnp.float32))
        return tuple(args)

    monkeypatch.setattr(modifier, "arg_dims", arg_dims)
    monkeypatch.setattr(modifier, "_build", functools.lru_cache(maxsize=256)(modifier._build.__wrapped__))
    monkeypatch.setattr(dense, "_modifier_args", modifier_args)


def _patch_specs(monkeypatch, *, config_change: dict | None = None, **spec_change) -> None:
    """Make attnlib's dense plans (`attention.make_plan`) from `config` changed by `config_change`, with
    `spec_change` applied to their forward and backward graph specs."""
    from attnlib._src.backends.cudnn import attention as dense

    make_plan = dense.make_plan

    def patched(config, *args, **kwargs):
        plan = make_plan(dataclasses.replace(config, **(config_change or {})), *args, **kwargs)
        return dataclasses.replace(
            plan, fwd=dataclasses.replace(plan.fwd, **spec_change), bwd=dataclasses.replace(plan.bwd, **spec_change),
            inference=None,
        )  # fmt: skip

    monkeypatch.setattr(dense, "make_plan", patched)


# ------------------------------------------------------------------------------------------------------------------
# score modifiers


def _batch_alibi(score, batch, head, q_idx, kv_idx, slope):
    return score - slope * jnp.abs(q_idx - kv_idx).astype(jnp.float32)


def _shifted_causal(batch, head, q_idx, kv_idx, offset):
    return q_idx.astype(jnp.float32) + offset >= kv_idx.astype(jnp.float32)


def _documents(batch, head, q_idx, kv_idx):
    return q_idx // 8 == kv_idx // 8


def _lengths(values):
    return jnp.asarray(values, jnp.int32)


def test_score_mod_args_batch_dims(monkeypatch):
    """A score_mod argument `[B, N, 1, 1]` (a slope per example and head) bound with its batch dim."""
    q, k, v = _qkv(1, (B,), T, S, N, K, H, H, DTYPE)
    slopes = 2.0 ** -(1.0 + jnp.arange(B * N, dtype=jnp.float32).reshape(B, N, 1, 1) / 3.0)
    kw = dict(score_mod=_batch_alibi, score_mod_args=(slopes,), is_causal=True)
    policy = _policy(q, k, v, **kw)
    _bind_batch_args(monkeypatch)
    _serve_everything(monkeypatch)
    outcome, detail = _probe(lambda: _compare(q, k, v, kw, dtype=DTYPE))
    _judge("score_mod_args_batch_dims", outcome, detail, policy,
           lift="drop the batch-dims check of support._modifier_reason and bind the batch dim as this test's "
                "`_bind_batch_args` does")  # fmt: skip


def test_modifier_per_sequence_offsets(monkeypatch):
    """A mask_mod comparing `q_idx + offset[b]` with `kv_idx`, the offsets a `[B, 1, 1, 1]` argument: what a
    per-sequence diagonal (packed rows, or lengths with a bottom-right diagonal) inside the modifier needs. The
    policy case is a padded bottom-right call whose score_mod reads `q_idx`, which support.py declines."""
    q, k, v = _qkv(2, (B,), T, S, N, K, H, H, DTYPE)
    offsets = jnp.asarray([S - T, 5], jnp.float32).reshape(B, 1, 1, 1)
    kw = dict(mask_mod=_shifted_causal, score_mod_args=(offsets,))
    policy = _policy(q, k, v, score_mod=lambda s, b, h, i, j: s - 0.01 * jnp.abs(i - j).astype(jnp.float32),
                     is_causal=True, diagonal_alignment="bottom_right", query_seq_lengths=_lengths([T, T - 9]),
                     key_value_seq_lengths=_lengths([S - 11, S]))  # fmt: skip
    _bind_batch_args(monkeypatch)
    _serve_everything(monkeypatch)
    outcome, detail = _probe(lambda: _compare(q, k, v, kw, dtype=DTYPE))
    _judge("modifier_per_sequence_offsets", outcome, detail, policy,
           lift="pass each sequence's diagonal offset as a batch-dim modifier argument instead of the visibility "
                "bias (modifier.visibility_as_bias); needs score_mod_args_batch_dims lifted too")  # fmt: skip


def test_modifier_with_bias(monkeypatch):
    """A mask_mod (documents of 8 tokens) with a `[1, N, T, S]` bias, dbias included."""
    q, k, v = _qkv(3, (B,), T, S, N, K, H, H, DTYPE)
    bias = (0.5 * jax.random.normal(jax.random.key(33), (1, N, T, S), jnp.float32)).astype(DTYPE)
    kw = dict(mask_mod=_documents, bias=bias)
    policy = _policy(q, k, v, **kw)
    _serve_everything(monkeypatch)
    outcome, detail = _probe(lambda: _compare(q, k, v, kw, dtype=DTYPE))
    _judge("modifier_with_bias", outcome, detail, policy,
           lift="serve a bias with a mask_mod alone; a score_mod or soft cap still needs the bias first, which "
                "cuDNN does not do")  # fmt: skip


def _packed_policy(**kw) -> str | None:
    """support.py's verdict on a THD call (two sequences of 20 and 17 tokens) with `kw`."""
    q, k, v = _qkv(4, (), 37, 37, N, K, H, H, DTYPE)
    return _policy(q, k, v, cu_seqlens_q=jnp.asarray([0, 20, 37], jnp.int32), **kw)


def test_padding_mask_with_score_mod(monkeypatch):
    """cuDNN's own padding mask in a graph with a soft cap: attnlib's modifier graphs otherwise carry key padding in
    a bias, and the probe drops it, so only cuDNN's mask hides the padded keys (results it leaves unwritten are
    zero-filled). The policy case is THD with a soft cap."""
    from attnlib._src.backends.cudnn import attention as dense

    q, k, v = _qkv(5, (B,), T, S, N, K, H, H, DTYPE)
    kw = dict(logits_soft_cap=20.0, query_seq_lengths=_lengths([T, T - 9]), key_value_seq_lengths=_lengths([S - 11, S]))
    policy = _packed_policy(logits_soft_cap=20.0)
    mask_bias = dense._mask_bias

    def without_key_padding(config, inputs, b, n, t, s, skip, seq_kv, dtype, visibility=None):
        return mask_bias(config, inputs, b, n, t, s, skip, None, dtype, visibility)

    _serve_everything(monkeypatch)
    monkeypatch.setattr(dense, "_mask_bias", without_key_padding)
    _patch_specs(monkeypatch, padding=True, memset_rows=True)
    outcome, detail = _probe(lambda: _compare(q, k, v, kw, dtype=DTYPE))
    _judge("padding_mask_with_score_mod", outcome, detail, policy,
           lift="support._layout_reason's THD + modifier check; varlen.py must then pass the modifier to its ragged "
                "graphs")  # fmt: skip


def test_causal_mask_with_score_mod(monkeypatch):
    """Report only: cuDNN's own causal band in a graph with a soft cap (attnlib puts causal into the modifier)."""
    q, k, v = _qkv(6, (B,), T, S, N, K, H, H, DTYPE)
    kw = dict(logits_soft_cap=20.0, is_causal=True)
    _serve_everything(monkeypatch)
    _patch_specs(monkeypatch, config_change=dict(is_causal=False), right_bound=0)
    outcome, detail = _probe(lambda: _compare(q, k, v, kw, dtype=DTYPE))
    _report("causal_mask_with_score_mod", outcome, None, detail=detail or None,
            note="report only: attnlib masks inside the modifier on every version (modifier.py)")  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# FP8


def test_fp8_bottom_right_hopper(monkeypatch):
    """`fp8="current"`, causal bottom-right with T < S: the FP8 forward graph keeps the bottom-right mask. Judged as
    tests/test_fp8_gpu.py judges FP8 (error within 1.5x rms / 2x max of the float64 FP8 reference's, lse `2 eps`
    of the emulation's, gradients the 16-bit backward at the dequantized inputs)."""
    from reference import reference_attention, reference_fp8_attention
    from test_fp8 import _quantized, _ref_kwargs
    from test_fp8_gpu import _backward_model, _dequantized, _errors, _inputs

    import attnlib

    if _device().compute_capability < (9, 0):
        pytest.skip("FP8 attention needs compute capability 9.0 or newer")
    q, k, v, kw = _inputs("bottom_right_t_lt_s", jnp.bfloat16)
    policy = _policy(q, k, v, fp8="current", **kw)
    _serve_everything(monkeypatch)
    attend = lambda q, k, v: attnlib.attention(  # noqa: E731
        q, k, v, fp8="current", implementation="cudnn", return_residual=True, **kw
    )

    def run():
        out, lse = jax.jit(attend)(q, k, v)
        (q8, dq), (k8, dk), (v8, dv) = _quantized(q), _quantized(k), _quantized(v)
        fp8_reference, _ = reference_fp8_attention(q8, k8, v8, scales=(dq, dk, dv), **_ref_kwargs(kw))
        exact, _ = reference_attention(q8 * dq, k8 * dk, v8 * dv, **_ref_kwargs(kw))
        rms, worst = _errors(out, exact)
        r_rms, r_worst = _errors(fp8_reference, exact)
        assert rms <= 1.5 * r_rms and worst <= 2 * r_worst, (
            f"out: cuDNN FP8 error rms {rms:.3g} / max {worst:.3g}; the FP8 reference's {r_rms:.3g} / {r_worst:.3g}"
        )
        _, e_lse = attnlib.attention(q, k, v, fp8="current", implementation="xla", return_residual=True, **kw)
        lse, e_lse = np.asarray(lse), np.asarray(e_lse)
        assert np.array_equal(np.isneginf(lse), np.isneginf(e_lse)), "lse: rows that see no key differ"
        finite = np.isfinite(e_lse)
        np.testing.assert_allclose(lse[finite], e_lse[finite], atol=2 * 2.0**-7, rtol=0, err_msg="lse")
        d_out = jax.random.normal(jax.random.key(4), q.shape, jnp.float32).astype(jnp.bfloat16)
        _, vjp = jax.vjp(attend, q, k, v)
        grads = jax.jit(vjp)((d_out, jnp.zeros_like(lse)))
        q_hat, k_hat, v_hat = (jnp.asarray(x, jnp.float32).astype(jnp.bfloat16) for x in _dequantized(q, k, v))
        expected = _backward_model(q_hat, k_hat, v_hat, out, lse, d_out, kw)
        eps = 2.0**-7
        for name, g, e in zip(("dquery", "dkey", "dvalue"), grads, expected, strict=True):
            g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
            err, bound = np.abs(g - e), 8 * eps * np.max(np.abs(e)) + eps * np.abs(e)
            assert np.all(err <= bound), f"{name}: max |err| {err.max():.3g} (bound {bound.max():.3g})"

    outcome, detail = _probe(run)
    _judge("fp8_bottom_right_hopper", outcome, detail, policy,
           lift=f"support.fp8_reason's Blackwell-only check for bottom-right on sm_"
                f"{''.join(map(str, _device().compute_capability))}")  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# rows past the lengths


def _nan_prefilled_run(spec, values: dict, prefilled) -> tuple[jax.Array, ...]:
    """The outputs of `spec`'s graph (attnlib's built graph, run by its FFI target) with the results `prefilled`
    (uids) starting as NaN: each is an extra operand aliased to its result, bound to the graph through the operand
    (the executor looks a graph uid up among the operands first), so a row cuDNN does not write stays NaN.

    `spec` must be a graph no other call of the process runs: the extension shares one deserialized plan, with its
    map from graph uids to operands, among the calls of a blob."""
    from attnlib._src.backends.cudnn import executor, ffi

    entry = executor.get_entry(spec)
    outs = spec.out_uids()
    results = [jax.ShapeDtypeStruct(*spec.shape(u)) for u in outs]
    if entry.workspace_bytes > 0:
        results.append(jax.ShapeDtypeStruct((entry.workspace_bytes,), jnp.uint8))
    first = len(spec.in_uids())
    call = jax.ffi.ffi_call(
        ffi.TARGET, results, input_output_aliases={first + i: outs.index(u) for i, u in enumerate(prefilled)}
    )

    def run(*operands):
        nans = [jnp.full(spec.shape(u)[0], jnp.nan, spec.shape(u)[1]) for u in prefilled]
        return call(
            *operands, *nans, graph=np.frombuffer(entry.blob, np.uint8), label=entry.label,
            in_uids=np.asarray(tuple(spec.in_uids()) + tuple(prefilled), np.int64),
            out_uids=np.asarray(entry.out_uids, np.int64), ws_bytes=np.int64(entry.workspace_bytes),
            zero_fill=np.zeros((0,), np.int64), replay=False,
        )  # fmt: skip

    return jax.jit(run)(*[values[u] for u in spec.in_uids()])[: len(outs)]


def _all_zero(x, what: str) -> None:
    a = np.asarray(jnp.asarray(x, jnp.float32))
    assert np.all(a == 0), (
        f"{what}: {int(np.isnan(a).sum())} of {a.size} values unwritten (NaN), {int(((a != 0) & ~np.isnan(a)).sum())} "
        "nonzero"
    )


def _rows_written_as_zero() -> None:
    """attnlib's padded top-left graphs (as `attention.make_plan` builds them without the memset), run on NaN
    result buffers with the lengths attnlib gives them: O, dQ past the query lengths and dK, dV past the key
    lengths are 0, and a sequence without query rows (a sequence without keys gets one key and 0 trimmed rows:
    `attention._graph_seq_kv`) is 0 throughout."""
    from attnlib._src.backends.cudnn.graphs import GraphSpec, Uid

    b, t, s = 3, 41, 59
    seq_q, seq_kv = _lengths([t - 6, 11, 0]), _lengths([s - 13, s, 1])
    common = dict(dtype="bfloat16", b=b, t=t, s=s, n=N, k=K, h=H, hv=H, scale=H**-0.5, padding=True, right_bound=0)
    fwd, bwd = GraphSpec(direction="fwd", **common), GraphSpec(direction="bwd", **common)
    q, k, v = _qkv(7, (b,), t, s, N, K, H, H, DTYPE)
    d_out = jax.random.normal(jax.random.key(70), (b, t, N, H), jnp.float32).astype(DTYPE)
    out, stats = _nan_prefilled_run(fwd, {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.SEQ_Q: seq_q, Uid.SEQ_KV: seq_kv},
                                    (Uid.O, Uid.STATS))  # fmt: skip
    for i, n in enumerate((t - 6, 11)):
        assert np.all(np.isfinite(np.asarray(out[i, :n], np.float32))), f"O rows below seq_len_q of sequence {i}"
    _all_zero(out[0, t - 6 :], "O rows past seq_len_q")
    _all_zero(out[1, 11:], "O rows past seq_len_q")
    _all_zero(out[2], "O of a sequence without query rows")
    clean = lambda x: jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))  # noqa: E731
    values = {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: clean(out), Uid.DO: d_out, Uid.STATS: clean(stats),
              Uid.SEQ_Q: seq_q, Uid.SEQ_KV: seq_kv}  # fmt: skip
    dq, dk, dv = _nan_prefilled_run(bwd, values, (Uid.DQ, Uid.DK, Uid.DV))
    _all_zero(dq[0, t - 6 :], "dQ rows past seq_len_q")
    _all_zero(dq[1, 11:], "dQ rows past seq_len_q")
    _all_zero(dk[0, s - 13 :], "dK rows past seq_len_kv")
    _all_zero(dv[0, s - 13 :], "dV rows past seq_len_kv")
    for name, x in (("dQ", dq), ("dK", dk), ("dV", dv)):
        _all_zero(x[2], f"{name} of a sequence without query rows")


def _padded_call_without_memset() -> None:
    """A padded call end to end (a sequence without keys included) with attnlib's memset off: matches the
    reference, and rows past the lengths are exactly 0 in out, dq, dk and dv."""
    q, k, v = _qkv(8, (B,), T, S, N, K, H, H, DTYPE)
    ql, kl = [T - 6, 20], [S - 13, 0]
    kw = dict(query_seq_lengths=_lengths(ql), key_value_seq_lengths=_lengths(kl), is_causal=True)
    out, lse, (dq, dk, dv) = _compare(q, k, v, kw, dtype=DTYPE)
    for i in range(B):
        _all_zero(out[i, ql[i] :], f"out rows past the query length of sequence {i}")
        _all_zero(dq[i, ql[i] :], f"dq rows past the query length of sequence {i}")
        _all_zero(dk[i, kl[i] :], f"dk rows past the key length of sequence {i}")
        _all_zero(dv[i, kl[i] :], f"dv rows past the key length of sequence {i}")


def test_writes_padding_zeros(monkeypatch):
    """`support.writes_padding_zeros` holds on the loaded cuDNN: where it says cuDNN writes zeros past the lengths,
    it does (with the memset off), and where it says it does not, the probe shows whether it could."""
    from attnlib._src.backends.cudnn import attention as dense, support

    version = _device().cudnn_version
    relied_on = support.writes_padding_zeros(version)
    monkeypatch.setattr(dense, "_memset_rows", lambda padded, device=None: False)

    def run():
        _rows_written_as_zero()
        _padded_call_without_memset()

    outcome, detail = _probe(run)
    policy = None if relied_on else f"support.writes_padding_zeros({version}) is False: padded calls memset first"
    _judge("writes_padding_zeros", outcome, detail, policy,
           lift=f"widen support.writes_padding_zeros to include {version} and drop the memset")  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# newer-cuDNN Hopper features attnlib can express


def test_hopper_deterministic_ordered_dq(monkeypatch):
    """cuDNN 9.25+ on Hopper: `deterministic_backward` by ordered dQ accumulation (workspace linear in the sequence
    length), chosen when `CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT` caps the dP workspace (0: never). attnlib serves
    deterministic backward on Hopper on every version, so it must be bitwise reproducible and correct either way; the
    report says whether the linear-workspace path was taken (a smaller workspace than the default plan's)."""
    import attnlib
    from attnlib._src.backends.cudnn import cache, executor, graphs
    from attnlib._src.backends.cudnn.graphs import GraphSpec

    if _device().compute_capability[0] != 9:
        pytest.skip("the ordered-dQ deterministic backward is a Hopper (sm_90) path")
    t, s = 45, 131
    q, k, v = _qkv(9, (B,), t, s, N, K, H, H, DTYPE)
    kw = dict(is_causal=True, deterministic_backward=True)
    policy = _policy(q, k, v, **kw)
    spec = GraphSpec(direction="bwd", dtype="bfloat16", b=B, t=t, s=s, n=N, k=K, h=H, hv=H, scale=H**-0.5,
                     right_bound=0, deterministic=True)  # fmt: skip
    monkeypatch.delenv("CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT", raising=False)
    default_ws = graphs.build(spec).workspace_bytes
    monkeypatch.setenv("CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT", "0")
    monkeypatch.setattr(executor, "CACHE", cache.GraphCache(directory=None))  # graphs built with the variable set
    ordered_ws = graphs.build(spec).workspace_bytes

    def loss(q, k, v):
        out = attnlib.attention(q, k, v, implementation="cudnn", **kw)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    def run():
        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        first = g(q, k, v)
        for _ in range(3):
            for a, b in zip(first, g(q, k, v)):
                assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)), (
                    "deterministic backward: gradients differ between runs"
                )
        _compare(q, k, v, kw, dtype=DTYPE)

    outcome, detail = _probe(run)
    _judge("hopper_deterministic_ordered_dq", outcome, detail, policy, default_workspace_bytes=default_ws,
           ordered_workspace_bytes=ordered_ws, linear_workspace=ordered_ws < default_ws)  # fmt: skip


def test_token_major_stats_in_the_backward(monkeypatch):
    """Report only: cuDNN 9.26+ reads a dense backward's Stats in a layout other than packed `[B, N, T]`. The probe
    has the forward write token-major `[B, T, N]` Stats (the layout of attnlib's lse, `GraphSpec.ragged_stats`'s
    strides) and the backward read them; attnlib's lse then comes out as that memory read as `[B, N, T]`, which the
    probe undoes before comparing. attnlib does not use this layout yet (it would save the lse transpose)."""
    import attnlib

    q, k, v = _qkv(10, (B,), T, S, N, K, H, H, DTYPE)
    kw = dict(is_causal=True)
    _patch_specs(monkeypatch, ragged_stats=True)
    cot = jax.random.normal(jax.random.key(11), (B, T, N, H), jnp.float32)

    def run(impl, q, k, v):
        def f(q, k, v):
            return attnlib.attention(q, k, v, implementation=impl, return_residual=True, **kw)

        def loss(q, k, v):
            return jnp.sum(f(q, k, v)[0].astype(jnp.float32) * cot)

        with jax.default_matmul_precision("highest"):
            return jax.jit(f)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    def check():
        from test_cudnn_gpu import _assert_close, _eps

        (out, lse), grads = run("cudnn", q, k, v)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        (r_out, r_lse), r_grads = run("xla", f32(q), f32(k), f32(v))
        lse = jnp.reshape(jnp.swapaxes(lse, 1, 2), (B, T, N))  # the token-major memory attnlib read as [B, N, T]
        e = _eps(DTYPE)
        _assert_close(out, r_out, 2 * e, e, "out")
        _assert_close(lse, r_lse, 2 * e, 0.0, "lse")
        for name, g, rg in zip(("dq", "dk", "dv"), grads, r_grads):
            _assert_close(g, rg, 8 * e, e, name, scale_by_max=True)

    outcome, detail = _probe(check)
    _report("token_major_stats_in_the_backward", outcome, None, detail=detail or None,
            note="report only: attnlib writes packed [B, N, T] Stats on every version")  # fmt: skip
