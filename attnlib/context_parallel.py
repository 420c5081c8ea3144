"""Context parallelism: attention over a sequence sharded across a mesh axis (call inside `shard_map`).

See `docs/context_parallel.md`.
"""

from ._src.context_parallel import attention as attention, reorder as reorder, restore as restore
