"""attnlib's own Pallas TPU attention kernel ("flex"): what `pallas_tpu` runs where splash declines.

`support.py` (what it serves), `plan.py` (the static plan), `operands.py` (layout and BlockSpecs), `block_map.py`
(block sparsity), `elementwise.py` (score_mod / mask_mod over blocks), `body.py` (one tile's scores),
`forward.py` / `backward.py` (the kernels), `attention.py` (the custom_vjp).
"""
