"""Low-latency (decode) mode: microseconds per dispatch, per combine and per
dispatch + combine pair, CUDA kernels beside the xla backend, through the
public API under jit; and the device time of each half (send / recv kernel).

    python benchmarks/bench_low_latency.py                  # DeepEP's case, all local GPUs
    python benchmarks/bench_low_latency.py --overlap        # also: compute between send and recv
    python benchmarks/bench_low_latency.py --overlap --overlap-sms 16  # sends beside XLA's stream
    python benchmarks/bench_low_latency.py --json ll.json

DeepEP's case: 128 tokens per rank, hidden 7168, top-8 of 288 experts, FP8
dispatch, bf16 combine. DeepEP V1's own figures on the same GPUs, to compare
with, are in benchmarks/RESULTS.md.

Timing (docs/design.md section 3): a jitted shard_map call costs many times
an operation's device time in host time, and each custom call adds launch
time, so each measurement runs one jitted program holding a chain of n
operations (each one's input depending on the previous one's output through
a one-element update) and one of 2n;
the time per operation is the difference divided by n, which cancels the
fixed cost of a call. Repeated for the median and p10/p90. The "glue" row
is a chain of the one-element updates alone, the cost included in every
other row. Kernel device times come from profiles of the pair chain (the
whole-operation kernels, the figure DeepEP's own test reports) and of the
"split pair" chain (the send and receive halves); a receive includes waiting
for its peers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from timing import chain_seconds, check_counts, environment, kernel_events, span_per_op, touch

import deep_ep_jax
from deep_ep_jax import testing

AXIS = "ep"
WHOLE_KERNELS = ("DispatchKernel", "CombineKernel")  # low_latency_dispatch / _combine: one kernel each
HALF_KERNELS = ("DispatchSendKernel", "DispatchRecvKernel", "CombineSendKernel", "CombineRecvKernel")


@dataclasses.dataclass(frozen=True)
class Case:
    num_tokens: int = 128
    hidden: int = 7168
    num_experts: int = 288
    topk: int = 8
    use_fp8: bool = True


def make_inputs(case: Case, num_ranks: int, seed: int = 0):
    """Global arrays: x bf16 [R*T, H], routing [R*T, K], expert outputs y bf16 [E, R*M, H]."""
    x = testing.random_rows(seed, (num_ranks * case.num_tokens, case.hidden))
    idx, w = testing.make_routing(seed, num_ranks * case.num_tokens, case.num_experts, case.topk, num_ranks)
    y = testing.random_rows(seed + 1, (case.num_experts, num_ranks * case.num_tokens, case.hidden))
    return dict(x=x, idx=jnp.asarray(idx), w=jnp.asarray(w), y=y)


def _uses_all(recv_x, count, handle):
    """[1, 1] depending on every output of a dispatch (so the xla backend
    cannot drop any of its exchanges)."""
    rows = recv_x if isinstance(recv_x, tuple) else (recv_x,)
    value = rows[0][0, :1, :1].astype(jnp.float32) + count[0]
    if len(rows) == 2:
        value = value + rows[1][0, :1, :1]
    return value + handle.recv_src_rank[:1, :1] + handle.recv_src_token[:1, :1] + handle.recv_src_topk[:1, :1]


def _dispatch(buffer, case, x, idx):
    outputs = deep_ep_jax.low_latency_dispatch(
        x,
        idx,
        buffer=buffer,
        num_max_dispatch_tokens_per_rank=case.num_tokens,
        num_experts=case.num_experts,
        use_fp8=case.use_fp8,
    )
    return lax.optimization_barrier(outputs)  # XLA must compute them whole, not the slices used


def _combine(buffer, y, idx, w, handle):
    return lax.optimization_barrier(deep_ep_jax.low_latency_combine(y, idx, w, handle, buffer=buffer))


def _compute(z, m):
    return jnp.tanh(z @ m)


def _split_pair(buffer, case, x, idx, w, y, between=lambda pending: pending):
    """Dispatch then combine through their send/recv halves; `between(pending)`
    runs between each send and its recv and returns the pending value to
    receive. Returns (out, recv_x, count, handle)."""
    pending = deep_ep_jax.low_latency_dispatch_send(
        x,
        idx,
        buffer=buffer,
        num_max_dispatch_tokens_per_rank=case.num_tokens,
        num_experts=case.num_experts,
        use_fp8=case.use_fp8,
    )
    pending = between(pending)
    # Barriers as in _dispatch/_combine: the xla backend must compute the whole outputs.
    recv_x, count, handle = lax.optimization_barrier(deep_ep_jax.low_latency_dispatch_recv(pending, buffer=buffer))
    pending = between(deep_ep_jax.low_latency_combine_send(y, idx, w, handle, buffer=buffer))
    out = lax.optimization_barrier(deep_ep_jax.low_latency_combine_recv(pending, buffer=buffer))
    return out, recv_x, count, handle


def make_chain(op, buffer, mesh, case, length):
    """A per-rank program of `length` operations; returns (fn, arg names)."""
    if op == "glue":

        def fn(x):
            for _ in range(length):
                x = touch(x, x[:1, :1] + 1)
            return x[:1, :1]

        names = ("x",)
    elif op == "dispatch":

        def fn(x, idx):
            for _ in range(length):
                recv_x, count, handle = _dispatch(buffer, case, x, idx)
                x = touch(x, _uses_all(recv_x, count, handle))
            return x[:1, :1]

        names = ("x", "idx")
    elif op == "combine":

        def fn(x, idx, w, y):
            _, _, handle = _dispatch(buffer, case, x, idx)
            for _ in range(length):
                out = _combine(buffer, y, idx, w, handle)
                # Through y, each send waits for the previous recv: at most two
                # low-latency operations may be in flight (see low_latency.py).
                y = y.at[0, 0, 0].set(out[0, 0])
            return out[:1, :1]

        names = ("x", "idx", "w", "y")
    elif op == "pair":

        def fn(x, idx, w, y):
            for _ in range(length):
                recv_x, count, handle = _dispatch(buffer, case, x, idx)
                out = _combine(buffer, y, idx, w, handle)
                x = touch(out, _uses_all(recv_x, count, handle))
            return x[:1, :1]

        names = ("x", "idx", "w", "y")
    elif op == "split pair":  # the same through the send/recv halves

        def fn(x, idx, w, y):
            for _ in range(length):
                out, recv_x, count, handle = _split_pair(buffer, case, x, idx, w, y)
                x = touch(out, _uses_all(recv_x, count, handle))
            return x[:1, :1]

        names = ("x", "idx", "w", "y")
    elif op == "compute":  # the work of "pair+compute" alone

        def fn(x, m):
            z = x
            for _ in range(length):
                z = _compute(_compute(z, m), m)
            return z[:1, :1]

        names = ("x", "m")
    elif op == "pair+compute":  # a matmul between each send and its recv

        def fn(x, idx, w, y, m):
            z = x

            def step(pending):
                nonlocal z
                pending, z = deep_ep_jax.low_latency_overlap(pending, _compute, z, m)
                return pending

            for _ in range(length):
                out, recv_x, count, handle = _split_pair(buffer, case, x, idx, w, y, between=step)
                x = touch(out, _uses_all(recv_x, count, handle) + z[:1, :1])
            return x[:1, :1]

        names = ("x", "idx", "w", "y", "m")
    else:
        raise ValueError(op)
    return testing.per_rank(fn, mesh, AXIS), names


def time_per_op(op, buffer, mesh, case, inputs, *, length, repeats):
    """Seconds per operation, one sample per repeat: (time of a 2n chain -
    time of an n chain) / n."""
    short, names = make_chain(op, buffer, mesh, case, length)
    long, _ = make_chain(op, buffer, mesh, case, 2 * length)
    args = [inputs[n] for n in names]
    return chain_seconds(short, long, args, length, repeats), long, args


def call_overhead(mesh, inputs, repeats):
    """Seconds of one jitted shard_map call doing (almost) nothing."""
    run = testing.per_rank(lambda x: x[:1, :1], mesh, AXIS)
    jax.block_until_ready(run(inputs["x"]))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(inputs["x"]))
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def profile_chain(run, args, kernels, num_ops):
    """From one profile of a chain: its kernel events, the median device time
    (s) of each kernel per GPU, and the device time per operation per GPU
    (span_per_op)."""
    events = kernel_events(run, args, kernels)
    medians = {key: float(np.median([(end - start) * 1e-9 for start, end in v])) for key, v in events.items()}
    return events, medians, span_per_op(events, num_ops)


def send_overlap(events):
    """{gpu plane: fraction of the send kernels' device time during which a
    kernel other than a low-latency one ran on that GPU}, from a chain's
    events of HALF_KERNELS and "" (every kernel): the direct sign that compute
    overlapped the transfer."""
    fractions = {}
    for gpu in {g for g, _ in events}:
        sends = sorted(e for k in HALF_KERNELS if "Send" in k for e in events.get((gpu, k), []))
        low_latency = {e for k in HALF_KERNELS for e in events.get((gpu, k), [])}
        others = sorted(e for e in events.get((gpu, ""), []) if e not in low_latency)
        covered = total = 0
        for start, end in sends:
            total += end - start
            cursor = start  # the union of the other kernels' intervals within [start, end]
            for o_start, o_end in others:
                if o_end > cursor and o_start < end:
                    covered += min(o_end, end) - max(o_start, cursor)
                    cursor = min(o_end, end)
        fractions[gpu] = covered / total if total else float("nan")
    return fractions


def make_buffer(mesh, backend, case, overlap_sms=0):
    num_ranks = mesh.shape[AXIS]
    common = dict(
        low_latency_mode=True,
        num_max_dispatch_tokens_per_rank=case.num_tokens,
        hidden=case.hidden,
        num_experts=case.num_experts,
    )
    if backend == "xla":
        return deep_ep_jax.Buffer(mesh, AXIS, backend="xla", **common)
    from deep_ep_jax.backends.cuda.sizes import low_latency_region_bytes

    region = low_latency_region_bytes(num_ranks, case.num_experts, case.hidden, case.num_tokens, num_topk=case.topk)
    return deep_ep_jax.Buffer(
        mesh,
        AXIS,
        backend="cuda",
        num_nvl_bytes=1 << 20,
        num_rdma_bytes=region,
        config=deep_ep_jax.Config(low_latency_overlap_sms=overlap_sms),
        **common,
    )


def summarize(op, backend, seconds):
    p10, p50, p90 = np.percentile(seconds, [10, 50, 90]) * 1e6
    return dict(op=op, backend=backend, us_median=p50, us_p10=p10, us_p90=p90, samples_us=(seconds * 1e6).tolist())


def format_row(r):
    return f"| {r['op']} | {r['backend']} | {r['us_median']:.1f} | {r['us_p10']:.1f}-{r['us_p90']:.1f} |"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backends",
        nargs="+",
        default=None,
        choices=["cuda", "xla"],
        help="default: cuda and xla on GPUs, xla elsewhere",
    )
    parser.add_argument("--ranks", type=int, default=None, help="EP size (default: all devices)")
    parser.add_argument("--tokens", type=int, default=Case.num_tokens, help="tokens per rank (= M)")
    parser.add_argument("--hidden", type=int, default=Case.hidden)
    parser.add_argument("--experts", type=int, default=Case.num_experts)
    parser.add_argument("--topk", type=int, default=Case.topk)
    parser.add_argument("--bf16", action="store_true", help="bf16 dispatch instead of FP8")
    parser.add_argument("--chain", type=int, default=50, help="operations per timed program (and twice that)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--overlap", action="store_true", help="also time a matmul placed between send and recv")
    parser.add_argument(
        "--overlap-sms",
        type=int,
        default=0,
        help="run the CUDA split sends beside XLA's stream on this many SMs "
        "(Config.low_latency_overlap_sms; default 0: on XLA's stream)",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the per-kernel device times")
    parser.add_argument("--json", default=None, help="write all results here")
    args = parser.parse_args(argv)
    check_counts(parser, args, "tokens", "hidden", "experts", "topk", "chain", "repeats")

    on_gpu = jax.default_backend() == "gpu"
    backends = args.backends or (["cuda", "xla"] if on_gpu else ["xla"])
    num_ranks = args.ranks or len(jax.devices())
    mesh = testing.ep_mesh(num_ranks, AXIS)
    case = Case(args.tokens, args.hidden, args.experts, args.topk, not args.bf16)
    env = environment()
    print(f"# low-latency mode, EP={num_ranks} on {env['devices'][0]} ({env['platform']}), jax {env['jax']}")
    print(
        f"# {case.num_tokens} tokens/rank, hidden {case.hidden}, top-{case.topk} of {case.num_experts} experts, "
        f"{'FP8' if case.use_fp8 else 'bf16'} dispatch, bf16 combine; chains of {args.chain} and "
        f"{2 * args.chain} ops, {args.repeats} repeats; CUDA kernels use every SM"
        + (f", but split sends run beside XLA's stream on {args.overlap_sms} SMs" if args.overlap_sms else "")
    )
    inputs = make_inputs(case, num_ranks)
    # [H, H] per rank (per_rank splits every argument along its first axis)
    inputs["m"] = jnp.tile((jnp.eye(case.hidden, dtype=jnp.float32) * 0.5).astype(jnp.bfloat16), (num_ranks, 1))
    ops = ["glue", "dispatch", "combine", "pair", "split pair"] + (["compute", "pair+compute"] if args.overlap else [])
    profiled = {
        "dispatch": WHOLE_KERNELS[:1],
        "combine": WHOLE_KERNELS[1:],
        "pair": WHOLE_KERNELS,
        "split pair": HALF_KERNELS,
        "compute": ("",),
        "pair+compute": HALF_KERNELS + ("",),
    }  # "": every kernel
    spans = {}  # op -> {gpu: seconds per op}

    overhead = call_overhead(mesh, inputs, args.repeats)
    print(
        f"# one jitted shard_map call that does nothing: {overhead * 1e6:.0f} us of host time (cancelled by the "
        f"n / 2n difference)"
    )
    print("\n| op | backend | us per op, median | p10-p90 |\n|---|---|---|---|")
    results, kernels = [], {}
    for backend in backends:
        buffer = make_buffer(mesh, backend, case, args.overlap_sms)
        try:
            for op in ops:
                if op in ("glue", "compute") and backend != backends[0]:
                    continue  # no communication: the same for every backend
                if op == "split pair" and backend != "cuda":
                    continue  # the reference backend's halves are its whole operations
                seconds, long, long_args = time_per_op(
                    op, buffer, mesh, case, inputs, length=args.chain, repeats=args.repeats
                )
                results.append(summarize(op, backend if op not in ("glue", "compute") else "-", seconds))
                print(format_row(results[-1]), flush=True)
                if op in profiled and backend == "cuda" and not args.no_profile:
                    try:
                        events, medians, spans[op] = profile_chain(long, long_args, profiled[op], 2 * args.chain)
                        if op in ("pair", "split pair"):
                            kernels.update(medians)
                        if op == "pair+compute":
                            overlap = send_overlap(events)
                            print(
                                "# send kernels' time with other kernels beside them: "
                                + ", ".join(f"{gpu} {f:.0%}" for gpu, f in sorted(overlap.items()))
                            )
                    except Exception as e:  # e.g. no CUPTI: the timings above still stand
                        print(f"# no per-kernel profile: {type(e).__name__}: {e}")
        finally:
            buffer.destroy()

    if kernels:
        print("\nDevice time per kernel, us (median over the profiled pair chains; a receive includes waiting):")
        print(
            "| GPU | dispatch | combine | dispatch send | dispatch recv | combine send | combine recv |\n"
            "|---|---|---|---|---|---|---|"
        )
        for gpu in sorted({g for g, _ in kernels}):
            cells = [f"{kernels.get((gpu, k), float('nan')) * 1e6:.1f}" for k in WHOLE_KERNELS + HALF_KERNELS]
            print(f"| {gpu} | " + " | ".join(cells) + " |")
    if spans:
        gpus = sorted({g for per_gpu in spans.values() for g in per_gpu})
        print(
            "\nDevice time per operation, us (a profiled chain: first kernel's start to last kernel's end, "
            "divided by its operations; gaps included, no host timing noise):"
        )
        print("| op | " + " | ".join(gpus) + " |\n|---|" + "---|" * len(gpus))
        for op, per_gpu in spans.items():
            print(f"| {op} | " + " | ".join(f"{per_gpu.get(g, float('nan')) * 1e6:.1f}" for g in gpus) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    environment=env,
                    case=dataclasses.asdict(case),
                    call_overhead_us=overhead * 1e6,
                    results=results,
                    kernel_us={f"{g} {k}": v * 1e6 for (g, k), v in kernels.items()},
                    span_us_per_op={op: {g: v * 1e6 for g, v in per_gpu.items()} for op, per_gpu in spans.items()},
                ),
                f,
                indent=1,
            )
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
