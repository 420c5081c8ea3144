"""H200 benchmark: the cost of `return_max_logit=True` on cuDNN (target: <= 3 % forward overhead), one process.

Usage: python benchmarks/bench_max_logit.py [--json out.json]

Per shape, under `jax.jit`: attnlib cudnn forward without and with `return_max_logit` (the graph then writes
`score_max` + `score_sum_exp` instead of Stats), the same with sinks (the statistic then takes `max_logit.py`'s
separate pass, for comparison) and jax.nn's cuDNN forward; forward + backward without and with. Timing as
`bench_cudnn.py` (`harness.best_per_call`).
"""

import json

import harness  # run as a script: benchmarks/ is on sys.path
import jax
import jax.numpy as jnp

import attnlib


SHAPES = {  # name: (b, s, n, k, d, causal)
    "b4_s4096_32_8_d128_causal": (4, 4096, 32, 8, 128, True),
    "b1_s8192_64_8_d128_causal": (1, 8192, 64, 8, 128, True),
    "b4_s4096_32_32_d128_full": (4, 4096, 32, 32, 128, False),
    "b2_s1024_16_16_d64_causal": (2, 1024, 16, 16, 64, True),
}


def main():
    parser = harness.parser(__doc__, only="shape names", rounds=3)
    args = parser.parse_args()
    results = {**harness.device_and_jax(), "shapes": {}}
    for name, (b, s, n, kh, d, causal) in SHAPES.items():
        if args.only is not None and name not in args.only:
            continue
        q, k, v, do = harness.normal((b, s, n, d), (b, s, kh, d), (b, s, kh, d), (b, s, n, d))
        sinks = jnp.zeros((n,), jnp.float32)

        def attend(q, k, v, max_logit=False, sink=False):
            return attnlib.attention(q, k, v, is_causal=causal, implementation="cudnn", return_max_logit=max_logit,
                                     sinks=sinks if sink else None)

        def grads(max_logit):
            def loss(q, k, v):
                res = attend(q, k, v, max_logit)
                out = res[0] if max_logit else res
                return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), res

            return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))

        variants = {
            "fwd": jax.jit(lambda q, k, v: attend(q, k, v)),
            "fwd_max_logit": jax.jit(lambda q, k, v: attend(q, k, v, True)),
            "fwd_sinks": jax.jit(lambda q, k, v: attend(q, k, v, False, True)),
            "fwd_sinks_max_logit_separate_pass": jax.jit(lambda q, k, v: attend(q, k, v, True, True)),
            "jax_nn_cudnn_fwd": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="cudnn")),
            "fwd_bwd": grads(False),
            "fwd_bwd_max_logit": grads(True),
        }  # fmt: skip
        row = {}
        for _ in range(args.rounds):  # round-robin, best of the rounds
            for label, f in variants.items():
                ms = harness.best_per_call(f, (q, k, v), loop=20, reps=5) * 1e3
                row[label] = min(row.get(label, float("inf")), ms)
        row["fwd_overhead"] = row["fwd_max_logit"] / row["fwd"] - 1
        row["fwd_bwd_overhead"] = row["fwd_bwd_max_logit"] / row["fwd_bwd"] - 1
        row["separate_pass_overhead"] = row["fwd_sinks_max_logit_separate_pass"] / row["fwd_sinks"] - 1
        results["shapes"][name] = row
        print(name, json.dumps({key: round(val, 4) for key, val in row.items()}), flush=True)
        harness.write_json(args.json, results)
    harness.write_json(args.json, results)


if __name__ == "__main__":
    main()
