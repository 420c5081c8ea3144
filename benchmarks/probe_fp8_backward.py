"""Probe (H200, torch + cuDNN frontend): can `fp8="current"` use cuDNN's FP8 backward (`sdpa_fp8_backward`)?

On Hopper the FP8 backward writes dQ, dK, dV in E4M3 (16-bit gradients are Blackwell-only in cuDNN 9.19), so their
scales, and the scale of the FP8 `dP` (dS) it quantizes inside, must be chosen before the gradients exist. Current
scaling has no amax history, so this probe compares three choices, each against float64 gradients of attention at the
dequantized inputs (same dO):
- `bound`: scales from bounds that cannot overflow (`|dS| <= 2 max||dO_i|| max||v_j||`, `|dV| <= T amax|dO|`,
  `|dQ| <= scale amax|k| B`, `|dK| <= scale amax|q| T B`);
- `oracle`: scales from the amaxes cuDNN reports after a first run (what perfect delayed scaling would give);
- `bf16`: cuDNN's 16-bit backward at the dequantized inputs (what attnlib runs today).
and times the FP8 backward (oracle scales) against the 16-bit one. Prints JSON lines; writes
OUT/probe_fp8_backward.json.
"""

import json
import math
import os

import cudnn
import torch


OUT = os.environ.get("OUT", ".")
handle = cudnn.create_handle()
E4M3, F32, BF = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT, cudnn.data_type.BFLOAT16
T_ = lambda x: x.permute(0, 2, 1, 3)  # noqa: E731  [B, S, N, H] storage viewed as cuDNN's [B, N, S, H]


def build(g):
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)


def timeit(g, pack, ws, n=10):
    for _ in range(3):
        g.execute(pack, ws, handle=handle)
    torch.cuda.synchronize()
    best = 1e9
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        e0.record()
        for _ in range(n):
            g.execute(pack, ws, handle=handle)
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) / n)
    return best


def scalar(x):
    return torch.as_tensor(x, device="cuda", dtype=torch.float32).reshape(1, 1, 1, 1)


def quantize(x):
    sc = x.abs().max().float() / 448.0
    return (x.float() / sc).clamp(-448, 448).to(torch.float8_e4m3fn), sc.reshape(1, 1, 1, 1)


def one(b, n, kh, s, d, causal, accuracy):
    row = {"shape": f"b{b}_s{s}_h{n}/{kh}_d{d}_{'causal' if causal else 'full'}"}
    scale = 1 / math.sqrt(d)
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for h in (n, kh, kh, n))
    (q8, sq), (k8, sk), (v8, sv), (do8, sdo) = (quantize(x) for x in (q, k, v, do))
    qh, kh_, vh = (x8.float() * sc for x8, sc in ((q8, sq), (k8, sk), (v8, sv)))  # dequantized, float32
    # FP8 forward: O8 and stats
    g = cudnn.pygraph(io_data_type=E4M3, intermediate_data_type=F32, compute_data_type=F32, handle=handle)
    tq, tk, tv = (g.tensor_like(T_(x)) for x in (q8, k8, v8))
    names = ("dq", "dk", "dv", "ds", "ss", "so")
    st = {m: g.tensor(name=m, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=F32) for m in names}
    o, stats, amax_s, amax_o = g.sdpa_fp8(q=tq, k=tk, v=tv, descale_q=st["dq"], descale_k=st["dk"], descale_v=st["dv"],
                                          descale_s=st["ds"], scale_s=st["ss"], scale_o=st["so"], generate_stats=True,
                                          attn_scale=scale, use_causal_mask=causal)
    O8 = torch.empty(b, s, n, d, device="cuda", dtype=torch.float8_e4m3fn)
    ST = torch.empty(b, n, s, 1, device="cuda", dtype=torch.float32)
    o.set_output(True).set_dim(list(T_(O8).size())).set_stride(list(T_(O8).stride())).set_data_type(E4M3)
    stats.set_output(True).set_data_type(F32)
    for a in (amax_s, amax_o):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(F32)
    ws = build(g)
    scale_o = scalar(448.0 / (1.25 * 448.0 * float(sv)))
    pack = {tq: T_(q8), tk: T_(k8), tv: T_(v8), o: T_(O8), stats: ST, amax_s: scalar(0),
            amax_o: scalar(0), st["dq"]: sq, st["dk"]: sk, st["dv"]: sv, st["ds"]: scalar(1 / 448),
            st["ss"]: scalar(448), st["so"]: scale_o}
    g.execute(pack, ws, handle=handle)
    torch.cuda.synchronize()
    out = O8.float() / scale_o.reshape(())

    # FP8 backward graph
    gb = cudnn.pygraph(io_data_type=E4M3, intermediate_data_type=F32, compute_data_type=F32, handle=handle)
    bq, bk, bv, bo, bdo = (gb.tensor_like(T_(x)) for x in (q8, k8, v8, O8, do8))
    bst = gb.tensor_like(ST)
    keys = ("dq", "dk", "dv", "do", "ddo", "ds", "ddp", "ss", "sdq", "sdk", "sdv", "sdp")
    t = {m: gb.tensor(name="x" + m, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=F32) for m in keys}
    outs = gb.sdpa_fp8_backward(q=bq, k=bk, v=bv, o=bo, dO=bdo, stats=bst, descale_q=t["dq"], descale_k=t["dk"],
                                descale_v=t["dv"], descale_o=t["do"], descale_dO=t["ddo"], descale_s=t["ds"],
                                descale_dP=t["ddp"], scale_s=t["ss"], scale_dQ=t["sdq"], scale_dK=t["sdk"],
                                scale_dV=t["sdv"], scale_dP=t["sdp"], attn_scale=scale, use_causal_mask=causal)
    DQ, DK, DV = (torch.empty_like(x) for x in (q8, k8, v8))
    for tt, x in zip(outs[:3], (DQ, DK, DV)):
        tt.set_output(True).set_dim(list(T_(x).size())).set_stride(list(T_(x).stride())).set_data_type(E4M3)
    amaxes = [scalar(0) for _ in outs[3:]]
    for a in outs[3:]:
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(F32)
    wsb = build(gb)

    def run_bwd(s_dq, s_dk, s_dv, s_dp):
        pk = {bq: T_(q8), bk: T_(k8), bv: T_(v8), bo: T_(O8), bdo: T_(do8), bst: ST, outs[0]: T_(DQ),
              outs[1]: T_(DK), outs[2]: T_(DV), t["dq"]: sq, t["dk"]: sk, t["dv"]: sv, t["do"]: 1 / scale_o,
              t["ddo"]: sdo, t["ds"]: scalar(1 / 448), t["ddp"]: 1 / s_dp, t["ss"]: scalar(448), t["sdq"]: s_dq,
              t["sdk"]: s_dk, t["sdv"]: s_dv, t["sdp"]: s_dp}
        pk.update(dict(zip(outs[3:], amaxes)))
        gb.execute(pk, wsb, handle=handle)
        torch.cuda.synchronize()
        grads = [x.float() / sc.reshape(()) for x, sc in ((DQ, s_dq), (DK, s_dk), (DV, s_dv))]
        return grads, [float(a) for a in amaxes], pk

    amax_do = float(do.abs().max())
    row_norm = lambda x: float(x.float().norm(dim=-1).max())  # noqa: E731
    bound_ds = 2 * row_norm(do) * row_norm(vh)
    bounds = (scale * float(kh_.abs().max()) * bound_ds, scale * float(qh.abs().max()) * s * bound_ds, s * amax_do,
              bound_ds)
    bound_scales = [scalar(448.0 / x) for x in bounds]
    grads_bound, amax_seen, _ = run_bwd(*bound_scales)
    oracle_scales = [scalar(448.0 / a) for a in amax_seen]
    grads_oracle, _, pk = run_bwd(*oracle_scales)
    row["amax_dq_dk_dv_dp"] = amax_seen
    row["bounds_dq_dk_dv_dp"] = list(bounds)
    if accuracy:
        # float64 reference gradients at the dequantized inputs with the same dO
        q64, k64, v64 = (x.double().requires_grad_(True) for x in (qh, kh_, vh))
        rep = n // kh
        logits = torch.einsum("bind,bjnd->bnij", q64, k64.repeat_interleave(rep, 2)) * scale
        if causal:
            i = torch.arange(s, device="cuda")
            logits = logits.masked_fill(i[None, :] > i[:, None], float("-inf"))
        ref = torch.einsum("bnij,bjnd->bind", torch.softmax(logits, -1), v64.repeat_interleave(rep, 2))
        ref.backward(do.double())
        refs = (q64.grad, k64.grad, v64.grad)
        rel = lambda a, r: float((a.double() - r).norm() / r.norm())  # noqa: E731
        row["fwd_rel_err"] = rel(out, ref.detach())
        row["rel_err_bound"] = [rel(a, r) for a, r in zip(grads_bound, refs)]
        row["rel_err_oracle"] = [rel(a, r) for a, r in zip(grads_oracle, refs)]
        row["zero_fraction_bound"] = [float((a == 0).double().mean()) for a in grads_bound]
        # 16-bit backward at the dequantized inputs (bf16), as attnlib runs it today
        qb, kb, vb = (x.to(torch.bfloat16).requires_grad_(True) for x in (qh, kh_, vh))
        ob = torch.nn.functional.scaled_dot_product_attention(
            T_(qb), T_(kb.repeat_interleave(rep, 2)), T_(vb.repeat_interleave(rep, 2)), is_causal=causal)
        T_(ob).backward(do)
        row["rel_err_bf16_bwd"] = [rel(x.grad, r) for x, r in zip((qb, kb, vb), refs)]
    row["fp8_bwd_ms_oracle_scales"] = timeit(gb, pk, wsb)
    # 16-bit cuDNN backward of the same shape
    qb, kb, vb, ob, dob = (x.to(torch.bfloat16) for x in (qh, kh_, vh, out, do))
    g2 = cudnn.pygraph(io_data_type=BF, intermediate_data_type=F32, compute_data_type=F32, handle=handle)
    xq, xk, xv, xo, xdo, xst = (g2.tensor_like(x) for x in (T_(qb), T_(kb), T_(vb), T_(ob), T_(dob), ST))
    rq, rk, rv = g2.sdpa_backward(name="b", q=xq, k=xk, v=xv, o=xo, dO=xdo, stats=xst, attn_scale=scale,
                                  use_causal_mask=causal)
    DQb, DKb, DVb = torch.empty_like(qb), torch.empty_like(kb), torch.empty_like(vb)
    for tt, x in ((rq, DQb), (rk, DKb), (rv, DVb)):
        tt.set_output(True).set_dim(list(T_(x).size())).set_stride(list(T_(x).stride()))
    ws2 = build(g2)
    pk2 = {xq: T_(qb), xk: T_(kb), xv: T_(vb), xo: T_(ob), xdo: T_(dob), xst: ST, rq: T_(DQb), rk: T_(DKb),
           rv: T_(DVb)}
    row["bf16_bwd_ms"] = timeit(g2, pk2, ws2)
    row["fp8_over_bf16_bwd_speed"] = row["bf16_bwd_ms"] / row["fp8_bwd_ms_oracle_scales"]
    return row


results = {"cudnn": cudnn.backend_version(), "frontend": cudnn.__version__, "rows": []}
for args in ((2, 8, 8, 1024, 128, False, True), (2, 8, 2, 1024, 128, True, True), (4, 32, 32, 4096, 128, False, False),
             (2, 16, 16, 2048, 128, False, False), (1, 64, 8, 8192, 128, False, False)):
    try:
        r = one(*args)
    except Exception as e:  # noqa: BLE001
        r = {"args": args, "error": f"{type(e).__name__}: {e}"[:600]}
    results["rows"].append(r)
    print(json.dumps(r), flush=True)
with open(os.path.join(OUT, "probe_fp8_backward.json"), "w") as f:
    json.dump(results, f, indent=1)
