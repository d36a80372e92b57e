"""The Flax MoE example on GPUs: the CUDA kernels against the reference backend
inside the whole layer and the whole training loop, and the GPU ragged_dot
lowering against the CPU one.

    pytest tests/gpu/test_example_gpu.py -v
"""

import jax
import jax.numpy as jnp
import moe_flax
import moe_layer as ml
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import deep_ep_jax as dej
from deep_ep_jax import testing as dt

pytestmark = pytest.mark.gpu


def _close(got, want, what, rel=2e-2):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    err, scale = np.abs(got - want).max(), np.abs(want).max() + 1e-6
    assert err <= rel * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def test_expert_ffn_gpu_lowering_matches_cpu():
    """ragged_dot lowers differently on GPU (Pallas-Triton grouped matmul when
    available): same outputs and gradients as on CPU, NaN padding ignored."""
    ml.use_fast_ragged_dot()
    num_rows, num_valid, num_local, topk, hidden, ffn = 512, 400, 16, 4, 256, 128
    rng = np.random.default_rng(0)
    idx = np.stack([rng.permutation(num_local)[:topk] for _ in range(num_rows)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.3] = -1
    idx[:50] = -1
    idx[:50, 0] = 3  # a crowded expert
    idx[num_valid:] = -1
    weights = np.where(idx >= 0, rng.random(idx.shape) + 0.1, 0.0).astype(np.float32)
    x = rng.standard_normal((num_rows, hidden)).astype(np.float32)
    x[num_valid:] = np.nan
    args = (
        x.astype(jnp.bfloat16),
        idx,
        weights,
        (rng.standard_normal((num_local, hidden, 2 * ffn)) * 0.05).astype(np.float32),
        (rng.standard_normal((num_local, ffn, hidden)) * 0.05).astype(np.float32),
    )
    probe = rng.standard_normal((num_rows, hidden)).astype(np.float32)

    def fwd_bwd(x, idx, w, w_in, w_out):
        loss = lambda x, w, w_in, w_out: jnp.sum(ml.expert_ffn(x, idx, w, w_in, w_out).astype(jnp.float32) * probe)
        return ml.expert_ffn(x, idx, w, w_in, w_out), jax.grad(loss, argnums=(0, 1, 2, 3))(x, w, w_in, w_out)

    on = lambda device: jax.jit(fwd_bwd)(*jax.device_put(args, device))
    gpu, cpu = on(jax.devices("gpu")[0]), on(jax.devices("cpu")[0])
    for name, g, c in zip(
        ("out", "grad x", "grad weights", "grad w_in", "grad w_out"), jax.tree.leaves(gpu), jax.tree.leaves(cpu)
    ):
        _close(g, c, name)


def test_moe_layer_cuda_matches_reference():
    """The NNX MoE layer with the CUDA kernels equals it with the reference
    backend (forward and every gradient) on all GPUs."""
    ml.use_fast_ragged_dot()
    gpus = jax.devices("gpu")
    mesh = Mesh(np.array(gpus).reshape(1, -1), ("data", "expert"))
    hidden, ffn, num_experts, topk, tokens = 1024, 512, 8 * len(gpus), 4, 512 * len(gpus)
    xla = dej.Buffer(mesh, "expert", backend="xla", hidden=hidden, num_experts=num_experts)
    layer = ml.MoE(hidden, ffn, num_experts, topk, buffer=xla, rngs=nnx.Rngs(0))
    params = [layer.router[...], layer.w_in[...], layer.w_out[...]]
    x = jax.device_put(dt.random_rows(1, (tokens, hidden), jnp.float32), NamedSharding(mesh, P(("data", "expert"))))

    def run(buffer):
        def loss(x, *p):
            y, aux = ml.moe_apply(x, *p, top_k=topk, buffer=buffer)
            return jnp.sum(jnp.sin(y)) + aux, y

        (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, *params)
        return [y, *grads]

    with dej.Buffer(mesh, "expert", backend="cuda", hidden=hidden, num_experts=num_experts) as cuda:
        got, want = run(cuda), run(xla)
    for name, g, w in zip(("y", "grad x", "grad router", "grad w_in", "grad w_out"), got, want):
        _close(g, w, name, rel=1e-2)


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("alignment, fp8", [(1, False), (64, False), (128, True)])
def test_grouped_layer_matches_capacity(alignment, fp8):
    """The NNX MoE layer with expert_impl="grouped" (the CUDA kernels'
    expert-major dispatch/combine, grouped_matmul's Mosaic GPU kernels on
    Hopper) equals the capacity path on the reference backend with room for
    every pair: forward and every gradient, on all GPUs. With fp8 (the
    weights' FP8 copies, rows sent as FP8, every matmul on FP8 operands)
    within FP8's error of it, as a norm."""
    from deep_ep_jax.experts import grouped_gemm

    gpus = jax.devices("gpu")
    mesh = Mesh(np.array(gpus).reshape(1, -1), ("data", "expert"))
    hidden, ffn, num_experts, topk, tokens = 1024, 512, 8 * len(gpus), 4, 512 * len(gpus)
    if grouped_gemm.is_hopper_gpu():  # the shapes must take the Mosaic GPU path, not a dense fallback
        for x_shape, w_shape in (((tokens, hidden), (8, hidden, 2 * ffn)), ((tokens, ffn), (8, ffn, hidden))):
            assert grouped_gemm.mgpu_unsupported_reason(x_shape, w_shape, jnp.bfloat16) is None
    xla = dej.Buffer(mesh, "expert", backend="xla", hidden=hidden, num_experts=num_experts)
    layer = ml.MoE(hidden, ffn, num_experts, topk, buffer=xla, rngs=nnx.Rngs(2))
    params = [layer.router[...], layer.w_in[...], layer.w_out[...]]
    x = jax.device_put(dt.random_rows(3, (tokens, hidden), jnp.float32), NamedSharding(mesh, P(("data", "expert"))))

    def run(buffer, fp8=False, **impl):
        def loss(x, *p):
            copies = ml.fp8_expert_weights(*p[1:], mesh=mesh, axis_name="expert") if fp8 else None
            y, aux = ml.moe_apply(x, *p, top_k=topk, buffer=buffer, fp8=copies, **impl)
            return jnp.sum(jnp.sin(y)) + aux, y

        (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, *params)
        return [y, *grads]

    with dej.Buffer(mesh, "expert", backend="cuda", hidden=hidden, num_experts=num_experts) as cuda:
        got = run(cuda, fp8, expert_impl="grouped", expert_alignment=alignment)
    want = run(xla, expert_impl="capacity", capacity=tokens)  # every pair fits: nothing dropped
    for name, g, w in zip(("y", "grad x", "grad router", "grad w_in", "grad w_out"), got, want):
        if not fp8:
            _close(g, w, f"alignment {alignment}: {name}", rel=1e-2)
            continue
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.isfinite(g).all(), f"fp8: {name}: non-finite values"
        # FP8 operands (3 mantissa bits): a few percent off as a norm; identical would mean FP8 did not run.
        error = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert error <= 0.1 and not np.array_equal(g, w), f"fp8: {name}: relative error {error:.3g}"


def test_training_loss_curve_same_on_both_backends():
    """examples/moe_flax.py: same seed, same loss curve with either backend."""
    args = moe_flax.parse_args(["--steps", "12", "--log-every", "4", "--plot", ""])
    args.backend = "xla"
    xla_losses, _ = moe_flax.train(args, progress=False)
    args.backend = "cuda"
    cuda_losses, _ = moe_flax.train(args, progress=False)
    print("xla ", np.round(xla_losses, 4))
    print("cuda", np.round(cuda_losses, 4))
    np.testing.assert_allclose(cuda_losses, xla_losses, rtol=2e-2)
    assert cuda_losses[-1] < 0.75 * cuda_losses[0], cuda_losses
