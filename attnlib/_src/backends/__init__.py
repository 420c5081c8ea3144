"""The implementations behind `attnlib.attention`: plain JAX (`xla`, `xla_chunked`) and cuDNN (`cudnn/`)."""
