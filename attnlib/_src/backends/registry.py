"""The implementations by name: what `implementation="cudnn"`, `"pallas_tpu"`, `"xla_chunked"` and `"xla"` stand for."""

from collections.abc import Callable, Sequence
from typing import Any

from .base import Implementation
from .cudnn.implementation import Cudnn
from .pallas_tpu.implementation import PallasTpu
from .xla import Xla
from .xla_chunked import XlaChunked


DEFAULTS: dict[str, Callable[[], Implementation]] = {
    "cudnn": Cudnn,
    "pallas_tpu": PallasTpu,
    "xla_chunked": XlaChunked,
    "xla": Xla,
}
"""Each name's default instance, made when a call is traced (`Cudnn()` reads the environment then)."""

Request = str | Cudnn | PallasTpu | XlaChunked | Xla | Sequence[Any] | None
"""What `implementation=` takes: None (automatic), a name, an implementation object, or a sequence of those (its
items are checked by `dispatch.requested_implementations`, with one message for every kind of mistake)."""

CLASSES: tuple[type[Implementation], ...] = (Cudnn, PallasTpu, XlaChunked, Xla)
"""The implementation classes a caller may configure and pass as `implementation`."""
