"""The contract of docs/design.md written as plain numpy loops, to check
the reference backend against something independent of it. Global view:
arrays are [R, T, ...] (rank r's shard at index r)."""

import numpy as np


def layout(idx, num_experts, num_ranks):
    """idx [T, K] -> (num_tokens_per_rank [R], per_expert [E], in_rank [T, R])."""
    per_rank_experts = num_experts // num_ranks
    in_rank = np.zeros((idx.shape[0], num_ranks), bool)
    per_expert = np.zeros(num_experts, np.int64)
    for t, row in enumerate(idx):
        for e in row:
            if 0 <= e < num_experts:
                in_rank[t, e // per_rank_experts] = True
                per_expert[e] += 1
    return in_rank.sum(0), per_expert, in_rank


def dispatch(x, idx, w, num_experts, num_worst_tokens):
    """x [R, T, H] (any dtype), idx/w [R, T, K]. Returns per receiving rank a
    dict of rows (lists) in contract order, truncated to num_worst_tokens."""
    num_ranks, num_tokens, _ = x.shape
    epr = num_experts // num_ranks
    out = []
    for r in range(num_ranks):
        rows = dict(x=[], idx=[], w=[], src=[], rank=[])
        for s in range(num_ranks):
            for t in range(num_tokens):
                mine = [(k, e) for k, e in enumerate(idx[s, t]) if 0 <= e < num_experts and e // epr == r]
                if not mine:
                    continue
                local = np.full(idx.shape[2], -1, np.int32)
                weights = np.zeros(idx.shape[2], np.float32)
                for k, e in mine:
                    local[k] = e - r * epr
                    weights[k] = w[s, t, k]
                rows["x"].append(x[s, t])
                rows["idx"].append(local)
                rows["w"].append(weights)
                rows["src"].append(t)
                rows["rank"].append(s)
        total = len(rows["x"])
        rows = {k: v[:num_worst_tokens] for k, v in rows.items()}
        rows["total"] = total
        out.append(rows)
    return out


def pair_bytes(data, scales):
    """A quantized pair's rows [..., T, *] as their bytes side by side, [..., T, bytes], the way they
    travel (float4 data two values to a byte, the first in the low half): what dispatch places."""
    data, scales = np.asarray(data), np.asarray(scales)
    if data.dtype.name == "float4_e2m1fn":
        nibbles = data.view(np.uint8).reshape(data.shape[:-1] + (-1, 2))
        data = nibbles[..., 0] | nibbles[..., 1] << 4
    return np.concatenate([data.view(np.uint8), scales.view(np.uint8)], -1)


def scaled_expert_rows(received, scales, num_rows, hidden):
    """deep_ep_jax.testing.scaled_experts on each rank's received rows:
    received: dispatch()'s output; scales [R, L]. Returns y [R, num_rows, H]
    (bf16 values as float32; zeros past the received rows)."""
    y = np.zeros((len(received), num_rows, hidden), np.float32)
    for r, rows in enumerate(received):
        for i, (x, idx, w) in enumerate(zip(rows["x"], rows["idx"], rows["w"])):
            total = np.float32(0)
            for k, e in enumerate(idx):
                total = np.float32(total + (np.float32(w[k]) * np.float32(scales[r][e]) if e >= 0 else 0))
            y[r, i] = bf16_values(np.asarray(x, np.float32) * total)
    return y


def combine(y, received, num_tokens, gpus_per_host=None, bf16_partials=True):
    """y [R, N, H]: each rank's rows; received: dispatch()'s output.
    Returns float32 [R(source), T, H] summed in rank order. With
    gpus_per_host G (rank r on host r // G, H = R / G > 1 hosts): summed per
    host first, the host's ranks in order from 0.0, the partial rounded to
    bf16 (unless not bf16_partials: the weights' partials stay float32), then
    the partials in host order from 0.0. The caller rounds to bf16."""
    num_ranks, _, hidden = y.shape
    if gpus_per_host is None or gpus_per_host >= num_ranks:
        gpus_per_host = num_ranks  # one host: the partial is the sum
    out = np.zeros((num_ranks, num_tokens, hidden), np.float32)
    for first in range(0, num_ranks, gpus_per_host):  # hosts in order
        partial = np.zeros_like(out)
        for r in range(first, min(first + gpus_per_host, num_ranks)):  # the host's ranks in order
            for i, (s, t) in enumerate(zip(received[r]["rank"], received[r]["src"])):
                partial[s, t] = partial[s, t] + y[r, i].astype(np.float32)
        if bf16_partials and gpus_per_host < num_ranks:
            partial = bf16_values(partial)
        out = out + partial
    return out


def traffic(idx, received, num_experts, gpus_per_host=None):
    """Rows each rank's kernels move per operation (docs/internode.md), from
    the routing idx [R, T, K] and dispatch()'s received rows (drops
    excluded), with rank r on host r // G (gpus_per_host None: one host).
    Returns {rank: {op: (nvlink_rows, network_rows)}}. NVLink: a row stored
    into or loaded from another rank's memory on the mover's host; network: a
    row put to another host.
      dispatch, cached_dispatch: the source moves a row to a destination of
        its host, the forwarder (the destination host's rank with the
        source's index) to one of another; each (token, remote host) crosses
        the network once, put by the source: dispatch for every remote host
        of its experts, cached_dispatch for the hosts that kept a row of it.
      combine: one host: the source loads its rows from the other ranks.
        Several: each rank stores a row into the forwarder of its source on
        its own host; each forwarder puts one partial per (token, remote
        source host that kept a row of it on the forwarder's host)."""
    num_ranks, num_tokens, _ = idx.shape
    per_host = num_ranks if gpus_per_host is None else min(gpus_per_host, num_ranks)
    host = [r // per_host for r in range(num_ranks)]
    epr = num_experts // num_ranks

    def forwarder(s, d):  # the rank of d's host with s's index
        return host[d] * per_host + s % per_host

    counts = {r: {op: [0, 0] for op in ("dispatch", "cached_dispatch", "combine")} for r in range(num_ranks)}
    kept_hosts = {}  # (s, t) -> hosts that kept a row
    for d, rows in enumerate(received):
        for s, t in zip(rows["rank"], rows["src"]):
            kept_hosts.setdefault((s, t), set()).add(host[d])
            mover = s if host[s] == host[d] else forwarder(s, d)
            for op in ("dispatch", "cached_dispatch"):
                counts[mover][op][0] += mover != d
            if per_host == num_ranks:
                counts[s]["combine"][0] += s != d
            else:
                counts[d]["combine"][0] += forwarder(s, d) != d
    for s in range(num_ranks):
        for t in range(num_tokens):
            expert_hosts = {host[e // epr] for e in idx[s, t] if 0 <= e < num_experts}
            counts[s]["dispatch"][1] += len(expert_hosts - {host[s]})
            remote_kept = kept_hosts.get((s, t), set()) - {host[s]}
            counts[s]["cached_dispatch"][1] += len(remote_kept)
            for b in remote_kept:
                counts[b * per_host + s % per_host]["combine"][1] += 1
    return {r: {op: tuple(v) for op, v in ops.items()} for r, ops in counts.items()}


def low_latency_dispatch(x, idx, num_experts, max_tokens):
    """x [R, T, H], idx [R, T, K] -> per rank: list per local expert of
    (source rank, token, k) in contract order, at most R * max_tokens each
    (the rest are dropped)."""
    num_ranks = idx.shape[0]
    epr = num_experts // num_ranks
    out = [[[] for _ in range(epr)] for _ in range(num_ranks)]
    for s, tokens in enumerate(np.asarray(idx).tolist()):  # source rank, then token, then k
        for t, row in enumerate(tokens):
            for k, e in enumerate(row):
                if 0 <= e < num_experts:
                    out[e // epr][e % epr].append((s, t, k))
    return [[slots[: num_ranks * max_tokens] for slots in experts] for experts in out]


def mask_ranks(idx, masked, num_experts):
    """idx [R, T, K] as low-latency mode serves it once the ranks in `masked`
    are masked on every other rank: a masked rank sends nothing (its tokens
    -1) and its experts receive nothing (their ids -1). The other ranks'
    dispatch and combine results are then low_latency_dispatch() and
    low_latency_combine() of this idx (a masked rank's own are undefined)."""
    idx = np.array(idx, copy=True)
    owner = np.where(idx >= 0, idx, 0) // (num_experts // idx.shape[0])
    idx[np.isin(owner, list(masked)) & (idx >= 0)] = -1
    idx[list(masked)] = -1
    return idx


def low_latency_combine(y, received, idx, w, num_experts):
    """y [R, E/R, R*M, H]: each rank's expert outputs in its received rows
    (low_latency_dispatch()'s order); idx/w [R, T, K]. Returns float32
    [R(source), T, H]: acc = 0, then for k in order with idx in [0, E),
    acc += w * float32(row), the product rounded to float32 before the add
    (numpy never fuses them)."""
    where = {}
    for r, experts in enumerate(received):
        for e, slots in enumerate(experts):
            for i, slot in enumerate(slots):
                where[slot] = (r, e, i)
    num_ranks, num_tokens, topk = idx.shape
    out = np.zeros((num_ranks, num_tokens, y.shape[-1]), np.float32)
    for s in range(num_ranks):
        for t in range(num_tokens):
            acc = np.zeros(y.shape[-1], np.float32)
            for k in range(topk):
                if not 0 <= idx[s, t, k] < num_experts:
                    continue
                r, e, i = where[(s, t, k)]  # a dropped row (KeyError): combine is undefined then
                term = np.float32(w[s, t, k]) * y[r, e, i].astype(np.float32)
                acc = acc + term
            out[s, t] = acc
    return out


def expert_layout(idx, num_local_experts, alignment, num_rows):
    """Expert-major rows of one rank: idx [N, K] local ids (others name no
    expert) -> dict of group_sizes [L], group_offsets [L], pair_row [N, K]
    (-1: no row), row_pair [num_rows] (n * K + k, -1: unused), num_dropped.
    Groups in expert order, each at a multiple of alignment, pairs in (n, k)
    order; rows past num_rows are dropped."""
    num_tokens, topk = idx.shape
    pairs = [[] for _ in range(num_local_experts)]
    for n in range(num_tokens):
        for k in range(topk):
            if 0 <= idx[n, k] < num_local_experts:
                pairs[idx[n, k]].append((n, k))
    pair_row = np.full((num_tokens, topk), -1, np.int64)
    row_pair = np.full(num_rows, -1, np.int64)
    sizes, offsets = np.zeros(num_local_experts, np.int64), np.zeros(num_local_experts, np.int64)
    start = dropped = 0
    for e, group in enumerate(pairs):
        offsets[e] = min(start, num_rows)
        for i, (n, k) in enumerate(group):
            if start + i < num_rows:
                pair_row[n, k] = start + i
                row_pair[start + i] = n * topk + k
                sizes[e] += 1
            else:
                dropped += 1
        start += -(-len(group) // alignment) * alignment
    return {
        "group_sizes": sizes,
        "group_offsets": offsets,
        "pair_row": pair_row,
        "row_pair": row_pair,
        "num_dropped": dropped,
    }


def expert_expand(x, row_pair, topk):
    """x [N, H] (any dtype) -> [num_rows, H]: each used row's token row, 0 elsewhere."""
    out = np.zeros((len(row_pair),) + x.shape[1:], x.dtype)
    for i, p in enumerate(row_pair):
        if p >= 0:
            out[i] = x[p // topk]
    return out


def expert_reduce(y, w, pair_row):
    """y [num_rows, H] expert outputs, w [N, K] float32 (None: plain sum) ->
    float32 [N, H]: acc = 0, then for k in order with a row, acc += w * float32(row),
    the product rounded to float32 before the add (numpy never fuses them)."""
    num_tokens, topk = pair_row.shape
    out = np.zeros((num_tokens, y.shape[1]), np.float32)
    for n in range(num_tokens):
        acc = np.zeros(y.shape[1], np.float32)
        for k in range(topk):
            if pair_row[n, k] < 0:
                continue
            row = y[pair_row[n, k]].astype(np.float32)
            acc = acc + (row if w is None else np.float32(w[n, k]) * row)
        out[n] = acc
    return out


# --------------------------------------------------------------------------
# Number formats, written from their definitions (no ml_dtypes, no jax).

FP8_BLOCK = 128  # channels per scale
MXFP8_BLOCK = 32  # channels per MXFP8 scale (float8_e8m0fnu)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def bf16_bits(a):
    """finite float32 -> the bits (uint16) of the nearest bfloat16, ties to even."""
    bits = np.asarray(a, np.float32).view(np.uint32)
    rounded = (bits >> 16) & 1
    rounded += bits  # + 0x8000 at most: stays below 2^32 for finite values
    rounded += 0x7FFF
    return (rounded >> 16).astype(np.uint16)


def bf16_values(a):
    """finite float32 -> the nearest bfloat16 values (ties to even), as float32."""
    return (bf16_bits(a).astype(np.uint32) << 16).view(np.float32)


def fp8_scales(x, round_scale=False, block=FP8_BLOCK, min_amax=1e-4):
    """x [..., H] (bf16 values) -> float32 scales [..., H / block]: per block of
    `block` channels max(amax, min_amax) times float32(1 / 448), both steps
    rounded to float32; with round_scale, the power of two at or above that."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    amax = np.maximum(np.abs(blocks).max(-1), np.float32(min_amax))
    scale = amax * (np.float32(1.0) / np.float32(FP8_MAX))
    if round_scale:
        # A float32's log2 is an integer exactly when it is a power of two, and
        # otherwise far from one at float64 precision: ceil is exact.
        scale = np.exp2(np.ceil(np.log2(scale.astype(np.float64)))).astype(np.float32)
    return scale.astype(np.float32)


def e4m3_round(v):
    """float32 values in [-448, 448] -> the nearest float8_e4m3fn values
    (ties to even), as float32: 3 mantissa bits, exponents from -6 (below
    2^-6, subnormal steps of 2^-9). The sign of zero is kept."""
    v = np.asarray(v, np.float64)
    _, exponent = np.frexp(v)  # |v| in [2^(exponent-1), 2^exponent)
    step = np.ldexp(1.0, np.maximum(exponent - 1, -6) - 3)
    return (np.round(v / step) * step).astype(np.float32)  # np.round: ties to even; exact in float64


def fp8_values(x, scales, inverse_ulps=0, block=FP8_BLOCK):
    """The FP8 values (as float32) of x [..., H] given its scales:
    e4m3(clip(x * inv, -448, 448)), inv = float32(1 / scale) (IEEE), or
    moved by `inverse_ulps` float32 steps (to bound a kernel whose 1 / scale
    is an approximate division)."""
    x = np.asarray(x, np.float32)
    inv = np.float32(1.0) / np.asarray(scales, np.float32)
    for _ in range(abs(inverse_ulps)):
        inv = np.nextafter(inv, np.float32(np.inf if inverse_ulps > 0 else 0.0)).astype(np.float32)
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    # A block holding inf has scale inf, so inv 0, and its inf * 0 is NaN, as in the kernels.
    with np.errstate(invalid="ignore"):
        scaled = np.clip(blocks * inv[..., None], np.float32(-FP8_MAX), np.float32(FP8_MAX))
    return e4m3_round(scaled).reshape(x.shape)


def quantize_fp8(x, round_scale=False, mxfp8=False):
    """x [..., H] (bf16 values) -> (FP8 values as float32 [..., H], float32 scales [..., H / 128]); with
    mxfp8, scales per 32 channels rounded up to powers of two (float32 values of the e8m0 ones)."""
    block = MXFP8_BLOCK if mxfp8 else FP8_BLOCK
    scales = fp8_scales(x, round_scale or mxfp8, block)
    return fp8_values(x, scales, block=block), scales


def expert_expand_quantized_t(x, row_pair, topk, row_multipliers, col_inverse):
    """The expert rows of bf16 x [N, H] (expert_expand) quantized and transposed, float32 values [H, rows]:
    e4m3(clip(x[row] * m[row] * inv[c], -448, 448)), each product rounded to float32; 0 where the row is
    unused or its multiplier m is 0."""
    rows = expert_expand(np.asarray(x, np.float32), row_pair, topk).astype(np.float32)
    m = np.asarray(row_multipliers, np.float32)[:, None]
    v = np.where(m == 0, np.float32(0), rows * m)
    scaled = np.clip(v * np.asarray(col_inverse, np.float32)[None, :], np.float32(-FP8_MAX), np.float32(FP8_MAX))
    return e4m3_round(scaled).T
