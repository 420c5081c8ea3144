"""`band.Band`: the one window / causal / diagonal-alignment rule, against a brute-force enumeration of keys."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from attnlib._src.band import Band


def _sees_any_key(band: Band, row: int, q_len: int, kv_len: int) -> bool:
    """Written from the definition: row `row` sits on diagonal `row` (+ kv_len - q_len bottom-right) and sees key `j`
    when `-left <= j - diagonal <= right`."""
    diagonal = row + (kv_len - q_len if band.bottom_right else 0)
    for j in range(kv_len):
        offset = j - diagonal
        if (band.left is None or offset >= -band.left) and (band.right is None or offset <= band.right):
            return True
    return False


BANDS = [Band(left, right, bottom_right) for left, right, bottom_right in itertools.product(
    (None, 0, 3), (None, 0, -2, 4), (False, True))]  # fmt: skip


@pytest.mark.parametrize("band", BANDS, ids=str)
def test_rows_valid_matches_enumeration(band):
    seq_q = np.array([0, 1, 5, 9, 9, 3], np.int32)
    seq_kv = np.array([4, 0, 5, 2, 11, 9], np.int32)
    rows = 10
    got = np.asarray(band.rows_valid(jnp.asarray(seq_q), jnp.asarray(seq_kv), rows))
    want = np.array([[i < q and _sees_any_key(band, i, q, kv) for i in range(rows)] for q, kv in zip(seq_q, seq_kv)])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("t, s", [(7, 7), (3, 8), (8, 3), (1, 5)])
def test_all_rows_valid_matches_enumeration(band, t, s):
    assert band.all_rows_valid(t, s) == all(_sees_any_key(band, i, t, s) for i in range(t))


def test_of_config_and_from_mask():
    class Config:
        def __init__(self, is_causal, window, diagonal_alignment):
            self.is_causal, self.window, self.diagonal_alignment = is_causal, window, diagonal_alignment

    assert Band.of(Config(False, None, "bottom_right")) == Band(None, None, False)  # nothing bounded: no alignment
    assert Band.of(Config(True, None, "bottom_right")) == Band(None, 0, True)
    assert Band.of(Config(True, (5, 3), "top_left")) == Band(5, 0, False)  # causal caps the right side
    assert Band.of(Config(True, (5, -2), "top_left")) == Band(5, -2, False)
    assert Band.of(Config(False, (2, 7), "bottom_right")) == Band(2, 7, True)
    assert Band.from_mask(is_causal=True, window=(4, 9)) == Band(4, 0, False)
    offsets = jnp.arange(-6, 7)
    np.testing.assert_array_equal(np.asarray(Band(4, 0, False).allows(offsets)), (-4 <= offsets) & (offsets <= 0))
    assert Band(None, None, False).allows(offsets) is True
