"""Guarded access to attnlib's native extension (`attnlib._attnlib_ffi`).

Placeholder until the native extension lands: reports it missing.
"""


def unavailable_reason() -> str | None:
    """None when the native cuDNN extension is importable and registered, else why not."""
    return "attnlib was built without its native extension"
