"""EP groups beyond 8 ranks, one process per rank spread over the GPUs at
hand (launch --ranks-per-gpu; the kernels of the processes of one GPU are
time-sliced, so this checks correctness, not speed), hosts emulated with
DEEP_EP_JAX_GPUS_PER_HOST (ranks of other hosts reached over NVSHMEM):

* low-latency mode at EP 16 and EP 32 as 2 and 4 hosts of 8: dispatch then
  combine, in one kernel each and as split halves, bf16 and FP8, fresh random
  and skewed routing, each process checking its own rank bit for bit against
  tests/oracle.py and the xla backend's FP8 quantisation (worker case
  large_ep_low_latency);
* normal mode in one node (one NVLink domain) of 16, 36 and 72 ranks, and
  across hosts at 2 x 8, 4 x 4, 4 x 8 and 2 x 16 (two NVLink domains of 16):
  dispatch, combine, a
  cached dispatch (combine's gradient), bf16 and FP8 pairs, and low-latency
  mode, against tests/oracle.py (worker case shared_gpu);
* the same at 2 x 2, 2 x 4 and 4 x 2: combine reduced per host (several
  ranks per host, several hosts) against the oracle's per-host order;
* the same at DeepEP's standard sizes (4096 tokens per rank, hidden 7168,
  top-8, 256 experts) at 1 x 2 (staged one-host kernels), 2 x 1 and 2 x 2;
* traffic counters (Config.count_traffic) at 1 x 2, 1 x 8 (one host's
  staged kernels over CUDA IPC), 2 x 2, 2 x 4 and 2 x 8 against
  tests/oracle.py's traffic() (worker case traffic);
* Buffer.wait_times(): a rank calling late shows on the others' low-latency
  receive counters, 1 x 4 and 2 x 2 (worker case wait_times);
* a rank killed or stalled in low-latency mode with Config.mask_failed_ranks:
  the others mask it and serve on, exact, at 8 and 16 ranks (worker case
  masked_rank);
* shared_gpu's checks from just under the 2^31 and 2^32 wraps of the
  sequence numbers (worker case shared_gpu_wrap): one host's staged kernels
  across processes (CUDA IPC, 1 x 2) and the internode ones (2 x 1, 2 x 2),
  on however few GPUs there are;
* independent round trips in one program, ordered only by the Buffer's
  order chain, under default and concurrent command-buffer scheduling
  (worker case shared_gpu_order), 1 x 2 and 2 x 1;
* Buffers made, used and destroyed in a loop while peers still receive
  (worker case shared_gpu_teardown), 1 x 2 and 2 x 1;
* a Buffer under a shard_map over its mesh's devices in another order
  refused, and a mesh in reverse process order right (worker cases
  mesh_order and shared_gpu), 1 x 2 and 2 x 1;
* dropless_moe at EP 8 (1 x 8) and 16 (2 x 8), hidden 7168, against the
  oracle and the worst-case layer in one round and several (worker case
  shared_gpu_dropless).

No XLA collective runs across the processes: NCCL refuses two ranks on one
GPU. Each launch is also runnable by hand, e.g. EP 16 on 2 GPUs:

    DEEP_EP_JAX_GPUS_PER_HOST=8 NVSHMEM_REMOTE_TRANSPORT=none XLA_PYTHON_CLIENT_PREALLOCATE=false \\
        python -m deep_ep_jax.launch -n 16 --ranks-per-gpu 8 --all-gpus-visible -- \\
        tests/multiprocess_worker.py large_ep_low_latency

(-n 64 --ranks-per-gpu 32 reaches ranks beyond 32, the second word of the
kernels' destination masks). Run this module in its own pytest process with
XLA_PYTHON_CLIENT_PREALLOCATE=false (scripts/device_run.sh does): up to 16
processes share each GPU with pytest's.
"""

import os
import subprocess
import sys
import time

import jax
import pytest

pytestmark = pytest.mark.gpu(min_gpus=1)  # ranks share the GPUs there are

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
CASE = "large_ep_low_latency"
RANKS_PER_HOST = 8


def _launch(num_ranks, *, timeout, case=CASE, ranks_per_host=RANKS_PER_HOST, extra_env=None, launcher_args=()):
    from deep_ep_jax.distributed import nvshmem

    # Not a skip: a GPU host runs these tests (conftest), and NVSHMEM belongs there; without it this is a failure.
    reason = nvshmem.unavailable_reason()
    if reason:
        pytest.fail(f"NVSHMEM cannot be used here: {reason}", pytrace=False)
    num_gpus = len(jax.devices("gpu"))
    ranks_per_gpu = -(-num_ranks // num_gpus)
    env = dict(os.environ)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # many processes per GPU, and this pytest process
    env.pop("XLA_FLAGS", None)  # conftest's CPU device count is not for the workers
    env["DEEP_EP_JAX_GPUS_PER_HOST"] = str(ranks_per_host)
    # No RDMA NIC needed on one machine: NVSHMEM's peer-to-peer transport carries everything.
    env.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra_env or {})
    # Every process sees every GPU (NVSHMEM maps its peers'), JAX uses GPU rank // ranks_per_gpu.
    cmd = [
        sys.executable,
        "-m",
        "deep_ep_jax.launch",
        "-n",
        str(num_ranks),
        "--ranks-per-gpu",
        str(ranks_per_gpu),
        "--all-gpus-visible",
        "--timeout",
        str(timeout - 15),
        *launcher_args,
        "--",
        WORKER,
        case,
    ]
    start = time.time()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return result.returncode, result.stdout + result.stderr, time.time() - start


def _run_hosts_case(case, num_hosts, ranks_per_host, timeout, summary, extra_env=None):
    """Runs worker `case` on num_hosts emulated hosts of ranks_per_host
    ranks (extra_env added to the workers' environment): it must exit 0,
    every rank report OK, and `summary` be printed."""
    num_ranks = num_hosts * ranks_per_host
    code, output, elapsed = _launch(
        num_ranks, timeout=timeout, case=case, ranks_per_host=ranks_per_host, extra_env=extra_env
    )
    assert code == 0, output[-8000:]
    for rank in range(num_ranks):
        assert f"[rank {rank}] process {rank}/{num_ranks}: CASE {case} OK" in output, output[-8000:]
    assert summary.format(num_ranks=num_ranks, num_hosts=num_hosts) in output, output[-8000:]
    print(f"{case} {num_hosts} x {ranks_per_host}: {elapsed:.0f} s")
    return output


SHARED_GPU_SUMMARY = "shared_gpu R={num_ranks} on {num_hosts} hosts: normal region"


@pytest.mark.parametrize("num_ranks", [16, 32])
def test_low_latency_beyond_eight_ranks(num_ranks):
    code, output, elapsed = _launch(num_ranks, timeout=280)
    assert code == 0, output[-8000:]
    for rank in range(num_ranks):
        assert f"[rank {rank}] process {rank}/{num_ranks}: CASE {CASE} OK" in output, output[-8000:]
    # Every program and routing ran: 2 kernels' shapes x 2 formats x 4 routings, on every rank.
    assert output.count(f"large_ep R={num_ranks} ") == num_ranks * 16, output[-8000:]
    print(f"EP {num_ranks}: {elapsed:.0f} s")


@pytest.mark.parametrize("num_hosts,ranks_per_host", [(2, 8), (4, 4), (4, 8), (2, 16)])
def test_normal_mode_across_hosts_beyond_eight_ranks(num_hosts, ranks_per_host):
    _run_hosts_case("shared_gpu", num_hosts, ranks_per_host, 280, SHARED_GPU_SUMMARY)


@pytest.mark.parametrize("num_hosts,ranks_per_host", [(2, 4), (4, 4)])
def test_one_nvlink_domain_across_hosts(num_hosts, ranks_per_host):
    """One NVLink domain over emulated hosts (DEEP_EP_JAX_NVLINK_DOMAIN, as
    NVML's fabric info tells a GB200 NVL72 rack's trays apart and together):
    one node, whose peer memory is NVSHMEM's (nvshmem_ptr, which NVSHMEM maps
    over the NVLink fabric across trays), running the one-node kernels (the
    wide path at 16 ranks); shared_gpu's checks against the oracle."""
    output = _run_hosts_case(
        "shared_gpu",
        num_hosts,
        ranks_per_host,
        280,
        "shared_gpu R={num_ranks} on 1 hosts: normal region",
        extra_env={"DEEP_EP_JAX_NVLINK_DOMAIN": "rack"},
    )
    assert "peer memory NVSHMEM" in output, output[-8000:]


@pytest.mark.parametrize("num_hosts,ranks_per_host", [(1, 2), (2, 1), (2, 2)])
def test_standard_size_against_the_oracle(num_hosts, ranks_per_host):
    """shared_gpu's checks at DeepEP's standard sizes (4096 tokens per rank,
    hidden 7168, top-8, 256 experts; low-latency mode 128 tokens per rank),
    the combine inputs NaN past the received rows: one host's staged kernels
    across processes (CUDA IPC, 1 x 2) and the internode ones (2 x 1, and 2 x 2
    with combine reduced per host)."""
    _run_hosts_case(
        "shared_gpu",
        num_hosts,
        ranks_per_host,
        280,
        "shared_gpu sizes: 4096 tokens per rank, hidden 7168",
        extra_env={"SHARED_GPU_SIZE": "standard"},
    )


@pytest.mark.parametrize(
    "num_ranks,timeout",
    [(2, 200), (8, 200), (16, 280), (36, 400), (72, 560)],
    ids=["R2_forced", "R8_forced", "R16", "R36", "R72"],
)
def test_one_nvlink_domain_wide_kernels(num_ranks, timeout):
    """One node (one host, one NVLink domain: a GB200 NVL72 rack at 72) on
    the single-node kernels' wide path, which lists each token's ranks
    instead of keeping a slot per rank: past 8 ranks always, at 2 and 8
    forced (DEEP_EP_JAX_WIDE_KERNELS=1). shared_gpu's checks (normal mode
    bf16, FP8 and the other wire formats, cached dispatch, low-latency mode)
    against tests/oracle.py. 72 processes on one GPU need a pytest --timeout
    above 560 s."""
    env = {"DEEP_EP_JAX_WIDE_KERNELS": "1"} if num_ranks <= 8 else None
    _run_hosts_case("shared_gpu", 1, num_ranks, timeout, SHARED_GPU_SUMMARY, extra_env=env)


@pytest.mark.parametrize("num_hosts,ranks_per_host", [(2, 2), (2, 4), (4, 2)])
def test_normal_mode_combine_per_host(num_hosts, ranks_per_host):
    """Combine summed per host on the forwarder, then per host at the
    source (bf16 partials), bit for bit as tests/oracle.py's
    gpus_per_host order, at small groups of several hosts of several ranks."""
    _run_hosts_case("shared_gpu", num_hosts, ranks_per_host, 200, SHARED_GPU_SUMMARY)


# Grids and token counts that reach every branch of the pipelined dispatch
# and combine (csrc/kernels/internode.cu, PipelinedMoveKernel and
# PipelinedCombineKernel), and their A/B switch.
PIPELINE_GRIDS = {
    # the serial send and forward kernels, from the same build
    "serial": (2, 2, {"DEEP_EP_JAX_INTERNODE_PIPELINE": "0"}),
    # one block: no room for a sender and a forwarder, the serial kernels run
    "one_block": (2, 2, {"DEEP_EP_JAX_NUM_SMS": "1"}),
    # one channel of 64 tokens: 4 chunks, each tail after the first; a forwarder block with no pair;
    # combine: one row channel of every chunk of the received rows, two forwarder blocks
    "one_channel": (2, 2, {"DEEP_EP_JAX_NUM_SMS": "3", "SHARED_GPU_TOKENS": "64"}),
    # 2 channels of 20 tokens (a full chunk and a part), 3 remote hosts x 2 channels over 2 forwarders
    "four_hosts": (4, 2, {"DEEP_EP_JAX_NUM_SMS": "4", "SHARED_GPU_TOKENS": "40"}),
    # combine: 4 holders per token's host, 2 row channels taking alternate chunks, 3 forwarder blocks
    "two_by_four": (2, 4, {"DEEP_EP_JAX_NUM_SMS": "5", "SHARED_GPU_TOKENS": "48"}),
}


@pytest.mark.parametrize("grid", PIPELINE_GRIDS)
def test_normal_mode_pipeline_grids(grid):
    """Dispatch, cached dispatch and combine across hosts against the oracle
    with the pipelined kernels' roles at small grids, several chunks per
    channel, and with the serial kernels."""
    num_hosts, ranks_per_host, extra_env = PIPELINE_GRIDS[grid]
    _run_hosts_case("shared_gpu", num_hosts, ranks_per_host, 240, SHARED_GPU_SUMMARY, extra_env=extra_env)


def test_pipelined_combine_fits_its_grids():
    """The pipelined combine needs its whole grid resident (its forwarders
    wait for its own senders) and runs its serial kernels otherwise: at the
    default grid and the grids above it runs pipelined, so the tests above
    check it and not only the serial kernels; a grid that cannot fit is refused."""
    from deep_ep_jax import Config, _native

    ext = _native.extension()
    assert getattr(ext, "with_nvshmem", False), "the CUDA extension was built without NVSHMEM"
    num_warps = Config().num_warps
    for num_sms in [Config().num_sms] + [
        int(env["DEEP_EP_JAX_NUM_SMS"]) for _, _, env in PIPELINE_GRIDS.values() if "DEEP_EP_JAX_NUM_SMS" in env
    ]:
        assert ext.internode_combine_pipeline_fits(0, num_sms, num_warps), num_sms
    assert not ext.internode_combine_pipeline_fits(0, 1 << 20, num_warps)


@pytest.mark.parametrize("num_hosts,ranks_per_host", [(1, 2), (1, 8), (2, 2), (2, 4), (2, 8)])
def test_traffic_counters_with_ranks_sharing_gpus(num_hosts, ranks_per_host):
    """The kernels' counters (rows and bytes over NVLink and the network, per
    operation) equal tests/oracle.py's traffic() on every rank: one host's
    staged kernels across processes (CUDA IPC, 1 x 2 and 1 x 8) and the
    internode ones (2 x 2 ... 2 x 8)."""
    _run_hosts_case("traffic", num_hosts, ranks_per_host, 200, "traffic R={num_ranks} on {num_hosts} hosts")


@pytest.mark.parametrize("num_hosts,ranks_per_host", [(1, 4), (2, 2)])
def test_wait_times_with_ranks_sharing_gpus(num_hosts, ranks_per_host):
    """Buffer.wait_times(): the rank that calls low-latency dispatch and combine
    2 s late shows on every other rank's receive counters, in both kinds (worker
    case wait_times): over CUDA IPC (1 x 4) and NVSHMEM (2 x 2)."""
    _run_hosts_case("wait_times", num_hosts, ranks_per_host, 200, "wait_times R={num_ranks}: ok")


@pytest.mark.parametrize("mode", ["kill", "stall"])
@pytest.mark.parametrize("at", ["dispatch", "combine", "between"])
@pytest.mark.parametrize("num_ranks", [8, 16])
def test_masked_rank_with_ranks_sharing_gpus(num_ranks, at, mode):
    """Low-latency mode with Config(mask_failed_ranks=True) on one host: rank 1
    killed (SIGKILL) or stalled at its second dispatch, its second combine or
    between round trips; every other rank masks it within 2x the timeout (10 s;
    a receive waits 1.5x)
    and its results, from that call on, are tests/oracle.py's with rank 1
    masked, bit for bit; the next round trip waits for no one; after
    low_latency_set_mask(zeros) rank 1 is masked again; a stalled rank 1 comes
    back masked, its calls sending and receiving nothing; Buffer.destroy
    meets the survivors only, a stalled rank 1's frees at once (worker case
    masked_rank)."""
    code, output, elapsed = _launch(
        num_ranks,
        timeout=300,
        case="masked_rank",
        ranks_per_host=num_ranks,
        extra_env={"MASKED_RANK_MODE": mode, "MASKED_RANK_AT": at, "MASKED_RANK_TIMEOUT_S": "10"},
        launcher_args=["--keep-going"],
    )
    assert code == (128 + 9 if mode == "kill" else 0), output[-8000:]  # the killed rank's status, the only failure
    for rank in range(num_ranks):
        survived = f"[rank {rank}] process {rank}/{num_ranks}: CASE masked_rank OK" in output
        assert survived == (rank != 1), (rank, output[-8000:])
    came_back = "stalled rank came back masked" in output and "stalled rank destroyed its Buffer" in output
    assert came_back == (mode == "stall"), output[-8000:]
    durations = next(line for line in output.splitlines() if line.startswith("[rank 0]") and "call durations" in line)
    print(f"masked_rank R={num_ranks} {mode} at {at}: {elapsed:.0f} s; {durations}")


@pytest.mark.parametrize("num_hosts,ranks_per_host", [(1, 2), (2, 1), (2, 2)])
def test_sequence_wrap_with_ranks_sharing_gpus(num_hosts, ranks_per_host):
    """Normal mode (dispatch, combine, its cached dispatch, FP8) and low-latency
    mode against tests/oracle.py, the Buffer started just under the 2^31 and
    2^32 wraps (tests/gpu/test_wrap_gpu.py's hook): staged one-host kernels
    over CUDA IPC (1 x 2) and the internode kernels over NVSHMEM (2 x 1, 2 x 2)."""
    _run_hosts_case("shared_gpu_wrap", num_hosts, ranks_per_host, 240, "shared_gpu_wrap R={num_ranks}: ok")


@pytest.mark.parametrize(
    "flags", ["", "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"], ids=["default", "concurrent"]
)
@pytest.mark.parametrize("num_hosts,ranks_per_host", [(1, 2), (2, 1)])
def test_independent_round_trips_with_ranks_sharing_gpus(num_hosts, ranks_per_host, flags):
    """Three normal-mode and two low-latency round trips in one program, which
    only the Buffer's order chain orders, equal each round trip run alone, bit
    for bit, under XLA's default and concurrent command-buffer scheduling:
    staged one-host kernels (CUDA IPC, 1 x 2) and internode ones (2 x 1)."""
    _run_hosts_case(
        "shared_gpu_order",
        num_hosts,
        ranks_per_host,
        200,
        "shared_gpu_order R={num_ranks}: ok",
        extra_env={"XLA_FLAGS": flags} if flags else None,
    )


@pytest.mark.parametrize("num_hosts,ranks_per_host", [(1, 2), (2, 1)])
def test_destroy_right_after_use_with_ranks_sharing_gpus(num_hosts, ranks_per_host):
    """Ten Buffers made, used (low-latency mode last, peers held back before
    their last receive) and destroyed across processes: each Buffer's results
    equal the first's and none stays alive (CUDA IPC 1 x 2, NVSHMEM 2 x 1)."""
    _run_hosts_case("shared_gpu_teardown", num_hosts, ranks_per_host, 240, "shared_gpu_teardown R={num_ranks}: ok")


@pytest.mark.parametrize("num_hosts,ranks_per_host", [(1, 2), (2, 1)])
def test_mesh_in_another_device_order(num_hosts, ranks_per_host):
    """A Buffer under a shard_map over its mesh's devices in another order is
    refused when lowered, before any row moves (worker case mesh_order; it
    gave wrong combine results before); a Buffer made on a mesh in reverse
    process order and used there passes shared_gpu's checks against
    tests/oracle.py: CUDA IPC (1 x 2) and NVSHMEM (2 x 1)."""
    _run_hosts_case("mesh_order", num_hosts, ranks_per_host, 120, "mesh_order backward: refused")
    _run_hosts_case(
        "shared_gpu",
        num_hosts,
        ranks_per_host,
        200,
        "mesh in reverse process order",
        extra_env={"SHARED_GPU_MESH_ORDER": "reversed"},
    )


@pytest.mark.parametrize("num_hosts,ranks_per_host", [(1, 8), (2, 8)])
def test_dropless_with_ranks_sharing_gpus(num_hosts, ranks_per_host):
    """dropless_moe at EP 8 (one host: CUDA IPC) and 16 (two hosts of 8: NVSHMEM across) at hidden 7168
    against tests/oracle.py and the worst-case layer, forward and gradients, bit for bit, in one round and
    several (worker case shared_gpu_dropless)."""
    output = _run_hosts_case(
        "shared_gpu_dropless", num_hosts, ranks_per_host, 400, "shared_gpu_dropless R={num_ranks}: ok"
    )
    print(*(line for line in output.splitlines() if line.startswith("[rank 0]") and "temporaries" in line), sep="\n")
