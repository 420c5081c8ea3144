"""Cache of built cuDNN graphs: bounded in memory, persistent on disk under `ATTNLIB_CACHE_DIR`.

Building a graph takes about a second; reading one back takes milliseconds. An entry is keyed by a SHA-256 of
everything that changes the graph (the `GraphSpec`, cuDNN and frontend versions, GPU). On disk each entry is one file
`<digest>.graph`: a magic line, a JSON header (the full key, sizes, the blob's SHA-256) and the blob. Files are
written to a temporary name and renamed, so readers never see a partial file and concurrent writers of one entry
just replace each other's identical bytes. An entry that fails any check (truncated, corrupt, another key) is
deleted and rebuilt.

A cached entry is a serialized graph that cuDNN executes in this process, and its name is computable from public
facts, so the disk is trusted only as ssh and pip trust theirs: the directory is created with mode 0700, and entries
are read and written only while the directory belongs to this user and no one else may write to it, and an entry
only when its file belongs to this user too. Otherwise the cache logs once and keeps graphs in memory.
"""

import collections
import dataclasses
import hashlib
import json
import logging
import os
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from types import EllipsisType
from typing import Any


logger = logging.getLogger("attnlib")

_MAGIC = b"ATTNLIB-CUDNN-GRAPH v1\n"
_HEADER_LEN = struct.Struct("<Q")


@dataclasses.dataclass(frozen=True)
class GraphEntry:
    """A built, serialized cuDNN graph and how to call it.

    Attributes:
        blob: the canonical serialized graph (UBJSON bytes).
        workspace_bytes: workspace the plan needs.
        in_uids: tensor uid of each FFI operand, in call order.
        out_uids: tensor uid of each FFI result (the workspace result excluded), in order.
        zero_fill: indices into `out_uids` of results to zero before the graph runs.
        label: a short name for error messages.
        plan: which cuDNN plan the blob holds and why (the heuristics' first, or the autotuning timings).
    """

    blob: bytes
    workspace_bytes: int
    in_uids: tuple[int, ...]
    out_uids: tuple[int, ...]
    zero_fill: tuple[int, ...]
    label: str
    plan: str = ""

    def header(self) -> dict[str, Any]:
        return {
            "workspace_bytes": self.workspace_bytes,
            "in_uids": list(self.in_uids),
            "out_uids": list(self.out_uids),
            "zero_fill": list(self.zero_fill),
            "label": self.label,
            "plan": self.plan,
            "blob_bytes": len(self.blob),
            "blob_sha256": hashlib.sha256(self.blob).hexdigest(),
        }


def canonical_key(key: Mapping[str, Any]) -> str:
    """The key as canonical JSON (sorted keys, no whitespace)."""
    return json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)


def key_digest(key: Mapping[str, Any]) -> str:
    """Hex SHA-256 of the canonical key: the entry's name in memory and on disk."""
    return hashlib.sha256(canonical_key(key).encode()).hexdigest()


def default_directory() -> str | None:
    """`ATTNLIB_CACHE_DIR`, else `$XDG_CACHE_HOME/attnlib/cudnn` (`~/.cache/...`); None when set to ""."""
    configured = os.environ.get("ATTNLIB_CACHE_DIR")
    if configured is not None:
        return configured or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attnlib", "cudnn")


def untrusted_reason(st: os.stat_result, uid: int, what: str) -> str | None:
    """Why a cache directory or file with status `st` must not be trusted by user `uid`, or None."""
    if st.st_uid != uid:
        return f"{what} belongs to uid {st.st_uid}, not to this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by others (mode {stat.S_IMODE(st.st_mode):#o})"
    return None


class CorruptEntry(Exception):
    """A cache file failed a check."""


def encode_entry(key: Mapping[str, Any], entry: GraphEntry) -> bytes:
    """The on-disk bytes of one entry."""
    header = json.dumps({"key": canonical_key(key), **entry.header()}, sort_keys=True).encode()
    return _MAGIC + _HEADER_LEN.pack(len(header)) + header + entry.blob


def decode_entry(key: Mapping[str, Any], data: bytes) -> GraphEntry:
    """Parse and verify one entry's bytes.

    Raises:
        CorruptEntry: on a bad magic, a truncated file, another key, or a blob that does not match its hash.
    """
    if not data.startswith(_MAGIC):
        raise CorruptEntry("bad magic")
    offset = len(_MAGIC)
    if len(data) < offset + _HEADER_LEN.size:
        raise CorruptEntry("truncated before the header")
    (header_len,) = _HEADER_LEN.unpack_from(data, offset)
    offset += _HEADER_LEN.size
    if len(data) < offset + header_len:
        raise CorruptEntry("truncated header")
    try:
        header = json.loads(data[offset : offset + header_len])
        blob = data[offset + header_len :]
        if header["key"] != canonical_key(key):
            raise CorruptEntry("the file holds another key")
        if len(blob) != header["blob_bytes"]:
            raise CorruptEntry(f"blob has {len(blob)} bytes, header says {header['blob_bytes']}")
        if hashlib.sha256(blob).hexdigest() != header["blob_sha256"]:
            raise CorruptEntry("blob does not match its SHA-256")
        return GraphEntry(
            blob=blob,
            workspace_bytes=int(header["workspace_bytes"]),
            in_uids=tuple(int(u) for u in header["in_uids"]),
            out_uids=tuple(int(u) for u in header["out_uids"]),
            zero_fill=tuple(int(i) for i in header["zero_fill"]),
            label=str(header["label"]),
            plan=str(header.get("plan", "")),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptEntry(f"unreadable header: {e}") from e


class GraphCache:
    """Memory + disk cache of `GraphEntry`s.

    Args:
        directory: where entries persist; a callable is asked at each lookup (so `ATTNLIB_CACHE_DIR` can change);
            None disables the disk.
        max_entries: bound of the in-memory LRU.
    """

    def __init__(
        self,
        directory: str | None | Callable[[], str | None] = default_directory,
        max_entries: int = 256,
        uid: int | None = None,
    ):
        if max_entries < 1:
            raise ValueError(f"`max_entries` must be at least 1. Got {max_entries}.")
        self._directory = directory
        self._uid = os.getuid() if uid is None else uid
        self._warned: set[str] = set()
        self.max_entries = max_entries
        self._memory: collections.OrderedDict[str, GraphEntry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.stats = collections.Counter()
        self.lookup_seconds: collections.deque[float] = collections.deque(maxlen=4096)
        """Seconds each of the latest `get` calls took (graph set-up at trace time; bounded), for the benchmarks."""
        self.build_seconds: collections.deque[tuple[str, float]] = collections.deque(maxlen=4096)
        """(label, seconds) of the latest graphs `get` built (bounded), for the benchmarks."""

    def directory(self) -> str | None:
        return self._directory() if callable(self._directory) else self._directory

    def path(self, key: Mapping[str, Any], directory: str | None | EllipsisType = ...) -> str | None:
        """The file of `key`'s entry in `directory` (default: the cache's own), or None when the disk cache is off
        or the directory is not trusted."""
        directory = self.directory() if directory is ... else directory
        if directory is None or not self._trusted_directory(directory):
            return None
        return os.path.join(directory, key_digest(key) + ".graph")

    def _distrust(self, where: str, reason: str) -> None:
        if where not in self._warned:
            self._warned.add(where)
            logger.warning(
                "attnlib: not using the cuDNN graph cache at %s: %s; graphs stay in memory (give the directory mode "
                "0700 and your ownership, or set ATTNLIB_CACHE_DIR to a directory of your own).",
                where,
                reason,
            )

    def _trusted_directory(self, directory: str) -> bool:
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            st = os.stat(directory)
        except OSError as e:
            self._distrust(directory, f"cannot create it ({e})")
            return False
        reason = untrusted_reason(st, self._uid, "the directory")
        if reason is not None:
            self._distrust(directory, reason)
            return False
        return True

    def clear_memory(self) -> None:
        with self._lock:
            self._memory.clear()

    def __len__(self) -> int:
        return len(self._memory)

    def get(
        self, key: Mapping[str, Any], build: Callable[[], GraphEntry], directory: str | None | EllipsisType = ...
    ) -> GraphEntry:
        """The entry of `key`: from memory, else from disk (`directory`, default the cache's own; None: no disk),
        else `build()` (then stored in both)."""
        start = time.perf_counter()
        try:
            return self._get(key, build, directory)
        finally:
            self.lookup_seconds.append(time.perf_counter() - start)

    def _get(
        self, key: Mapping[str, Any], build: Callable[[], GraphEntry], directory: str | None | EllipsisType
    ) -> GraphEntry:
        digest = key_digest(key)
        with self._lock:
            entry = self._memory.get(digest)
            if entry is not None:
                self._memory.move_to_end(digest)
                self.stats["memory_hits"] += 1
                return entry
        path = self.path(key, directory)
        entry = self._read(key, path) if path is not None else None
        if entry is not None:
            self.stats["disk_hits"] += 1
        else:
            start = time.perf_counter()
            entry = build()
            self.build_seconds.append((entry.label, time.perf_counter() - start))
            self.stats["builds"] += 1
            if path is not None:
                self._write(key, path, entry)
        with self._lock:
            self._memory[digest] = entry
            self._memory.move_to_end(digest)
            while len(self._memory) > self.max_entries:
                self._memory.popitem(last=False)
                self.stats["evictions"] += 1
        return entry

    def _read(self, key: Mapping[str, Any], path: str) -> GraphEntry | None:
        try:
            with open(path, "rb") as f:
                reason = untrusted_reason(os.fstat(f.fileno()), self._uid, "the file")
                if reason is not None:
                    self.stats["untrusted"] += 1
                    self._distrust(path, reason)
                    return None
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("attnlib: cannot read cached cuDNN graph %s (%s); rebuilding it.", path, e)
            return None
        try:
            return decode_entry(key, data)
        except CorruptEntry as e:
            self.stats["discarded"] += 1
            logger.warning("attnlib: discarding corrupt cached cuDNN graph %s (%s); rebuilding it.", path, e)
            try:
                os.unlink(path)
            except OSError:
                pass
            return None

    def _write(self, key: Mapping[str, Any], path: str, entry: GraphEntry) -> None:
        directory = os.path.dirname(path)
        tmp = None
        try:
            with tempfile.NamedTemporaryFile(
                dir=directory, prefix=os.path.basename(path) + ".", suffix=".tmp", delete=False
            ) as f:
                tmp = f.name
                f.write(encode_entry(key, entry))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            logger.warning("attnlib: cannot write the cuDNN graph cache %s (%s); continuing without it.", path, e)
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
