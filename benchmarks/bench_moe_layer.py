"""Forward + backward time of the MoE layer (examples/moe_layer.py) with the
deep_ep_jax CUDA kernels against the same layer on the reference backend
(XLA all_to_all), in one run, on all local GPUs (one expert-parallel group).

    python benchmarks/bench_moe_layer.py                # DeepSeek-V3-like layer
    python benchmarks/bench_moe_layer.py --hidden 4096 --json moe_layer.json

Each jitted call runs --steps forward+backward passes in a fori_loop (each
step's input depends on the previous step's gradient, so XLA can neither
hoist nor drop them), which amortises the ~300 us host cost of a jitted
call. The figure is the time of one step; median and spread are over --reps
calls after a warm-up call.
"""

from __future__ import annotations

import argparse
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(1, str(ROOT))
import moe_layer as ml  # noqa: E402

from deep_ep_jax import Buffer  # noqa: E402


def init_inputs(args, mesh):
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
        w_in = (jax.random.normal(k[1], (e, h, 2 * f), jnp.float32) * h**-0.5).astype(jnp.bfloat16)
        w_out = (jax.random.normal(k[2], (e, f, h), jnp.float32) * f**-0.5).astype(jnp.bfloat16)
        x = jax.random.normal(k[3], (mesh.size * args.tokens, h), jnp.float32).astype(jnp.bfloat16)
        return router, w_in, w_out, x

    return jax.jit(init, out_shardings=shardings)(jax.random.key(args.seed))


def make_steps(args, buffer):
    """A jitted function running args.steps forward+backward passes."""

    def loss(x, router, w_in, w_out):
        y, aux_loss = ml.moe_apply(x, router, w_in, w_out, top_k=args.top_k, buffer=buffer)
        return 0.5 * jnp.sum(jnp.square(y.astype(jnp.float32))) + aux_loss

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))

    def steps(x, router, w_in, w_out):
        def body(_, carry):
            x, keep = carry
            g_x, g_router, g_w_in, g_w_out = grad(x, router, w_in, w_out)
            # The next input depends on this gradient (a nudge far below bf16
            # resolution: same routing every step). One element of each weight
            # gradient keeps its computation alive without an extra pass.
            x = x + (1e-6 * g_x).astype(x.dtype)
            keep = keep + g_router[0, 0] + g_w_in[0, 0, 0].astype(jnp.float32) + g_w_out[0, 0, 0].astype(jnp.float32)
            return x, keep

        return jax.lax.fori_loop(0, args.steps, body, (x, jnp.zeros((), jnp.float32)))

    return jax.jit(steps)


def forward(args, buffer, inputs):
    router, w_in, w_out, x = inputs
    fn = jax.jit(lambda x, r, wi, wo: ml.moe_apply(x, r, wi, wo, top_k=args.top_k, buffer=buffer)[0])
    return np.asarray(fn(x, router, w_in, w_out).astype(jnp.float32))


def time_backend(args, buffer, inputs):
    router, w_in, w_out, x = inputs
    run = make_steps(args, buffer)
    t0 = time.perf_counter()
    jax.block_until_ready(run(x, router, w_in, w_out))  # compile + warm-up
    compile_s = time.perf_counter() - t0
    per_step = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(x, router, w_in, w_out))
        per_step.append((time.perf_counter() - t0) / args.steps)
    return per_step, compile_s


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per device")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048, help="expert intermediate size")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="forward+backward passes per jitted call")
    p.add_argument("--reps", type=int, default=7, help="timed calls")
    p.add_argument("--backends", default="cuda,xla", help="comma list of cuda, xla")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args()

    fast_ragged_dot = ml.use_fast_ragged_dot()
    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(1, -1), ("data", "expert"))
    num_ranks = mesh.size
    if args.experts % num_ranks:
        raise SystemExit(f"--experts {args.experts} must divide by the {num_ranks} devices")
    if devices[0].platform == "gpu" and not fast_ragged_dot:
        print("warning: ragged_dot uses XLA's dense expansion here (E/R times the FLOPs and memory); "
              "expect out-of-memory at large sizes", file=sys.stderr)

    # Useful expert FLOPs per device: 3 matmuls of 2*H*F per routed (token, expert),
    # three times over for forward + backward.
    flops = 3 * 3 * 2 * args.tokens * args.top_k * args.hidden * args.ffn
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    print(
        f"MoE layer forward+backward: {num_ranks} x {devices[0].device_kind}, jax {jax.__version__}, "
        f"{args.tokens} tokens/device, hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, "
        f"top-{args.top_k}, ragged_dot {'pallas-triton' if fast_ragged_dot else 'xla default'}; "
        f"{args.steps} steps per jitted call, {args.reps} calls"
    )
    inputs = init_inputs(args, mesh)
    results, outputs = {}, {}
    for name in backends:
        buffer = Buffer(mesh, "expert", backend=name, hidden=args.hidden, num_experts=args.experts)
        try:
            outputs[name] = forward(args, buffer, inputs)
            per_step, compile_s = time_backend(args, buffer, inputs)
        finally:
            buffer.destroy()
        med = statistics.median(per_step)
        results[name] = {
            "median_ms": med * 1e3,
            "min_ms": min(per_step) * 1e3,
            "max_ms": max(per_step) * 1e3,
            "expert_tflops": flops / med / 1e12,
            "compile_s": compile_s,
            "num_sms": buffer.config.num_sms if name == "cuda" else None,
        }

    print("\n| backend | median ms/step | min | max | expert TFLOP/s | compile s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        label = f"deep_ep_jax cuda ({r['num_sms']} SMs)" if name == "cuda" else "reference (XLA all_to_all)"
        print(f"| {label} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['max_ms']:.2f} "
              f"| {r['expert_tflops']:.1f} | {r['compile_s']:.0f} |")
    if "cuda" in results and "xla" in results:
        diff = np.abs(outputs["cuda"] - outputs["xla"]).max()
        print(f"\nspeedup of the layer: {results['xla']['median_ms'] / results['cuda']['median_ms']:.2f}x; "
              f"forward outputs of the two backends: max |diff| = {diff:.3g}")
    if args.json:
        meta = {k: getattr(args, k) for k in ("tokens", "hidden", "ffn", "experts", "top_k", "steps", "reps")}
        meta.update(devices=f"{num_ranks} x {devices[0].device_kind}", jax=jax.__version__,
                    ragged_dot="pallas-triton" if fast_ragged_dot else "xla default")
        Path(args.json).write_text(json.dumps({"config": meta, "results": results}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
