"""Expert-major rows: a rank's received rows regrouped by local expert, for a
grouped GEMM, and reduced back per row (docs/design.md, "Expert-major rows").

    expert_x, layout, recv_w, handle = dispatch_expert_major(
        x, topk_idx, topk_weights, num_experts=E, buffer=buffer, alignment=128)
    expert_y = experts(expert_x, layout.group_offsets, layout.group_sizes)
    out = combine_expert_major(expert_y, recv_w, layout, handle, buffer=buffer)

`expand` and `reduce` are local (no communication, any context): a layer
over the rank-major `dispatch` and `combine`. The gradients' rules live here,
so every backend shares them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from deep_ep_jax import _native, fp8_quant
from deep_ep_jax.backends import reference_expert_major
from deep_ep_jax.comm import normal
from deep_ep_jax.comm import validation as v
from deep_ep_jax.comm.buffer import Buffer
from deep_ep_jax.comm.handle import DispatchHandle, ExpertLayout
from deep_ep_jax.comm.validation import Rows
from deep_ep_jax.comm.varying import vary_over, varying_like, vma, zero_rows_like
from deep_ep_jax.config import FP8_BLOCK, ROW_FORMATS, row_bytes
from deep_ep_jax.experts import grouped_gemm
from deep_ep_jax.experts.grouped_gemm import Fp8Rows, grouped_matmul
from deep_ep_jax.fp8_quant import quantize_rows

INT32_MAX = v.INT32_MAX  # rows and pairs are indexed with int32
BACKENDS = ("auto", "cuda", "xla")


def default_num_rows(num_tokens: int, num_topk: int, num_local_experts: int, alignment: int) -> int:
    """The worst case of expert-major rows for N = num_tokens received rows:
    N * min(K, L) pairs (a row names each local expert at most once, as top-k
    routing does) plus up to alignment - 1 padding rows per group, rounded up
    to a multiple of the alignment (as num_rows must be)."""
    rows = num_tokens * min(num_topk, num_local_experts) + num_local_experts * (alignment - 1)
    return -(-rows // alignment) * alignment


def expand(
    recv_x: Rows,
    recv_topk_idx: jax.Array,
    *,
    num_local_experts: int,
    alignment: int = 1,
    num_rows: int | None = None,
    backend: str = "auto",
    fp8_rows: bool = False,
) -> tuple[Rows | Fp8Rows, ExpertLayout]:
    """One row per (row n, k) pair of a valid local expert id, grouped by
    local expert e = 0..L-1, each group starting at a multiple of `alignment`;
    within a group, pairs in (n, k) order.

      recv_x: bf16 [N, H] (or an FP8 pair (float8_e4m3fn [N, H], float32
        [N, H // 128])), e.g. dispatch's received rows.
      recv_topk_idx: int32 [N, K] local expert ids; ids outside [0, L) name no expert.
      num_rows: rows of the result, a multiple of `alignment` (default
        `default_num_rows`, the worst case); pairs past it are dropped and
        counted in layout.num_dropped.
      backend: "cuda" (the kernels), "xla" (pure JAX) or "auto" (the kernels
        where the program runs on CUDA GPUs and the extension is built).
      fp8_rows: quantize bf16 recv_x per row first (fp8_quant.quantize_rows)
        and expand its FP8 rows: expert_x is then an Fp8Rows for
        grouped_matmul(..., fp8_weights=), through which recv_x's gradient
        flows (its rows that hold a pair are those of quantize_rows(expert_x),
        bit for bit; unused rows have data and scale 0).

    Returns (expert_x [num_rows, H] in recv_x's form (an Fp8Rows with
    fp8_rows), unused rows 0; layout).
    """
    fn = "expand"
    if not v.check_bool(fn, "fp8_rows", fp8_rows):
        return _expand(fn, recv_x, recv_topk_idx, num_local_experts, alignment, num_rows, backend)
    _check_fp8_rows_input(fn, recv_x, "recv_x")
    pair = _quantized_pair(recv_x)
    expert_pair, layout = _expand(fn, pair, recv_topk_idx, num_local_experts, alignment, num_rows, backend)
    ops = _backend(fn, backend)
    sink, _ = _rows_gradient_sink(recv_x, None, None, None, layout, None, ops, None)
    return _fp8_rows(expert_pair, sink, pair[0], layout, ops), layout


def reduce(
    expert_y: jax.Array, recv_topk_weights: jax.Array, layout: ExpertLayout, *, backend: str = "auto"
) -> jax.Array:
    """y[n] = bf16(sum over k = 0..K-1, in order, of w[n, k] * expert_y[pair_row[n, k]]):
    float32, each product rounded before its add, pairs with no row skipped;
    a row with no pair gives 0.

      expert_y: bf16 [num_rows, H], the expert outputs in expand's rows.
      recv_topk_weights: float32 [N, K].

    Returns bf16 [N, H], the rows `combine` takes.
    """
    return _reduce("reduce", expert_y, recv_topk_weights, layout, backend)


# grouped_matmul's keyword arguments and their defaults, which grouped_matmul_reduce passes on.
_MATMUL_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(grouped_matmul).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
}


def grouped_matmul_reduce(
    x,
    w,
    group_sizes,
    recv_topk_weights: jax.Array,
    layout: ExpertLayout,
    *,
    backend: str = "auto",
    matmul_backend: str = "auto",
    **matmul,
) -> jax.Array:
    """reduce(grouped_matmul(x, w, group_sizes, backend=matmul_backend, **matmul), recv_topk_weights,
    layout, backend=backend): the experts' last matmul and the weighted sum per row as one function
    (bf16 [N, H], the rows `combine` takes; the same values).

    With matmul's fp8_weights=fp8_weights(w, weight_grad=True) its backward never writes the expert
    rows' bf16 gradient (w[n, k] * dy[n] on every row of a pair): the token rows' gradient is
    quantized once per row and gathered into the FP8 operands of dx (its FP8 rows, each scaled by its
    pair's weight) and of dw (gathered transposed and quantized per column with multipliers, by
    `expand_rows_transposed`; w's N a multiple of 128, its tiles). Otherwise it is the composition above.
    """
    fn = "grouped_matmul_reduce"
    unknown = set(matmul) - set(_MATMUL_DEFAULTS)
    if unknown:
        raise TypeError(f"{fn}: unknown grouped_matmul arguments {sorted(unknown)}")
    matmul_backend = grouped_gemm.resolve_backend(fn, matmul_backend, matmul.pop("impl", None))
    w8 = matmul.get("fp8_weights")
    if w8 is None or not getattr(w8, "weight_grad", False) or getattr(w, "shape", (0,) * 3)[-1] % FP8_BLOCK:
        y = grouped_matmul(x, w, group_sizes, backend=matmul_backend, **matmul)
        return reduce(y, recv_topk_weights, layout, backend=backend)
    matmul = {**_MATMUL_DEFAULTS, **matmul}  # grouped_matmul's own defaults
    call = grouped_gemm.prepared_call(
        x, w, group_sizes, matmul_backend, matmul["block_sizes"], matmul["aligned_groups"], matmul["valid_sizes"], w8
    )
    hidden = w.shape[2]
    ops = _check_reduce(fn, jax.ShapeDtypeStruct((call.num_rows, hidden), w.dtype), recv_topk_weights, layout, backend)
    x, w, group_sizes, valid_sizes, scale = call.arrays
    return _fp8_matmul_reduce(
        call.static, call.num_rows, ops, x, w, w8, group_sizes, valid_sizes, scale, recv_topk_weights, layout
    )


def dispatch_expert_major(
    x: Rows,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    *,
    num_experts: int,
    buffer: Buffer,
    alignment: int = 1,
    num_worst_tokens: int | None = None,
    num_rows: int | None = None,
    fp8_rows: bool = False,
) -> tuple[Rows | Fp8Rows, ExpertLayout, jax.Array, DispatchHandle]:
    """`dispatch`, then `expand` of the received rows on the Buffer's backend.

    fp8_rows: quantize bf16 x per row (fp8_quant.quantize_rows) and send
    and expand its FP8 rows (half the bytes of bf16): expert_x is then an
    Fp8Rows for grouped_matmul(..., fp8_weights=), through which x's
    gradient flows back (a combine, as dispatch's own). Its rows that hold a
    pair are those of quantize_rows(expert_x) without it, bit for bit. While
    x's or the weights' gradient is taken, the matmul's dx is computed and
    sent back even if only one of them is asked for.

    Returns (expert_x, layout, recv_topk_weights float32 [N, K], handle):
    what `combine_expert_major` takes back, with the expert outputs.
    """
    fn = "dispatch_expert_major"
    fp8_rows = v.check_bool(fn, "fp8_rows", fp8_rows)
    sent, sent_weights = x, topk_weights
    if fp8_rows:  # x and the weights get their gradients from _rows_gradient_sink's backward
        _check_fp8_rows_input(fn, x, "x")
        sent, sent_weights = _quantized_pair(x), lax.stop_gradient(topk_weights)
    recv_x, recv_idx, recv_w, handle = normal.dispatch_as(  # bf16 or the FP8 pair: what expand and the GEMM take
        fn, sent, topk_idx, sent_weights, num_experts, buffer, num_worst_tokens, formats=ROW_FORMATS[:1]
    )
    if handle.num_worst_tokens < 1:
        raise ValueError(
            f"{fn}: no row can arrive (x has 0 tokens per rank and num_worst_tokens is "
            f"{num_worst_tokens}), and the expert-major layout needs at least one row"
        )
    expert_x, layout = _expand(
        fn, recv_x, recv_idx, num_experts // buffer.num_ranks, alignment, num_rows, buffer.backend
    )
    if num_rows is None:  # sized for the expert rows' worst case, beside dispatch's (checked there)
        normal.check_budget(
            fn,
            layout.num_rows * row_bytes(recv_x if isinstance(recv_x, tuple) else (recv_x,)),
            f"{layout.num_rows} expert rows: every received row on min(K, local experts) of them",
            "Pass num_rows= (pairs past it are dropped and counted; Config(checks=True) raises on them)",
            buffer,
        )
    if fp8_rows:
        ops = _backend(fn, buffer.backend)
        sink, recv_w = _rows_gradient_sink(x, topk_weights, recv_w, recv_idx, layout, handle, ops, buffer)
        expert_x = _fp8_rows(expert_x, sink, recv_x[0], layout, ops)
    if buffer.config.checks:
        message = f"{fn}: more (row, expert) pairs arrived than num_rows={layout.num_rows}; the excess was dropped"
        expert_x, layout = v.raise_if_any(buffer, [(layout.num_dropped > 0, message)], (expert_x, layout))
    return expert_x, layout, recv_w, handle


def combine_expert_major(
    expert_y: jax.Array, recv_topk_weights: jax.Array, layout: ExpertLayout, handle: DispatchHandle, *, buffer: Buffer
) -> jax.Array:
    """`reduce` of the expert outputs with the weights, then `combine`: bf16 [T, H]."""
    fn = "combine_expert_major"
    v.check_buffer(buffer, fn)
    v.check_tokens(expert_y, buffer, fn, allow_fp8=False, name="expert_y")  # its hidden, named here
    if not isinstance(handle, DispatchHandle):
        raise TypeError(
            f"{fn}: handle must be the DispatchHandle that dispatch_expert_major returned, got {type(handle).__name__}"
        )
    _check_layout(fn, layout)
    local_experts = handle.num_recv_tokens_per_expert.shape[0]
    if layout.group_sizes.shape[0] != local_experts or layout.pair_row.shape[0] != handle.num_worst_tokens:
        raise ValueError(
            f"{fn}: layout is for {layout.group_sizes.shape[0]} local experts and {layout.pair_row.shape[0]} rows, "
            f"the handle for {local_experts} and {handle.num_worst_tokens} (pass the layout and handle of one "
            f"dispatch_expert_major)"
        )
    y = _reduce(fn, expert_y, recv_topk_weights, layout, buffer.backend)
    return normal.combine(y, handle, buffer=buffer)


# Checks ------------------------------------------------------------------------


def _check_layout(fn, layout):
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"{fn}: layout must be the ExpertLayout that expand returned, got {type(layout).__name__}")


def _expand(fn, recv_x, recv_topk_idx, num_local_experts, alignment, num_rows, backend):
    xs, num_tokens, hidden = v.check_tokens(recv_x, None, fn, name="recv_x")
    shape, dtype = tuple(getattr(recv_topk_idx, "shape", ())), jnp.dtype(getattr(recv_topk_idx, "dtype", None))
    if dtype != jnp.int32 or len(shape) != 2 or shape[0] != num_tokens or shape[1] < 1:
        raise TypeError(f"{fn}: recv_topk_idx must be int32 [{num_tokens}, topk] (recv_x's rows), got {dtype} {shape}")
    num_topk = shape[1]
    if num_tokens < 1:
        raise ValueError(f"{fn}: recv_x must have at least one row")
    num_local_experts = v.check_int(fn, "num_local_experts", num_local_experts, 1)
    alignment = v.check_int(fn, "alignment", alignment, 1)
    # Every row index, padding included, fits an int32.
    if num_tokens * num_topk + num_local_experts * (alignment - 1) > INT32_MAX:
        raise ValueError(
            f"{fn}: rows * topk + num_local_experts * (alignment - 1) must be <= {INT32_MAX} (int32 "
            f"rows), got {num_tokens} * {num_topk} + {num_local_experts} * ({alignment} - 1)"
        )
    if num_rows is None:
        num_rows = default_num_rows(num_tokens, num_topk, num_local_experts, alignment)
    num_rows = v.check_int(fn, "num_rows", num_rows, 1)
    if num_rows % alignment:
        # A group cut at num_rows would end off the alignment: padded_group_sizes would break
        # grouped_matmul's aligned_groups promise (its outputs all NaN).
        down, up = num_rows // alignment * alignment, -(-num_rows // alignment) * alignment
        raise ValueError(
            f"{fn}: num_rows ({num_rows}) must be a multiple of alignment ({alignment}), so every "
            f"group ends on it; use {up}" + (f" or {down}" if down else "")
        )
    ops = _backend(fn, backend)
    if ops.check is not None:
        ops.check(fn, num_local_experts=num_local_experts, hidden=hidden, rows_dtype=xs[0].dtype)
    idx = jnp.where((recv_topk_idx >= 0) & (recv_topk_idx < num_local_experts), recv_topk_idx, -1)
    layout = ops.expert_layout(idx, num_local_experts=num_local_experts, alignment=alignment, num_rows=num_rows)
    expert_xs = _expand_rows(xs, layout, ops)
    return (expert_xs[0] if len(xs) == 1 else expert_xs), layout


def _check_fp8_rows_input(fn, x, name):
    if isinstance(x, (tuple, list)):
        raise TypeError(
            f"{fn}: fp8_rows=True quantizes bf16 {name} itself; got an FP8 pair (pass "
            f"fp8_rows=False to move it as it is)"
        )
    _, _, hidden = v.check_tokens(x, None, fn, allow_fp8=False, name=name)
    if hidden % FP8_BLOCK:
        raise ValueError(
            f"{fn}: fp8_rows=True needs hidden a multiple of {FP8_BLOCK} (the FP8 rows' scale blocks), got {hidden}"
        )


def _quantized_pair(x):
    """bf16 x [T, H] quantized per row, as the FP8 pair the kernels move: (float8 [T, H], its row scale
    repeated over the H / 128 blocks, float32 [T, H / 128])."""
    data, scales = quantize_rows(x)
    return data, jnp.broadcast_to(scales[:, None], (x.shape[0], x.shape[1] // FP8_BLOCK))


def _fp8_rows(expert_pair, grad_sink, token_data, layout, ops):
    """The Fp8Rows of the expanded pair, with data_t gathered straight from the token rows (a separate
    call: dropped by XLA where nothing reads it, as without the FP8 weight gradient)."""
    data, block_scales = expert_pair
    data_t = ops.expand_rows_transposed(lax.stop_gradient(token_data), layout)  # FP8 carries no gradient
    return Fp8Rows(data, block_scales[:, 0], grad_sink, data_t)


def _reduce(fn, expert_y, recv_topk_weights, layout, backend):
    ops = _check_reduce(fn, expert_y, recv_topk_weights, layout, backend)
    return _reduce_rows(expert_y, recv_topk_weights, layout, ops)


def _check_reduce(fn, expert_y, recv_topk_weights, layout, backend) -> _Ops:
    """Raises where expert_y (an array or its shape and dtype), the weights and layout do not go
    together; returns the backend's operations."""
    _check_layout(fn, layout)
    (expert_y,), num_rows, hidden = v.check_tokens(expert_y, None, fn, allow_fp8=False, name="expert_y")
    if num_rows != layout.num_rows:
        raise ValueError(f"{fn}: expert_y must have the layout's {layout.num_rows} rows, got {num_rows}")
    shape, dtype = tuple(getattr(recv_topk_weights, "shape", ())), jnp.dtype(getattr(recv_topk_weights, "dtype", None))
    if dtype != jnp.float32 or shape != layout.pair_row.shape:
        raise TypeError(
            f"{fn}: recv_topk_weights must be float32 {layout.pair_row.shape} (the layout's [rows, topk]), "
            f"got {dtype} {shape}"
        )
    ops = _backend(fn, backend)
    if ops.check is not None:
        ops.check(fn, num_local_experts=layout.group_sizes.shape[0], hidden=hidden, rows_dtype=expert_y.dtype)
    return ops


# Backends -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Ops:
    """The local operations of one backend (hashable: a custom_vjp's static argument)."""

    expert_layout: Callable
    expand_rows: Callable
    expand_rows_transposed: Callable
    reduce_rows: Callable
    check: Callable | None = None  # the kernels' own trace-time limits


_XLA = _Ops(
    reference_expert_major.expert_layout,
    reference_expert_major.expand_rows,
    reference_expert_major.expand_rows_transposed,
    reference_expert_major.reduce_rows,
)


@functools.cache
def _cuda_ops(by_platform: bool) -> _Ops:
    """The kernels' operations; by_platform: the kernels where the program
    runs on CUDA, the pure-JAX ones elsewhere (lax.platform_dependent)."""
    from deep_ep_jax.backends.cuda import expert_major as cuda
    from deep_ep_jax.backends.cuda import lifecycle

    lifecycle.register_ffi_targets()
    if not by_platform:
        return _Ops(
            cuda.expert_layout, cuda.expand_rows, cuda.expand_rows_transposed, cuda.reduce_rows, cuda.check_shapes
        )

    def on_platform(name):
        def op(*args, **static):
            branches = {
                platform: _varying_as_inputs(functools.partial(getattr(module, name), **static))
                for platform, module in (("cuda", cuda), ("default", reference_expert_major))
            }
            return lax.platform_dependent(*args, **branches)

        return op

    return _Ops(
        on_platform("expert_layout"),
        on_platform("expand_rows"),
        on_platform("expand_rows_transposed"),
        on_platform("reduce_rows"),
        cuda.check_shapes,
    )


def _varying_as_inputs(fn):
    """fn with every result typed as varying over every mesh axis an input
    varies over: both branches of platform_dependent then have one type."""

    def run(*args):
        out = fn(*args)
        leaves, tree = jax.tree.flatten(out)
        return jax.tree.unflatten(tree, varying_like(leaves, jax.tree.leaves(args), None))

    return run


def _backend(fn, backend) -> _Ops:
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "xla":
        return _XLA
    reason = _native.unavailable_reason()
    if backend == "cuda":
        if reason:
            raise RuntimeError(f"{fn}: backend 'cuda' is not available: {reason}")
        return _cuda_ops(False)
    return _XLA if reason else _cuda_ops(True)


# Gradients ------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _expand_rows(xs, layout, ops):
    return ops.expand_rows(xs, layout)


def _expand_rows_fwd(xs, layout, ops):
    return _expand_rows(xs, layout, ops), (layout, tuple(x[:0] for x in xs))  # xs' types, as in dispatch


def _expand_rows_bwd(ops, residuals, g_expert_xs):
    layout, xs_like = residuals
    # Each pair's gradient row summed back to its row, float32 in k order.
    if len(g_expert_xs) == 1:
        g_xs = (ops.reduce_rows(g_expert_xs[0], None, layout),)
    else:  # FP8 rows carry no gradient, as in dispatch.
        g_xs = tuple(zero_rows_like(layout.pair_row.shape[0], x) for x in xs_like)
    return g_xs, jax.tree.map(lambda _: None, layout)


_expand_rows.defvjp(_expand_rows_fwd, _expand_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _rows_gradient_sink(x, topk_weights, recv_w, recv_idx, layout, handle, ops, buffer):
    """(zeros of x's dtype [num_rows, H], recv_w): stand-ins through which the gradients of rows that
    moved as FP8 (which carry none) reach x and topk_weights, as those of bf16 rows would: the expert
    rows' gradient summed per row (expand's backward), then with a buffer combined back together
    with recv_w's (dispatch's backward). Without one (expand alone) the weights are None."""
    rows = jnp.zeros((layout.num_rows, x.shape[1]), x.dtype)
    return vary_over(rows, vma(x)), recv_w


def _rows_gradient_sink_fwd(x, topk_weights, recv_w, recv_idx, layout, handle, ops, buffer):
    return _rows_gradient_sink(x, topk_weights, recv_w, recv_idx, layout, handle, ops, buffer), (
        recv_idx,
        layout,
        handle,
    )


def _rows_gradient_sink_bwd(ops, buffer, residuals, cotangents):
    recv_idx, layout, handle = residuals
    g_rows, g_recv_w = cotangents
    g_x = ops.reduce_rows(g_rows, None, layout)
    g_w = None
    if buffer is not None:
        g_x, g_w = normal.dispatch_backward(g_x, g_recv_w, recv_idx, handle, buffer)
    no_grad = lambda tree: jax.tree.map(lambda _: None, tree)
    # recv_w passed through: its gradient went to topk_weights' above.
    return g_x, g_w, None, None, no_grad(layout), no_grad(handle)


_rows_gradient_sink.defvjp(_rows_gradient_sink_fwd, _rows_gradient_sink_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _reduce_rows(expert_y, weights, layout, ops):
    return ops.reduce_rows(expert_y, weights, layout)


def _reduce_rows_fwd(expert_y, weights, layout, ops):
    return _reduce_rows(expert_y, weights, layout, ops), (expert_y, weights, layout)


def _reduce_rows_bwd(ops, residuals, g_y):
    # d expert_y[pair_row[n, k]] = bf16(w[n, k] * dy[n]); unused rows get 0. Pure JAX on every backend.
    expert_y, weights, layout = residuals
    used, pair, dy = _rows_of_pairs(g_y, layout)
    w = weights.reshape(-1)[pair]
    g_expert_y = jnp.where(used[:, None], (w[:, None] * dy).astype(expert_y.dtype), jnp.zeros((), expert_y.dtype))
    return g_expert_y, _weights_grad(dy, used, expert_y, layout), jax.tree.map(lambda _: None, layout)


def _rows_of_pairs(g_y, layout):
    """(used bool [num_rows], pair int32 [num_rows] (0 where unused), float32 [num_rows, H]: each row's
    token row of g_y)."""
    used = layout.row_pair >= 0
    pair = jnp.where(used, layout.row_pair, 0)
    return used, pair, g_y[pair // layout.pair_row.shape[1]].astype(jnp.float32)


def _weights_grad(dy, used, expert_y, layout):
    """d w[n, k] = sum_h dy[n, h] * expert_y[pair_row[n, k], h] in float32 (dy: _rows_of_pairs' rows);
    0 for pairs with no row."""
    return _of_pairs(jnp.where(used, jnp.sum(dy * expert_y.astype(jnp.float32), axis=1), 0.0), layout)


def _of_pairs(row_values, layout):
    """[N, K]: each pair's value of its row (row_values [num_rows]), 0 for pairs with no row."""
    has = layout.pair_row >= 0
    return jnp.where(has, row_values[jnp.where(has, layout.pair_row, 0)], 0.0)


_reduce_rows.defvjp(_reduce_rows_fwd, _reduce_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_matmul_reduce(matmul_static, num_rows, ops, x, w, w8, group_sizes, valid_sizes, scale, weights, layout):
    """grouped_matmul_reduce on grouped_matmul's prepared arrays (FP8 with its weight gradient)."""
    return _fp8_matmul_reduce_fwd(
        matmul_static, num_rows, ops, x, w, w8, group_sizes, valid_sizes, scale, weights, layout
    )[0]


def _fp8_matmul_reduce_fwd(matmul_static, num_rows, ops, x, w, w8, group_sizes, valid_sizes, scale, weights, layout):
    y, matmul_residuals = grouped_gemm.fp8_forward(*matmul_static, x, w, w8, group_sizes, valid_sizes, scale)
    expert_y = y[:num_rows]
    return ops.reduce_rows(expert_y, weights, layout), (matmul_residuals, expert_y, weights, layout)


def _fp8_matmul_reduce_bwd(matmul_static, num_rows, ops, residuals, g_y):
    matmul_residuals, expert_y, weights, layout = residuals
    used, pair, dy = _rows_of_pairs(g_y, layout)  # read only by the weights' gradient: XLA fuses the gather
    g_weights = _weights_grad(dy, used, expert_y, layout)
    w_row = jnp.where(used, weights.reshape(-1)[pair], 0.0)  # each row's pair weight: its dy is w_row * g_y[n]
    # dx's operand: g_y's FP8 rows gathered, each scaled by its token row's scale times w_row.
    g_data, g_scales = quantize_rows(g_y)
    dy_data, dy_block_scales = ops.expand_rows(
        (g_data, jnp.broadcast_to(g_scales[:, None], (g_y.shape[0], g_y.shape[1] // FP8_BLOCK))), layout
    )
    dy_scales = dy_block_scales[:, 0] * w_row
    # dw's: z = dy * x's row scales quantized per column, i.e. g_y's rows gathered times the multipliers
    # m = w_row * x_scales. A column's amax is max over token rows of |g_y[n]| * (the largest |m| of n's
    # rows): |g * m| = |g| * |m| in float32, so the same value as over the gathered rows, from fewer.
    m = w_row * grouped_gemm.fp8_dw_row_scales(matmul_residuals)[:num_rows]
    token_m = jnp.max(_of_pairs(jnp.abs(m), layout), axis=1)
    z_scales, z_inverse = fp8_quant.column_scales(g_y, token_m)
    z_data_t = ops.expand_rows_transposed(g_y, layout, m, z_inverse)
    (_, x_scales), *_ = matmul_residuals
    extra = x_scales.shape[0] - num_rows  # rows grouped_matmul padded x with (its row multiple)
    if extra:
        dy_data, dy_scales = jnp.pad(dy_data, ((0, extra), (0, 0))), jnp.pad(dy_scales, (0, extra))
        z_data_t = jnp.pad(z_data_t, ((0, 0), (0, extra)))
    use_mgpu, blocks, _ = matmul_static
    dw = grouped_gemm.fp8_weight_grad_of(use_mgpu, blocks, matmul_residuals, z_data_t, z_scales)
    matmul_cotangents = grouped_gemm.fp8_cotangents(*matmul_static, matmul_residuals, dy_data, dy_scales, dw)
    return (*matmul_cotangents, g_weights, jax.tree.map(lambda _: None, layout))


_fp8_matmul_reduce.defvjp(_fp8_matmul_reduce_fwd, _fp8_matmul_reduce_bwd)
