"""`attnlib.PallasTpu`: fused attention on TPU through JAX's bundled Pallas TPU kernels (splash attention)."""
