"""GPU probe behind docs/score_mod_cudnn.md: the graphs that `score_mod_lowering` emits, built with the cuDNN frontend
 on an H200 and compared with a float32 reference (JAX on the CPU), forward and backward. Run on the GPU machine from
 the project root with the frontend wheel on PYTHONPATH: `python benchmarks/probe_score_mod_lowering.py`."""
import importlib.util
import json
import math
import os
import sys
import time
import traceback


os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The original probe's order: torch before the cuDNN frontend.
# isort: off
import numpy as np
import torch
import cudnn
import jax
import jax.numpy as jnp
# isort: on


_SML = "attnlib/_src/backends/cudnn/score_mod_lowering"
spec = importlib.util.spec_from_file_location("sml", f"{_SML}/__init__.py", submodule_search_locations=[_SML])
L = importlib.util.module_from_spec(spec)
sys.modules["sml"] = L
spec.loader.exec_module(L)

OUT = os.environ.get("OUT", ".")
F32, I32, BF = cudnn.data_type.FLOAT, cudnn.data_type.INT32, cudnn.data_type.BFLOAT16
HANDLE = cudnn.create_handle()
T_ = lambda x: x.permute(0, 2, 1, 3)
F, I = jnp.float32, jnp.int32
f = lambda x: x.astype(F)
NEG = -jnp.inf


def build(g):
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()


class LazyIndices:
    """[batch, head, q, kv] gen_index tensors created on first access (no dangling axes)."""
    def __init__(self, g, like):
        self.g, self.like, self.made = g, like, {}
    def __getitem__(self, i):
        if i not in self.made:
            t = self.g.gen_index(input=self.like, axis=i)
            t.set_data_type(I32)
            self.made[i] = t
        return self.made[i]


def indices(g, like, mode):
    if mode == "lazy":
        return lambda: LazyIndices(g, like)
    def all4():
        out = []
        for a in range(4):
            t = g.gen_index(input=like, axis=a)
            t.set_data_type(I32)
            out.append(t)
        return out
    return all4


def run(name, fn, n_args=0, fwd_only=False, idx="lazy", b=2, hq=4, hkv=2, t=128, s=192, d=64, arg_mode="tensor"):
    res = {}
    torch.manual_seed(0)
    scale = 1 / math.sqrt(d)
    q = torch.randn(b, t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(b, t, hq, d, device="cuda", dtype=torch.bfloat16)
    arg_vals = [(0.25 * (1 + torch.arange(hq, dtype=torch.float32))).reshape(1, hq, 1, 1).cuda() for _ in range(n_args)]
    jaxpr = jax.make_jaxpr(fn)(*([jnp.zeros((), F)] + [jnp.zeros((), I)] * 4 + [jnp.zeros((), F)] * n_args))
    res["fwd_reason"], res["bwd_reason"] = L.forward_reason(jaxpr), L.backward_reason(jaxpr)
    O = torch.empty_like(q)
    ST = torch.empty(b, hq, t, 1, device="cuda", dtype=torch.float32)
    g = cudnn.pygraph(io_data_type=BF, intermediate_data_type=F32, compute_data_type=F32, handle=HANDLE)
    tq, tk, tv = g.tensor_like(T_(q)), g.tensor_like(T_(k)), g.tensor_like(T_(v))
    if arg_mode == "tensor":
        targs = [g.tensor_like(a) for a in arg_vals]
    else:
        targs = [float(a.flatten()[0]) for a in arg_vals]
    store = {}
    def fwd_cb(gg, sc):
        ops = L.CudnnOps(gg)
        return L.emit_forward(ops, jaxpr, sc, indices(gg, sc, idx), targs, store)
    o_t, st_t = g.sdpa(name="a", q=tq, k=tk, v=tv, generate_stats=True, attn_scale=scale, score_mod=fwd_cb)
    o_t.set_output(True).set_dim(list(T_(O).size())).set_stride(list(T_(O).stride()))
    st_t.set_output(True).set_data_type(F32)
    t0 = time.perf_counter()
    try:
        build(g)
    except Exception as e:
        res["fwd_build"] = str(e)[:600]
        return res
    res["fwd_build_s"] = round(time.perf_counter() - t0, 2)
    pack = {tq: T_(q), tk: T_(k), tv: T_(v), o_t: T_(O), st_t: ST}
    if arg_mode == "tensor":
        pack.update(dict(zip(targs, arg_vals)))
    ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
    g.execute(pack, ws, handle=HANDLE)
    torch.cuda.synchronize()
    # reference: scores in torch f32, the modifier and its derivative in JAX (CPU)
    rep = hq // hkv
    qr, kr, vr = (T_(x).float().detach().requires_grad_(True) for x in (q, k, v))
    grids = [np.broadcast_to(np.arange(n, dtype=np.int32).reshape([n if i == j else 1 for j in range(4)]),
                             (b, hq, t, s))
             for i, n in enumerate((b, hq, t, s))]
    argnp = [a.cpu().numpy() for a in arg_vals] if arg_mode == "tensor" else [np.float32(x) for x in targs]
    mod = jnp.vectorize(fn)
    dmod = jnp.vectorize(jax.grad(fn))

    class Mod(torch.autograd.Function):
        @staticmethod
        def forward(ctx, sc):
            x = sc.detach().cpu().numpy()
            m = np.asarray(mod(x, *grids, *argnp))
            ctx.dm = None if fwd_only or res["bwd_reason"] else np.asarray(dmod(x, *grids, *argnp))
            return torch.from_numpy(m.copy()).cuda()
        @staticmethod
        def backward(ctx, gr):
            return gr * torch.from_numpy(ctx.dm.copy()).cuda()

    sc = qr @ kr.repeat_interleave(rep, 1).transpose(-1, -2) * scale
    m = Mod.apply(sc)
    p = torch.softmax(m, -1)
    orf = p @ vr.repeat_interleave(rep, 1)
    res["err_o"] = float((T_(O).float() - orf).abs().max())
    res["ref_o_absmax"] = float(orf.abs().max())
    lse = torch.logsumexp(m, -1, keepdim=True)
    res["err_stats"] = float((ST - lse).abs().max())
    if fwd_only or res["bwd_reason"]:
        return res
    orf.backward(T_(do).float())
    gb = cudnn.pygraph(io_data_type=BF, intermediate_data_type=F32, compute_data_type=F32, handle=HANDLE)
    bq, bk, bv, bo, bdo, bst = (gb.tensor_like(x) for x in (T_(q), T_(k), T_(v), T_(O), T_(do), ST))
    btargs = [gb.tensor_like(a) for a in arg_vals] if arg_mode == "tensor" else targs
    bstore = {}
    def fcb(gg, sc):
        return L.emit_forward(L.CudnnOps(gg), jaxpr, sc, indices(gg, sc, idx), btargs, bstore)
    def bcb(gg, ds):
        return L.emit_backward(L.CudnnOps(gg), jaxpr, ds, indices(gg, ds, idx), btargs, bstore)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    t0 = time.perf_counter()
    try:
        rq, rk, rv = gb.sdpa_backward(name="b", q=bq, k=bk, v=bv, o=bo, dO=bdo, stats=bst, attn_scale=scale,
                                      score_mod=fcb, score_mod_bprop=bcb)
        for tt, x in ((rq, dq), (rk, dk), (rv, dv)):
            tt.set_output(True).set_dim(list(T_(x).size())).set_stride(list(T_(x).stride()))
        build(gb)
    except Exception as e:
        res["bwd_build"] = str(e)[:600]
        return res
    res["bwd_build_s"] = round(time.perf_counter() - t0, 2)
    bpack = {bq: T_(q), bk: T_(k), bv: T_(v), bo: T_(O), bdo: T_(do), bst: ST, rq: T_(dq), rk: T_(dk), rv: T_(dv)}
    if arg_mode == "tensor":
        bpack.update(dict(zip(btargs, arg_vals)))
    wsb = torch.empty(gb.get_workspace_size(), device="cuda", dtype=torch.uint8)
    gb.execute(bpack, wsb, handle=HANDLE)
    torch.cuda.synchronize()
    for nm, got, want in (("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        res["err_" + nm] = float((T_(got).float() - want).abs().max())
        res["ref_" + nm + "_absmax"] = float(want.abs().max())
    return res


CASES = {
    "softcap_causal": dict(fn=lambda s, b, h, q, k: jnp.where(q >= k, 5.0 * jnp.tanh(s / 5.0), NEG)),
    "softcap_causal_all4_indices": dict(fn=lambda s, b, h, q, k: jnp.where(q >= k, 5.0 * jnp.tanh(s / 5.0), NEG),
                                        idx="all4"),
    "causal_then_softcap": dict(fn=lambda s, b, h, q, k: 5.0 * jnp.tanh(jnp.where(q >= k, s, NEG) / 5.0)),
    "tanh_of_score": dict(fn=lambda s, b, h, q, k: 3.0 * jnp.tanh(s)),
    "sigmoid": dict(fn=lambda s, b, h, q, k: 4.0 * jax.nn.sigmoid(s)),
    "document": dict(fn=lambda s, b, h, q, k: jnp.where(q // 16 == k // 16, s, NEG)),
    "document_remainder": dict(fn=lambda s, b, h, q, k: jnp.where((q - k) % 3 != 1, s, NEG)),
    "window_alibi_tensor": dict(fn=lambda s, b, h, q, k, sl: jnp.where((q >= k) & (k > q - 40), s - sl * f(q - k), NEG),
                                n_args=1),
    "window_alibi_baked": dict(fn=lambda s, b, h, q, k, sl: jnp.where((q >= k) & (k > q - 40), s - sl * f(q - k), NEG),
                               n_args=1, arg_mode="const"),
    "prefix_lm": dict(fn=lambda s, b, h, q, k: jnp.where((k <= q) | (k < 20), s, NEG)),
    "xor_mask": dict(fn=lambda s, b, h, q, k: jnp.where((q >= k) ^ (k == 5), s, NEG)),
    "document_all4_indices": dict(fn=lambda s, b, h, q, k: jnp.where(q // 16 == k // 16, s, NEG), idx="all4"),
    "additive_mask": dict(fn=lambda s, b, h, q, k: s + jnp.where(q >= k, 0.0, NEG)),
    "multiplicative_mask": dict(fn=lambda s, b, h, q, k: s * f(q >= k) + 0.5 * f(k > 100)),
    "sum_masked": dict(fn=lambda s, b, h, q, k: jnp.where(q >= k, s, 0.0) + jnp.where(k > 50, 2.0 * s, 0.0)),
    "head_batch_terms": dict(fn=lambda s, b, h, q, k: s * (1.0 + 0.25 * f(h)) + jnp.sin(f(q) * 0.1) - 0.5 * f(b)),
    "integer_terms": dict(fn=lambda s, b, h, q, k: s + 0.1 * f((q - k) // 7) + 0.1 * f((q - k) % 5)
                          + 0.1 * f(jax.lax.div(q - k, 3)) + 0.1 * f(jax.lax.rem(q - k, 3))),
    "A_final_select_const_m5": dict(fn=lambda s, b, h, q, k: jnp.where(q >= k, 5.0 * jnp.tanh(s / 5.0), -5.0)),
    "B_final_select_const_0": dict(fn=lambda s, b, h, q, k: jnp.where(q >= k, s, 0.0)),
    "C_select_tensor_branches": dict(fn=lambda s, b, h, q, k: jnp.where(q >= k, s, 0.5 * s)),
    "D_mult_mask_only": dict(fn=lambda s, b, h, q, k: s * f(q >= k)),
    "E_not_mask_const_first": dict(fn=lambda s, b, h, q, k: jnp.where(~(q < k), s, NEG)),
    "G_select_then_scale_masked": dict(fn=lambda s, b, h, q, k: jnp.where(q >= k, s, NEG) * 2.0),
    "I_select_then_add_index": dict(fn=lambda s, b, h, q, k: jnp.where(q >= k, s, NEG) + 0.01 * f(k)),
    "J_final_select_const_m5_no_tanh": dict(fn=lambda s, b, h, q, k: jnp.where(q >= k, s, -5.0)),
    "K_inner_zero_select_then_mask": dict(fn=lambda s, b, h, q, k: jnp.where(k < 150, jnp.where(q >= k, s, 0.0), NEG)),
    "output_is_score": dict(fn=lambda s, b, h, q, k: s),
    "fwd_fmod_negative": dict(fn=lambda s, b, h, q, k: s + jnp.fmod(f(q - k), 7.0) * 0.1, fwd_only=True),
    "fwd_zoo": dict(fn=lambda s, b, h, q, k: jnp.round(s * 2.0) * 0.1 + jnp.sign(s) * 0.1 + jax.lax.erf(s)
                    + jnp.log1p(jnp.abs(s)) + jnp.exp2(s * 0.1) + f((s * 3.0).astype(I)) * 0.05, fwd_only=True),
    "fwd_score_condition": dict(fn=lambda s, b, h, q, k: jnp.where(s > 0.0, s, 0.1 * s), fwd_only=True),
    "fwd_relu_gelu": dict(fn=lambda s, b, h, q, k: jax.nn.relu(s) + jax.nn.gelu(s) * 0.5, fwd_only=True),
}


def main():
    results = {"cudnn": cudnn.backend_version(), "fe": cudnn.__version__, "jax": jax.__version__}
    print(results, flush=True)
    names = sys.argv[1:] or list(CASES)
    for name in names:
        try:
            results[name] = run(name, **CASES[name])
        except Exception:
            results[name] = {"error": traceback.format_exc()[-1500:]}
        print(name, json.dumps(results[name]), flush=True)
    with open(os.path.join(OUT, "probe.json"), "w") as fh:
        json.dump(results, fh, indent=1)


main()
