"""Bad input fails at trace time with a clear error naming the argument."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import deep_ep_jax as dej
from deep_ep_jax import testing as dt
from deep_ep_jax.config import ROW_FORMATS

R, T, H, E, K = 4, 8, 256, 8, 2


@pytest.fixture(scope="module")
def mesh():
    return dt.ep_mesh(R, platform="cpu")


@pytest.fixture(scope="module")
def buffer(mesh):
    return dej.Buffer(mesh, "ep", backend="xla")


def _inputs(dtype=jnp.bfloat16):
    idx, w = dt.make_routing(0, R * T, E, K, R)
    return dt.random_rows(1, (R * T, H), dtype), jnp.asarray(idx), jnp.asarray(w)


def _trace(mesh, fn, *args):
    """Traces fn per rank (shapes only, nothing runs)."""
    return dt.per_rank(fn, mesh, "ep").lower(*args)


def _dispatch(buffer, **kw):
    return lambda x, idx, w: dej.dispatch(x, idx, w, num_experts=kw.pop("num_experts", E), buffer=buffer, **kw)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda x, i, w: (x.astype(jnp.float16), i, w), TypeError, "x must be bfloat16"),
        (lambda x, i, w: (x.reshape(R * T, 2, H // 2), i, w), ValueError, r"x must be \[tokens, hidden\]"),
        (lambda x, i, w: (x, i.astype(jnp.float32), w), TypeError, "topk_idx must be int32"),
        (lambda x, i, w: (x, i[:, :1], w), ValueError, "topk_weights must have topk_idx's shape"),
        (lambda x, i, w: (x, i, w.astype(jnp.bfloat16)), TypeError, "topk_weights must be float32"),
        (lambda x, i, w: (x, i[: R * T // 2], w[: R * T // 2]), ValueError, r"topk_idx must be \[8, topk\]"),
    ],
)
def test_dispatch_bad_arrays(mesh, buffer, make, error, match):
    with pytest.raises(error, match=match):
        _trace(mesh, _dispatch(buffer), *make(*_inputs()))


# The dtype rules are the kernels', checked before any backend, so a model
# prototyped on the xla backend cannot break on the CUDA one.
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.int32])
def test_rows_must_be_bf16(mesh, buffer, dtype):
    x, idx, w = _inputs(dtype)
    name = jnp.dtype(dtype).name
    with pytest.raises(
        TypeError, match=rf"dispatch: x must be bfloat16 or a pair of FP8 .*MXFP8 .*NVFP4 .*, got {name}"
    ):
        _trace(mesh, _dispatch(buffer), x, idx, w)

    def combine_rows_of(x, idx, w):
        recv_x, _, _, handle = dej.dispatch(x.astype(jnp.bfloat16), idx, w, num_experts=E, buffer=buffer)
        return dej.combine(recv_x.astype(dtype), handle, buffer=buffer)

    with pytest.raises(TypeError, match=rf"combine: x must be bfloat16, got {name}"):
        _trace(mesh, combine_rows_of, x, idx, w)
    ll = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=T)
    with pytest.raises(TypeError, match=rf"low_latency_dispatch: x must be bfloat16, got {name}"):
        _trace(
            mesh,
            lambda x, idx: dej.low_latency_dispatch(
                x, idx, buffer=ll, num_max_dispatch_tokens_per_rank=T, num_experts=E
            ),
            x,
            idx,
        )


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int16, jnp.uint32, jnp.float32])
def test_topk_idx_must_be_int32(mesh, buffer, dtype):
    x, idx, w = _inputs()
    idx = idx.astype(dtype)
    name = jnp.dtype(dtype).name
    with pytest.raises(TypeError, match=f"dispatch: topk_idx must be int32, got {name}"):
        _trace(mesh, _dispatch(buffer), x, idx, w)
    with pytest.raises(TypeError, match=f"get_dispatch_layout: topk_idx must be int32, got {name}"):
        _trace(mesh, lambda idx: dej.get_dispatch_layout(idx, num_experts=E, buffer=buffer), idx)
    ll = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=T)
    with pytest.raises(TypeError, match=f"low_latency_dispatch: topk_idx must be int32, got {name}"):
        _trace(
            mesh,
            lambda x, idx: dej.low_latency_dispatch(
                x, idx, buffer=ll, num_max_dispatch_tokens_per_rank=T, num_experts=E
            ),
            x,
            idx,
        )


@pytest.mark.parametrize("n", [0, -4, 8.0, True, "8"])
def test_num_experts_not_a_positive_int(mesh, buffer, n):
    with pytest.raises(ValueError, match=r"^dispatch: num_experts must be a positive int"):
        _trace(mesh, _dispatch(buffer, num_experts=n), *_inputs())


def test_num_experts_not_divisible(mesh, buffer):
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by the size of axis 'ep' \(4\)"):
        _trace(mesh, _dispatch(buffer, num_experts=6), *_inputs())
    with pytest.raises(ValueError, match="must be divisible"):
        dej.Buffer(mesh, "ep", backend="xla", num_experts=6)


def test_topk_larger_than_experts(mesh, buffer):
    x, _, _ = _inputs()
    idx = jnp.zeros((R * T, 9), jnp.int32)
    with pytest.raises(ValueError, match=r"topk must be in \[1, num_experts=8\], got 9"):
        _trace(mesh, _dispatch(buffer), x, idx, idx.astype(jnp.float32))


def test_hidden_mismatch(mesh):
    buffer = dej.Buffer(mesh, "ep", backend="xla", hidden=512)
    with pytest.raises(ValueError, match="x has hidden 256 but the buffer was made for hidden 512"):
        _trace(mesh, _dispatch(buffer), *_inputs())


def test_dispatch_without_weights(mesh, buffer):
    """dispatch takes topk_weights=None (recv_topk_weights is None then), its
    gradient too; dispatch_expert_major, whose reduce needs them, does not
    (tests/test_expert_major.py)."""
    x, idx, w = _inputs()

    def x_gradient(weighted):
        def step(x, idx, w):
            def loss(x):
                recv_x, _, recv_w, handle = dej.dispatch(x, idx, w if weighted else None, num_experts=E, buffer=buffer)
                assert (recv_w is None) == (not weighted)
                return dej.combine(recv_x, handle, buffer=buffer).astype(jnp.float32).sum()

            return jax.grad(loss)(x)

        return np.asarray(dt.per_rank(step, mesh, "ep")(x, idx, w), np.float32)

    g = x_gradient(False)
    np.testing.assert_array_equal(g, x_gradient(True))  # x's gradient does not involve the weights
    assert np.abs(g).sum() > 0


def test_not_rows(mesh, buffer):
    x, idx, w = _inputs()
    with pytest.raises(
        ValueError,
        match=r"^dispatch: x must be a bfloat16 array or a quantized pair \(data, scales\), "
        r"got a list of 3 items",
    ):
        _trace(mesh, lambda x, idx, w: dej.dispatch([x, x, x], idx, w, num_experts=E, buffer=buffer), x, idx, w)


def test_scalar_topk_idx(mesh, buffer):
    _, idx, _ = _inputs()
    with pytest.raises(ValueError, match=r"^get_dispatch_layout: topk_idx must be \[tokens, topk\], got shape \(\)"):
        _trace(mesh, lambda idx: dej.get_dispatch_layout(idx[0, 0], num_experts=E, buffer=buffer), idx)


@pytest.mark.parametrize("n", [0, -1, R * T + 1, 2.5, True])
def test_num_worst_tokens_out_of_range(mesh, buffer, n):
    with pytest.raises(ValueError, match="num_worst_tokens must be an int in"):
        _trace(mesh, _dispatch(buffer, num_worst_tokens=n), *_inputs())


def test_fp8_pair_bad_scales(mesh, buffer):
    x, idx, w = _inputs()
    data = x.astype(jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"FP8 scales x\[1\] must be float32 \(8, 2\)"):
        _trace(mesh, _dispatch(buffer), (data, jnp.ones((R * T, 3), jnp.float32)), idx, w)
    with pytest.raises(TypeError, match=r"x must be a pair of FP8 \(float8_e4m3fn .*got \(bfloat16, float32\)"):
        _trace(mesh, _dispatch(buffer), (x, jnp.ones((R * T, 2), jnp.float32)), idx, w)


def test_quantized_pair_errors(mesh, buffer):
    """A pair of no format, or of the wrong shapes, fails at trace time naming the argument; expand
    takes bf16 rows and the FP8 pair only (the grouped GEMM has no MXFP8 or NVFP4 kernels)."""
    _, idx, w = _inputs()
    data, scales = dt.random_pair(0, ROW_FORMATS[1], R * T, H)  # MXFP8
    fp4 = data.astype(jnp.float4_e2m1fn)
    with pytest.raises(TypeError, match=r"dispatch: x must be a pair of FP8 .*MXFP8 .*NVFP4 .*got \(float16, "):
        _trace(mesh, _dispatch(buffer), (data.astype(jnp.float16), scales), idx, w)
    with pytest.raises(TypeError, match=r"dispatch: MXFP8 scales x\[1\] must be float8_e8m0fnu \(8, 8\), got "):
        _trace(mesh, _dispatch(buffer), (data, scales[:, :4]), idx, w)
    with pytest.raises(TypeError, match=r"dispatch: NVFP4 scales x\[1\] must be float8_e4m3fn \(8, 16\)"):
        _trace(mesh, _dispatch(buffer), (fp4, data[:, :8]), idx, w)
    packed = (jnp.zeros((R * T, 48), jnp.uint8), jnp.zeros((R * T, 6), jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"dispatch: NVFP4 packed hidden must be a multiple of 128, got 96"):
        _trace(mesh, _dispatch(buffer), packed, idx, w)
    with pytest.raises(TypeError, match=r"expand: recv_x is an NVFP4 pair; here it must be bfloat16 or a pair of FP8"):
        dej.expand((fp4, data[:, :16]), idx, num_local_experts=2)
    with pytest.raises(
        TypeError,
        match=r"expand: recv_x is an MXFP8 pair; here it must be bfloat16 or a pair of FP8 .*"
        r"dequantize it first",
    ):
        dej.expand((data, scales), idx, num_local_experts=2)
    with pytest.raises(TypeError, match=r"dispatch: x must be bfloat16 .*got float8_e4m3fn \(pass it with its scales"):
        _trace(mesh, _dispatch(buffer), data, idx, w)


def test_worst_case_over_the_dispatch_budget(mesh):
    """Results sized for T x R rows (or expert-major rows for all of them) past Config.dispatch_budget_gib: a
    trace-time error naming the ways out; num_worst_tokens= (num_rows=) or a larger budget pass."""
    x, idx, w = _inputs()
    # T x R = 32 rows of 512 bytes + 2 x 8 bytes of ids and weights + 4: 17024 bytes.
    small = dej.Buffer(mesh, "ep", backend="xla", config=dej.Config(dispatch_budget_gib=16000 / 2**30))
    with pytest.raises(ValueError, match=r"^dispatch: sized for the worst case \(32 rows: every token of the 4 "
                       r"ranks\), its results take 1\.59e-05 GiB per GPU, over Config.dispatch_budget_gib=1\.49e-05\. "
                       r"Use dropless_moe .* pass num_worst_tokens= .*DEEP_EP_JAX_DISPATCH_BUDGET_GIB"):  # fmt: skip
        _trace(mesh, _dispatch(small), x, idx, w)
    _trace(mesh, _dispatch(small, num_worst_tokens=R * T - 2), x, idx, w)
    large = dej.Buffer(mesh, "ep", backend="xla", config=dej.Config(dispatch_budget_gib=17100 / 2**30))
    _trace(mesh, _dispatch(large), x, idx, w)

    # Expert-major rows too: N x min(K, L) = 30 x 2 rows of 512 bytes past the budget; num_rows= passes.
    def expert_major(**kwargs):
        return lambda x, i, w: dej.dispatch_expert_major(
            x, i, w, num_experts=E, buffer=large, num_worst_tokens=R * T - 2, **kwargs
        )[0]

    with pytest.raises(ValueError, match=r"^dispatch_expert_major: sized for the worst case \(60 expert rows: every "
                       r"received row on min\(K, local experts\) of them\), its results take 2\.86e-05 GiB .*"
                       r"Pass num_rows= "):  # fmt: skip
        _trace(mesh, expert_major(), x, idx, w)
    _trace(mesh, expert_major(num_rows=16), x, idx, w)


def test_fp8_hidden_alignment(mesh, buffer):
    _, idx, w = _inputs()
    data = jnp.zeros((R * T, 200), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="FP8 hidden must be a multiple of 128, got 200"):
        _trace(mesh, _dispatch(buffer), (data, jnp.ones((R * T, 1), jnp.float32)), idx, w)


def test_buffer_inside_jit(mesh):
    """A Buffer is made eagerly: inside a trace (a CUDA one would allocate per trace) it is refused."""
    with pytest.raises(RuntimeError, match="^Buffer: create it eagerly, outside jit"):
        jax.jit(lambda: dej.Buffer(mesh, "ep", backend="xla") and 0)()


def test_axis_not_in_mesh(mesh):
    with pytest.raises(ValueError, match=r"axis_name 'expert' is not an axis of the mesh \('ep',\)"):
        dej.Buffer(mesh, "expert")


def test_outside_shard_map(buffer):
    x, idx, w = _inputs()
    with pytest.raises(ValueError, match="must be called inside jax.shard_map over the buffer's axis 'ep'"):
        dej.dispatch(x[:T], idx[:T], w[:T], num_experts=E, buffer=buffer)


def test_buffer_of_another_mesh(buffer):
    small = dt.ep_mesh(2, platform="cpu")
    with pytest.raises(ValueError, match="axis 'ep' has size 2 here but the buffer was made for 4 ranks"):
        _trace(small, _dispatch(buffer), *[a[: 2 * T] for a in _inputs()])


def test_buffer_of_a_mesh_with_other_axes(buffer):
    """A buffer of the 4 ranks of mesh ('ep': 4) inside a shard_map over ('data': 2, 'ep': 4): the same EP axis
    size, but the CUDA backend would find ranks (and devices) of another mesh; refused at trace time."""
    wide = jax.sharding.Mesh(np.array(jax.devices("cpu")).reshape(2, R), ("data", "ep"))
    tokens = P(("data", "ep"))
    run = jax.jit(jax.shard_map(_dispatch(buffer), mesh=wide, in_specs=tokens, out_specs=tokens))
    x, idx, w = _inputs()
    with pytest.raises(
        ValueError,
        match=r"dispatch: the shard_map here is over a mesh of axes \{'data': 2, 'ep': 4\}, "
        r"but the buffer was made on one of axes \{'ep': 4\}",
    ):
        run.trace(*(jnp.concatenate([a, a]) for a in (x, idx, w)))


def round_trips(buffer, num_tokens, num_experts=E):
    """Every operation that exchanges rows, each a function of (x, idx, w) per rank (also the worker case
    mesh_order's)."""
    ll = dict(num_experts=num_experts, num_max_dispatch_tokens_per_rank=num_tokens, buffer=buffer)

    def normal(x, idx, w):
        recv_x, _, recv_w, handle = dej.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
        return dej.combine(recv_x, handle, recv_w, buffer=buffer)

    def low_latency(x, idx, w):
        recv_x, _, handle = dej.low_latency_dispatch(x, idx, use_fp8=False, **ll)
        return dej.low_latency_combine(recv_x, idx, w, handle, buffer=buffer)

    def halves(x, idx, w):
        recv_x, _, handle = dej.low_latency_dispatch_recv(
            dej.low_latency_dispatch_send(x, idx, use_fp8=False, **ll), buffer=buffer
        )
        return dej.low_latency_combine_recv(
            dej.low_latency_combine_send(recv_x, idx, w, handle, buffer=buffer), buffer=buffer
        )

    def backward(x, idx, w):  # only the gradient's communication is used
        return jax.grad(lambda x: normal(x, idx, w)[0].astype(jnp.float32).sum())(x)

    return dict(normal=normal, low_latency=low_latency, halves=halves, backward=backward)


@pytest.mark.parametrize("op", ["normal", "low_latency", "halves", "backward"])
def test_buffer_of_a_mesh_in_another_device_order(mesh, op):
    """A shard_map over the buffer's mesh's devices in another order (as jax.make_mesh and a reshape of
    jax.devices() can give): a device's rank would differ between the kernels and axis_index, so tokens
    would reach other ranks' experts (seen on the CUDA backend). Refused when the program is lowered, on
    every backend alike (the worker case mesh_order checks the CUDA backend across processes)."""
    buffer = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=T)
    fn = round_trips(buffer, T)[op]
    other = jax.sharding.Mesh(mesh.devices[[1, 0, 2, 3]], ("ep",))
    ids = [d.id for d in mesh.devices.flat]
    _trace(mesh, fn, *_inputs())  # the buffer's own mesh
    with pytest.raises(
        ValueError,
        match=rf"the shard_map's mesh orders the devices otherwise than the Buffer's mesh: "
        rf"an EP group \(device ids in rank order along 'ep'\) is "
        rf"\[{ids[1]}, {ids[0]}, {ids[2]}, {ids[3]}\] there, "
        rf"\[{ids[0]}, {ids[1]}, {ids[2]}, {ids[3]}\] in the Buffer's",
    ):
        _trace(other, fn, *_inputs())


def test_buffer_mesh_with_its_groups_in_another_order():
    """A ('data', 'ep') mesh with its EP groups swapped along 'data' keeps each device's rank and peers: accepted,
    and the results are the buffer's own mesh's; a rank moved inside a group is refused."""
    devices = np.array(jax.devices("cpu")).reshape(2, R)
    made = jax.sharding.Mesh(devices, ("data", "ep"))
    swapped = jax.sharding.Mesh(devices[::-1], ("data", "ep"))
    buffer = dej.Buffer(made, "ep", backend="xla")
    fn = round_trips(buffer, T)["normal"]
    x, idx, w = (jnp.concatenate([a, a[::-1]]) for a in _inputs())
    tokens = P(("data", "ep"))

    def run(mesh, x, idx, w):
        out = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=tokens, out_specs=tokens))(x, idx, w)
        return jax.device_get(out)

    want = run(made, x, idx, w)
    # The swapped mesh gives group 0's tokens to group 1's devices: feed each group its own tokens.
    half = R * T
    got = run(swapped, *(jnp.concatenate([a[half:], a[:half]]) for a in (x, idx, w)))
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.concatenate([b[half:], b[:half]]), a)
    moved = jax.sharding.Mesh(devices[:, [0, 2, 1, 3]], ("data", "ep"))
    with pytest.raises(ValueError, match="orders the devices otherwise"):
        run(moved, x, idx, w)


@pytest.mark.parametrize("jit", [True, False])
def test_shard_map_manual_over_some_axes(jit):
    """shard_map(axis_names={'ep'}) on a ('data', 'ep') mesh leaves 'data' to the compiler; refused at
    trace time naming the fix (JAX itself failed there with a bare AssertionError)."""
    wide = jax.sharding.Mesh(np.array(jax.devices("cpu")).reshape(2, R), ("data", "ep"))
    buffer = dej.Buffer(wide, "ep", backend="xla")
    run = jax.shard_map(_dispatch(buffer), mesh=wide, in_specs=P("ep"), out_specs=P("ep"), axis_names={"ep"})
    with pytest.raises(
        ValueError,
        match=r"^dispatch: the shard_map here is manual over \['ep'\] of the mesh's axes "
        r"\['data', 'ep'\]; deep_ep_jax needs every axis manual",
    ):
        (jax.jit(run) if jit else run)(*_inputs())


def test_bad_backend_and_buffer_args(mesh):
    with pytest.raises(ValueError, match="backend must be one of"):
        dej.Buffer(mesh, "ep", backend="tpu")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        dej.Buffer(list(jax.devices("cpu")), "ep")
    with pytest.raises(ValueError, match="hidden must be a positive int"):
        dej.Buffer(mesh, "ep", hidden=-3)
    with pytest.raises(ValueError, match="low_latency_mode=True needs num_max_dispatch_tokens_per_rank"):
        dej.Buffer(mesh, "ep", low_latency_mode=True)
    with pytest.raises(ValueError, match="hidden must be a positive int or None, got True"):
        dej.Buffer(mesh, "ep", hidden=True)
    with pytest.raises(TypeError, match="low_latency_mode must be a bool, got str 'no'"):
        dej.Buffer(mesh, "ep", low_latency_mode="no", num_max_dispatch_tokens_per_rank=8)
    with pytest.raises(TypeError, match="config must be a deep_ep_jax.Config or None, got dict"):
        dej.Buffer(mesh, "ep", config={"checks": True})


@pytest.mark.parametrize(
    "field, value, error, match",
    [
        ("checks", "false", TypeError, "Config.checks must be a bool, got str 'false'"),
        ("count_traffic", 1, TypeError, "Config.count_traffic must be a bool, got int 1"),
        ("internode_pipeline", None, TypeError, "Config.internode_pipeline must be a bool"),
        ("num_sms", 2.5, TypeError, "Config.num_sms must be an int, got float 2.5"),
        ("num_sms", True, TypeError, "Config.num_sms must be an int, got bool True"),
        ("num_warps", None, TypeError, "Config.num_warps must be an int, got NoneType"),
        ("chunk_tokens", "2", TypeError, "Config.chunk_tokens must be an int, got str"),
        ("low_latency_overlap_sms", 1.5, TypeError, "Config.low_latency_overlap_sms must be an int"),
        ("gpus_per_host", 2.5, TypeError, "Config.gpus_per_host must be an int or None, got float 2.5"),
        ("timeout_s", "10", TypeError, "Config.timeout_s must be a number of seconds, got str '10'"),
        ("num_sms", 0, ValueError, "Config.num_sms must be >= 1"),
        ("timeout_s", float("nan"), ValueError, r"Config.timeout_s must be in \[0.001, 3600\]"),
        ("timeout_s", 0.0005, ValueError, r"Config.timeout_s must be in \[0.001, 3600\], got 0.0005$"),
    ],
)
def test_config_fields(field, value, error, match):
    with pytest.raises(error, match=f"^{match}"):
        dej.Config(**{field: value})
    dej.Config(num_sms=np.int64(8), timeout_s=np.float32(3), checks=np.bool_(True), gpus_per_host=None)  # numpy's fine


def test_cuda_backend_unavailable_says_why(mesh):
    with pytest.raises(
        RuntimeError, match=r"Buffer\(backend='cuda'\) is not available: the mesh's devices are \['cpu'\]"
    ):
        dej.Buffer(mesh, "ep", backend="cuda")
    assert dej.Buffer(mesh, "ep").backend == "xla"  # auto falls back on CPU


def test_copies_of_a_buffer_are_the_buffer(mesh):
    """A Buffer is a handle to device memory: a copy that could free it apart from the original would not do."""
    import copy

    buffer = dej.Buffer(mesh, "ep", backend="xla")
    assert copy.copy(buffer) is buffer and copy.deepcopy({"b": buffer})["b"] is buffer


def test_spans_hosts_on_the_xla_backend(mesh):
    buffer = dej.Buffer(mesh, "ep", backend="xla", config=dej.Config(gpus_per_host=2))
    assert (buffer.num_nodes, buffer.spans_hosts) == (R // 2, True) and "spans_hosts=True" in repr(buffer)
    assert not dej.Buffer(mesh, "ep", backend="xla").spans_hosts


def test_use_after_destroy(mesh):
    buffer = dej.Buffer(mesh, "ep", backend="xla")
    with buffer:
        pass
    with pytest.raises(RuntimeError, match="the Buffer was destroyed"):
        _trace(mesh, _dispatch(buffer), *_inputs())


def test_combine_bad_arguments(mesh, buffer):
    x, idx, w = _inputs()

    def rows_mismatch(x, idx, w):
        recv_x, _, _, handle = dej.dispatch(x, idx, w, num_experts=E, buffer=buffer)
        return dej.combine(recv_x[:-1], handle, buffer=buffer)

    with pytest.raises(ValueError, match="x must have the handle's 32 rows, got 31"):
        _trace(mesh, rows_mismatch, x, idx, w)

    def not_a_handle(x, idx, w):
        return dej.combine(x, {"send_pos": idx}, buffer=buffer)

    with pytest.raises(TypeError, match="handle must be the DispatchHandle"):
        _trace(mesh, not_a_handle, x, idx, w)

    def weights_dtype(x, idx, w):
        recv_x, _, recv_w, handle = dej.dispatch(x, idx, w, num_experts=E, buffer=buffer)
        return dej.combine(recv_x, handle, recv_w.astype(jnp.bfloat16), buffer=buffer)

    with pytest.raises(TypeError, match=r"topk_weights must be float32 \[32, topk\]"):
        _trace(mesh, weights_dtype, x, idx, w)

    def weights_list(x, idx, w):
        recv_x, _, recv_w, handle = dej.dispatch(x, idx, w, num_experts=E, buffer=buffer)
        return dej.combine(recv_x, handle, [recv_w], buffer=buffer)

    with pytest.raises(TypeError, match="^combine: topk_weights must be an array, got list"):
        _trace(mesh, weights_list, x, idx, w)


def test_low_latency_bad_arguments(mesh):
    M = 4
    ll = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=M)
    normal = dej.Buffer(mesh, "ep", backend="xla")
    x, idx, _ = _inputs()

    def call(buffer, m=M):
        return lambda x, idx: dej.low_latency_dispatch(
            x, idx, buffer=buffer, num_max_dispatch_tokens_per_rank=m, num_experts=E
        )

    with pytest.raises(ValueError, match="x has 8 tokens, more than num_max_dispatch_tokens_per_rank=4"):
        _trace(mesh, call(ll), x, idx)
    with pytest.raises(ValueError, match="the buffer was made without low_latency_mode=True"):
        _trace(mesh, call(normal), x[: R * M], idx[: R * M])
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank=8 exceeds the buffer's 4"):
        _trace(mesh, call(ll, 8), x, idx)
    with pytest.raises(ValueError, match="use_fp8 needs hidden to be a multiple of 128, got 100"):
        _trace(mesh, call(ll), x[: R * M, :100], idx[: R * M])

    def bad_combine(x, idx, w):
        recv, _, handle = dej.low_latency_dispatch(x, idx, buffer=ll, num_max_dispatch_tokens_per_rank=M, num_experts=E)
        return dej.low_latency_combine(recv[0], idx, w, handle, buffer=ll)  # FP8 data, not bf16

    with pytest.raises(TypeError, match="x must be bfloat16, got float8_e4m3fn"):
        _trace(mesh, bad_combine, x[: R * M], idx[: R * M], _inputs()[2][: R * M])

    def flag(name, value):
        return lambda x, idx: dej.low_latency_dispatch(
            x, idx, buffer=ll, num_max_dispatch_tokens_per_rank=M, num_experts=E, **{name: value}
        )

    with pytest.raises(TypeError, match="^low_latency_dispatch: use_fp8 must be a bool, got str 'false'"):
        _trace(mesh, flag("use_fp8", "false"), x[: R * M], idx[: R * M])
    with pytest.raises(TypeError, match="^low_latency_dispatch: round_scale must be a bool, got int 1"):
        _trace(mesh, flag("round_scale", 1), x[: R * M], idx[: R * M])
    with pytest.raises(TypeError, match="^low_latency_dispatch: mxfp8 must be a bool, got str 'yes'"):
        _trace(mesh, flag("mxfp8", "yes"), x[: R * M], idx[: R * M])

    def bf16_mxfp8(x, idx):
        return dej.low_latency_dispatch(
            x, idx, buffer=ll, num_max_dispatch_tokens_per_rank=M, num_experts=E, use_fp8=False, mxfp8=True
        )

    with pytest.raises(ValueError, match="^low_latency_dispatch: mxfp8=True quantizes to FP8: it needs use_fp8=True"):
        _trace(mesh, bf16_mxfp8, x[: R * M], idx[: R * M])

    def bf16_round_scale(x, idx):
        return dej.low_latency_dispatch(
            x, idx, buffer=ll, num_max_dispatch_tokens_per_rank=M, num_experts=E, use_fp8=False, round_scale=True
        )

    with pytest.raises(ValueError, match="^low_latency_dispatch: round_scale=True rounds FP8 scales: it needs use_f"):
        _trace(mesh, bf16_round_scale, x[: R * M], idx[: R * M])
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank must be a positive int, got True"):
        _trace(mesh, call(ll, True), x[: R * M], idx[: R * M])


def _low_latency_round_trip(ll, split, M, stop_gradient=False):
    """x, w -> low-latency dispatch, the rows as expert outputs, combine (whole or by halves)."""

    def run(x, idx, w):
        if stop_gradient:
            x, w = jax.lax.stop_gradient((x, w))
        kw = dict(buffer=ll, num_max_dispatch_tokens_per_rank=M, num_experts=E, use_fp8=False)
        if split:
            recv, _, handle = dej.low_latency_dispatch_recv(dej.low_latency_dispatch_send(x, idx, **kw), buffer=ll)
            pending = dej.low_latency_combine_send(recv, idx, w, handle, buffer=ll)
            return dej.low_latency_combine_recv(pending, buffer=ll)
        recv, _, handle = dej.low_latency_dispatch(x, idx, **kw)
        return dej.low_latency_combine(recv, idx, w, handle, buffer=ll)

    return run


@pytest.mark.parametrize("split", [False, True])
def test_low_latency_refuses_gradients(mesh, split):
    """Low-latency mode has no backward on the kernels; the xla backend refuses
    one too (rather than train on CPU what cannot train on GPUs)."""
    ll = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=T)
    x, idx, w = _inputs()
    fn = "low_latency_dispatch_send" if split else "low_latency_dispatch"

    def loss(x, w, stop_gradient=False):
        run = dt.per_rank(_low_latency_round_trip(ll, split, T, stop_gradient), mesh, "ep")
        return run(x, idx, w).astype(jnp.float32).sum()

    with pytest.raises(TypeError, match=f"^{fn}: low-latency mode is not differentiable"):
        jax.grad(loss)(x, w)
    combine = "low_latency_combine_send" if split else "low_latency_combine"
    with pytest.raises(TypeError, match=f"^{combine}: low-latency mode is not differentiable"):
        jax.grad(loss, argnums=1)(x, w)  # the weights reach combine only
    g_x, g_w = jax.grad(lambda x, w: loss(x, w, True), argnums=(0, 1))(x, w)  # stopped: zeros, as asked
    assert not np.asarray(g_x, np.float32).any() and not np.asarray(g_w).any()
    assert float(loss(x, w)) != 0  # the forward runs (and is not all zeros)


def test_low_latency_receive_checks_what_it_takes(mesh):
    """A receive takes what its own kind of send returned, on the same Buffer
    (on the kernels another Buffer's receive would wait until the timeout)."""
    ll = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=T)
    other = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=T)
    x, idx, w = _inputs()
    kw = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False)

    def receive(kind, recv_buffer):
        def run(x, idx, w):
            pending = dej.low_latency_dispatch_send(x, idx, buffer=ll, **kw)
            if kind == "dispatch":
                return dej.low_latency_dispatch_recv(pending, buffer=recv_buffer)[0]
            if kind == "combine":
                return dej.low_latency_combine_recv(pending, buffer=recv_buffer)
            return dej.low_latency_dispatch_recv(x, buffer=recv_buffer)[0]

        return run

    _trace(mesh, receive("dispatch", ll), x, idx, w)  # fine
    with pytest.raises(
        TypeError,
        match="^low_latency_combine_recv: pending must be what low_latency_combine_send "
        "returned, got low_latency_dispatch_send's",
    ):
        _trace(mesh, receive("combine", ll), x, idx, w)
    with pytest.raises(ValueError, match="^low_latency_dispatch_recv: pending comes from a send on another Buffer"):
        _trace(mesh, receive("dispatch", other), x, idx, w)
    with pytest.raises(
        TypeError, match="^low_latency_dispatch_recv: pending must be what low_latency_dispatch_send returned, got "
    ):
        _trace(mesh, receive("array", ll), x, idx, w)

    def combine_on(combine_buffer):
        def run(x, idx, w):
            recv_x, _, handle = dej.low_latency_dispatch(x, idx, buffer=ll, **kw)
            return dej.low_latency_combine(recv_x, idx, w, handle, buffer=combine_buffer)

        return run

    _trace(mesh, combine_on(ll), x, idx, w)  # fine
    with pytest.raises(ValueError, match="^low_latency_combine: handle comes from a dispatch on another Buffer"):
        _trace(mesh, combine_on(other), x, idx, w)


def test_num_experts_differs_from_the_buffers(mesh):
    """A Buffer made with num_experts checks every call against it."""
    x, idx, w = _inputs()
    buffer = dej.Buffer(mesh, "ep", backend="xla", num_experts=E)
    _trace(mesh, _dispatch(buffer), x, idx, w)  # the buffer's own number passes
    message = f"num_experts is {2 * E} but the buffer was made for {E}"
    with pytest.raises(ValueError, match=f"^dispatch: {message}"):
        _trace(mesh, _dispatch(buffer, num_experts=2 * E), x, idx, w)
    with pytest.raises(ValueError, match=f"^get_dispatch_layout: {message}"):
        _trace(mesh, lambda idx: dej.get_dispatch_layout(idx, num_experts=2 * E, buffer=buffer), idx)
    ll = dej.Buffer(mesh, "ep", backend="xla", num_experts=E, low_latency_mode=True, num_max_dispatch_tokens_per_rank=T)
    for send in (dej.low_latency_dispatch, dej.low_latency_dispatch_send):
        with pytest.raises(ValueError, match=f"^{send.__name__}: {message}"):
            _trace(
                mesh,
                lambda x, idx, send=send: send(
                    x, idx, buffer=ll, num_max_dispatch_tokens_per_rank=T, num_experts=2 * E
                ),
                x,
                idx,
            )


def _swap(position, value):
    """Combine arguments (y, topk_idx, topk_weights, handle) with one replaced by value(old)."""
    return lambda args: tuple(value(a) if i == position else a for i, a in enumerate(args))


# Per rank: y [E/R = 2, R*M = 32, H], topk_idx and topk_weights [T = 8, K = 2].
@pytest.mark.parametrize(
    "change, error, match",
    [
        (_swap(3, lambda h: {"recv_count": h.recv_count}), TypeError, "handle must be the LowLatencyHandle"),
        (_swap(0, lambda y: y.astype(jnp.float32)), TypeError, "x must be bfloat16, got float32"),
        (
            _swap(0, lambda y: y[:, :-1]),
            ValueError,
            r"x must be \[2, 32, hidden\] \(the dispatch's rows\), got \(2, 31, 256\)",
        ),
        (_swap(0, lambda y: y[None]), ValueError, r"x must be \[2, 32, hidden\]"),
        (
            _swap(0, lambda y: jnp.concatenate([y, y], -1)),
            ValueError,
            "x has hidden 512 but the buffer was made for hidden 256",
        ),
        (_swap(2, lambda w: None), TypeError, "topk_weights is required"),
        (_swap(2, lambda w: w[:, :1]), ValueError, "topk_weights must have topk_idx's shape"),
        (_swap(2, lambda w: w.astype(jnp.bfloat16)), TypeError, "topk_weights must be float32"),
        (_swap(1, lambda i: i.astype(jnp.int16)), TypeError, "topk_idx must be int32, got int16"),
        (_swap(1, lambda i: i[:, 0]), ValueError, r"topk_idx must be \[tokens, topk\], got shape \(8,\)"),
        (_swap(1, lambda i: i[0, 0]), ValueError, r"topk_idx must be \[tokens, topk\], got shape \(\)"),
        (
            _swap(0, lambda y: (y.astype(jnp.float8_e4m3fn), y[..., :2].astype(jnp.float32))),
            TypeError,
            r"x must be the experts' bfloat16 outputs \[2, 32, hidden\], got a tuple \(an FP8 dispatch's rows\?",
        ),
        (
            lambda args: (args[0], jnp.concatenate([args[1]] * 2), jnp.concatenate([args[2]] * 2), args[3]),
            ValueError,
            r"topk_idx must be the dispatch's, \[8, 2\], got \[16, 2\] \(each row returns to the \(token, k\) slot",
        ),
        (
            lambda args: (args[0], args[1][:4], args[2][:4], args[3]),
            ValueError,
            r"topk_idx must be the dispatch's, \[8, 2\], got \[4, 2\]",
        ),
        (
            lambda args: (args[0], args[1][:, :1], args[2][:, :1], args[3]),
            ValueError,
            r"topk_idx must be the dispatch's, \[8, 2\], got \[8, 1\]",
        ),
    ],
)
@pytest.mark.parametrize("combine", [dej.low_latency_combine, dej.low_latency_combine_send])
def test_low_latency_combine_bad_arguments(mesh, combine, change, error, match):
    ll = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=T, hidden=H)
    x, idx, w = _inputs()

    def fn(x, idx, w):
        recv_x, _, handle = dej.low_latency_dispatch(
            x, idx, buffer=ll, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False
        )
        return combine(*change((recv_x, idx, w, handle)), buffer=ll)

    with pytest.raises(error, match=f"^{combine.__name__}: ({match})"):
        _trace(mesh, fn, x, idx, w)


def test_low_latency_combine_needs_a_low_latency_buffer(mesh):
    ll = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=T)
    normal = dej.Buffer(mesh, "ep", backend="xla")
    x, idx, w = _inputs()

    def fn(combine_buffer, recv_buffer):
        def run(x, idx, w):
            recv_x, _, handle = dej.low_latency_dispatch(
                x, idx, buffer=ll, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False
            )
            pending = dej.low_latency_combine_send(recv_x, idx, w, handle, buffer=combine_buffer)
            return dej.low_latency_combine_recv(pending, buffer=recv_buffer)

        return run

    _trace(mesh, fn(ll, ll), x, idx, w)
    made_without = "the buffer was made without low_latency_mode=True"
    with pytest.raises(ValueError, match=f"^low_latency_combine_send: {made_without}"):
        _trace(mesh, fn(normal, ll), x, idx, w)
    with pytest.raises(ValueError, match=f"^low_latency_combine_recv: {made_without}"):
        _trace(mesh, fn(ll, normal), x, idx, w)


def test_checks_mode_raises_on_bad_data(mesh):
    buffer = dej.Buffer(mesh, "ep", backend="xla", config=dej.Config(checks=True))
    x, idx, w = _inputs()
    f = dej.checked(dt.per_rank(_dispatch(buffer), mesh, "ep"))
    f(x, idx, w)  # good data passes
    with pytest.raises(dej.CheckError) as error:
        f(x, idx.at[3, 1].set(E + 5).at[30, 0].set(-2), w)
    # One error, one line: every rank reports it, once.
    assert str(error.value) == "dispatch: topk_idx holds expert ids outside [-1, 8) (on 2 of 4 ranks)"
    g = dej.checked(dt.per_rank(_dispatch(buffer, num_worst_tokens=4), mesh, "ep"))
    with pytest.raises(dej.CheckError, match=r"dispatch: more rows arrived than num_worst_tokens=4; .* of 4 ranks\)$"):
        g(x, idx, w)
    f(x, idx, w)  # nothing left over from the failures


def test_checks_mode_layout_and_low_latency(mesh):
    config = dej.Config(checks=True)
    x, idx, _ = _inputs()
    bad = idx.at[0, 0].set(E)
    buffer = dej.Buffer(mesh, "ep", backend="xla", config=config)
    layout = dej.checked(dt.per_rank(lambda i: dej.get_dispatch_layout(i, num_experts=E, buffer=buffer), mesh, "ep"))
    layout(idx)
    with pytest.raises(dej.CheckError, match=r"^get_dispatch_layout: topk_idx holds expert ids outside \[-1, 8\)"):
        layout(bad)
    ll = dej.Buffer(mesh, "ep", backend="xla", config=config, low_latency_mode=True, num_max_dispatch_tokens_per_rank=T)
    dispatch = dej.checked(
        dt.per_rank(
            lambda x, i: dej.low_latency_dispatch(x, i, buffer=ll, num_max_dispatch_tokens_per_rank=T, num_experts=E),
            mesh,
            "ep",
        )
    )
    dispatch(x, idx)
    with pytest.raises(dej.CheckError, match=r"^low_latency_dispatch: topk_idx holds expert ids outside \[-1, 8\)"):
        dispatch(x, bad)


@pytest.mark.parametrize("dispatch", [dej.low_latency_dispatch, dej.low_latency_dispatch_send])
def test_checks_mode_low_latency_rows_dropped(mesh, dispatch):
    """An expert holds R*M rows; more come only from a token naming it twice,
    and are dropped: checks say so (and pass a duplicate that fits)."""
    config = dej.Config(checks=True)
    ll = dej.Buffer(mesh, "ep", backend="xla", config=config, low_latency_mode=True, num_max_dispatch_tokens_per_rank=T)
    x, idx, _ = _inputs()
    f = dej.checked(
        dt.per_rank(
            lambda x, i: dispatch(x, i, buffer=ll, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False),
            mesh,
            "ep",
        )
    )
    full = jnp.asarray(np.tile(np.arange(K, dtype=np.int32), (R * T, 1)))  # experts 0..K-1: R*T = R*M rows each
    f(x, full)
    f(x, full.at[0].set(3))  # a duplicate that fits
    with pytest.raises(
        dej.CheckError,
        match=rf"^{dispatch.__name__}: more than {R * T} rows \(ranks x "
        r"num_max_dispatch_tokens_per_rank\) for one expert, the rest dropped",
    ):
        f(x, jnp.asarray(full).at[9, 1].set(0))  # one row too many for expert 0, from rank 1


@pytest.mark.parametrize("halves", [False, True])
def test_checks_mode_low_latency_combine_of_other_topk_idx(mesh, halves):
    """A combine's topk_idx must be its dispatch's: the handle locates rows only
    for the pairs dispatched, so another id reads another token's row."""
    ll = dej.Buffer(
        mesh,
        "ep",
        backend="xla",
        config=dej.Config(checks=True),
        low_latency_mode=True,
        num_max_dispatch_tokens_per_rank=T,
    )
    x, idx, w = _inputs()
    kwargs = dict(buffer=ll, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False)

    def round_trip(x, dispatch_idx, combine_idx, w):
        if halves:
            pending = dej.low_latency_dispatch_send(x, dispatch_idx, **kwargs)
            recv_x, _, handle = dej.low_latency_dispatch_recv(pending, buffer=ll)
            return dej.low_latency_combine_recv(
                dej.low_latency_combine_send(recv_x, combine_idx, w, handle, buffer=ll), buffer=ll
            )
        recv_x, _, handle = dej.low_latency_dispatch(x, dispatch_idx, **kwargs)
        return dej.low_latency_combine(recv_x, combine_idx, w, handle, buffer=ll)

    f = dej.checked(dt.per_rank(round_trip, mesh, "ep"))
    f(x, idx, idx, w)  # the dispatch's passes
    combine = "low_latency_combine_send" if halves else "low_latency_combine"
    other = (idx[1, 0] + 1) % E
    for combine_idx, ranks in [(idx.at[1, 0].set(other), 1), (idx.at[1, 0].set(-1).at[20, 1].set(-1), 2)]:
        with pytest.raises(dej.CheckError, match=rf"^{combine}: topk_idx is not the dispatch's .*\(on {ranks} of 4"):
            f(x, idx, combine_idx, w)
    with pytest.raises(dej.CheckError, match=rf"^{combine}: topk_idx is not the dispatch's"):
        f(x, idx.at[1, 0].set(-1), idx, w)  # an id where dispatch had -1


def test_checks_mode_without_checked_raises_quietly(tmp_path):
    """Unwrapped, the program fails with JAX's error, whose last line is the
    CheckError: no traceback per rank, none at exit; also where collectives
    follow the failed check (no rank enters one while another has stopped:
    XLA:CPU used to abort, its rendezvous waiting for the stopped ranks)."""
    script = tmp_path / "unwrapped.py"
    script.write_text(
        "import jax, jax.numpy as jnp\n"
        "import deep_ep_jax as dej\n"
        "from deep_ep_jax import testing as dt\n"
        "mesh = dt.ep_mesh(8, platform='cpu')\n"
        "buffer = dej.Buffer(mesh, 'ep', backend='xla', config=dej.Config(checks=True))\n"
        "idx = jnp.full((64, 2), 99, jnp.int32)\n"
        "f = dt.per_rank(lambda i: dej.get_dispatch_layout(i, num_experts=16, buffer=buffer), mesh, 'ep')\n"
        "try:\n"
        "    jax.block_until_ready(f(idx))\n"
        "except Exception as e:\n"
        "    print('RAISED', type(e).__name__, str(e).splitlines()[-1])\n"
        "def layer(x, i, w):\n"  # rows dropped past num_worst_tokens, then local work and combine's exchange
        "    rx, ri, rw, h = dej.dispatch(x, i, w, num_experts=16, buffer=buffer, num_worst_tokens=12)\n"
        "    ex, layout = dej.expand(rx, ri, num_local_experts=2)\n"
        "    return dej.combine(dej.reduce(ex, rw, layout), h, buffer=buffer)\n"
        "x = jnp.ones((64, 128), jnp.bfloat16)\n"
        "i = (jnp.arange(64, dtype=jnp.int32)[:, None] * 3 + jnp.arange(4, dtype=jnp.int32) * 4) % 16\n"
        "for _ in range(3):\n"
        "    try:\n"
        "        jax.block_until_ready(dt.per_rank(layer, mesh, 'ep')(x, i, jnp.ones((64, 4), jnp.float32)))\n"
        "    except Exception as e:\n"
        "        print('RAISED', type(e).__name__, str(e).splitlines()[-1])\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(dej.__file__)))  # deep_ep_jax, installed or not
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    want = "CheckError: get_dispatch_layout: topk_idx holds expert ids outside [-1, 16) (on 8 of 8 ranks)"
    assert f"RAISED JaxRuntimeError {want}" in result.stdout, result.stdout
    want = "CheckError: dispatch: more rows arrived than num_worst_tokens=12; the excess was dropped (on 8 of 8 ranks)"
    assert result.stdout.count(f"RAISED JaxRuntimeError {want}") == 3, result.stdout
    assert "Traceback" not in result.stderr, result.stderr


def test_out_of_range_ids_are_ignored_without_checks(mesh, buffer):
    x, idx, w = _inputs()
    bad = idx.at[:, 0].set(jnp.where(jnp.arange(R * T) % 2 == 0, E + 3, -7))
    clean = idx.at[:, 0].set(-1)
    f = dt.per_rank(_dispatch(buffer), mesh, "ep")
    got, want = f(x, bad, w), f(x, clean, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_poison_padding_shows_an_unmasked_weight_gradient(mesh):
    """Config(poison_padding=True): the xla backend's dispatch leaves NaN in its padding rows, as the kernels may,
    so a weight gradient that does not mask them (recv_x^T @ dy) comes out NaN on CPU too; masked, it is finite.
    Without it the padding rows are finite (and such a bug passes on CPU)."""
    x, idx, w = _inputs()
    dy = jnp.ones((R * T * R, H), jnp.float32)

    def weight_grads(buffer):
        def per_rank(x, idx, w, dy):
            recv_x, recv_idx, _, handle = dej.dispatch(x, idx, w, num_experts=E, buffer=buffer)
            rows = recv_x.astype(jnp.float32)
            masked = jnp.where((recv_idx >= 0).any(axis=1)[:, None], rows, 0.0)
            return (rows.T @ dy)[None], (masked.T @ dy)[None], handle.num_recv_tokens[None]

        return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w, dy)

    plain, masked, num_recv = weight_grads(dej.Buffer(mesh, "ep", backend="xla"))
    assert np.isfinite(np.asarray(plain)).all() and np.isfinite(np.asarray(masked)).all()
    assert (np.asarray(num_recv) < R * T).any()  # some rank has padding rows
    plain, masked, _ = weight_grads(dej.Buffer(mesh, "ep", backend="xla", config=dej.Config(poison_padding=True)))
    assert np.isnan(np.asarray(plain)).any() and np.isfinite(np.asarray(masked)).all()


@pytest.mark.parametrize("use_fp8", [False, True])
def test_poison_padding_in_low_latency_mode(mesh, use_fp8):
    """Config(poison_padding=True) on the xla backend: low-latency dispatch's rows past each expert's recv_count
    are NaN (data and scales), its valid rows finite; without it every row is finite."""
    x, idx, _ = _inputs()

    def rows(config):
        buffer = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=T,
                            config=config)  # fmt: skip

        def per_rank(x, idx):
            recv_x, count, _ = dej.low_latency_dispatch(
                x, idx, buffer=buffer, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=use_fp8
            )
            return tuple(a.astype(jnp.float32)[None] for a in jax.tree.leaves(recv_x)), count[None]

        return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(x, idx)

    plain, _ = rows(dej.Config())
    assert all(np.isfinite(np.asarray(a)).all() for a in plain)
    poisoned, count = rows(dej.Config(poison_padding=True))
    valid = np.arange(R * T)[None, None, :] < np.asarray(count)[:, :, None]  # [R, E/R, R*T]
    assert not valid.all()  # some expert has padding rows
    for a in poisoned:
        a = np.asarray(a).reshape(valid.shape + (-1,))
        assert np.isfinite(a[valid]).all() and np.isnan(a[~valid]).all()


def test_auto_backend_on_gpus_the_extension_cannot_run_warns(mesh, monkeypatch):
    """backend="auto" on GPUs whose CUDA backend cannot run (not built for their architecture, say) falls back
    to the xla backend with one warning naming the reason; on CPUs it falls back without a word."""
    import warnings

    from deep_ep_jax import _native
    from deep_ep_jax.comm import buffer as buffer_module

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dej.Buffer(mesh, "ep").backend == "xla"  # CPU devices: nothing to say
    monkeypatch.setattr(buffer_module, "_is_gpu", lambda device: True)
    monkeypatch.setattr(_native, "unavailable_reason", lambda: "no kernel image for sm_80 (built for sm_90)")
    with pytest.warns(UserWarning, match=r"Buffer\(backend='auto'\): .* not available: no kernel image for sm_80"):
        assert dej.Buffer(mesh, "ep").backend == "xla"
