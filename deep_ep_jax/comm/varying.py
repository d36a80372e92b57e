"""Which shard_map axes an array varies over (its vma), and marking arrays varying: the outputs of a
custom call or a custom_vjp's cotangents must be typed as their inputs and primals under check_vma."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def vma(a) -> set:
    """The shard_map axes `a` varies over (none outside shard_map)."""
    aval = jax.typeof(a)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; before, aval.vma
    return set(mat.varying) if mat is not None else set(getattr(aval, "vma", ()))


def vary_over(a, axes):
    """a marked varying over `axes`, as far as it is not yet."""
    missing = tuple(sorted(set(axes) - vma(a)))
    return lax.pcast(a, missing, to="varying") if missing else a


def zero_rows_like(num_rows, like):
    """Zeros [num_rows, like's other dims] of like's dtype, varying as `like` (a custom_vjp's zero
    cotangent for a primal typed as `like`, which may have no rows: `x[:0]` keeps x's type at no cost)."""
    return vary_over(jnp.zeros((num_rows,) + like.shape[1:], like.dtype), vma(like))


def vary_together(*arrays):
    """arrays, each marked varying over every shard_map axis any of them varies over."""
    axes = set().union(*(vma(a) for a in arrays))
    return tuple(vary_over(a, axes) for a in arrays)


def shape_like(shape, dtype, like):
    """jax.ShapeDtypeStruct(shape, dtype) varying as `like` (a Pallas call's output under check_vma)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def varying_like(outputs, inputs, axis_name):
    """A custom call's outputs typed as varying over the EP axis (when manual
    here) and every axis an input varies over, as shard_map's check_vma=True
    expects (XLA's FFI call leaves its results unvarying): they differ per rank."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)  # empty outside shard_map
    axes = set().union(*(vma(x) for x in inputs)) | (manual & {axis_name})
    return [vary_over(out, axes) for out in outputs]
