"""The index math of internode normal mode (csrc/kernels/internode.cu) as a
numpy model, for H hosts x G GPUs, against the contract (tests/oracle.py):
per-host positions, one packet per (token, destination host) to the GPU of
the sender's local index, final rows computed at the sender, forwarding to
the destination GPUs of that host. Checks that every row lands exactly once,
in the contract's order, that no receive slot is written twice, and that the
network carries one packet per distinct remote destination host, counted from
the routing itself, not from the model (the
deduplication docs/internode.md's bandwidth figures assume); the same with
the pipelined send and forward (sender channels in chunks, tails, forwarder
pairs) interleaved at random, where a packet forwarded before it landed
fails. Combine the other way: every rank's rows to the forwarder of their source on its host
(NVLink), which sums the host's rows and puts one bf16 partial per (token,
remote host) to the source, which sums the partials in host order: equal to
the oracle's per-host order bit for bit, one network row per remote host
holding the token; the same with the pipelined send and forward (row
senders in chunks of the received rows, tails per sender and channel,
forwarder warps that wait for the tails covering an entry's rows)
interleaved at random, where a row reduced before it landed fails. Runs on
CPU; the kernels themselves are checked against the reference on GPUs
(tests/gpu/test_internode_gpu.py, test_scale_gpu.py)."""

import numpy as np
import oracle
import pytest

from deep_ep_jax import testing
from deep_ep_jax.distributed import multiprocess


def model_dispatch(x, idx, nodes, num_experts, num_worst_tokens, num_blocks=0, rng=None):
    """x [R, T, H], idx [R, T, K]; nodes[r]: host of rank r. Returns per rank
    (rows [N, H] with NaN where nothing landed, src_idx [N], count of network
    packets sent). num_blocks > 1: send and forward as the pipelined kernel
    with that grid, its steps interleaved at random by rng."""
    num_ranks, num_tokens, _ = x.shape
    num_nodes = max(nodes) + 1
    epr = num_experts // num_ranks
    local = [sum(nodes[q] == nodes[r] for q in range(r)) for r in range(num_ranks)]
    per_host = num_ranks // num_nodes
    # The kernels' host table (DeviceState::device_nodes): rank at (host b, index j) at b * G + j.
    rank_at = [-1] * num_ranks
    for r in range(num_ranks):
        rank_at[nodes[r] * per_host + local[r]] = r
    host_ranks = [rank_at[b * per_host : (b + 1) * per_host] for b in range(num_nodes)]

    # Notify: masks, counts, the exchange, final rows and per-host positions.
    in_rank = np.zeros((num_ranks, num_tokens, num_ranks), bool)
    for s in range(num_ranks):
        for t in range(num_tokens):
            for e in idx[s, t]:
                if 0 <= e < num_experts:
                    in_rank[s, t, e // epr] = True
    in_node = np.zeros((num_ranks, num_tokens, num_nodes), bool)
    for r in range(num_ranks):
        in_node[:, :, nodes[r]] |= in_rank[:, :, r]
    counts = in_rank.sum(1)  # [src, dst]
    node_counts = in_node.sum(1)  # [src, node]
    first_row = np.cumsum(counts, 0) - counts  # [src, dst]: rows of earlier sources
    pos_in_dest = np.cumsum(in_rank, 1) - 1
    send_pos = np.where(
        in_rank & (first_row[:, None, :] + pos_in_dest < num_worst_tokens), first_row[:, None, :] + pos_in_dest, -1
    )
    node_pos = np.where(in_node, np.cumsum(in_node, 1) - 1, -1)

    landing = np.full((num_ranks, num_worst_tokens) + x.shape[2:], np.nan)
    src_idx = np.full((num_ranks, num_worst_tokens), -1)
    src_rank = np.full((num_ranks, num_worst_tokens), -1)

    def deliver(dest, row, s, t):
        assert np.isnan(landing[dest, row]).all(), f"row {row} of rank {dest} written twice"
        landing[dest, row] = x[s, t]
        src_idx[dest, row] = t
        src_rank[dest, row] = s

    # Send: one packet per remote destination host, direct rows on this host.
    # A packet carries no per-rank data: its token's final rows on the G ranks
    # of its host travel in rdma_meta, staged by the notify kernel and put in
    # one piece per host.
    rdma_recv = {}  # (forwarder, source host, position) -> (source rank, token)
    rdma_meta = {}  # (forwarder, source host, position) -> final rows on the forwarder's host's ranks
    packets = 0

    def send_token(s, t):
        nonlocal packets
        for b in range(num_nodes):
            if b != nodes[s] and node_pos[s, t, b] >= 0:
                key = (rank_at[b * per_host + local[s]], nodes[s], node_pos[s, t, b])
                assert key not in rdma_recv, f"receive slot {key} written twice"
                rdma_recv[key] = (s, t)
                rdma_meta[key] = [send_pos[s, t, d] for d in host_ranks[b]]
                assert len(rdma_meta[key]) <= 8  # a host's ranks, never all R
                packets += 1
        for d in range(num_ranks):
            if nodes[d] == nodes[s] and send_pos[s, t, d] >= 0:
                deliver(d, send_pos[s, t, d], s, t)

    def forward_packet(f, s, p):
        s_, t = rdma_recv.pop((f, nodes[s], p))  # KeyError: forwarded before it landed, or twice
        final_rows = rdma_meta.pop((f, nodes[s], p))
        assert s_ == s
        for d, row in zip(host_ranks[nodes[f]], final_rows):
            if row >= 0:
                deliver(d, row, s, t)

    if num_blocks > 1:
        pipelined_send_forward(num_blocks, num_tokens, nodes, local, rank_at, node_pos, send_token, forward_packet, rng)
    else:
        for s in range(num_ranks):
            for t in range(num_tokens):
                send_token(s, t)
        # Forward: each forwarder walks the packets of the same-index ranks of the other hosts.
        for f in range(num_ranks):
            for s in range(num_ranks):
                if nodes[s] == nodes[f] or local[s] != local[f]:
                    continue
                for p in range(node_counts[s, nodes[f]]):
                    forward_packet(f, s, p)
    assert not rdma_recv, "packets nobody forwarded"
    handle = {
        "send_pos": send_pos,
        "src_idx": src_idx,
        "src_rank": src_rank,
        "num_recv": np.minimum(counts.sum(0), num_worst_tokens),
    }
    return landing, src_idx, packets, handle


# The pipelined kernel's constants (csrc/kernels/internode.h).
PIPELINE_SENDER_SHARE, PIPELINE_CHUNK_TOKENS = 2, 16


def pipelined_send_forward(num_blocks, num_tokens, nodes, local, rank_at, node_pos, send_token, forward_packet, rng):
    """The pipelined kernel's schedule (PipelinedMoveKernel): sender channel
    c of rank s sends tokens [T c / C, T (c+1) / C) in chunks, each chunk
    raising its tail at every remote forwarder with new packets (the first
    at all); forwarder blocks poll the tails of their (remote host, channel)
    pairs and forward [done, tail) from the channel's head. Steps of all
    senders and forwarders interleave at random: a forwarder that forwards a
    position that has not landed, or twice, fails in forward_packet."""
    num_ranks, num_nodes = len(nodes), max(nodes) + 1
    per_host = num_ranks // num_nodes
    channels = num_blocks // PIPELINE_SENDER_SHARE
    forwarders = num_blocks - channels
    heads, tails = {}, {}  # (forwarder, source host, channel) -> (first position, count) / delivered

    def sender(s, c):
        begin, end = num_tokens * c // channels, num_tokens * (c + 1) // channels
        fwd = {b: rank_at[b * per_host + local[s]] for b in range(num_nodes) if b != nodes[s]}
        sent = dict.fromkeys(fwd, 0)
        for b, f in fwd.items():
            positions = [node_pos[s, t, b] for t in range(begin, end) if node_pos[s, t, b] >= 0]
            assert positions == list(range(positions[0], positions[0] + len(positions))) if positions else True
            heads[(f, nodes[s], c)] = (positions[0] if positions else 0, len(positions))
        chunk = begin
        while chunk == begin or chunk < end:
            chunk_end = min(end, chunk + PIPELINE_CHUNK_TOKENS)
            for t in range(chunk, chunk_end):
                send_token(s, t)
            for b, f in fwd.items():
                fresh = sum(node_pos[s, t, b] >= 0 for t in range(chunk, chunk_end))
                if fresh or chunk == begin:
                    sent[b] += fresh
                    tails[(f, nodes[s], c)] = sent[b]
            yield
            chunk += PIPELINE_CHUNK_TOKENS

    def forwarder(f, block):
        total = (num_nodes - 1) * channels
        pairs = []
        for i in range(block, total, forwarders):
            remote = i // channels
            pairs.append((remote if remote < nodes[f] else remote + 1, i % channels))
        assert len(pairs) <= num_nodes  # the kernel's shared arrays: one slot per pair, at most H
        done = dict.fromkeys(pairs, 0)
        while True:
            open_pairs, moved = 0, False
            for node, c in pairs:
                key = (f, node, c)
                if key not in tails:
                    open_pairs += 1
                    continue
                head, count = heads[key]
                if done[(node, c)] == count:
                    continue
                open_pairs += 1
                source = rank_at[node * per_host + local[f]]
                for i in range(done[(node, c)], min(tails[key], count)):
                    forward_packet(f, source, head + i)
                    moved = True
                done[(node, c)] = min(tails[key], count)
            if open_pairs == 0:
                return
            yield None if moved else False  # False: it only waited (interleave's deadlock check)

    steps = [sender(s, c) for s in range(num_ranks) for c in range(channels)]
    steps += [forwarder(f, block) for f in range(num_ranks) for block in range(forwarders)]
    interleave(steps, rng)


def interleave(steps, rng):
    """Runs the generators' steps, picking the next one at random, to the
    end of them all. A step yields False when it only waited: a run of
    waits far longer than it takes to pick every step is a deadlock, which
    fails instead of hanging."""
    waits = 0
    while steps:
        step = steps[rng.integers(len(steps))]
        try:
            waits = waits + 1 if next(step) is False else 0
        except StopIteration:
            steps.remove(step)
            waits = 0
        assert waits <= 64 * len(steps), "deadlock: every step left waits"


def _host_tables(nodes):
    num_ranks, num_nodes = len(nodes), max(nodes) + 1
    per_host = num_ranks // num_nodes
    local = [sum(nodes[q] == nodes[r] for q in range(r)) for r in range(num_ranks)]
    rank_at = [-1] * num_ranks
    for r in range(num_ranks):
        rank_at[nodes[r] * per_host + local[r]] = r
    return num_nodes, per_host, local, rank_at


def model_combine(y, handle, nodes, num_blocks=0, rng=None, wait_for_tails=True):
    """y [R, N, H]: each rank's rows; handle: model_dispatch's. The kernels'
    per-host combine: returns (float32 [R, T, H] before the final bf16
    rounding, network rows). num_blocks > 1: send and forward as the
    pipelined kernel with that grid, its steps interleaved at random by rng;
    wait_for_tails=False drops its forwarders' wait (only to show it fails)."""
    send_pos, src_idx, src_rank, num_recv = (handle[k] for k in ("send_pos", "src_idx", "src_rank", "num_recv"))
    num_ranks, num_tokens, _ = send_pos.shape
    num_rows = y.shape[1]
    num_nodes, per_host, local, rank_at = _host_tables(nodes)
    holds = (send_pos >= 0) & (send_pos < num_rows)  # [source, token, rank]: HandleRow

    # Notify (source s): per host b, the tokens with a row there, in token
    # order, each as (token, mask of b's ranks holding it, its row at each of
    # them or -1), staged for the forwarder on b (the rank of s's local
    # index); s's own host's list is s's own, there at once.
    staged = {}  # (source, host) -> entries
    for s in range(num_ranks):
        for b in range(num_nodes):
            staged[(s, b)] = []
            for t in range(num_tokens):
                rows = [send_pos[s, t, r] if holds[s, t, r] else -1 for r in rank_at[b * per_host : (b + 1) * per_host]]
                mask = sum(1 << j for j, row in enumerate(rows) if row >= 0)
                if mask:
                    staged[(s, b)].append((t, mask, rows))
    meta_counts = {key: len(entries) for key, entries in staged.items()}  # (source, host) -> positions
    meta = {}  # (forwarder, source host, position) -> entry, once its list is at the forwarder

    def put_lists(s, remote):
        for b in range(num_nodes):
            if (b != nodes[s]) == remote:
                for p, entry in enumerate(staged[(s, b)]):
                    meta[(rank_at[b * per_host + local[s]], nodes[s], p)] = entry

    # Send: every rank's rows over NVLink to the forwarder of their source on
    # its own host, slot [its index][source host][token].
    slots = {}

    def send_row(d, i):
        s, t = src_rank[d, i], src_idx[d, i]
        forwarder = rank_at[nodes[d] * per_host + local[s]]
        assert nodes[forwarder] == nodes[d], "a row left its host before the reduction"
        key = (forwarder, local[d], nodes[s], t)
        assert key not in slots, f"combine slot {key} written twice"
        slots[key] = y[d, i].astype(np.float32)

    # Forward: the forwarder sums its host's rows of each token in index
    # order from 0.0, rounds to bf16, and puts one row per (token, remote host).
    partials = {}  # (source, host, token) -> bf16 partial
    network_rows = 0

    def reduce_entry(f, hs, p):
        nonlocal network_rows
        t, mask, _ = meta.pop((f, hs, p))
        acc = np.zeros(y.shape[2:], np.float32)
        for j in range(per_host):
            if mask >> j & 1:
                key = (f, j, hs, t)
                assert key in slots, f"combine slot {key} read before it was written"
                acc = acc + slots.pop(key)
        partials[(rank_at[hs * per_host + local[f]], nodes[f], t)] = oracle.bf16_values(acc)
        network_rows += hs != nodes[f]

    for s in range(num_ranks):
        put_lists(s, False)  # its own host's list, written in place by the notify
    if num_blocks > 1:
        pipelined_combine(
            num_blocks, nodes, num_recv, meta_counts, meta, put_lists, send_row, reduce_entry, rng, wait_for_tails
        )
    else:
        # The send kernel puts the remote lists before any row.
        for s in range(num_ranks):
            put_lists(s, True)
        for d in range(num_ranks):
            for i in range(num_recv[d]):
                send_row(d, i)
        for f in range(num_ranks):
            for hs in range(num_nodes):
                for p in range(meta_counts[(rank_at[hs * per_host + local[f]], nodes[f])]):
                    reduce_entry(f, hs, p)
    assert not meta and not slots, "metadata or rows nobody reduced"
    # Receive: the source sums the partials of the hosts holding the token in host order from 0.0.
    out = np.zeros((num_ranks, num_tokens) + y.shape[2:], np.float32)
    for s in range(num_ranks):
        for t in range(num_tokens):
            for b in range(num_nodes):
                if any(holds[s, t, rank_at[b * per_host + j]] for j in range(per_host)):
                    out[s, t] = out[s, t] + partials.pop((s, b, t))
    assert not partials, "partials nobody summed"
    return out, network_rows


# A combine channel's tail once it has sent all its chunks: above any count.
FINISHED = 1 << 62


def pipelined_combine(
    num_blocks,
    nodes,
    num_recv,
    meta_counts,
    meta,
    put_lists,
    send_row,
    reduce_entry,
    rng,
    wait_for_tails=True,
    warps_per_block=2,
):
    """The pipelined combine's send and forward: C = num_blocks / 2 row
    sender channels per rank, channel c taking the chunks k = c, c + C, ...
    of its received rows (chunk k: rows [16 k, 16 k + 16)) and, after each,
    setting its tail at every rank of its host to its chunks sent (FINISHED
    after the last); the first forwarder block first puts the lists to the remote hosts. The
    W = F * warps_per_block forwarder warps of a rank take entry i of its
    lists (by source host, then position) if i % W is theirs, in order, and
    wait for the tails that cover the rows the entry reduces, unless
    wait_for_tails is False: reading a row that has not landed fails in
    reduce_entry. Steps of all channels and warps interleave at random."""
    num_ranks, num_nodes = len(nodes), max(nodes) + 1
    _, per_host, local, rank_at = _host_tables(nodes)
    channels = num_blocks // PIPELINE_SENDER_SHARE
    warps = (num_blocks - channels) * warps_per_block
    tails = {}  # (rank, sender index on its host, channel) -> chunks sent, or FINISHED
    listed = set()  # sources whose remote lists are put

    def set_tail(d, c, value):
        for f in rank_at[nodes[d] * per_host : (nodes[d] + 1) * per_host]:
            assert value > tails.get((f, local[d], c), 0), "a tail went back"
            tails[(f, local[d], c)] = value

    def sender(d, c):
        num_chunks = -(-num_recv[d] // PIPELINE_CHUNK_TOKENS)
        for sent, k in enumerate(range(c, num_chunks, channels), 1):
            for i in range(k * PIPELINE_CHUNK_TOKENS, min(num_recv[d], (k + 1) * PIPELINE_CHUNK_TOKENS)):
                send_row(d, i)
            set_tail(d, c, sent)
            yield
        set_tail(d, c, FINISHED)

    def landed(f, rows):
        # Row r is chunk k = r / 16, the (k / C)-th of channel k % C of the rank of index `holder` that holds it.
        for holder, r in enumerate(rows):
            k = r // PIPELINE_CHUNK_TOKENS
            if r >= 0 and tails.get((f, holder, k % channels), 0) < k // channels + 1:
                return False
        return True

    def warp(f, w):
        # The first forwarder block puts the rank's lists (its warp 0 here) before any of its warps forwards.
        if w == 0:
            put_lists(f, True)
            listed.add(f)
            yield
        while w < warps_per_block and f not in listed:
            yield False
        sources = [rank_at[hs * per_host + local[f]] for hs in range(num_nodes)]
        entries = [(hs, p) for hs in range(num_nodes) for p in range(meta_counts[(sources[hs], nodes[f])])]
        for hs, p in entries[w::warps]:
            while hs != nodes[f] and sources[hs] not in listed:
                yield False  # the list is not here yet
            while wait_for_tails and not landed(f, meta[(f, hs, p)][2]):
                yield False  # a row it sums may not be in its slot yet
            reduce_entry(f, hs, p)
            yield

    steps = [sender(d, c) for d in range(num_ranks) for c in range(channels)]
    steps += [warp(f, w) for f in range(num_ranks) for w in range(warps)]
    interleave(steps, rng)


def remote_hosts_holding(expected, nodes):
    """From the contract's received rows (oracle.dispatch, drops excluded),
    independent of the model: for every source token, the hosts other than
    its own where a rank received it."""
    held = set()
    for d, rows in enumerate(expected):
        held |= {(s, t, nodes[d]) for s, t in zip(rows["rank"], rows["src"]) if nodes[d] != nodes[s]}
    return len(held)


def remote_hosts_per_token(idx, nodes, num_experts):
    """Straight from the routing, independent of the model: for every source
    token, the hosts other than its own that hold one of its experts."""
    num_ranks = len(nodes)
    epr = num_experts // num_ranks
    return sum(
        len({nodes[e // epr] for e in idx[s, t] if 0 <= e < num_experts} - {nodes[s]})
        for s in range(idx.shape[0])
        for t in range(idx.shape[1])
    )


# Groups of up to 8 ranks, with 37 tokens per rank;
# hosts of 8 GPUs up to 16 of them (128 ranks), with fewer tokens to stay quick.
SMALL_GROUPS = [(2, 1, 37, 4), (2, 4, 37, 4), (4, 2, 37, 4), (8, 1, 37, 4), (3, 2, 37, 4)]
LARGE_GROUPS = [(2, 8, 16, 8), (4, 8, 8, 8), (8, 8, 4, 8), (16, 8, 3, 8)]


@pytest.mark.parametrize("num_hosts,gpus_per_host,num_tokens,topk", SMALL_GROUPS + LARGE_GROUPS)
@pytest.mark.parametrize("kind", ["random", "one_expert", "rank_empty", "minus_one"])
@pytest.mark.parametrize("fraction", [1.0, 0.3])
def test_model_matches_contract(num_hosts, gpus_per_host, num_tokens, topk, kind, fraction, rng):
    num_ranks = num_hosts * gpus_per_host
    num_experts, hidden = 4 * num_ranks, 2
    rows = max(1, int(fraction * num_tokens * num_ranks))
    idx, w = testing.make_routing(num_ranks, num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
    idx = np.asarray(idx).reshape(num_ranks, num_tokens, topk)
    w = np.asarray(w).reshape(num_ranks, num_tokens, topk)
    x = rng.standard_normal((num_ranks, num_tokens, hidden))
    nodes = multiprocess.group_nodes(["machine"] * num_ranks, gpus_per_host)
    landing, src_idx, packets, handle = model_dispatch(x, idx, nodes, num_experts, rows)
    assert packets == remote_hosts_per_token(idx, nodes, num_experts)  # once per (token, remote destination host)
    # The pipelined kernel at a few grids lands the same rows (and sends the same packets).
    for num_blocks in (2, 5, 24):
        piped, piped_src, piped_packets, _ = model_dispatch(x, idx, nodes, num_experts, rows, num_blocks, rng)
        np.testing.assert_array_equal(piped, landing)
        np.testing.assert_array_equal(piped_src, src_idx)
        assert piped_packets == packets
    want = oracle.dispatch(x, idx, w, num_experts, rows)
    for r in range(num_ranks):
        n = len(want[r]["x"])
        np.testing.assert_array_equal(landing[r, :n], np.reshape(want[r]["x"], (n, hidden)))
        np.testing.assert_array_equal(src_idx[r, :n], want[r]["src"])
        assert np.isnan(landing[r, n:]).all() and (src_idx[r, n:] == -1).all()
    # Combine, per host: bf16 rows of +-2^24 among small ones, so that another order shows.
    y = rng.standard_normal((num_ranks, rows, hidden), np.float32)
    y = oracle.bf16_values(np.where(rng.random(y.shape) < 0.5, np.sign(y) * np.float32(1 << 24), y))
    out, network_rows = model_combine(y, handle, nodes)
    assert network_rows == remote_hosts_holding(want, nodes)  # once per (token, remote host holding it)
    np.testing.assert_array_equal(out, oracle.combine(y, want, num_tokens, gpus_per_host))
    # The pipelined kernel at a few grids sums the same rows in the same order (and puts the same rows).
    for num_blocks in (2, 5, 24):
        piped, piped_rows = model_combine(y, handle, nodes, num_blocks, rng)
        np.testing.assert_array_equal(piped, out)
        assert piped_rows == network_rows


def test_pipelined_combine_needs_tails():
    """Without the forwarders' wait for the tails, some interleaving reduces
    a row before it landed, and the model fails: the tails are what makes
    the pipelined combine right, not the luck of the schedule."""
    num_ranks, num_tokens, num_experts, topk = 8, 64, 32, 4
    idx, _ = testing.make_routing(num_ranks, num_ranks * num_tokens, num_experts, topk, num_ranks, "random")
    idx = np.asarray(idx).reshape(num_ranks, num_tokens, topk)
    nodes = multiprocess.group_nodes(["machine"] * num_ranks, 4)
    rows = num_tokens * num_ranks
    x = np.zeros((num_ranks, num_tokens, 1))
    *_, handle = model_dispatch(x, idx, nodes, num_experts, rows)
    y = np.ones((num_ranks, rows, 1), np.float32)
    for seed in range(5):
        model_combine(y, handle, nodes, 4, np.random.default_rng(seed))  # with the wait: passes
        try:
            model_combine(y, handle, nodes, 4, np.random.default_rng(seed), wait_for_tails=False)
        except AssertionError as error:
            assert "read before it was written" in str(error)
            return
    pytest.fail("no interleaving read a row before it landed")
