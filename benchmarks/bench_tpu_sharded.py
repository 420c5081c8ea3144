"""attnlib on a TPU under a one-device mesh with explicit axes against the same call with no mesh: equal outputs,
and the time each takes (forward, forward + backward), measured round-robin in one process.

A program written for a slice (`jax.set_mesh` of a mesh with explicit axes, operands placed `P("data", None,
"model")`) runs on one chip too: there attnlib's layout work runs under `jax.sharding.auto_axes` and each kernel call
sees the whole batch and heads (docs/sharding.md). This measures what that costs on one chip (nothing is expected).

    python benchmarks/bench_tpu_sharded.py --json out.json [--only NAME ...] [--rounds N]
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import attnlib
import harness


def _alibi(score, batch, head, q_idx, kv_idx):
    return score - 0.01 * ((head + 1) * jnp.abs(q_idx - kv_idx)).astype(score.dtype)


CASES = {
    # name: (B, T, N, K, H, keyword arguments)
    "splash_gqa_causal_b4_s4096": (4, 4096, 32, 8, 128, dict(is_causal=True)),
    "flex_alibi_causal_b2_s4096": (2, 4096, 16, 4, 128, dict(is_causal=True, score_mod=_alibi)),
}


def _programs(kw):
    attend = lambda q, k, v: attnlib.attention(q, k, v, **kw)  # noqa: E731
    return jax.jit(attend), jax.jit(harness.grad_fn(attend))


def main() -> None:
    parser = harness.parser(__doc__, only="cases to run", rounds=3)
    args = parser.parse_args()
    names = args.only or list(CASES)
    harness.check_names(parser, names, CASES)
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    results = {"meta": harness.device_and_jax(), "cases": {}}
    for name in names:
        B, T, N, K, H, kw = CASES[name]
        q, k, v = harness.normal((B, T, N, H), (B, T, K, H), (B, T, K, H))
        forward, gradient = _programs(kw)
        plain_out = np.asarray(forward(q, k, v).astype(jnp.float32))
        with jax.set_mesh(mesh):
            placed = [jax.device_put(x, NamedSharding(mesh, P("data", None, "model", None))) for x in (q, k, v)]
            sharded_forward, sharded_gradient = _programs(kw)
            mesh_out = np.asarray(sharded_forward(*placed).astype(jnp.float32))
            equal = bool(np.array_equal(plain_out, mesh_out))
            grads_equal = all(
                bool(np.array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))))
                for a, b in zip(gradient(q, k, v), sharded_gradient(*placed))
            )
            timed = {
                ("no mesh", "forward_ms"): (forward, (q, k, v), 10),
                ("no mesh", "forward_backward_ms"): (gradient, (q, k, v), 5),
                ("one-device explicit mesh", "forward_ms"): (sharded_forward, placed, 10),
                ("one-device explicit mesh", "forward_backward_ms"): (sharded_gradient, placed, 5),
            }
            times = harness.round_robin(timed, args.rounds)
        fields = ("forward_ms", "forward_backward_ms")
        ratio = {f: times["no mesh"][f] / times["one-device explicit mesh"][f] for f in fields}
        results["cases"][name] = {"times": times, "outputs_equal": equal, "gradients_equal": grads_equal,
                                  "speed_ratio_mesh_vs_plain": ratio, "explain": str(attnlib.explain(q, k, v, **kw))}
        print(name, "equal out", equal, "equal grads", grads_equal, {k: dict(v) for k, v in times.items()}, ratio,
              flush=True)
        harness.write_json(args.json, results)


if __name__ == "__main__":
    main()
