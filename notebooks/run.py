"""Execute the notebooks top to bottom and report their run times (CI: `python3 notebooks/run.py`).

A plain run changes no file. `--write` stores the executed outputs back into the notebooks and lets the notebooks
redraw the pictures the docs reuse (`docs/images/*.png`, through `ATTNLIB_WRITE_IMAGES=1`): do this before committing
a changed notebook. Each notebook runs in a fresh kernel with `notebooks/` as its working directory; it fails on the
first error.
"""

import argparse
import os
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient


HERE = pathlib.Path(__file__).resolve().parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="notebook paths (default: notebooks/*.ipynb)")
    parser.add_argument("--write", action="store_true",
                        help="save the executed outputs into the notebooks and redraw docs/images/")  # fmt: skip
    parser.add_argument("--max-seconds", type=float, default=120.0, help="fail a notebook slower than this")
    args = parser.parse_args(argv)
    paths = [pathlib.Path(p) for p in args.notebooks] or sorted(HERE.glob("*.ipynb"))
    os.environ["ATTNLIB_WRITE_IMAGES"] = "1" if args.write else "0"  # read by the kernels the notebooks run in
    failed = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(
            nb, timeout=300, kernel_name="python3", record_timing=False,
            resources={"metadata": {"path": str(path.resolve().parent)}},
        )  # fmt: skip
        start = time.perf_counter()
        try:
            client.execute()
        except Exception as e:  # report every notebook, then fail
            print(f"FAILED {path.name} after {time.perf_counter() - start:.1f} s: {type(e).__name__}: {e}")
            failed.append(path.name)
            continue
        seconds = time.perf_counter() - start
        status = "ok" if seconds <= args.max_seconds else f"too slow (> {args.max_seconds:g} s)"
        print(f"{path.name:40s} {seconds:6.1f} s  {status}", flush=True)
        if seconds > args.max_seconds:
            failed.append(path.name)
        if args.write:
            nbformat.write(nb, path)
    print(f"{len(paths) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
