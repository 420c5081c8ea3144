"""attnlib: fused attention for JAX."""

import importlib.metadata

from . import checkpoint_policies as checkpoint_policies, context_parallel as context_parallel
from ._src.attention import attention as attention, explain as explain
from ._src.backends.cudnn.implementation import Cudnn as Cudnn
from ._src.backends.pallas_tpu.implementation import PallasTpu as PallasTpu
from ._src.backends.xla import Xla as Xla
from ._src.backends.xla_chunked import XlaChunked as XlaChunked
from ._src.dispatch import Explanation as Explanation
from ._src.fp8 import Fp8Scales as Fp8Scales
from ._src.paged import PagedKVCache as PagedKVCache


try:
    __version__ = importlib.metadata.version("attnlib")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
