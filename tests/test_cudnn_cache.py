"""CPU tests of the cuDNN graph cache: keys, persistence across processes, corruption recovery, bounds."""

import dataclasses
import importlib.metadata
import multiprocessing
import os
import subprocess
import sys

import pytest

from attnlib._src.backends.cudnn import cache as cache_lib, graphs, support
from attnlib._src.backends.cudnn.modifier import ScoreModifier


DEVICE = support.Device((9, 0), "NVIDIA H200", 91900)
SPEC = graphs.GraphSpec("fwd", "bfloat16", 2, 64, 96, 8, 2, 64, 64, 0.125)


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _entry(tag: bytes = b"graph") -> cache_lib.GraphEntry:
    return cache_lib.GraphEntry(
        blob=b"{" + tag * 50 + b"}", workspace_bytes=4096, in_uids=(1, 2, 3), out_uids=(4, 5), zero_fill=(), label="t"
    )


class Builder:
    def __init__(self, tag: bytes = b"graph"):
        self.calls = 0
        self.tag = tag

    def __call__(self) -> cache_lib.GraphEntry:
        self.calls += 1
        return _entry(self.tag)


def _key(spec=SPEC, device=DEVICE):
    try:
        return graphs.cache_key(spec, device)
    except importlib.metadata.PackageNotFoundError:  # no cuDNN frontend installed: same key without its version
        key = {"format": 1, "spec": dataclasses.asdict(spec), "cudnn": device.cudnn_version,
               "compute_capability": list(device.compute_capability), "gpu": device.name}
        return key


def test_memory_then_disk_then_build(tmp_path):
    build = Builder()
    c = cache_lib.GraphCache(str(tmp_path))
    key = _key()
    first = c.get(key, build)
    assert build.calls == 1 and c.stats["builds"] == 1
    assert c.get(key, build) == first and c.stats["memory_hits"] == 1
    fresh = cache_lib.GraphCache(str(tmp_path))  # a new process' cache: empty memory, same directory
    assert fresh.get(key, build) == first
    assert build.calls == 1 and fresh.stats["disk_hits"] == 1


VARIATIONS = {
    "direction": "bwd", "dtype": "float16", "b": 3, "t": 65, "s": 97, "n": 4, "k": 4, "h": 128, "hv": 32,
    "scale": 0.2, "alignment": "bottom_right", "left_bound": 17, "right_bound": 0, "padding": True, "bias_b": 1,
    "bias_n": 8, "dropout": 0.1, "sinks": True, "deterministic": True, "ragged": True, "t_total": 2048,
    "s_total": 4096, "pages": (64, 16, 8), "stats": False, "ragged_stats": True, "memset_rows": True,
    "modifier": ScoreModifier(jaxpr=None, function=None, arg_dims=(), key="a modifier"), "bias_grad": False,
    "fp8": True,
    "row_max": True,
}


def test_every_field_changes_the_key():
    assert set(VARIATIONS) == {f.name for f in dataclasses.fields(graphs.GraphSpec)}
    digests = {cache_lib.key_digest(_key())}
    for name, value in VARIATIONS.items():
        digests.add(cache_lib.key_digest(_key(dataclasses.replace(SPEC, **{name: value}))))
    for device in (support.Device((10, 0), "NVIDIA H200", 91900), support.Device((9, 0), "NVIDIA H100", 91900),
                   support.Device((9, 0), "NVIDIA H200", 92000)):
        digests.add(cache_lib.key_digest(_key(device=device)))
    assert len(digests) == 1 + len(VARIATIONS) + 3


def test_distinct_configurations_never_share_an_entry(tmp_path):
    c = cache_lib.GraphCache(str(tmp_path))
    a = c.get(_key(), Builder(b"a"))
    b = c.get(_key(dataclasses.replace(SPEC, sinks=True)), Builder(b"b"))
    assert a.blob != b.blob
    assert len(os.listdir(tmp_path)) == 2


@pytest.mark.parametrize(
    "damage",
    ["truncate", "flip_blob_byte", "garbage", "empty", "other_key"],
)
def test_corrupt_entry_is_discarded_and_rebuilt(tmp_path, damage, caplog):
    key = _key()
    c = cache_lib.GraphCache(str(tmp_path))
    c.get(key, Builder())
    path = c.path(key)
    data = _read(path)
    if damage == "truncate":
        data = data[: len(data) - 10]
    elif damage == "flip_blob_byte":
        data = data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:]
    elif damage == "garbage":
        data = b"\x00" * len(data)
    elif damage == "empty":
        data = b""
    else:
        data = cache_lib.encode_entry(_key(dataclasses.replace(SPEC, b=7)), _entry())
    with open(path, "wb") as f:
        f.write(data)
    fresh = cache_lib.GraphCache(str(tmp_path))
    build = Builder()
    entry = fresh.get(key, build)
    assert build.calls == 1 and fresh.stats["discarded"] == 1
    assert entry == _entry()
    assert cache_lib.decode_entry(key, _read(path)) == _entry()  # rewritten intact
    assert "corrupt cached cuDNN graph" in caplog.text


def test_memory_cache_is_bounded():
    c = cache_lib.GraphCache(None, max_entries=2)
    build = Builder()
    keys = [_key(dataclasses.replace(SPEC, b=b)) for b in (1, 2, 3)]
    for key in keys:
        c.get(key, build)
    assert len(c) == 2 and c.stats["evictions"] == 1
    c.get(keys[0], build)  # evicted: rebuilt (no disk)
    assert build.calls == 4
    with pytest.raises(ValueError, match="max_entries"):
        cache_lib.GraphCache(None, max_entries=0)


def test_environment_variable_selects_or_disables_the_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLIB_CACHE_DIR", str(tmp_path / "x"))
    assert cache_lib.default_directory() == str(tmp_path / "x")
    monkeypatch.setenv("ATTNLIB_CACHE_DIR", "")
    assert cache_lib.default_directory() is None
    c = cache_lib.GraphCache()
    c.get(_key(), Builder())
    assert c.path(_key()) is None and not (tmp_path / "x").exists()


def test_unwritable_directory_still_builds(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    c = cache_lib.GraphCache(str(blocker / "sub"))
    build = Builder()
    assert c.get(_key(), build) == _entry() and build.calls == 1


def _fill(directory: str, tag: bytes, rounds: int) -> None:
    c = cache_lib.GraphCache(directory)
    for _ in range(rounds):
        c.clear_memory()
        os.environ.pop("ATTNLIB_CACHE_DIR", None)
        c._write(_key(), c.path(_key()), _entry(tag))  # force a write each round, racing the other process


def test_two_processes_filling_the_cache_corrupt_nothing(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_fill, args=(str(tmp_path), b"same", 50)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []
    c = cache_lib.GraphCache(str(tmp_path))
    assert c.get(_key(), Builder(b"other")) == _entry(b"same") and c.stats["disk_hits"] == 1


def test_persistence_across_real_processes(tmp_path):
    code = (
        "import sys\n"
        "from tests.test_cudnn_cache import _key, Builder\n"
        "from attnlib._src.backends.cudnn import cache\n"
        "c = cache.GraphCache(sys.argv[1]); b = Builder(); c.get(_key(), b); print(b.calls)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = [
        subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=root)
        for _ in range(2)
    ]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    assert [r.stdout.strip() for r in runs] == ["1", "0"]


_MODIFIER_KEY_SNIPPET = r"""
import dataclasses, sys
import jax.numpy as jnp
from attnlib._src.backends.cudnn import attention as dense, cache, support
from attnlib._src.config import AttentionConfig
from attnlib._src import modifiers
import test_cudnn_support as ts

def alibi(score, batch, head, q_idx, kv_idx, slope):
    return score - slope * jnp.abs(q_idx - kv_idx).astype(jnp.float32)

mods = modifiers.describe(alibi, lambda b, h, i, j, slope: j <= i + 3, (jnp.ones((8, 1, 1)),))
config = dataclasses.replace(ts.BASE, modifiers=mods, logits_soft_cap=30.0, is_causal=True)
plan = dense.make_plan(config, 2, config.q_len, None)
device = support.Device((9, 0), "NVIDIA H200", 91900)
print(*(cache.key_digest(dense.graphs.cache_key(spec, device)) for spec in (plan.fwd, plan.bwd)))
"""


@pytest.mark.full  # heavy; its feature runs in the fast tier elsewhere
def test_modifier_graph_keys_are_stable_across_processes_and_distinct():
    """The same score_mod / mask_mod in a fresh process gives the same graph keys (a disk-cache hit); changing the
    function gives other keys."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__)] + sys.path))
    run = lambda code: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    first, second = run(_MODIFIER_KEY_SNIPPET).stdout.split(), run(_MODIFIER_KEY_SNIPPET).stdout.split()
    assert first == second and len(first) == 2 and first[0] != first[1]
    other = run(_MODIFIER_KEY_SNIPPET.replace("i + 3", "i + 4")).stdout.split()
    assert not set(other) & set(first)


def _plant(directory, tag=b"planted"):
    """Another user's entry for `_key()`: a valid file whose graph differs from what this process would build."""
    path = os.path.join(directory, cache_lib.key_digest(_key()) + ".graph")
    with open(path, "wb") as f:
        f.write(cache_lib.encode_entry(_key(), _entry(tag)))
    return path


def test_a_new_cache_directory_is_private(tmp_path):
    c = cache_lib.GraphCache(str(tmp_path / "cache"))
    c.get(_key(), Builder())
    assert os.stat(tmp_path / "cache").st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o1777])
def test_a_planted_entry_in_a_shared_directory_is_never_used(tmp_path, caplog, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    _plant(str(shared))
    c = cache_lib.GraphCache(str(shared))
    build = Builder()
    with caplog.at_level("WARNING", logger="attnlib"):
        assert c.get(_key(), build) == _entry() and build.calls == 1
        c.clear_memory()
        assert c.get(_key(), build) == _entry() and build.calls == 2  # still not from disk
    warnings = [r.getMessage() for r in caplog.records if "not using the cuDNN graph cache" in r.getMessage()]
    assert len(warnings) == 1 and "writable by others" in warnings[0]
    with open(os.path.join(shared, cache_lib.key_digest(_key()) + ".graph"), "rb") as f:
        assert f.read().endswith(b"planted}")  # nothing written there either


def test_an_entry_or_directory_of_another_user_is_never_used(tmp_path, caplog):
    """As another user: this process' uid differs from the owner of the directory and of the planted file."""
    _plant(str(tmp_path))
    other = cache_lib.GraphCache(str(tmp_path), uid=os.getuid() + 1)
    build = Builder()
    with caplog.at_level("WARNING", logger="attnlib"):
        assert other.get(_key(), build) == _entry() and build.calls == 1
    assert any("belongs to uid" in r.getMessage() for r in caplog.records)


def test_an_entry_file_of_another_user_in_a_private_directory_is_never_used(tmp_path, caplog, monkeypatch):
    path = _plant(str(tmp_path))
    real_fstat = os.fstat

    def foreign_owner(fd):  # the planted file as another user's (chown needs root)
        st = real_fstat(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid + 1, *tuple(st)[5:]))

    monkeypatch.setattr(cache_lib.os, "fstat", foreign_owner)
    c = cache_lib.GraphCache(str(tmp_path))
    build = Builder()
    with caplog.at_level("WARNING", logger="attnlib"):
        assert c.get(_key(), build) == _entry() and build.calls == 1
    assert c.stats["untrusted"] == 1
    assert any(path in r.getMessage() and "belongs to uid" in r.getMessage() for r in caplog.records)
