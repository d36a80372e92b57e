"""Greedy decoding of the MoE language model of moe_flax.py in the low-latency mode.

    python examples/moe_decode.py

Trains the small model of moe_flax.py for a few steps (normal-mode dispatch
and combine), then decodes with a KV cache: one jitted step per token, static
shapes, `--batch` sequences per device. In the decode step each MoE layer
uses a second Buffer, in low-latency mode, as DeepEP's decoding does:

    route -> low_latency_dispatch_send ... low_latency_dispatch_recv
          -> compact the expert-major rows -> SwiGLU experts (grouped matmuls)
          -> expand back to the dispatch's rows -> low_latency_combine

The step splits its batch into two micro-batches, a and b. While a's rows
travel (between the send and the receive), b's attention runs, and then the
other way round: `low_latency_overlap` puts the attention there.

Prints a check (exit status 1 when it fails): the decode path's logits for
the first generated position against the training model's full forward
(normal-mode MoE) on the same prompt. Then tokens per second, the time per
step and the time of the step's MoE part alone, median and spread over
`--repeats`: with the CUDA kernels and the reference backend beside them on
GPUs, with the reference backend on a CPU (8 virtual devices).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import time
from pathlib import Path

# Virtual CPU devices must be requested before jax is imported (as moe_flax.py).
if not any(p in os.environ.get("JAX_PLATFORMS", "") for p in ("cuda", "gpu")) and (
    "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))  # moe_flax, moe_layer
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # deep_ep_jax from a checkout
import moe_flax
from moe_layer import ExpertParam, route, use_fast_ragged_dot

from deep_ep_jax import (
    Buffer,
    Config,
    grouped_matmul,
    low_latency_combine,
    low_latency_dispatch_recv,
    low_latency_dispatch_send,
    low_latency_overlap,
)
from deep_ep_jax.experts.grouped_gemm import swiglu

# --------------------------------------------------------------------------
# Experts on the low-latency dispatch's rows (per rank)


def expert_mlp(recv_x, recv_count, w_in, w_out, num_rows: int):
    """SwiGLU experts on the expert-major rows of low_latency_dispatch.

    recv_x: bf16 [L, C, H], or the FP8 pair (e4m3 [L, C, H], f32 scales
    [L, C, H / 128]); the first recv_count[e] rows of local expert e hold
    data, the rest are padding (any bits). w_in [L, H, 2F], w_out [L, F, H].
    num_rows: a static bound on sum(recv_count), the packed rows.
    Returns bf16 [L, C, H], the experts' outputs in the dispatch's rows
    (unweighted: low_latency_combine weights them), zeros in padding rows.
    """
    recv_xs = recv_x if isinstance(recv_x, tuple) else (recv_x,)
    num_local, capacity = recv_xs[0].shape[:2]
    ends = jnp.cumsum(recv_count)
    offsets = ends - recv_count

    # Compact: packed row m is row m - offsets[e] of the expert e whose group
    # holds m. Rows past sum(recv_count) are zeros: no padding row is read.
    packed = jnp.arange(num_rows, dtype=jnp.int32)
    expert = jnp.searchsorted(ends, packed, side="right").astype(jnp.int32)  # num_local past the end
    valid = expert < num_local
    clipped = jnp.minimum(expert, num_local - 1)
    source = jnp.where(valid, clipped * capacity + packed - offsets[clipped], 0)
    rows = [jnp.where(valid[:, None], a.reshape(num_local * capacity, -1)[source], 0) for a in recv_xs]
    if len(rows) == 2:  # FP8: dequantize per block of channels
        q, scales = rows
        blocks = q.reshape(num_rows, scales.shape[-1], -1).astype(jnp.float32) * scales[:, :, None]
        rows = [blocks.reshape(q.shape)]
    x = rows[0].astype(jnp.bfloat16)

    hidden = swiglu(grouped_matmul(x, w_in.astype(jnp.bfloat16), recv_count))
    out = grouped_matmul(hidden, w_out.astype(jnp.bfloat16), recv_count)

    # Expand: row i of expert e is packed row offsets[e] + i.
    slot = jnp.arange(capacity, dtype=jnp.int32)
    filled = slot[None, :] < recv_count[:, None]
    index = jnp.where(filled, offsets[:, None] + slot[None, :], 0)
    return jnp.where(filled[..., None], out[index], 0).astype(jnp.bfloat16)


# --------------------------------------------------------------------------
# The decode step (per rank, inside shard_map over the whole mesh)


class Decoder:
    """The jitted decode step and MoE-only function over one low-latency Buffer.

    step(params, caches, tokens [B], position) -> (logits [B, V], next tokens
    [B], caches): feeds each sequence's token at `position`, writes its keys
    and values there. caches = {"a": [(keys, values)] per layer, "b": ...},
    each [B / 2, S, heads, head_dim], one per micro-batch.
    moe_only(params, xa, xb) -> (xa, xb): x + MoE(x) through every layer, the
    step's MoE part on the same shapes.
    """

    def __init__(self, graphdef, param_specs, buffer: Buffer, *, num_experts: int, fp8: bool):
        self.graphdef, self.buffer = graphdef, buffer
        self.num_experts, self.fp8 = num_experts, fp8
        self.max_tokens = buffer.num_max_dispatch_tokens_per_rank  # one micro-batch
        tokens = P(tuple(buffer.mesh.axis_names))  # split over every mesh axis
        per_rank = functools.partial(jax.shard_map, mesh=buffer.mesh)
        self.step = jax.jit(
            per_rank(self._step, in_specs=(param_specs, tokens, tokens, P()), out_specs=(tokens, tokens, tokens)),
            donate_argnums=1,
        )
        self.moe_only = jax.jit(
            per_rank(self._moe_only, in_specs=(param_specs, tokens, tokens), out_specs=(tokens, tokens))
        )

    def _step(self, params, caches, tokens, position):
        model = nnx.merge(self.graphdef, params)
        blocks, half = model.blocks, tokens.shape[0] // 2
        position_row = lax.dynamic_index_in_dim(model.position[...], position, keepdims=False)
        xa, xb = (model.embed(t) + position_row for t in (tokens[:half], tokens[half:]))
        kv_a, kv_b = list(caches["a"]), list(caches["b"])

        def attend(layer, x, kv):
            return self._attend(blocks[layer], x, kv, position)

        def head(x):
            return model.embed.attend(model.norm(x))

        # Two micro-batches in turn: each one's dispatch travels while the
        # other one's attention (or, at the end, a's output head) runs.
        xa, ha, kv_a[0] = attend(0, xa, kv_a[0])
        for layer, block in enumerate(blocks):
            sent = self._send(block, ha)
            sent, (xb, hb, kv_b[layer]) = low_latency_overlap(sent, functools.partial(attend, layer), xb, kv_b[layer])
            xa = xa + self._receive(block, sent)
            sent = self._send(block, hb)
            if layer + 1 < len(blocks):
                sent, (xa, ha, kv_a[layer + 1]) = low_latency_overlap(
                    sent, functools.partial(attend, layer + 1), xa, kv_a[layer + 1]
                )
            else:
                sent, logits_a = low_latency_overlap(sent, head, xa)
            xb = xb + self._receive(block, sent)
        logits = jnp.concatenate([logits_a, head(xb)])
        return logits, jnp.argmax(logits, -1).astype(jnp.int32), {"a": kv_a, "b": kv_b}

    def _attend(self, block, x, kv, position):
        """The new token's attention over the cache: (x + attention, the MoE's
        input, the cache with this token's keys and values)."""
        attn, (batch, hidden) = block.attn, x.shape
        q, k, v = jnp.split(attn.qkv(block.attn_norm(x)).reshape(batch, 3 * attn.heads, -1), 3, axis=1)
        keys = lax.dynamic_update_slice_in_dim(kv[0], k[:, None], position, axis=1)
        values = lax.dynamic_update_slice_in_dim(kv[1], v[:, None], position, axis=1)
        scores = jnp.einsum("bnd,bsnd->bns", q, keys) / np.sqrt(q.shape[-1])
        scores = jnp.where(jnp.arange(keys.shape[1]) <= position, scores, -jnp.inf)  # causal
        y = jnp.einsum("bns,bsnd->bnd", jax.nn.softmax(scores, axis=-1), values)
        x = x + attn.out(y.reshape(batch, hidden))
        return x, block.moe_norm(x), (keys, values)

    def _send(self, block, h):
        """Routes h [T, H] and sends its rows; returns what _receive needs."""
        topk_idx, topk_weights, _ = route(h, block.moe.router[...], block.moe.top_k)
        pending = low_latency_dispatch_send(
            h.astype(jnp.bfloat16),
            topk_idx,
            buffer=self.buffer,
            num_experts=self.num_experts,
            num_max_dispatch_tokens_per_rank=self.max_tokens,
            use_fp8=self.fp8,
        )
        return pending, topk_idx, topk_weights

    def _receive(self, block, sent):
        pending, topk_idx, topk_weights = sent
        recv_x, recv_count, handle = low_latency_dispatch_recv(pending, buffer=self.buffer)
        num_local = self.num_experts // self.buffer.num_ranks
        # Each (source rank, token) names at most min(K, L) distinct local
        # experts (route's top-k ids are distinct): the packed rows' bound.
        num_rows = self.buffer.num_ranks * self.max_tokens * min(topk_idx.shape[1], num_local)
        y = expert_mlp(recv_x, recv_count, block.moe.w_in[...], block.moe.w_out[...], num_rows)
        return low_latency_combine(y, topk_idx, topk_weights, handle, buffer=self.buffer).astype(jnp.float32)

    def _moe_only(self, params, xa, xb):
        for block in nnx.merge(self.graphdef, params).blocks:
            xa = xa + self._receive(block, self._send(block, block.moe_norm(xa)))
            xb = xb + self._receive(block, self._send(block, block.moe_norm(xb)))
        return xa, xb


# --------------------------------------------------------------------------
# Driver


def train(margs, mesh, buffer):
    """moe_flax's training step for margs.steps steps; returns (params, chain)."""
    chain = moe_flax.MarkovChain(margs.vocab, margs.branching, margs.seed)
    params, opt_state, train_step = moe_flax.init_training(margs, mesh, buffer)
    rng = np.random.default_rng(margs.seed + 1)
    token_sharding = NamedSharding(mesh, P(("data", "expert")))
    start, losses = time.perf_counter(), []
    for _ in range(margs.steps):
        tokens = jax.device_put(chain.sample(rng, margs.batch, margs.seq_len + 1)[0], token_sharding)
        params, opt_state, lm_loss, _ = train_step(params, opt_state, tokens)
        losses.append(float(lm_loss))
    if losses:
        print(
            f"trained {margs.steps} steps in {time.perf_counter() - start:.1f} s: loss {losses[0]:.3f} -> "
            f"{losses[-1]:.3f} (uniform {np.log(margs.vocab):.3f})"
        )
    return params, chain


def spread(samples, scale=1e3):
    """'median (min-max)' of seconds, in ms."""
    s = np.asarray(samples) * scale
    return f"{np.median(s):.3f} ms ({s.min():.3f}-{s.max():.3f})"


def check_logits(got, want, backend: str, fp8: bool) -> bool:
    """Prints and returns whether the decode path's logits [B, V] match the
    full forward's: per sequence, max abs error within a tolerance of max
    |logit| (bf16 rounding: the two paths round the MoE's sums in different
    places; FP8 dispatch quantizes its rows). A sequence whose router meets a
    near-tie can pick another expert on one path and differ more: 2% of the
    sequences may."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    tolerance, scale = (0.03 if fp8 else 0.01), np.abs(want).max()
    error = np.abs(got - want).max(axis=1)
    within = error <= tolerance * scale
    allowed = int(np.ceil(0.02 * len(error)))
    ok = bool(np.isfinite(got).all() and (~within).sum() <= allowed)
    worst = error[within].max() if within.any() else np.nan
    print(
        f"check ({backend}): decode logits at the first generated position vs the full forward (normal mode): "
        f"max abs error {worst:.4f} = {worst / scale:.2%} of max |logit| {scale:.2f} on {within.sum()} of "
        f"{len(error)} sequences (tolerance {tolerance:.1%}); {(~within).sum()} beyond it (top-k near-ties; "
        f"allowed {allowed}): {'OK' if ok else 'FAILED'}"
    )
    return ok


def run_backend(decoder, params, forward_logits, prompt, chain, args, margs):
    """Prefill, check, time; returns whether the check passed."""
    buffer = decoder.buffer
    tokens, replicated = NamedSharding(buffer.mesh, P(("data", "expert"))), NamedSharding(buffer.mesh, P())
    batch, prompt_len = prompt.shape
    positions = [jax.device_put(np.int32(p), replicated) for p in range(prompt_len + args.decode_steps)]
    zeros = np.zeros((batch // 2, margs.seq_len, margs.heads, margs.hidden // margs.heads), np.float32)
    caches = jax.device_put({half: [(zeros, zeros)] * margs.layers for half in "ab"}, tokens)

    # Prefill token by token through the decode step: the last logits predict
    # the first generated token.
    for p in range(prompt_len):
        logits, next_token, caches = decoder.step(params, caches, jax.device_put(prompt[:, p], tokens), positions[p])
    ok = check_logits(logits, forward_logits, buffer.backend, args.fp8)

    def generate(caches, record=None):
        token = next_token
        for p in positions[prompt_len:]:
            _, token, caches = decoder.step(params, caches, token, p)
            if record is not None:
                record.append(token)
        return jax.block_until_ready(token)

    prefilled = caches
    generated = []
    generate(jax.tree.map(jnp.copy, prefilled), generated)  # also warms up
    seqs = np.concatenate([prompt[:, -1:], np.stack([np.asarray(t) for t in generated], 1)], 1)
    allowed = np.mean([[b in chain.successors[a] for a, b in itertools.pairwise(s)] for s in seqs])

    # The MoE part alone: every layer's MoE on both micro-batches, each call
    # taking the previous one's output.
    rng = np.random.default_rng(margs.seed)
    xs = [jax.device_put(rng.standard_normal((batch // 2, margs.hidden), np.float32), tokens) for _ in "ab"]
    xs = jax.block_until_ready(decoder.moe_only(params, *xs))

    # Both timed in turn in each repeat, so that both see the same machine.
    step_times, moe_times = [], []
    for _ in range(args.repeats):
        caches = jax.block_until_ready(jax.tree.map(jnp.copy, prefilled))
        start = time.perf_counter()
        generate(caches)
        step_times.append((time.perf_counter() - start) / args.decode_steps)
        start = time.perf_counter()
        for _ in range(args.decode_steps):
            xs = decoder.moe_only(params, *xs)
        jax.block_until_ready(xs)
        moe_times.append((time.perf_counter() - start) / args.decode_steps)
    print(
        f"{buffer.backend:>4}: {batch / np.median(step_times):,.0f} tokens/s (all devices); per step "
        f"{spread(step_times)}; MoE part alone {spread(moe_times)}; {allowed:.1%} of generated transitions are "
        f"ones the chain allows"
    )
    return ok


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Other options (--hidden --ffn --heads --layers --experts --top-k --vocab --seq-len --ep "
        "--backend --lr --seed ...) set the model and its training, as in moe_flax.py.",
    )
    p.add_argument("--train-steps", "--steps", type=int, default=30, help="training steps before decoding (0: none)")
    p.add_argument("--train-batch", type=int, default=32, help="sequences per training step (global)")
    p.add_argument(
        "--batch", type=int, default=0, help="sequences decoded per device, even (default: 128 on GPUs, 16 on a CPU)"
    )
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--decode-steps", type=int, default=32, help="tokens generated (timed) after the prompt")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats of the decoding")
    p.add_argument("--fp8", action="store_true", help="FP8 dispatch (default bf16)")
    p.add_argument(
        "--overlap-sms",
        type=int,
        default=0,
        help="Config.low_latency_overlap_sms: SMs of the sends that run beside the attention (CUDA)",
    )
    args, model_argv = p.parse_known_args(argv)
    margs = moe_flax.parse_args(model_argv + ["--steps", str(args.train_steps), "--batch", str(args.train_batch)])
    return args, margs


def main(argv=None):
    args, margs = parse_args(argv)
    fast_ragged_dot = use_fast_ragged_dot()
    mesh = moe_flax.make_mesh(margs.ep)
    moe_flax.check_model_args(margs, mesh, batch_flag="--train-batch")  # margs.batch is the training batch
    on_gpu = jax.devices()[0].platform != "cpu"
    per_device = args.batch or (128 if on_gpu else 16)
    if per_device <= 0 or per_device % 2:
        raise SystemExit(f"--batch {per_device} must be a positive even number (two micro-batches)")
    if args.prompt_len < 1 or args.prompt_len + args.decode_steps > margs.seq_len:
        raise SystemExit(
            f"--prompt-len {args.prompt_len} + --decode-steps {args.decode_steps} must be at most "
            f"--seq-len {margs.seq_len} (the model's positions), with a prompt of at least 1"
        )
    if args.fp8 and margs.hidden % 128:
        raise SystemExit(f"--fp8 needs --hidden a multiple of 128, got {margs.hidden}")
    if args.repeats < 1 or args.decode_steps < 1:
        raise SystemExit(f"--repeats {args.repeats} and --decode-steps {args.decode_steps} must be at least 1")
    if args.train_steps < 0 or args.overlap_sms < 0:
        raise SystemExit(f"--train-steps {args.train_steps} and --overlap-sms {args.overlap_sms} must be at least 0")

    train_buffer = Buffer(mesh, "expert", backend=margs.backend, hidden=margs.hidden, num_experts=margs.experts)
    backends = [train_buffer.backend] + (["xla"] if train_buffer.backend == "cuda" else [])
    decode_buffers = [
        Buffer(
            mesh,
            "expert",
            backend=b,
            low_latency_mode=True,
            hidden=margs.hidden,
            num_experts=margs.experts,
            num_max_dispatch_tokens_per_rank=per_device // 2,
            config=Config(low_latency_overlap_sms=args.overlap_sms),
        )
        for b in backends
    ]
    batch = per_device * mesh.size
    print(
        f"devices: {mesh.size} x {jax.devices()[0].platform}, mesh {dict(mesh.shape)}, backends {backends}"
        + (", ragged_dot: pallas-triton" if fast_ragged_dot else "")
    )
    try:
        params, chain = train(margs, mesh, train_buffer)
        abstract = nnx.eval_shape(lambda: moe_flax.LanguageModel(margs, train_buffer, rngs=nnx.Rngs(0)))
        graphdef, abstract_params = nnx.split(abstract, nnx.Param)
        param_specs = jax.tree.map(
            lambda v: P("expert") if isinstance(v, ExpertParam) else P(),
            abstract_params,
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )

        tokens = NamedSharding(mesh, P(("data", "expert")))
        prompt = chain.sample(np.random.default_rng(margs.seed + 2), batch, args.prompt_len)[0]
        forward = jax.jit(lambda params, t: nnx.merge(graphdef, params)(t)[0][:, -1])
        forward_logits = forward(params, jax.device_put(prompt, tokens))
        print(
            f"decode: {per_device} sequences per device ({batch} in all), prompt {args.prompt_len}, "
            f"{args.decode_steps} steps, {'FP8' if args.fp8 else 'bf16'} dispatch, "
            f"{args.overlap_sms} overlap SMs; median (min-max) of {args.repeats}"
        )
        ok = True
        for buffer in decode_buffers:
            decoder = Decoder(graphdef, param_specs, buffer, num_experts=margs.experts, fp8=args.fp8)
            ok &= run_backend(decoder, params, forward_logits, prompt, chain, args, margs)
    finally:
        for buffer in decode_buffers + [train_buffer]:
            buffer.destroy()
    if not ok:
        raise SystemExit("the decode path's logits do not match the full forward")


if __name__ == "__main__":
    main()
