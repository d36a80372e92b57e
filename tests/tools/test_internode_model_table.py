"""benchmarks/internode_model.py, the InfiniBand model of docs/internode.md:
its row counts against a plain walk over each token's destinations (every
top-k subset of a small group, and skewed routings), its sampled routing
against the exact expectations of that enumeration, monotonic sanity as hosts
grow, combine's network rows (one per remote destination host per token,
reduced per host; one per remote destination rank before), the time
arithmetic on a case worked by hand, and the command line. CPU, fast."""

import itertools
import json
import pathlib
import subprocess
import sys

import internode_model as im
import numpy as np
import pytest

from deep_ep_jax import testing

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"

COUNTS = (
    "packets_sent",
    "packets_received",
    "direct_sent",
    "direct_received",
    "forwarded_sent",
    "forwarded_received",
    "self_rows",
    "forwarder_own",
    "remote_rows_by_source",
    "staged",
)


def walk(idx, gpus_per_host, num_experts):
    """The same counts as im.traffic, token by token with sets: a packet per
    remote destination host to the rank of the sender's index there, which
    keeps its own row and forwards the others; own-host rows go directly."""
    num_ranks, num_tokens, _ = idx.shape
    per_rank = num_experts // num_ranks
    c = {name: np.zeros(num_ranks, np.int64) for name in COUNTS}
    totals = {"dest_ranks": 0, "dest_hosts": 0, "remote_hosts": 0, "remote_ranks": 0}
    for s in range(num_ranks):
        home, index = divmod(s, gpus_per_host)
        for t in range(num_tokens):
            dests = {int(e) // per_rank for e in idx[s, t] if 0 <= e < num_experts}
            hosts = {d // gpus_per_host for d in dests}
            remote = hosts - {home}
            totals["dest_ranks"] += len(dests)
            totals["dest_hosts"] += len(hosts)
            totals["remote_hosts"] += len(remote)
            totals["remote_ranks"] += sum(d // gpus_per_host != home for d in dests)
            c["staged"][s] += bool(remote)
            for b in remote:
                c["packets_sent"][s] += 1
                c["packets_received"][b * gpus_per_host + index] += 1
            for d in dests:
                host = d // gpus_per_host
                forwarder = host * gpus_per_host + index
                if d == s:
                    c["self_rows"][s] += 1
                elif host == home:
                    c["direct_sent"][s] += 1
                    c["direct_received"][d] += 1
                elif d == forwarder:
                    c["forwarder_own"][d] += 1
                else:
                    c["forwarded_sent"][forwarder] += 1
                    c["forwarded_received"][d] += 1
                if host != home:
                    c["remote_rows_by_source"][s] += 1
    return c, totals


def assert_counts_match(idx, gpus_per_host, num_experts):
    t = im.traffic(idx, gpus_per_host, num_experts)
    want, totals = walk(idx, gpus_per_host, num_experts)
    for name in COUNTS:
        np.testing.assert_array_equal(getattr(t, name), want[name], err_msg=name)
    for name, value in totals.items():
        assert getattr(t, name) == value, name
    assert t.received.sum() == t.dest_ranks  # every row lands once
    return t


def all_subsets(num_ranks, num_experts, topk, seed):
    """Every top-k expert set once per rank, in a fresh order per rank: [R, C(E, k), k]."""
    subsets = np.array(list(itertools.combinations(range(num_experts), topk)), np.int32)
    rng = np.random.default_rng(seed)
    return np.stack([subsets[rng.permutation(len(subsets))] for _ in range(num_ranks)])


@pytest.mark.parametrize(
    "num_hosts,gpus_per_host,num_experts,topk", [(2, 2, 8, 3), (2, 1, 6, 2), (3, 2, 12, 2), (2, 4, 8, 4)]
)
def test_counts_on_every_subset(num_hosts, gpus_per_host, num_experts, topk, rng):
    seed = int(rng.integers(1 << 30))
    idx = all_subsets(num_hosts * gpus_per_host, num_experts, topk, seed)
    assert_counts_match(idx, gpus_per_host, num_experts)


@pytest.mark.parametrize("kind", ["random", "one_expert", "rank_empty", "minus_one", "out_of_range"])
@pytest.mark.parametrize("num_hosts,gpus_per_host", [(2, 1), (2, 4), (3, 2), (4, 2)])
def test_counts_on_skewed_routing(kind, num_hosts, gpus_per_host, rng):
    num_ranks, num_tokens, num_experts, topk = num_hosts * gpus_per_host, 23, 4 * num_hosts * gpus_per_host, 3
    seed = int(rng.integers(1 << 30))
    idx, _ = testing.make_routing(seed, num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
    idx = np.asarray(idx).reshape(num_ranks, num_tokens, topk)
    t = assert_counts_match(idx, gpus_per_host, num_experts)
    if kind == "one_expert":  # everything to rank 0: its host's rows only
        assert t.received[1:].sum() == 0 and t.received[0] == num_ranks * num_tokens
    if kind == "rank_empty":
        assert t.received[-1] == 0


def exact_expectations(num_hosts, gpus_per_host, num_experts, topk):
    """Per-token means over every top-k subset and every source rank: what
    uniform routing gives in expectation."""
    idx = all_subsets(num_hosts * gpus_per_host, num_experts, topk, seed=0)
    _, totals = walk(idx, gpus_per_host, num_experts)
    return {k: v / idx.shape[0] / idx.shape[1] for k, v in totals.items()}


def test_sampled_routing_matches_the_enumeration(rng):
    case = im.Case(num_tokens=20000, hidden=128, num_experts=8, topk=3)
    seed = int(rng.integers(1 << 30))
    idx = im.sample_routing(case, 2, 2, seed)
    assert idx.min() >= 0 and idx.max() < case.num_experts
    assert (np.sort(idx, -1)[..., 1:] != np.sort(idx, -1)[..., :-1]).all()  # distinct experts per token
    got = im.per_token(im.traffic(idx, 2, case.num_experts))
    want = exact_expectations(2, 2, case.num_experts, case.topk)
    for key in ("ranks", "hosts", "remote_hosts", "remote_ranks"):  # 80000 tokens: standard errors < 0.005
        assert abs(got[key] - want["dest_" + key if key in ("ranks", "hosts") else key]) < 0.03, key


def test_node_limited_routing(rng):
    seed = int(rng.integers(1 << 30))
    one_host = im.per_token(im.traffic(im.sample_routing(im.Case(2000, 128, 8, 2, max_hosts=1), 4, 1, seed), 1, 8))
    assert one_host["hosts"] == 1.0
    assert abs(one_host["remote_hosts"] - 0.75) < 0.03  # the chosen host is uniform over 4
    idx = im.sample_routing(im.Case(500, 128, 64, 8, max_hosts=2), 8, 2, seed)
    hosts_per_token = [len({int(e) // 8 for e in token}) for token in idx.reshape(-1, 8)]
    assert max(hosts_per_token) == 2
    unlimited = im.per_token(im.traffic(im.sample_routing(im.Case(500, 128, 64, 8), 8, 2, seed), 2, 64))
    assert unlimited["hosts"] > 4  # the limit did something


def test_more_hosts_more_network_rows(rng):
    case, machine = im.Case(num_tokens=64), im.Machine()
    seed = int(rng.integers(1 << 30))
    results = im.run(case, machine, [(2, 8), (4, 8), (8, 8), (16, 8)], seed)
    remote_hosts = [r["per_token"]["remote_hosts"] for r in results]
    assert remote_hosts == sorted(remote_hosts) and len(set(remote_hosts)) == 4, remote_hosts
    for op in ("dispatch_bf16", "combine_bf16"):
        nic = [next(o for o in r["ops"] if o["op"] == op)["nic_mb_per_gpu"] for r in results]
        assert nic == sorted(nic) and len(set(nic)) == 4, (op, nic)
    for r in results:
        ops = {o["op"]: o for o in r["ops"]}
        # Reducing per host never sends more, and the FP8 rows are about half the bf16 ones.
        assert ops["combine_bf16"]["nic_rows"] < ops["combine_bf16_per_rank"]["nic_rows"]
        assert 0.45 < ops["dispatch_fp8"]["nic_mb_per_gpu"] / ops["dispatch_bf16"]["nic_mb_per_gpu"] < 0.6
        for o in r["ops"]:
            assert o["bound_gbs"] >= o["pipelined_gbs"] and o["pipelined_us"] <= o["serial_us"]
            assert o["pipelined_nic_gbs"] <= machine.nic_gbs * machine.nic_efficiency


@pytest.mark.parametrize("num_hosts,gpus_per_host", [(2, 2), (3, 2), (2, 8), (4, 4)])
def test_network_rows_per_token_are_remote_destinations(num_hosts, gpus_per_host, rng):
    """Dispatch and combine reduced per host: one network row per remote
    destination host of a token; combine per rank: one per remote destination
    rank; counted here straight from the routing."""
    num_ranks = num_hosts * gpus_per_host
    case = im.Case(num_tokens=31, hidden=256, num_experts=4 * num_ranks, topk=4)
    seed = int(rng.integers(1 << 30))
    idx, _ = testing.make_routing(seed, num_ranks * 31, case.num_experts, case.topk, num_ranks, "minus_one")
    idx = np.asarray(idx).reshape(num_ranks, 31, case.topk)
    t = im.traffic(idx, gpus_per_host, case.num_experts)
    per_rank = case.num_experts // num_ranks
    remote_hosts = remote_ranks = 0
    for s in range(num_ranks):
        for token in idx[s]:
            dests = {int(e) // per_rank for e in token if 0 <= e < case.num_experts}
            remote_hosts += len({d // gpus_per_host for d in dests} - {s // gpus_per_host})
            remote_ranks += sum(d // gpus_per_host != s // gpus_per_host for d in dests)
    rows = {op: im.model(t, case, im.Machine(), op, gpus_per_host)["nic_rows"] for op in im.OPS}
    assert rows["dispatch_bf16"] == rows["dispatch_fp8"] == rows["combine_bf16"] == remote_hosts
    assert rows["combine_bf16_per_rank"] == remote_ranks


def test_time_arithmetic_by_hand():
    """2 hosts of 1 GPU, every token to the other GPU's one expert: T rows each
    way over the NIC, nothing over NVLink."""
    num_tokens, hidden = 1000, 1024
    case = im.Case(num_tokens=num_tokens, hidden=hidden, num_experts=2, topk=1)
    idx = np.array([1, 0], np.int32)[:, None, None].repeat(num_tokens, 1)
    machine = im.Machine(
        nic_gbs=50, nic_efficiency=0.8, hbm_gbs=4000, hbm_efficiency=0.5, channels=10, chunk_tokens=25, fixed_us=7
    )
    o = im.model(im.traffic(idx, 1, 2), case, machine, "dispatch_bf16", 1)
    packet = 2 * hidden + 16 + 4  # row, 16-aligned metadata (4 + 8 bytes), one final row (G = 1)
    landing = 2 * hidden + 4 + 8
    nic_us = num_tokens * packet / (50e3 * 0.8)  # bytes / (bytes per us)
    # Staging, the forwarder's own row written locally, then the copy out (read and write).
    hbm_us = num_tokens * (packet - 4 + 3 * landing) / (4000e3 * 0.5)
    assert o["nic_rows"] == 2 * num_tokens and o["nvlink_rows"] == 0
    assert o["nic_mb_per_gpu"] == pytest.approx(num_tokens * packet / 1e6)
    assert o["nic_us"] == pytest.approx(nic_us) and o["hbm_us"] == pytest.approx(hbm_us)
    assert o["serial_us"] == pytest.approx(nic_us + hbm_us + 7)
    assert o["chunks"] == 4
    assert o["pipelined_us"] == pytest.approx(nic_us + hbm_us / 4 + 7)
    assert o["bound_gbs"] == pytest.approx(50 * 2 * hidden / packet)
    assert o["pipelined_gbs"] == pytest.approx(num_tokens * 2 * hidden / o["pipelined_us"] / 1e3)
    assert o["pipelined_deepep_rdma_gbs"] == pytest.approx(o["pipelined_gbs"])  # one host per token here


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"num_experts": 12}, "multiple of the 8 ranks"),
        ({"topk": 300}, "topk 300"),
        ({"hidden": 100}, "multiple of 128"),
        ({"max_hosts": 0}, "max_hosts 0"),
        ({"max_hosts": 1, "topk": 40}, "experts of 1 hosts"),
    ],
)
def test_bad_case(bad, match):
    case = im.Case(**{"num_tokens": 8, "num_experts": 64, "topk": 8, **bad})
    with pytest.raises(ValueError, match=match):
        im.sample_routing(case, 2, 4)


def test_bad_inputs():
    with pytest.raises(ValueError, match="not hosts of 3"):
        im.traffic(np.zeros((4, 2, 1), np.int32), 3, 8)
    with pytest.raises(ValueError, match="combine_partials"):
        im.row_bytes(im.Case(), "combine_bf16", 8, "fp16")


def test_command_line():
    common = [
        sys.executable,
        str(BENCHMARKS / "internode_model.py"),
        "--configs",
        "2x2",
        "3x2",
        "--tokens",
        "40",
        "--experts",
        "24",
        "--topk",
        "4",
    ]
    out = subprocess.run(common + ["--json"], check=True, capture_output=True, text=True).stdout
    data = json.loads(out)
    assert [(r["hosts"], r["gpus_per_host"]) for r in data["results"]] == [(2, 2), (3, 2)]
    assert all([o["op"] for o in r["ops"]] == list(im.OPS) for r in data["results"])
    f32 = subprocess.run(
        common + ["--json", "--combine-partials", "f32"], check=True, capture_output=True, text=True
    ).stdout
    bf16_rows = {o["op"]: o for o in data["results"][0]["ops"]}
    f32_rows = {o["op"]: o for o in json.loads(f32)["results"][0]["ops"]}
    assert f32_rows["combine_bf16"]["nic_mb_per_gpu"] > 1.9 * bf16_rows["combine_bf16"]["nic_mb_per_gpu"]
    table = subprocess.run(common, check=True, capture_output=True, text=True).stdout
    assert "| 3 x 2 | combine bf16, per host |" in table
    bad = subprocess.run(common[:2] + ["--configs", "2by8"], check=False, capture_output=True, text=True)
    assert bad.returncode != 0 and "HOSTSxGPUS" in bad.stderr


def test_docs_table_is_the_scripts_output():
    """docs/internode.md shows what `python benchmarks/internode_model.py` prints (seed 0)."""
    docs = (BENCHMARKS.parent / "docs" / "internode.md").read_text()
    table = im.markdown(im.run(im.Case(), im.Machine()))
    assert table in docs, "regenerate the table in docs/internode.md: python benchmarks/internode_model.py"
