"""The expert-major CUDA targets (csrc/ffi/expert_major.cc) against the xla
backend and the numpy oracle (tests/oracle.py): the standard case through
dispatch on 2 GPUs, the local targets per rank on 2 GPUs or, where there is
one, on one.

Everything must match bit for bit: the layout (group sizes and offsets, each
pair's row, each row's pair, the drop count), the expanded rows (unused rows
0; FP8 bytes and scales), the reduced rows, the combined output and the
gradient of x. The gradient of the weights is the same JAX code on both
backends, compiled in two programs, so it is compared to float32 rounding.
Before each CUDA run the allocator is handed freed arrays of the outputs'
sizes filled with poison, which it tends to give back for the outputs, so
entries the kernels do not write show up as mismatches.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from jax import lax

import deep_ep_jax
from deep_ep_jax import testing
from deep_ep_jax.backends import reference, reference_expert_major
from deep_ep_jax.backends.cuda import expert_major as cuda_expert_major

pytestmark = pytest.mark.gpu

AXIS = "ep"
bits, assert_bits_equal = testing.bits, testing.assert_bits_equal


TARGETS = ("deep_ep_jax_expert_layout", "deep_ep_jax_expand_rows", "deep_ep_jax_reduce_rows")
LAYOUT_FIELDS = ("group_sizes", "group_offsets", "pair_row", "row_pair", "num_dropped")


@pytest.fixture(scope="module")
def mesh():
    return testing.ep_mesh(2, AXIS, platform="gpu")


@pytest.fixture(scope="module")
def local_mesh():
    """2 ranks, or 1 on a one-GPU host: the local targets exchange nothing."""
    from deep_ep_jax.backends.cuda import lifecycle

    lifecycle.register_ffi_targets()  # for the raw target calls, made without a Buffer
    return testing.ep_mesh(min(2, len(jax.devices("gpu"))), AXIS, platform="gpu")


def expert_rows(layout, expert_x):
    """Exact in bf16 (no rounding for XLA to skip), a different value per row;
    unused rows 1, so a sum that reads one shows it."""
    return jnp.where((layout.row_pair >= 0)[:, None], expert_x * 2, jnp.ones((), expert_x.dtype))


def rank(tree, r):
    return jax.tree.map(lambda a: np.asarray(a[r]), tree)


# The standard case, through the public API ---------------------------------------


@functools.cache
def standard_runner(buffer, mesh, num_experts, alignment):
    """dispatch_expert_major, an exact "expert", reduce alone, combine_expert_major;
    and the gradients of sum(out * c) with respect to x and the weights."""

    def forward(x, idx, w):
        # The worst case, chosen: past Config.dispatch_budget_gib at 2 ranks with alignment 128.
        worst = deep_ep_jax.comm.expert_major.default_num_rows(
            x.shape[0] * buffer.num_ranks, idx.shape[1], num_experts // buffer.num_ranks, alignment
        )
        expert_x, layout, recv_w, handle = deep_ep_jax.dispatch_expert_major(
            x, idx, w, num_experts=num_experts, buffer=buffer, alignment=alignment, num_rows=worst
        )
        expert_y = expert_rows(layout, expert_x)
        out = deep_ep_jax.combine_expert_major(expert_y, recv_w, layout, handle, buffer=buffer)
        return expert_x, layout, recv_w, expert_y, out

    def fn(x, idx, w, c):
        expert_x, layout, recv_w, expert_y, out = forward(x, idx, w)
        reduced = deep_ep_jax.reduce(expert_y, recv_w, layout, backend=buffer.backend)
        loss = lambda x, w: jnp.sum(forward(x, idx, w)[-1].astype(jnp.float32) * c)
        g_x, g_w = jax.grad(loss, argnums=(0, 1))(x, w)
        return expert_x, layout, recv_w, reduced, out, g_x, g_w

    return testing.per_rank(fn, mesh, AXIS, check_vma=True)


@pytest.mark.parametrize(
    "alignment, kind", [(128, "random"), (1, "random"), (128, "one_expert"), (128, "rank_empty"), (1, "minus_one")]
)
def test_standard_case(mesh, buffers, alignment, kind, rng):
    """4096 tokens per rank, hidden 7168, top-8 of 256 experts, 2 ranks; fresh random and skewed routing."""
    cuda, _ = buffers
    args = standard_inputs(int(rng.integers(1 << 30)), mesh.shape[AXIS], 4096, 7168, 256, 8, kind)
    text = standard_runner(cuda, mesh, 256, alignment).lower(*args).as_text()
    assert all(t in text for t in TARGETS), "the CUDA targets must be in the program"
    check_standard_case(mesh, buffers, alignment, 256, args)


def standard_inputs(seed, num_ranks, num_tokens, hidden, num_experts, topk, kind):
    """(x, topk_idx, topk_weights, the loss's cotangent) of every rank, stacked."""
    idx, w = testing.make_routing(seed, num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
    x = testing.random_rows(seed + 1, (num_ranks * num_tokens, hidden))
    c = testing.random_rows(seed + 2, (num_ranks * num_tokens, hidden), jnp.float32)
    return x, jnp.asarray(idx), jnp.asarray(w), c


def check_standard_case(mesh, buffers, alignment, num_experts, args):
    """buffers' first backend against the second (bit for bit but the weights' gradient) and the oracle."""
    cuda, xla = buffers
    x, idx, w, _ = args
    idx, w = np.asarray(idx), np.asarray(w)
    num_ranks = mesh.shape[AXIS]
    (num_tokens, hidden), topk = (x.shape[0] // num_ranks, x.shape[1]), idx.shape[1]
    local_experts = num_experts // num_ranks
    run = standard_runner(cuda, mesh, num_experts, alignment)
    num_worst = num_ranks * num_tokens
    num_rows = deep_ep_jax.comm.expert_major.default_num_rows(num_worst, topk, local_experts, alignment)
    testing.poison_allocator(
        mesh,
        AXIS,
        [
            ((num_rows, hidden), jnp.bfloat16),
            ((num_worst, topk), jnp.int32),
            ((num_rows,), jnp.int32),
            ((num_worst, hidden), jnp.bfloat16),
        ],
    )
    got = run(*args)
    want = standard_runner(xla, mesh, num_experts, alignment)(*args)
    names = ("expert_x", "layout", "recv_w", "reduced", "out", "g_x")
    for name, g, v in zip(names, got[:6], want[:6]):
        for (path, gl), vl in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(v)):
            assert_bits_equal(gl, vl, name + jax.tree_util.keystr(path))
    np.testing.assert_allclose(got[6], want[6], rtol=1e-4, atol=1e-2)
    assert np.abs(np.asarray(got[5], np.float32)).max() > 0 and np.abs(np.asarray(got[6])).max() > 0

    # Against the oracle, which shares no code with the package.
    # On the host: indexing a sharded jax.Array (expert_x[r]) runs an XLA program whose all-reduce turns
    # -0.0 into +0.0 (random_rows holds a few), which the oracle keeps.
    expert_x, layout, recv_w, reduced, out = jax.tree.map(np.asarray, got[:5])
    xs = np.asarray(x).reshape(num_ranks, num_tokens, hidden)
    received = oracle.dispatch(
        xs, idx.reshape(num_ranks, num_tokens, topk), w.reshape(num_ranks, num_tokens, topk), num_experts, num_worst
    )
    combined_rows = np.zeros((num_ranks, num_worst, hidden), np.float32)
    for r in range(num_ranks):
        n = len(received[r]["idx"])
        recv_idx = np.full((num_worst, topk), -1, np.int32)
        recv_idx[:n] = np.reshape(received[r]["idx"], (n, topk))
        recv_x = np.zeros((num_worst, hidden), xs.dtype)
        recv_x[:n] = np.reshape(received[r]["x"], (n, hidden))
        want_layout = oracle.expert_layout(recv_idx, local_experts, alignment, num_rows)
        for field in LAYOUT_FIELDS:
            np.testing.assert_array_equal(getattr(rank(layout, r), field), want_layout[field], err_msg=field)
        assert want_layout["num_dropped"] == 0
        assert_bits_equal(expert_x[r], oracle.expert_expand(recv_x, want_layout["row_pair"], topk), "expert_x (oracle)")
        expert_y = np.where((want_layout["row_pair"] >= 0)[:, None], np.asarray(expert_x[r], np.float32) * 2, 1)
        sums = oracle.expert_reduce(expert_y.astype(xs.dtype), np.asarray(recv_w[r]), want_layout["pair_row"])
        assert_bits_equal(bits(reduced[r]), oracle.bf16_bits(sums), "reduced (oracle)")
        combined_rows[r] = np.asarray(reduced[r], np.float32)
    want_out = oracle.combine(combined_rows, received, num_tokens)
    assert_bits_equal(bits(out).reshape(num_ranks, num_tokens, hidden), oracle.bf16_bits(want_out), "out (oracle)")


# The targets on edge cases ---------------------------------------------------------


@functools.cache
def local_runner(mesh, backend, num_local_experts, alignment, num_rows, fp8):
    """expand, an exact "expert", reduce; the gradient of sum(y * c) in x and w (bf16 rows)."""

    def forward(x, idx, w):
        expert_x, layout = deep_ep_jax.expand(
            x, idx, num_local_experts=num_local_experts, alignment=alignment, num_rows=num_rows, backend=backend
        )
        rows = expert_x[0].astype(jnp.bfloat16) if fp8 else expert_x
        return expert_x, layout, deep_ep_jax.reduce(expert_rows(layout, rows), w, layout, backend=backend)

    def fn(x, idx, w, c):
        expert_x, layout, y = forward(x, idx, w)
        if fp8:
            return expert_x, layout, y
        loss = lambda x, w: jnp.sum(forward(x, idx, w)[-1].astype(jnp.float32) * c)
        return expert_x, layout, y, jax.grad(loss, argnums=(0, 1))(x, w)

    return testing.per_rank(fn, mesh, AXIS, check_vma=True)


def local_ids(seed, num_ranks, num_tokens, num_local_experts, topk, kind):
    """int32 [R * N, K] local ids of every rank's rows ("nothing_on_last_rank":
    at one rank, nothing on its last half of rows)."""
    if kind == "nothing_on_last_rank":
        idx, _ = testing.make_routing(seed, num_ranks * num_tokens, num_local_experts, topk, 1, "random")
        idx[(num_ranks - 1) * num_tokens if num_ranks > 1 else num_tokens // 2 :] = -1
    elif kind == "duplicates":
        idx, _ = testing.make_routing(seed, num_ranks * num_tokens, num_local_experts, topk, 1, "minus_one")
        idx[::3, 1] = idx[::3, 0]
    else:
        idx, _ = testing.make_routing(seed, num_ranks * num_tokens, num_local_experts, topk, 1, kind)
    return idx


# (rows per rank N, top-k, local experts, hidden, alignment, num_rows or None, routing, fp8)
CASES = [
    (1, 1, 1, 8, 1, None, "random", False),
    (3, 2, 2, 8, 4, None, "one_expert", False),
    (129, 4, 8, 64, 8, None, "minus_one", False),
    (1000, 8, 128, 256, 128, None, "random", False),
    (1000, 8, 128, 256, 1, 500, "random", False),  # pairs dropped
    (1000, 8, 64, 256, 128, 640, "one_expert", False),  # one group, cut
    (517, 8, 32, 128, 16, None, "duplicates", False),
    (300, 8, 4096, 64, 4, None, "nothing_on_last_rank", False),  # the most local experts
    (300, 4, 16, 256, 8, None, "minus_one", True),  # FP8: 8-byte scale rows
    (300, 8, 128, 7168, 128, None, "random", True),  # FP8: 224-byte scale rows
]


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[f"N{c[0]}-K{c[1]}-L{c[2]}-H{c[3]}-a{c[4]}-r{c[5]}-{c[6]}" + ("-fp8" if c[7] else "") for c in CASES],
)
def test_targets_match_reference(local_mesh, case):
    mesh, num_ranks = local_mesh, local_mesh.shape[AXIS]
    num_tokens, topk, num_local_experts, hidden, alignment, num_rows, kind, fp8 = case
    seed = sum(case[:5])
    idx = local_ids(seed, num_ranks, num_tokens, num_local_experts, topk, kind)
    x = testing.random_rows(seed + 1, (num_ranks * num_tokens, hidden))
    if fp8:
        x = tuple(reference.quantize_fp8(x))
    w = jnp.asarray(np.random.default_rng(seed + 2).random(idx.shape).astype(np.float32) + 0.1)
    c = testing.random_rows(seed + 3, (num_ranks * num_tokens, hidden), jnp.float32)
    args = (x, jnp.asarray(idx), w, c)
    rows = num_rows or deep_ep_jax.comm.expert_major.default_num_rows(num_tokens, topk, num_local_experts, alignment)

    run = local_runner(mesh, "cuda", num_local_experts, alignment, num_rows, fp8)
    assert all(t in run.lower(*args).as_text() for t in TARGETS)
    testing.poison_allocator(
        mesh,
        AXIS,
        [
            ((rows, hidden), jnp.bfloat16),
            ((num_tokens, topk), jnp.int32),
            ((rows,), jnp.int32),
            ((num_tokens, hidden), jnp.bfloat16),
            ((rows, hidden // 128 or 1), jnp.float32),
        ],
    )
    got = run(*args)
    want = local_runner(mesh, "xla", num_local_experts, alignment, num_rows, fp8)(*args)
    for name, g, v in zip(
        ("expert_x", "layout", "y", "g_x"),
        got[:3] + ((got[3][0],) if not fp8 else ()),
        want[:3] + ((want[3][0],) if not fp8 else ()),
    ):
        for (path, gl), vl in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(v)):
            assert_bits_equal(gl, vl, name + jax.tree_util.keystr(path))
    if not fp8:
        np.testing.assert_allclose(got[3][1], want[3][1], rtol=1e-4, atol=1e-3)

    layout = got[1]
    dropped = 0
    for r in range(num_ranks):
        want_layout = oracle.expert_layout(
            idx.reshape(num_ranks, num_tokens, topk)[r], num_local_experts, alignment, rows
        )
        for field in LAYOUT_FIELDS:
            np.testing.assert_array_equal(getattr(rank(layout, r), field), want_layout[field], err_msg=field)
        dropped += want_layout["num_dropped"]
    assert (dropped > 0) == (num_rows is not None)
    if kind == "nothing_on_last_rank" and num_ranks > 1:
        assert (np.asarray(layout.row_pair[-1]) == -1).all()


@pytest.mark.gpu(min_gpus=1)
def test_raw_ids_skipped_by_the_kernels(local_mesh):
    """The layout kernel itself ignores ids outside [0, L) (the API replaces
    them with -1 first) and places duplicates as two pairs."""
    mesh, num_ranks = local_mesh, local_mesh.shape[AXIS]
    num_local_experts, topk, num_tokens = 24, 8, 777
    rng = np.random.default_rng(5)
    idx = rng.integers(-3, num_local_experts + 3, size=(num_ranks * num_tokens, topk), dtype=np.int32)
    idx[:, 1] = idx[:, 0]
    idx[::5] = -1
    clean = np.where((idx < 0) | (idx >= num_local_experts), -1, idx).astype(np.int32)
    kw = {"num_local_experts": num_local_experts, "alignment": 16, "num_rows": 3000}
    got = testing.per_rank(lambda i: cuda_expert_major.expert_layout(i, **kw), mesh, AXIS)(jnp.asarray(idx))
    want = testing.per_rank(lambda i: reference_expert_major.expert_layout(i, **kw), mesh, AXIS)(jnp.asarray(clean))
    for field in LAYOUT_FIELDS:
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


@pytest.mark.gpu(min_gpus=1)
def test_auto_backend_and_loop(local_mesh):
    """backend="auto" runs the kernels on GPUs (under check_vma=True), also
    inside a jitted fori_loop (command buffers); each iteration routes
    differently and the sums must equal the xla backend's."""
    mesh, num_ranks = local_mesh, local_mesh.shape[AXIS]
    num_tokens, topk, num_local_experts, hidden, iters = 256, 8, 16, 512, 20
    idx = local_ids(9, num_ranks, num_tokens, num_local_experts, topk, "minus_one")
    x = testing.random_rows(10, (num_ranks * num_tokens, hidden))
    w = jnp.asarray(np.random.default_rng(11).random(idx.shape).astype(np.float32))

    def make(backend):
        def fn(x, idx, w):
            def body(i, acc):
                shifted = jnp.where(idx >= 0, (idx + i) % num_local_experts, -1)
                expert_x, layout = deep_ep_jax.expand(
                    x, shifted, num_local_experts=num_local_experts, alignment=8, backend=backend
                )
                y = deep_ep_jax.reduce(expert_rows(layout, expert_x), w, layout, backend=backend)
                # The barrier keeps y's rounding to bf16: XLA on GPUs may drop an f32 -> bf16 -> f32
                # round trip (excess precision), which the kernels' bf16 output cannot.
                return acc + lax.optimization_barrier(y).astype(jnp.float32)

            return lax.fori_loop(0, iters, body, jnp.zeros_like(x, jnp.float32))  # zeros_like: x's vma

        return testing.per_rank(fn, mesh, AXIS, check_vma=True)

    args = (x, jnp.asarray(idx), w)
    auto = make("auto")
    assert all(t in auto.lower(*args).as_text() for t in TARGETS)
    got, want = auto(*args), make("xla")(*args)
    assert_bits_equal(got, want, "loop sums")
    assert np.abs(np.asarray(got)).max() > 0


# One GPU, the standard size: the local targets outside shard_map ----------------


def _distinct_local_ids(rng, num_rows, topk, num_local_experts, kind):
    """[N, K] local ids as one rank receives them: about half the slots name a
    local expert (distinct per row, as top-k), the rest -1; or every row to
    the last expert only; or nothing local."""
    idx = np.full((num_rows, topk), -1, np.int32)
    if kind == "one_expert":
        idx[:, 0] = num_local_experts - 1
    elif kind == "random":
        for n in range(num_rows):
            picks = rng.choice(num_local_experts, topk, replace=False)
            idx[n] = np.where(rng.random(topk) < 0.5, picks, -1)
    return idx


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize(
    "num_local_experts,alignment,kind,num_rows",
    [
        (128, 128, "random", None),
        (128, 1, "random", None),
        (128, 1, "one_expert", None),
        (128, 128, "nothing", None),
        (128, 1, "random", 20000),
        (16, 8, "random", None),
    ],
)
def test_local_targets_standard_size(num_local_experts, alignment, kind, num_rows, rng):
    """expand and reduce on one GPU, 8192 received rows of 7168 (4096 tokens x
    2 ranks), top-8: the CUDA targets against the xla backend bit for bit
    (rows, layout, reduced rows, both gradients) and against the numpy oracle
    (layout, expanded rows, 256 reduced rows); num_rows 20000 drops pairs."""
    from deep_ep_jax.backends.cuda import lifecycle

    lifecycle.register_ffi_targets()
    num_tokens, topk, hidden = 8192, 8, 7168
    idx = jnp.asarray(_distinct_local_ids(rng, num_tokens, topk, num_local_experts, kind))
    x = testing.random_rows(int(rng.integers(1 << 30)), (num_tokens, hidden))
    w = jnp.asarray(rng.random((num_tokens, topk)).astype(np.float32) + 0.1)
    c = testing.random_rows(int(rng.integers(1 << 30)), (num_tokens, hidden))

    def run(backend):
        def forward(x, w):
            expert_x, layout = deep_ep_jax.expand(
                x, idx, num_local_experts=num_local_experts, alignment=alignment, num_rows=num_rows, backend=backend
            )
            expert_y = (expert_x.astype(jnp.float32) * 2).astype(jnp.bfloat16)  # exact in bf16
            return expert_x, layout, deep_ep_jax.reduce(expert_y, w, layout, backend=backend)

        def body(x, w, c):
            (expert_x, layout, y), vjp = jax.vjp(forward, x, w)
            no_layout = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), layout)
            return (expert_x, layout, y) + vjp((jnp.zeros_like(expert_x), no_layout, c))

        return jax.jit(body)(x, w, c)

    got, want = run("cuda"), run("xla")
    for name, g, r in zip(("expert_x", "layout", "y", "grad_x", "grad_w"), got, want):
        for g_leaf, r_leaf in zip(jax.tree.leaves(g), jax.tree.leaves(r)):
            assert_bits_equal(g_leaf, r_leaf, f"{kind}: {name}, cuda against xla")
    expert_x, layout = got[0], got[1]
    want_layout = oracle.expert_layout(np.asarray(idx), num_local_experts, alignment, expert_x.shape[0])
    for field in LAYOUT_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(layout, field)), want_layout[field], err_msg=field)
    if num_rows is not None:
        assert want_layout["num_dropped"] > 0, "this case is meant to drop pairs"
    assert_bits_equal(expert_x, oracle.expert_expand(np.asarray(x), want_layout["row_pair"], topk), "expand vs oracle")
    sample = rng.choice(num_tokens, 256, replace=False)
    expert_y = (np.asarray(expert_x).astype(np.float32) * 2).astype(expert_x.dtype)
    want_y = oracle.expert_reduce(expert_y, np.asarray(w)[sample], want_layout["pair_row"][sample])
    assert_bits_equal(np.asarray(got[2])[sample], want_y.astype(expert_x.dtype), "reduce vs oracle")


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize(
    "num_local_experts,alignment,kind,num_rows",
    [(128, 128, "random", None), (128, 1, "one_expert", None), (128, 128, "nothing", None), (16, 1, "random", 20001)],
)
def test_fp8_rows_transposed(num_local_experts, alignment, kind, num_rows, rng):
    """expand(..., fp8_rows=True) on one GPU, 8192 received rows of 7168, top-8: the expert rows' FP8
    values transposed (Fp8Rows.data_t, which their own kernel gathers from the token rows for the FP8
    weight gradient) equal data.T and the numpy oracle's expansion of the quantized token rows, bit for
    bit, over an allocator left full of NaN; 20001 rows: a partial tile, rows not a multiple of 16 (byte
    stores), pairs dropped."""
    from deep_ep_jax.backends.cuda import lifecycle
    from deep_ep_jax.fp8_quant import quantize_rows

    lifecycle.register_ffi_targets()
    num_tokens, topk, hidden = 8192, 8, 7168
    idx = jnp.asarray(_distinct_local_ids(rng, num_tokens, topk, num_local_experts, kind))
    x = testing.random_rows(int(rng.integers(1 << 30)), (num_tokens, hidden))
    run = jax.jit(
        lambda x: deep_ep_jax.expand(
            x,
            idx,
            num_local_experts=num_local_experts,
            alignment=alignment,
            num_rows=num_rows,
            backend="cuda",
            fp8_rows=True,
        )
    )
    assert "deep_ep_jax_expand_rows_transposed" in run.lower(x).as_text()
    rows = num_rows or deep_ep_jax.comm.expert_major.default_num_rows(num_tokens, topk, num_local_experts, alignment)
    testing.poison_allocator(testing.ep_mesh(1, AXIS, platform="gpu"), AXIS, [((hidden, rows), jnp.float8_e4m3fn)])
    expert_x, layout = run(x)
    assert expert_x.data_t.shape == (hidden, rows)
    data_t = bits(expert_x.data_t)
    np.testing.assert_array_equal(data_t, bits(expert_x.data).T, err_msg=f"{kind}: data_t against data.T")
    want_layout = oracle.expert_layout(np.asarray(idx), num_local_experts, alignment, rows)
    np.testing.assert_array_equal(np.asarray(layout.row_pair), want_layout["row_pair"])
    tokens = bits(jax.jit(quantize_rows)(x)[0])
    want = oracle.expert_expand(tokens, want_layout["row_pair"], topk).T
    np.testing.assert_array_equal(data_t, want, err_msg=f"{kind}: data_t against the oracle")
    assert (data_t != 0).any() == (kind != "nothing")
    if num_rows is not None:
        assert want_layout["num_dropped"] > 0, "this case is meant to drop pairs"


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize(
    "num_local_experts,alignment,kind,num_rows",
    [(128, 128, "random", None), (128, 1, "one_expert", None), (128, 128, "nothing", None), (16, 1, "random", 20001)],
)
def test_quantized_rows_transposed(num_local_experts, alignment, kind, num_rows, rng):
    """The transposed expansion of bf16 token rows, quantized (the fused FP8 weight gradient's operand
    in grouped_matmul_reduce), on one GPU, 8192 rows of 7168, top-8: the CUDA target against the xla
    backend on the GPU (all of it) and the numpy oracle (three 128-column tiles, the last included), bit
    for bit, over an allocator left full of NaN; a fifth of the rows' multipliers 0 (rows of 0 whatever
    the token holds), a few columns saturated."""
    from deep_ep_jax.backends.cuda import lifecycle

    lifecycle.register_ffi_targets()
    num_tokens, topk, hidden = 8192, 8, 7168
    idx = jnp.asarray(_distinct_local_ids(rng, num_tokens, topk, num_local_experts, kind))
    x = testing.random_rows(int(rng.integers(1 << 30)), (num_tokens, hidden))
    _, layout = jax.jit(
        lambda x: deep_ep_jax.expand(
            x, idx, num_local_experts=num_local_experts, alignment=alignment, num_rows=num_rows, backend="cuda"
        )
    )(x)
    rows = layout.num_rows
    m = jnp.asarray(rng.random(rows).astype(np.float32) * (rng.random(rows) > 0.2))
    inverse = rng.random(hidden).astype(np.float32) * 60 + 1
    inverse[[5, hidden - 1]] = 1e5
    inverse = jnp.asarray(inverse)
    testing.poison_allocator(testing.ep_mesh(1, AXIS, platform="gpu"), AXIS, [((hidden, rows), jnp.float8_e4m3fn)])
    got = jax.jit(cuda_expert_major.expand_rows_transposed)(x, layout, m, inverse)
    want = jax.jit(reference_expert_major.expand_rows_transposed)(x, layout, m, inverse)
    assert got.dtype == jnp.float8_e4m3fn and got.shape == (hidden, rows)
    assert_bits_equal(got, want, f"{kind}: cuda against xla")
    cols = np.concatenate(
        [
            np.arange(128),
            128 * int(rng.integers(1, hidden // 128 - 1)) + np.arange(128),
            np.arange(hidden - 128, hidden),
        ]
    )
    values = np.asarray(x, np.float32)[:, cols]
    want_cols = oracle.expert_expand_quantized_t(
        values, np.asarray(layout.row_pair), topk, np.asarray(m), np.asarray(inverse)[cols]
    )
    np.testing.assert_array_equal(
        bits(got)[cols], bits(jnp.asarray(want_cols, jnp.float8_e4m3fn)), err_msg=f"{kind}: cuda against the oracle"
    )
    data = np.asarray(got, np.float32)
    assert (data != 0).any() == (kind != "nothing") and (kind == "nothing" or (np.abs(data[5]) == 448).any())


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("kind", ["random", "one_expert"])
def test_grouped_matmul_reduce_fp8(kind, rng):
    """grouped_matmul_reduce with FP8 weight gradients (Mosaic GPU kernels; its backward quantizes the
    token rows' gradient once and gathers it) against reduce(grouped_matmul(...)) on one GPU, 4096 rows
    of 2048 into 7168, top-8 over 8 local experts: the output and the pair weights' gradient bit for
    bit; the rows' and experts' gradients as close to float32 maths (within 6%) as the two calls'."""
    from deep_ep_jax.experts.grouped_gemm import fp8_weights

    num_tokens, topk, local_experts, hidden, out = 4096, 8, 8, 2048, 7168
    idx = jnp.asarray(_distinct_local_ids(rng, num_tokens, topk, local_experts, kind))
    x = testing.random_rows(int(rng.integers(1 << 30)), (num_tokens, hidden))
    w_e = testing.random_rows(int(rng.integers(1 << 30)), (local_experts, hidden, out)) * 0.02
    w = jnp.asarray(rng.random((num_tokens, topk)).astype(np.float32))
    c = testing.random_rows(int(rng.integers(1 << 30)), (num_tokens, out), jnp.float32)

    def run(mode):
        def layer(x, w_e, w):
            expert_x, layout = deep_ep_jax.expand(
                x, idx, num_local_experts=local_experts, alignment=128, backend="cuda"
            )
            sizes = layout.padded_group_sizes(128)
            if mode == "exact":
                y = deep_ep_jax.grouped_matmul(
                    expert_x.astype(jnp.float32),
                    w_e.astype(jnp.float32),
                    sizes,
                    backend="xla",
                    valid_sizes=layout.group_sizes,
                )
                return deep_ep_jax.reduce(y.astype(jnp.bfloat16), w, layout, backend="cuda")
            kwargs = dict(
                aligned_groups=True,
                valid_sizes=layout.group_sizes,
                fp8_weights=fp8_weights(w_e, weight_grad=True),
            )
            if mode == "fused":
                return deep_ep_jax.grouped_matmul_reduce(
                    expert_x, w_e, sizes, w, layout, backend="cuda", matmul_backend="cuda", **kwargs
                )
            return deep_ep_jax.reduce(
                deep_ep_jax.grouped_matmul(expert_x, w_e, sizes, backend="cuda", **kwargs), w, layout, backend="cuda"
            )

        loss = lambda x, w_e, w: jnp.sum(layer(x, w_e, w).astype(jnp.float32) * c)
        step = jax.jit(lambda x, w_e, w: (layer(x, w_e, w), jax.grad(loss, argnums=(0, 1, 2))(x, w_e, w)))
        if mode == "fused":
            assert "deep_ep_jax_expand_rows_transposed" in step.lower(x, w_e, w).as_text()
        return step(x, w_e, w)

    (y, grads), (y2, grads2), (_, exact) = run("fused"), run("two calls"), run("exact")
    assert np.abs(np.asarray(y, np.float32)).max() > 0
    assert_bits_equal(y, y2, f"{kind}: output")
    assert_bits_equal(grads[2], grads2[2], f"{kind}: the pair weights' gradient")
    for name, a, b, e in zip(("rows", "experts"), grads[:2], grads2[:2], exact[:2]):
        a, b, e = (np.asarray(v, np.float32) for v in (a, b, e))
        error, error2 = np.linalg.norm(a - e) / np.linalg.norm(e), np.linalg.norm(b - e) / np.linalg.norm(e)
        assert 0 < error < 0.06 and error < 1.25 * error2, (kind, name, error, error2)


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("kind", ["minus_one", "one_expert"])
def test_fp8_rows_match_rows_quantized_in_the_matmul(kind, rng):
    """dispatch_expert_major(fp8_rows=True) (rows sent and expanded as FP8) into the FP8 grouped matmul
    (Mosaic GPU kernels, FP8 weight gradient), then combine_expert_major, on the cuda backend: the output
    and the gradients of x, the weights and the experts equal, bit for bit, those of bf16 rows quantized
    inside the matmul. On the local GPUs (one rank each, at most 2): 4096 tokens of 7168 per rank, top-8,
    32 experts per rank."""
    from deep_ep_jax.experts.grouped_gemm import fp8_weights

    num_ranks = min(jax.device_count(), 2)
    num_tokens, hidden, local_experts, topk = 4096, 7168, 32, 8
    num_experts = num_ranks * local_experts
    mesh = testing.ep_mesh(num_ranks, AXIS, platform="gpu")
    idx, w = testing.make_routing(
        int(rng.integers(1 << 30)), num_ranks * num_tokens, num_experts, topk, num_ranks, kind
    )
    x = testing.random_rows(int(rng.integers(1 << 30)), (num_ranks * num_tokens, hidden))
    w_e = testing.random_rows(int(rng.integers(1 << 30)), (num_experts, hidden, hidden)) * 0.02
    c = testing.random_rows(int(rng.integers(1 << 30)), (num_ranks * num_tokens, hidden), jnp.float32)
    with deep_ep_jax.Buffer(mesh, AXIS, backend="cuda") as buffer:

        def run(fp8_rows):
            def layer(x, idx, w, w_e):
                expert_x, layout, recv_w, handle = deep_ep_jax.dispatch_expert_major(
                    x, idx, w, num_experts=num_experts, buffer=buffer, alignment=128, fp8_rows=fp8_rows
                )
                expert_y = deep_ep_jax.grouped_matmul(
                    expert_x,
                    w_e,
                    layout.padded_group_sizes(128),
                    backend="cuda",
                    aligned_groups=True,
                    valid_sizes=layout.group_sizes,
                    fp8_weights=fp8_weights(w_e, weight_grad=True),
                )
                return deep_ep_jax.combine_expert_major(expert_y, recv_w, layout, handle, buffer=buffer)

            def body(x, idx, w, w_e, c):
                loss = lambda x, w, w_e: jnp.sum(layer(x, idx, w, w_e).astype(jnp.float32) * c)
                return (layer(x, idx, w, w_e),) + jax.grad(loss, argnums=(0, 1, 2))(x, w, w_e)

            return testing.per_rank(body, mesh, AXIS, check_vma=True)(x, jnp.asarray(idx), jnp.asarray(w), w_e, c)

        got, want = run(True), run(False)
    for name, g, r in zip(("out", "grad x", "grad weights", "grad experts"), got, want):
        assert np.abs(np.asarray(r, np.float32)).max() > 0, f"{kind}: {name} is all zeros"
        assert_bits_equal(g, r, f"{kind}: {name}, FP8 rows sent against quantized in the matmul")
