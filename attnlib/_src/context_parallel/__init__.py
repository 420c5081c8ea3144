"""Context parallelism: attention over a sequence sharded across a mesh axis (`attnlib.context_parallel`).

Called inside `shard_map`, each device holds `T / D` query tokens and `S / D` key/value tokens of every sequence
(`D` = size of the mesh axis). Two strategies:

- `"all_gather"`: keys/values (and key segment ids) are all-gathered once; each device attends its own queries.
  Plain autodiff: the transpose of `all_gather` reduce-scatters dK/dV back to their owners.
- `"ring"`: key/value blocks travel around the ring with `ppermute` (the next transfer is issued before the current
  step's compute); a `custom_vjp` backward rings again, dK/dV accumulators travelling with their block and going
  home at the end. The forward saves only local arrays, so memory per device is O(S / D).

How masks become per-step work (the *plan*). Every local token has a global position fixed by the layout
(contiguous shards, or the load-balanced "dual chunk" order of `reorder`). The causal / window rule is a band on
`key_position - query_position`; since every layout is made of contiguous *chunks* of global positions, the plan
uses interval arithmetic on chunks, at trace time, to turn every (step, device) into a few `attnlib.attention`
calls on sub-blocks, each

- fully visible: no mask;
- a band that `attnlib.attention` expresses natively on the sub-block (`is_causal`, `local_window_size`,
  `diagonal_alignment`; padding lengths become local prefix lengths): those flags;
- anything else: a small boolean `mask` `[T_sub, S_sub]` built from global positions.

Empty chunk pairs are skipped, key columns no query sees are trimmed, and a ring step that no device needs is
dropped, transfers included (windows cost only the steps they reach). Chunks are combined into one call when that
computes no more score entries than separate calls. Packed rows (segment ids) always use the boolean-mask form,
built from global segment ids and global positions (within one contiguous segment, differences of in-segment
positions are differences of global positions). Partial results `(out_i, lse_i)` merge exactly through `lse`;
sinks enter once, in the final merge. Devices whose plans differ (the causal diagonal, load-balanced halves) pick
their branch with `lax.switch` on `axis_index`.
"""

from .api import attention as attention
from .layout import reorder as reorder, restore as restore
