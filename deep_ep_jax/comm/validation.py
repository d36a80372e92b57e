"""Argument checks shared by the public functions, and the run-time checks
of `Config(checks=True)`.

Every error names the function, the argument, what was expected and what was
given, so a user can fix the call without reading our code.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from deep_ep_jax.config import PAIR_HIDDEN_MULTIPLE, ROW_FORMATS, is_bool, is_int, row_format

# Types of the public API. Rows: bf16 [T, H], or a pair (data, scales) of
# config.ROW_FORMATS (DeepEP's FP8: float8_e4m3fn [T, H], float32 [T, H // 128]).
Rows = jax.Array | tuple[jax.Array, jax.Array]
# What a low-latency send half returns for its receive half (backend-specific).
Pending = Any


INT32_MAX = 2**31 - 1


def check_int(fn, name, value, low, high=INT32_MAX) -> int:
    """value an int (not a bool) in [low, high]; returns it as a Python int."""
    if not is_int(value) or not low <= value <= high:
        raise ValueError(f"{fn}: {name} must be an int in [{low}, {high}], got {value!r}")
    return int(value)


def check_bool(fn, name, value) -> bool:
    """value a bool (a string such as "false" would count as true)."""
    if not is_bool(value):
        raise TypeError(f"{fn}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_backend(fn, backend, choices, impl=None, aliases=None) -> str:
    """`backend`, the one word for choosing an implementation, checked against choices. impl: the
    old name of the argument (a DeprecationWarning, then taken as backend); aliases: old values
    and the new ones they stand for."""
    if impl is not None:
        warnings.warn(f"{fn}: impl= is now backend=", DeprecationWarning, stacklevel=3)
        backend = impl
    backend = (aliases or {}).get(backend, backend)
    if backend not in choices:
        raise ValueError(f"{fn}: backend must be one of {choices}, got {backend!r}")
    return backend


def check_buffer(buffer, fn):
    from deep_ep_jax.comm.buffer import Buffer

    if not isinstance(buffer, Buffer):
        raise TypeError(f"{fn}: buffer must be a deep_ep_jax.Buffer, got {type(buffer).__name__}")
    buffer.check_alive(fn)
    try:
        size = jax.lax.axis_size(buffer.axis_name)
    except NameError:
        raise ValueError(
            f"{fn}: must be called inside jax.shard_map over the buffer's axis {buffer.axis_name!r} "
            f"(the axis is not bound here)"
        ) from None
    if size != buffer.num_ranks:
        raise ValueError(
            f"{fn}: axis {buffer.axis_name!r} has size {size} here but the buffer was made for "
            f"{buffer.num_ranks} ranks (a buffer of another mesh?)"
        )
    # The CUDA backend finds each device's rank in the buffer's mesh: a mesh of other axes here would
    # give ranks and EP groups other than the program's (or devices the buffer lacks).
    here = jax.sharding.get_abstract_mesh()
    made = dict(buffer.mesh.shape)
    if not here.empty and dict(here.shape) != made:
        raise ValueError(
            f"{fn}: the shard_map here is over a mesh of axes {dict(here.shape)}, but the buffer was "
            f"made on one of axes {made}; make the Buffer on the mesh its shard_map uses"
        )
    # Each device runs the kernels as its own rank: axes left to the compiler (shard_map's axis_names)
    # would let it place the work of one call on other devices.
    manual = set(getattr(here, "manual_axes", here.axis_names))
    if not here.empty and manual != set(here.axis_names):
        raise ValueError(
            f"{fn}: the shard_map here is manual over {sorted(manual)} of the mesh's axes "
            f"{list(here.axis_names)}; deep_ep_jax needs every axis manual (leave out shard_map's "
            f"axis_names)"
        )


def check_num_experts(num_experts, buffer, fn):
    if not is_int(num_experts) or num_experts <= 0:
        raise ValueError(f"{fn}: num_experts must be a positive int, got {num_experts!r}")
    if num_experts % buffer.num_ranks:
        raise ValueError(
            f"{fn}: num_experts ({num_experts}) must be divisible by the size of axis "
            f"{buffer.axis_name!r} ({buffer.num_ranks})"
        )
    if buffer.num_experts is not None and num_experts != buffer.num_experts:
        raise ValueError(f"{fn}: num_experts is {num_experts} but the buffer was made for {buffer.num_experts}")


def shape_dtype(a, fn, name):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{fn}: {name} must be an array, got {type(a).__name__}")
    return tuple(a.shape), jnp.dtype(a.dtype)


def check_tokens(x, buffer, fn, *, allow_fp8=True, name="x", formats=ROW_FORMATS[:1]):
    """x (the argument `name`) is bf16 [T, H], or (where allow_fp8) a pair
    (data, scales) of one of `formats` (config.ROW_FORMATS). Returns (rows as
    a tuple, T, H). buffer may be None (no hidden size to check against).

    The same rule on every backend, so that a model prototyped on the xla
    backend (CPU) runs unchanged on the kernels."""
    if isinstance(x, (tuple, list)):
        if not allow_fp8:
            raise TypeError(f"{fn}: {name} must be one array here, not a pair")
        if len(x) != 2:
            raise ValueError(
                f"{fn}: {name} must be a bfloat16 array or a quantized pair (data, scales), got a "
                f"{type(x).__name__} of {len(x)} items"
            )
        (shape, dtype), (sshape, sdtype) = shape_dtype(x[0], fn, f"{name}[0]"), shape_dtype(x[1], fn, f"{name}[1]")
        fmt = row_format(dtype, sdtype)
        if fmt is not None and fmt not in formats:
            raise TypeError(
                f"{fn}: {name} is an {fmt.name} pair; here it must be bfloat16 or a pair of {_formats_text(formats)} "
                f"(dequantize it first: deep_ep_jax.dequantize)"
            )
        if fmt is None:
            same_data = [f for f in formats if f.data == dtype]
            if not same_data:
                raise TypeError(f"{fn}: {name} must be a pair of {_formats_text(formats)}, got ({dtype}, {sdtype})")
            fmt = same_data[0]  # the scales' check below says what they must be
        kind = fmt.name
        if len(shape) != 2:
            raise ValueError(f"{fn}: {kind} data {name}[0] must be [tokens, hidden], got shape {shape}")
        hidden = shape[1] * fmt.pack
        if hidden % PAIR_HIDDEN_MULTIPLE:
            raise ValueError(f"{fn}: {kind} hidden must be a multiple of {PAIR_HIDDEN_MULTIPLE}, got {hidden}")
        want = (shape[0], hidden // fmt.block)
        if sdtype != fmt.scales or sshape != want:
            raise TypeError(f"{fn}: {kind} scales {name}[1] must be {fmt.scales} {want}, got {sdtype} {sshape}")
        xs = tuple(x)
    else:
        shape, dtype = shape_dtype(x, fn, name)
        if dtype != jnp.bfloat16:
            pair = f" or a pair of {_formats_text(formats)}"
            quantized = allow_fp8 and any(f.data == dtype for f in formats)
            hint = "pass it with its scales, as a pair" if quantized else f"cast with {name}.astype(jnp.bfloat16)"
            raise TypeError(
                f"{fn}: {name} must be bfloat16{pair if allow_fp8 else ''}, got {dtype} "
                f"({hint}; every backend takes the same dtypes)"
            )
        if len(shape) != 2:
            raise ValueError(f"{fn}: {name} must be [tokens, hidden], got shape {shape}")
        xs = (x,)
        hidden = shape[1]
    num_tokens = shape[0]
    if getattr(buffer, "hidden", None) is not None and hidden != buffer.hidden:
        raise ValueError(f"{fn}: {name} has hidden {hidden} but the buffer was made for hidden {buffer.hidden}")
    return xs, num_tokens, hidden


def _formats_text(formats):
    """'FP8 (float8_e4m3fn [tokens, hidden], float32 [tokens, hidden // 128]), ...'"""
    return ", ".join(
        f"{f.name} ({f.data} [tokens, hidden{f' // {f.pack}' if f.pack > 1 else ''}], "
        f"{f.scales} [tokens, hidden // {f.block}])"
        for f in formats
    )


def check_topk(topk_idx, topk_weights, num_tokens, num_experts, fn, *, weights="required"):
    """Returns K. num_tokens None: topk_idx's own. weights: "required",
    "optional" (None allowed, else checked) or "none" (the function takes none)."""
    shape, dtype = shape_dtype(topk_idx, fn, "topk_idx")
    if dtype != jnp.int32:
        raise TypeError(f"{fn}: topk_idx must be int32, got {dtype}")
    if len(shape) != 2 or num_tokens is not None and shape[0] != num_tokens:
        raise ValueError(
            f"{fn}: topk_idx must be [{'tokens' if num_tokens is None else num_tokens}, topk], got shape {shape}"
        )
    topk = shape[1]
    if not 1 <= topk <= num_experts:
        raise ValueError(f"{fn}: topk must be in [1, num_experts={num_experts}], got {topk}")
    if weights == "required" and topk_weights is None:
        raise TypeError(f"{fn}: topk_weights is required: float32 {list(shape)}, topk_idx's shape")
    if weights != "none" and topk_weights is not None:
        wshape, wdtype = shape_dtype(topk_weights, fn, "topk_weights")
        if wdtype != jnp.float32:
            raise TypeError(f"{fn}: topk_weights must be float32, got {wdtype}")
        if wshape != shape:
            raise ValueError(f"{fn}: topk_weights must have topk_idx's shape {shape}, got {wshape}")
    return topk


def sanitize_topk_idx(topk_idx, num_experts):
    """Expert ids outside [0, num_experts) become -1, so they can never cause
    an out-of-bounds write. Returns (clean ids, whether any were bad)."""
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    return jnp.where(bad, -1, topk_idx), bad.any()


class CheckError(ValueError):
    """`Config(checks=True)` found bad data at run time: expert ids outside
    [-1, num_experts), rows dropped (past `num_worst_tokens`, or past a
    low-latency expert's rows), or a low-latency combine's topk_idx other
    than its dispatch's."""


# Run-time failures wait here while a `checked` call runs, to be raised by it
# once, cleanly, in the caller's thread; otherwise the callback raises itself.
_lock = threading.Lock()
_num_checked_calls = 0
_failures: list[str] = []
_raised_outside_checked = False


class _DropCheckErrorLogs(logging.Filter):
    """JAX logs a traceback per rank for an exception raised in a callback;
    a CheckError's message already says everything."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], CheckError))


logging.getLogger("jax._src.callback").addFilter(_DropCheckErrorLogs())  # io_callback's


@atexit.register  # after JAX's own handlers at import, so it runs before them
def _forget_failed_checks():
    """At exit, JAX waits again on the tokens of every program with a host
    callback and prints a failed one's error twice more; after a CheckError
    already raised, forget them (JAX internals: skipped if they change)."""
    if _raised_outside_checked:
        try:
            from jax._src import dispatch

            dispatch.runtime_tokens.clear()
        except Exception:
            pass


def raise_if_any(buffer, failures, outputs):
    """Check mode: report on the host when any rank saw a failure; returns
    `outputs` (any pytree), made to wait for the report.

    failures: [(traced bool, message)]. The flags are summed over the axis so
    that every rank (every process) sees the same failures, and the outputs
    wait for the report, so that each rank stops there, before any collective
    that uses them: no rank is left waiting for a peer that stopped. Under
    `checked` the failures are recorded and raised by it; otherwise the
    callback raises, and the program fails with a JaxRuntimeError whose last
    line is the CheckError.
    """
    flags = jax.lax.psum(jnp.stack([f.astype(jnp.int32) for f, _ in failures]), buffer.axis_name)
    messages = [m for _, m in failures]
    num_ranks = buffer.num_ranks

    def _report(flags):
        bad = [f"{m} (on {int(n)} of {num_ranks} ranks)" for m, n in zip(messages, flags) if n]
        if bad:
            global _raised_outside_checked
            with _lock:
                if not _num_checked_calls:
                    _raised_outside_checked = True
                    raise CheckError("; ".join(bad))
                _failures.extend(b for b in bad if b not in _failures)  # every rank reports the same
        return np.int32(0)

    reported = io_callback(_report, jax.ShapeDtypeStruct((), jnp.int32), flags, ordered=False)
    return jax.lax.optimization_barrier((outputs, reported))[0]


F = TypeVar("F", bound=Callable[..., Any])


def checked(fn: F) -> F:
    """Wraps fn (a jitted step, say) so that the run-time checks of
    `Config(checks=True)` raise one `CheckError` naming the problem, from this
    call, after fn's results are ready (rather than a JaxRuntimeError from
    wherever the results are next used).

        step = deep_ep_jax.checked(jax.jit(step))
        step(params, batch)   # CheckError: dispatch: topk_idx holds expert ids outside [-1, 256) (on 1 of 8 ranks)

    Waits for fn's results (block_until_ready): a debugging aid, like checks.
    """

    @functools.wraps(fn)
    def run(*args, **kwargs):
        global _num_checked_calls
        with _lock:
            _num_checked_calls += 1
        try:
            out = jax.block_until_ready(fn(*args, **kwargs))
            jax.effects_barrier()  # every check's callback has run
        finally:
            with _lock:
                _num_checked_calls -= 1
                found = list(_failures)
                _failures.clear()
        if found:
            raise CheckError("; ".join(found))
        return out

    return run  # type: ignore[return-value]
