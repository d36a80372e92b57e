"""Forward + backward time of the MoE layer (examples/moe_layer.py) with the
deep_ep_jax CUDA kernels against the same layer on the reference backend
(XLA all_to_all), in one run, on all local GPUs (one expert-parallel group).

    python benchmarks/bench_moe_layer.py                # DeepSeek-V3-like layer
    python benchmarks/bench_moe_layer.py --hidden 4096 --json moe_layer.json
    python benchmarks/bench_moe_layer.py --expert-impl capacity,grouped
    python benchmarks/bench_moe_layer.py --expert-impl grouped --profile   # also: time by kernel

The experts run with --expert-impl, one or a comma list timed in one run
(e.g. capacity,grouped): "capacity" (batched matmuls over a padded
[experts, capacity, H] buffer; "auto" on GPUs without the Pallas-Triton
grouped matmul, where ragged_dot expands to a dense dot that does not fit),
"grouped" (expert-major rows from dispatch_expert_major, grouped_matmul:
Mosaic GPU kernels on Hopper), "grouped_fp8" (the same with FP8 forward and
input-gradient matmuls, the rows sent as FP8: the weights' FP8 copies are made once per jitted
call, as once per optimizer step of --steps micro-batches, their cost
included), "grouped_fp8_dw" (the weight gradients from FP8 operands too:
fp8_expert_weights' default; --steps 1 makes the copies every step)
or "ragged_dot". The capacity is taken from the
true routing (the largest load of an expert, rounded up to 128), and so are
the grouped path's expert rows per rank (the largest per-rank pair count,
rounded up to 128), computed once on the host, so nothing is dropped; the run
checks it. Before compiling, the run checks the routing (distinct in-range ids
per token, agreeing with a host top-k), prints the loads, the capacity and the
rows, and refuses a padded buffer over --max-capacity-gib.

The run also times the same experts without dispatch/combine (each rank's
own tokens on its local experts, ids taken modulo E/R: the same number of
pairs per rank on average and the same capacity or rows); the difference
estimates the share of the step spent in dispatch+combine.

Before running, each compiled step's memory per device (arguments + outputs
+ temporaries, from XLA's memory analysis) is checked against 90% of the XLA
pool (75% of the GPU by default); where it does not fit, tokens per device are
halved until it does, and the run says so.

Where the driver's NVML library is there, each layer's timed calls are also
given in joules per step per GPU, with the mean power and the share of the
time the power cap held the clocks down (this layer can run a GPU at its
power limit, where a step gets shorter only by needing less energy;
benchmarks/README.md).

Each jitted call runs --steps forward+backward passes in a fori_loop (each
step's input depends on the previous step's gradient, so XLA can neither
hoist nor drop them), which amortises the host cost of a jitted call
(docs/design.md section 3). The figure is the time of one step; median and
spread are over --reps calls after a warm-up call.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on our hosts

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(1, str(ROOT))
import moe_layer as ml  # noqa: E402
from timing import check_counts, gpu_meters, power_summary, print_kernel_breakdown  # noqa: E402

from deep_ep_jax import Buffer  # noqa: E402
from deep_ep_jax.comm.expert_major import default_num_rows  # noqa: E402
from deep_ep_jax.config import FP8_BLOCK  # noqa: E402

GiB = 2**30


def init_inputs(args, mesh, tokens):
    """Router (f32, replicated), expert weights (bf16, split over "expert"),
    tokens (bf16, split over every axis), made on the devices."""
    e, h, f = args.experts, args.hidden, args.ffn
    shardings = (
        NamedSharding(mesh, P()),
        NamedSharding(mesh, P("expert")),
        NamedSharding(mesh, P("expert")),
        NamedSharding(mesh, P(("data", "expert"))),
    )

    def init(key):
        k = jax.random.split(key, 4)
        router = jax.random.normal(k[0], (h, e), jnp.float32) * 0.02
        w_in = (jax.random.normal(k[1], (e, h, 2 * f), jnp.bfloat16) * h**-0.5).astype(jnp.bfloat16)
        w_out = (jax.random.normal(k[2], (e, f, h), jnp.bfloat16) * f**-0.5).astype(jnp.bfloat16)
        x = jax.random.normal(k[3], (mesh.size * tokens, h), jnp.bfloat16)
        return router, w_in, w_out, x

    return jax.jit(init, out_shardings=shardings)(jax.random.key(args.seed))


def check_routing(args, inputs, topk_idx):
    """Refuse routing that no trained model would give, before compiling:
    ids out of range or repeated within a token (a broken device top-k or
    NaN router logits: one expert for every pair makes the capacity N * K),
    or disagreeing with a float32 top-k on the host for a sample of tokens."""
    router, _, _, x = inputs
    e, k = args.experts, args.top_k
    if topk_idx.min() < 0 or topk_idx.max() >= e:
        raise SystemExit(f"routing: expert ids outside [0, {e}) (min {topk_idx.min()}, max {topk_idx.max()})")
    distinct = (np.diff(np.sort(topk_idx, axis=1), axis=1) != 0).all(axis=1)
    sample = min(64, x.shape[0])
    logits = np.asarray(x[:sample].astype(jnp.float32)) @ np.asarray(router, np.float32)
    host = np.argsort(-logits, axis=1)[:, :k]
    agree = np.mean([len(set(a) & set(b)) / k for a, b in zip(host, topk_idx[:sample])])
    print(
        f"routing check: tokens with {k} distinct experts {distinct.mean():.1%}, device top-{k} agrees "
        f"with a host float32 top-{k} on {agree:.1%} of ids ({sample} tokens); "
        f"router logits finite: {bool(np.isfinite(logits).all())}"
    )
    if not distinct.all() or agree < 0.75:
        raise SystemExit(
            f"routing is broken on this device (first token's ids {topk_idx[0].tolist()}, host "
            f"{host[0].tolist()}): capacities from it would be meaningless"
        )


def true_routing(args, inputs):
    """The router's top-k ids of every token (host, once), checked."""
    router, _, _, x = inputs

    # Top-k indices returned straight out of a sharded jit can come back wrong
    # (openxla/xla#49005: "TopK produces incorrect local index shapes when
    # returned directly"); an operation on them before returning avoids it.
    def device_ids(x, r):
        idx = ml.route(x, r, args.top_k)[0]
        return jnp.where(idx >= 0, idx, -1)

    topk_idx = np.asarray(jax.jit(device_ids)(x, router))
    check_routing(args, inputs, topk_idx)
    return topk_idx


def local_ids(args, mesh, topk_idx):
    """The "local" variant's routing: each rank's own tokens, ids modulo E/R, [R, T, K]."""
    return np.stack(np.split(topk_idx, mesh.size)) % (args.experts // mesh.shape["expert"])


def pick_capacity(args, mesh, topk_idx):
    """Slots per expert from the true routing: the largest load of an expert
    with dispatch (all tokens) and without (each rank's tokens, ids modulo
    E/R), rounded up to 128. Returns (capacity, largest load)."""
    num_local = args.experts // mesh.shape["expert"]
    counts = np.bincount(topk_idx.reshape(-1), minlength=args.experts)
    loads = [counts.max()] + [
        np.bincount(ids.reshape(-1), minlength=num_local).max() for ids in local_ids(args, mesh, topk_idx)
    ]
    largest = int(max(loads))
    capacity = args.capacity or -(-largest // 128) * 128
    # The largest padded activation per rank: [E/R, capacity, max(H, 2F)] bf16.
    buffer_gib = num_local * capacity * max(args.hidden, 2 * args.ffn) * 2 / GiB
    print(
        f"expert loads: mean {counts.mean():.0f}, min {counts.min()}, largest {largest} (with the per-rank "
        f"'local' loads); capacity {capacity} slots -> padded buffer "
        f"[{num_local}, {capacity}, {max(args.hidden, 2 * args.ffn)}] bf16 = {buffer_gib:.2f} GiB per device"
    )
    if buffer_gib > args.max_capacity_gib:
        raise SystemExit(
            f"capacity {capacity} needs a {buffer_gib:.1f} GiB padded buffer per device "
            f"(> --max-capacity-gib {args.max_capacity_gib}); refusing to compile"
        )
    dropped = int(ml.capacity_overflow(topk_idx, args.experts, capacity))
    if dropped or largest > capacity:
        raise SystemExit(f"--capacity {capacity} drops {dropped} (token, expert) pairs (largest load {largest})")
    return capacity, largest


def pick_expert_rows(args, mesh, topk_idx):
    """Expert-major rows per rank for the grouped path from the true routing:
    the largest per-rank row count (pairs, each expert's rounded up to
    --expert-alignment) with dispatch and without, rounded up to 128.
    Returns (rows, largest count)."""
    num_ranks, num_local, align = mesh.shape["expert"], args.experts // mesh.shape["expert"], args.expert_alignment

    def rows_of(counts):
        return int((-(-counts // align) * align).sum())

    counts = np.bincount(topk_idx.reshape(-1), minlength=args.experts).reshape(num_ranks, num_local)
    per_rank = [rows_of(c) for c in counts] + [
        rows_of(np.bincount(ids.reshape(-1), minlength=num_local)) for ids in local_ids(args, mesh, topk_idx)
    ]
    largest = max(per_rank)
    rows = args.expert_rows or -(-largest // 128) * 128
    print(
        f"expert-major rows per rank: mean {np.mean(per_rank[:num_ranks]):.0f}, largest {largest} (with the "
        f"'local' ones); {rows} rows (alignment {align}), worst case "
        f"{default_num_rows(topk_idx.shape[0], args.top_k, num_local, align)}"
    )
    dropped = int(ml.expert_rows_overflow(topk_idx, args.experts, num_ranks, rows, align))
    if dropped or largest > rows:
        raise SystemExit(f"--expert-rows {rows} drops {dropped} (token, expert) pairs (largest count {largest})")
    return rows, largest


def layer_fn(args, mesh, buffer, impl, sizes):
    """(x, router, w_in, w_out, fp8) -> (y, aux_loss): the MoE layer, or with
    buffer None its experts alone on each rank's own tokens (no dispatch or
    combine); fp8: FP8 copies of the weights for the FP8_IMPLS, else None."""
    kw = {
        "capacity": sizes.get("capacity"),
        "expert_rows": sizes.get("expert_rows"),
        "expert_alignment": args.expert_alignment,
    }
    impl = "grouped" if impl in FP8_IMPLS else impl
    if buffer is not None:
        return lambda x, r, wi, wo, fp8: ml.moe_apply(
            x, r, wi, wo, top_k=args.top_k, buffer=buffer, expert_impl=impl, fp8=fp8, **kw
        )
    num_local = args.experts // mesh.shape["expert"]
    tokens, experts = P(("data", "expert")), P("expert")

    def local(x, idx, w, wi, wo, fp8=None):
        return ml.expert_ffn(x.astype(jnp.bfloat16), idx % num_local, w, wi, wo, impl=impl, fp8=fp8, **kw)

    def apply(x, r, wi, wo, fp8):
        idx, w, aux = ml.route(x, r, args.top_k)
        operands = (x, idx, w, wi, wo) + (() if fp8 is None else (fp8,))
        per_rank = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(tokens, tokens, tokens, experts, experts, experts)[: len(operands)],
            out_specs=tokens,
        )
        return per_rank(*operands).astype(x.dtype), aux

    return apply


# grouped experts on FP8 operands: whether the weight gradients are too (fp8_expert_weights' weight_grad)
FP8_IMPLS = {"grouped_fp8": False, "grouped_fp8_dw": True}
# --expert-impl's names; "auto" first (parse_impls resolves it to one of the rest)
IMPL_NAMES = ("auto", *ml.EXPERT_IMPLS, *FP8_IMPLS)


def fp8_copies(impl, mesh):
    """(w_in, w_out) -> the FP8 copies the impl's layer takes (None but for the FP8_IMPLS), each rank's
    from its own experts."""
    if impl in FP8_IMPLS:
        return functools.partial(ml.fp8_expert_weights, weight_grad=FP8_IMPLS[impl], mesh=mesh, axis_name="expert")
    return lambda w_in, w_out: None


def make_steps(args, layer, copies):
    """A jitted function running args.steps forward+backward passes (copies:
    the weights' FP8 copies, made once before them, or None)."""

    def loss(x, router, w_in, w_out, fp8):
        y, aux_loss = layer(x, router, w_in, w_out, fp8)
        return 0.5 * jnp.sum(jnp.square(y.astype(jnp.float32))) + aux_loss

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))

    def steps(x, router, w_in, w_out):
        fp8 = copies(w_in, w_out)  # once per optimizer step of args.steps micro-batches

        def body(_, carry):
            x, keep = carry
            g_x, g_router, g_w_in, g_w_out = grad(x, router, w_in, w_out, fp8)
            # The next input depends on this gradient (a nudge far below bf16
            # resolution: same routing every step). One element of each weight
            # gradient keeps its computation alive without an extra pass.
            x = x + (1e-6 * g_x).astype(x.dtype)
            keep = keep + g_router[0, 0] + g_w_in[0, 0, 0].astype(jnp.float32) + g_w_out[0, 0, 0].astype(jnp.float32)
            return x, keep

        return jax.lax.fori_loop(0, args.steps, body, (x, jnp.zeros((), jnp.float32)))

    return jax.jit(steps)


def compile_steps(args, layer, copies, inputs):
    """Compiled steps and their memory per device in bytes (None if unknown)."""
    router, w_in, w_out, x = inputs
    compiled = make_steps(args, layer, copies).lower(x, router, w_in, w_out).compile()
    try:
        m = compiled.memory_analysis()
        need = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    except Exception:  # noqa: BLE001 (not every platform reports it)
        need = None
    return compiled, need


def time_steps(args, compiled, inputs):
    """(seconds per step of each call, power_summary's pair for all of them)."""
    router, w_in, w_out, x = inputs
    jax.block_until_ready(compiled(x, router, w_in, w_out))  # warm-up
    per_step = []
    meters = gpu_meters()
    start = time.perf_counter()
    for _ in range(args.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(x, router, w_in, w_out))
        per_step.append((time.perf_counter() - t0) / args.steps)
    power = power_summary(meters, gpu_meters(), time.perf_counter() - start, args.reps * args.steps)
    return per_step, power


def time_copies(args, copies, inputs):
    """Median ms of one jitted call making the FP8 weight copies (once per optimizer step)."""
    _, w_in, w_out, _ = inputs
    make = jax.jit(copies)
    jax.block_until_ready(make(w_in, w_out))  # compile, warm up
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(make(w_in, w_out))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def forward(layer, copies, inputs):
    router, w_in, w_out, x = inputs
    fn = jax.jit(lambda x, r, wi, wo: layer(x, r, wi, wo, copies(wi, wo))[0])
    return np.asarray(fn(x, router, w_in, w_out).astype(jnp.float32))


def pool_bytes(device):
    """Bytes of XLA's memory pool on the device (None where unknown, e.g. CPU)."""
    try:
        return (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 (platform-specific failures)
        return None


def parse_impls(text, on_gpu, fast_ragged_dot):
    """--expert-impl's comma list, "auto" resolved; in order, no repeats."""
    impls = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        if name == "auto":
            name = "capacity" if on_gpu and not fast_ragged_dot else "ragged_dot"
        if name not in IMPL_NAMES[1:]:
            raise SystemExit(f"--expert-impl: {name!r} is not one of {', '.join(IMPL_NAMES)}")
        if name not in impls:
            impls.append(name)
    if not impls:
        raise SystemExit("--expert-impl: give at least one")
    return impls


def pick_sizes(args, mesh, inputs, impls):
    """Capacity and expert rows from the true routing, for the impls that take them."""
    sizes = {}
    grouped = any(impl == "grouped" or impl in FP8_IMPLS for impl in impls)
    if "capacity" in impls or grouped:
        topk_idx = true_routing(args, inputs)
        if "capacity" in impls:
            sizes["capacity"], sizes["largest_expert_load"] = pick_capacity(args, mesh, topk_idx)
        if grouped:
            sizes["expert_rows"], sizes["largest_rows_per_rank"] = pick_expert_rows(args, mesh, topk_idx)
    return sizes


def describe(impl, sizes, ragged_name, hidden):
    if impl == "capacity":
        return (
            f"capacity experts ({sizes['capacity']} slots per expert, largest load "
            f"{sizes['largest_expert_load']}, nothing dropped)"
        )
    if impl == "grouped" or impl in FP8_IMPLS:
        gradients = "forward, input and weight gradients" if FP8_IMPLS.get(impl) else "forward and input gradients"
        rows = ", rows sent as FP8" if hidden % FP8_BLOCK == 0 else ""  # as the example does where it can
        fp8 = f", FP8 {gradients}{rows}, weight copies made once per jitted call" if impl != "grouped" else ""
        return (
            f"{impl} experts ({sizes['expert_rows']} expert-major rows per rank, largest count "
            f"{sizes['largest_rows_per_rank']}, nothing dropped{fp8})"
        )
    return f"ragged_dot experts ({ragged_name})"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per device")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048, help="expert intermediate size")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument(
        "--expert-impl",
        dest="impl",
        default="auto",
        help=f"comma list of {', '.join(IMPL_NAMES)} (auto: ragged_dot on CPU or with the "
        "Pallas-Triton grouped matmul, else capacity)",
    )
    p.add_argument("--capacity", type=int, default=0, help="slots per expert (0: from the routing, nothing dropped)")
    p.add_argument(
        "--expert-rows",
        type=int,
        default=0,
        help="grouped: expert-major rows per rank (0: from the routing, nothing dropped)",
    )
    p.add_argument(
        "--expert-alignment",
        type=int,
        default=0,
        help="grouped: each expert's rows start at a multiple (0: ml.default_expert_alignment(), "
        "128 on Hopper, where aligned groups take the warp-specialized kernels)",
    )
    p.add_argument(
        "--max-capacity-gib",
        type=float,
        default=4.0,
        help="refuse a capacity whose padded [E/R, capacity, H] buffer exceeds this per device",
    )
    p.add_argument("--steps", type=int, default=8, help="forward+backward passes per jitted call")
    p.add_argument("--reps", type=int, default=7, help="timed calls")
    p.add_argument("--backends", default="cuda,xla", help="comma list of cuda, xla")
    p.add_argument("--no-local", action="store_true", help="skip timing the experts without dispatch/combine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        nargs="?",
        type=int,
        const=12,
        default=0,
        metavar="TOP",
        help="also print where each layer's step goes on the first GPU: the TOP (12) kernels by time",
    )
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args()
    check_counts(p, args, "tokens", "hidden", "ffn", "experts", "top_k", "steps", "reps")
    args.expert_alignment = args.expert_alignment or ml.default_expert_alignment()

    fast_ragged_dot = ml.use_fast_ragged_dot()
    devices = jax.devices()
    on_gpu = devices[0].platform == "gpu"
    impls = parse_impls(args.impl, on_gpu, fast_ragged_dot)
    mesh = Mesh(np.array(devices).reshape(1, -1), ("data", "expert"))
    num_ranks = mesh.size
    if args.experts % num_ranks:
        raise SystemExit(f"--experts {args.experts} must divide by the {num_ranks} devices")
    if on_gpu and "ragged_dot" in impls and not fast_ragged_dot:
        print(
            "warning: ragged_dot uses XLA's dense expansion here (E/R times the FLOPs and memory); "
            "expect out-of-memory at large sizes (use --expert-impl capacity or grouped)",
            file=sys.stderr,
        )
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    pool = pool_bytes(devices[0])
    ragged_name = "pallas-triton" if fast_ragged_dot else "xla default"

    buffers = {}
    try:
        for name in backends:
            buffers[name] = Buffer(mesh, "expert", backend=name, hidden=args.hidden, num_experts=args.experts)
        # One row per (impl, variant): the layer on each backend, and its experts alone.
        rows = [(impl, v) for impl in impls for v in backends + ([] if args.no_local else ["local"])]
        tokens = args.tokens
        while True:  # halve tokens until every compiled step fits
            inputs = init_inputs(args, mesh, tokens)
            sizes = pick_sizes(args, mesh, inputs, impls)
            layers = {row: layer_fn(args, mesh, buffers.get(row[1]), row[0], sizes) for row in rows}
            t0 = time.perf_counter()
            compiled = {row: compile_steps(args, layers[row], fp8_copies(row[0], mesh), inputs) for row in rows}
            compile_s = time.perf_counter() - t0
            need = max((n for _, n in compiled.values() if n is not None), default=None)
            if pool is None or need is None or need <= 0.9 * pool or tokens <= 128:
                break
            print(
                f"{tokens} tokens/device need {need / GiB:.2f} GiB per device, more than 90% of XLA's "
                f"{pool / GiB:.2f} GiB pool: halving tokens"
            )
            del inputs, compiled
            tokens //= 2

        print(
            f"MoE layer forward+backward: {num_ranks} x {devices[0].device_kind}, jax {jax.__version__}, "
            f"{tokens} tokens/device, hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, "
            f"top-{args.top_k}, {'; '.join(describe(impl, sizes, ragged_name, args.hidden) for impl in impls)}; "
            f"{args.steps} steps per jitted call, {args.reps} calls"
        )
        pool_desc = f"of XLA's {pool / GiB:.1f} GiB pool" if pool else "(pool size unknown)"
        for impl in impls:
            mem = ", ".join(f"{v} {n / GiB:.2f}" for (i, v), (_, n) in compiled.items() if i == impl and n is not None)
            print(f"memory per device, GiB, {impl} experts: {mem or 'not reported'} {pool_desc}")
        print(f"compile {compile_s:.0f} s for all")
        if "cuda" in buffers:
            print(
                f"deep_ep_jax cuda buffer (outside XLA's pool): {buffers['cuda'].num_nvl_bytes / GiB:.2f} GiB "
                "per device"
            )

        # Useful expert FLOPs per device: 3 matmuls of 2*H*F per routed (token, expert),
        # three times over for forward + backward.
        flops = 3 * 3 * 2 * tokens * args.top_k * args.hidden * args.ffn
        results, outputs, powers = {}, {}, {}
        for row in rows:
            if row[1] != "local":
                outputs[row] = forward(layers[row], fp8_copies(row[0], mesh), inputs)
            per_step, (joules, power_line) = time_steps(args, compiled[row][0], inputs)
            med = statistics.median(per_step)
            if power_line:
                powers[row] = power_line
            results[row] = {
                "impl": row[0],
                "layer": row[1],
                "median_ms": med * 1e3,
                "min_ms": min(per_step) * 1e3,
                "max_ms": max(per_step) * 1e3,
                "expert_tflops": flops / med / 1e12,
                "memory_gib": None if compiled[row][1] is None else compiled[row][1] / GiB,
                "num_sms": buffers[row[1]].config.num_sms if row[1] == "cuda" else None,
                "joules_per_step": joules,
            }
            if args.profile:
                router, w_in, w_out, x = inputs
                print_kernel_breakdown(
                    f"{row[1]} layer, {row[0]} experts",
                    compiled[row][0],
                    (x, router, w_in, w_out),
                    args.steps,
                    top=args.profile,
                )
        copies_ms = {impl: time_copies(args, fp8_copies(impl, mesh), inputs) for impl in impls if impl in FP8_IMPLS}
    finally:
        for buffer in buffers.values():
            buffer.destroy()

    labels = {"xla": "reference (XLA all_to_all)", "local": "experts only (no dispatch/combine)"}
    print("\n| layer | median ms/step | min | max | expert TFLOP/s | dispatch+combine share |")
    print("|---|---|---|---|---|---|")
    for (impl, v), r in results.items():
        label = f"deep_ep_jax cuda ({r['num_sms']} SMs)" if v == "cuda" else labels[v]
        local = results.get((impl, "local"))
        share = "" if v == "local" or local is None else f"{1 - local['median_ms'] / r['median_ms']:.0%}"
        if share:
            r["comm_share"] = 1 - local["median_ms"] / r["median_ms"]
        print(
            f"| {label}, {impl} experts | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['max_ms']:.2f} "
            f"| {r['expert_tflops']:.1f} | {share} |"
        )
    for (impl, v), line in powers.items():
        print(f"{v} layer, {impl} experts, the timed calls: {line}")
    for impl, ms in copies_ms.items():
        print(
            f"{impl}: the FP8 weight copies alone take {ms:.2f} ms per call (median of {args.reps}), made once per "
            f"jitted call: {ms / args.steps:.2f} ms of each of its {args.steps} steps above"
        )
    print()
    for impl in impls:
        cuda, xla = (impl, "cuda"), (impl, "xla")
        if cuda in results and xla in results:
            diff = np.abs(outputs[cuda] - outputs[xla]).max()
            speedup = results[xla]["median_ms"] / results[cuda]["median_ms"]
            print(
                f"speedup of the layer ({impl} experts): {speedup:.2f}x; "
                f"forward outputs of the two backends: max |diff| = {diff:.3g}"
            )
    # The other expert paths against the first, on the same backend.
    (first_impl, first_v), first_out = next(iter(outputs.items()))
    for (impl, v), out in outputs.items():
        if impl != first_impl and v == first_v:
            ratio = results[(first_impl, v)]["median_ms"] / results[(impl, v)]["median_ms"]
            print(
                f"{v}: {impl} experts {ratio:.2f}x as fast as {first_impl}; forward outputs: "
                f"max |diff| = {np.abs(out - first_out).max():.3g}"
            )
    if args.json:
        meta = {k: getattr(args, k) for k in ("hidden", "ffn", "experts", "top_k", "steps", "reps", "expert_alignment")}
        meta.update(
            tokens=tokens,
            devices=f"{num_ranks} x {devices[0].device_kind}",
            jax=jax.__version__,
            expert_impls=impls,
            ragged_dot=ragged_name,
            fp8_copies_ms=copies_ms,
            **sizes,
        )
        Path(args.json).write_text(json.dumps({"config": meta, "results": list(results.values())}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
