"""`attnlib.attention`: the public function, and `attnlib.explain`."""

import functools
import inspect
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype, BeartypeConf
from jaxtyping import Array, ArrayLike, Float, jaxtyped, PRNGKeyArray, Shaped, TypeCheckError

from . import dispatch, fp8 as fp8_lib, max_logit as max_logit_lib, validation
from .config import ARRAY_ARGUMENTS, AttentionConfig, AttentionInputs
from .paged_pools import PagedPools


# Array shapes and dtypes are checked by `validation` (with attnlib's messages: shapes are documented in the
# docstring); beartype checks the kinds of arguments. Ints pass where floats are annotated.
_typechecker = beartype(conf=BeartypeConf(is_pep484_tower=True))


def _readable_type(annotation: str) -> str:
    """An annotation as beartype prints it, the way a user writes it: `<class 'bool'>` -> `bool`,
    `attnlib._src.fp8.Fp8Scales` -> `attnlib.Fp8Scales`, `collections.abc.Sequence[Any]` -> `a sequence`."""
    text = re.sub(r"<class '([\w.]+)'>", r"\1", annotation)
    text = re.sub(r"\bbool \| numpy\.bool_?\b", "bool", text)  # NumPy bools are accepted quietly
    text = text.replace("attnlib._src.paged_pools.PagedPools", "attnlib.PagedKVCache")  # the cache's base class
    text = re.sub(r"attnlib\._src(?:\.\w+)*\.(\w+)", r"attnlib.\1", text)
    text = re.sub(r"collections\.abc\.Sequence\[[^\]]*\]", "a sequence (tuple or list)", text)
    text = re.sub(r"collections\.abc\.Callable(\[[^\]]*\])?", "a callable", text)
    return text


def _concise_type_errors(fn: Callable) -> Callable:
    """Re-raise jaxtyping/beartype parameter violations in attnlib's one-sentence style."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TypeCheckError as e:
            text = str(e)
            param = re.search(r"typechecking parameter '(\w+)'", text)
            if param is None or f"parameters of {fn.__module__}.{fn.__qualname__}." not in text:
                raise
            expected = re.search(r"Expected type: (.*)", text)
            actual = re.search(r"Actual value: (.*)", text)
            expected_text = _readable_type(expected.group(1).rstrip(".")) if expected else "of the annotated type"
            actual_text = actual.group(1).rstrip(".") if actual else "another type"
            raise TypeError(f"`{param.group(1)}` must be {expected_text}. Got {actual_text}.") from None

    return wrapper


def _unpack_cache(key: Any, value: Any, page_table: Any, key_value_seq_lengths: Any) -> tuple[Any, ...]:
    """`(key, value, page_table, key_value_seq_lengths, pool_layout)`: a `PagedKVCache` passed as `key` unpacked
    into its pools (the combined pool as both for `"combined"`), page table, lengths and layout
    (docs/semantics.md, `page_table`); bare arrays as given, `pool_layout` None (token-major pools)."""
    if not isinstance(key, PagedPools):
        if isinstance(value, PagedPools):
            raise TypeError("Pass a PagedKVCache as `key` with value=None: attnlib.attention(q, cache, None, ...).")
        if value is None:
            raise TypeError("`value` is required (None only with a PagedKVCache as `key`). Got value=None.")
        return key, value, page_table, key_value_seq_lengths, None
    if value is not None and value is not key:
        raise TypeError(
            "With a PagedKVCache as `key`, pass value=None (the cache holds both pools): "
            f"attnlib.attention(q, cache, None, ...). Got value of type {type(value).__name__}."
        )
    for name, given in (("page_table", page_table), ("key_value_seq_lengths", key_value_seq_lengths)):
        if given is not None:
            raise ValueError(f"With a PagedKVCache as `key`, `{name}` comes from the cache; do not pass it. Got both.")
    k_pool, v_pool = key.pools if len(key.pools) == 2 else key.pools * 2
    return k_pool, v_pool, key.page_table, key.lengths, key.pool_layout


@jax.named_scope("attnlib.attention")
@_concise_type_errors
@jaxtyped(typechecker=_typechecker)
def attention(
    query: Shaped[ArrayLike, "..."],
    key: Shaped[ArrayLike, "..."] | PagedPools,
    value: Shaped[ArrayLike, "..."] | PagedPools | None,
    bias: Shaped[ArrayLike, "..."] | None = None,
    mask: Shaped[ArrayLike, "..."] | None = None,
    *,
    scale: numbers.Real | Shaped[ArrayLike, "..."] | None = None,
    is_causal: bool | np.bool_ = False,
    query_seq_lengths: Shaped[ArrayLike, "..."] | Sequence[int] | None = None,
    key_value_seq_lengths: Shaped[ArrayLike, "..."] | Sequence[int] | None = None,
    local_window_size: numbers.Integral | Sequence[Any] | None = None,
    implementation: dispatch.ImplementationRequest = None,
    return_residual: bool | np.bool_ = False,
    diagonal_alignment: Literal["top_left", "bottom_right"] | str = "top_left",
    q_segment_ids: Shaped[ArrayLike, "..."] | None = None,
    kv_segment_ids: Shaped[ArrayLike, "..."] | None = None,
    max_segments_per_row: numbers.Integral | None = None,
    cu_seqlens_q: Shaped[ArrayLike, "..."] | None = None,
    cu_seqlens_kv: Shaped[ArrayLike, "..."] | None = None,
    max_seqlen_q: numbers.Integral | None = None,
    max_seqlen_kv: numbers.Integral | None = None,
    page_table: Shaped[ArrayLike, "..."] | None = None,
    logits_soft_cap: numbers.Real | None = None,
    sinks: Shaped[ArrayLike, "..."] | None = None,
    dropout_rate: numbers.Real = 0.0,
    dropout_key: PRNGKeyArray | None = None,
    deterministic_backward: bool | np.bool_ = False,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    score_mod_args: Sequence[Any] = (),
    fp8: str | fp8_lib.Fp8Scales | None = None,
    return_max_logit: bool | np.bool_ = False,
) -> Float[Array, "..."] | tuple[Float[Array, "..."], ...]:
    r"""Scaled dot-product attention: a drop-in for `jax.nn.dot_product_attention` that goes further.

    For one sequence and head, with $s = \mathrm{scale} \cdot q k^\top (+\,\mathrm{bias})$, modified by
    `score_mod`, soft-capped ($s \leftarrow c \tanh(s / c)$) and then masked (`mask_mod` AND every built-in mask
    AND `mask`),

    $$p = \frac{e^{s}}{e^{\mathrm{sink}} + \sum_{\mathrm{kept}} e^{s}}, \qquad
      \mathrm{out} = p\, v, \qquad \mathrm{lse} = \log\Big(e^{\mathrm{sink}} + \sum_{\mathrm{kept}} e^{s}\Big).$$

    A query with no visible key (fully masked, padding, segment id 0, past `cu_seqlens_q[-1]`) gets `out = 0` and,
    without sinks, `lse = -inf`; its gradients are 0, never NaN.

    Shapes: `B` batch, `T` query length, `S` key/value length, `N` query heads, `K` key/value heads
    (`N % K == 0`; query head `n` uses key/value head `n // (N // K)`), `H` query/key head dim, `Hv` value head
    dim, `P` pages.

    Args:
        query: `[*B, T, N, H]`; `[T, N, H]` when unbatched or THD.
        key: `[*B, S, K, H]`; a token-major page pool `[P, page_size, K, H]` with `page_table`; or an
            `attnlib.PagedKVCache` in any of its layouts (then `value` is None and the page table and lengths come
            from the cache).
        value: `[*B, S, K, Hv]`; a page pool `[P, page_size, K, Hv]` with `page_table`. Same dtype as `query`
            and `key` (float16, bfloat16, float32, or float64 under `jax_enable_x64` on `xla` / `xla_chunked`;
            float8_e4m3fn with `fp8=Fp8Scales(...)`).
        bias: broadcastable to `[*B, N, T, S]`; added to the scaled logits; differentiable.
        mask: bool, broadcastable to `[*B, N, T, S]`; `True` = may attend.
        scale: logit scale: a Python float (static; on cuDNN baked into the graph) or a 0-d float array, traced
            under `jit` or not (a learned temperature: one graph for every value, no retrace, differentiable;
            not with `fp8=`, and on cuDNN only for dense calls). Defaults to `1/sqrt(H)`.
        is_causal: causal mask, aligned by `diagonal_alignment`. Defaults to False.
        query_seq_lengths: int `[*B]` (an array or a list of ints): valid query prefix lengths in `[0, T]`
            (padding rows output 0). Concrete values outside that range raise `ValueError`; traced ones (under
            `jit`) are clamped to it.
        key_value_seq_lengths: int `[*B]` (array or list): valid key/value prefix lengths in `[0, S]` (paged:
            `S = pages_per_seq * page_size`), checked or clamped likewise. Required with `page_table`.
        local_window_size: `int w` = `(w, w)`, or `(left, right)`: a query at aligned position `i` sees keys
            `i - left … i + right`.
        implementation: `None` (the first of `"cudnn"`, `"xla_chunked"`, `"xla"` that can serve the call),
            one name (raises `NotImplementedError` when it cannot serve), an implementation object
            (`attnlib.Cudnn(...)`, `attnlib.XlaChunked(block_k=...)`, `attnlib.Xla()`, wherever a name is accepted;
            a name means its default instance), or a sequence tried in order.
        return_residual: also return `lse`. Defaults to False.
        diagonal_alignment: `"top_left"` (query 0 on key 0) or `"bottom_right"` (last query on last key, per
            sequence). Defaults to `"top_left"`.
        q_segment_ids: int `[*B, T]`: packed rows; tokens attend only within their segment; 0 = padding; each
            segment one contiguous run. Positions restart at each segment.
        kv_segment_ids: int `[*B, S]`. Defaults to `q_segment_ids`.
        max_segments_per_row: static bound on segments per row, sizing fused kernels (a row with more gets NaN
            there). Without it cuDNN takes the bound from concrete ids, or under `jit` uses 16 and runs a call
            whose rows hold more on `xla_chunked`.
        cu_seqlens_q: int `[B + 1]`: THD layout; sequence `b` is query rows `cu[b]:cu[b+1]`; rows past `cu[-1]`
            are padding. With `page_table` (or a `PagedKVCache`): ragged queries `[T, N, H]` against the cache,
            one range per page-table row (mixed prefill chunks and decodes).
        cu_seqlens_kv: int `[B + 1]`. Defaults to `cu_seqlens_q`.
        max_seqlen_q: THD (and ragged paged) static bound of one sequence's query length. Defaults to `T`.
        max_seqlen_kv: THD static bound of one sequence's key length. Defaults to `S`.
        page_table: int `[B, pages_per_seq]`: key token `j` of sequence `b` lives at
            `pool[page_table[b, j // page_size], j % page_size]`.
        logits_soft_cap: `c > 0` in `s <- c * tanh(s / c)`, applied after bias, before masking.
        sinks: float `[N]`: per-head sink logit in every softmax denominator; differentiable; zeros give the
            off-by-one softmax.
        dropout_rate: dropout on the probabilities, in `[0, 1)`, kept ones scaled by `1 / (1 - rate)`.
        dropout_key: PRNG key; required when `dropout_rate > 0`. The same key gives the same mask forward and
            backward.
        deterministic_backward: the backward is bitwise reproducible run to run (the plain-JAX implementations
            always are).
        score_mod: `score_mod(score, batch, head, q_idx, kv_idx, *args) -> score`, written in `jax.numpy` for ONE
            score element (flex attention): `score` is the float32 logit after `scale` and `bias`; `batch` (the
            flattened `*B` row; THD: the 0-based sequence), `head` (the query head `n`), `q_idx`, `kv_idx` are
            int32 scalars, the positions within the sequence (per segment / THD sequence) aligned by
            `diagonal_alignment`; `*args` are one element of each of `score_mod_args`. Returns a float scalar
            (used as float32). Applied after `bias`, before `logits_soft_cap` and the masks; a score it sets to
            `-inf` counts as masked. Gradients flow through `score` (and the float `score_mod_args`).
        mask_mod: `mask_mod(batch, head, q_idx, kv_idx, *args) -> bool`, written like `score_mod`: `True` = may
            attend. ANDed with every built-in mask and `mask`.
        score_mod_args: arrays, each broadcastable to `[*B, N, T, S]` (THD: `[N, T, S]`), of any dtype;
            `score_mod` and `mask_mod` receive the element at their position (e.g. per-head ALiBi slopes
            `[N, 1, 1]`). Float ones are differentiable. Defaults to `()`.
        fp8: None (off), `"current"`: quantize `query`, `key`, `value` to float8_e4m3fn with per-tensor scales
            from their current amax, attend in FP8 and return `query.dtype` (gradients with straight-through
            quantizers), or an `attnlib.Fp8Scales` for inputs that are already float8_e4m3fn (its scales
            dequantize them; the result is its `output_dtype`). The semantics are in `docs/fp8.md`; `xla` and
            `xla_chunked` emulate them exactly; `cudnn` runs them on FP8 tensor cores (compute capability 9.0+)
            with the limits listed there.
        return_max_logit: also return `max_logit`, float32 `[*B, N]` (THD `[B, N]`, one row per sequence): the
            largest logit any kept query-key pair of that row and head reached (after bias, `score_mod` and soft
            cap; -inf where nothing is kept), for QK-clip. Not differentiable. Defaults to False.

    Returns:
        `out` `[*B, T, N, Hv]` (THD `[T, N, Hv]`) in `query.dtype`; with `return_residual`, `(out, lse)` where
        `lse` is float32 `[*B, T, N]` (THD `[T, N]`); with `return_max_logit`, `max_logit` after them:
        `(out, max_logit)` or `(out, lse, max_logit)`.

    Raises:
        ValueError: a shape or value is invalid (the message names the argument and shows what was given).
        TypeError: a dtype or argument kind is invalid.
        NotImplementedError: the requested implementation(s) cannot serve this valid call.

    !!! Example
        ```python
        out = attnlib.attention(q, k, v, is_causal=True, local_window_size=(128, 0))

        # ALiBi and a prefix-LM mask, written for one score element
        alibi = lambda score, b, h, q_idx, kv_idx, slope: score + slope * (kv_idx - q_idx).astype(jnp.float32)
        prefix_lm = lambda b, h, q_idx, kv_idx, slope: (kv_idx <= q_idx) | (kv_idx < 16)  # sees the args too
        out = attnlib.attention(q, k, v, score_mod=alibi, mask_mod=prefix_lm, score_mod_args=(slopes[:, None, None],))
        ```
    """
    arguments = dict(locals())  # every parameter by name: one list of them, the signature
    for i, arg in enumerate(score_mod_args):
        if isinstance(arg, jax.ShapeDtypeStruct):  # only `explain` takes shapes without values
            raise TypeError(f"`score_mod_args[{i}]` must be an array. Got a jax.ShapeDtypeStruct {arg}.")
    config, inputs = _validate(arguments, jnp.asarray)
    out, lse, *fused = dispatch.run(config, inputs, implementation)
    if return_max_logit:
        max_logit = (
            max_logit_lib.from_implementation(config, fused[0]) if fused else max_logit_lib.max_logit(config, inputs)
        )
    results = (out,) + ((lse,) if return_residual else ()) + ((max_logit,) if return_max_logit else ())
    return results[0] if len(results) == 1 else results


Shaped = ArrayLike | jax.ShapeDtypeStruct


@_concise_type_errors
@_typechecker
def explain(
    query: Shaped,
    key: Shaped | PagedPools,
    value: Shaped | PagedPools | None,
    bias: Shaped | None = None,
    mask: Shaped | None = None,
    *,
    implementation: dispatch.ImplementationRequest = None,
    **kwargs: Any,
) -> dispatch.Explanation:
    """Which implementation `attention` would run for these arguments, and why each other one declined.

    Takes the same arguments as `attention`; arrays may be `jax.ShapeDtypeStruct`s (nothing is computed).

    Returns:
        An `Explanation` with `.implementation` (None when nothing can serve), `.declined` (name -> reason) and
        a readable `str()`.

    Raises:
        ValueError, TypeError: as `attention` would for the same arguments.

    !!! Example
        ```python
        q = jax.ShapeDtypeStruct((4, 4096, 32, 128), jnp.bfloat16)
        print(attnlib.explain(q, q, q, is_causal=True))
        ```
    """
    as_shaped = lambda x: x if isinstance(x, jax.ShapeDtypeStruct) or hasattr(x, "dtype") else jnp.asarray(x)
    arguments = {**ARGUMENT_DEFAULTS, "query": query, "key": key, "value": value, "bias": bias, "mask": mask}
    for name, x in kwargs.items():
        if name not in ARGUMENT_DEFAULTS:
            raise TypeError(f"explain() got an unexpected keyword argument `{name}`.")
        arguments[name] = x
    arguments["return_max_logit"] = False  # a statistic: no effect on dispatch
    config, _ = _validate(arguments, as_shaped)
    return dispatch.explain_config(config, implementation)


ARGUMENT_DEFAULTS = {
    name: p.default for name, p in inspect.signature(attention).parameters.items() if p.default is not p.empty
}
"""`attention`'s keyword arguments and their defaults, read from its signature (`explain` starts from them)."""


def _validate(arguments: dict[str, Any], as_array: Callable[[Any], Any]) -> tuple[AttentionConfig, AttentionInputs]:
    """`validation.validate` over `attention`'s arguments by name (a `PagedKVCache` unpacked, `implementation`
    left to dispatch), with `as_array` applied to every array argument given."""
    arguments = dict(arguments)
    del arguments["implementation"]
    for name in ("is_causal", "return_residual", "deterministic_backward", "return_max_logit"):
        if isinstance(arguments[name], np.bool_):
            arguments[name] = bool(arguments[name])  # NumPy bools are accepted, as jax.nn does
    (
        arguments["key"], arguments["value"], arguments["page_table"], arguments["key_value_seq_lengths"],
        arguments["pool_layout"],
    ) = _unpack_cache(arguments["key"], arguments["value"], arguments["page_table"], arguments["key_value_seq_lengths"])
    for name in ARRAY_ARGUMENTS:
        if arguments[name] is not None:
            arguments[name] = as_array(arguments[name])
    return validation.validate(**arguments)
