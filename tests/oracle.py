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


def combine(y, received, num_tokens):
    """y [R, N, H]: each rank's rows; received: dispatch()'s output.
    Returns float32 [R(source), T, H] summed in rank order."""
    num_ranks, _, hidden = y.shape
    out = np.zeros((num_ranks, num_tokens, hidden), np.float32)
    for r in range(num_ranks):  # rank order, as the contract says
        for i, (s, t) in enumerate(zip(received[r]["rank"], received[r]["src"])):
            out[s, t] = out[s, t] + y[r, i].astype(np.float32)
    return out


def low_latency_dispatch(x, idx, num_experts, max_tokens):
    """x [R, T, H], idx [R, T, K] -> per rank: list per local expert of
    (source rank, token, k) in contract order."""
    num_ranks, num_tokens, topk = idx.shape
    epr = num_experts // num_ranks
    out = []
    for r in range(num_ranks):
        experts = []
        for e in range(epr):
            g = r * epr + e
            experts.append([(s, t, k) for s in range(num_ranks) for t in range(num_tokens) for k in range(topk) if idx[s, t, k] == g])
        out.append(experts)
    return out
