"""What the benchmark scripts share: timing loops, inputs, checks against a reference, error strings, argument
parsing, JSON files, fresh processes and the settings switched around one variant. Scripts import it by name: a
script's own folder is on `sys.path` when it runs. `best_per_call` times the GPU scripts, `time_calls` the TPU ones.
"""

import argparse
import collections
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import attnlib


def best_per_call(fn, args, loop: int, reps: int = 10, warmup: int = 2) -> float:
    """Seconds per call: the best mean of `reps` loops of `loop` calls of `fn(*args)`, after `warmup` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(loop):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / loop)
    return best


def round_robin(timed: dict, rounds: int, reps: int = 5) -> dict:
    """`{(label, field): (fn, args, loop)}` timed round-robin, each call once a round (`best_per_call`), so that the
    device's state when its turn comes favours none: `{label: {field: best ms a call over the rounds}}`; a call that
    raised gets `{field with "_ms" -> "_error" (else + "_error"): message}` instead and is not timed again."""
    out = collections.defaultdict(dict)
    for _ in range(rounds):
        for (label, field), (fn, args, loop) in timed.items():
            failed = field.replace("_ms", "_error", 1) if "_ms" in field else f"{field}_error"
            if failed in out[label]:
                continue
            try:
                ms = best_per_call(fn, args, loop, reps) * 1e3
                out[label][field] = min(out[label].get(field, float("inf")), ms)
            except Exception as e:  # noqa: BLE001  (reported, not fatal: e.g. a peer without a backward)
                out[label][failed] = error(e, 200)
    return out


def time_calls(fn, args, *, target_s: float = 0.05, max_loop: int = 20, loops: int = 5, warmup: int = 2) -> list:
    """Per-call seconds of `loops` timed loops (each `loop` calls then one `block_until_ready`), after `warmup`
    calls; `loop` is chosen from the last warm-up call so that a loop takes about `target_s`."""
    one = float("inf")
    for _ in range(warmup):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        one = time.perf_counter() - start
    loop = max(1, min(max_loop, int(target_s / max(one, 1e-9))))
    times = []
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(loop):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / loop)
    return times


def normal(*shapes, seed: int = 0, dtype=jnp.bfloat16, via_float32: bool = False) -> list:
    """One standard normal array per shape, from `jax.random.split(jax.random.key(seed), len(shapes))`; drawn in
    float32 and cast with `via_float32`."""
    keys, drawn = jax.random.split(jax.random.key(seed), len(shapes)), jnp.float32 if via_float32 else dtype
    return [jax.random.normal(key, shape, drawn).astype(dtype) for key, shape in zip(keys, shapes)]


def grad_fn(f, dout=None):
    """The gradient wrt the first three arguments (q, k, v) of `sum(f(...))` in float32, or of `sum(f(...) * dout)`."""
    if dout is None:
        return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
    return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * dout.astype(jnp.float32)), argnums=(0, 1, 2))


def visible_pairs(length: int, causal: bool = True, window: int | None = None) -> int:
    """The (query, key) pairs that `length` queries over as many keys see: all, causal, or causal within a left window
    (keys i - window .. i)."""
    if not causal:
        return length * length
    if window is None:
        return length * (length + 1) // 2
    return int(np.sum(np.minimum(np.arange(length), window) + 1))


def flops(pairs: int, h: int, hv: int) -> tuple[float, float]:
    """Forward and forward + backward FLOPs of `pairs` visible (query, key) pairs summed over rows and heads, the
    cuDNN frontend's convention: `2 pairs (H + Hv)` and `2 pairs (4 H + 3 Hv)`."""
    return 2.0 * pairs * (h + hv), 2.0 * pairs * (4 * h + 3 * hv)


def reference(q, k, v, **kw) -> np.ndarray:
    """attnlib's `xla` implementation on float32 copies of `q`, `k`, `v` at the highest matmul precision."""
    with jax.default_matmul_precision("highest"):
        out = attnlib.attention(*(x.astype(jnp.float32) for x in (q, k, v)), implementation="xla", **kw)
    return np.asarray(out, np.float32)


def tolerance(reference) -> float:
    """The error a bf16 variant may have against a float32 reference: `4 eps(bf16) max|ref|`."""
    return 4 * float(jnp.finfo(jnp.bfloat16).eps) * float(np.max(np.abs(reference)))


def checked(out, reference, tol: float, rows=None) -> dict:
    """`{"max_err": ...}` of `out` against `reference` (only where `rows`, if given), with `"wrong"` beyond `tol`."""
    diff = np.abs(np.asarray(out, np.float32) - reference)
    err = float(np.max(diff if rows is None else np.where(rows, diff, 0)))
    return {"max_err": err} if err <= tol else {"max_err": err, "wrong": f"max |err| {err:.3g} > {tol:.3g}"}


def error(e: Exception, limit: int = 300) -> str:
    return f"{type(e).__name__}: {str(e)[:limit]}"


def error_or_oom(e: Exception) -> str:
    """`error(e)`, or "out of memory" when it is that (compiling or running)."""
    text = f"{type(e).__name__}: {e}".lower()
    oom = "resource_exhausted" in text or "out of memory" in text or "ran out of memory" in text
    return "out of memory" if oom else error(e)


def parser(doc: str, *, only: str | None = None, rounds: int | None = None) -> argparse.ArgumentParser:
    """A script's argument parser, described by its docstring's first paragraph, with `--json FILE`; `--only NAME ...`
    (`only`: its help) and `--rounds N` (`rounds`: the default) where given."""
    p = argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].split()))
    p.add_argument("--json", help="write the results here")
    if only is not None:
        p.add_argument("--only", nargs="*", default=None, help=only)
    if rounds is not None:
        p.add_argument("--rounds", type=int, default=rounds)
    return p


def compiled_bytes(compiled) -> dict | None:
    """A compiled executable's argument, output, aliased and temporary bytes (XLA's memory analysis), or None."""
    try:
        m = compiled.memory_analysis()
        return {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
                "aliased": int(m.alias_size_in_bytes), "temporaries": int(m.temp_size_in_bytes)}  # fmt: skip
    except Exception:  # noqa: BLE001  (a backend without the analysis)
        return None


def markdown(header: list[str], rows) -> str:
    """A Markdown table: `header`, then one line per row of cells."""
    return "\n".join(f"| {' | '.join(map(str, cells))} |" for cells in [header, ["---"] * len(header), *rows])


def check_names(parser, given, known, what: str = "cases") -> None:
    """`parser.error` naming what of `given` is not in `known`."""
    unknown = set(given or ()) - set(known)
    if unknown:
        parser.error(f"unknown {what} {sorted(unknown)}; known: {list(known)}")


def device_and_jax() -> dict:
    return {"device": str(jax.devices()[0]), "jax": jax.__version__}


def write_json(path: str | None, data, indent: int = 1) -> None:
    """`data` as JSON at `path` (nothing without a path): scripts write after every case, so that a run cut short
    keeps what it measured."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=indent)


def fresh_processes(snippet: str, runs: int = 2, **env: str) -> list[dict]:
    """The JSON printed last by each of `runs` fresh Python processes running `snippet` in turn on one new, empty
    ATTNLIB_CACHE_DIR (the first builds the cuDNN graphs that the next read from disk), `env` set; `{"error":
    stderr}` for a process that failed."""
    results = []
    with tempfile.TemporaryDirectory() as cache:
        for _ in range(runs):
            done = subprocess.run([sys.executable, "-c", snippet], env=dict(os.environ, ATTNLIB_CACHE_DIR=cache, **env),
                                  capture_output=True, text=True)  # fmt: skip
            results.append({"error": done.stderr[-2000:]} if done.returncode else
                           json.loads(done.stdout.strip().splitlines()[-1]))  # fmt: skip
    return results


def tokamax_or_none(stdout: bool = False):
    """The `tokamax` module, a benchmark-only peer, or None (the reason printed, to stderr unless `stdout`)."""
    try:
        import tokamax

        return tokamax
    except Exception as e:  # noqa: BLE001  (reported, not fatal)
        print(f"tokamax unavailable: {error(e, 200)}", file=sys.stdout if stdout else sys.stderr)
        return None


def graph_replay(label: str):
    """ATTNLIB_CUDNN_GRAPH_REPLAY for the executables compiled inside (the extension reads it per executable): "0"
    for a `*_direct` variant, "always" for `*_always`, else "" (each call's own choice, `executor.replays`)."""
    mode = "0" if label.endswith("_direct") else "always" if label.endswith("_always") else ""
    return mock.patch.dict(os.environ, {"ATTNLIB_CUDNN_GRAPH_REPLAY": mode})


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """A paged serving step (`bench_peers.py --suite decode`'s mixed ones, `bench_tpu_decode.py`'s). Decode: `b`
    sequences of `length` cached tokens, one query each. Mixed: `prompts` prefill chunks plus `decodes` decode queries
    over `decode_length` tokens (`b`, `length` unused). GQA `n`/`k` heads of `h`."""

    b: int
    length: int
    n: int
    k: int
    h: int
    page_size: int
    prompts: tuple[int, ...] = ()
    decodes: int = 0
    decode_length: int = 0

    @property
    def mixed(self) -> bool:
        return bool(self.prompts)

    @property
    def kv_lengths(self) -> tuple[int, ...]:
        return self.prompts + (self.decode_length,) * self.decodes if self.mixed else (self.length,) * self.b

    @property
    def q_lengths(self) -> tuple[int, ...]:
        return self.prompts + (1,) * self.decodes if self.mixed else (1,) * self.b


def token_major_cache(k_pages, v_pages, page_table, lengths) -> attnlib.PagedKVCache:
    """A token-major `PagedKVCache` holding the pools `[P, page_size, K, H]` (every page in use), the page table and
    the lengths."""
    P, page, K, H = k_pages.shape
    cache = attnlib.PagedKVCache.create(page_table.shape[0], P, page, K, H, max_pages_per_seq=page_table.shape[1],
                                        layout="token_major")  # fmt: skip
    return dataclasses.replace(cache, pools=(k_pages, v_pages), page_table=page_table,
                               lengths=jnp.asarray(lengths, jnp.int32), num_used_pages=jnp.asarray(P, jnp.int32))


def packed_reference(q, kv_of, q_lengths, kv_lengths, n: int, k: int, h: int) -> np.ndarray:
    """float32 bottom-right causal attention of each sequence's queries (packed `[T, N, H]`, `q_lengths` of them) over
    its keys and values (`kv_of(b, s)`: the `s = kv_lengths[b]` of sequence `b`, `[s, K, H]` each), packed."""
    out, start = [], 0
    for b, (t, s) in enumerate(zip(q_lengths, kv_lengths)):
        keys, values = (x.astype(jnp.float32) for x in kv_of(b, s))
        qf = q[start : start + t].astype(jnp.float32).reshape(t, k, -1, h) / np.sqrt(h)
        scores = jnp.einsum("tkgh,skh->kgts", qf, keys, precision=jax.lax.Precision.HIGHEST)
        visible = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t)
        p = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), -1)
        o = jnp.einsum("kgts,skh->tkgh", p, values, precision=jax.lax.Precision.HIGHEST)
        out.append(np.asarray(o.reshape(t, n, h)))
        start += t
    return np.concatenate(out)
