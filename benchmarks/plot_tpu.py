"""Draw the TPU v5e speed plot of the README and the performance page from the committed TPU results.

Usage: python benchmarks/plot_tpu.py [--out docs/images/perf_tpu_v5e.png]

Reads `benchmarks/results/bench_tpu_v5e.json` (`bench_tpu.py`: training-shaped attention, TFLOP/s over the visible
(query, key) pairs) and `benchmarks/results/bench_tpu_decode_v5e.json` (`bench_tpu_decode.py`: one serving step on a
paged cache, GB/s of visible keys and values) and draws three panels: forward TFLOP/s, forward + backward TFLOP/s,
and paged-decode GB/s, each variant side by side per case, as `notebooks/07_performance.ipynb` draws the H200's. It
measures nothing; a variant that refused a case (or was not run) has no bar.
"""

import argparse
import json
import pathlib
import re

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

TRAINING = [
    ("attnlib (automatic)", "attnlib"),
    ("raw splash, 512-blocks", "splash"),
    ("raw splash, default blocks", "splash_default"),
    ("attnlib xla_chunked", "attnlib_xla_chunked"),
]
DECODE = [
    ("attnlib, PagedKVCache (combined)", "attnlib"),
    ("raw ragged_paged_attention", "ragged_paged_attention"),
    ("raw paged_attention", "paged_attention"),
    ("bare token-major pools", "attnlib_token_major"),
]


def _heads(shape: dict) -> str:
    return f"GQA {shape['n']}/{shape['k']}" if shape["n"] != shape["k"] else f"MHA {shape['n']}"


def _training_label(case: dict) -> str:
    shape = case["shape"]
    mask = f"window {shape['window']}" if shape.get("window") else "causal" if shape["causal"] else "full"
    return f"{_heads(shape)}\n{mask}\nb{shape['b']} · s{shape['s']}\nd{shape['h']}"


def _decode_label(case: dict) -> str:
    shape = case["shape"]
    if shape.get("prompts"):
        label = f"mixed step\n{len(shape['prompts'])} prefills\n+ {shape['decodes']} decodes"
    else:
        label = f"{_heads(shape)}\nb{shape['b']} · {shape['length']} tok\nd{shape['h']} · page {shape['page_size']}"
    if case.get("attnlib_pick") != "pallas_tpu":  # recorded by the benchmark: what automatic dispatch ran
        label += f"\n(attnlib ran\n{case['attnlib_pick']})"
    return label


def _dates(*results: dict) -> str:
    """The dates the result files record (in their free-text fields)."""
    found = sorted(set(re.findall(r"\d{4}-\d{2}-\d{2}", json.dumps([
        {k: v for k, v in r.items() if k != "cases"} for r in results]))))  # fmt: skip
    return ", ".join(found) or "date not recorded"


def _bars(ax, names, items, value, title, unit):
    width = 0.8 / len(items)
    for i, (label, key) in enumerate(items):
        values = [value(name, key) for name in names]
        ax.bar(np.arange(len(names)) + (i - (len(items) - 1) / 2) * width,
               [np.nan if v is None else v for v in values], width, label=label)  # fmt: skip
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit)
    ax.set_ylim(0, 1.25 * ax.get_ylim()[1])
    ax.legend(fontsize=7, loc="upper left", ncol=2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "images" / "perf_tpu_v5e.png"))
    args = parser.parse_args(argv)
    train = json.loads((RESULTS / "bench_tpu_v5e.json").read_text())
    decode = json.loads((RESULTS / "bench_tpu_decode_v5e.json").read_text())

    fig, axes = plt.subplots(1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [1, 1, 1.15]})
    cases = list(train["cases"])
    variant = lambda name, key, field: train["cases"][name]["variants"].get(key, {}).get(field)
    for ax, (kind, title) in zip(axes[:2], (("fwd", "forward"), ("fwd_bwd", "forward + backward"))):
        _bars(ax, cases, TRAINING, lambda n, k: variant(n, k, f"{kind}_tflops"), f"{title}, bf16", "TFLOP/s")
        ax.set_xticks(range(len(cases)), [_training_label(train["cases"][c]) for c in cases], fontsize=7)

    steps = [n for n, c in decode["cases"].items() if "attnlib" in c["variants"]]
    gb_s = lambda n, k: decode["cases"][n]["variants"].get(k, {}).get("gb_s")
    _bars(axes[2], steps, DECODE, gb_s, "paged serving step, bf16", "GB/s (visible keys and values)")
    axes[2].set_xticks(range(len(steps)), [_decode_label(decode["cases"][n]) for n in steps], fontsize=7)

    fig.suptitle(f"one TPU v5e chip, jax {train['jax']}, measured {_dates(train, decode)} "
                 "(bench_tpu_v5e.json, bench_tpu_decode_v5e.json)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
