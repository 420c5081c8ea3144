"""Draw the performance page's plots from the committed results in `benchmarks/results/` (it measures nothing).

Usage: python benchmarks/plot.py tpu [--out docs/images/perf_tpu_v5e.png]
       python benchmarks/plot.py model [--out docs/images/perf_model.png]

`tpu`: forward, forward + backward and paged-decode panels from `bench_tpu_v5e.json` and `bench_tpu_decode_v5e.json`;
`model`: a panel of training-step tokens/s per `bench_model_*.json`, attnlib's MFU over its bar. A variant that
refused a case, failed or was not run has no bar.
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
MODEL = [
    ("attnlib (automatic)", "attnlib"),
    ("raw splash, 512-blocks", "splash"),
    ("raw splash, GQA in its MHA kernel", "splash_grouped"),
    ("tokamax", "tokamax"),
    ("jax.nn cuDNN", "jax_nn_cudnn"),
    ("jax.nn (XLA)", "jax_nn"),
]


def _bars(ax, names, items, value, title, unit, legend: dict) -> dict:
    """One bar per name for each `(label, key)` of `items` (`value(name, key)`, None: no bar); the bars by key."""
    width, drawn = 0.8 / max(1, len(items)), {}
    for i, (label, key) in enumerate(items):
        values = [value(name, key) for name in names]
        drawn[key] = ax.bar(np.arange(len(names)) + (i - (len(items) - 1) / 2) * width,
                            [np.nan if v is None else v for v in values], width, label=label)  # fmt: skip
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit)
    ax.set_ylim(0, 1.25 * ax.get_ylim()[1])
    ax.legend(fontsize=7, **legend)
    return drawn


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


def tpu(out: str) -> None:
    train = json.loads((RESULTS / "bench_tpu_v5e.json").read_text())
    decode = json.loads((RESULTS / "bench_tpu_decode_v5e.json").read_text())
    fig, axes = plt.subplots(1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [1, 1, 1.15]})
    cases = list(train["cases"])
    variant = lambda name, key, field: train["cases"][name]["variants"].get(key, {}).get(field)  # noqa: E731
    legend = {"loc": "upper left", "ncol": 2}
    for ax, (kind, title) in zip(axes[:2], (("fwd", "forward"), ("fwd_bwd", "forward + backward"))):
        _bars(ax, cases, TRAINING, lambda n, k: variant(n, k, f"{kind}_tflops"), f"{title}, bf16", "TFLOP/s", legend)
        ax.set_xticks(range(len(cases)), [_training_label(train["cases"][c]) for c in cases], fontsize=7)
    steps = [n for n, c in decode["cases"].items() if "attnlib" in c["variants"]]
    gb_s = lambda n, k: decode["cases"][n]["variants"].get(k, {}).get("gb_s")  # noqa: E731
    _bars(axes[2], steps, DECODE, gb_s, "paged serving step, bf16", "GB/s (visible keys and values)", legend)
    axes[2].set_xticks(range(len(steps)), [_decode_label(decode["cases"][n]) for n in steps], fontsize=7)
    # The dates the result files record (in their free-text fields).
    header = json.dumps([{k: v for k, v in r.items() if k != "cases"} for r in (train, decode)])
    dates = ", ".join(sorted(set(re.findall(r"\d{4}-\d{2}-\d{2}", header)))) or "date not recorded"
    fig.suptitle(f"one TPU v5e chip, jax {train['jax']}, measured {dates} "
                 "(bench_tpu_v5e.json, bench_tpu_decode_v5e.json)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def model(out: str) -> None:
    files = sorted(RESULTS.glob("bench_model_*.json"))
    if not files:
        raise SystemExit(f"no bench_model_*.json in {RESULTS}")
    columns = min(2, len(files))
    rows = -(-len(files) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(7 * columns, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(files) :]:
        ax.set_visible(False)
    for ax, path in zip(axes.flat, files):
        result = json.loads(path.read_text())
        groups = []  # (label, {variant: row}) per config and framework that attnlib ran in
        for name, config in result["configs"].items():
            for framework, rows in config.get("frameworks", {}).items():
                if rows.get("variants", {}).get("attnlib", {}).get("step_ms"):
                    groups.append((f"{name}\n{framework}", rows["variants"]))
        present = [(label, key) for label, key in MODEL if any(v.get(key, {}).get("step_ms") for _, v in groups)]
        tokens = lambda i, key: (groups[i][1].get(key, {}).get("tokens_per_s") or np.nan) / 1e3  # noqa: E731
        title = (f"{result.get('device_kind', result.get('device'))}, remat {result.get('remat', 'full')}, "
                 f"{result.get('optimizer', 'adamw')}\n{path.name} (attnlib's MFU over its bar)")  # fmt: skip
        drawn = _bars(ax, range(len(groups)), present, tokens, title, "thousand tokens / s (training step)",
                      {"loc": "upper right"})  # fmt: skip
        for bar, (_, rows) in zip(drawn.get("attnlib", ()), groups):
            if rows["attnlib"].get("mfu"):
                ax.annotate(f"{100 * rows['attnlib']['mfu']:.0f}%", (bar.get_x() + bar.get_width() / 2,
                            bar.get_height()), ha="center", va="bottom", fontsize=7)  # fmt: skip
        ax.set_xticks(np.arange(len(groups)), [label for label, _ in groups], fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    plots = parser.add_subparsers(dest="plot", required=True)
    for name, image in (("tpu", "perf_tpu_v5e.png"), ("model", "perf_model.png")):
        plots.add_parser(name).add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "images" / image)
    args = parser.parse_args(argv)
    {"tpu": tpu, "model": model}[args.plot](str(args.out))
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
