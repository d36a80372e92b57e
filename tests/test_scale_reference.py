"""The reference (xla) backend beyond 8 ranks: EP groups of 16 and 64
virtual CPU devices against tests/oracle.py: normal-mode dispatch, layout and
combine (bf16, and FP8 pairs), their gradients, and low-latency dispatch and
combine, with fresh random and skewed routing (all tokens to one expert, a
rank that receives nothing, -1 entries, ids out of range).

XLA fixes the number of CPU devices per process (tests/conftest.py asks for
8), so each group size runs in a process of its own (all started together,
before the first test waits for its own): this file run as a script,
`XLA_FLAGS=--xla_force_host_platform_device_count=16 python
tests/test_scale_reference.py 16 <seed> normal ...` (prints "CASE <name> OK").
"""

import sys
import time

import numpy as np
import pytest
from script_run import session_items, start_script

CASES = ("normal", "fp8", "gradients", "low_latency")

TOKENS, HIDDEN, TOPK = 4, 128, 8  # per rank; small, so that 64 ranks stay quick


@pytest.fixture(scope="module")
def workers(request):
    """{group size: (seed, Background)} for the group sizes this session runs, started together: one
    process's compiles leave a core idle part of the time, which the other's fill."""
    sizes = {
        item.callspec.params["num_ranks"] for item in session_items(request, "test_reference_backend_beyond_8_ranks")
    }
    started = {}
    try:
        for num_ranks in sorted(sizes, reverse=True):  # the longest first
            seed = int(np.random.SeedSequence().entropy % (1 << 31))  # fresh per run; printed on failure
            started[num_ranks] = seed, start_script(__file__, num_ranks, seed, *CASES, devices=num_ranks)
        yield started
    finally:
        for _, worker in started.values():
            worker.stop()


@pytest.mark.parametrize("num_ranks", [16, 64])  # 64: past 32 ranks, the rank masks' second word
def test_reference_backend_beyond_8_ranks(num_ranks, workers):
    seed, worker = workers[num_ranks]
    code, stdout, stderr = worker.result(timeout=300)
    output = stdout + stderr
    assert code == 0, f"seed {seed}:\n{output[-6000:]}"
    for case in CASES:
        assert f"CASE {case} OK" in stdout, f"seed {seed}:\n{output[-6000:]}"


# ---------------------------------------------------------------------------
# The worker: runs in the subprocess, with num_ranks CPU devices.


def _np(a):
    """numpy, with bf16 and FP8 as float32 (exactly; converted on the host)."""
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype.name in ("bfloat16", "float8_e4m3fn") else a


def _shards(a, num_ranks):
    """Global [R * n, ...] -> numpy [R, n, ...]."""
    a = _np(a)
    return a.reshape((num_ranks, -1) + a.shape[1:])


def _bf16(a):
    """float32 numpy rounded to bf16, back as float32."""
    import jax.numpy as jnp

    return np.asarray(a, np.float32).astype(jnp.bfloat16).astype(np.float32)


def _padded(rows, num_rows, shape):
    """The oracle's list of rows as [num_rows, *shape], zeros past the end."""
    out = np.zeros((num_rows,) + shape, np.float32)
    if rows:
        out[: len(rows)] = np.reshape(rows, (len(rows),) + shape)
    return out


class Worker:
    def __init__(self, num_ranks, seed):
        import jax
        import jax.numpy as jnp

        import deep_ep_jax as dej
        from deep_ep_jax import testing as dt

        assert jax.device_count("cpu") == num_ranks, (jax.devices("cpu"), num_ranks)
        self.jax, self.jnp, self.dej, self.dt = jax, jnp, dej, dt
        self.num_ranks = num_ranks
        self.rng = np.random.default_rng(seed)
        self.mesh = dt.ep_mesh(num_ranks, platform="cpu")

    def put(self, a):
        """A host array split over the ranks along its first axis (no compiled resharding)."""
        sharding = self.jax.sharding.NamedSharding(self.mesh, self.jax.sharding.PartitionSpec("ep"))
        return self.jax.device_put(a, sharding)

    def rows(self, shape, dtype=None, wide=False):
        """Fresh standard normal rows (bf16 unless dtype), split over the ranks.
        wide: half the values +-2^24, which cancel in sums; a small value added
        while such a sum is large is lost, so float32 sums in another order
        come out different (what checks a summation order)."""
        a = self.rng.standard_normal(shape, np.float32)
        if wide:
            a = np.where(self.rng.random(shape) < 0.5, np.sign(a) * np.float32(1 << 24), a)
        return self.put(a.astype(dtype or self.jnp.bfloat16))

    def routing(self, num_experts, kind, num_tokens=TOKENS):
        seed = int(self.rng.integers(1 << 30))
        idx, w = self.dt.make_routing(seed, self.num_ranks * num_tokens, num_experts, TOPK, self.num_ranks, kind)
        return self.put(idx), self.put(w)

    # Normal mode ---------------------------------------------------------

    def case_normal(self):
        R, dej = self.num_ranks, self.dej
        num_experts = 2 * R
        buffer = dej.Buffer(self.mesh, "ep", backend="xla", hidden=HIDDEN, num_experts=num_experts)
        for worst, kinds in ((None, self.dt.ROUTING_KINDS), (TOKENS * R // 4, ("random", "one_expert"))):
            rows = worst or TOKENS * R

            def step(x, idx, w, y, worst=worst):
                recv_x, recv_idx, recv_w, handle = dej.dispatch(
                    x, idx, w, num_experts=num_experts, buffer=buffer, num_worst_tokens=worst
                )
                layout = dej.get_dispatch_layout(idx, num_experts=num_experts, buffer=buffer)
                out, out_w = dej.combine(y, handle, recv_w, buffer=buffer)
                return recv_x, recv_idx, recv_w, handle, layout, out, out_w

            run = self.dt.per_rank(step, self.mesh, "ep")
            for kind in kinds:
                idx, w = self.routing(num_experts, kind)
                x = self.rows((R * TOKENS, HIDDEN))
                y = self.rows((R * rows, HIDDEN), wide=True)
                outs = run(x, idx, w, y)
                self.check_normal(num_experts, rows, kind, (x, idx, w, y), outs)
            print(f"normal num_worst_tokens={worst}: {', '.join(kinds)} ok", flush=True)

    def check_normal(self, num_experts, rows, kind, inputs, outs):
        R = self.num_ranks
        xs, idxs, ws, ys = (_shards(a, R) for a in inputs)
        # Per rank [R, ...]: bf16 as float32.
        recv_x, recv_idx, recv_w, handle, layout, out, out_w = self.jax.tree.map(_np, outs)
        expected = oracle.dispatch(xs, idxs, ws, num_experts, rows)
        what = f"{kind}, {rows} rows"
        for r in range(R):
            want = expected[r]
            n = len(want["x"])
            assert int(handle.num_recv_tokens[r]) == n, (what, r)
            assert int(handle.num_dropped_tokens[r]) == want["total"] - n, (what, r)
            np.testing.assert_array_equal(recv_x[r, :n], _padded(want["x"], n, (HIDDEN,)), err_msg=f"{what} rank {r}")
            np.testing.assert_array_equal(recv_idx[r, :n], np.reshape(want["idx"], (n, TOPK)), err_msg=what)
            np.testing.assert_array_equal(recv_w[r, :n], np.reshape(want["w"], (n, TOPK)), err_msg=what)
            np.testing.assert_array_equal(handle.recv_src_idx[r, :n], want["src"], err_msg=what)
            np.testing.assert_array_equal(handle.recv_src_rank[r, :n], want["rank"], err_msg=what)
            assert (recv_idx[r, n:] == -1).all() and (recv_w[r, n:] == 0).all(), (what, r)
            assert (handle.recv_src_idx[r, n:] == -1).all() and (handle.recv_src_rank[r, n:] == -1).all(), (what, r)
            local = np.reshape(want["idx"], (n, TOPK))
            per_local_expert = [(local == e).any(1).sum() for e in range(num_experts // R)]
            np.testing.assert_array_equal(handle.num_recv_tokens_per_expert[r], per_local_expert, err_msg=what)
            per_rank, per_expert, in_rank = oracle.layout(idxs[r], num_experts, R)
            np.testing.assert_array_equal(layout[0][r], per_rank, err_msg=what)
            np.testing.assert_array_equal(layout[1][r], per_expert, err_msg=what)
            np.testing.assert_array_equal(layout[2][r], in_rank, err_msg=what)
            np.testing.assert_array_equal(handle.is_token_in_rank[r], in_rank, err_msg=what)
        if kind == "rank_empty":
            assert int(handle.num_recv_tokens[-1]) == 0 and int(handle.num_recv_tokens.sum()) > 0
        if kind == "one_expert":
            assert int(handle.num_recv_tokens.sum()) == int(handle.num_recv_tokens[0]) > 0
        # Combine: float32 sums in rank order, rounded once to bf16; the weights likewise.
        want = _bf16(oracle.combine(ys, expected, TOKENS))
        np.testing.assert_array_equal(out, want, err_msg=what)
        w_rows = np.stack([_padded(expected[r]["w"], rows, (TOPK,)) for r in range(R)])
        np.testing.assert_array_equal(out_w, oracle.combine(w_rows, expected, TOKENS))

    def case_fp8(self):
        """FP8 pairs travel bit for bit: data and scales rows as the oracle places them."""
        R, dej, jnp = self.num_ranks, self.dej, self.jnp
        num_experts = 2 * R
        buffer = dej.Buffer(self.mesh, "ep", backend="xla", hidden=HIDDEN)

        def step(data, scales, idx, w):
            (recv_data, recv_scales), _, _, handle = dej.dispatch(
                (data, scales), idx, w, num_experts=num_experts, buffer=buffer
            )
            return recv_data, recv_scales, handle.num_recv_tokens

        run = self.dt.per_rank(step, self.mesh, "ep")
        for kind in ("random", "one_expert", "rank_empty", "minus_one"):
            idx, w = self.routing(num_experts, kind)
            data = self.put((self.rng.standard_normal((R * TOKENS, HIDDEN), np.float32) * 8).astype(jnp.float8_e4m3fn))
            scales = self.put(self.rng.random((R * TOKENS, HIDDEN // 128), np.float32) + 0.5)
            recv_data, recv_scales, num_recv = run(data, scales, idx, w)
            num_recv = np.asarray(num_recv)  # indexed per rank below: numpy, not an eager gather per index
            assert recv_data.dtype == jnp.float8_e4m3fn and recv_scales.dtype == jnp.float32
            assert recv_data.shape == (R, R * TOKENS, HIDDEN) and recv_scales.shape == (R, R * TOKENS, HIDDEN // 128)
            both = np.concatenate([_shards(data, R), _shards(scales, R)], axis=-1)  # one oracle call for both
            expected = oracle.dispatch(both, _shards(idx, R), _shards(w, R), num_experts, R * TOKENS)
            got = np.concatenate([_np(recv_data), _np(recv_scales)], axis=-1)
            for r in range(R):
                n = len(expected[r]["x"])
                assert int(num_recv[r]) == n, (kind, r)
                np.testing.assert_array_equal(got[r, :n], _padded(expected[r]["x"], n, both.shape[2:]), err_msg=kind)
        print("fp8 ok", flush=True)

    # Gradients -----------------------------------------------------------

    def case_gradients(self):
        """loss = <recv_x, P> + <recv_w, Q> + <combine(y), G> + <combined weights, S>:
        d/dx is the combine of P, d/dw gathers Q and S back to the slots, d/dy
        is G at each row's source token (the oracle's layouts give each)."""
        R, dej, jax, jnp = self.num_ranks, self.dej, self.jax, self.jnp
        P_ = self.jax.sharding.PartitionSpec
        num_experts = 2 * R
        rows = TOKENS * R
        buffer = dej.Buffer(self.mesh, "ep", backend="xla")

        def per_rank(x, w, y, idx, p, q, g, s):
            recv_x, _, recv_w, handle = dej.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
            out, out_w = dej.combine(y, handle, recv_w, buffer=buffer)
            loss = (
                jnp.sum(recv_x.astype(jnp.float32) * p)
                + jnp.sum(recv_w * q)
                + jnp.sum(out.astype(jnp.float32) * g)
                + jnp.sum(out_w * s)
            )
            return jax.lax.psum(loss, "ep")

        loss = jax.shard_map(per_rank, mesh=self.mesh, in_specs=P_("ep"), out_specs=P_(), check_vma=False)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        for kind in ("random", "one_expert", "rank_empty", "minus_one", "out_of_range"):
            idx, w = self.routing(num_experts, kind)
            x = self.rows((R * TOKENS, HIDDEN))
            y = self.rows((R * rows, HIDDEN))
            p = self.rows((R * rows, HIDDEN), jnp.float32, wide=True)
            q = self.rows((R * rows, TOPK), jnp.float32)
            g = self.rows((R * TOKENS, HIDDEN), jnp.float32)
            s = self.rows((R * TOKENS, TOPK), jnp.float32)
            g_x, g_w, g_y = grad(x, w, y, idx, p, q, g, s)
            assert g_x.dtype == jnp.bfloat16 and g_y.dtype == jnp.bfloat16 and g_w.dtype == jnp.float32

            idxs, ws = _shards(idx, R), _shards(w, R)
            expected = oracle.dispatch(_shards(x, R), idxs, ws, num_experts, rows)
            ps, qs, gs, ss = (_shards(a, R) for a in (p, q, g, s))
            # x: the rows' cotangents (bf16, as recv_x is) summed back in rank order.
            want_x = _bf16(oracle.combine(_bf16(ps), expected, TOKENS))
            np.testing.assert_array_equal(_shards(g_x, R), want_x, err_msg=kind)
            # y: each valid row gets its source token's cotangent (bf16); padding rows 0.
            want_y = np.zeros((R, rows, HIDDEN), np.float32)
            for r in range(R):
                for i, (src_rank, t) in enumerate(zip(expected[r]["rank"], expected[r]["src"])):
                    want_y[r, i] = _bf16(gs[src_rank, t])
            np.testing.assert_array_equal(_shards(g_y, R), want_y, err_msg=kind)
            # w: slot k of token t gets Q of the row holding it (on the rank of its expert) plus S[t, k].
            want_w = np.zeros((R, TOKENS, TOPK), np.float32)
            for r in range(R):
                for i, (src_rank, t) in enumerate(zip(expected[r]["rank"], expected[r]["src"])):
                    mine = np.asarray(expected[r]["idx"][i]) >= 0
                    want_w[src_rank, t][mine] = qs[r, i][mine] + ss[src_rank, t][mine]
            np.testing.assert_array_equal(_shards(g_w, R), want_w, err_msg=kind)
            if kind in ("minus_one", "out_of_range"):
                assert (want_w == 0).any()  # slots naming no expert get no gradient
        print("gradients ok", flush=True)

    # Low-latency mode ----------------------------------------------------

    def case_low_latency(self):
        R, dej = self.num_ranks, self.dej
        max_tokens, num_tokens, num_experts = TOKENS, TOKENS - 1, 4 * R
        epr = num_experts // R
        buffer = dej.Buffer(
            self.mesh,
            "ep",
            backend="xla",
            low_latency_mode=True,
            num_max_dispatch_tokens_per_rank=max_tokens,
            hidden=HIDDEN,
            num_experts=num_experts,
        )
        for use_fp8 in (False, True):

            def step(x, idx, w, y, use_fp8=use_fp8):
                recv_x, count, handle = dej.low_latency_dispatch(
                    x,
                    idx,
                    buffer=buffer,
                    num_max_dispatch_tokens_per_rank=max_tokens,
                    num_experts=num_experts,
                    use_fp8=use_fp8,
                )
                out = dej.low_latency_combine(y, idx, w, handle, buffer=buffer)
                return recv_x, count, handle, out

            run = self.dt.per_rank(step, self.mesh, "ep")
            kinds = self.dt.ROUTING_KINDS if not use_fp8 else ("random", "one_expert", "minus_one")
            for kind in kinds:
                idx, _ = self.routing(num_experts, kind, num_tokens)
                # Weights that multiply exactly, so that the sum's order shows through wide rows.
                w = self.put(self.rng.choice(np.float32([0.5, 1, 2]), (R * num_tokens, TOPK)))
                x = self.rows((R * num_tokens, HIDDEN))
                y = self.rows((R * epr, R * max_tokens, HIDDEN), wide=True)
                recv_x, count, handle, out = run(x, idx, w, y)
                xs, idxs, ws = _shards(x, R), _shards(idx, R), _shards(w, R)
                expected = oracle.low_latency_dispatch(xs, idxs, num_experts, max_tokens)
                if use_fp8:
                    data, scales = (_np(a) for a in recv_x)
                    rows = data.astype(np.float32).reshape(R, epr, R * max_tokens, HIDDEN)
                    scales = scales.reshape(R, epr, R * max_tokens, HIDDEN // 128)
                else:
                    rows = _np(recv_x).reshape(R, epr, R * max_tokens, HIDDEN)
                handle = self.jax.tree.map(lambda a: np.asarray(a).reshape(R, epr, -1), handle)
                count = np.asarray(count).reshape(R, epr)
                for r in range(R):
                    for e in range(epr):
                        slots = expected[r][e]
                        n = len(slots)
                        what = f"{kind} fp8={use_fp8} rank {r} expert {e}"
                        assert int(count[r, e]) == n, what
                        src, tok, k = (np.array(v, np.int32).reshape(n) for v in zip(*slots)) if n else ([],) * 3
                        np.testing.assert_array_equal(handle.recv_src_rank[r, e, :n], src, err_msg=what)
                        np.testing.assert_array_equal(handle.recv_src_token[r, e, :n], tok, err_msg=what)
                        np.testing.assert_array_equal(handle.recv_src_topk[r, e, :n], k, err_msg=what)
                        assert (handle.recv_src_rank[r, e, n:] == -1).all(), what
                        if not n:
                            continue
                        want = xs[src, tok]
                        if use_fp8:  # the reference's 1 / scale is IEEE on the CPU: FP8 values and scales exact
                            want_values, want_scales = oracle.quantize_fp8(want)
                            np.testing.assert_array_equal(scales[r, e, :n], want_scales, err_msg=what)
                            np.testing.assert_array_equal(rows[r, e, :n], want_values, err_msg=what)
                        else:
                            np.testing.assert_array_equal(rows[r, e, :n], want, err_msg=what)
                ys = _np(y).reshape(R, epr, R * max_tokens, HIDDEN)
                want = oracle.low_latency_combine(ys, expected, idxs, ws, num_experts)
                np.testing.assert_array_equal(_np(out), _bf16(want), err_msg=f"{kind} fp8={use_fp8}")
                if kind == "one_expert":
                    assert count[0, 0] == R * num_tokens and count.sum() == R * num_tokens
                if kind == "rank_empty":
                    assert (count[-1] == 0).all() and count.sum() > 0
            print(f"low_latency fp8={use_fp8}: {', '.join(kinds)} ok", flush=True)


# Started by the workers fixture (script_run.start_script: the repository and tests/ on the path).
if __name__ == "__main__":
    import oracle

    num_ranks, seed, names = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    worker = Worker(num_ranks, seed)
    for name in names:
        start = time.time()
        getattr(worker, f"case_{name}")()
        print(f"CASE {name} OK ({time.time() - start:.1f} s)", flush=True)
