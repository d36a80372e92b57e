"""Normal-mode bandwidth: dispatch bf16, dispatch FP8, combine bf16, CUDA
kernels beside the xla backend, through the public API under jit.

    python benchmarks/bench_normal.py                      # standard case, 24 SMs
    python benchmarks/bench_normal.py --num-sms 8 16 24 32 --json out.json
    python benchmarks/bench_normal.py --sweep --plot sweep.png
    python -m deep_ep_jax.launch -n 2 -- benchmarks/bench_normal.py   # one process per GPU (CUDA IPC)
    DEEP_EP_JAX_GPUS_PER_HOST=1 XLA_PYTHON_CLIENT_PREALLOCATE=false \
      python -m deep_ep_jax.launch -n 2 --all-gpus-visible -- benchmarks/bench_normal.py   # as two hosts (NVSHMEM)

Standard case (DeepEP's): 4096 tokens per rank, hidden 7168, top-8 of 256
experts, all local GPUs as the EP group. Bandwidth is DeepEP's formula:
bytes of the rows a rank receives (local rows included; FP8 counts data and
scales; combine counts the same rows as the bf16 dispatch) over the time of
one operation, averaged over ranks.

Timing (docs/design.md section 3): a jitted call costs more host time than
an operation takes, so each measurement runs one jitted program holding a
chain of n operations, each one's input depending on the previous one's
output (one element updated), and a chain of 2n; the time per operation is
the difference divided by n, which cancels the fixed cost of a call. Repeated for the median
and the p10/p90 spread. Inputs are random bf16 rows, never zeros.

Every operation of a chain does the whole work, on both backends: each has a
routing of its own (each rank's tokens permuted afresh, so every operation
receives the same rows: the bandwidth formula holds), each combine the handle
of its own dispatch, and every output of a dispatch is used. With one routing
for the whole chain XLA would compute the xla backend's routing-dependent
exchanges once per chain, and it would drop an unused exchange (the FP8
scales').
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from timing import chain_seconds, check_counts, environment, kernel_durations, touch

import deep_ep_jax
from deep_ep_jax import launch, testing
from deep_ep_jax.backends import reference

AXIS = "ep"
OPS = ("dispatch_bf16", "dispatch_fp8", "combine_bf16")


@dataclasses.dataclass(frozen=True)
class Case:
    num_tokens: int = 4096
    hidden: int = 7168
    num_experts: int = 256
    topk: int = 8


def make_inputs(case: Case, num_ranks: int, seed: int = 0):
    """Global arrays [R * T, ...]: x bf16, its FP8 pair, routing, rows y for combine."""
    x = testing.random_rows(seed, (num_ranks * case.num_tokens, case.hidden))
    idx, w = testing.make_routing(seed, num_ranks * case.num_tokens, case.num_experts, case.topk, num_ranks)
    y = testing.random_rows(seed + 1, (num_ranks * case.num_tokens * num_ranks, case.hidden))
    return dict(x=x, x_fp8=tuple(reference.quantize_fp8(x)), idx=jnp.asarray(idx), w=jnp.asarray(w), y=y)


def op_routings(case: Case, num_ranks: int, inputs, num_ops: int, seed: int = 1):
    """[(topk_idx, topk_weights)] for each operation of a chain: each rank's
    tokens permuted afresh, so that no two operations share a layout, while
    every one receives exactly the rows of inputs["idx"]."""
    rng = np.random.default_rng(seed)
    idx, w = np.asarray(inputs["idx"]), np.asarray(inputs["w"])
    routings = []
    for _ in range(num_ops):
        order = np.concatenate([r * case.num_tokens + rng.permutation(case.num_tokens) for r in range(num_ranks)])
        routings.append((jnp.asarray(idx[order]), jnp.asarray(w[order])))
    return routings


def dispatch_handles(buffer, mesh, case: Case, x, routings):
    """The handle of a dispatch of x along each routing ([R, ...] per field: per_rank's stacking)."""
    run = testing.per_rank(
        lambda x, idx, w: deep_ep_jax.dispatch(x, idx, w, num_experts=case.num_experts, buffer=buffer)[3], mesh, AXIS
    )
    return [run(x, idx, w) for idx, w in routings]


def _uses_all(outputs):
    """[1, 1] depending on every output of a dispatch (after an optimization
    barrier, so XLA must compute them whole)."""
    return sum(leaf.reshape(-1)[:1].astype(jnp.float32) for leaf in jax.tree.leaves(outputs))[None]


def dispatch_chain(buffer, mesh, case: Case, length: int, fp8: bool):
    def fn(x, routings):
        for idx, w in routings[:length]:
            outputs = deep_ep_jax.dispatch(x, idx, w, num_experts=case.num_experts, buffer=buffer)
            # The barrier keeps XLA from computing only the slices used below.
            value = _uses_all(lax.optimization_barrier(outputs))
            x = (touch(x[0], value), x[1]) if fp8 else touch(x, value)
        return value  # depends on every dispatch of the chain

    return testing.per_rank(fn, mesh, AXIS)


def combine_chain(buffer, mesh, case: Case, length: int):
    def fn(y, handles):
        for handle in handles[:length]:
            handle = jax.tree.map(lambda a: a[0], handle)  # this rank's [1, ...] -> [...]
            out = lax.optimization_barrier(deep_ep_jax.combine(y, handle, buffer=buffer))
            y = touch(y, out[:1, :1])
        return out[0, 0]

    return testing.per_rank(fn, mesh, AXIS)


def chain_args(op, buffer, mesh, case, inputs, num_ops):
    """The arguments of both chains of op: inputs, and a routing (or, for
    combine, a dispatch's handle) for each of num_ops operations."""
    routings = op_routings(case, buffer.num_ranks, inputs, num_ops)
    if op == "dispatch_bf16":
        return inputs["x"], routings
    if op == "dispatch_fp8":
        return inputs["x_fp8"], routings
    return inputs["y"], dispatch_handles(buffer, mesh, case, inputs["x"], routings)


def make_chain(op, buffer, mesh, case, length):
    if op == "combine_bf16":
        return combine_chain(buffer, mesh, case, length)
    return dispatch_chain(buffer, mesh, case, length, fp8=op == "dispatch_fp8")


def time_per_op(op, buffer, mesh, case, inputs, *, length, repeats):
    """Seconds per operation, one sample per repeat: (time of a 2n chain -
    time of an n chain) / n."""
    args = chain_args(op, buffer, mesh, case, inputs, 2 * length)
    short, long = make_chain(op, buffer, mesh, case, length), make_chain(op, buffer, mesh, case, 2 * length)
    return chain_seconds(short, long, args, length, repeats), long, args


def device_seconds_per_op(run, args, length):
    """Device time of our kernels per operation (the slowest GPU), from a
    profile of the 2n chain: every kernel of deep_ep_jax::intranode (one host)
    or ::internode (several hosts), waits included."""
    per_gpu = {}
    for (plane, _), seconds in kernel_durations(run, args, ["intranode", "internode"]).items():
        per_gpu[plane] = per_gpu.get(plane, 0.0) + sum(seconds) / (2 * length)
    return max(per_gpu.values()) if per_gpu else float("nan")


_received_rows = {}  # (case, num_ranks) -> mean rows a rank receives (the same for every backend)


def received_row_bytes(op, buffer, mesh, case, inputs):
    """Mean over ranks of the bytes of the rows a rank receives (DeepEP's formula)."""
    key = (case, buffer.num_ranks)
    if key not in _received_rows:

        def fn(x, idx, w):
            _, _, _, handle = deep_ep_jax.dispatch(x, idx, w, num_experts=case.num_experts, buffer=buffer)
            return handle.num_recv_tokens

        rows = testing.per_rank(fn, mesh, AXIS)(inputs["x"], inputs["idx"], inputs["w"])
        rows = multihost_utils.process_allgather(rows, tiled=True)  # one process per GPU: every rank's count
        _received_rows[key] = float(np.asarray(rows, np.float64).mean())
    row_bytes = case.hidden + case.hidden // 128 * 4 if op == "dispatch_fp8" else 2 * case.hidden
    return _received_rows[key] * row_bytes


def measure(op, buffer, mesh, case, inputs, *, length, repeats):
    seconds, long, args = time_per_op(op, buffer, mesh, case, inputs, length=length, repeats=repeats)
    device = float("nan")
    if buffer.backend == "cuda":
        try:
            device = device_seconds_per_op(long, args, length)
        except Exception as e:  # no CUPTI: the wall-clock figures still stand
            print(f"# no profile: {type(e).__name__}: {e}")
    nbytes = received_row_bytes(op, buffer, mesh, case, inputs)
    p10, p50, p90 = np.percentile(seconds, [10, 50, 90])
    return dict(
        op=op,
        backend=buffer.backend,
        num_sms=buffer.config.num_sms if buffer.backend == "cuda" else None,
        chunk_tokens=buffer.config.chunk_tokens if buffer.backend == "cuda" else None,
        num_warps=getattr(buffer.config, "num_warps", None) if buffer.backend == "cuda" else None,
        num_ranks=buffer.num_ranks,
        tokens_per_rank=case.num_tokens,
        hidden=case.hidden,
        num_experts=case.num_experts,
        topk=case.topk,
        received_bytes_per_rank=nbytes,
        us_median=p50 * 1e6,
        us_p10=p10 * 1e6,
        us_p90=p90 * 1e6,
        device_us=device * 1e6,
        device_gbps=nbytes / device / 1e9,
        gbps_median=nbytes / p50 / 1e9,
        gbps_p10=nbytes / p90 / 1e9,  # the slow end of the time spread
        gbps_p90=nbytes / p10 / 1e9,
        samples_us=(seconds * 1e6).tolist(),
    )


def format_table(results):
    lines = [
        "| op | backend | SMs | time median (us) | time p10-p90 (us) | GB/s median | GB/s p10-p90 "
        "| kernel device time (us) | GB/s by device time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        sms = "-" if r["num_sms"] is None else str(r["num_sms"])
        lines.append(
            f"| {r['op']} | {r['backend']} | {sms} | {r['us_median']:.1f} | {r['us_p10']:.1f}-{r['us_p90']:.1f} | "
            f"{r['gbps_median']:.1f} | {r['gbps_p10']:.1f}-{r['gbps_p90']:.1f} | "
            f"{r['device_us']:.1f} | {r['device_gbps']:.1f} |"
        )
    return "\n".join(lines)


def make_buffer(mesh, backend, **config):
    if backend == "xla":
        return deep_ep_jax.Buffer(mesh, AXIS, backend="xla")
    return deep_ep_jax.Buffer(mesh, AXIS, backend="cuda", config=deep_ep_jax.Config(**config))


def config_fields(num_sms, chunk_tokens=None, num_warps=None):
    """Config keyword arguments; num_warps only where Config has it."""
    fields = {"num_sms": num_sms}
    if chunk_tokens is not None:
        fields["chunk_tokens"] = chunk_tokens
    if num_warps is not None and "num_warps" in deep_ep_jax.Config.__dataclass_fields__:
        fields["num_warps"] = num_warps
    return fields


def run_table(mesh, case, backends, num_sms_list, *, length, repeats, ops=OPS, chunk_tokens_list=(None,)):
    inputs = make_inputs(case, mesh.shape[AXIS])
    results = []
    for backend in backends:
        configs = [(n, c) for n in num_sms_list for c in chunk_tokens_list] if backend == "cuda" else [(None, None)]
        for num_sms, chunk_tokens in configs:
            if chunk_tokens is not None:
                print(f"# chunk_tokens={chunk_tokens}")
            buffer = make_buffer(mesh, backend, **(config_fields(num_sms, chunk_tokens) if backend == "cuda" else {}))
            try:
                for op in ops:
                    results.append(measure(op, buffer, mesh, case, inputs, length=length, repeats=repeats))
                    print(format_table(results[-1:]).splitlines()[-1], flush=True)
            finally:
                buffer.destroy()
    return results


def run_sweep(mesh, case, backends, num_sms, *, length, repeats, plot_path):
    results = []
    tokens = [128 * 2**i for i in range(7)]  # 128 .. 8192
    for num_tokens in tokens:
        sub = dataclasses.replace(case, num_tokens=num_tokens)
        # Small operations need longer chains: the n / 2n difference must stand
        # well above the host's jitter (a run with 4 ops at 128 tokens gave noise).
        scaled = length * min(16, max(1, 2048 // num_tokens))
        results += run_table(mesh, sub, backends, [num_sms], length=scaled, repeats=repeats)
    if plot_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(OPS), figsize=(5 * len(OPS), 4), sharey=True)
        for ax, op in zip(axes, OPS):
            for backend in backends:
                rows = [r for r in results if r["op"] == op and r["backend"] == backend]
                label = f"{backend} ({num_sms} SMs)" if backend == "cuda" else backend
                ax.plot(
                    [r["tokens_per_rank"] for r in rows],
                    [max(r["gbps_median"], 0) for r in rows],
                    marker="o",
                    label=label,
                )
                if backend == "cuda":  # the profile's kernel times: steadier at small sizes
                    ax.plot(
                        [r["tokens_per_rank"] for r in rows],
                        [r["device_gbps"] for r in rows],
                        marker="x",
                        linestyle="--",
                        label=f"{label}, kernel device time",
                    )
            ax.set_xscale("log", base=2)
            ax.set_title(op)
            ax.set_xlabel("tokens per rank")
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel("GB/s (DeepEP formula)")
        axes[0].legend()
        fig.suptitle(f"EP={mesh.shape[AXIS]}, hidden {case.hidden}, top-{case.topk} of {case.num_experts} experts")
        fig.tight_layout()
        fig.savefig(plot_path, dpi=120)
        print(f"saved {plot_path}")
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-sms", type=int, nargs="+", default=[24], help="SM counts of the CUDA kernels")
    parser.add_argument(
        "--backends",
        nargs="+",
        default=None,
        choices=["cuda", "xla"],
        help="default: cuda and xla on GPUs, xla elsewhere",
    )
    parser.add_argument("--ranks", type=int, default=None, help="EP size (default: all devices)")
    parser.add_argument("--tokens", type=int, default=Case.num_tokens, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=Case.hidden)
    parser.add_argument("--experts", type=int, default=Case.num_experts)
    parser.add_argument("--topk", type=int, default=Case.topk)
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        nargs="+",
        default=[None],
        help="Config.chunk_tokens values of the CUDA kernels (default: Config's)",
    )
    parser.add_argument("--chain", type=int, default=20, help="operations per timed program (and twice that)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="tokens per rank 128..8192, both backends")
    parser.add_argument("--plot", default="bench_normal_sweep.png", help="PNG path of the --sweep plot")
    parser.add_argument("--json", default=None, help="write all results here")
    args = parser.parse_args(argv)
    check_counts(parser, args, "tokens", "hidden", "experts", "topk", "chain", "repeats")
    if launch.NUM_PROCESSES_VAR in os.environ:  # one process per GPU: python -m deep_ep_jax.launch -n R -- ...
        launch.initialize()

    on_gpu = jax.default_backend() == "gpu"
    backends = args.backends or (["cuda", "xla"] if on_gpu else ["xla"])
    num_ranks = args.ranks or len(jax.devices())
    mesh = testing.ep_mesh(num_ranks, AXIS)
    case = Case(args.tokens, args.hidden, args.experts, args.topk)
    env = environment()
    print(f"# normal mode, EP={num_ranks} on {env['devices'][0]} ({env['platform']}), jax {env['jax']}")
    print(
        f"# {case.num_tokens} tokens/rank, hidden {case.hidden}, top-{case.topk} of {case.num_experts} experts, "
        f"chains of {args.chain} and {2 * args.chain} ops, {args.repeats} repeats"
    )
    if args.sweep:
        results = run_sweep(
            mesh, case, backends, args.num_sms[0], length=args.chain, repeats=args.repeats, plot_path=args.plot
        )
    else:
        results = run_table(
            mesh,
            case,
            backends,
            args.num_sms,
            length=args.chain,
            repeats=args.repeats,
            chunk_tokens_list=args.chunk_tokens,
        )
    print()
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, results=results), f, indent=1)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
