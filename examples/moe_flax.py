"""Train a small decoder-only language model with expert-parallel MoE layers.

    python examples/moe_flax.py --steps 40

The task is synthetic but learnable: sequences from a random sparse Markov
chain (every token has a few likely successors), so the loss falls from
log(vocab) towards the chain's entropy, which is printed as the floor.

Runs on whatever devices are present: on a CPU-only machine it makes 8
virtual devices and uses the reference backend (XLA collectives); on GPUs
Buffer(backend="auto") picks the CUDA kernels. The mesh is (data, expert);
tokens are split over both axes, expert weights over "expert".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# Virtual CPU devices must be requested before jax is imported. The flag only
# affects the CPU platform, so it is harmless on GPU machines.
if not any(
    p in os.environ.get("JAX_PLATFORMS", "") for p in ("cuda", "gpu")
) and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))  # moe_layer
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # deep_ep_jax from a checkout
from moe_layer import EXPERT_IMPLS, ExpertParam, MoE, use_fast_ragged_dot

from deep_ep_jax import Buffer

ModuleList = getattr(nnx, "List", list)  # flax >= 0.12 wants nnx.List for lists of modules


# --------------------------------------------------------------------------
# Data: a random sparse Markov chain


class MarkovChain:
    def __init__(self, vocab: int, branching: int, seed: int):
        rng = np.random.default_rng(seed)
        self.successors = np.stack([rng.choice(vocab, branching, replace=False) for _ in range(vocab)])
        self.probs = rng.dirichlet(np.ones(branching), size=vocab)
        self.cumprobs = np.cumsum(self.probs, axis=1)
        self.vocab = vocab

    def sample(self, rng, batch: int, length: int):
        """int32 [batch, length] token ids and the mean true -log p(next | current)."""
        tokens = np.empty((batch, length), np.int32)
        tokens[:, 0] = rng.integers(self.vocab, size=batch)
        nll = 0.0
        for t in range(1, length):
            current = tokens[:, t - 1]
            choice = (rng.random(batch)[:, None] > self.cumprobs[current]).sum(1)
            choice = np.minimum(choice, self.successors.shape[1] - 1)
            tokens[:, t] = self.successors[current, choice]
            nll -= np.log(self.probs[current, choice]).sum()
        return tokens, nll / (batch * (length - 1))


# --------------------------------------------------------------------------
# Model


class Attention(nnx.Module):
    def __init__(self, hidden: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.qkv = nnx.Linear(hidden, 3 * hidden, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(hidden, hidden, use_bias=False, rngs=rngs)

    def __call__(self, x):
        batch, length, hidden = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(batch, length, 3 * self.heads, -1), 3, axis=2)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.reshape(batch, length, hidden))


class Block(nnx.Module):
    def __init__(self, args, buffer: Buffer, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(args.hidden, rngs=rngs)
        self.attn = Attention(args.hidden, args.heads, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(args.hidden, rngs=rngs)
        self.moe = MoE(
            args.hidden,
            args.ffn,
            args.experts,
            args.top_k,
            buffer=buffer,
            rngs=rngs,
            expert_impl=args.expert_impl,
            dropless=args.dropless,
        )

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        y, aux_loss = self.moe(self.moe_norm(x))
        return x + y, aux_loss


class LanguageModel(nnx.Module):
    def __init__(self, args, buffer: Buffer, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(args.vocab, args.hidden, rngs=rngs)
        self.position = nnx.Param(jax.random.normal(rngs.params(), (args.seq_len, args.hidden)) * 0.02)
        self.blocks = ModuleList([Block(args, buffer, rngs=rngs) for _ in range(args.layers)])
        self.norm = nnx.RMSNorm(args.hidden, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.position[...][: tokens.shape[1]]
        aux_losses = []
        for block in self.blocks:
            x, aux_loss = block(x)
            aux_losses.append(aux_loss)
        return self.embed.attend(self.norm(x)), jnp.mean(jnp.stack(aux_losses))


# --------------------------------------------------------------------------
# Training


def make_mesh(ep: int) -> Mesh:
    devices = jax.devices()
    if ep <= 0:  # default: all GPUs on the expert axis; on CPU show both axes
        ep = len(devices) if devices[0].platform != "cpu" else max(1, len(devices) // 2)
    if len(devices) % ep:
        raise SystemExit(f"--ep {ep} does not divide the {len(devices)} devices")
    return Mesh(np.array(devices).reshape(len(devices) // ep, ep), ("data", "expert"))


def init_training(args, mesh: Mesh, buffer: Buffer):
    """Model parameters placed on the mesh, optimizer state, and the jitted step."""
    model = LanguageModel(args, buffer, rngs=nnx.Rngs(args.seed))
    # Expert weights split over "expert"; everything else replicated.
    replicated = NamedSharding(mesh, P())
    experts, others = nnx.state(model, ExpertParam), nnx.state(model, nnx.Not(ExpertParam))
    nnx.update(model, jax.device_put(experts, NamedSharding(mesh, P("expert"))), jax.device_put(others, replicated))
    graphdef, params = nnx.split(model, nnx.Param)

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, 5, max(args.steps, 6))
    optimizer = optax.adamw(schedule, weight_decay=0.01)
    # Scalars (step counters) go on the mesh too, as the step returns them,
    # so that the second step does not compile again.
    opt_state = jax.tree.map(lambda a: a if a.ndim else jax.device_put(a, replicated), optimizer.init(params))

    def loss_fn(params, tokens):
        logits, aux_loss = nnx.merge(graphdef, params)(tokens[:, :-1])
        lm_loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return lm_loss + args.aux_coef * aux_loss, (lm_loss, aux_loss)

    @jax.jit
    def train_step(params, opt_state, tokens):
        (_, (lm_loss, aux_loss)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lm_loss, aux_loss

    return params, opt_state, train_step


def check_model_args(args, mesh, batch_flag="--batch"):
    """Exits with a message on model options the mesh or the model cannot take."""
    for flag in ("seq_len", "vocab", "branching", "hidden", "ffn", "layers", "experts", "log_every"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
    if args.branching > args.vocab:
        raise SystemExit(f"--branching {args.branching} must be at most --vocab {args.vocab} (distinct successors)")
    if args.batch % mesh.size:
        raise SystemExit(f"{batch_flag} {args.batch} must divide by the {mesh.size} devices")
    if args.experts % mesh.shape["expert"]:
        raise SystemExit(f"--experts {args.experts} must divide by the expert axis ({mesh.shape['expert']})")
    if not 1 <= args.top_k <= args.experts:
        raise SystemExit(f"--top-k {args.top_k} must be in [1, --experts {args.experts}]")
    if args.dropless is not True and args.dropless is not False and args.dropless < 1:
        raise SystemExit(f"--dropless {args.dropless} must be at least 1 (rows per rank per round)")
    if args.heads < 1 or args.hidden % args.heads:
        raise SystemExit(f"--hidden {args.hidden} must divide by --heads {args.heads}")


def train(args, progress: bool = True):
    """Trains; returns (the language-model loss of every step, the loss floor)."""
    fast_ragged_dot = use_fast_ragged_dot()
    mesh = make_mesh(args.ep)
    check_model_args(args, mesh)
    buffer = Buffer(mesh, "expert", backend=args.backend, hidden=args.hidden, num_experts=args.experts)
    print(
        f"devices: {mesh.size} x {jax.devices()[0].platform}, mesh {dict(mesh.shape)}, "
        f"backend {buffer.backend}, experts {args.expert_impl}"
        + {False: "", True: ", dropless"}.get(args.dropless, f", dropless at {args.dropless} rows")
        + (", ragged_dot: pallas-triton" if fast_ragged_dot else "")
    )
    chain = MarkovChain(args.vocab, args.branching, args.seed)
    floor = chain.sample(np.random.default_rng(0), 256, args.seq_len + 1)[1]
    print(f"uniform guess: log(vocab) = {np.log(args.vocab):.3f}; floor (entropy of the chain) ~ {floor:.3f}")
    try:
        params, opt_state, train_step = init_training(args, mesh, buffer)
        rng = np.random.default_rng(args.seed + 1)
        token_sharding = NamedSharding(mesh, P(("data", "expert")))
        losses = []
        steps = range(1, args.steps + 1)
        if progress:
            from tqdm import tqdm

            steps = tqdm(steps, desc="train", dynamic_ncols=True)
        start = time.perf_counter()
        for step in steps:
            tokens = jax.device_put(chain.sample(rng, args.batch, args.seq_len + 1)[0], token_sharding)
            params, opt_state, lm_loss, aux_loss = train_step(params, opt_state, tokens)
            losses.append(float(lm_loss))
            if progress:
                steps.set_postfix(loss=f"{losses[-1]:.4f}")
            if step % args.log_every == 0 or step == args.steps:
                line = f"step {step} loss={losses[-1]:.4f} aux={float(aux_loss):.4f}"
                steps.write(line) if progress else print(line, flush=True)
        print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s (the first one compiles)")
    finally:
        buffer.destroy()  # frees the CUDA communication memory
    return losses, floor


def plot(losses, floor, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(losses) + 1), losses, label="training loss")
    ax.axhline(floor, color="gray", linestyle="--", label="entropy of the chain")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title("MoE language model (deep_ep_jax)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=32, help="sequences per step (global)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--branching", type=int, default=3, help="likely successors of each token")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256, help="expert hidden size")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--ep", type=int, default=0, help="expert-parallel size (default: all GPUs, or half the CPUs)")
    p.add_argument("--backend", choices=("auto", "xla", "cuda"), default="auto")
    p.add_argument(
        "--expert-impl",
        choices=EXPERT_IMPLS,
        default="ragged_dot",
        help="how the experts run (moe_layer.py): grouped = expert-major rows + grouped_matmul",
    )
    p.add_argument(
        "--dropless",
        nargs="?",
        type=int,
        const=True,
        default=False,
        metavar="ROWS",
        help="the MoE through dropless_moe: receive buffers of ROWS rows per rank (default: dropless_moe's), "
        "overflow in further rounds",
    )
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--aux-coef", type=float, default=0.01, help="weight of the load-balancing loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--plot", default="moe_flax_loss.png", help="PNG of the loss curve ('' for none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    losses, floor = train(args, progress=not args.no_progress)
    if args.plot:
        plot(losses, floor, args.plot)
        print(f"loss curve: {args.plot}")


if __name__ == "__main__":
    main()
