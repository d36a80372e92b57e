"""One process of a multi-process test, started by deep_ep_jax.launch:

    python -m deep_ep_jax.launch -n 2 --cpu -- tests/multiprocess_worker.py reference exchange
    python -m deep_ep_jax.launch -n 2 -- tests/multiprocess_worker.py normal low_latency

Cases (run in the order given; each process prints "CASE <name> OK"):
  reference    xla backend across processes against tests/oracle.py (CPU or GPU)
  exchange     the key-value handle exchange, and its timeout naming the rank and key
  normal       CUDA normal mode vs the xla backend: the suite's core comparisons
  low_latency  CUDA low-latency mode vs the xla backend: the suite's core comparisons
  digest       prints a digest of dispatch/combine outputs for fixed inputs (determinism across deployments)
  kill         CUDA dispatch/combine in a loop; the last rank kills itself midway,
               the others must fail with the kernels' timeout message
  launch_mismatch  each process launches a different number of blocks (Config.num_sms):
               every rank must fail at once with the kernels' launch-mismatch message
               (one host: intranode kernels; with DEEP_EP_JAX_GPUS_PER_HOST=1: internode)
  hosts        the hostname exchange and the host decision (CPU or GPU)
  nvshmem_outcome  an NVSHMEM Buffer whose making fails on process 1 alone (stood in for): every
               process raises naming it; made on all, every process has it (CPU)
  shared_gpu   with launch --ranks-per-gpu K: CUDA normal and low-latency mode against
               tests/oracle.py, each process checking its own rank (no XLA collective:
               NCCL refuses two ranks on one GPU); with --cpu, the xla backend;
               SHARED_GPU_SIZE=standard: at DeepEP's standard sizes (low latency: whole
               calls and split halves)
               SHARED_GPU_MESH_ORDER=reversed: the mesh's ranks in reverse process order
  shared_gpu_dropless  with launch --ranks-per-gpu K: dropless_moe against tests/oracle.py and
               the worst-case layer, forward and gradients, 1 to several rounds
  wait_times   with launch --ranks-per-gpu K: rank 1 starts each low-latency dispatch and
               combine late; Buffer.wait_times() on every other rank shows it (CUDA), or
               zeros (--cpu, the xla backend)
  mesh_order   a Buffer under a shard_map over its mesh's devices in another order: every
               operation refused when lowered, every process (CPU or GPU; ranks may share one)
  shared_gpu_wrap  the same from just under the 2^31 and 2^32 wraps of the sequence
               numbers (staged one-host kernels, or internode ones across emulated hosts)
  shared_gpu_order independent round trips in one program (only the order chain orders
               them) against each run alone, each process its own rank; for
               XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT too
  shared_gpu_teardown  Buffers made, used (low latency last) and destroyed in a loop
               while peers still receive; every Buffer's results equal the first's
  shared_gpu_moe_layer  with launch --ranks-per-gpu K: the MoE layer's grouped path (bf16 and
               FP8) forward and gradients against dense maths, each process its own rank;
               with --cpu, the xla backend's
  internode_low_latency  with DEEP_EP_JAX_GPUS_PER_HOST=1 (every rank its own "host"):
               CUDA low-latency mode over NVSHMEM vs the xla backend
  large_ep_low_latency   with launch --ranks-per-gpu K --all-gpus-visible and
               DEEP_EP_JAX_GPUS_PER_HOST=8: CUDA low-latency mode at EP = the process
               count (beyond one host's 8 ranks), hosts of 8 emulated over NVSHMEM,
               each process checking its own rank as shared_gpu does
  internode_normal       with DEEP_EP_JAX_GPUS_PER_HOST=1: CUDA normal mode across hosts
               (internode kernels over NVSHMEM) vs the xla backend
  wrap         CUDA normal (staged) and low-latency mode across the sequence numbers'
               2^31 and 2^32 wraps vs the xla backend (tests/gpu/test_wrap_gpu.py)
  internode_wrap         with DEEP_EP_JAX_GPUS_PER_HOST=1: the same over NVSHMEM
  internode_handler_checks  with DEEP_EP_JAX_GPUS_PER_HOST=1: the internode FFI handlers,
               called past the Python wrapper, refuse shapes their kernels cannot take
  traffic      with launch --ranks-per-gpu K (and DEEP_EP_JAX_GPUS_PER_HOST): the kernels'
               traffic counters against tests/oracle.py, each process its own rank;
               with --cpu, the xla backend's
Results are gathered to every process (process_allgather), so the checks of
the single-process suites (tests/gpu/*) run unchanged.
"""

import functools
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE, os.path.join(HERE, "gpu")]

from deep_ep_jax import launch  # noqa: E402

launch.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import deep_ep_jax as dej  # noqa: E402
from deep_ep_jax import testing as dt  # noqa: E402
from deep_ep_jax.config import ROW_FORMATS  # noqa: E402
from deep_ep_jax.distributed import multiprocess, nvshmem, topology  # noqa: E402

AXIS = "ep"
_per_rank = dt.per_rank


class _Gathered:
    """A per-rank function whose outputs come back as numpy on every process."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return multihost_utils.process_allgather(self.fn(*args), tiled=True)

    def lower(self, *args):
        return self.fn.lower(*args)


def gathered_per_rank(fn, mesh, axis_name, *, jit=True, check_vma=False):
    return _Gathered(_per_rank(fn, mesh, axis_name, jit=jit, check_vma=check_vma))


# The single-process suites call testing.per_rank and read results with np.asarray.
dt.per_rank = gathered_per_rank


def log(message):
    print(f"process {jax.process_index()}/{jax.process_count()}: {message}", flush=True)


def _gpus_per_host(buffer):
    """G of the buffer's hosts (rank r on host r // G), as tests/oracle.py's combine takes it."""
    gpus_per_host = buffer.num_ranks // buffer.num_nodes
    assert buffer.rank_hosts == tuple(r // gpus_per_host for r in range(buffer.num_ranks)), buffer.rank_hosts
    return gpus_per_host


# Cases -------------------------------------------------------------------------


def case_reference():
    import oracle

    num_ranks = jax.device_count()
    mesh = dt.ep_mesh(num_ranks, AXIS)
    assert multiprocess.spans_processes(mesh.devices.flat), "the mesh should span processes"
    buffer = dej.Buffer(mesh, AXIS, backend="xla")
    num_tokens, hidden, topk, num_experts = 12, 64, 3, 4 * num_ranks

    def step(x, idx, w, y):
        recv_x, recv_idx, recv_w, handle = dej.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
        layout = dej.get_dispatch_layout(idx, num_experts=num_experts, buffer=buffer)
        out, out_w = dej.combine(y, handle, recv_w, buffer=buffer)
        return recv_x, recv_idx, recv_w, handle, layout, out, out_w

    run = dt.per_rank(step, mesh, AXIS)
    for seed, kind in enumerate(dt.ROUTING_KINDS):
        idx, w = dt.make_routing(seed, num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
        x = dt.random_rows(seed + 1, (num_ranks * num_tokens, hidden))
        y = dt.random_rows(seed + 2, (num_ranks * num_ranks * num_tokens, hidden))
        recv_x, recv_idx, recv_w, handle, layout, out, out_w = run(x, jnp.asarray(idx), jnp.asarray(w), y)

        def shards(a):
            a = np.asarray(jnp.asarray(a).astype(jnp.float32) if jnp.asarray(a).dtype == jnp.bfloat16 else a)
            return a.reshape((num_ranks, -1) + a.shape[1:])

        xs, idxs, ws, ys = shards(x), shards(idx), shards(w), shards(y)
        expected = oracle.dispatch(xs, idxs, ws, num_experts, num_ranks * num_tokens)
        for r in range(num_ranks):
            rows = expected[r]
            n = len(rows["x"])
            assert int(handle.num_recv_tokens[r]) == n == rows["total"], (kind, r)
            np.testing.assert_array_equal(np.asarray(recv_x[r, :n], np.float32), np.reshape(rows["x"], (n, hidden)))
            np.testing.assert_array_equal(recv_idx[r, :n], np.reshape(rows["idx"], (n, topk)))
            np.testing.assert_array_equal(recv_w[r, :n], np.reshape(rows["w"], (n, topk)))
            np.testing.assert_array_equal(handle.recv_src_idx[r, :n], rows["src"])
            np.testing.assert_array_equal(handle.recv_src_rank[r, :n], rows["rank"])
            assert (recv_idx[r, n:] == -1).all() and (handle.recv_src_rank[r, n:] == -1).all()
            per_rank, per_expert, in_rank = oracle.layout(idxs[r], num_experts, num_ranks)
            np.testing.assert_array_equal(layout[0][r], per_rank)
            np.testing.assert_array_equal(layout[1][r], per_expert)
            np.testing.assert_array_equal(layout[2][r], in_rank)
        want = oracle.combine(ys, expected, num_tokens, _gpus_per_host(buffer))
        np.testing.assert_array_equal(
            np.asarray(out, np.float32), np.asarray(jnp.asarray(want).astype(jnp.bfloat16), np.float32)
        )
        valid_w = np.where((idxs >= 0) & (idxs < num_experts), ws, 0)
        np.testing.assert_array_equal(np.asarray(out_w).reshape(valid_w.shape), valid_w)
        if kind == "rank_empty":
            assert int(handle.num_recv_tokens[-1]) == 0


def case_exchange():
    me, count = jax.process_index(), jax.process_count()
    name = f"{multiprocess.KEY_PREFIX}/test-exchange"
    payload = {(0, me): bytes([me, 0, 255]) * 50}
    others = {(0, p): p for p in range(count) if p != me}
    received = multiprocess.exchange(name, payload, others, timeout_s=30)
    assert received == {(0, p): bytes([p, 0, 255]) * 50 for p in range(count) if p != me}, received
    # A rank that never publishes: a timeout error naming it and its key.
    start = time.time()
    try:
        multiprocess.exchange(name, {}, {(3, 7): 5}, timeout_s=1.5)
    except TimeoutError as e:
        message = str(e)
    else:
        raise AssertionError("no timeout")
    assert "rank 7" in message and "process 5" in message and "/group/3/rank/7" in message, message
    assert time.time() - start < 30
    multiprocess.barrier(f"{name}/done", timeout_s=30)


def _gpu_mesh():
    gpus = jax.devices("gpu")
    assert len(gpus) >= 2 and len(jax.local_devices()) == 1, (gpus, jax.local_devices())
    return dt.ep_mesh(len(gpus), AXIS, platform="gpu")


def case_normal():
    import test_normal_gpu as suite

    mesh = _gpu_mesh()
    cuda = dej.Buffer(mesh, AXIS, backend="cuda")
    xla = dej.Buffer(mesh, AXIS, backend="xla")
    assert cuda.backend == "cuda" and cuda.ipc, cuda
    buffers = (cuda, xla)
    for kind in dt.ROUTING_KINDS:
        suite.test_matches_reference(mesh, buffers, kind)
        log(f"normal {kind}: ok")
    for kind in ("random", "one_expert", "minus_one"):
        suite.test_fp8_pairs(mesh, buffers, kind)
        log(f"normal fp8 {kind}: ok")
    suite.test_topk_range(mesh, buffers)
    cuda.destroy()


def case_low_latency():
    import test_low_latency_gpu as suite

    from deep_ep_jax.backends.cuda import sizes

    mesh = _gpu_mesh()
    num_ranks = mesh.shape[AXIS]
    region = sizes.low_latency_region_bytes(
        num_ranks, suite.MAX_EXPERTS, suite.MAX_HIDDEN, suite.MAX_TOKENS, num_topk=suite.MAX_TOPK
    )
    cuda = dej.Buffer(
        mesh,
        AXIS,
        backend="cuda",
        low_latency_mode=True,
        num_max_dispatch_tokens_per_rank=suite.MAX_TOKENS,
        num_nvl_bytes=1 << 20,
        num_rdma_bytes=region,
    )
    xla = dej.Buffer(
        mesh, AXIS, backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=suite.MAX_TOKENS
    )
    assert cuda.backend == "cuda" and cuda.ipc, cuda
    buffers = (cuda, xla)
    for use_fp8 in (True, False):
        for kind in dt.ROUTING_KINDS:
            suite.test_matches_reference(mesh, buffers, kind, use_fp8)
            log(f"low-latency {kind} fp8={use_fp8}: ok")
    suite.test_many_calls_in_fori_loop(mesh, buffers)
    log("low-latency fori_loop: ok")
    cuda.destroy()


def case_digest():
    import test_reliability_gpu as suite

    print(f"DIGEST {suite.outputs_digest(_gpu_mesh())}", flush=True)


def case_kill():
    """The last rank dies after a few calls; the others must fail within the
    timeout with the kernels' message naming rank, mode and counter."""
    mesh = _gpu_mesh()
    num_ranks, num_tokens, num_experts = mesh.shape[AXIS], 256, 16
    buffer = dej.Buffer(mesh, AXIS, backend="cuda", config=dej.Config(timeout_s=3))
    idx, w = dt.make_routing(0, num_ranks * num_tokens, num_experts, 2, num_ranks)
    x = dt.random_rows(1, (num_ranks * num_tokens, 1024))

    def roundtrip(x, idx, w):
        recv_x, _, recv_w, handle = dej.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
        out, _ = dej.combine(recv_x, handle, recv_w, buffer=buffer)
        return out

    run = _per_rank(roundtrip, mesh, AXIS)  # not gathered: the loop must not meet in collectives
    victim = jax.process_count() - 1
    idx, w = jnp.asarray(idx), jnp.asarray(w)
    try:
        for i in range(1000):
            if i == 5 and jax.process_index() == victim:
                log("killing myself")
                os.kill(os.getpid(), signal.SIGKILL)
            jax.block_until_ready(run(x, idx, w))
    except Exception as e:  # the kernels' trap surfaces as an XLA runtime error
        _exit_after_trap(f"failed as expected after {i} calls: {type(e).__name__}: {str(e)[:500]}")
    log("NO TIMEOUT")


def _exit_after_trap(message, wait_for_peers=None):
    """Logs, then exits with status 17, skipping jax.distributed's shutdown
    barrier, which would wait for dead or trapped processes; flushes C stdio
    first (the kernels' printf goes through it). With wait_for_peers (a
    barrier name), it first waits up to 60 s for every process to get this
    far: process 0 hosts the coordination service, and a process that leaves
    early makes the service abort the others before they can report (the
    processes' traps surface at different times)."""
    import ctypes

    log(message)
    ctypes.CDLL(None).fflush(None)
    if wait_for_peers:
        try:
            multiprocess.barrier(wait_for_peers, 60)
        except TimeoutError as e:
            log(str(e))
    os._exit(17)


def case_launch_mismatch():
    """Peers wait for each other's blocks by index, so every rank must launch
    the same grid. Here each process asks for another Config.num_sms: the
    first call must fail on every rank with the kernels' message naming both
    counts and ranks, well before the timeout."""
    from deep_ep_jax.backends.cuda import sizes

    mesh = _gpu_mesh()
    num_ranks, num_tokens, num_experts, hidden = mesh.shape[AXIS], 64, 4 * mesh.shape[AXIS], 512
    config = dej.Config(num_sms=4 + 2 * jax.process_index(), timeout_s=60)
    kwargs = {}
    if config.gpus_per_host == 1:  # emulated hosts: the internode kernels
        kwargs["num_nvl_bytes"] = sizes.internode_region_bytes(num_ranks, num_ranks, hidden, num_tokens)
    buffer = dej.Buffer(mesh, AXIS, backend="cuda", config=config, **kwargs)
    log(f"buffer {buffer}, num_sms {config.num_sms}")
    idx, w = dt.make_routing(0, num_ranks * num_tokens, num_experts, 2, num_ranks)
    x = dt.random_rows(1, (num_ranks * num_tokens, hidden))

    def roundtrip(x, idx, w):
        recv_x, _, recv_w, handle = dej.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
        out, _ = dej.combine(recv_x, handle, recv_w, buffer=buffer)
        return out

    run = _per_rank(roundtrip, mesh, AXIS)  # not gathered: the failing call must not meet in collectives
    start = time.time()
    try:
        jax.block_until_ready(run(x, jnp.asarray(idx), jnp.asarray(w)))
    except Exception as e:  # the kernels' trap surfaces as an XLA runtime error
        _exit_after_trap(
            f"failed as expected after {time.time() - start:.1f} s: {type(e).__name__}: {str(e)[:300]}",
            wait_for_peers="deep_ep_jax/test/launch_mismatch/reported",
        )
    log("NO LAUNCH MISMATCH ERROR")


def _one_rank_per_process():
    """(platform, R, mesh, this process's rank, rng): every process holds one
    device; the rng is seeded alike in every process (by the coordinator's
    port), so each makes the same global inputs and checks its own rank."""
    platform = "gpu" if jax.default_backend() == "gpu" else "cpu"
    num_ranks = jax.device_count()
    assert len(jax.local_devices()) == 1, jax.local_devices()
    mesh = dt.ep_mesh(num_ranks, AXIS, platform=platform)
    if os.environ.get("SHARED_GPU_MESH_ORDER") == "reversed":  # ranks in another order than the processes'
        mesh = jax.sharding.Mesh(mesh.devices[::-1], (AXIS,))
        log(f"mesh in reverse process order: device ids {[d.id for d in mesh.devices.flat]}")
    rank = [d.process_index for d in mesh.devices.flat].index(jax.process_index())
    rng = np.random.default_rng(int(os.environ[launch.COORDINATOR_VAR].rsplit(":", 1)[1]))
    return platform, num_ranks, mesh, rank, rng


def _shared_buffer(platform, mesh, hidden, num_experts, ll_tokens=None, **config):
    """The Buffer of a case whose processes may share GPUs: the CUDA backend
    (the xla one with launch --cpu), waits long enough for time-sliced peers;
    low-latency mode too with ll_tokens (tokens per rank); `config`: more
    Config fields."""
    low_latency = dict(low_latency_mode=True, num_max_dispatch_tokens_per_rank=ll_tokens) if ll_tokens else {}
    return dej.Buffer(
        mesh,
        AXIS,
        backend="cuda" if platform == "gpu" else "xla",
        hidden=hidden,
        num_experts=num_experts,
        config=dej.Config(**{"timeout_s": 150, **config}),
        **low_latency,
    )


def _own_rank_io(mesh, name, timeout_s):
    """(put, run) for cases where processes share GPUs and nothing may cross
    processes (NCCL refuses two ranks on one GPU): put(a) makes a global array
    of which each process fills its own shard; run(fn, *args) runs fn per rank
    (compiled once per fn) after a barrier, so no kernel waits on a peer that
    is still compiling, and returns this rank's block of each output ([R, ...]
    outputs; bf16 and FP8 as float32)."""
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(mesh, PartitionSpec(AXIS))
    barriers = iter(range(1 << 30))
    compiled = {}

    def put(a):
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    def mine(a):
        a = np.asarray(a.addressable_shards[0].data)[0]
        return a.astype(np.float32) if a.dtype.name in ("bfloat16", "float8_e4m3fn") else a

    def run(fn, *args):
        if fn not in compiled:
            compiled[fn] = jax.jit(_per_rank(fn, mesh, AXIS, jit=False)).lower(*args).compile()
        multiprocess.barrier(f"deep_ep_jax/test/{name}/{next(barriers)}", timeout_s)
        return jax.tree.map(mine, compiled[fn](*args))

    return put, run


def _assert_low_latency_sources(handle, e, slots, what):
    """Expert e's first len(slots) slots of a low-latency handle hold the
    oracle's (source rank, token, k) in order; returns (ranks, tokens)."""
    n = len(slots)
    s, t, k = (np.array(v) for v in zip(*slots))
    np.testing.assert_array_equal(handle.recv_src_rank[e, :n], s, err_msg=what)
    np.testing.assert_array_equal(handle.recv_src_token[e, :n], t, err_msg=what)
    np.testing.assert_array_equal(handle.recv_src_topk[e, :n], k, err_msg=what)
    return s, t


def _assert_low_latency_combine(out, y, expected, idxs, ws, rank, what):
    """This rank's low-latency combine output equals tests/oracle.py's, bit for
    bit: y [E, R * T, H] the experts' rows, idxs and ws [R, T, K]."""
    import oracle

    num_experts, num_ranks = y.shape[0], idxs.shape[0]
    ys = y.reshape(num_ranks, num_experts // num_ranks, *y.shape[1:])  # the oracle reads rows as float32
    combined = oracle.low_latency_combine(ys, expected, idxs, ws, num_experts)[rank]
    np.testing.assert_array_equal(out, combined.astype(jnp.bfloat16).astype(np.float32), err_msg=what)


def case_shared_gpu(sequence_starts=(None,)):
    """Launched with --ranks-per-gpu K (several processes per GPU): the CUDA
    backend's normal mode (bf16 and an FP8 pair) and low-latency mode (whole
    calls and split halves) against tests/oracle.py. XLA's collectives across
    processes go through NCCL, which refuses two ranks on one GPU, so nothing
    here gathers: every process makes the same global inputs (seeded by the
    launch's coordinator port) and checks its own rank. Combine's input rows past each rank's received rows
    are NaN, so a row read that must not be shows. On CPU (launch --cpu) it
    runs the xla backend, to check the case itself. sequence_starts: run
    every check once per start, the Buffer's sequence numbers set there first
    (tests/gpu/test_wrap_gpu.py's hook; None: as created).

    Sizes: small by default, SHARED_GPU_TOKENS tokens per rank (more: e.g.
    several chunks per channel of the pipelined dispatch); with
    SHARED_GPU_SIZE=standard, DeepEP's standard case: 4096 tokens per rank,
    hidden 7168, top-8, 256 experts (low-latency mode: 128 tokens per rank)."""
    import oracle

    platform, num_ranks, mesh, rank, rng = _one_rank_per_process()
    size = os.environ.get("SHARED_GPU_SIZE", "small")
    if size == "standard":
        num_tokens, hidden, topk, num_experts, ll_tokens = 4096, 7168, 8, 256, 128
    elif size == "small":
        num_tokens = int(os.environ.get("SHARED_GPU_TOKENS", "8"))
        hidden, topk, num_experts, ll_tokens = 256, 4, 4 * num_ranks, num_tokens
    else:
        raise ValueError(f"SHARED_GPU_SIZE={size!r}: 'small' or 'standard'")
    log(
        f"shared_gpu sizes: {num_tokens} tokens per rank, hidden {hidden}, top-{topk}, {num_experts} experts, "
        f"low-latency {ll_tokens} tokens per rank"
    )
    # Kernels of the processes of one GPU take turns: waits for a peer last long.
    buffer = _shared_buffer(platform, mesh, hidden, num_experts, ll_tokens)
    if buffer.backend == "cuda":  # DEEP_EP_JAX_GPUS_PER_HOST below R: internode kernels; else one node's
        assert buffer.num_nvl_bytes > 0, "normal mode serves the group"
        log(
            f"shared_gpu R={num_ranks} on {buffer.num_nodes} hosts: normal region {buffer.num_nvl_bytes} bytes, "
            f"peer memory {buffer.peer_memory}"
        )
    gpus_per_host = _gpus_per_host(buffer)
    put, run = _own_rank_io(mesh, "shared_gpu", buffer.config.timeout_s)

    def routing(kind, tokens=num_tokens):
        idx, w = dt.make_routing(int(rng.integers(1 << 30)), num_ranks * tokens, num_experts, topk, num_ranks, kind)
        return idx, w, idx.reshape(num_ranks, tokens, topk), w.reshape(num_ranks, tokens, topk)

    def bf16_rows(shape, wide=False):
        # wide: half the values +-2^24, which cancel in sums, so that a sum in another order comes out different.
        a = rng.standard_normal(shape, np.float32)
        if wide:
            a = np.where(rng.random(shape) < 0.5, np.sign(a) * np.float32(1 << 24), a)
        return a.astype(jnp.bfloat16)

    def rows_then_nan(shape, counts):
        """Combine's input of the given [..., rows, H] shape: the first counts[i] rows of block i fresh (wide),
        NaN past them."""
        y = np.full(shape, np.nan, jnp.bfloat16)
        blocks = y.reshape((-1,) + shape[-2:])
        for block, n in zip(blocks, np.ravel(counts)):
            block[:n] = bf16_rows((n, shape[-1]), True)
        return y

    def normal(x, idx, w, y):
        recv_x, recv_idx, recv_w, handle = dej.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
        out, out_w = dej.combine(y, handle, recv_w, buffer=buffer)
        return recv_x, recv_idx, recv_w, handle.recv_src_idx, handle.recv_src_rank, handle.num_recv_tokens, out, out_w

    for start in sequence_starts:
        if start is not None and buffer.backend == "cuda":  # the xla backend counts no calls
            from test_wrap_gpu import start_sequence_at

            start_sequence_at(buffer, start)
            log(f"shared_gpu from sequence number {start % 2**32}")
        for kind in dt.ROUTING_KINDS:
            idx, w, idxs, ws = routing(kind)
            x = bf16_rows((num_ranks * num_tokens, hidden))
            expected = oracle.dispatch(
                x.astype(np.float32).reshape(num_ranks, num_tokens, hidden),
                idxs,
                ws,
                num_experts,
                num_ranks * num_tokens,
            )
            y = rows_then_nan((num_ranks, num_ranks * num_tokens, hidden), [len(e["x"]) for e in expected])
            recv_x, recv_idx, recv_w, src, src_rank, num_recv, out, out_w = run(
                normal, *map(put, (x, idx, w, y.reshape(-1, hidden)))
            )
            want, n = expected[rank], len(expected[rank]["x"])
            assert int(num_recv) == n, (kind, int(num_recv), n)
            np.testing.assert_array_equal(recv_x[:n], np.reshape(want["x"], (n, hidden)), err_msg=kind)
            np.testing.assert_array_equal(recv_idx[:n], np.reshape(want["idx"], (n, topk)), err_msg=kind)
            np.testing.assert_array_equal(recv_w[:n], np.reshape(want["w"], (n, topk)), err_msg=kind)
            np.testing.assert_array_equal(src[:n], want["src"], err_msg=kind)
            np.testing.assert_array_equal(src_rank[:n], want["rank"], err_msg=kind)
            # Combine: per host (the buffer's hosts), then the hosts in order.
            combined = oracle.combine(y, expected, num_tokens, gpus_per_host)[rank]  # reads rows as float32
            np.testing.assert_array_equal(out, combined.astype(jnp.bfloat16).astype(np.float32), err_msg=kind)
            w_rows = np.zeros((num_ranks, num_ranks * num_tokens, topk), np.float32)
            for r in range(num_ranks):
                w_rows[r, : len(expected[r]["w"])] = np.reshape(expected[r]["w"], (-1, topk))
            np.testing.assert_array_equal(
                out_w,
                oracle.combine(w_rows, expected, num_tokens, gpus_per_host, bf16_partials=False)[rank],
                err_msg=kind,
            )
            if kind == "rank_empty" and rank == num_ranks - 1:
                assert n == 0
            log(f"shared_gpu normal {kind}: ok")

        def combine_grad(x, idx, w, y, ct):  # combine's backward: a cached dispatch of the cotangent
            _, _, _, handle = dej.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)

            def loss(y):
                return (dej.combine(y, handle, buffer=buffer).astype(jnp.float32) * ct).sum()

            return jax.grad(loss)(y), handle.num_recv_tokens

        for kind in ("random", "rank_empty"):
            idx, w, idxs, ws = routing(kind)
            x, y = bf16_rows((num_ranks * num_tokens, hidden)), bf16_rows((num_ranks * num_ranks * num_tokens, hidden))
            ct = bf16_rows((num_ranks * num_tokens, hidden)).astype(np.float32)  # exact in bf16: moved as they are
            grad_y, num_recv = run(combine_grad, *map(put, (x, idx, w, y, ct)))
            want = oracle.dispatch(
                ct.reshape(num_ranks, num_tokens, hidden), idxs, ws, num_experts, num_ranks * num_tokens
            )[rank]
            n = len(want["x"])
            assert int(num_recv) == n, (kind, int(num_recv), n)
            np.testing.assert_array_equal(grad_y[:n], np.reshape(want["x"], (n, hidden)), err_msg=kind)
            assert n == 0 or np.abs(grad_y[:n]).sum() > 0, kind
            log(f"shared_gpu cached dispatch (combine's gradient) {kind}: ok")

        def dispatch_pair(data, scales, idx, w):
            (recv_data, recv_scales), _, _, handle = dej.dispatch(
                (data, scales), idx, w, num_experts=num_experts, buffer=buffer
            )
            return recv_data, recv_scales, handle.num_recv_tokens

        for kind in ("random", "one_expert"):
            idx, w, idxs, ws = routing(kind)
            data = (rng.standard_normal((num_ranks * num_tokens, hidden), np.float32) * 8).astype(jnp.float8_e4m3fn)
            scales = rng.random((num_ranks * num_tokens, hidden // 128), np.float32) + 0.5
            recv_data, recv_scales, num_recv = run(dispatch_pair, *map(put, (data, scales, idx, w)))
            both = np.concatenate([data.astype(np.float32), scales], -1).reshape(num_ranks, num_tokens, -1)
            want = oracle.dispatch(both, idxs, ws, num_experts, num_ranks * num_tokens)[rank]["x"]
            n = len(want)
            assert int(num_recv) == n, (kind, int(num_recv), n)
            got = np.concatenate([recv_data[:n], recv_scales[:n]], -1)
            np.testing.assert_array_equal(got, np.reshape(want, (n, both.shape[-1])), err_msg=kind)
            log(f"shared_gpu fp8 {kind}: ok")

        for fmt in ROW_FORMATS[1:]:  # MXFP8, NVFP4 (float4 and packed): every byte random, moved as it is

            def dispatch_fmt(data, scales, idx, w, fmt=fmt):
                """The received pair as its bytes (run() would show FP8 as float32), in the dtypes sent. float4
                data comes packed (a compiled program takes float4 arguments in XLA's packed layout only)."""
                if fmt.data == jnp.float4_e2m1fn:
                    data = jax.lax.bitcast_convert_type(data, fmt.data).reshape(data.shape[0], -1)
                recv_data, recv_scales, num_recv = dispatch_pair(data, scales, idx, w)
                assert (recv_data.dtype, recv_scales.dtype) == (fmt.data, fmt.scales), fmt
                if fmt.data == jnp.float4_e2m1fn:  # two to a byte, as oracle.pair_bytes packs them
                    recv_data = recv_data.reshape(recv_data.shape[0], -1, 2)
                as_bytes = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(a.shape[0], -1)
                return jnp.concatenate([as_bytes(recv_data), as_bytes(recv_scales)], -1), num_recv

            for kind in ("random", "one_expert", "minus_one"):
                idx, w, idxs, ws = routing(kind)
                pair = dt.random_pair(int(rng.integers(1 << 30)), fmt, num_ranks * num_tokens, hidden)
                both = oracle.pair_bytes(*pair)
                if fmt.data == jnp.float4_e2m1fn:  # sent as its packed bytes (dispatch_fmt)
                    pair = (both[:, : hidden // 2], pair[1])
                got, num_recv = run(dispatch_fmt, *map(put, (*pair, idx, w)))
                both = both.reshape(num_ranks, num_tokens, -1)
                want = oracle.dispatch(both, idxs, ws, num_experts, num_ranks * num_tokens)[rank]["x"]
                n = len(want)
                assert int(num_recv) == n, (fmt.name, kind, int(num_recv), n)
                want = np.reshape(np.asarray(want, np.uint8), (n, got.shape[-1]))
                dt.assert_bits_equal(got[:n], want, f"{fmt.name} {kind}")
                log(f"shared_gpu {fmt.name} {kind}: ok")

        ll_modes = [(fp8, False, split) for fp8 in (False, True) for split in (False, True)] + [(True, True, False)]
        for use_fp8, mxfp8, split in ll_modes:

            def low_latency(x, idx, w, y, use_fp8=use_fp8, mxfp8=mxfp8, split=split):
                kwargs = dict(
                    buffer=buffer,
                    num_experts=num_experts,
                    num_max_dispatch_tokens_per_rank=ll_tokens,
                    use_fp8=use_fp8,
                    mxfp8=mxfp8,
                )
                if split:  # the send and receive halves
                    pending = dej.low_latency_dispatch_send(x, idx, **kwargs)
                    recv_x, count, handle = dej.low_latency_dispatch_recv(pending, buffer=buffer)
                    pending = dej.low_latency_combine_send(y, idx, w, handle, buffer=buffer)
                    return recv_x, count, handle, dej.low_latency_combine_recv(pending, buffer=buffer)
                recv_x, count, handle = dej.low_latency_dispatch(x, idx, **kwargs)
                return recv_x, count, handle, dej.low_latency_combine(y, idx, w, handle, buffer=buffer)

            for kind in ("random", "one_expert", "rank_empty", "minus_one"):
                idx, _, idxs, _ = routing(kind, ll_tokens)
                w = rng.choice(np.float32([0.5, 1, 2]), idx.shape)  # exact products: the sum's order shows
                ws = w.reshape(idxs.shape)
                x = bf16_rows((num_ranks * ll_tokens, hidden))
                xs = x.astype(np.float32).reshape(num_ranks, ll_tokens, hidden)
                expected = oracle.low_latency_dispatch(xs, idxs, num_experts, ll_tokens)
                y = rows_then_nan(
                    (num_experts, num_ranks * ll_tokens, hidden),
                    [len(slots) for experts in expected for slots in experts],
                )
                recv_x, count, handle, out = run(low_latency, *map(put, (x, idx, w, y)))
                rows = recv_x[0].astype(np.float32) if use_fp8 else recv_x
                for e, slots in enumerate(expected[rank]):
                    n, what = len(slots), f"{kind} fp8={use_fp8} mxfp8={mxfp8} split={split} expert {e}"
                    assert int(count[e]) == n, (what, int(count[e]), n)
                    if not n:
                        continue
                    s, t = _assert_low_latency_sources(handle, e, slots, what)
                    if use_fp8:  # scales exact; values as test_oracle_gpu.py bounds the kernels' 1 / scale
                        block = oracle.MXFP8_BLOCK if mxfp8 else oracle.FP8_BLOCK
                        scales = oracle.fp8_scales(xs[s, t], mxfp8, block)
                        got_scales = np.asarray(recv_x[1][e, :n].astype(np.float32))
                        np.testing.assert_array_equal(got_scales, scales, err_msg=what)
                        low, high = (oracle.fp8_values(xs[s, t], scales, ulps, block) for ulps in (-2, 2))
                        got = rows[e, :n]
                        assert ((np.minimum(low, high) <= got) & (got <= np.maximum(low, high))).all(), what
                    else:
                        np.testing.assert_array_equal(rows[e, :n], xs[s, t], err_msg=what)
                _assert_low_latency_combine(out, y, expected, idxs, ws, rank, kind)
                log(f"shared_gpu low-latency {kind} fp8={use_fp8} mxfp8={mxfp8} split={split}: ok")
    buffer.destroy()


def case_shared_gpu_moe_layer():
    """Launched with --ranks-per-gpu K: the MoE layer's grouped path across
    processes (examples/moe_layer.py's moe_ffn, expert_impl="grouped":
    dispatch_expert_major, grouped_matmul, grouped_matmul_reduce, combine),
    in bf16 and with the weights' FP8 copies (rows sent as FP8, every matmul
    on FP8 operands, FP8 weight gradients), forward and the gradients of x,
    the weights and the experts, each process checking its own rank against
    dense float32 maths of the whole layer (tests/test_example.py's
    dense_moe) on its CPU: bf16 within 3% of the largest value, FP8 within
    10% as a norm. Fresh routing, one expert for every token (a group past
    the FP8 weight gradient's promotion threshold), a rank that receives
    nothing, -1 entries. With launch --cpu, the xla backend and ragged_dot."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    import moe_layer as ml
    from test_example import _assert_close, _dense_and_grads, output_and_grads

    platform, num_ranks, mesh, rank, rng = _one_rank_per_process()
    # 640 tokens in all: with every token on one expert, its group (640 rows) is promoted in the FP8 dw.
    tokens, topk, num_experts = 640 // num_ranks, 4, 4 * num_ranks
    hidden, ffn = (1024, 512) if platform == "gpu" else (256, 128)  # on CPU: the case's checks, quickly
    buffer = _shared_buffer(platform, mesh, hidden, num_experts)
    put, run = _own_rank_io(mesh, "shared_gpu_moe_layer", buffer.config.timeout_s)
    alignment = ml.default_expert_alignment()
    mine = slice(rank * tokens, (rank + 1) * tokens)
    local = slice(rank * num_experts // num_ranks, (rank + 1) * num_experts // num_ranks)
    w_in = (rng.standard_normal((num_experts, hidden, 2 * ffn), np.float32) * hidden**-0.5).astype(jnp.bfloat16)
    w_out = (rng.standard_normal((num_experts, ffn, hidden), np.float32) * ffn**-0.5).astype(jnp.bfloat16)

    def layer(fp8):
        def fn(x, idx, weights, w_in, w_out, probe):
            def layer(x, weights, w_in, w_out):
                copies = ml.fp8_expert_weights(w_in, w_out) if fp8 else None
                return ml.moe_ffn(
                    x,
                    idx,
                    weights,
                    w_in,
                    w_out,
                    buffer=buffer,
                    num_experts=num_experts,
                    expert_impl="grouped",
                    expert_alignment=alignment,
                    fp8=copies,
                )

            y, grads = output_and_grads(layer, (x, weights, w_in, w_out), probe)
            return (y, *grads)

        return fn

    layers = {fp8: layer(fp8) for fp8 in (False, True)}  # one compile each, reused by every routing
    for kind in ("random", "one_expert", "rank_empty", "minus_one"):
        idx, weights = dt.make_routing(
            int(rng.integers(1 << 30)), num_ranks * tokens, num_experts, topk, num_ranks, kind
        )
        x = rng.standard_normal((num_ranks * tokens, hidden), np.float32).astype(jnp.bfloat16)
        probe = rng.standard_normal((num_ranks * tokens, hidden), np.float32)
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            y, grads = _dense_and_grads(
                x.astype(np.float32), idx, weights, w_in.astype(np.float32), w_out.astype(np.float32), probe
            )
        want = [
            np.asarray(a, np.float32)
            for a in (y[mine], grads[0][mine], grads[1][mine], grads[2][local], grads[3][local])
        ]
        for fp8, fn in layers.items():
            got = run(fn, *map(put, (x, idx, weights, w_in, w_out, probe)))
            errors = []
            for name, g, w in zip(("y", "grad x", "grad weights", "grad w_in", "grad w_out"), got, want):
                what = f"{kind} fp8={fp8}: {name}"
                g = np.asarray(g, np.float32)
                if fp8:  # FP8 operands (3 mantissa bits): a few percent off as a norm
                    assert np.isfinite(g).all(), f"{what}: non-finite values"
                    errors.append(np.linalg.norm(g - w) / (np.linalg.norm(w) + 1e-30))
                    assert errors[-1] <= 0.1, f"{what}: relative error {errors[-1]:.3g}"
                else:  # of the largest value
                    errors.append(_assert_close(g, w, what, rel=3e-2))
            log(
                f"shared_gpu_moe_layer {kind} fp8={fp8}: ok (errors of y and the 4 gradients: "
                f"{', '.join(f'{e:.2g}' for e in errors)})"
            )
    buffer.destroy()


def case_shared_gpu_dropless():
    """Launched with --ranks-per-gpu K: dropless_moe (receive buffers of
    `capacity` rows, overflow in further rounds) at DeepEP's hidden size, its
    output against tests/oracle.py and, with its gradients (x, the weights, the
    experts' scales), against the one-round layer sized for the worst case, bit
    for bit, each process checking its own rank, at capacities of one round
    and several (testing.scaled_experts: exact sums, so any order gives the
    same bits); then x as an FP8 and a packed NVFP4 pair, against the
    worst-case layer. Prints each compiled program's temporary memory. With
    launch --cpu, the xla backend (smaller hidden)."""
    import oracle
    from test_dropless import check_pair_layers, exact_pair, pair_layers, per_rank_layers

    platform, num_ranks, mesh, rank, rng = _one_rank_per_process()
    tokens, hidden, topk, num_experts = 64, 7168 if platform == "gpu" else 256, 8, max(4 * num_ranks, 16)
    buffer = _shared_buffer(platform, mesh, hidden, num_experts)
    put, run = _own_rank_io(mesh, "shared_gpu_dropless", buffer.config.timeout_s)
    # One round, and several (two and more: tests/test_dropless.py on CPU).
    layers = per_rank_layers(buffer, num_experts, hidden, (num_ranks * tokens, num_ranks * tokens // 8))

    def routing(kind):
        """(topk_idx, weights in quarters, experts' scales powers of two): every sum exact."""
        idx, _ = dt.make_routing(int(rng.integers(1 << 30)), num_ranks * tokens, num_experts, topk, num_ranks, kind)
        w = rng.integers(1, 9, idx.shape).astype(np.float32) / 4
        return idx, w, (2.0 ** rng.integers(-1, 3, num_experts)).astype(np.float32)

    rounds_seen = set()
    for kind in ("random", "one_expert", "rank_empty", "minus_one"):
        idx, w, scales = routing(kind)
        x = rng.integers(-4, 5, (num_ranks * tokens, hidden)).astype(jnp.bfloat16)
        received = oracle.dispatch(
            x.astype(np.float32).reshape(num_ranks, tokens, hidden),
            idx.reshape(num_ranks, tokens, topk),
            w.reshape(num_ranks, tokens, topk),
            num_experts,
            num_ranks * tokens,
        )
        y = oracle.scaled_expert_rows(received, scales.reshape(num_ranks, -1), num_ranks * tokens, hidden)
        expected = oracle.bf16_values(oracle.combine(y, received, tokens, _gpus_per_host(buffer))[rank])
        args = tuple(map(put, (x, idx, w, scales)))
        want = run(layers["worst"], *args)
        np.testing.assert_array_equal(want[0], expected, err_msg=f"{kind}: the worst-case layer")
        for capacity in list(layers)[1:]:
            got = run(layers[capacity], *args)
            rounds_seen.add(int(got[1][0]))
            for name, a, b in zip(("out", "dx", "dw", "dscales"), got[:1] + got[2:], want[:1] + want[2:]):
                np.testing.assert_array_equal(a, b, err_msg=f"{kind} capacity {capacity}: {name}")
            log(f"shared_gpu_dropless {kind} capacity {capacity}: {int(got[1][0])} rounds, ok")
    assert 1 in rounds_seen and max(rounds_seen) > 2, rounds_seen
    several = num_ranks * tokens // 8
    for fmt, packed in ((ROW_FORMATS[0], False), (ROW_FORMATS[2], True)):
        quantized = pair_layers(buffer, num_experts, hidden, (several,))  # compiled once per format
        for kind in ("random", "one_expert"):
            idx, w, scales = routing(kind)
            pair = map(np.asarray, exact_pair(rng, fmt, num_ranks * tokens, hidden, packed))
            pair_args = tuple(map(put, (*pair, idx, w, scales)))
            want = run(quantized["worst"], *pair_args)
            check_pair_layers(run(quantized[several], *pair_args), want, f"{fmt.name} {kind}")
            log(f"shared_gpu_dropless {fmt.name}{' packed' if packed else ''} {kind}: ok")
    for name, fn in layers.items():  # what each program needs besides its arguments and results
        temp = jax.jit(_per_rank(fn, mesh, AXIS, jit=False)).lower(*args).compile().memory_analysis().temp_size_in_bytes
        log(f"shared_gpu_dropless R={num_ranks} {name}: forward and backward temporaries {temp / 2**20:.1f} MiB")
    log(f"shared_gpu_dropless R={num_ranks}: ok (rounds seen {sorted(rounds_seen)})")
    buffer.destroy()


def case_wait_times():
    """Launched with --ranks-per-gpu K: low-latency dispatch, then combine (two
    programs), rank 1 calling each SLOW_S late. On the CUDA backend every
    other rank's receives count at least half that wait for rank 1, more than
    for any other rank, in both kinds, and rank 1 waits less than half of it;
    reset_wait_times zeroes them. With launch --cpu, the xla backend's zeros."""
    from jax.sharding import PartitionSpec

    platform, num_ranks, mesh, rank, rng = _one_rank_per_process()
    tokens, hidden, topk, num_experts = 8, 256, 2, 4 * num_ranks
    buffer = _shared_buffer(platform, mesh, hidden, num_experts, tokens)
    slow_s = 2.0 if buffer.backend == "cuda" else 0.0  # the xla backend counts nothing to show it
    put, _ = _own_rank_io(mesh, "wait_times", buffer.config.timeout_s)
    spmd = lambda fn: jax.jit(  # noqa: E731
        jax.shard_map(fn, mesh=mesh, in_specs=PartitionSpec(AXIS), out_specs=PartitionSpec(AXIS), check_vma=False)
    )
    kwargs = dict(buffer=buffer, num_experts=num_experts, num_max_dispatch_tokens_per_rank=tokens, use_fp8=False)
    dispatch = spmd(lambda x, idx: dej.low_latency_dispatch(x, idx, **kwargs))
    combine = spmd(lambda y, idx, w, handle: dej.low_latency_combine(y, idx, w, handle, buffer=buffer))
    idx, w = dt.make_routing(int(rng.integers(1 << 30)), num_ranks * tokens, num_experts, topk, num_ranks, "random")
    x, idx, w = put(rng.standard_normal((num_ranks * tokens, hidden)).astype(jnp.bfloat16)), put(idx), put(w)
    steps = iter(range(1 << 30))

    def round_trip(late):
        multiprocess.barrier(f"deep_ep_jax/test/wait_times/{next(steps)}", buffer.config.timeout_s)
        if late:
            time.sleep(slow_s)
        recv_x, _, handle = jax.block_until_ready(dispatch(x, idx))
        if late:
            time.sleep(slow_s)
        jax.block_until_ready(combine(recv_x, idx, w, handle))

    round_trip(False)  # compiled, and every rank past its first calls
    buffer.reset_wait_times()
    round_trip(rank == 1)
    times = buffer.wait_times()
    assert sorted(times) == [rank], times
    for kind, waited in times[rank].items():
        log(f"wait_times {kind}: {np.array2string(waited, precision=3)} s")
        assert waited.shape == (num_ranks,) and (waited >= 0).all(), (kind, waited)
        if buffer.backend == "xla":
            assert not waited.any(), (kind, waited)
        elif rank == 1:
            assert waited.max() < slow_s / 2, (kind, waited)
        else:
            assert waited[1] >= slow_s / 2 and waited.argmax() == 1, (kind, waited)
    buffer.reset_wait_times()
    assert not any(v.any() for v in buffer.wait_times()[rank].values())
    log(f"wait_times R={num_ranks}: ok")
    buffer.destroy()


def case_masked_rank():
    """Launched with --keep-going --ranks-per-gpu K, Config(mask_failed_ranks=True):
    rank VICTIM (1) stops (MASKED_RANK_MODE: "kill", SIGKILL to itself; "stall",
    no call until the others are done) at MASKED_RANK_AT: its second dispatch ("dispatch"),
    its second combine ("combine") or after its second round trip ("between").
    Every other rank runs on without barriers: the low-latency call that waits
    for it masks it within 2x the timeout, each result is bit for bit
    tests/oracle.py's with the victim masked (oracle.mask_ranks) from that call
    on, the next round trip takes no timeout, low_latency_mask says [victim],
    and after low_latency_set_mask(zeros) the next round trip masks it again;
    Buffer.destroy meets only the survivors (and, stalled, the victim's frees at once).
    MASKED_RANK_MODE "none" (launch --cpu: the xla backend, which masks no
    rank): the same round trips, all unmasked. Survivors leave with os._exit,
    rank 0 last (docs/multiprocess.md)."""
    import signal as signals

    import oracle
    from jax.sharding import PartitionSpec

    mode, at = os.environ.get("MASKED_RANK_MODE", "kill"), os.environ.get("MASKED_RANK_AT", "dispatch")
    platform, num_ranks, mesh, rank, rng = _one_rank_per_process()
    victim = 1 if mode != "none" else None
    tokens, hidden, topk, num_experts = 8, 256, 3, 2 * num_ranks
    timeout_s = float(os.environ.get("MASKED_RANK_TIMEOUT_S", "20"))
    buffer = _shared_buffer(platform, mesh, hidden, num_experts, tokens, timeout_s=timeout_s, mask_failed_ranks=True)
    put, _ = _own_rank_io(mesh, "masked_rank", 120)
    rows = PartitionSpec(AXIS)

    def spmd(fn, specs=rows):  # fn per rank; each output [R, ...]: this rank's in row 0 of its shard
        body = lambda *args: jax.tree.map(lambda a: a[None], fn(*args))  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=rows, check_vma=False))

    kwargs = dict(buffer=buffer, num_experts=num_experts, num_max_dispatch_tokens_per_rank=tokens, use_fp8=False)
    dispatch = spmd(lambda x, idx: dej.low_latency_dispatch(x, idx, **kwargs))
    unrow = lambda handle: jax.tree.map(lambda a: a[0], handle)  # noqa: E731  (dispatch's output: a row per rank)
    combine = spmd(lambda y, idx, w, handle: dej.low_latency_combine(y, idx, w, unrow(handle), buffer=buffer))
    read_mask = spmd(lambda: dej.low_latency_mask(buffer=buffer), ())
    clear_mask = spmd(lambda: dej.low_latency_set_mask(jnp.zeros(num_ranks, jnp.int32), buffer=buffer), ())
    idx, w = dt.make_routing(int(rng.integers(1 << 30)), num_ranks * tokens, num_experts, topk, num_ranks, "random")
    x = rng.standard_normal((num_ranks * tokens, hidden)).astype(jnp.bfloat16)
    y = rng.standard_normal((num_experts, num_ranks * tokens, hidden)).astype(jnp.bfloat16)
    xs, idxs, ws = (np.asarray(a).reshape(num_ranks, tokens, -1) for a in (x, idx, w))
    ys = np.asarray(y, np.float32).reshape(num_ranks, num_experts // num_ranks, num_ranks * tokens, hidden)
    full = oracle.low_latency_dispatch(xs, idxs, num_experts, tokens)
    masked_idx = oracle.mask_ranks(idxs, [victim] if victim is not None else [], num_experts)
    masked = oracle.low_latency_dispatch(xs, masked_idx, num_experts, tokens)
    x, idx_g, w_g, y_g = put(x), put(idx), put(w), put(y)
    mine = lambda a: np.asarray(a.addressable_shards[0].data)[0]  # noqa: E731
    epr = num_experts // num_ranks

    def stop_here(where, round_trip):
        if rank != victim or where != at or round_trip != 1:
            return
        log(f"victim: {mode} at {where}")
        if mode == "kill":
            os.kill(os.getpid(), signals.SIGKILL)
        # Stalled past the others' masking wait (1.5x the timeout), it comes back masked, by the
        # others' word: out, it sends to and waits for no one, so its calls return at once, empty.
        time.sleep(2.5 * timeout_s)
        np.testing.assert_array_equal(mine(read_mask()), np.eye(num_ranks, dtype=np.int32)[rank])
        (_, count, handle), took_dispatch = timed(dispatch, x, idx_g)
        out, took_combine = timed(combine, y_g, idx_g, w_g, handle)
        assert not mine(count).any() and not np.asarray(mine(out), np.float32).any(), "an out rank receives nothing"
        assert max(took_dispatch, took_combine) < timeout_s / 2, (took_dispatch, took_combine)
        log("stalled rank came back masked: its calls sent and received nothing")
        time.sleep(2 * timeout_s + 10)  # past the others' last call (masking it again after the clear)
        buffer.destroy()  # masked: it frees without waiting for anyone
        multiprocess._client().key_value_set("deep_ep_jax/test/masked_rank/victim_done", "1")
        log("stalled rank destroyed its Buffer")
        os._exit(0)

    def check_dispatch(recv_x, count, handle, lists, what):
        recv_x, count, handle = jax.tree.map(mine, (recv_x, count, handle))
        for e in range(epr):
            slots = lists[rank][e]
            assert int(count[e]) == len(slots), (what, e, int(count[e]), len(slots))
            if slots:
                s, t = _assert_low_latency_sources(handle, e, slots, f"{what} expert {e}")
                np.testing.assert_array_equal(np.asarray(recv_x[e, : len(slots)], np.float32), xs[s, t], err_msg=what)

    def check_combine(out, lists, routing, what):
        want = oracle.low_latency_combine(ys, lists, routing, ws, num_experts)[rank]
        np.testing.assert_array_equal(
            np.asarray(mine(out), np.float32), want.astype(jnp.bfloat16).astype(np.float32), err_msg=what
        )

    def timed(fn, *args):
        start = time.time()
        out = jax.block_until_ready(fn(*args))
        return out, time.time() - start

    # Round trip 0: compiled and run by every rank, then a barrier (the last one).
    recv_x, count, handle = jax.block_until_ready(dispatch(x, idx_g))
    jax.block_until_ready(combine(y_g, idx_g, w_g, handle))
    multiprocess.barrier("deep_ep_jax/test/masked_rank/ready", 120)
    jax.block_until_ready(read_mask() if victim is None else (read_mask(), clear_mask()))  # before anyone is gone
    # Calls 0-5: dispatch and combine of round trips 1-3. Those with the victim masked on the
    # survivors: from the call that finds it gone on; the clear after round trip 2 unmasks it,
    # and call 4 (dispatch 3) masks it again.
    masked_calls = set() if victim is None else set(range({"dispatch": 0, "combine": 1, "between": 2}[at], 6))
    durations = []
    for round_trip in (1, 2, 3):
        call = 2 * (round_trip - 1)
        stop_here("dispatch", round_trip)
        (recv_x, count, handle), took = timed(dispatch, x, idx_g)
        durations.append(took)
        lists = masked if call in masked_calls else full
        check_dispatch(recv_x, count, handle, lists, f"dispatch {round_trip}")
        stop_here("combine", round_trip)
        out, took = timed(combine, y_g, idx_g, w_g, handle)
        durations.append(took)
        check_combine(out, lists, masked_idx if call + 1 in masked_calls else idxs, f"combine {round_trip}")
        stop_here("between", round_trip)
        want_mask = np.zeros(num_ranks, np.int32)
        if call + 1 in masked_calls:
            want_mask[victim] = 1
        np.testing.assert_array_equal(mine(read_mask()), want_mask, err_msg=f"mask after round trip {round_trip}")
        if round_trip == 2 and victim is not None:
            np.testing.assert_array_equal(mine(clear_mask()), np.zeros(num_ranks, np.int32))
            log("mask cleared: the next round trip waits for the victim again")
    log(f"masked_rank {mode} at {at}: call durations {np.array2string(np.array(durations), precision=2)} s")
    if victim is not None:  # a receive waits 1.5x the timeout before it masks
        maskers = (min(masked_calls), 4)
        for i, took in enumerate(durations):
            if i in maskers:
                assert timeout_s <= took <= 2 * timeout_s, (i, durations)
            else:
                assert took < timeout_s / 2, (i, durations)
    log(f"masked_rank R={num_ranks}: ok")
    buffer.destroy()  # with a victim: a barrier of the survivors only
    if victim is None:
        return
    log("CASE masked_rank OK")  # main's line: a survivor leaves at once, skipping jax's shutdown
    if rank == 0:  # the coordinator's process leaves last
        if mode == "stall":
            multiprocess._client().blocking_key_value_get("deep_ep_jax/test/masked_rank/victim_done", 120_000)
        time.sleep(5)
    os._exit(0)


def case_mesh_order():
    """A Buffer used under a shard_map over a mesh of the same axes whose
    devices are in another order: every operation refuses it when the program
    is lowered, on every process, before any row moves (no XLA collective:
    ranks may share a GPU). With launch --cpu, the xla backend's refusal."""
    from test_validation import round_trips

    platform, num_ranks, mesh, _, _ = _one_rank_per_process()
    other = jax.sharding.Mesh(mesh.devices[::-1], (AXIS,))
    hidden, topk, num_experts, tokens = 256, 2, 2 * num_ranks, 8
    buffer = _shared_buffer(platform, mesh, hidden, num_experts, tokens)
    log(f"mesh_order: {buffer}")
    x = jax.ShapeDtypeStruct((num_ranks * tokens, hidden), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((num_ranks * tokens, topk), jnp.int32)
    w = jax.ShapeDtypeStruct((num_ranks * tokens, topk), jnp.float32)
    ids = [d.id for d in mesh.devices.flat]
    want = f"is {ids[::-1]} there, {ids} in the Buffer's"
    for name, fn in round_trips(buffer, tokens, num_experts).items():
        jax.jit(_per_rank(fn, mesh, AXIS, jit=False)).lower(x, idx, w)  # the Buffer's own mesh lowers
        try:
            jax.jit(_per_rank(fn, other, AXIS, jit=False)).lower(x, idx, w)
        except ValueError as e:
            assert "orders the devices otherwise" in str(e) and want in str(e), (name, str(e))
            log(f"mesh_order {name}: refused ({str(e)[:160]}...)")
        else:
            raise AssertionError(
                f"mesh_order {name}: a shard_map over {other.devices} lowered with a Buffer of {mesh.devices}"
            )
    buffer.destroy()


def case_shared_gpu_wrap():
    """shared_gpu's checks across the 2^31 and 2^32 wraps of the sequence
    numbers (normal mode crossing at its first and second call, low latency
    at its second and third), with ranks that may share GPUs: the staged
    one-host kernels (CUDA IPC) or, across emulated hosts, the internode ones."""
    case_shared_gpu(sequence_starts=(2**31 - 1, 2**32 - 2))
    log(f"shared_gpu_wrap R={jax.device_count()}: ok")


def case_shared_gpu_order():
    """Independent round trips in one jitted program, nothing ordering them
    but the Buffer's order chain (deep_ep_jax.comm.ordering): three normal-mode
    dispatch + combine and two low-latency ones, against each round trip run
    alone (shared_gpu checks those against the oracle), bit for bit, each
    process its own rank. Meant also for XLA_FLAGS=
    --xla_gpu_command_buffer_scheduling_mode=CONCURRENT, with ranks that may
    share GPUs (no XLA collective across processes)."""
    platform, num_ranks, mesh, _, rng = _one_rank_per_process()
    num_tokens, hidden, topk, num_experts = 32, 256, 4, 4 * num_ranks
    buffer = _shared_buffer(platform, mesh, hidden, num_experts, num_tokens)
    put, run = _own_rank_io(mesh, "shared_gpu_order", buffer.config.timeout_s)

    def normal(scale, x, idx, w):
        recv_x, recv_idx, recv_w, handle = dej.dispatch(
            (x * scale).astype(jnp.bfloat16), idx, w, num_experts=num_experts, buffer=buffer
        )
        out, out_w = dej.combine(recv_x, handle, recv_w, buffer=buffer)
        return handle.num_recv_tokens, recv_x, recv_idx, recv_w, out, out_w

    def low_latency(scale, x, idx, w):
        recv_x, count, handle = dej.low_latency_dispatch(
            (x * scale).astype(jnp.bfloat16),
            idx,
            num_experts=num_experts,
            num_max_dispatch_tokens_per_rank=num_tokens,
            use_fp8=False,
            buffer=buffer,
        )
        return count, dej.low_latency_combine(recv_x, idx, w, handle, buffer=buffer)

    trips = [functools.partial(normal, s) for s in (1.0, 2.0, 3.0)] + [
        functools.partial(low_latency, s) for s in (1.0, 2.0)
    ]

    def together(x, idx, w):
        return tuple(trip(x, idx, w) for trip in trips)

    for kind in dt.ROUTING_KINDS:
        idx, w = dt.make_routing(int(rng.integers(1 << 30)), num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
        x = rng.standard_normal((num_ranks * num_tokens, hidden), np.float32).astype(jnp.bfloat16)
        args = tuple(map(put, (x, idx, w)))
        got = run(together, *args)
        for i, trip in enumerate(trips):
            want = run(trip, *args)
            what = f"{kind}, round trip {i}"
            if i < 3:  # normal mode: received rows past num_recv_tokens are undefined
                n = int(want[0])
                assert int(got[i][0]) == n, (what, int(got[i][0]), n)
                for name, g, r in zip(("recv_x", "recv_idx", "recv_w"), got[i][1:4], want[1:4]):
                    np.testing.assert_array_equal(g[:n], r[:n], err_msg=f"{what}: {name}")
                got_rest, want_rest = got[i][4:], want[4:]
            else:
                got_rest, want_rest = got[i], want
            for g, r in zip(got_rest, want_rest):
                np.testing.assert_array_equal(g, r, err_msg=what)
        log(f"shared_gpu_order {kind}: ok")
    log(f"shared_gpu_order R={num_ranks}: ok")
    buffer.destroy()


def case_shared_gpu_teardown():
    """Buffers made, used (a normal-mode round trip, then low-latency mode in
    split halves, the other ranks held back before the last receive: this
    rank's outputs are ready while peers still receive) and destroyed, ten
    times, ranks possibly sharing GPUs. destroy must wait for every process's
    last receive before anything is freed: a late write into a freed region
    would land in the next Buffer's. Every Buffer's results must equal the
    first's (same inputs), and no Buffer may stay alive."""
    import test_wrap_gpu as suite

    from deep_ep_jax import _native

    platform, num_ranks, mesh, _, _ = _one_rank_per_process()
    assert platform == "gpu", "the CUDA backend's teardown"
    experts = suite.num_experts(mesh)
    ext = _native.extension()
    live = ext.num_live_buffers()
    x = dt.random_rows(1, (num_ranks * suite.NUM_TOKENS, suite.HIDDEN))
    idx, w = dt.make_routing(2, num_ranks * suite.NUM_TOKENS, experts, suite.TOPK, num_ranks)
    y = dt.random_rows(3, (num_ranks * suite.NUM_TOKENS * num_ranks, suite.HIDDEN))
    ll_idx, ll_w = dt.make_routing(4, num_ranks * suite.LL_TOKENS, experts, suite.TOPK, num_ranks)
    ll_x = dt.random_rows(5, (num_ranks * suite.LL_TOKENS, suite.HIDDEN))
    first = None
    for i in range(10):
        buffer = suite.cuda_buffer(mesh)
        put, run = _own_rank_io(mesh, f"shared_gpu_teardown/{i}", buffer.config.timeout_s)
        args = tuple(map(put, (np.asarray(a) for a in (x, idx, w, y, ll_x, ll_idx, ll_w))))
        got = run(functools.partial(suite.teardown_calls, buffer, experts), *args)
        buffer.destroy()
        if first is None:
            first = got
            continue
        recv_x, num_recv, out, out_w, xs, count, ll_handle, ll_out = got
        f_recv_x, f_num_recv, f_out, f_out_w, f_xs, f_count, f_ll_handle, f_ll_out = first
        n = int(num_recv)
        assert n == int(f_num_recv), (i, n, int(f_num_recv))
        np.testing.assert_array_equal(recv_x[:n], f_recv_x[:n], err_msg=f"buffer {i}: recv_x")
        np.testing.assert_array_equal(count, f_count, err_msg=f"buffer {i}: low-latency recv_count")
        valid = np.arange(xs[0].shape[1])[None, :] < count[:, None]  # only the received rows are defined
        for j, (g, f) in enumerate(zip(xs, f_xs)):
            np.testing.assert_array_equal(g[valid], f[valid], err_msg=f"buffer {i}: low-latency recv_x[{j}]")
        for name, g, f in [("out", out, f_out), ("out_weights", out_w, f_out_w), ("low-latency out", ll_out, f_ll_out)]:
            np.testing.assert_array_equal(g, f, err_msg=f"buffer {i}: {name}")
        for j, (g, f) in enumerate(zip(jax.tree.leaves(ll_handle), jax.tree.leaves(f_ll_handle))):
            np.testing.assert_array_equal(g, f, err_msg=f"buffer {i}: low-latency handle leaf {j}")
    assert ext.num_live_buffers() == live, (ext.num_live_buffers(), live)
    log(f"shared_gpu_teardown R={num_ranks}: ok")


def case_large_ep_low_latency():
    """An EP group beyond one host's 8 ranks (R = the process count, e.g. 16
    or 32), cut into hosts of DEEP_EP_JAX_GPUS_PER_HOST ranks that
    reach each other over NVSHMEM, several processes per GPU (launch
    --ranks-per-gpu, time-sliced): low-latency dispatch then combine, in one
    kernel each and as split halves, bf16 and FP8, fresh random and skewed
    routing. As in shared_gpu nothing is gathered (NCCL refuses two ranks on
    one GPU): every process makes the same global inputs and checks its own
    rank, bit for bit, against tests/oracle.py (routing, handle, bf16 rows,
    combine) and the xla backend's FP8 quantisation run on its own GPU (FP8
    rows and scales). On CPU (launch --cpu) it runs the xla backend, to
    check the case itself."""
    import oracle

    from deep_ep_jax.backends import reference

    platform, num_ranks, mesh, rank, rng = _one_rank_per_process()
    cuda = platform == "gpu"
    num_tokens, hidden, topk = 16, 1024, 4
    num_experts = 2 * num_ranks
    # Kernels of the processes of one GPU take turns: waits for a peer last long.
    config = dej.Config(timeout_s=150)
    buffer = dej.Buffer(
        mesh,
        AXIS,
        backend="cuda" if cuda else "xla",
        hidden=hidden,
        num_experts=num_experts,
        low_latency_mode=True,
        num_max_dispatch_tokens_per_rank=num_tokens,
        config=config,
    )
    if cuda:
        assert buffer.spans_hosts and buffer.num_nodes == -(-num_ranks // config.gpus_per_host), buffer
        log(
            f"{buffer}: {buffer.num_nodes} hosts, region {buffer.num_rdma_bytes} + send area "
            f"{buffer.num_send_bytes} bytes"
        )
    put, run = _own_rank_io(mesh, "large_ep", config.timeout_s)

    def bf16_rows(shape, wide=False):
        # wide: half the values +-2^24, which cancel in sums, so that a sum in another order comes out different.
        a = rng.standard_normal(shape, np.float32)
        if wide:
            a = np.where(rng.random(shape) < 0.5, np.sign(a) * np.float32(1 << 24), a)
        return a.astype(jnp.bfloat16)

    def whole(x, idx, w, y, use_fp8):
        recv_x, count, handle = dej.low_latency_dispatch(
            x, idx, buffer=buffer, num_experts=num_experts, num_max_dispatch_tokens_per_rank=num_tokens, use_fp8=use_fp8
        )
        return recv_x, count, handle, dej.low_latency_combine(y, idx, w, handle, buffer=buffer)

    def halves(x, idx, w, y, use_fp8):
        pending = dej.low_latency_dispatch_send(
            x, idx, buffer=buffer, num_experts=num_experts, num_max_dispatch_tokens_per_rank=num_tokens, use_fp8=use_fp8
        )
        recv_x, count, handle = dej.low_latency_dispatch_recv(pending, buffer=buffer)
        pending = dej.low_latency_combine_send(y, idx, w, handle, buffer=buffer)
        return recv_x, count, handle, dej.low_latency_combine_recv(pending, buffer=buffer)

    programs = {
        (name, use_fp8): (lambda x, idx, w, y, f=f, use_fp8=use_fp8: f(x, idx, w, y, use_fp8))
        for name, f in (("whole", whole), ("halves", halves))
        for use_fp8 in (False, True)
    }
    quantize = jax.jit(reference.quantize_fp8)
    for (name, use_fp8), program in programs.items():
        for kind in ("random", "one_expert", "rank_empty", "minus_one"):
            what = f"{name} fp8={use_fp8} {kind}"
            idx, _ = dt.make_routing(
                int(rng.integers(1 << 30)), num_ranks * num_tokens, num_experts, topk, num_ranks, kind
            )
            w = rng.choice(np.float32([0.5, 1, 2]), idx.shape)  # exact products: the sum's order shows
            x = bf16_rows((num_ranks * num_tokens, hidden))
            y = bf16_rows((num_experts, num_ranks * num_tokens, hidden), True)
            recv_x, count, handle, out = run(program, *map(put, (x, idx, w, y)))
            idxs, ws = idx.reshape(num_ranks, num_tokens, topk), w.reshape(num_ranks, num_tokens, topk)
            xs = x.astype(np.float32).reshape(num_ranks, num_tokens, hidden)
            if use_fp8:  # the xla backend's quantisation, on this process's device
                data, scales = quantize(jax.device_put(x, jax.local_devices()[0]))
                want_rows = (
                    np.asarray(data).astype(np.float32).reshape(num_ranks, num_tokens, hidden),
                    np.asarray(scales).reshape(num_ranks, num_tokens, -1),
                )
                got_rows = recv_x
            else:
                want_rows, got_rows = (xs,), (recv_x,)
            expected = oracle.low_latency_dispatch(xs, idxs, num_experts, num_tokens)
            for e, slots in enumerate(expected[rank]):
                n = len(slots)
                assert int(count[e]) == n, (what, e, int(count[e]), n)
                for field in ("recv_src_rank", "recv_src_token", "recv_src_topk"):
                    assert (getattr(handle, field)[e, n:] == -1).all(), (what, e, field)
                if not n:
                    continue
                s, t = _assert_low_latency_sources(handle, e, slots, what)
                for got, want in zip(got_rows, want_rows):
                    np.testing.assert_array_equal(got[e, :n], want[s, t], err_msg=what)
            if kind == "rank_empty" and rank == num_ranks - 1:
                assert not count.any(), what
            _assert_low_latency_combine(out, y, expected, idxs, ws, rank, what)
            log(f"large_ep R={num_ranks} {what}: ok")
    buffer.destroy()


def case_traffic():
    """Launched with --ranks-per-gpu K (and DEEP_EP_JAX_GPUS_PER_HOST): the
    CUDA kernels' traffic counters (Config.count_traffic) against
    tests/oracle.py's traffic(), each process checking its own rank (no XLA
    collective, as shared_gpu): dispatch, combine and its backward (a cached
    dispatch), fresh random and skewed routing, num_worst_tokens drops, bf16
    and FP8 rows. With --cpu, the xla backend's counters."""
    import oracle

    platform, num_ranks, mesh, rank, rng = _one_rank_per_process()
    num_tokens, hidden, topk, num_experts = 8, 256, 4, 4 * num_ranks
    buffer = _shared_buffer(platform, mesh, hidden, num_experts, count_traffic=True)
    gpus_per_host = _gpus_per_host(buffer) if buffer.num_nodes > 1 else None
    log(f"traffic R={num_ranks} on {buffer.num_nodes} hosts ({buffer})")
    put, run = _own_rank_io(mesh, "traffic", buffer.config.timeout_s)

    def programs(num_worst_tokens):
        def bf16(x, idx, w, y):
            _, _, _, handle = dej.dispatch(
                x, idx, w, num_experts=num_experts, buffer=buffer, num_worst_tokens=num_worst_tokens
            )

            def loss(y):  # combine, and its backward: a cached dispatch
                return (dej.combine(y, handle, buffer=buffer).astype(jnp.float32) ** 2).sum()

            return jax.value_and_grad(loss)(y)

        def dispatch_pair(data, scales, idx, w):
            return dej.dispatch(
                (data, scales), idx, w, num_experts=num_experts, buffer=buffer, num_worst_tokens=num_worst_tokens
            )[0]

        return bf16, dispatch_pair

    cases = [("random", None), ("one_expert", None), ("rank_empty", None), ("minus_one", None), ("random", 0.3)]
    compiled = {
        worst: programs(None if worst is None else int(worst * num_ranks * num_tokens))
        for worst in {w for _, w in cases}
    }
    for kind, worst in cases:
        rows = num_ranks * num_tokens if worst is None else int(worst * num_ranks * num_tokens)
        idx, w = dt.make_routing(int(rng.integers(1 << 30)), num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
        idxs, ws = idx.reshape(num_ranks, num_tokens, topk), w.reshape(num_ranks, num_tokens, topk)
        expected = oracle.dispatch(np.zeros((num_ranks, num_tokens, 1)), idxs, ws, num_experts, rows)
        want = oracle.traffic(idxs, expected, num_experts, gpus_per_host)[rank]
        bf16, fp8 = compiled[worst]
        x = rng.standard_normal((num_ranks * num_tokens, hidden), np.float32).astype(jnp.bfloat16)
        y = rng.standard_normal((num_ranks * rows, hidden), np.float32).astype(jnp.bfloat16)
        data = (rng.standard_normal((num_ranks * num_tokens, hidden), np.float32) * 8).astype(jnp.float8_e4m3fn)
        scales = rng.random((num_ranks * num_tokens, hidden // 128), np.float32) + 0.5
        for program, args, row_bytes in (
            (bf16, (x, idx, w, y), 2 * hidden),
            (fp8, (data, scales, idx, w), hidden + hidden // 128 * 4),
        ):
            buffer.reset_traffic()
            run(program, *map(put, args))
            got = buffer.traffic()[rank]
            ops = ("dispatch", "cached_dispatch", "combine") if program is bf16 else ("dispatch",)
            for op in ("dispatch", "cached_dispatch", "combine"):
                nvlink, network = want[op] if op in ops else (0, 0)
                assert got[op] == {
                    "nvlink_rows": nvlink,
                    "nvlink_bytes": nvlink * row_bytes,
                    "network_rows": network,
                    "network_bytes": network * row_bytes,
                }, (kind, worst, program.__name__, op, got[op], want[op])
        log(f"traffic {kind} worst={worst}: ok {want}")
    buffer.destroy()


def case_hosts():
    """The hostname and NVLink domain exchange, each process naming itself as if processes 2i and
    2i + 1 shared a machine and processes 4i to 4i + 3 an NVLink domain (so an exchange that kept
    only a process's own names fails), under keys of this case's own; then the nodes the names
    give: pairs of processes, one each with gpus_per_host=1, fours with the domains."""
    import socket
    from unittest import mock

    count, me = jax.process_count(), jax.process_index()
    saved = multiprocess._places
    multiprocess._places = None  # traded once per process: this case trades its own names
    with (
        mock.patch.object(socket, "gethostname", return_value=f"machine{me // 2}"),
        mock.patch.dict(os.environ, {"DEEP_EP_JAX_NVLINK_DOMAIN": f"rack{me // 4}"}),
        mock.patch.object(multiprocess, "HOST_KEY_PREFIX", multiprocess.HOST_KEY_PREFIX + "/case_hosts"),
    ):
        found = multiprocess.places(timeout_s=30)
        assert found == {p: (f"machine{p // 2}", topology.Domain(f"rack{p // 4}", 0)) for p in range(count)}, found
        hosts, domains = [found[p][0] for p in range(count)], [found[p][1] for p in range(count)]
        assert multiprocess.group_nodes(hosts) == [p // 2 for p in range(count)]
        assert multiprocess.group_nodes(hosts, 1) == list(range(count))
        assert multiprocess.group_nodes(hosts, 1, domains) == [p // 4 for p in range(count)]
        # A Buffer cuts its group the same way: one node per domain, whatever the hosts.
        _, _, mesh, _, _ = _one_rank_per_process()
        buffer = dej.Buffer(mesh, AXIS, backend="xla", config=dej.Config(gpus_per_host=1))
        assert buffer.num_nodes == -(-count // 4) and buffer.rank_hosts == tuple(p // 4 for p in range(count))
    multiprocess._places = saved


def case_nvshmem_outcome():
    """lifecycle.allocate_nvshmem with NVSHMEM stood in for: the C++ making fails on process 1 only (as
    when NVSHMEM cannot map a peer, after the collective allocation); every process must raise naming
    process 1 and its message, not only process 1. Then made on every process: each gets its id."""
    from unittest import mock

    from deep_ep_jax.backends.cuda import lifecycle

    _, _, mesh, _, _ = _one_rank_per_process()
    me = jax.process_index()

    def create(device, rank, pes, nodes, *sizes, fail):
        if fail and me == 1:
            raise RuntimeError("deep_ep_jax: NVSHMEM cannot map rank 0 (stood in)")
        return 7

    for fail in (True, False):
        buffer = dej.Buffer(mesh, AXIS, backend="xla")
        buffer.store_key = f"{multiprocess.next_buffer_name()}/case_nvshmem_outcome"
        groups = [[d.local_hardware_id if d.process_index == me else -1 for d in mesh.devices.flat]]
        with (
            mock.patch.object(nvshmem, "unavailable_reason", return_value=None),
            mock.patch.object(nvshmem, "check_one_gpu_per_process"),
            mock.patch.object(nvshmem, "initialize"),
            mock.patch.object(nvshmem, "track"),
            mock.patch.object(lifecycle, "_check_fits_device"),
            mock.patch.object(lifecycle, "create_nvshmem_buffer", functools.partial(create, fail=fail)),
        ):
            try:
                lifecycle.allocate_nvshmem(buffer, groups, [[0] * len(groups[0])], None, None, normal=False)
                assert not fail and buffer.buffer_id == 7, (fail, buffer.buffer_id)
            except RuntimeError as e:
                assert fail and "failed on process(es) [1]; process 1: RuntimeError: " in str(e), e
                assert "stood in" in str(e) and buffer.buffer_id is None, e


def _internode_mesh():
    assert dej.Config().gpus_per_host == 1, "run with DEEP_EP_JAX_GPUS_PER_HOST=1"
    return _gpu_mesh()


def case_internode_low_latency():
    import test_low_latency_gpu as suite

    from deep_ep_jax.backends.cuda import sizes

    mesh = _internode_mesh()
    num_ranks = mesh.shape[AXIS]
    region = sizes.low_latency_region_bytes(
        num_ranks, suite.MAX_EXPERTS, suite.MAX_HIDDEN, suite.MAX_TOKENS, num_topk=suite.MAX_TOPK
    )
    cuda = dej.Buffer(
        mesh,
        AXIS,
        backend="cuda",
        low_latency_mode=True,
        hidden=suite.MAX_HIDDEN,
        num_max_dispatch_tokens_per_rank=suite.MAX_TOKENS,
        num_rdma_bytes=region,
    )
    xla = dej.Buffer(
        mesh, AXIS, backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=suite.MAX_TOKENS
    )
    assert cuda.backend == "cuda" and cuda.spans_hosts and not cuda.ipc, cuda
    log(f"NVSHMEM buffer: {cuda}, send area {cuda.num_send_bytes} bytes")
    # Sized for the suite's largest hidden; its cases use smaller ones too, which
    # fit: drop the per-call hidden check (the send-area check still runs).
    cuda.hidden = None
    buffers = (cuda, xla)
    for use_fp8 in (True, False):
        for kind in dt.ROUTING_KINDS:
            suite.test_matches_reference(mesh, buffers, kind, use_fp8)
            log(f"internode low-latency {kind} fp8={use_fp8}: ok")
    suite.test_split_halves(mesh, buffers)
    log("internode low-latency split halves: ok")
    suite.test_many_calls_in_fori_loop(mesh, buffers)
    log("internode low-latency fori_loop: ok")
    cuda.destroy()


def case_internode_normal():
    """Normal mode across (emulated) hosts against the xla backend: the
    single-host suite's comparisons, bit for bit (handle, rows, padding,
    combine's rank-ordered float32 sums), on poisoned outputs, with the suite's
    seeded inputs."""
    import test_normal_gpu as suite

    from deep_ep_jax.backends.cuda import sizes

    mesh = _internode_mesh()
    num_ranks = mesh.shape[AXIS]
    # The suite's largest shapes: 1024 tokens of hidden 4096, 333 of 7168 (top-k <= 9).
    region = max(
        sizes.internode_region_bytes(num_ranks, num_ranks, 7168, 333),
        sizes.internode_region_bytes(num_ranks, num_ranks, 4096, 1024),
    )
    cuda = dej.Buffer(mesh, AXIS, backend="cuda", num_nvl_bytes=region)
    xla = dej.Buffer(mesh, AXIS, backend="xla")
    assert cuda.backend == "cuda" and cuda.spans_hosts and cuda.num_nodes == num_ranks and not cuda.ipc, cuda
    log(f"NVSHMEM buffer: {cuda}, normal region {cuda.num_nvl_bytes} bytes")
    buffers = (cuda, xla)
    for kind in dt.ROUTING_KINDS:
        suite.test_matches_reference(mesh, buffers, kind)
        log(f"internode normal {kind}: ok")
    for kind in ("random", "one_expert"):
        suite.test_fp8_pairs(mesh, buffers, kind)
        log(f"internode normal fp8 {kind}: ok")
    suite.test_num_worst_tokens_smaller(mesh, buffers, 0.3)
    log("internode normal num_worst_tokens overflow: ok")
    for kind in ("random", "rank_empty"):
        suite.test_gradients_exact(mesh, buffers, kind)
    log("internode normal gradients: ok")
    # Back-to-back calls in one program: sequence numbers, no resets.
    num_experts = 8 * num_ranks
    x = dt.random_rows(0, (num_ranks * 96, 512))
    idx, w = suite.routing(1, num_ranks, 96, num_experts, 3, "minus_one")
    got = suite._loop_runner(cuda, mesh, num_experts, 300)(x, idx, w)
    want = suite._loop_runner(xla, mesh, num_experts, 300)(x, idx, w)
    for name, g, wv in zip(("combined rows", "combined weights", "num_recv_tokens"), got, want):
        suite.assert_bits_equal(g, wv, name)
    log("internode normal 300 calls in fori_loop: ok")
    # Too small a region: a clear error at trace time.
    small = dej.Buffer(mesh, AXIS, backend="cuda", num_nvl_bytes=1 << 20)
    big_x = dt.random_rows(1, (num_ranks * 512, 2048))
    big_idx, big_w = suite.routing(2, num_ranks, 512, num_experts, 4, "random")
    try:
        _per_rank(lambda x, i, w: dej.dispatch(x, i, w, num_experts=num_experts, buffer=small)[0], mesh, AXIS)(
            big_x, big_idx, big_w
        )
    except ValueError as e:
        assert "num_nvl_bytes" in str(e) and "spans hosts" in str(e), e
    else:
        raise AssertionError("a too-small normal region was not refused")
    small.destroy()
    cuda.destroy()


def _check_across_wraps(suite, mesh, buffers, what):
    for wrap in suite.WRAPS:
        for crossing in range(suite.NORMAL_CALLS):
            suite.check_normal_across_wrap(mesh, buffers, wrap, crossing)
        log(f"{what} normal mode across {wrap}: ok")
        for crossing in range(suite.LL_CALLS):
            for split in (False, True):
                suite.check_low_latency_across_wrap(mesh, buffers, wrap, crossing, split)
        log(f"{what} low-latency mode across {wrap}: ok")


def case_wrap():
    import test_wrap_gpu as suite

    mesh = _gpu_mesh()
    cuda = suite.cuda_buffer(mesh)
    assert cuda.backend == "cuda" and cuda.ipc and cuda.staged, cuda
    _check_across_wraps(suite, mesh, (cuda, suite.xla_buffer(mesh)), "CUDA IPC")
    cuda.destroy()


def case_internode_wrap():
    import test_wrap_gpu as suite

    from deep_ep_jax.backends.cuda import sizes

    mesh = _internode_mesh()
    num_ranks = mesh.shape[AXIS]
    region = sizes.internode_region_bytes(num_ranks, num_ranks, suite.HIDDEN, suite.NUM_TOKENS)
    cuda = suite.cuda_buffer(mesh, num_nvl_bytes=region)
    assert cuda.backend == "cuda" and cuda.spans_hosts and not cuda.ipc, cuda
    _check_across_wraps(suite, mesh, (cuda, suite.xla_buffer(mesh)), "NVSHMEM")
    cuda.destroy()


def case_internode_handler_checks():
    """The internode handlers make the one-host handlers' checks (csrc/ffi/common.h):
    called through jax.ffi directly, past the wrapper's trace-time checks,
    shapes the kernels cannot take fail in the handler with a message naming
    the target, before any launch (so no peer is waited for)."""
    from deep_ep_jax.backends.cuda import common, internode, sizes

    mesh = _internode_mesh()
    num_ranks, num_tokens = mesh.shape[AXIS], 64
    buffer = dej.Buffer(
        mesh, AXIS, backend="cuda", num_nvl_bytes=sizes.internode_region_bytes(num_ranks, num_ranks, 1024, num_tokens)
    )
    assert buffer.spans_hosts, buffer
    max_local = common.limit("max_local_experts")

    def dispatch(xs, num_experts, topk=2):
        idx = jnp.zeros((num_tokens, topk), jnp.int32)
        w = jnp.ones((num_tokens, topk), jnp.float32)
        out_types = dict(
            common.dispatch_out_types(num_tokens, num_tokens * num_ranks, xs, topk, num_ranks, num_experts),
            node_pos=jax.ShapeDtypeStruct((num_tokens, buffer.num_nodes), jnp.int32),
        )
        return internode.DISPATCH(
            buffer,
            out_types,
            xs[0],
            common.scales_or_empty(xs, num_tokens),
            idx,
            w,
            num_experts=np.int64(num_experts),
            **internode._launch_attrs(buffer),
        )

    def combine(hidden):
        rows = num_tokens * num_ranks
        out_types = dict(
            out=jax.ShapeDtypeStruct((num_tokens, hidden), jnp.bfloat16),
            out_weights=jax.ShapeDtypeStruct((num_tokens, 0), jnp.float32),
        )
        return internode.COMBINE(
            buffer,
            out_types,
            jnp.zeros((rows, hidden), jnp.bfloat16),
            jnp.zeros((rows, 0), jnp.float32),
            jnp.zeros((num_tokens, num_ranks), jnp.int32),
            jnp.zeros((), jnp.int32),
            jnp.zeros((rows,), jnp.int32),
            jnp.zeros((rows,), jnp.int32),
            **internode._launch_attrs(buffer),
        )

    bf16 = lambda hidden: (jnp.zeros((num_tokens, hidden), jnp.bfloat16),)
    fp8 = lambda hidden: (
        jnp.zeros((num_tokens, hidden), jnp.float8_e4m3fn),
        jnp.zeros((num_tokens, max(1, hidden // 128)), jnp.float32),
    )
    cases = [
        (
            "experts per rank",
            lambda: dispatch(bf16(512), num_ranks * (max_local + 1)),
            f"at most {max_local} experts per rank",
        ),
        ("bf16 hidden", lambda: dispatch(bf16(100), 4 * num_ranks), "multiple of 8"),
        ("FP8 hidden", lambda: dispatch(fp8(192), 4 * num_ranks), "multiple of 128"),
        ("combine hidden", lambda: combine(100), "multiple of 8"),
    ]
    for name, call, expected in cases:
        try:
            jax.block_until_ready(jax.jit(call)())  # on this process's GPU: the buffer's device
        except Exception as e:  # XLA's runtime error carrying the handler's message
            assert "deep_ep_jax_internode_" in str(e) and expected in str(e), (name, str(e)[:1000])
            log(f"internode handler refuses {name}: ok ({str(e)[:200]})")
        else:
            raise AssertionError(f"the internode handler accepted {name}")
    buffer.destroy()


CASES = {
    "reference": case_reference,
    "exchange": case_exchange,
    "normal": case_normal,
    "low_latency": case_low_latency,
    "kill": case_kill,
    "launch_mismatch": case_launch_mismatch,
    "digest": case_digest,
    "hosts": case_hosts,
    "nvshmem_outcome": case_nvshmem_outcome,
    "shared_gpu": case_shared_gpu,
    "shared_gpu_wrap": case_shared_gpu_wrap,
    "mesh_order": case_mesh_order,
    "wait_times": case_wait_times,
    "masked_rank": case_masked_rank,
    "shared_gpu_dropless": case_shared_gpu_dropless,
    "shared_gpu_order": case_shared_gpu_order,
    "shared_gpu_teardown": case_shared_gpu_teardown,
    "shared_gpu_moe_layer": case_shared_gpu_moe_layer,
    "internode_low_latency": case_internode_low_latency,
    "large_ep_low_latency": case_large_ep_low_latency,
    "internode_normal": case_internode_normal,
    "wrap": case_wrap,
    "internode_wrap": case_internode_wrap,
    "internode_handler_checks": case_internode_handler_checks,
    "traffic": case_traffic,
}


def main(names):
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        raise SystemExit(f"cases: {sorted(CASES)}; got {names}")
    for name in names:
        start = time.time()
        CASES[name]()
        log(f"CASE {name} OK ({time.time() - start:.1f} s)")


if __name__ == "__main__":
    main(sys.argv[1:])
