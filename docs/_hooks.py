"""MkDocs hooks for the attnlib docs (`hooks:` in mkdocs.yml).

`strict: true` turns every warning into a failure. One known docstring pattern is exempted, by exact text:
the layers' `DotProductAttention.__call__` documents its pass-through options of `attnlib.attention` as one
grouped `Args:` entry ("query_seq_lengths, key_value_seq_lengths, ...: as `attnlib.attention`"), which griffe's
Google parser cannot split into name/description pairs. The API pages restate that group in prose. Every other
docstring warning still fails the build.
"""

import logging


_KNOWN = "Failed to get 'name: description' pair from 'query_seq_lengths, key_value_seq_lengths, q_segment_ids,"
_FILES = ("attnlib/_src/layers/equinox/dot_product.py", "attnlib/_src/layers/haiku/dot_product.py")


class _KnownGroupedArgs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (_KNOWN in message and any(f in message for f in _FILES))


def on_startup(command, dirty) -> None:
    for name in ("mkdocs.plugins.griffe", "griffe", "mkdocs.plugins.mkdocstrings"):
        logging.getLogger(name).addFilter(_KnownGroupedArgs())
