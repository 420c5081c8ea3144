"""A float64 NumPy reference for a multi-head attention layer (projections + attention core + output projection).

The attention core is `tests/reference.py` (independent of attnlib); the projections are spelled out here in the
`y = x @ w + b` convention (Haiku's; Equinox's `Linear` stores `w` transposed). Gradients of `<d_y, y>` w.r.t. the
parameters follow by the chain rule through `reference_attention_vjp`.
"""

import numpy as np
from reference import reference_attention, reference_attention_vjp


def _f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


def reference_mha(xq, xk, xv, params, *, num_heads, num_kv_heads, mask=None, d_y=None, **attention_kwargs):
    """float64 output `[..., T', D']` of a multi-head attention layer, and with `d_y` the parameter gradients.

    Args:
        xq, xk, xv: `[..., T', Dq]`, `[..., T, Dk]`, `[..., T, Dv]` (the same leading dims).
        params: `{"query"|"key"|"value"|"output": (w [in, out], b [out] or None)}`, plus `"sinks"` `[N]` or absent.
        num_heads, num_kv_heads: `N` and `K`.
        mask: bool, broadcastable to `[..., N, T', T]`.
        d_y: cotangent of the output; when given, also return gradients.
        attention_kwargs: keyword arguments of `reference_attention` (is_causal, local_window_size, ...).

    Returns:
        `y`, or `(y, grads)` with `grads` shaped like `params` (`(dw, db)` per projection, `db` None without bias).
    """
    xq, xk, xv = _f64(xq), _f64(xk), _f64(xv)
    w = {name: (_f64(p[0]), _f64(p[1])) for name, p in params.items() if name != "sinks"}
    sinks = _f64(params.get("sinks"))

    def project(x, name, heads):
        wt, b = w[name]
        y = x @ wt + (0.0 if b is None else b)
        return y.reshape(y.shape[:-1] + (heads, -1))

    qh, kh, vh = project(xq, "query", num_heads), project(xk, "key", num_kv_heads), project(xv, "value", num_kv_heads)
    out, _ = reference_attention(qh, kh, vh, mask=mask, sinks=sinks, **attention_kwargs)
    attn = out.reshape(out.shape[:-2] + (-1,))
    wo, bo = w["output"]
    y = attn @ wo + (0.0 if bo is None else bo)
    if d_y is None:
        return y

    d_y = _f64(d_y)
    d_attn = (d_y @ wo.T).reshape(out.shape)
    g = reference_attention_vjp(qh, kh, vh, mask=mask, sinks=sinks, d_out=d_attn, **attention_kwargs)

    def dparams(x, d_heads, name):
        x2 = x.reshape(-1, x.shape[-1])
        d2 = d_heads.reshape(x2.shape[0], -1)
        return x2.T @ d2, (None if w[name][1] is None else d2.sum(axis=0))

    grads = {
        "query": dparams(xq, g["query"], "query"),
        "key": dparams(xk, g["key"], "key"),
        "value": dparams(xv, g["value"], "value"),
        "output": dparams(attn, d_y, "output"),
    }
    if sinks is not None:
        grads["sinks"] = g["sinks"]
    return y, grads
