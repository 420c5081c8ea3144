"""The Llama-shaped decoder of `llama.py`, written in Haiku, with attention by `attnlib.haiku`.

The same model, layer for layer: pre-norm blocks of RMSNorm, grouped-query attention with rotary positions
(`attnlib.haiku.DotProductAttention` on `[B, T, N, H]` projections, no transposes), a SwiGLU MLP, optional per-block
remat (`hk.remat`), optional Mistral-style sliding window; float32 parameters, bfloat16 compute (by default). It takes
`llama.py`'s `LlamaConfig` and uses its `rope`, `training_inputs` and layout helpers (on a mesh with explicit axes:
`train.py --framework haiku --mesh ...`), and `params_from_equinox` turns an Equinox `llama.Llama` into this model's
parameters (the same weights give the same logits).

    import haiku as hk, jax
    import llama_haiku
    from llama import LlamaConfig

    model = llama_haiku.transform(LlamaConfig(remat=True))   # hk.Transformed, no apply rng
    params = model.init(jax.random.key(0), tokens)             # float32
    logits = model.apply(params, tokens, segment_ids)          # [B, T, V] float32
    value = llama_haiku.loss(params, tokens, segment_ids, model=model)

Parameters (names mirror the Equinox model's fields):

    llama                      embed [V, D], head [D, V] (not with tie_embeddings)
    llama/layer_{i}/attn_norm, .../mlp_norm, llama/norm    weight [D]
    llama/layer_{i}/attn   wq [D, N, H], wk [D, K, H], wv [D, K, H], wo [N, H, D]
    llama/layer_{i}/mlp    w_gate [D, F], w_up [D, F], w_down [F, D]
"""

from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

# examples/ is on sys.path when these files run as scripts
from llama import embed_tokens, kv_heads_for, laid_out_like, LlamaConfig, remat_policy, rope, training_inputs

import attnlib.haiku


AttentionCore = Callable[..., jax.Array]
"""`core(q, k, v, segment_ids) -> out`: `q` `[B, T, N, H]`, `k`, `v` `[B, T, K, H]`, `segment_ids` `[B, T]` or None;
causal (and windowed, with `sliding_window`). The default is `attnlib.haiku.DotProductAttention`; a benchmark passes
another one to compare attention implementations in the same model."""


def _weight(name: str, shape: tuple[int, ...], fan_in: int, dtype: Any) -> jax.Array:
    return hk.get_parameter(name, shape, dtype, init=hk.initializers.RandomNormal(stddev=fan_in**-0.5))


class RMSNorm(hk.Module):
    def __init__(self, config: LlamaConfig, name: str | None = None):
        super().__init__(name=name)
        self.config = config

    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        weight = hk.get_parameter("weight", (c.dim,), c.param_dtype, init=jnp.ones)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + c.norm_eps)
        return (x32 * jnp.reshape(weight.astype(jnp.float32), (1,) * (x.ndim - 1) + (c.dim,))).astype(x.dtype)


class Attention(hk.Module):
    """Grouped-query self-attention. The projections are `[D, N, H]` tensors, so `x @ wq` is already `[B, T, N, H]`."""

    def __init__(self, config: LlamaConfig, core: AttentionCore | None = None, name: str | None = None):
        super().__init__(name=name)
        self.config = config
        self.core = core

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        c = self.config
        wq = _weight("wq", (c.dim, c.num_heads, c.head_dim), c.dim, c.param_dtype)
        wk = _weight("wk", (c.dim, c.num_kv_heads, c.head_dim), c.dim, c.param_dtype)
        wv = _weight("wv", (c.dim, c.num_kv_heads, c.head_dim), c.dim, c.param_dtype)
        wo = _weight("wo", (c.num_heads, c.head_dim, c.dim), c.num_heads * c.head_dim, c.param_dtype)
        proj = lambda w: jnp.einsum("btd,dnh->btnh", x, w.astype(x.dtype))
        q = rope(proj(wq), positions, c.rope_theta)  # [B, T, N, H]
        wk, wv = kv_heads_for(wk, q), kv_heads_for(wv, q)  # unchanged unless explicit axes split the groups
        k = rope(proj(wk), positions, c.rope_theta)  # [B, T, K, H]
        v = proj(wv)
        if self.core is None:
            window = None if c.sliding_window is None else (c.sliding_window, 0)
            core = attnlib.haiku.DotProductAttention(
                is_causal=True, local_window_size=window, implementation=c.implementation
            )
            out = core(q, k, v, q_segment_ids=segment_ids)
        else:
            out = self.core(q, k, v, segment_ids)
        # A sum over the heads: across devices when they are split (tensor parallelism), laid out as `x` is.
        return jnp.einsum("btnh,nhd->btd", out, wo.astype(x.dtype), out_sharding=laid_out_like(x))


class MLP(hk.Module):
    """SwiGLU: `down(silu(x @ gate) * (x @ up))`."""

    def __init__(self, config: LlamaConfig, name: str | None = None):
        super().__init__(name=name)
        self.config = config

    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        w_gate = _weight("w_gate", (c.dim, c.hidden_dim), c.dim, c.param_dtype)
        w_up = _weight("w_up", (c.dim, c.hidden_dim), c.dim, c.param_dtype)
        w_down = _weight("w_down", (c.hidden_dim, c.dim), c.hidden_dim, c.param_dtype)
        gate = jax.nn.silu(x @ w_gate.astype(x.dtype))
        hidden = gate * (x @ w_up.astype(x.dtype))  # [B, T, F]: split over `model` under tensor parallelism
        return jnp.matmul(hidden, w_down.astype(x.dtype), out_sharding=laid_out_like(x))


class Block(hk.Module):
    def __init__(self, config: LlamaConfig, core: AttentionCore | None = None, name: str | None = None):
        super().__init__(name=name)
        self.config = config
        self.core = core

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        attn = Attention(self.config, self.core, name="attn")
        x = x + attn(RMSNorm(self.config, name="attn_norm")(x), positions, segment_ids)
        return x + MLP(self.config, name="mlp")(RMSNorm(self.config, name="mlp_norm")(x))


class Llama(hk.Module):
    """The training forward: `[B, T]` tokens to causal float32 logits `[B, T, V]`."""

    def __init__(self, config: LlamaConfig, core: AttentionCore | None = None, name: str | None = "llama"):
        super().__init__(name=name)
        self.config = config
        self.core = core

    def __call__(
        self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        """Causal logits, float32.

        Args:
            tokens: `[B, T]`.
            segment_ids: `[B, T]` packed documents (0 = padding): tokens attend only within their document.
                Defaults to None (each row one sequence).
            positions: `[B, T]` rotary positions. Defaults to `0, 1, ...` restarting at each document.
        """
        c = self.config
        tokens, segment_ids, positions = training_inputs(tokens, segment_ids, positions)
        embed = _weight("embed", (c.vocab_size, c.dim), c.dim, c.param_dtype)
        x = embed_tokens(embed, tokens).astype(c.dtype)
        checkpoint, policy = remat_policy(c)
        for i in range(c.num_layers):
            block = Block(c, self.core, name=f"layer_{i}")
            x = (hk.remat(block, policy=policy) if checkpoint else block)(x, positions, segment_ids)
        x = RMSNorm(c, name="norm")(x)
        head = embed.T if c.tie_embeddings else _weight("head", (c.dim, c.vocab_size), c.dim, c.param_dtype)
        return jnp.einsum("btd,dv->btv", x, head.astype(x.dtype), preferred_element_type=jnp.float32)


def transform(config: LlamaConfig, core: AttentionCore | None = None) -> hk.Transformed:
    """`Llama(config, core)` as `hk.Transformed`: `init(rng, tokens, segment_ids=None, positions=None)`,
    `apply(params, tokens, segment_ids=None, positions=None) -> logits` (no rng: the model is deterministic)."""

    def forward(tokens, segment_ids=None, positions=None):
        return Llama(config, core)(tokens, segment_ids, positions)

    return hk.without_apply_rng(hk.transform(forward))


def next_token_loss(logits: jax.Array, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy of `[B, T, V]` logits (as `llama.loss`): with `segment_ids`, a document's last
    token predicts nothing and padding (segment 0) neither predicts nor is predicted."""
    tokens = jnp.asarray(tokens)
    logits, targets = logits[:, :-1], tokens[:, 1:]
    if segment_ids is None:
        keep = jnp.ones(targets.shape, bool)
    else:
        segment_ids = jnp.asarray(segment_ids)
        keep = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    log_p = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(keep, nll, 0.0)) / jnp.maximum(jnp.sum(keep), 1).astype(jnp.float32)


def loss(
    params: hk.Params,
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    *,
    model: hk.Transformed,
) -> jax.Array:
    """`next_token_loss(model.apply(params, tokens, segment_ids, positions), tokens, segment_ids)`."""
    return next_token_loss(model.apply(params, tokens, segment_ids, positions), tokens, segment_ids)


def params_from_equinox(model: Any) -> dict[str, dict[str, jax.Array]]:
    """The Haiku parameters holding the weights of an Equinox `llama.Llama` (the arrays themselves, not copies)."""
    top = {"embed": model.embed}
    if model.head is not None:
        top["head"] = model.head
    params = {"llama": top, "llama/norm": {"weight": model.norm.weight}}
    for i, block in enumerate(model.layers):
        prefix = f"llama/layer_{i}/"
        params[prefix + "attn_norm"] = {"weight": block.attn_norm.weight}
        params[prefix + "attn"] = {"wq": block.attn.wq, "wk": block.attn.wk, "wv": block.attn.wv, "wo": block.attn.wo}
        params[prefix + "mlp_norm"] = {"weight": block.mlp_norm.weight}
        params[prefix + "mlp"] = {"w_gate": block.mlp.w_gate, "w_up": block.mlp.w_up, "w_down": block.mlp.w_down}
    return params


def num_params(params: hk.Params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))
