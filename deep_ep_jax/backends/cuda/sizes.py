"""How large a CUDA Buffer's regions are when it is not told.

Policy only: the standard case (hidden 7168, 4096 tokens per rank, top-k 16)
and the larger of bf16 and FP8 rows. Every size comes from the extension's
layout functions, the code the kernels lay memory out with.
"""

from __future__ import annotations

from deep_ep_jax import _native
from deep_ep_jax.config import FP8_BLOCK

DEFAULT_HIDDEN = 7168
DEFAULT_TOKENS = 4096  # per rank
DEFAULT_TOPK = 16


def _row_formats(hidden):
    """(row bytes, scale bytes per row) of bf16 rows and of FP8 ones."""
    return (2 * hidden, 0), (hidden, hidden // FP8_BLOCK * 4)


def _standard(hidden, num_tokens):
    return (DEFAULT_HIDDEN if hidden is None else int(hidden)), (
        DEFAULT_TOKENS if num_tokens is None else int(num_tokens)
    )


def normal_region_bytes(num_ranks, hidden=None, num_tokens=None, num_topk=DEFAULT_TOPK, *, staged) -> int:
    """Normal region per device of an EP group on one host. Rows go straight
    to XLA's buffers, so the control block is enough, unless `staged`: then
    room for num_tokens * num_ranks received rows of `hidden` (None: the
    standard case) and chunk records for any Config.chunk_tokens."""
    if not staged:
        return _native.limits()["control_bytes"]
    hidden, num_tokens = _standard(hidden, num_tokens)
    ext = _native.extension()
    num_rows = num_tokens * int(num_ranks)
    # num_chunks = num_tokens: chunks of one token, the most records any chunk_tokens needs.
    return max(
        ext.staged_region_bytes(num_rows, row, scales, int(num_topk), num_tokens, int(num_ranks))
        for row, scales in _row_formats(hidden)
    )


def internode_region_bytes(num_ranks, num_nodes, hidden=None, num_tokens=None, num_topk=DEFAULT_TOPK) -> int:
    """Normal region per rank of an EP group across `num_nodes` hosts: the
    largest of a bf16 and an FP8 dispatch of num_tokens tokens per rank
    (T * R rows) and their combine."""
    hidden, num_tokens = _standard(hidden, num_tokens)
    ext = _native.extension()
    num_ranks, num_nodes, num_topk = int(num_ranks), int(num_nodes), int(num_topk)
    num_rows = num_tokens * num_ranks
    dispatch = max(
        ext.internode_dispatch_region_bytes(num_tokens, num_rows, num_topk, row, scales, num_ranks, num_nodes)
        for row, scales in _row_formats(hidden)
    )
    return max(
        dispatch, ext.internode_combine_region_bytes(num_tokens, num_rows, num_topk, hidden, num_ranks, num_nodes)
    )


def _low_latency_shapes(fn, hidden, max_tokens, num_topk):
    if hidden is None or max_tokens is None:
        raise ValueError(
            f"{fn}: hidden and num_max_dispatch_tokens_per_rank are required to size the low-latency region; "
            f"create the Buffer with hidden=... (or num_rdma_bytes=...)"
        )
    return int(hidden), int(max_tokens), DEFAULT_TOPK if num_topk is None else int(num_topk)


def low_latency_region_bytes(num_ranks, num_experts, hidden, num_max_dispatch_tokens_per_rank, num_topk=None) -> int:
    """Low-latency region per device: a control block and two halves
    (consecutive operations alternate), each holding a dispatch's rows (bf16
    or FP8, up to M per source rank) or a combine's (M * K). `num_experts`
    None sizes for the kernels' most; `num_topk` None for top-k 16."""
    hidden, max_tokens, num_topk = _low_latency_shapes(
        "low_latency_region_bytes", hidden, num_max_dispatch_tokens_per_rank, num_topk
    )
    num_ranks = int(num_ranks)
    if num_experts is None:
        num_local = _native.limits()["low_latency_max_experts"] // num_ranks + 1
    else:
        num_local = -(-int(num_experts) // num_ranks)
    return _native.extension().low_latency_region_bytes(num_ranks, num_local, hidden, max_tokens, num_topk)


def low_latency_send_bytes(num_ranks, hidden, num_max_dispatch_tokens_per_rank, num_topk=None) -> int:
    """Send area of a Buffer across hosts (after its low-latency region in
    NVSHMEM's symmetric heap), where rows put to other hosts are staged: a
    dispatch's or a combine's of these shapes (`num_topk` None: 16). A
    combine stages one bf16 row per (source rank, token, k), R * M * K * H * 2
    bytes (`_C.low_latency_combine_stage_bytes`), which grows with the group."""
    hidden, max_tokens, num_topk = _low_latency_shapes(
        "low_latency_send_bytes", hidden, num_max_dispatch_tokens_per_rank, num_topk
    )
    return _native.extension().low_latency_send_bytes(int(num_ranks), hidden, max_tokens, num_topk)
