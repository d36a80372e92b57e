"""What the CUDA op modules share: FFI targets with named results, the
extension's limits, and normal mode's pieces that intranode and internode
both use (result names, launch attributes, trace-time checks, calls)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from deep_ep_jax import _native, config
from deep_ep_jax.comm import ordering
from deep_ep_jax.comm.handle import DispatchHandle
from deep_ep_jax.comm.mesh import same_mesh
from deep_ep_jax.comm.varying import varying_like

INT32_MAX = 2**31 - 1  # the kernels index rows with 32-bit ints


def limit(name: str) -> int:
    """One of the kernels' limits, from the extension (`_C.limits()[name]`)."""
    return _native.limits()[name]


def normal_mode_max_ranks(spans_hosts: bool) -> int:
    """The most ranks normal mode serves: one node (an NVLink domain);
    across nodes `limit("max_internode_normal_ranks")` in all, on hosts of at
    most `limit("max_internode_host_ranks")` each (low-latency mode serves up to
    `limit("max_group_ranks")`)."""
    return limit("max_internode_normal_ranks" if spans_hosts else "max_nvlink_ranks")


def normal_mode_rank_error(fn, num_ranks, spans_hosts) -> str | None:
    """Why normal mode cannot serve an EP group of num_ranks ranks, or None."""
    max_ranks = normal_mode_max_ranks(spans_hosts)
    if num_ranks <= max_ranks:
        return None
    where = "in all across hosts" if spans_hosts else "in one node (one NVLink domain)"
    cut = "" if spans_hosts else "; Config.gpus_per_nvlink_domain cuts it into nodes joined by NVSHMEM"
    return (
        f"{fn}: normal mode supports at most {max_ranks} ranks {where}, the EP group has {num_ranks} "
        f"(low-latency mode: {limit('max_group_ranks')}){cut}"
    )


@dataclasses.dataclass(frozen=True)
class FfiTarget:
    """An FFI target of the extension and the names of its results, in order
    (checked against `_C.ffi_outputs()` when the targets are registered).

    An `ordered` target communicates: it takes its Buffer's order state first
    and returns it last, aliased (`deep_ep_jax.comm.ordering`), so XLA runs the
    Buffer's calls one after another in program order, and never merges two.
    No target carries a JAX effect (`has_side_effect`): an effect takes a
    jitted step off jit's C++ dispatch path onto its slower Python one, which
    a host-bound step such as the decode example's pays on every call. Like
    any pure op, a call whose results nothing uses may be dropped, on every
    rank alike (all run one program)."""

    name: str
    results: tuple
    vmap_method: str | None = None
    ordered: bool = True

    @property
    def all_results(self) -> tuple:
        """Every result the target returns, the order state's included."""
        return self.results + (("order_out",) if self.ordered else ())

    def __call__(self, buffer, out_types: dict, *args, **attrs) -> dict:
        """Calls the target for `buffer`. out_types: {result name:
        jax.ShapeDtypeStruct}; returns {result name: array}."""
        if sorted(out_types) != sorted(self.results):
            raise TypeError(f"{self.name}: out_types names {sorted(out_types)}, the target returns {self.results}")
        types = tuple(out_types[r] for r in self.results)
        aliases = None
        if self.ordered:
            args = (same_mesh(ordering.take(buffer), buffer, self.name),) + args
            types += (jax.ShapeDtypeStruct((1,), jnp.int32),)
            aliases = {0: len(types) - 1}
        call = jax.ffi.ffi_call(self.name, types, vmap_method=self.vmap_method, input_output_aliases=aliases)
        results = varying_like(call(*args, **attrs), args, getattr(buffer, "axis_name", None))
        outputs = dict(zip(self.all_results, results))
        if self.ordered:
            ordering.put(buffer, outputs.pop("order_out"))
        return outputs


# Normal mode: results of both paths (internode adds scratch after them) -------

# After the received rows, the handle's fields (DispatchHandle), in its order.
DISPATCH_RESULTS = (
    "recv_x",
    "recv_x_scales",
    "recv_topk_idx",
    "recv_topk_weights",
    "is_token_in_rank",
    "num_tokens_per_rank",
    "rank_prefix_matrix",
    "send_pos",
    "recv_src_idx",
    "recv_src_rank",
    "num_recv_tokens",
    "num_recv_tokens_per_expert",
    "num_dropped_tokens",
)
CACHED_DISPATCH_RESULTS = ("recv_x", "recv_x_scales", "recv_topk_weights")
COMBINE_RESULTS = ("out", "out_weights")


def dispatch_out_types(num_tokens, num_rows, xs, num_topk, num_ranks, num_experts) -> dict:
    """Result types of a dispatch (either path), by name."""
    x, scales = xs[0], scales_or_empty(xs, num_tokens)
    i32, f32 = jnp.int32, jnp.float32
    shapes = dict(
        recv_x=((num_rows, x.shape[1]), x.dtype),
        recv_x_scales=((num_rows, scales.shape[1]), scales.dtype),
        recv_topk_idx=((num_rows, num_topk), i32),
        recv_topk_weights=((num_rows, num_topk), f32),
        is_token_in_rank=((num_tokens, num_ranks), jnp.bool_),
        num_tokens_per_rank=((num_ranks,), i32),
        rank_prefix_matrix=((num_ranks, num_ranks), i32),
        send_pos=((num_tokens, num_ranks), i32),
        recv_src_idx=((num_rows,), i32),
        recv_src_rank=((num_rows,), i32),
        num_recv_tokens=((), i32),
        num_recv_tokens_per_expert=((num_experts // num_ranks,), i32),
        num_dropped_tokens=((), i32),
    )
    return {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in shapes.items()}


def dispatch_results(outputs: dict, xs, topk_weights):
    """(recv_xs, recv_topk_idx, recv_topk_weights, handle) from a dispatch's results."""
    arrays = [f.name for f in dataclasses.fields(DispatchHandle) if not f.metadata.get("static")]
    handle = DispatchHandle(**{name: outputs[name] for name in arrays})
    recv_xs = (outputs["recv_x"],) if len(xs) == 1 else (outputs["recv_x"], outputs["recv_x_scales"])
    return recv_xs, outputs["recv_topk_idx"], (None if topk_weights is None else outputs["recv_topk_weights"]), handle


def launch_attrs(buffer) -> dict:
    """The launch attributes both paths take (intranode adds its own)."""
    config = buffer.config
    return dict(
        buffer_id=np.int64(buffer.buffer_id),
        num_sms=np.int64(config.num_sms),
        num_warps=np.int64(config.num_warps),
        timeout_ns=np.int64(config.timeout_ns),
        count_traffic=np.int64(config.count_traffic),
    )


# Normal mode: trace-time checks --------------------------------------------------


def check_common(fn, buffer, *, num_tokens, num_rows, num_topk):
    error = normal_mode_rank_error(fn, buffer.num_ranks, buffer.spans_hosts)
    if error:
        raise ValueError(error)
    if buffer.buffer_id is None:
        raise ValueError(f"{fn}: the buffer has no device memory (backend {buffer.backend!r}); use backend='cuda'")
    for what, value in (
        ("tokens * ranks", num_tokens * buffer.num_ranks),
        ("tokens * topk", num_tokens * num_topk),
        ("num_worst_tokens * topk", num_rows * num_topk),
    ):
        if value > INT32_MAX:
            raise ValueError(f"{fn}: {what} must be <= {INT32_MAX} (32-bit row indices), got {value}")


def check_num_experts(fn, num_experts, num_ranks):
    max_local = limit("max_local_experts")
    if num_experts % num_ranks or num_experts // num_ranks > max_local:
        raise ValueError(
            f"{fn}: num_experts must be a multiple of the {num_ranks} ranks with at most {max_local} per "
            f"rank for the CUDA kernels, got {num_experts}"
        )


def row_bytes(fn, xs):
    """(bytes per row of x, of its scales: 0 for bf16 rows). A quantized pair (the public
    functions checked its format) moves as bytes."""
    x = xs[0]
    if len(xs) == 2:
        return tuple(config.row_bytes((a,)) for a in xs)
    hidden = x.shape[1]
    if jnp.dtype(x.dtype) != jnp.bfloat16:
        raise ValueError(f"{fn}: the CUDA kernels move bf16 rows or quantized pairs, got x of dtype {x.dtype}")
    if hidden % 8:
        raise ValueError(f"{fn}: bf16 hidden must be a multiple of 8 (16-byte rows) for the CUDA kernels, got {hidden}")
    return 2 * hidden, 0


# Normal mode: calls -------------------------------------------------------------


def scales_or_empty(xs, num_tokens):
    return xs[1] if len(xs) == 2 else jnp.zeros((num_tokens, 0), jnp.float32)


def dispatch_call(
    target: FfiTarget, buffer, xs, topk_idx, topk_weights, num_experts, num_rows, num_ranks, attrs, scratch_types=None
):
    """The dispatch of either path (internode adds its scratch results): rows
    (and scales), top-k ids and weights in; (recv_xs, recv_topk_idx,
    recv_topk_weights or None, handle) out."""
    num_tokens, num_topk = topk_idx.shape
    weights = jnp.zeros((num_tokens, num_topk), jnp.float32) if topk_weights is None else topk_weights
    out_types = dict(
        dispatch_out_types(num_tokens, num_rows, xs, num_topk, num_ranks, num_experts), **(scratch_types or {})
    )
    out = target(
        buffer,
        out_types,
        xs[0],
        scales_or_empty(xs, num_tokens),
        jnp.asarray(topk_idx, jnp.int32),
        jnp.asarray(weights, jnp.float32),
        num_experts=np.int64(num_experts),
        **attrs,
    )
    return dispatch_results(out, xs, topk_weights)


def cached_dispatch_call(target: FfiTarget, buffer, xs, topk_weights, handle, attrs, scratch_types=None):
    """The cached dispatch of either path (internode adds its scratch
    results): rows (and scales), weights, the handle's send positions and
    received-row count in; (received rows (and scales), received weights or
    None) out."""
    num_tokens, num_rows = handle.send_pos.shape[0], handle.num_worst_tokens
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    x = xs[0]
    scales = scales_or_empty(xs, num_tokens)
    weights = jnp.zeros((num_tokens, 0), jnp.float32) if topk_weights is None else topk_weights
    out_types = dict(
        recv_x=jax.ShapeDtypeStruct((num_rows, x.shape[1]), x.dtype),
        recv_x_scales=jax.ShapeDtypeStruct((num_rows, scales.shape[1]), scales.dtype),
        recv_topk_weights=jax.ShapeDtypeStruct((num_rows, num_topk), jnp.float32),
        **(scratch_types or {}),
    )
    out = target(
        buffer,
        out_types,
        x,
        scales,
        jnp.asarray(weights, jnp.float32),
        handle.send_pos,
        handle.num_recv_tokens,
        **attrs,
    )
    recv_xs = (out["recv_x"],) if len(xs) == 1 else (out["recv_x"], out["recv_x_scales"])
    return recv_xs, (None if topk_weights is None else out["recv_topk_weights"])


def combine_call(target: FfiTarget, buffer, x, topk_weights, num_tokens, handle_arrays, attrs):
    """The combine of either path: x and the weights, then the path's handle
    arrays in; (out bf16 [T, H], reduced weights f32 [T, K] or None) out."""
    num_rows, hidden = x.shape
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    weights = jnp.zeros((num_rows, 0), jnp.float32) if topk_weights is None else topk_weights
    out_types = dict(
        out=jax.ShapeDtypeStruct((num_tokens, hidden), x.dtype),
        out_weights=jax.ShapeDtypeStruct((num_tokens, num_topk), jnp.float32),
    )
    out = target(buffer, out_types, x, jnp.asarray(weights, jnp.float32), *handle_arrays, **attrs)
    return out["out"], (None if topk_weights is None else out["out_weights"])
