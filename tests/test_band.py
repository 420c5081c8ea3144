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


def _visible(band: Band, q_len: int, kv_len: int) -> np.ndarray:
    """bool `[q_len, kv_len]` from the definition: row `i` sees key `j` when `-left <= j - diagonal(i) <= right`."""
    shift = kv_len - q_len if band.bottom_right else 0
    offset = np.arange(kv_len)[None, :] - (np.arange(q_len)[:, None] + shift)
    allowed = np.ones((q_len, kv_len), bool)
    if band.left is not None:
        allowed &= offset >= -band.left
    if band.right is not None:
        allowed &= offset <= band.right
    return allowed


SHAPES = [(7, 7), (3, 8), (8, 3), (1, 5), (5, 1)]


@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("t, s", SHAPES)
def test_visible_offsets_and_keys_match_enumeration(band, t, s):
    rows, cols = np.nonzero(_visible(band, t, s))
    if rows.size == 0:
        assert band.visible_offsets(t, s) is None and band.visible_keys(t, s) is None
        return
    # every `j - i` in the interval has a visible entry, and no other does
    offsets = set((cols - rows).tolist())
    assert offsets == set(range(band.visible_offsets(t, s)[0], band.visible_offsets(t, s)[1] + 1))
    assert band.visible_keys(t, s) == (cols.min(), cols.max())


@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("t, s", SHAPES)
def test_block_and_around_match_enumeration(band, t, s):
    whole = _visible(band, t, s)
    for q_start, k_start in itertools.product(range(t), range(s)):
        n, m = t - q_start, s - k_start
        block = band.block(q_start, k_start, t, s)
        assert not block.bottom_right
        np.testing.assert_array_equal(_visible(block, n, m), whole[q_start:, k_start:])
        for bottom_right in (False, True):
            around = block.around(q_start, k_start, t, s, bottom_right)
            assert around.bottom_right == bottom_right
            assert around.block(q_start, k_start, t, s) == block
            if band.bottom_right == bottom_right:
                assert around == band


@pytest.mark.parametrize("band", BANDS, ids=str)
def test_flags_give_the_band(band):
    flags = band.flags(unbounded=16)
    if (band.left is not None and band.left < 0) or (band.right is not None and band.right < 0):
        assert flags is None
        return
    is_causal, window, alignment = flags
    assert is_causal == (band.right == 0)
    assert window is None or min(window) >= 0
    assert alignment == ("bottom_right" if band.bottom_right else "top_left")
    again = Band.from_flags(is_causal=is_causal, window=window, diagonal_alignment=alignment)
    for t, s in SHAPES + [(8, 8), (2, 14)]:  # t + s <= 16
        np.testing.assert_array_equal(_visible(again, t, s), _visible(band, t, s))


def test_from_flags_matches_of():
    class Config:
        def __init__(self, is_causal, window, diagonal_alignment):
            self.is_causal, self.window, self.diagonal_alignment = is_causal, window, diagonal_alignment

    for flags in itertools.product((False, True), (None, (0, 0), (3, 5)), ("top_left", "bottom_right")):
        band = Band.from_flags(is_causal=flags[0], window=flags[1], diagonal_alignment=flags[2])
        assert band == Band.of(Config(*flags))
