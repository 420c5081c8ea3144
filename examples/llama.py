"""A small Llama-shaped decoder-only language model in Equinox, with attention by `attnlib`.

Readable rather than clever: copy it and change what you need. Pre-norm blocks of RMSNorm, grouped-query attention
with rotary positions, and a SwiGLU MLP; float32 parameters with bfloat16 compute (by default).

Two ways in:

- **Training**, `model(tokens, segment_ids=None, positions=None) -> logits`: a causal forward over `[B, T]` token
  rows. Packed documents pass `segment_ids` (0 = padding; tokens attend only within their document and rotary
  positions restart at each one). `loss(model, tokens, segment_ids)` is next-token cross-entropy that never predicts
  across a document boundary.
- **Serving**, `model.paged_forward(tokens, positions, caches, cu_seqlens) -> (hidden, caches)`: one ragged (THD)
  batch of new tokens for the sequences of a set of `attnlib.PagedKVCache`s (one cache per layer): prefill chunks and
  single decode tokens alike. Each layer appends the new keys and values to its cache, then attends to everything
  cached so far. `examples/generate.py` drives it with continuous batching.

The projections produce `[B, T, N, H]` (THD: `[T, N, H]`) directly, the layout `attnlib.attention` takes, so no
transpose sits between a projection and the attention call.

On a device mesh with explicit axes (`make_mesh`, `jax.set_mesh`), the same code runs data and tensor parallel:
`param_shardings` splits the heads and the MLP's hidden units over a `model` axis (Megatron-LM's layout), and the few
ops whose result layout JAX cannot infer name it (`laid_out_like`, `embed_tokens`, `kv_heads_for`). Without a mesh
they are the plain ops.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

import attnlib
import attnlib.equinox


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters. The defaults are a tiny model that runs in seconds on a CPU.

    Attributes:
        vocab_size: `V`.
        dim: model width `D`.
        num_layers: transformer blocks.
        num_heads: query heads `N`.
        num_kv_heads: key/value heads `K` (grouped-query attention; `N % K == 0`).
        head_dim: `H`.
        hidden_dim: SwiGLU hidden width `F`.
        rope_theta: rotary base.
        norm_eps: RMSNorm epsilon.
        tie_embeddings: the output head is the transposed input embedding.
        remat: per-block rematerialization (`jax.checkpoint` of each block). False stores every activation; True
            (or "full") recomputes the whole block in the backward pass; "save_attention" recomputes all but the
            fused attention kernel's results (`attnlib.checkpoint_policies.save_attention`: no second attention
            forward); "save_dots_and_attention" also keeps the matrix products of the projections and the MLP. A
            callable is a `jax.checkpoint` policy of your own. See `REMAT_POLICIES`.
        dtype: compute dtype (activations, the KV cache). Parameters are `param_dtype`.
        param_dtype: parameter dtype.
        implementation: `attnlib.attention`'s `implementation`. None picks the best available.
        sliding_window: Mistral-style local attention: each token sees itself and the `sliding_window` tokens before
            it (`local_window_size=(sliding_window, 0)`). None: full causal attention.
    """

    vocab_size: int = 97
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    hidden_dim: int = 172
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    remat: bool | str | Callable = False
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    implementation: Any = None
    sliding_window: int | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"`num_heads` must be a multiple of `num_kv_heads`. Got num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}."
            )
        if isinstance(self.remat, str) and self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"`remat` must be a bool, a policy or one of {sorted(REMAT_POLICIES)}. Got {self.remat!r}."
            )
        if not isinstance(self.remat, (bool, str)) and not callable(self.remat):
            raise TypeError(f"`remat` must be a bool, a name or a `jax.checkpoint` policy. Got {self.remat!r}.")
        if self.head_dim % 2 != 0:
            raise ValueError(f"`head_dim` must be even (rotary positions rotate pairs). Got {self.head_dim}.")


REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_attention": attnlib.checkpoint_policies.save_attention,
    "save_dots_and_attention": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, attnlib.checkpoint_policies.save_attention
    ),
}  # per-block remat by name: recompute everything; all but attnlib's kernels; all but those and the matrix products


def remat_policy(config: LlamaConfig):
    """`config.remat` as `(checkpoint each block?, its jax.checkpoint policy)`."""
    if config.remat is False:
        return False, None
    if callable(config.remat):
        return True, config.remat
    return True, REMAT_POLICIES["full" if config.remat is True else config.remat]


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int, dtype: Any) -> Array:
    return (jax.random.normal(key, shape, jnp.float32) / fan_in**0.5).astype(dtype)


def laid_out_like(x: Array, extra_dims: int = 0) -> jax.sharding.NamedSharding | None:
    """The sharding in `x`'s type, with `extra_dims` whole dims appended, when the program runs on a mesh with
    explicit axes (`jax.set_mesh` of an `AxisType.Explicit` mesh: `train.py --mesh`); None otherwise.

    Under explicit axes JAX types every array with its sharding and asks, where it cannot tell, how a result is laid
    out: a contraction over a dim split over a mesh axis (the output projections sum over the heads or hidden units
    split over `model`: a sum across shards), or rows gathered from a table by sharded token ids. Those ops take this
    as their `out_sharding` (None, the default, elsewhere).
    """
    sharding = jax.typeof(x).sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec) + extra_dims)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def embed_tokens(table: Float[Array, "V D"], tokens: Int[Array, "..."]) -> Float[Array, "... D"]:
    """`table[tokens]`, its rows laid out as the tokens are (under explicit axes: `laid_out_like`)."""
    return table.at[tokens].get(out_sharding=laid_out_like(tokens, extra_dims=1))


def kv_heads_for(w: Float[Array, "D K H"], query: Float[Array, "... N H"]) -> Float[Array, "D K2 H"]:
    """The key or value projection `w` as the query's head layout needs it: `w` itself, unless explicit mesh axes
    split the query heads over more devices than `w` has heads evenly (`train.py --mesh model=4` on 2 key/value heads).

    JAX cannot type a split of grouped-query attention's groups across shards (the `[N] -> [K, N/K]` reshape of the
    query heads has no single layout then; `jax.nn.dot_product_attention` fails the same way). So, as Megatron-LM does
    when the tensor-parallel degree exceeds the key/value heads, each device holds the key/value heads its own query
    heads read: `w`'s heads are repeated (each `r` times, `K * r` the least common multiple of `K` and the device
    count) and split over the query heads' axes. The forward moves no data (each device keeps its slice); the copies'
    gradients sum back into `w`. The attention sees `K * r` key/value heads, which divide the query heads.
    """
    sharding = laid_out_like(query)
    axes = None if sharding is None else sharding.spec[-2]
    if axes is None:
        return w
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    devices = math.prod(sharding.mesh.shape[a] for a in axes)
    repeats = devices // math.gcd(w.shape[1], devices)
    if repeats == 1:
        return w
    spec = jax.sharding.PartitionSpec(None, axes, None)
    return jax.sharding.reshard(jnp.repeat(w, repeats, axis=1), jax.sharding.NamedSharding(sharding.mesh, spec))


def _lead(x: Array, ndim: int) -> Array:
    """`x` with leading axes of size 1 up to rank `ndim` (explicit broadcasting: works under
    `jax_numpy_rank_promotion="raise"`)."""
    return jnp.reshape(x, (1,) * (ndim - x.ndim) + x.shape)


class RMSNorm(eqx.Module):
    weight: Float[Array, " D"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float, dtype: Any):
        self.weight = jnp.ones((dim,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * _lead(self.weight.astype(jnp.float32), x.ndim)).astype(x.dtype)


def rope(x: Float[Array, "... heads H"], positions: Int[Array, "..."], theta: float) -> Float[Array, "... heads H"]:
    """Rotary position embedding (the "rotate half" convention of Hugging Face's Llama) at explicit `positions`.

    `positions` has `x`'s shape without the last two axes: `[B, T]` for `[B, T, N, H]`, `[T]` for THD `[T, N, H]`.
    Explicit positions serve packed documents (positions restart at each one) and cached decoding (the new tokens
    sit after the cached ones) alike.
    """
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [H/2]
    angle = positions.astype(jnp.float32)[..., None, None] * _lead(inv_freq, positions.ndim + 2)  # [..., 1, H/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(eqx.Module):
    """Grouped-query self-attention. The projections are `[D, N, H]` tensors, so `x @ wq` is already `[..., N, H]`."""

    wq: Float[Array, "D N H"]
    wk: Float[Array, "D K H"]
    wv: Float[Array, "D K H"]
    wo: Float[Array, "N H D"]
    core: attnlib.equinox.DotProductAttention
    theta: float = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray):
        c = config
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = _normal(kq, (c.dim, c.num_heads, c.head_dim), c.dim, c.param_dtype)
        self.wk = _normal(kk, (c.dim, c.num_kv_heads, c.head_dim), c.dim, c.param_dtype)
        self.wv = _normal(kv, (c.dim, c.num_kv_heads, c.head_dim), c.dim, c.param_dtype)
        self.wo = _normal(ko, (c.num_heads, c.head_dim, c.dim), c.num_heads * c.head_dim, c.param_dtype)
        window = None if c.sliding_window is None else (c.sliding_window, 0)
        self.core = attnlib.equinox.DotProductAttention(
            c.num_heads, is_causal=True, local_window_size=window, implementation=c.implementation
        )
        self.theta = c.rope_theta

    def __call__(
        self,
        x: Float[Array, "... D"],
        positions: Int[Array, "..."],
        *,
        segment_ids: Int[Array, "B T"] | None = None,
        cache: attnlib.PagedKVCache | None = None,
        cu_seqlens: Int[Array, " num_seqs_plus_1"] | None = None,
        max_seqlen_q: int | None = None,
    ) -> tuple[Float[Array, "... D"], attnlib.PagedKVCache | None]:
        """Dense rows `x` `[B, T, D]` (no `cache`), or THD tokens `x` `[T, D]` with a `cache` and `cu_seqlens` (and
        the static bound `max_seqlen_q` of one sequence's new tokens)."""
        proj = lambda w: jnp.einsum("...d,dnh->...nh", x, w.astype(x.dtype))
        q = rope(proj(self.wq), positions, self.theta)  # [B, T, N, H] (THD: [T, N, H])
        wk, wv = (self.wk, self.wv) if cache is not None else (kv_heads_for(w, q) for w in (self.wk, self.wv))
        k = rope(proj(wk), positions, self.theta)  # [B, T, K, H]
        v = proj(wv)
        if cache is None:  # training: causal within each row (within each document with segment ids)
            out = self.core(q, k, v, q_segment_ids=segment_ids)
        else:  # serving: the new tokens join the cache first, so each query sees itself
            cache = cache.append(k, v, cu_seqlens=cu_seqlens)
            out = cache.attend(
                q,
                cu_seqlens_q=cu_seqlens,
                max_seqlen_q=max_seqlen_q,
                local_window_size=self.core.local_window_size,
                implementation=self.core.implementation,
            )
        # A sum over the heads: across devices when they are split (tensor parallelism), laid out as `x` is.
        out = jnp.einsum("...nh,nhd->...d", out, self.wo.astype(x.dtype), out_sharding=laid_out_like(x))
        return out, cache


class MLP(eqx.Module):
    """SwiGLU: `down(silu(x @ gate) * (x @ up))`."""

    w_gate: Float[Array, "D F"]
    w_up: Float[Array, "D F"]
    w_down: Float[Array, "F D"]

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray):
        c = config
        kg, ku, kd = jax.random.split(key, 3)
        self.w_gate = _normal(kg, (c.dim, c.hidden_dim), c.dim, c.param_dtype)
        self.w_up = _normal(ku, (c.dim, c.hidden_dim), c.dim, c.param_dtype)
        self.w_down = _normal(kd, (c.hidden_dim, c.dim), c.hidden_dim, c.param_dtype)

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        gate = jax.nn.silu(x @ self.w_gate.astype(x.dtype))
        hidden = gate * (x @ self.w_up.astype(x.dtype))  # [..., F]: split over `model` under tensor parallelism
        return jnp.matmul(hidden, self.w_down.astype(x.dtype), out_sharding=laid_out_like(x))


class Block(eqx.Module):
    attn_norm: RMSNorm
    attn: Attention
    mlp_norm: RMSNorm
    mlp: MLP

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.attn_norm = RMSNorm(config.dim, config.norm_eps, config.param_dtype)
        self.attn = Attention(config, key=ka)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps, config.param_dtype)
        self.mlp = MLP(config, key=km)

    def __call__(self, x, positions, **attention_args):
        h, cache = self.attn(self.attn_norm(x), positions, **attention_args)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache


def segment_positions(segment_ids: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """Positions that restart at 0 at the start of every segment (each segment one contiguous run)."""
    T = segment_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), segment_ids.shape)
    first = jnp.concatenate(
        [jnp.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1
    )
    start = jax.lax.cummax(jnp.where(first, index, 0), axis=segment_ids.ndim - 1)
    return index - start


def training_inputs(tokens, segment_ids=None, positions=None) -> tuple[Array, Array | None, Array]:
    """`(tokens, segment_ids, positions)` of the training forward as arrays, positions defaulting to `0, 1, ...`
    restarting at each document (`segment_positions`), or along each row without segment ids."""
    tokens = jnp.asarray(tokens)
    segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)
    if positions is None:
        if segment_ids is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)
        else:
            positions = segment_positions(segment_ids)
    return tokens, segment_ids, jnp.asarray(positions)


class Llama(eqx.Module):
    embed: Float[Array, "V D"]
    layers: tuple[Block, ...]
    norm: RMSNorm
    head: Float[Array, "D V"] | None
    config: LlamaConfig = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray):
        ke, kh, *kl = jax.random.split(key, config.num_layers + 2)
        self.embed = _normal(ke, (config.vocab_size, config.dim), config.dim, config.param_dtype)
        self.layers = tuple(Block(config, key=k) for k in kl)
        self.norm = RMSNorm(config.dim, config.norm_eps, config.param_dtype)
        self.head = (
            None
            if config.tie_embeddings
            else _normal(kh, (config.dim, config.vocab_size), config.dim, config.param_dtype)
        )
        self.config = config

    def logits(self, hidden: Float[Array, "... D"]) -> Float[Array, "... V"]:
        """Final-normed hidden states to float32 logits."""
        head = self.embed.T if self.head is None else self.head
        return jnp.einsum("...d,dv->...v", hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32)

    def _blocks(self, x, positions, caches=None, **attention_args):
        call = lambda block, x, positions, cache: block(x, positions, cache=cache, **attention_args)
        checkpoint, policy = remat_policy(self.config)
        if checkpoint:
            call = eqx.filter_checkpoint(call, policy=policy)
        new_caches = []
        for i, block in enumerate(self.layers):
            x, cache = call(block, x, positions, None if caches is None else caches[i])
            new_caches.append(cache)
        return self.norm(x), new_caches

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        segment_ids: Int[Array, "B T"] | None = None,
        positions: Int[Array, "B T"] | None = None,
    ) -> Float[Array, "B T V"]:
        """The training forward: causal logits, float32.

        Args:
            tokens: `[B, T]`.
            segment_ids: `[B, T]` packed documents (0 = padding): tokens attend only within their document.
                Defaults to None (each row one sequence).
            positions: `[B, T]` rotary positions. Defaults to `0, 1, ...` restarting at each document.
        """
        tokens, segment_ids, positions = training_inputs(tokens, segment_ids, positions)
        x = embed_tokens(self.embed, tokens).astype(self.config.dtype)
        hidden, _ = self._blocks(x, positions, segment_ids=segment_ids)
        return self.logits(hidden)

    def paged_forward(
        self,
        tokens: Int[Array, " T"],
        positions: Int[Array, " T"],
        caches: list[attnlib.PagedKVCache],
        cu_seqlens: Int[Array, " B_plus_1"],
        max_seqlen_q: int | None = None,
    ) -> tuple[Float[Array, "T D"], list[attnlib.PagedKVCache]]:
        """New tokens of the cached sequences, as one ragged (THD) batch: the serving forward.

        Sequence `b`'s new tokens are `tokens[cu_seqlens[b]:cu_seqlens[b + 1]]` (empty for a sequence with nothing
        new); rows past `cu_seqlens[-1]` are padding (they are not cached, and their outputs are garbage).

        Args:
            tokens: `[T]` token ids.
            positions: `[T]` each token's position in its sequence (its cache length before this call, counting up).
            caches: one `attnlib.PagedKVCache` per layer, `B` sequences each.
            cu_seqlens: int32 `[B + 1]`.
            max_seqlen_q: static bound of one sequence's new tokens (default `T`): 1 for a step of decodes only.
                cuDNN lays the queries out as `[B, max_seqlen_q]` rows, so a tight bound saves it work.

        Returns:
            `(hidden, caches)`: final-normed hidden states `[T, D]` (`model.logits(hidden[i])` is the next-token
            prediction after token `i`) and the caches with the new tokens appended.
        """
        x = embed_tokens(self.embed, tokens).astype(self.config.dtype)
        return self._blocks(x, positions, caches, cu_seqlens=cu_seqlens, max_seqlen_q=max_seqlen_q)

    def make_caches(
        self, batch_size: int, num_pages: int, page_size: int, max_pages_per_seq: int | None = None, layout=None
    ) -> list[attnlib.PagedKVCache]:
        """One empty `attnlib.PagedKVCache` per layer in the compute dtype (`layout=None`: the device's best)."""
        c = self.config
        return [
            attnlib.PagedKVCache.create(
                batch_size,
                num_pages,
                page_size,
                c.num_kv_heads,
                c.head_dim,
                dtype=c.dtype,
                max_pages_per_seq=max_pages_per_seq,
                layout=layout,
            )
            for _ in range(c.num_layers)
        ]


def loss(
    model: Llama,
    tokens: Int[Array, "B T"],
    segment_ids: Int[Array, "B T"] | None = None,
    positions: Int[Array, "B T"] | None = None,
) -> Float[Array, ""]:
    """Mean next-token cross-entropy. With `segment_ids`, a document's last token predicts nothing (the next token
    belongs to another document) and padding (segment 0) neither predicts nor is predicted."""
    tokens = jnp.asarray(tokens)
    logits = model(tokens, segment_ids, positions)[:, :-1]
    targets = tokens[:, 1:]
    if segment_ids is None:
        keep = jnp.ones(targets.shape, bool)
    else:
        segment_ids = jnp.asarray(segment_ids)
        keep = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    log_p = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(keep, nll, 0.0)) / jnp.maximum(jnp.sum(keep), 1).astype(jnp.float32)


def num_params(model: Llama) -> int:
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


# Sharding: `train.py --mesh` and `generate.py --mesh` run the model on a device mesh with explicit axes.


def parse_mesh(text: str) -> dict[str, int]:
    """`"data=2,model=4"` as `{"data": 2, "model": 4}`: mesh axis sizes by name, `data` and `model` only."""
    axes = {}
    for part in text.split(","):
        name, _, size = (s.strip() for s in part.partition("="))
        if name not in ("data", "model") or name in axes or not size.isdigit() or int(size) < 1:
            raise ValueError(
                f"`--mesh` must name `data` and/or `model` with their sizes, as data=2,model=4. Got {text!r}."
            )
        axes[name] = int(size)
    return axes


def make_mesh(axes: dict[str, int]) -> jax.sharding.Mesh:
    """A mesh of the first `prod(sizes)` of `jax.devices()` with these axes, all `AxisType.Explicit` ("sharding in
    types": every array's type carries its sharding; run the program under `jax.set_mesh(mesh)`)."""
    count = math.prod(axes.values())
    if count > jax.device_count():
        raise ValueError(
            f"`--mesh` needs {count} devices, this machine has {jax.device_count()} (on a CPU, simulate more with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count}). Got {axes}."
        )
    explicit = (jax.sharding.AxisType.Explicit,) * len(axes)
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=explicit, devices=jax.devices()[:count])


SPLIT_DIMS = {"wq": 1, "wk": 1, "wv": 1, "w_gate": 1, "w_up": 1, "wo": 0, "w_down": 0}
"""Tensor parallelism (Megatron-LM's), by parameter name: the dim each matrix splits over the `model` axis. The query,
key and value projections `[D, heads, H]` and the MLP's gate and up projections `[D, F]` by output features (heads,
hidden units), the output projections `wo` `[N, H, D]` and `w_down` `[F, D]` by input features: each device computes
its heads' attention and its hidden units' MLP on its own, and the output projections' sums over heads and hidden units
are a block's only communication in the forward (one all-reduce each). Everything else (embeddings, head, norms) is
replicated."""


def param_shardings(params: Any, mesh: jax.sharding.Mesh, *, replicate_kv: bool = True) -> Any:
    """The `NamedSharding` of each parameter of the Equinox `Llama` (its arrays, as `eqx.partition` gives them) or of
    `llama_haiku`'s parameters (the same names) on `mesh`: `SPLIT_DIMS` over `model`, replicated without a `model`
    axis (the `data` axis splits the batch, not the parameters).

    Key/value projections whose heads `model` does not divide stay replicated when `replicate_kv` (the training
    forward then repeats them for the query heads: `kv_heads_for`); otherwise that is an error, as is a split dim
    `model` does not divide.
    """
    size = dict(mesh.shape).get("model", 1)

    def sharding(path, p) -> jax.sharding.NamedSharding:
        name = getattr(path[-1], "name", getattr(path[-1], "key", None))  # Equinox: a field; Haiku: a dict key
        dim = SPLIT_DIMS.get(name) if size > 1 else None
        spec = [None] * p.ndim
        if dim is not None and p.shape[dim] % size == 0:
            spec[dim] = "model"
        elif dim is not None and not (replicate_kv and name in ("wk", "wv")):
            raise ValueError(
                f"`--mesh` model={size} must divide dim {dim} of `{name}`, which it splits. "
                f"Got {jax.tree_util.keystr(path)} of shape {p.shape}."
            )
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))

    return jax.tree_util.tree_map_with_path(sharding, params)
