"""Several hosts: a sharded training step run by two processes (4 CPU devices each, `jax.distributed` on 127.0.0.1)
equals the same step run by one process with 8 devices.

Each run is a subprocess of `tests/multihost_step.py` (the device count is fixed when JAX starts): 3 SGD steps of the
example Llama through `attnlib.attention` (causal GQA, a sliding window, packed documents) on a mesh `data=2,
model=4`, batch over `data`, heads over `model`. All start at once:

- `two`: two processes of 4 devices, `jax.distributed.initialize` with a free port on 127.0.0.1; each feeds only its
  own rows of the batch and gathers the results with `multihost_utils.process_allgather`.
- `one_gloo`: one process of 8 devices under `jax.distributed.initialize(num_processes=1)`: the same collectives
  as `two` (JAX's CPU default across processes, gloo), all in one process.
- `one`: one plain process of 8 devices (XLA's in-process CPU collectives).
- `other`: as `two`, but process 1 changes one token of its rows: a host with other data.

`two` equals `one_gloo` bitwise, in every parameter and loss, on both processes. `two` and `one` differ in the last
bit or so: the two collectives implementations sum an all-reduce over more than two devices in different orders
(in-process: device order, `((x0 + x1) + x2) + x3`; gloo: a ring, each quarter of the buffer starting at another
device, e.g. `((x3 + x2) + x1) + x0` for the first quarter), and the `model` axis has 4 devices. With two devices the
orders agree (`x0 + x1 == x1 + x0`). So `two` is compared with `one` at a float32 round-off tolerance (`ROUND_OFF`).
`other` must fail both comparisons.

Both processes' outputs are checked, not one: the parameters are replicated over `data`, that is across the
processes, and `process_allgather` returns each process's own replicas, so a host whose parameters diverged may show
it in its own output only. (Checked by hand: a learning rate 1.001x on process 1 fails both comparisons, and the two
processes' outputs differ.)
"""

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import bitwise_equal


ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "multihost_step.py"
TIMEOUT_S = 300
EPS32 = float(np.finfo(np.float32).eps)
ROUND_OFF = 16 * EPS32
"""`two` against `one`: |a - b| <= ROUND_OFF * max|b| per array. Measured: <= 1.5 eps (reordered float32 sums in the
all-reduces of 3 steps); 16 eps leaves 4 bits of headroom. One token changed in one host's rows moves every array
by more than 25,000 eps."""


def _free_ports(count: int) -> list[int]:
    """`count` distinct free TCP ports on 127.0.0.1 (held open together while chosen, so they differ)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _env(num_devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={num_devices}").strip()
    return env


def _tail(path: Path, chars: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no output)"
    return "\n".join(line for line in text[-chars:].splitlines() if not line.startswith("[Gloo] Rank"))


def run_together(out: Path, commands: dict[str, tuple[int, list[str]]]) -> dict[str, str]:
    """Start every `name: (CPU devices, argv)` of `commands` at once (cwd the repository root) and wait for all;
    their outputs by name. Any failure or the timeout kills the others and fails the test with every output."""
    out.mkdir(parents=True, exist_ok=True)
    procs, logs = {}, {}
    for name, (devices, argv) in commands.items():
        logs[name] = out / f"{name.replace('/', '_')}.log"
        with open(logs[name], "w") as log:
            procs[name] = subprocess.Popen(argv, cwd=ROOT, env=_env(devices), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + TIMEOUT_S
    failed = []
    while not failed and None in [proc.poll() for proc in procs.values()]:  # poll every process, every time
        failed = [f"{name}: exit {proc.returncode}" for name, proc in procs.items() if proc.returncode not in (None, 0)]
        if time.monotonic() > deadline:
            failed = [f"{name}: no exit within {TIMEOUT_S} s" for name, proc in procs.items() if proc.poll() is None]
        time.sleep(0.1)
    failed = failed or [f"{name}: exit {proc.returncode}" for name, proc in procs.items() if proc.returncode != 0]
    if failed:
        killed = set()
        for name, proc in procs.items():  # the peer of a failed process would wait for it until the runtime gives up
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                killed.add(name)
        status = lambda name: "killed by the test" if name in killed else f"exit {procs[name].returncode}"  # noqa: E731
        report = "\n\n".join(f"--- {name} ({status(name)}) ---\n{_tail(logs[name])}" for name in commands)
        pytest.fail(f"{'; '.join(failed)}\n{report}", pytrace=False)
    return {name: logs[name].read_text(errors="replace") for name in commands}


def run_step(out: Path) -> dict[str, dict]:
    """Run `tests/multihost_step.py` as `one`, `one_gloo`, the two processes of `two` (`two/0`, `two/1`) and those of
    `other` (as `two`, but process 1 changes one token of its rows), all at once; what each wrote (losses and
    parameters), by name."""
    port_gloo, port_two, port_other = _free_ports(3)
    pair = lambda port: ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id"]  # noqa: E731
    args = {
        "one": (8, []),
        "one_gloo": (8, ["--coordinator", f"127.0.0.1:{port_gloo}", "--num-processes", "1", "--process-id", "0"]),
        "two/0": (4, [*pair(port_two), "0"]),
        "two/1": (4, [*pair(port_two), "1"]),
        "other/0": (4, [*pair(port_other), "0"]),
        "other/1": (4, [*pair(port_other), "1", "--perturb"]),
    }
    npz = lambda name: out / f"{name.replace('/', '_')}.npz"  # noqa: E731
    run_together(out, {name: (devices, [sys.executable, str(PROGRAM), "--out", str(npz(name)), *argv])
                       for name, (devices, argv) in args.items()})  # fmt: skip
    return {name: dict(np.load(npz(name))) for name in args}


def assert_bitwise_equal(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), (what, sorted(actual), sorted(expected))
    differ = {
        k: float(np.max(np.abs(actual[k].astype(np.float64) - expected[k])))
        for k in expected
        if not bitwise_equal(actual[k], expected[k])
    }
    assert not differ, f"{what}: {len(differ)} of {len(expected)} arrays differ (max |difference|): {differ}"


def assert_round_off_close(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), (what, sorted(actual), sorted(expected))
    off = {k: float(np.max(np.abs(actual[k].astype(np.float64) - expected[k])) / np.max(np.abs(expected[k])))
           for k in expected}  # fmt: skip
    beyond = {k: f"{v / EPS32:.1f} eps" for k, v in off.items() if not v <= ROUND_OFF}
    assert not beyond, f"{what}: arrays beyond {ROUND_OFF / EPS32:.0f} eps of their largest entry: {beyond}"


@pytest.mark.full  # six JAX processes at once: ~25 CPU-s, 25-30 s on 2 busy cores
def test_two_processes_equal_one_process_of_eight_devices(tmp_path):
    """On each process: bitwise the one-process run with the same collectives (gloo), and the plain one-process run
    but for the summation order of the all-reduces (module docstring). A host with other data fails both.

    One test, not three: under `pytest -n auto` a module fixture shared by several tests would run these six JAX
    processes again on every worker that takes one of them."""
    results = run_step(tmp_path)
    for i in range(2):
        assert_bitwise_equal(results[f"two/{i}"], results["one_gloo"], f"process {i} of 2 vs one process (gloo)")
        assert_round_off_close(results[f"two/{i}"], results["one"], f"process {i} of 2 vs one plain process")
    losses = results["one"]["losses"]
    assert losses.shape == (3,) and np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses  # it trains

    other = results["other/0"]
    assert_bitwise_equal(results["other/1"], other, "changed token: process 1 vs process 0")  # still one program
    with pytest.raises(AssertionError, match="arrays differ"):
        assert_bitwise_equal(other, results["one_gloo"], "changed token")
    with pytest.raises(AssertionError, match="beyond 16 eps"):
        assert_round_off_close(other, results["one"], "changed token")


def test_the_docs_program_runs_on_two_processes(tmp_path):
    """The program of the docs' "Several hosts" section (`# several_hosts.py`), run as its two processes: both print
    the same loss and the global gradient's shape. In the fast tier (~5 CPU-s): attnlib's gradients over two
    processes, one small program."""
    blocks = [b for page in sorted((ROOT / "docs").glob("*.md"))
              for b in re.findall(r"```python\n(# several_hosts\.py.*?)```", page.read_text(), re.S)]  # fmt: skip
    assert len(blocks) == 1, f"want one `# several_hosts.py` block under docs/, found {len(blocks)}"
    program = tmp_path / "several_hosts.py"
    program.write_text(blocks[0])
    (port,) = _free_ports(1)
    call = "import runpy, sys; runpy.run_path(sys.argv[1])['main'](int(sys.argv[2]), coordinator=sys.argv[3])"
    logs = run_together(tmp_path, {f"docs/{i}": (4, [sys.executable, "-c", call, str(program), str(i),
                                                    f"127.0.0.1:{port}"]) for i in range(2)})  # fmt: skip
    lines = [re.search(r"^process (\d) of 2: loss (\S+), dq \(4, 16, 8, 32\)$", log, re.M) for log in logs.values()]
    assert all(lines) and [m[1] for m in lines] == ["0", "1"] and lines[0][2] == lines[1][2], logs
