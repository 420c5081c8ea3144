"""Which cuDNN graph calls are marked for the native executor's CUDA-graph replay (`executor.replays`): the short
ones, where the host's launch work rather than the device sets the pace (docs/performance.md, "Replaying short
graph calls"). The boundary cases are the H200 measurements that placed it."""

import pytest

from attnlib._src.backends.cudnn import executor
from attnlib._src.backends.cudnn.graph_spec import GraphSpec


def _spec(direction, b, t, s, n, k, h, causal=False, **kw):
    return GraphSpec(direction, "bfloat16", b, t, s, n, k, h, h, 0.1, right_bound=0 if causal else None, **kw)


@pytest.mark.parametrize(
    "spec, replayed",
    [
        # Measured faster replayed: the decode step at batch 1, 1k context, and the small forwards.
        (_spec("fwd", 1, 1, 1024, 32, 8, 128, alignment="bottom_right", padding=True), True),
        (_spec("fwd", 1, 1, 1024, 32, 8, 128, pages=(16, 64, 16), padding=True), True),
        (_spec("fwd", 2, 1024, 1024, 16, 16, 64, causal=True), True),
        (_spec("fwd", 8, 512, 512, 16, 16, 128, causal=True), True),
        # Measured 3-4 % slower replayed (device-bound decode steps), or far longer than any host work.
        (_spec("fwd", 1, 1, 32768, 32, 8, 128, alignment="bottom_right", padding=True), False),
        (_spec("fwd", 8, 1, 8192, 32, 8, 128, alignment="bottom_right", padding=True), False),
        (_spec("fwd", 4, 4096, 4096, 32, 32, 128, causal=True), False),
        (_spec("bwd", 8, 512, 512, 16, 16, 128, causal=True), False),
    ],
    ids=["decode_b1_1k", "paged_decode_b1_1k", "small_b2_s1024", "small_b8_s512", "decode_b1_32k", "decode_b8_8k",
         "mha_b4_s4096", "small_b8_s512_bwd"],  # fmt: skip
)
def test_short_graphs_are_replayed_and_long_ones_run_directly(spec, replayed):
    assert executor.replays(spec) is replayed, executor.expected_device_us(spec)


def test_expected_time_grows_with_the_work():
    small = _spec("fwd", 2, 1024, 1024, 16, 16, 64)
    assert executor.expected_device_us(_spec("fwd", 4, 1024, 1024, 16, 16, 64)) == pytest.approx(
        2 * executor.expected_device_us(small)
    )
    assert executor.expected_device_us(_spec("fwd", 2, 1024, 1024, 16, 16, 64, causal=True)) == pytest.approx(
        executor.expected_device_us(small) / 2
    )
    assert executor.expected_device_us(_spec("bwd", 2, 1024, 1024, 16, 16, 64)) == pytest.approx(
        2.5 * executor.expected_device_us(small)
    )
