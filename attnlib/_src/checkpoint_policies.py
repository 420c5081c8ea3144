"""`save_attention`: a `jax.checkpoint` policy that keeps what attnlib's fused attention kernels compute."""

from typing import Any


_KERNEL_CALL = "custom_vmap_call"  # every cuDNN graph and Pallas TPU kernel call of attnlib is one (its batching rule)


def save_attention(primitive: Any, *_avals: Any, **params: Any) -> bool:
    """A `jax.checkpoint` (remat) policy: keep the results of attnlib's fused attention kernels, recompute the rest.

    Under `jax.checkpoint` the backward pass recomputes every value the policy does not save, so a checkpointed
    transformer block with the default policy runs its attention kernel's forward twice: once in the forward pass,
    once again before the kernel's backward. This policy saves what attnlib's kernel calls (cuDNN graphs on a GPU,
    Pallas kernels on a TPU) return: the attention output and the residuals its backward reads (the log-sum-exp), so
    the backward runs no second forward kernel. Everything else is recomputed, as with `nothing_saveable`.
    Plain-JAX implementations (`xla`, `xla_chunked`) make no kernel call: under this policy they are recomputed.

    Use it as any JAX policy, alone or combined (`jax.checkpoint_policies.save_from_both_policies`):

        block = jax.checkpoint(block, policy=attnlib.checkpoint_policies.save_attention)
        block = eqx.filter_checkpoint(block, policy=attnlib.checkpoint_policies.save_attention)
        block = hk.remat(block, policy=attnlib.checkpoint_policies.save_attention)

    Memory: per attention call, the output in its dtype (`[B, T, N, Hv]`; heads-major `[B, N, T, Hv]` on a TPU) and
    the log-sum-exp (float32, one per row and head: `[B, N, T]` on a TPU, 0.5 MiB for 16 heads of 8192 rows, where
    raw splash's own call keeps it replicated over 128 lanes).

    Args:
        primitive: the JAX primitive of one equation (JAX calls the policy with each).
        *_avals: its operands' abstract values (unused).
        **params: its parameters; a kernel call's batching rule tells attnlib's calls from others.

    Returns:
        Whether to save the equation's outputs.
    """
    if getattr(primitive, "name", None) != _KERNEL_CALL:
        return False
    return getattr(params.get("rule"), "__module__", "").startswith("attnlib.")
