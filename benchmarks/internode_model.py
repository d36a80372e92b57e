"""A model of normal mode across hosts on 400 Gb/s InfiniBand (issue 18): per
operation, the bytes each GPU moves over the NIC, over NVLink and in its own
memory, the bandwidth bound, and the time the kernels should take, with their
stages run one after another (today's kernels) and pipelined by chunk. No
RDMA NIC is on the development machine: these are estimates from byte
counts, not measurements.

    python benchmarks/internode_model.py                  # markdown tables, standard case
    python benchmarks/internode_model.py --json           # the same as JSON (--json PATH: to a file)
    python benchmarks/internode_model.py --max-hosts 4    # tokens routed to at most 4 hosts

Routing: every token of every GPU picks its top-k of E experts uniformly at
random (sampled, seeded); expert e lives on rank e // (E / R), rank r on host
r // G. With --max-hosts M a token first keeps the M hosts holding its best
scores, then takes its top-k among their experts (node-limited routing, as
DeepSeek-V3's and DeepEP's internode tests with M = 4).

Data paths (docs/internode.md):
- dispatch: one packet per (token, remote destination host) over the NIC to
  the GPU of that host with the sender's index on its host (its forwarder),
  which copies it over NVLink to the token's other destinations there; rows
  for the sender's own host go over NVLink directly; then a copy out of the
  landing area into XLA's buffers (local memory).
- combine, reduced per host: the reverse. A token's rows on each remote host
  gather over NVLink at its forwarder, which sums them and sends one row per
  remote host over the NIC (bf16; --combine-partials f32 for float32 sums);
  the source sums its own host's rows and the partial sums.
- combine per rank (before issue 18): every destination rank sends its row
  back to the source, over the NIC when it is on another host.

Time: each resource moves its bytes at line rate x an efficiency; on links
(full duplex) a GPU's bytes are the larger of what it sends and receives; the
slowest GPU counts. "serial" runs the kernels' steps one after another, as
today's kernels do (dispatch: network puts beside the own-host NVLink stores,
then the NVLink forward, then the copy out); "pipelined" overlaps them by
chunk: time = the busiest resource + the fill and drain of one chunk (its
time through the serial steps, less its turn at the busiest resource), where
a chunk is chunk_tokens tokens of each of the channels. Both add a fixed cost
per call (count exchange, flags, launches). "bound": the busiest resource at
line rate, no fixed cost.

Bandwidth is DeepEP's formula (docs/design.md section 3): bytes of all rows a
GPU receives, local ones included (FP8: data + scales; combine counts the
rows of a bf16 dispatch), over the time. "NIC GB/s" is the bytes that cross
the network over the same time. "DeepEP RDMA GB/s" counts as DeepEP's
internode tests do: one row per destination host of a token, its own host
included, of hidden x 2 bytes (FP8: hidden + hidden / 32).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import numpy as np

OPS = ("dispatch_bf16", "dispatch_fp8", "combine_bf16", "combine_bf16_per_rank")
OP_TITLES = {
    "dispatch_bf16": "dispatch bf16",
    "dispatch_fp8": "dispatch FP8",
    "combine_bf16": "combine bf16, per host",
    "combine_bf16_per_rank": "combine bf16, per rank (before)",
}
CONFIGS = ((2, 1), (2, 4), (2, 8), (4, 8), (8, 8), (16, 8))
FP8_BLOCK = 128  # channels per float32 scale (deep_ep_jax.config.FP8_BLOCK)
VECTOR_BYTES = 16  # packets' pieces are 16-aligned (csrc/common/limits.h kVectorBytes)


@dataclasses.dataclass(frozen=True)
class Case:
    num_tokens: int = 4096
    hidden: int = 7168
    num_experts: int = 256
    topk: int = 8
    max_hosts: int | None = None  # node-limited routing: at most this many hosts per token (>= hosts: no limit)


@dataclasses.dataclass(frozen=True)
class Machine:
    # ConnectX-7 400 Gb/s, one per GPU: 50 GB/s each way at line rate.
    nic_gbs: float = 50.0
    # Large RDMA writes reach about 85-95% of line rate; assumed, not measured here.
    nic_efficiency: float = 0.9
    # H100/H200 NV18: 18 links x 25 GB/s = 450 GB/s per direction.
    nvlink_gbs: float = 450.0
    # What our single-host kernels reach per direction over NV18 in the
    # normal-mode benchmark (benchmarks/RESULTS.md, EP=2, 24 SMs; the formula's
    # figure counts the local half of the rows too), as a share of the links.
    nvlink_efficiency: float = 0.6
    # H200 HBM3e (H100: 3350 GB/s); reads and writes of copies and sums both count.
    hbm_gbs: float = 4800.0
    hbm_efficiency: float = 0.6  # assumed
    # The pipeline's chunk: chunk_tokens tokens of each of the channels (24 SMs as 12 channels).
    channels: int = 12
    chunk_tokens: int = 16
    # Per call: the count exchange (network round trips), flags and five launches; a guess.
    fixed_us: float = 30.0


def _align(n: int) -> int:
    return -(-n // VECTOR_BYTES) * VECTOR_BYTES


def check_case(case: Case, num_hosts: int, gpus_per_host: int):
    num_ranks = num_hosts * gpus_per_host
    if num_hosts < 1 or gpus_per_host < 1:
        raise ValueError(f"hosts and GPUs per host must be positive, got {num_hosts} x {gpus_per_host}")
    if case.num_experts % num_ranks:
        raise ValueError(f"num_experts {case.num_experts} is not a multiple of the {num_ranks} ranks")
    if not 1 <= case.topk <= case.num_experts:
        raise ValueError(f"topk {case.topk} must be in 1..num_experts {case.num_experts}")
    if case.hidden % FP8_BLOCK:
        raise ValueError(f"hidden {case.hidden} is not a multiple of {FP8_BLOCK} (FP8 scales)")
    if case.max_hosts is not None:
        if case.max_hosts < 1:
            raise ValueError(f"max_hosts {case.max_hosts} must be positive")
        if case.topk > min(case.max_hosts, num_hosts) * case.num_experts // num_hosts:
            raise ValueError(f"topk {case.topk} > the experts of {case.max_hosts} hosts")


def sample_routing(case: Case, num_hosts: int, gpus_per_host: int, seed: int = 0) -> np.ndarray:
    """Top-k expert ids [R, T, K], distinct per token: the k best of uniform
    random scores (with max_hosts: among the experts of the max_hosts hosts
    with the best scores)."""
    check_case(case, num_hosts, gpus_per_host)
    rng = np.random.default_rng(seed)
    num_ranks, per_host = num_hosts * gpus_per_host, case.num_experts // num_hosts
    idx = np.empty((num_ranks, case.num_tokens, case.topk), np.int32)
    for r in range(num_ranks):  # one GPU at a time: [T, E] scores stay small
        scores = rng.random((case.num_tokens, case.num_experts), dtype=np.float32)
        if case.max_hosts is not None and case.max_hosts < num_hosts:
            best = scores.reshape(case.num_tokens, num_hosts, per_host).max(-1)
            hosts = np.argpartition(-best, case.max_hosts - 1, axis=1)[:, : case.max_hosts]
            kept = np.zeros((case.num_tokens, num_hosts), bool)
            np.put_along_axis(kept, hosts, True, axis=1)
            scores = np.where(np.repeat(kept, per_host, axis=1), scores, -1.0)
        idx[r] = np.argpartition(-scores, case.topk - 1, axis=1)[:, : case.topk]
    return idx


@dataclasses.dataclass
class Traffic:
    """Rows a dispatch moves, from the routing: per GPU ([R] arrays) and in
    total over all tokens. Combine's paths are the reverse of these."""

    num_tokens: int  # per GPU
    tokens: int  # source tokens in all
    dest_ranks: int  # sum over tokens of destination ranks
    dest_hosts: int  # ... of destination hosts, the source's own included
    remote_hosts: int
    remote_ranks: int
    packets_sent: np.ndarray  # per source: (token, remote destination host) packets over the NIC
    packets_received: np.ndarray  # per forwarder
    direct_sent: np.ndarray  # per source: rows to the other GPUs of its host, over NVLink
    direct_received: np.ndarray
    forwarded_sent: np.ndarray  # per forwarder: rows of remote packets to the other GPUs of its host
    forwarded_received: np.ndarray
    self_rows: np.ndarray  # per GPU: rows a source keeps (it holds one of the token's experts)
    forwarder_own: np.ndarray  # per forwarder: rows of remote packets for itself
    remote_rows_by_source: np.ndarray  # per source: rows landing on other hosts
    staged: np.ndarray  # per source: tokens with a remote destination host (staged once for the NIC)

    @property
    def received(self) -> np.ndarray:
        """Rows landing on each GPU, local ones included (the formula's rows)."""
        return self.direct_received + self.forwarded_received + self.self_rows + self.forwarder_own


def traffic(idx: np.ndarray, gpus_per_host: int, num_experts: int) -> Traffic:
    """Counts the rows of a dispatch of routing idx [R, T, K] (ids outside
    0..E-1, such as -1, select nothing) across hosts of gpus_per_host GPUs."""
    num_ranks, num_tokens, _ = idx.shape
    if num_ranks % gpus_per_host or num_experts % num_ranks:
        raise ValueError(
            f"{num_ranks} ranks, {num_experts} experts: not hosts of {gpus_per_host} GPUs with as many experts each"
        )
    num_hosts, per_rank = num_ranks // gpus_per_host, num_experts // num_ranks
    per_gpu = (np.zeros(num_ranks, np.int64) for _ in range(10))
    t = Traffic(num_tokens, num_ranks * num_tokens, 0, 0, 0, 0, *per_gpu)
    tokens = np.arange(num_tokens)[:, None]
    for s in range(num_ranks):
        home, index = divmod(s, gpus_per_host)
        ids = idx[s]
        valid = (ids >= 0) & (ids < num_experts)
        in_rank = np.zeros((num_tokens, num_ranks + 1), bool)  # last column: invalid ids
        in_rank[tokens, np.where(valid, ids // per_rank, num_ranks)] = True
        in_rank = in_rank[:, :num_ranks]
        host_rows = in_rank.reshape(num_tokens, num_hosts, gpus_per_host).sum(-1)  # [T, H]
        in_host = host_rows > 0
        forwarder_gets = in_rank[:, index::gpus_per_host]  # [T, H]: the rank of index `index` on each host
        remote = np.arange(num_hosts) != home
        forwarders = np.arange(num_hosts) * gpus_per_host + index

        t.dest_ranks += int(in_rank.sum())
        t.dest_hosts += int(in_host.sum())
        t.remote_hosts += int(in_host[:, remote].sum())
        t.remote_ranks += int(host_rows[:, remote].sum())
        t.packets_sent[s] += in_host[:, remote].sum()
        t.packets_received[forwarders[remote]] += in_host[:, remote].sum(0)
        t.direct_sent[s] += (host_rows[:, home] - in_rank[:, s]).sum()
        t.forwarded_sent[forwarders[remote]] += (host_rows - forwarder_gets)[:, remote].sum(0)
        not_forwarder = np.arange(num_ranks) % gpus_per_host != index
        on_home = np.arange(num_ranks) // gpus_per_host == home
        rows = in_rank.sum(0)
        t.direct_received += np.where(on_home & not_forwarder, rows, 0)
        t.forwarded_received += np.where(~on_home & not_forwarder, rows, 0)
        t.self_rows[s] += in_rank[:, s].sum()
        t.forwarder_own[forwarders[remote]] += forwarder_gets[:, remote].sum(0)
        t.remote_rows_by_source[s] += host_rows[:, remote].sum()
        t.staged[s] += in_host[:, remote].any(1).sum()
    return t


def row_bytes(case: Case, op: str, gpus_per_host: int, combine_partials: str = "bf16") -> dict:
    """Bytes of one row on each path: "formula" (DeepEP's formula), "deepep"
    (DeepEP's RDMA count), "nic" (a network row), "nvlink" (an NVLink row,
    also what local copies move), "staged" (a packet staged for the NIC)."""
    hidden, topk = case.hidden, case.topk
    if op.startswith("dispatch"):
        fp8 = op == "dispatch_fp8"
        data, scales = (hidden, hidden // FP8_BLOCK * 4) if fp8 else (2 * hidden, 0)
        meta = 4 + 8 * topk  # source token, top-k ids and weights
        packet = _align(data) + _align(scales) + _align(meta)
        # A packet also carries its token's final rows on the G ranks there (one put per host).
        return {
            "formula": data + scales,
            "deepep": data + scales,
            "nic": packet + 4 * gpus_per_host,
            "nvlink": data + scales + meta,
            "staged": packet,
        }
    row = _align(2 * hidden) + _align(4 * topk)  # bf16 row and its top-k weights
    nic = row
    if op == "combine_bf16" and combine_partials == "f32":
        nic = _align(4 * hidden) + _align(4 * topk)
    elif combine_partials not in ("bf16", "f32"):
        raise ValueError(f"combine_partials must be bf16 or f32, got {combine_partials!r}")
    return {"formula": 2 * hidden, "deepep": 2 * hidden, "nic": nic, "nvlink": row, "staged": nic}


def _paths(t: Traffic, op: str, sizes: dict):
    """Rows per GPU ([R]) on each link path of op, its local memory bytes per
    GPU, and its serial steps (lists of paths that run together)."""
    nic, nvl = sizes["nic"], sizes["nvlink"]
    if op.startswith("dispatch"):
        rows = {
            "nic_send": t.packets_sent,
            "nic_recv": t.packets_received,
            "direct_send": t.direct_sent,
            "direct_recv": t.direct_received,
            "forward_send": t.forwarded_sent,
            "forward_recv": t.forwarded_received,
        }
        # Staging for the NIC, the rows written locally, then the copy out (read and write).
        hbm = t.staged * sizes["staged"] + (t.self_rows + t.forwarder_own) * nvl + 2 * t.received * nvl
        steps = [["nic", "direct"], ["forward"], ["hbm"]]
    elif op == "combine_bf16":
        # The transpose of dispatch: gather at the forwarders, one partial sum per packet back.
        rows = {
            "nic_send": t.packets_received,
            "nic_recv": t.packets_sent,
            "direct_send": t.direct_received,
            "direct_recv": t.direct_sent,
            "forward_send": t.forwarded_received,
            "forward_recv": t.forwarded_sent,
        }
        # The forwarder sums its host's rows and stages the partial; the source
        # sums its own host's rows and the partials into its T output rows.
        hbm = (
            (t.forwarded_sent + t.forwarder_own) * nvl
            + t.packets_received * nic
            + (t.direct_sent + t.self_rows) * nvl
            + t.packets_sent * nic
            + t.num_tokens * nvl
        )
        steps = [["direct", "forward"], ["nic"], ["hbm"]]
    else:  # combine per rank: every row from another host crosses the network unreduced
        from_remote = t.forwarded_received + t.forwarder_own  # rows a GPU holds of other hosts' tokens
        none = np.zeros_like(t.direct_sent)
        rows = {
            "nic_send": from_remote,
            "nic_recv": t.remote_rows_by_source,
            "direct_send": t.direct_received,
            "direct_recv": t.direct_sent,
            "forward_send": none,
            "forward_recv": none,
        }
        # Remote rows staged for the NIC; the source sums all its rows.
        hbm = (
            from_remote * nic + (t.direct_sent + t.self_rows) * nvl + t.remote_rows_by_source * nic + t.num_tokens * nvl
        )
        steps = [["nic", "direct"], ["hbm"]]
    return rows, hbm, steps


def model(
    t: Traffic, case: Case, machine: Machine, op: str, gpus_per_host: int, combine_partials: str = "bf16"
) -> dict:
    """Rows and bytes per GPU, stage times and bandwidths of op for the routing t counts."""
    sizes = row_bytes(case, op, gpus_per_host, combine_partials)
    rows, hbm, steps = _paths(t, op, sizes)
    nic = {k: rows[k] * sizes["nic"] for k in ("nic_send", "nic_recv")}
    nvl = {k: rows[k] * sizes["nvlink"] for k in rows if not k.startswith("nic")}
    nvl_send, nvl_recv = nvl["direct_send"] + nvl["forward_send"], nvl["direct_recv"] + nvl["forward_recv"]
    # Bytes of the slowest GPU on each resource (links: the larger direction).
    busiest = {
        "nic": np.maximum(nic["nic_send"], nic["nic_recv"]).max(),
        "nvlink": np.maximum(nvl_send, nvl_recv).max(),
        "hbm": hbm.max(),
    }
    part_bytes = {
        "nic": busiest["nic"],
        "hbm": busiest["hbm"],
        "direct": np.maximum(nvl["direct_send"], nvl["direct_recv"]).max(),
        "forward": np.maximum(nvl["forward_send"], nvl["forward_recv"]).max(),
    }
    line = {"nic": machine.nic_gbs, "nvlink": machine.nvlink_gbs, "hbm": machine.hbm_gbs}
    rate = {
        "nic": machine.nic_gbs * machine.nic_efficiency,
        "nvlink": machine.nvlink_gbs * machine.nvlink_efficiency,
        "hbm": machine.hbm_gbs * machine.hbm_efficiency,
    }
    resource_of = {"nic": "nic", "direct": "nvlink", "forward": "nvlink", "hbm": "hbm"}
    stage_us = {r: busiest[r] / rate[r] / 1e3 for r in busiest}  # bytes / (GB/s) / 1e3 = us

    def step_us(step):  # parts on one resource share it; different resources overlap
        return max(sum(part_bytes[p] for p in step if resource_of[p] == r) / rate[r] / 1e3 for r in rate)

    serial_us = sum(step_us(step) for step in steps)
    # Pipelined: the busiest resource all along, plus one chunk's time through
    # the other steps (fill and drain).
    chunks = max(1, math.ceil(t.num_tokens / (machine.channels * machine.chunk_tokens)))
    slowest = max(stage_us.values())
    pipelined_us = slowest + (serial_us - slowest) / chunks + machine.fixed_us
    serial_us += machine.fixed_us
    bound_us = max(busiest[r] / line[r] / 1e3 for r in busiest)

    num_ranks = len(t.received)
    formula = t.received.sum() / num_ranks * sizes["formula"]  # bytes per GPU
    deepep = t.dest_hosts / num_ranks * sizes["deepep"]
    nic_mean = nic["nic_send"].sum() / num_ranks

    def gbs(nbytes, us):
        return float(nbytes / us / 1e3)

    return {
        "op": op,
        "nic_rows": int(rows["nic_send"].sum()),  # over all GPUs
        "nvlink_rows": int((rows["direct_send"] + rows["forward_send"]).sum()),
        "nic_mb_per_gpu": float(nic_mean / 1e6),
        "nvlink_mb_per_gpu": float(nvl_send.sum() / num_ranks / 1e6),
        "hbm_mb_per_gpu": float(hbm.sum() / num_ranks / 1e6),
        "formula_mb_per_gpu": float(formula / 1e6),
        "nic_us": float(stage_us["nic"]),
        "nvlink_us": float(stage_us["nvlink"]),
        "hbm_us": float(stage_us["hbm"]),
        "bound_gbs": gbs(formula, bound_us),
        "serial_us": float(serial_us),
        "serial_gbs": gbs(formula, serial_us),
        "pipelined_us": float(pipelined_us),
        "pipelined_gbs": gbs(formula, pipelined_us),
        "pipelined_nic_gbs": gbs(nic_mean, pipelined_us),
        "pipelined_deepep_rdma_gbs": gbs(deepep, pipelined_us),
        "chunks": chunks,
    }


def per_token(t: Traffic) -> dict:
    return {
        "ranks": t.dest_ranks / t.tokens,
        "hosts": t.dest_hosts / t.tokens,
        "remote_hosts": t.remote_hosts / t.tokens,
        "remote_ranks": t.remote_ranks / t.tokens,
    }


def run(case: Case, machine: Machine, configs=CONFIGS, seed: int = 0, combine_partials: str = "bf16") -> list[dict]:
    """One entry per hosts x GPUs: routing statistics and every op's model."""
    results = []
    for num_hosts, gpus_per_host in configs:
        idx = sample_routing(case, num_hosts, gpus_per_host, seed)
        t = traffic(idx, gpus_per_host, case.num_experts)
        results.append(
            {
                "hosts": num_hosts,
                "gpus_per_host": gpus_per_host,
                "ranks": num_hosts * gpus_per_host,
                "per_token": per_token(t),
                "ops": [model(t, case, machine, op, gpus_per_host, combine_partials) for op in OPS],
            }
        )
    return results


def markdown(results: list[dict]) -> str:
    lines = [
        "| hosts x GPUs | ranks/token | hosts/token (own included) | remote hosts/token | remote ranks/token |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        c = r["per_token"]
        lines.append(
            f"| {r['hosts']} x {r['gpus_per_host']} | {c['ranks']:.2f} | {c['hosts']:.2f} | "
            f"{c['remote_hosts']:.2f} | {c['remote_ranks']:.2f} |"
        )
    header = (
        "| hosts x GPUs | op | NIC MB/GPU | NVLink MB/GPU | NIC / NVLink / memory us | bound GB/s | "
        "serial us (GB/s) | pipelined us (GB/s) | pipelined NIC GB/s | pipelined DeepEP RDMA GB/s |"
    )
    lines += ["", header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for o in r["ops"]:
            lines.append(
                f"| {r['hosts']} x {r['gpus_per_host']} | {OP_TITLES[o['op']]} | {o['nic_mb_per_gpu']:.0f} | "
                f"{o['nvlink_mb_per_gpu']:.0f} | {o['nic_us']:.0f} / {o['nvlink_us']:.0f} / {o['hbm_us']:.0f} | "
                f"{o['bound_gbs']:.0f} | {o['serial_us']:.0f} ({o['serial_gbs']:.0f}) | "
                f"{o['pipelined_us']:.0f} ({o['pipelined_gbs']:.0f}) | {o['pipelined_nic_gbs']:.1f} | "
                f"{o['pipelined_deepep_rdma_gbs']:.1f} |"
            )
    return "\n".join(lines)


def _config(text: str) -> tuple[int, int]:
    try:
        hosts, gpus = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOSTSxGPUS, e.g. 2x8") from None
    return hosts, gpus


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", type=_config, nargs="+", default=list(CONFIGS), help="HOSTSxGPUS, e.g. 2x8")
    parser.add_argument("--tokens", type=int, default=Case.num_tokens, help="tokens per GPU")
    parser.add_argument("--hidden", type=int, default=Case.hidden)
    parser.add_argument("--experts", type=int, default=Case.num_experts)
    parser.add_argument("--topk", type=int, default=Case.topk)
    parser.add_argument("--max-hosts", type=int, default=None, help="node-limited routing: hosts per token at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--combine-partials",
        choices=["bf16", "f32"],
        default="bf16",
        help="precision of the per-host partial sums on the network",
    )
    for field in dataclasses.fields(Machine):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=field.default)
    parser.add_argument("--json", nargs="?", const="-", default=None, help="JSON instead of markdown (to PATH)")
    args = parser.parse_args(argv)
    case = Case(args.tokens, args.hidden, args.experts, args.topk, args.max_hosts)
    machine = Machine(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Machine)})
    results = run(case, machine, args.configs, args.seed, args.combine_partials)
    if args.json is None:
        print(markdown(results))
        return
    text = json.dumps(
        {
            "case": dataclasses.asdict(case),
            "machine": dataclasses.asdict(machine),
            "seed": args.seed,
            "combine_partials": args.combine_partials,
            "results": results,
        },
        indent=1,
    )
    if args.json == "-":
        print(text)
    else:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
