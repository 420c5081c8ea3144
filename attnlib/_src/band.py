"""The band rule: which keys a query row sees around its aligned diagonal (causal, window, diagonal alignment).

Derived once from the configuration (`Band.of`) and used by every path: the plain-JAX masks (`masks.visible`), the
cuDNN graphs' bounds and the rows they leave empty (`Band.rows_valid`, `Band.all_rows_valid`), paged and ragged
calls. Query row `i` of a sequence with `q_len` rows and `kv_len` keys sits on diagonal `i` (top-left) or
`i + kv_len - q_len` (bottom-right) and sees the keys `j` with `-left <= j - diagonal <= right`, clipped to
`0 <= j < kv_len` (None: unbounded on that side).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .config import AttentionConfig


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
        band = cls.from_mask(is_causal=config.is_causal, window=config.window)
        return dataclasses.replace(band, bottom_right=config.diagonal_alignment == "bottom_right" and band.bounded)

    @classmethod
    def from_mask(cls, *, is_causal: bool, window: tuple[int, int] | None) -> "Band":
        """The band of `is_causal` / `window` on positions that are already aligned (no diagonal shift)."""
        left, right = (None, None) if window is None else window
        if is_causal:
            right = 0 if right is None else min(right, 0)
        return cls(left, right, False)

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

    def _sees_a_key(self, diagonal, kv_len, xp):
        last = kv_len - 1 + xp.zeros_like(diagonal)
        lo = xp.zeros_like(diagonal) if self.left is None else xp.maximum(diagonal - self.left, 0)
        hi = last if self.right is None else xp.minimum(diagonal + self.right, last)
        return lo <= hi
