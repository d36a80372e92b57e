"""The reference backend: the contract of docs/design.md in pure JAX.

It is the oracle for the CUDA kernels and the XLA baseline in benchmarks, so
it is written the way plain XLA runs fastest: fixed-capacity
`lax.all_to_all` exchanges (one slot per (destination rank, token)) with
gathers on both sides, no scatters of rows, no sorting. Every function runs
per rank inside `shard_map` (see `deep_ep_jax.backends` for the interface).

Summation order is part of the contract, so sums over ranks (combine) and
over top-k slots (low-latency combine) are written as explicit left-to-right
float32 loops starting from 0.0, which the CUDA kernels reproduce bit for bit.
Across hosts (`buffer.rank_hosts`) combine sums each host's ranks first and
rounds the partial to bf16, then sums the partials in host order, as the
internode kernels do (docs/internode.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from deep_ep_jax.comm.handle import DispatchHandle, LowLatencyHandle
from deep_ep_jax.comm.mesh import same_mesh
from deep_ep_jax.comm.varying import varying_like
from deep_ep_jax.config import FP8_BLOCK, MXFP8_BLOCK, TRAFFIC_FIELDS, row_bytes

FP8_MAX = 448.0  # largest finite float8_e4m3fn


# --------------------------------------------------------------------------
# Layout


def get_dispatch_layout(topk_idx, *, num_experts, buffer):
    num_ranks = buffer.num_ranks
    experts_per_rank = num_experts // num_ranks
    valid = topk_idx >= 0
    rank_of = jnp.where(valid, topk_idx // experts_per_rank, -1)
    is_token_in_rank = (rank_of[:, :, None] == jnp.arange(num_ranks, dtype=jnp.int32)).any(axis=1)
    num_tokens_per_rank = is_token_in_rank.sum(axis=0, dtype=jnp.int32)
    expert_or_sink = jnp.where(valid, topk_idx, num_experts).reshape(-1)
    num_tokens_per_expert = jnp.bincount(expert_or_sink, length=num_experts + 1)[:num_experts]
    return num_tokens_per_rank, num_tokens_per_expert.astype(jnp.int32), is_token_in_rank


def _send_order(is_token_in_rank):
    """Position of each token among those sent to a rank, and the inverse:
    order[r, j] = index of the j-th token sent to rank r (0 where unused)."""
    num_tokens, num_ranks = is_token_in_rank.shape
    pos_in_dest = jnp.cumsum(is_token_in_rank, axis=0, dtype=jnp.int32) - 1
    dest = jnp.where(is_token_in_rank, jnp.arange(num_ranks, dtype=jnp.int32)[None, :], num_ranks)
    tokens = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None], dest.shape)
    order = jnp.zeros((num_ranks, num_tokens), jnp.int32).at[dest, pos_in_dest].set(tokens, mode="drop")
    return pos_in_dest, order


def _pair_rows(handle):
    """Rows per (source, destination) block of the exchanges: T, or the dispatch's rows_per_pair."""
    return handle.rows_per_pair or handle.is_token_in_rank.shape[0]


def _recv_slots(rank_prefix_matrix, rank, num_rows, num_tokens):
    """For each output row: its slot in the all_to_all result [R * P] (P =
    num_tokens slots per source; rows from source s are the first counts[s]
    slots of block s), its source rank, and whether it is valid."""
    ends = rank_prefix_matrix[:, rank]  # inclusive prefix over source ranks
    starts = ends - jnp.diff(ends, prepend=0)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    src_rank = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    valid = rows < ends[-1]
    src_rank = jnp.where(valid, src_rank, 0)
    slot = src_rank * num_tokens + rows - starts[src_rank]
    return jnp.where(valid, slot, 0), jnp.where(valid, src_rank, -1), valid


def _exchange(tree, buffer):
    """all_to_all of [R, ...] blocks: block r goes to rank r (of the Buffer's
    mesh, which the program's must order alike, as on the CUDA backend)."""
    exchange = lambda a: lax.all_to_all(a, buffer.axis_name, 0, 0)
    return jax.tree.map(lambda a: same_mesh(exchange(a), buffer, "deep_ep_jax (xla backend)"), tree)


def _as_bits(a):
    # float8 all_to_all is not supported on every platform; move the bytes.
    return lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 and a.dtype != jnp.uint8 else a


def _from_bits(a, dtype):
    return lax.bitcast_convert_type(a, dtype) if a.dtype != dtype else a


def _move_rows(xs, topk_idx, topk_weights, handle, order, buffer):
    """Send rows along a layout: slot [r, j] carries token order[r, j] (j < the pair's rows)."""
    num_ranks = buffer.num_ranks
    num_tokens = _pair_rows(handle)
    order = order[:, :num_tokens]
    num_rows = handle.recv_src_idx.shape[0]
    rank = lax.axis_index(buffer.axis_name)
    payload = {"xs": tuple(_as_bits(x)[order] for x in xs)}
    if topk_idx is not None:
        experts_per_rank = handle.num_recv_tokens_per_expert.shape[0]
        local = topk_idx[None, :, :] - (jnp.arange(num_ranks, dtype=jnp.int32) * experts_per_rank)[:, None, None]
        on_rank = (topk_idx[None] >= 0) & (local >= 0) & (local < experts_per_rank)
        local = jnp.where(on_rank, local, -1)  # [R, T, K]
        payload["idx"] = jnp.take_along_axis(local, order[:, :, None], axis=1)
    if topk_weights is not None:
        payload["w"] = topk_weights[order]
    received = _exchange(payload, buffer)
    slot, _, valid = _recv_slots(handle.rank_prefix_matrix, rank, num_rows, num_tokens)
    flat = lambda a: a.reshape((num_ranks * num_tokens,) + a.shape[2:])[slot]
    recv_xs = tuple(_from_bits(flat(r), x.dtype) for r, x in zip(received["xs"], xs))
    if buffer.config.poison_padding:  # as the kernels may leave them (Config.poison_padding)
        recv_xs = tuple(
            jnp.where(valid.reshape((-1,) + (1,) * (r.ndim - 1)), r, jnp.nan).astype(r.dtype) for r in recv_xs
        )
    recv_idx = recv_w = None
    if topk_idx is not None:
        recv_idx = jnp.where(valid[:, None], flat(received["idx"]), -1)
    if topk_weights is not None:
        recv_w = jnp.where(valid[:, None], flat(received["w"]), 0.0)
        if recv_idx is not None:
            recv_w = jnp.where(recv_idx >= 0, recv_w, 0.0)
    return recv_xs, recv_idx, recv_w


def dispatch(xs, topk_idx, topk_weights, *, num_experts, num_worst_tokens, buffer, rows_per_pair=None):
    axis, num_ranks = buffer.axis_name, buffer.num_ranks
    num_tokens = topk_idx.shape[0]
    pair_rows = min(rows_per_pair or num_tokens, num_tokens)
    rank = lax.axis_index(axis)
    num_tokens_per_rank, _, is_token_in_rank = get_dispatch_layout(topk_idx, num_experts=num_experts, buffer=buffer)

    counts = lax.all_gather(jnp.minimum(num_tokens_per_rank, pair_rows), axis)  # [source, destination]
    rank_prefix_matrix = jnp.cumsum(counts, axis=0, dtype=jnp.int32)
    pos_in_dest, order = _send_order(is_token_in_rank)
    first_row = rank_prefix_matrix[rank] - counts[rank]  # my first row at each destination
    send_pos = first_row[None, :] + pos_in_dest
    send_pos = jnp.where(is_token_in_rank & (pos_in_dest < pair_rows) & (send_pos < num_worst_tokens), send_pos, -1)

    total = rank_prefix_matrix[-1, rank]
    num_recv = jnp.minimum(total, num_worst_tokens)
    if rows_per_pair:  # rows past a pair's cap are dropped as well
        total = lax.psum(num_tokens_per_rank, axis)[rank]
    _, src_rank, valid = _recv_slots(rank_prefix_matrix, rank, num_worst_tokens, pair_rows)
    experts_per_rank = num_experts // num_ranks
    # recv_src_idx and num_recv_tokens_per_expert are filled after the exchange.
    handle = DispatchHandle(
        is_token_in_rank=is_token_in_rank,
        num_tokens_per_rank=num_tokens_per_rank,
        rank_prefix_matrix=rank_prefix_matrix,
        send_pos=send_pos,
        recv_src_idx=jnp.zeros((num_worst_tokens,), jnp.int32),
        recv_src_rank=src_rank,
        num_recv_tokens=num_recv.astype(jnp.int32),
        num_recv_tokens_per_expert=jnp.zeros((experts_per_rank,), jnp.int32),
        num_dropped_tokens=(total - num_recv).astype(jnp.int32),
        rows_per_pair=pair_rows if rows_per_pair else None,
    )
    token_ids = jnp.arange(num_tokens, dtype=jnp.int32)  # travels with the rows
    recv_xs, recv_idx, recv_w = _move_rows(xs + (token_ids,), topk_idx, topk_weights, handle, order, buffer)
    recv_xs, recv_src_idx = recv_xs[:-1], recv_xs[-1]
    sink = jnp.where(recv_idx >= 0, recv_idx, experts_per_rank).reshape(-1)
    per_expert = jnp.bincount(sink, length=experts_per_rank + 1)[:experts_per_rank].astype(jnp.int32)
    handle = dataclasses.replace(
        handle, recv_src_idx=jnp.where(valid, recv_src_idx, -1), num_recv_tokens_per_expert=per_expert
    )
    if _counting(buffer):
        _count_moves(buffer, "dispatch", handle, is_token_in_rank, row_bytes(xs))
    return recv_xs, recv_idx, recv_w, handle


def cached_dispatch(xs, topk_weights, handle, *, buffer):
    _, order = _send_order(handle.is_token_in_rank)
    recv_xs, _, recv_w = _move_rows(xs, None, topk_weights, handle, order, buffer)
    if _counting(buffer):
        _count_moves(buffer, "cached_dispatch", handle, _valid_rows(handle), row_bytes(xs))
    return recv_xs, recv_w


def combine(x, topk_weights, handle, *, buffer):
    axis, num_ranks = buffer.axis_name, buffer.num_ranks
    num_tokens = handle.is_token_in_rank.shape[0]
    num_rows = x.shape[0]
    rank = lax.axis_index(axis)
    # Receiver side: slot [s, j] returns my row for the j-th token of rank s.
    ends = handle.rank_prefix_matrix[:, rank]
    starts = ends - jnp.diff(ends, prepend=0)
    rows = starts[:, None] + jnp.arange(_pair_rows(handle), dtype=jnp.int32)[None, :]
    rows = jnp.clip(rows, 0, num_rows - 1)  # slots past a source's count are never read
    payload = {"x": x[rows]}
    if topk_weights is not None:
        payload["w"] = topk_weights[rows]
    back = _exchange(payload, buffer)  # [r, j]: rank r's row for my j-th token sent to r
    # Sender side: sum the ranks' rows for each token, in rank order.
    pos_in_dest = jnp.cumsum(handle.is_token_in_rank, axis=0, dtype=jnp.int32) - 1
    valid = handle.send_pos >= 0
    gather_pos = jnp.where(valid, pos_in_dest, 0)

    def rank_sum(blocks, ranks):
        acc = jnp.zeros((num_tokens,) + blocks.shape[2:], jnp.float32)
        for r in ranks:
            part = blocks[r][gather_pos[:, r]].astype(jnp.float32)
            mask = valid[:, r].reshape((num_tokens,) + (1,) * (part.ndim - 1))
            acc = acc + jnp.where(mask, part, 0.0)
        return acc

    def reduce(blocks, out_dtype):
        hosts = _host_ranks(buffer)
        if hosts is None:
            return rank_sum(blocks, range(num_ranks)).astype(out_dtype)
        # Per host, then the hosts' partials (in out_dtype: what crosses the network) in host order.
        # reduce_precision, not a convert pair, which XLA may drop (xla_allow_excess_precision).
        finfo = jnp.finfo(out_dtype)
        acc = jnp.zeros((num_tokens,) + blocks.shape[2:], jnp.float32)
        for ranks in hosts:
            partial = lax.reduce_precision(rank_sum(blocks, ranks), exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)
            acc = acc + partial
        return acc.astype(out_dtype)

    out = reduce(back["x"], x.dtype)
    out_w = reduce(back["w"], jnp.float32) if topk_weights is not None else None
    if _counting(buffer):
        _count_combine(buffer, handle, row_bytes((x,)))
    return out, out_w


def _host_ranks(buffer):
    """The ranks of each host in rank order, hosts in order, when combine's
    per-host order differs from the plain rank order (several hosts of
    several ranks); else None."""
    rank_hosts = getattr(buffer, "rank_hosts", None)
    if rank_hosts is None:
        return None
    if len(rank_hosts) != buffer.num_ranks:
        raise ValueError(f"buffer.rank_hosts has {len(rank_hosts)} entries for {buffer.num_ranks} ranks")
    hosts = [[r for r, h in enumerate(rank_hosts) if h == b] for b in range(max(rank_hosts) + 1)]
    # One host: its partial is the sum. One rank per host: a bf16 row's partial is the row.
    if len(hosts) == 1 or max(len(h) for h in hosts) == 1:
        return None
    return hosts


# --------------------------------------------------------------------------
# Traffic counters (Config.count_traffic): what the CUDA kernels would count,
# from the layout (docs/internode.md). Per rank, the rows its kernels move over
# NVLink (into or out of another rank's memory on its host) and the network.


def _counting(buffer):
    config = getattr(buffer, "config", None)
    return config is not None and config.count_traffic


def _valid_rows(handle):
    """[T, R]: the token has a row at the rank (a handle row in [0, N))."""
    num_rows = handle.recv_src_idx.shape[0]
    return (handle.send_pos >= 0) & (handle.send_pos < num_rows)


class _Hosts:
    """Static tables of the buffer's hosts: each rank's host and index on it,
    and for each (source s, destination d) the rank whose kernels move the row
    of s to d in dispatch (s on its own host, else the forwarder: the rank of
    d's host with s's index) and in combine across hosts (the forwarder)."""

    def __init__(self, buffer):
        num_ranks = buffer.num_ranks
        hosts = tuple(getattr(buffer, "rank_hosts", None) or (0,) * num_ranks)
        self.host = np.array(hosts, np.int32)
        self.num_hosts = max(hosts) + 1
        self.local = np.array([hosts[:r].count(hosts[r]) for r in range(num_ranks)], np.int32)
        rank_at = {(h, j): r for r, (h, j) in enumerate(zip(hosts, self.local.tolist()))}
        # Hosts of unequal sizes (possible here, refused by the kernels): no forwarder gives -1.
        self.forwarder = np.array(
            [[rank_at.get((hosts[d], self.local[s]), -1) for d in range(num_ranks)] for s in range(num_ranks)], np.int32
        )  # [s, d]
        same_host = self.host[:, None] == self.host[None, :]
        self.deliverer = np.where(same_host, np.arange(num_ranks, dtype=np.int32)[:, None], self.forwarder)
        self.one_hot = (self.host[:, None] == np.arange(self.num_hosts)[None, :]).astype(np.int32)  # [R, H]


def _received_per_source(handle):
    """[R(source), R(destination)]: rows each source has at each destination
    after num_worst_tokens, from the (global) rank_prefix_matrix."""
    num_rows = handle.recv_src_idx.shape[0]
    kept = jnp.minimum(handle.rank_prefix_matrix, num_rows)
    return kept - jnp.concatenate([jnp.zeros_like(kept[:1]), kept[:-1]], axis=0)


def _remote_hosts(hosts, rank, in_rank):
    """Per token, the hosts other than this rank's holding one of its ranks in in_rank [T, R]; summed."""
    in_host = (in_rank.astype(jnp.int32) @ jnp.asarray(hosts.one_hot)) > 0  # [T, H]
    other = jnp.arange(hosts.num_hosts) != jnp.asarray(hosts.host)[rank]
    return (in_host & other[None, :]).sum(dtype=jnp.int32), in_host


def _record(buffer, op, rank, nvlink_rows, network_rows, row_bytes):
    """Adds this rank's rows to the buffer's counters when the program runs (a debug callback per rank)."""

    def add(rank, nvlink_rows, network_rows):
        counters = buffer._reference_traffic.setdefault(int(rank), {})
        entry = counters.setdefault(op, dict.fromkeys(TRAFFIC_FIELDS, 0))
        for kind, rows in (("nvlink", int(nvlink_rows)), ("network", int(network_rows))):
            entry[f"{kind}_rows"] += rows
            entry[f"{kind}_bytes"] += rows * row_bytes

    jax.debug.callback(add, rank, nvlink_rows, network_rows)


def _count_moves(buffer, op, handle, sent_to, row_bytes):
    """Dispatch and cached dispatch: a row goes over NVLink when its mover (the
    source, or the forwarder on the destination's host) is not its
    destination; over the network once per (token, remote host in sent_to)."""
    hosts = _Hosts(buffer)
    rank = lax.axis_index(buffer.axis_name)
    received = _received_per_source(handle)
    others = jnp.arange(buffer.num_ranks)[None, :] != rank
    nvlink = jnp.where((jnp.asarray(hosts.deliverer) == rank) & others, received, 0).sum(dtype=jnp.int32)
    network, _ = _remote_hosts(hosts, rank, sent_to)
    _record(buffer, op, rank, nvlink, network, row_bytes)


def _count_combine(buffer, handle, row_bytes):
    """Combine. One host: the source loads its rows from the other ranks. Across
    hosts: every rank stores its rows into their source's forwarder on its
    host (NVLink unless itself), and each forwarder puts one partial per
    (token, remote source) over the network."""
    hosts = _Hosts(buffer)
    rank = lax.axis_index(buffer.axis_name)
    received = _received_per_source(handle)
    num_ranks = buffer.num_ranks
    if hosts.num_hosts == 1:
        others = jnp.arange(num_ranks) != rank
        nvlink = jnp.where(others, received[rank], 0).sum(dtype=jnp.int32)
        _record(buffer, "combine", rank, nvlink, jnp.int32(0), row_bytes)
        return
    forwarder_of_mine = jnp.asarray(hosts.forwarder)[:, rank]  # [s]: where this rank's rows of s go
    nvlink = jnp.where(forwarder_of_mine != rank, received[:, rank], 0).sum(dtype=jnp.int32)
    # The partials this rank's tokens need from each host, credited to that host's forwarder.
    _, in_host = _remote_hosts(hosts, rank, _valid_rows(handle))
    per_host = in_host.sum(axis=0, dtype=jnp.int32)  # [H]
    forwarders = jnp.asarray(hosts.forwarder)[rank]  # [d]: the forwarder on d's host
    mine = (forwarders == jnp.arange(num_ranks)) & (jnp.asarray(hosts.host) != jnp.asarray(hosts.host)[rank])
    credit = jnp.where(mine, per_host[jnp.asarray(hosts.host)], 0)
    network = lax.psum(credit, buffer.axis_name)[rank]
    _record(buffer, "combine", rank, nvlink, network, row_bytes)


# --------------------------------------------------------------------------
# Low-latency mode


def quantize_fp8(x, round_scale=False, mxfp8=False):
    """bf16 [..., H] -> (float8_e4m3fn [..., H], float32 scales [..., H // 128]); with mxfp8,
    scales per 32 channels as float8_e8m0fnu [..., H // 32] (rounded up to powers of two)."""
    block = MXFP8_BLOCK if mxfp8 else FP8_BLOCK
    round_scale = round_scale or mxfp8
    blocks = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), 1e-4)
    scale = amax * np.float32(1.0 / FP8_MAX)  # what XLA makes of amax / 448 anyway
    if round_scale:  # the power of two at or above scale, exactly (exp2(ceil(log2)) is not)
        mantissa, exponent = jnp.frexp(scale)
        scale = jnp.ldexp(jnp.float32(1.0), jnp.where(mantissa == 0.5, exponent - 1, exponent))
    q = jnp.clip(blocks * (1.0 / scale)[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(x.shape), scale.astype(jnp.float8_e8m0fnu) if mxfp8 else scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _DispatchPending:
    recv_xs: tuple  # [R(source), M, H] (+ scales)
    recv_idx: jax.Array  # [R(source), M, K] local expert ids or -1
    num_experts: int = dataclasses.field(metadata=dict(static=True))
    num_tokens: int = dataclasses.field(metadata=dict(static=True))  # T of the dispatch (<= M)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _CombinePending:
    back: jax.Array  # [R(expert rank), M, K, H]: expert outputs for my (token, k)
    topk_idx: jax.Array
    topk_weights: jax.Array
    num_experts: int = dataclasses.field(metadata=dict(static=True))


def low_latency_dispatch_send(
    x, topk_idx, *, num_experts, num_max_dispatch_tokens_per_rank, use_fp8, round_scale, buffer, mxfp8=False
):
    num_ranks, max_tokens = buffer.num_ranks, num_max_dispatch_tokens_per_rank
    num_tokens = x.shape[0]
    experts_per_rank = num_experts // num_ranks
    pad = max_tokens - num_tokens
    x = jnp.pad(x, ((0, pad), (0, 0)))
    topk_idx = jnp.pad(topk_idx, ((0, pad), (0, 0)), constant_values=-1)
    xs = quantize_fp8(x, round_scale, mxfp8) if use_fp8 else (x,)
    # One slot per (destination rank, token): the token's row once, with its
    # local expert ids on that rank (-1 for experts elsewhere).
    local = topk_idx[None] - (jnp.arange(num_ranks, dtype=jnp.int32) * experts_per_rank)[:, None, None]
    on_rank = (topk_idx[None] >= 0) & (local >= 0) & (local < experts_per_rank)
    payload = {
        "xs": tuple(jnp.broadcast_to(_as_bits(a)[None], (num_ranks,) + a.shape) for a in xs),
        "idx": jnp.where(on_rank, local, -1),
    }
    received = _exchange(payload, buffer)
    recv_xs = tuple(_from_bits(r, a.dtype) for r, a in zip(received["xs"], xs))
    return _DispatchPending(recv_xs, received["idx"], num_experts, num_tokens)


def low_latency_dispatch_recv(pending, *, buffer):
    num_ranks, max_tokens, topk = pending.recv_idx.shape
    experts_per_rank = pending.num_experts // num_ranks
    capacity = num_ranks * max_tokens
    # Slot n = (source rank, token, k); rows of expert e are its matching
    # slots in n order, i.e. by source rank, then token, then k.
    idx = pending.recv_idx.reshape(-1)
    match = idx[None, :] == jnp.arange(experts_per_rank, dtype=jnp.int32)[:, None]  # [E/R, R*M*K]
    pos = jnp.cumsum(match, axis=1, dtype=jnp.int32) - 1
    recv_count = jnp.minimum(match.sum(axis=1, dtype=jnp.int32), capacity)
    expert_of = jnp.where(idx >= 0, idx, experts_per_rank)
    pos_of = jnp.take_along_axis(pos, jnp.clip(idx, 0, experts_per_rank - 1)[None], axis=0)[0]
    slots = jnp.arange(idx.shape[0], dtype=jnp.int32)
    table = jnp.full((experts_per_rank, capacity), -1, jnp.int32).at[expert_of, pos_of].set(slots, mode="drop")
    valid = table >= 0
    row = jnp.where(valid, table // topk, 0)  # row of [R * M]
    recv_xs = tuple(r.reshape((capacity,) + r.shape[2:])[row] for r in pending.recv_xs)
    if buffer.config.poison_padding:  # as the kernels may leave them (Config.poison_padding)
        recv_xs = tuple(jnp.where(valid[..., None], r, jnp.nan).astype(r.dtype) for r in recv_xs)
    handle = LowLatencyHandle(
        recv_count=recv_count,
        recv_src_rank=jnp.where(valid, table // (max_tokens * topk), -1),
        recv_src_token=jnp.where(valid, (table // topk) % max_tokens, -1),
        recv_src_topk=jnp.where(valid, table % topk, -1),
        num_tokens=pending.num_tokens,
        num_topk=topk,
    )
    return recv_xs, recv_count, handle


def low_latency_combine_send(x, topk_idx, topk_weights, handle, *, buffer):
    num_ranks = buffer.num_ranks
    experts_per_rank, capacity, hidden = x.shape
    max_tokens = capacity // num_ranks
    num_tokens, topk = topk_idx.shape
    # Return each expert output to slot (source rank, token, k) of its source.
    valid = handle.recv_src_rank >= 0
    slot = (handle.recv_src_rank * max_tokens + handle.recv_src_token) * topk + handle.recv_src_topk
    slot = jnp.where(valid, slot, num_ranks * max_tokens * topk)
    packed = jnp.arange(experts_per_rank * capacity, dtype=jnp.int32).reshape(experts_per_rank, capacity)
    inverse = jnp.zeros((num_ranks * max_tokens * topk,), jnp.int32).at[slot].set(packed, mode="drop")
    back = x.reshape(experts_per_rank * capacity, hidden)[inverse].reshape(num_ranks, max_tokens, topk, hidden)
    back = _exchange(back, buffer)
    return _CombinePending(back, topk_idx, topk_weights, experts_per_rank * num_ranks)


def low_latency_combine_recv(pending, *, buffer):
    num_tokens, topk = pending.topk_idx.shape
    experts_per_rank = pending.num_experts // buffer.num_ranks
    # Ids outside [0, E) name no expert, as in dispatch (the wrapper sanitises them; this backend need not rely on it).
    valid = (pending.topk_idx >= 0) & (pending.topk_idx < pending.num_experts)
    owner = jnp.where(valid, pending.topk_idx // experts_per_rank, 0)
    tokens = jnp.arange(num_tokens)
    y = pending.back[owner, tokens[:, None], jnp.arange(topk)[None, :]].astype(jnp.float32)  # [T, K, H]
    # Products first, then their sum in k order as a loop: XLA must not fuse
    # multiply and add into an FMA, which rounds differently from the kernels.
    # The barrier keeps them apart on GPUs; XLA's CPU backend drops barriers,
    # but cannot fuse across the loop's iterations.
    terms = lax.optimization_barrier(jnp.where(valid[:, :, None], pending.topk_weights[:, :, None] * y, 0.0))
    terms = jnp.moveaxis(terms, 1, 0)  # [K, T, H]
    zeros = jnp.zeros_like(terms[0])  # typed like terms (varying over the same mesh axes)
    acc, _ = lax.scan(lambda acc, term: (acc + term, None), zeros, terms)
    return acc.astype(jnp.bfloat16)


def low_latency_dispatch(x, topk_idx, *, buffer, **kwargs):
    return low_latency_dispatch_recv(low_latency_dispatch_send(x, topk_idx, buffer=buffer, **kwargs), buffer=buffer)


def low_latency_combine(x, topk_idx, topk_weights, handle, *, buffer):
    return low_latency_combine_recv(
        low_latency_combine_send(x, topk_idx, topk_weights, handle, buffer=buffer), buffer=buffer
    )


def low_latency_mask(set_to, *, buffer):
    """No rank is ever masked here: XLA's collectives have no timeout to find one by."""
    if set_to is not None:
        raise NotImplementedError(
            "low_latency_set_mask: the xla backend masks no rank (its collectives succeed or fail as a whole); "
            "masking needs the CUDA backend"
        )
    return varying_like([jnp.zeros((buffer.num_ranks,), jnp.int32)], [], buffer.axis_name)[0]
