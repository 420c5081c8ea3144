"""The band rule: which keys a query row sees around its aligned diagonal (causal, window, diagonal alignment).

Derived once from the configuration (`Band.of`) and used by every path: the plain-JAX masks (`masks.visible`), the
cuDNN graphs' bounds and the rows they leave empty (`Band.rows_valid`, `Band.all_rows_valid`), paged and ragged
calls, and the context-parallel plan (the band on each sub-block, `Band.block`, and the flags that express it,
`Band.flags`). Query row `i` of a sequence with `q_len` rows and `kv_len` keys sits on diagonal `i` (top-left) or
`i + kv_len - q_len` (bottom-right) and sees the keys `j` with `-left <= j - diagonal <= right`, clipped to
`0 <= j < kv_len` (None: unbounded on that side).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .config import AttentionConfig, AttentionInputs


@dataclasses.dataclass(frozen=True)
class Band:
    """Attributes:
    left: keys visible before the diagonal (None: all of them).
    right: keys visible after it (None: all; 0: causal; negative: the diagonal itself is hidden).
    bottom_right: the diagonal is aligned to the end of the key sequence. False whenever nothing is bounded (the
        alignment then changes nothing).
    """

    left: int | None
    right: int | None
    bottom_right: bool

    @classmethod
    def of(cls, config: AttentionConfig) -> "Band":
        """The band of a call: `local_window_size = (left, right)`, with `is_causal` capping `right` at 0."""
        return cls.from_flags(
            is_causal=config.is_causal, window=config.window, diagonal_alignment=config.diagonal_alignment
        )

    @classmethod
    def from_flags(cls, *, is_causal: bool, window: tuple[int, int] | None, diagonal_alignment: str) -> "Band":
        """The band of `attnlib.attention`'s flags (`window` as `(left, right)` or None), as `Band.of` reads them
        from a configuration."""
        band = cls.from_mask(is_causal=is_causal, window=window)
        return dataclasses.replace(band, bottom_right=diagonal_alignment == "bottom_right" and band.bounded)

    @classmethod
    def from_mask(cls, *, is_causal: bool, window: tuple[int, int] | None) -> "Band":
        """The band of `is_causal` / `window` on positions that are already aligned (no diagonal shift)."""
        left, right = (None, None) if window is None else window
        if is_causal:
            right = 0 if right is None else min(right, 0)
        return cls(left, right, False)

    @classmethod
    def on_indices(cls, config: AttentionConfig, inputs: AttentionInputs) -> "Band | None":
        """A band on the canonical token indices (query row `i`, key `j` of one row of `canonical.Problem`) outside
        which no query sees a key, when one holds whatever the runtime lengths, segment ids or `cu_seqlens` are; None
        when the call is unbounded or its positions move the diagonal at run time. `xla_chunked` skips the key
        blocks outside it.

        - Plain rows: `Band.of(config)` itself (positions are the indices; padding only hides more, and with
          `bottom_right` the diagonal moves with the lengths, so none then).
        - Segments or THD where the keys share the queries' ids (`kv_segment_ids` / `cu_seqlens_kv` not given, and
          for segments `T = S`): a query and a key of one sequence sit at the same offset from its start (each
          segment is one contiguous run), so the band holds on the indices, top-left. With padding lengths and
          `bottom_right` the two runs may end differently: none then.
        """
        band = cls.of(config)
        if not band.bounded:
            return None
        top_left = cls(band.left, band.right, False)
        lengths = config.has_q_lengths or config.has_kv_lengths
        if config.layout == "thd":
            return top_left if inputs.cu_seqlens_kv is None else None
        if config.has_segments:
            shared = inputs.kv_segment_ids is None and config.q_len == config.kv_len
            return top_left if shared and not (lengths and band.bottom_right) else None
        return None if lengths and band.bottom_right else band

    @property
    def bounded(self) -> bool:
        return self.left is not None or self.right is not None

    def allows(self, offset: jax.Array) -> jax.Array | bool:
        """Whether a key at `offset = key position - aligned query position` is inside the band."""
        allowed = True
        if self.left is not None:
            allowed = allowed & (offset >= -self.left)
        if self.right is not None:
            allowed = allowed & (offset <= self.right)
        return allowed

    def diagonal(self, rows, q_len, kv_len):
        """The aligned diagonal of query rows `rows` (broadcasting against the lengths)."""
        return rows + (kv_len - q_len) if self.bottom_right else rows + 0 * q_len

    def rows_valid(self, seq_q: jax.Array, seq_kv: jax.Array, rows: int) -> jax.Array:
        """bool `[Bc, rows]`: row `i` of each sequence exists (`i < seq_q`) and sees at least one of its `seq_kv`
        keys."""
        i = jnp.arange(rows, dtype=jnp.int32)[None, :]
        q_len = seq_q.astype(jnp.int32)[:, None]
        kv_len = seq_kv.astype(jnp.int32)[:, None]
        return (i < q_len) & self._sees_a_key(self.diagonal(i, q_len, kv_len), kv_len, jnp)

    def all_rows_valid(self, t: int, s: int) -> bool:
        """Whether each of `t` unpadded query rows sees at least one of `s` keys (static shapes)."""
        return bool(np.all(self._sees_a_key(self.diagonal(np.arange(t), t, s), s, np)))

    def flags(self, unbounded: int) -> tuple[bool, tuple[int, int] | None, str] | None:
        """`(is_causal, window, diagonal_alignment)` of `attnlib.attention` giving this band on every call with
        `q_len + kv_len <= unbounded` (an unbounded side of a window becomes `unbounded`; a right side of 0 is
        `is_causal`), or None when a side is negative (no window expresses it)."""
        if (self.left is not None and self.left < 0) or (self.right is not None and self.right < 0):
            return None
        window = None
        if not (self.left is None and self.right in (None, 0)):
            window = (
                int(unbounded if self.left is None else self.left),
                int(unbounded if self.right is None else self.right),
            )
        return self.right == 0, window, "bottom_right" if self.bottom_right else "top_left"

    def block(self, q_start: int, k_start: int, q_len: int, kv_len: int) -> "Band":
        """The band on the sub-block of a `q_len x kv_len` call whose row `i` is query `q_start + i` and column `j`
        key `k_start + j`, aligned top-left on the sub-block."""
        start = k_start - self.diagonal(q_start, q_len, kv_len)  # offset of the sub-block's first row and column
        return Band(
            None if self.left is None else self.left + start, None if self.right is None else self.right - start, False
        )

    def around(self, q_start: int, k_start: int, q_len: int, kv_len: int, bottom_right: bool) -> "Band":
        """The inverse of `block`: the band, aligned `bottom_right`, of a `q_len x kv_len` call whose sub-block at
        `(q_start, k_start)` has this (top-left) band."""
        aligned = Band(self.left, self.right, bottom_right)
        start = k_start - aligned.diagonal(q_start, q_len, kv_len)
        return Band(
            None if self.left is None else self.left - start,
            None if self.right is None else self.right + start,
            bottom_right,
        )

    def visible_offsets(self, q_len: int, kv_len: int) -> tuple[int, int] | None:
        """The closed interval of `j - i` over the entries (query row `i`, key `j`) of a `q_len x kv_len` call that
        the band lets through, or None when it lets none through (static shapes)."""
        shift = self.diagonal(0, q_len, kv_len)
        lo = -(q_len - 1) if self.left is None else max(shift - self.left, -(q_len - 1))
        hi = kv_len - 1 if self.right is None else min(shift + self.right, kv_len - 1)
        return (int(lo), int(hi)) if lo <= hi else None

    def visible_keys(self, q_len: int, kv_len: int) -> tuple[int, int] | None:
        """The first and last key that some query row of a `q_len x kv_len` call sees, or None when no row sees a
        key (static shapes)."""
        offsets = self.visible_offsets(q_len, kv_len)
        if offsets is None:
            return None
        lo, hi = offsets
        return max(lo, 0), min(hi + q_len - 1, kv_len - 1)

    def _sees_a_key(self, diagonal, kv_len, xp):
        last = kv_len - 1 + xp.zeros_like(diagonal)
        lo = xp.zeros_like(diagonal) if self.left is None else xp.maximum(diagonal - self.left, 0)
        hi = last if self.right is None else xp.minimum(diagonal + self.right, last)
        return lo <= hi


def causal_mask_is_a_no_op(is_causal, diagonal_alignment, q_len, layout, q_segment_ids) -> bool:
    """A single query row aligned bottom-right sits on the last key of its sequence and sees every key: decoding.
    Dropping the mask there lets cuDNN run its unmasked kernels (docs/performance.md, decode loop); a window still
    bounds the row from the left."""
    return (
        bool(is_causal)
        and diagonal_alignment == "bottom_right"
        and q_len == 1
        and layout != "thd"
        and q_segment_ids is None
    )
