"""`implementation="cudnn"`: cuDNN fused attention graphs run by attnlib's native XLA FFI extension.

The import is cheap and safe everywhere: nothing here imports the cuDNN frontend or touches a GPU until a call is
traced on a machine that has one. The implementation object is `implementation.Cudnn`.
"""
