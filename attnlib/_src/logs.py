"""The `attnlib` logger, and messages logged once per key (eager loops would otherwise repeat them on every call)."""

import logging
from collections.abc import Hashable


logger = logging.getLogger("attnlib")

_logged: set[Hashable] = set()
_MAX_LOGGED = 4096


def log_once(key: Hashable, level: int, message: str, *args: object) -> None:
    """`logger.log(level, message, *args)` unless a message with this `key` was logged already (keys are forgotten
    after 4096, so memory stays bounded)."""
    if key in _logged:
        return
    if len(_logged) >= _MAX_LOGGED:
        _logged.clear()
    _logged.add(key)
    logger.log(level, message, *args)
