"""Kernels correct under any run length, and teardown that never races a
peer (issue 21), on all local GPUs, against the xla backend bit for bit.

Sequence numbers: every mode counts its calls in 32 bits and compares its
flags against that count. The test hook `_C.set_sequence_for_testing` starts
a Buffer as if just under 2^31 calls had run (where a signed compare sees the
next number as smaller than every flag) or just under 2^32 (where the number
wraps to 0, and staged mode's reset flags used to be 0), and several programs
run across the wrap, the wrap falling on each call of the program in turn:
normal mode (direct and staged: dispatch, combine, cached dispatch) and
low-latency mode (whole operations and split halves), each on fresh inputs.
Before every call all ranks but 0 are held back (`straggle`), so rank 0's
waits really wait: a wait that passes too early reads stale counts, buffers
or rows and the results differ, instead of winning its race by luck. Short
timeouts (Config.timeout_s) turn a wait that never passes into a quick error.
On the old kernels (signed compares, staged flags reset to 0) these fail: at
2^31 every wait passes at once; past 2^32 - 1 (negative numbers) staged mode's
zeroed chunk records and row flags read as ready. tests/multiprocess_worker.py
runs the same checks across processes (CUDA IPC) and over NVSHMEM.

Teardown: Buffers are made, used (low-latency last) and destroyed while the
other ranks still run their last receive, which writes its "freed" flag into
rank 0's region at its very end; destroy must wait for every device before
freeing any.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_low_latency_gpu as ll_suite
import test_normal_gpu as normal_suite
from jax import lax

import deep_ep_jax
from deep_ep_jax import _native, testing
from deep_ep_jax.distributed import multiprocess

pytestmark = pytest.mark.gpu

AXIS = "ep"
TIMEOUT_S = 10  # a wait that never passes fails in seconds, not minutes
WRAPS = (2**31, 2**32)
# Shapes: normal mode, then low-latency mode (M = max tokens per rank).
NUM_TOKENS, HIDDEN, TOPK = 256, 2048, 8
LL_TOKENS, LL_MAX_TOKENS = 64, 128
NORMAL_CALLS, LL_CALLS = 3, 2  # calls per program
NUM_PROGRAMS = 3  # programs per start: the first crosses the wrap, the others run past it
STRAGGLE_UPDATES = 1 << 22


def num_experts(mesh):
    return 16 * mesh.shape[AXIS]


# Helpers ----------------------------------------------------------------------


def straggle(after, before):
    """Returns (before, check): `before` tied after a scatter-add that itself
    runs after `after`. On every rank but 0 its STRAGGLE_UPDATES updates all
    add to one element (contended atomics: milliseconds), on rank 0 to
    distinct elements (fast), so rank 0 reaches the next call first. check is
    the scatter's total (STRAGGLE_UPDATES on every rank), an output so the
    scatter stays in the program."""
    after, base = lax.optimization_barrier((after, lax.iota(jnp.int32, STRAGGLE_UPDATES)))
    hot = jnp.where(lax.axis_index(AXIS) == 0, base, 0)
    counts = jnp.zeros(STRAGGLE_UPDATES, jnp.int32).at[hot].add(1)
    before, counts = lax.optimization_barrier((before, counts))
    return before, counts.sum()


_barriers = itertools.count()


def start_sequence_at(buffer, seq):
    """Sets every sequence number of the CUDA Buffer as if `seq` calls had run.
    With peers in other processes, every process synchronises and meets the
    others before and after, so no peer writes a flag meanwhile."""
    ext = _native.extension()
    seq %= 2**32  # the counters are 32 bits: 2^32 calls in is 0 calls in
    if buffer.store_key is None:  # no peers in other processes
        ext.set_sequence_for_testing(buffer.buffer_id, seq)  # synchronises every device first
        return
    name = f"{buffer.store_key}/test-sequence/{next(_barriers)}"
    ext.synchronize_buffer(buffer.buffer_id)
    multiprocess.barrier(f"{name}/before", buffer.config.timeout_s)
    ext.set_sequence_for_testing(buffer.buffer_id, seq)
    multiprocess.barrier(f"{name}/after", buffer.config.timeout_s)


def start_for(wrap, crossing, *, low_latency):
    """The start after which call `crossing` of the next program is the first at
    or past `wrap` (normal mode numbers its calls from seq + 1, low-latency mode
    from seq)."""
    return wrap - crossing - (0 if low_latency else 1)


def cuda_buffer(mesh, *, staged=False, num_nvl_bytes=None):
    """Both regions, sized for these shapes; `staged` only on one process."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DEEP_EP_JAX_STAGED", "1" if staged else "0")
        return deep_ep_jax.Buffer(
            mesh,
            AXIS,
            backend="cuda",
            low_latency_mode=True,
            num_max_dispatch_tokens_per_rank=LL_MAX_TOKENS,
            hidden=HIDDEN,
            num_experts=num_experts(mesh),
            num_nvl_bytes=num_nvl_bytes,
            config=deep_ep_jax.Config(timeout_s=TIMEOUT_S),
        )


def xla_buffer(mesh):
    return deep_ep_jax.Buffer(
        mesh, AXIS, backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=LL_MAX_TOKENS
    )


def normal_calls(buffer, num_experts, x, idx, w, y):
    """Dispatch, combine, cached dispatch (NORMAL_CALLS calls), each after a straggle."""
    (x, idx, w), c0 = straggle(x, (x, idx, w))
    recv_x, recv_idx, recv_w, handle = deep_ep_jax.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
    (y, handle, recv_w), c1 = straggle(recv_x, (y, handle, recv_w))
    out, out_w = deep_ep_jax.combine(y, handle, recv_w, buffer=buffer)
    (x, w, handle), c2 = straggle((out, out_w), (x, w, handle))
    cached_xs, cached_w = buffer.ops.cached_dispatch((x,), w, handle, buffer=buffer)
    return recv_x, recv_idx, recv_w, handle, out, out_w, cached_xs, cached_w, jnp.stack([c0, c1, c2])


@functools.cache
def normal_runner(buffer, mesh):
    return testing.per_rank(functools.partial(normal_calls, buffer, num_experts(mesh)), mesh, AXIS)


def check_normal_across_wrap(mesh, buffers, wrap, crossing):
    """NUM_PROGRAMS programs of NORMAL_CALLS calls from just under `wrap`, call
    `crossing` of the first being the first at or past it; each equals the
    reference's, bit for bit."""
    cuda, xla = buffers
    num_ranks = mesh.shape[AXIS]
    start_sequence_at(cuda, start_for(wrap, crossing, low_latency=False))
    for program in range(NUM_PROGRAMS):
        seed = 1000 * crossing + 10 * program + (wrap == 2**32)
        x = normal_suite.make_x(seed, num_ranks, NUM_TOKENS, HIDDEN, False)
        idx, w = normal_suite.routing(seed, num_ranks, NUM_TOKENS, num_experts(mesh), TOPK, "minus_one")
        rows = NUM_TOKENS * num_ranks
        y = testing.random_rows(seed + 1, (num_ranks * rows, HIDDEN))
        testing.poison_allocator(
            mesh,
            normal_suite.AXIS,
            [
                ((rows, HIDDEN), jnp.bfloat16),
                ((rows, TOPK), jnp.int32),
                ((rows, TOPK), jnp.float32),
                ((rows,), jnp.int32),
                ((NUM_TOKENS, HIDDEN), jnp.bfloat16),
                ((NUM_TOKENS, TOPK), jnp.float32),
            ],
        )
        got = normal_runner(cuda, mesh)(x, idx, w, y)
        want = normal_runner(xla, mesh)(x, idx, w, y)
        try:
            normal_suite.check_same(got[:8], want[:8], fp8=False)
        except AssertionError as e:
            raise AssertionError(f"program {program} (wrap {wrap} at call {crossing} of the first): {e}") from e
        np.testing.assert_array_equal(np.asarray(got[8]), STRAGGLE_UPDATES)


def low_latency_calls(buffer, num_experts, split, x, idx, w):
    """Dispatch and combine (LL_CALLS operations), each send after a straggle;
    split halves have the other ranks held back between send and receive too."""

    def between(pending, x):
        if not split:
            return pending, jnp.int32(STRAGGLE_UPDATES)
        pending, (_, check) = deep_ep_jax.low_latency_overlap(pending, lambda x: straggle(x, x), x)
        return pending, check

    kw = dict(buffer=buffer, num_max_dispatch_tokens_per_rank=LL_MAX_TOKENS, num_experts=num_experts)
    (x, idx), c0 = straggle(x, (x, idx))
    if split:
        pending = deep_ep_jax.low_latency_dispatch_send(x, idx, **kw)
        pending, c1 = between(pending, x)
        recv_x, count, handle = deep_ep_jax.low_latency_dispatch_recv(pending, buffer=buffer)
    else:
        (recv_x, count, handle), c1 = deep_ep_jax.low_latency_dispatch(x, idx, **kw), jnp.int32(STRAGGLE_UPDATES)
    xs = tuple(recv_x)
    y = ll_suite._expert_outputs(xs, num_experts // buffer.num_ranks, seed=5)
    (y, handle, idx, w), c2 = straggle(y, (y, handle, idx, w))
    if split:
        pending = deep_ep_jax.low_latency_combine_send(y, idx, w, handle, buffer=buffer)
        pending, c3 = between(pending, y)
        out = deep_ep_jax.low_latency_combine_recv(pending, buffer=buffer)
    else:
        out, c3 = deep_ep_jax.low_latency_combine(y, idx, w, handle, buffer=buffer), jnp.int32(STRAGGLE_UPDATES)
    return xs, count, handle, out, y, jnp.stack([c0, c1, c2, c3])


@functools.cache
def low_latency_runner(buffer, mesh, split):
    return testing.per_rank(functools.partial(low_latency_calls, buffer, num_experts(mesh), split), mesh, AXIS)


def check_low_latency_across_wrap(mesh, buffers, wrap, crossing, split):
    """As check_normal_across_wrap, for LL_CALLS low-latency operations (FP8 dispatch, combine)."""
    cuda, xla = buffers
    experts = num_experts(mesh)
    start_sequence_at(cuda, start_for(wrap, crossing, low_latency=True))
    for program in range(NUM_PROGRAMS):
        seed = 2000 + 1000 * crossing + 10 * program + (wrap == 2**32) + 100 * split
        x, idx, w = ll_suite._inputs(seed, mesh, LL_TOKENS, HIDDEN, experts, TOPK, "minus_one")
        ll_suite._poison_outputs(mesh, experts, LL_MAX_TOKENS, HIDDEN, LL_TOKENS, True)
        got = jax.tree.map(np.asarray, low_latency_runner(cuda, mesh, split)(x, idx, w))
        want = jax.tree.map(np.asarray, low_latency_runner(xla, mesh, split)(x, idx, w))
        (gxs, gcount, gh, gout, gy, gcheck), (wxs, wcount, wh, wout, wy, _) = got, want
        ll_suite._assert_dispatch_equal((gxs, gcount, gh), (wxs, wcount, wh))
        ll_suite._assert_combine_equal(gout, wout, explain=((gy, gh), (wy, wh), (idx, w, experts)))
        np.testing.assert_array_equal(gcheck, STRAGGLE_UPDATES)


# Tests ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(mesh):
    return xla_buffer(mesh)


@pytest.fixture(scope="module")
def direct(mesh):
    buffer = cuda_buffer(mesh)
    assert buffer.backend == "cuda" and not buffer.staged
    yield buffer
    buffer.destroy()


@pytest.fixture(scope="module")
def staged(mesh):
    buffer = cuda_buffer(mesh, staged=True)
    assert buffer.backend == "cuda" and buffer.staged
    yield buffer
    buffer.destroy()


def test_set_sequence_for_testing_checks_its_arguments(direct):
    ext = _native.extension()
    with pytest.raises(ValueError, match="seq must be in"):
        ext.set_sequence_for_testing(direct.buffer_id, 2**32)
    with pytest.raises(ValueError, match="seq must be in"):
        ext.set_sequence_for_testing(direct.buffer_id, -(2**31) - 1)
    with pytest.raises(ValueError, match="does not exist"):
        ext.set_sequence_for_testing(10**9, 0)


@pytest.mark.parametrize("path", ["direct", "staged"])
@pytest.mark.parametrize("crossing", range(NORMAL_CALLS))
@pytest.mark.parametrize("wrap", WRAPS)
def test_normal_across_wrap(request, mesh, reference, path, wrap, crossing):
    check_normal_across_wrap(mesh, (request.getfixturevalue(path), reference), wrap, crossing)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("crossing", range(LL_CALLS))
@pytest.mark.parametrize("wrap", WRAPS)
def test_low_latency_across_wrap(mesh, direct, reference, wrap, crossing, split):
    check_low_latency_across_wrap(mesh, (direct, reference), wrap, crossing, split)


def teardown_calls(buffer, num_experts, x, idx, w, y, ll_x, ll_idx, ll_w):
    """A normal-mode round trip, then low-latency dispatch and combine in split
    halves, the other ranks held back between the combine's halves: rank 0's
    results are ready while the others have still to receive."""
    recv_x, _, recv_w, handle = deep_ep_jax.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
    out, out_w = deep_ep_jax.combine(y, handle, recv_w, buffer=buffer)
    _, (ll_x, ll_idx, ll_w) = lax.optimization_barrier(((out, out_w), (ll_x, ll_idx, ll_w)))  # low-latency last
    xs, count, ll_handle, ll_out, ll_y, _ = low_latency_calls(buffer, num_experts, True, ll_x, ll_idx, ll_w)
    return recv_x, handle.num_recv_tokens, out, out_w, xs, count, ll_handle, ll_out


def test_destroy_right_after_use(mesh, reference):
    """20 Buffers, each made, used (normal mode, then low-latency mode last),
    and destroyed as soon as rank 0's last output is ready, while the other
    ranks still run their last receive; every result is checked afterwards.
    The old destroy synchronised and freed one device at a time: the other
    ranks' receives then wrote their freed flags into rank 0's freed region."""
    num_ranks, experts = mesh.shape[AXIS], num_experts(mesh)
    ext = _native.extension()
    live = ext.num_live_buffers()
    first_device = mesh.devices.flat[0]
    for i in range(20):
        x = testing.random_rows(3 * i, (num_ranks * NUM_TOKENS, HIDDEN))
        idx, w = normal_suite.routing(3 * i, num_ranks, NUM_TOKENS, experts, TOPK, "random")
        y = testing.random_rows(3 * i + 1, (num_ranks * NUM_TOKENS * num_ranks, HIDDEN))
        ll = ll_suite._inputs(3 * i + 2, mesh, LL_TOKENS, HIDDEN, experts, TOPK, "random")
        args = (x, idx, w, y, *ll)
        buffer = cuda_buffer(mesh)
        got = testing.per_rank(functools.partial(teardown_calls, buffer, experts), mesh, AXIS)(*args)
        last = got[-1]  # the low-latency combine's output
        next(s for s in last.addressable_shards if s.device == first_device).data.block_until_ready()
        buffer.destroy()
        got = jax.tree.map(np.asarray, got)
        want = jax.tree.map(np.asarray, _teardown_reference(reference, mesh)(*args))
        recv_x, num_recv, out, out_w, xs, count, ll_handle, ll_out = got
        w_recv_x, w_num_recv, w_out, w_out_w, w_xs, w_count, w_ll_handle, w_ll_out = want
        np.testing.assert_array_equal(num_recv, w_num_recv)
        for r, n in enumerate(num_recv):
            normal_suite.assert_bits_equal(recv_x[r, :n], w_recv_x[r, :n], f"recv_x of rank {r} (buffer {i})")
        normal_suite.assert_bits_equal(out, w_out, f"combine out (buffer {i})")
        normal_suite.assert_bits_equal(out_w, w_out_w, f"combine out_weights (buffer {i})")
        ll_suite._assert_dispatch_equal((xs, count, ll_handle), (w_xs, w_count, w_ll_handle))
        ll_suite._assert_combine_equal(ll_out, w_ll_out)
    assert ext.num_live_buffers() == live


@functools.cache
def _teardown_reference(buffer, mesh):
    return testing.per_rank(functools.partial(teardown_calls, buffer, num_experts(mesh)), mesh, AXIS)
