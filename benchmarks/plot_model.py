"""Draw the model benchmark's plot of the performance page from the committed `bench_model.py` results.

Usage: python benchmarks/plot_model.py [--out docs/images/perf_model.png]

Reads every `benchmarks/results/bench_model_*.json` (one per machine) and draws one panel per file: the training
step's tokens/s of each attention core (attnlib, jax.nn, jax.nn cuDNN, raw splash, tokamax) side by side per config
and framework, attnlib's MFU written over its bar. It measures nothing; a variant that was skipped, failed or was
not reached has no bar.
"""

import argparse
import json
import pathlib

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

VARIANTS = [
    ("attnlib (automatic)", "attnlib"),
    ("raw splash, 512-blocks", "splash"),
    ("tokamax", "tokamax"),
    ("jax.nn cuDNN", "jax_nn_cudnn"),
    ("jax.nn (XLA)", "jax_nn"),
]


def _groups(result: dict) -> list[tuple[str, dict]]:
    """`(label, {variant: row})` per config and framework that attnlib ran in."""
    groups = []
    for name, config in result["configs"].items():
        for framework, rows in config.get("frameworks", {}).items():
            variants = rows.get("variants", {})
            if variants.get("attnlib", {}).get("step_ms"):
                groups.append((f"{name}\n{framework}", variants))
    return groups


def _panel(ax, title: str, groups: list[tuple[str, dict]]) -> None:
    present = [(label, key) for label, key in VARIANTS if any(v.get(key, {}).get("step_ms") for _, v in groups)]
    width = 0.8 / max(1, len(present))
    for i, (label, key) in enumerate(present):
        x = np.arange(len(groups)) + (i - (len(present) - 1) / 2) * width
        tokens = [rows.get(key, {}).get("tokens_per_s") or np.nan for _, rows in groups]
        bars = ax.bar(x, np.asarray(tokens) / 1e3, width, label=label)
        if key == "attnlib":
            for bar, (_, rows) in zip(bars, groups):
                mfu = rows["attnlib"].get("mfu")
                if mfu:
                    ax.annotate(f"{100 * mfu:.0f}%", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=7)  # fmt: skip
    ax.set_xticks(np.arange(len(groups)), [label for label, _ in groups], fontsize=7)
    ax.set_ylabel("thousand tokens / s (training step)")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, 1.25 * ax.get_ylim()[1])
    ax.legend(fontsize=7, loc="upper right")


def main(argv=None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "images" / "perf_model.png")
    args = parser.parse_args(argv)
    files = sorted(RESULTS.glob("bench_model_*.json"))
    if not files:
        raise SystemExit(f"no bench_model_*.json in {RESULTS}")
    fig, axes = plt.subplots(1, len(files), figsize=(6 * len(files), 4.2), squeeze=False)
    for ax, path in zip(axes[0], files):
        result = json.loads(path.read_text())
        device = result.get("device_kind", result.get("device"))
        title = f"{device}, remat {result.get('remat', 'full')}: {path.name} (attnlib's MFU over its bar)"
        _panel(ax, title, _groups(result))
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
