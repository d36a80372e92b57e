"""The layouts that dispatch hands to combine (and to the gradients).

Both backends produce the same handle, so combine, the cached dispatch of
combine's backward, and the custom_vjp rules are shared. All fields are device
arrays (the low-latency handle also keeps its dispatch's T and K, static);
shapes are static (T tokens, R ranks, N = num_worst_tokens rows,
E experts, K top-k, M = num_max_dispatch_tokens_per_rank).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deep_ep_jax.config import is_int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchHandle:
    """Normal-mode layout, as seen by one rank."""

    is_token_in_rank: jax.Array  # bool [T, R]: token t is sent to rank r
    num_tokens_per_rank: jax.Array  # int32 [R]: tokens this rank sends to each rank
    rank_prefix_matrix: jax.Array  # int32 [R, R]: [s, r] = rows rank r receives from ranks <= s (inclusive, as DeepEP)
    send_pos: jax.Array  # int32 [T, R]: row of token t in rank r's output; -1 if not sent/dropped
    recv_src_idx: jax.Array  # int32 [N]: source token of each received row; -1 for padding
    recv_src_rank: jax.Array  # int32 [N]: source rank of each received row; -1 for padding
    num_recv_tokens: jax.Array  # int32 []: valid rows, [0, num_recv_tokens)
    num_recv_tokens_per_expert: jax.Array  # int32 [E/R]: (row, k) entries of valid rows naming each local expert
    num_dropped_tokens: jax.Array  # int32 []: rows beyond num_worst_tokens, dropped (0 unless overflow)
    # The reference backend's exchange blocks: rows per (source, destination), T unless its dispatch was
    # given rows_per_pair (rows past it dropped and counted as well).
    rows_per_pair: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def num_worst_tokens(self) -> int:
        return self.recv_src_idx.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowLatencyHandle:
    """Low-latency layout of one rank's received rows, [E/R, R*M] per field."""

    recv_count: jax.Array  # int32 [E/R]: valid rows of each local expert
    recv_src_rank: jax.Array  # int32 [E/R, R*M]: source rank of each row, -1 for padding
    recv_src_token: jax.Array  # int32 [E/R, R*M]: source token index, -1 for padding
    recv_src_topk: jax.Array  # int32 [E/R, R*M]: which top-k slot of the source token, -1 for padding
    # The dispatch's topk_idx was [num_tokens, num_topk] on every rank: its combine's must be too (rows
    # come back to (token, k) slots by these shapes, so another shape would read slots nothing wrote).
    num_tokens: int = dataclasses.field(metadata=dict(static=True))
    num_topk: int = dataclasses.field(metadata=dict(static=True))
    # The dispatch's topk_idx (ids outside [-1, E) as -1), which the combine's must equal: the
    # low_latency_dispatch functions set it; `Config(checks=True)` compares them at run time.
    topk_idx: jax.Array | None = None
    # The Buffer that dispatched (Buffer.key): a combine on another Buffer is refused at trace time.
    buffer_key: int | None = dataclasses.field(default=None, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where `expand` put each (row, k) pair of a rank's received rows: N rows,
    K top-k, L local experts, num_rows expert-major rows (docs/design.md,
    "Expert-major rows")."""

    group_sizes: jax.Array  # int32 [L]: rows of local expert e that hold a pair (drops excluded)
    group_offsets: jax.Array  # int32 [L]: first row of expert e's group, a multiple of the alignment (<= num_rows)
    pair_row: jax.Array  # int32 [N, K]: expert-major row of pair (n, k); -1 for no expert or dropped
    row_pair: jax.Array  # int32 [num_rows]: the pair n * K + k each row holds; -1 for unused rows
    num_dropped: jax.Array  # int32 []: pairs that did not fit in num_rows
    alignment: int = dataclasses.field(metadata=dict(static=True))  # each group starts at a multiple of it

    @property
    def num_rows(self) -> int:
        return self.row_pair.shape[0]

    def padded_group_sizes(self, alignment: int | None = None) -> jax.Array:
        """int32 [L]: each group's rows up to the next group's start, the last
        one rounded up to a multiple of the layout's alignment: group sizes
        for `grouped_matmul`, which takes groups back to back, all multiples of
        the alignment. Pass `valid_sizes=self.group_sizes` with them, so that
        the padding rows are left out. With alignment 1, the pairs per expert.
        `alignment`, if given, must be the layout's (a check on the caller's
        assumption: other sizes would not match the groups' starts)."""
        fn = "ExpertLayout.padded_group_sizes"
        if alignment is not None:
            if not is_int(alignment) or alignment < 1:
                raise ValueError(f"{fn}: alignment must be an int >= 1 (the layout's), got {alignment!r}")
            if alignment != self.alignment:
                raise ValueError(
                    f"{fn}: alignment {alignment} is not the layout's ({self.alignment}): its groups "
                    f"start at multiples of {self.alignment}"
                )
        last = -(-self.group_sizes[-1:] // self.alignment) * self.alignment
        return jnp.concatenate([jnp.diff(self.group_offsets), last])
