"""attnlib internals: not public API (the public names are re-exported by `attnlib`, `attnlib.equinox`, `attnlib.haiku`
and `attnlib.context_parallel`)."""
