"""Which device is which rank, and the check that a program agrees.

A device's rank is its place along the EP axis of the Buffer's mesh: the CUDA
backend finds a device's peers by it, when the Buffer is made. Inside a
shard_map, `axis_index` is the device's place in the shard_map's mesh. The
two must agree, or tokens reach other ranks' experts; JAX shows the body only
the abstract mesh, so the check runs when the program is lowered.
"""

from __future__ import annotations

import jax
from jax._src import core
from jax.interpreters import ad, batching, mlir

from deep_ep_jax.distributed.multiprocess import device_grid


def ep_groups(mesh, axis_name) -> tuple:
    """The mesh's EP groups, each its device ids in rank order; the groups
    sorted, since no backend cares where a group sits along the other axes."""
    return tuple(sorted(tuple(int(d.id) for d in row) for row in device_grid(mesh, axis_name)))


# An identity whose lowering makes the check: on the data path of every call
# that exchanges rows, it cannot be dropped as unused.
_same_mesh_p = core.Primitive("deep_ep_jax_same_mesh")
_same_mesh_p.def_abstract_eval(lambda x, **_: x)
_same_mesh_p.def_impl(lambda x, **_: x)  # eager: outside shard_map, where no other mesh can be
ad.primitive_jvps[_same_mesh_p] = lambda primals, tangents, **params: (
    _same_mesh_p.bind(*primals, **params),
    tangents[0],
)
batching.primitive_batchers[_same_mesh_p] = lambda args, dims, **params: (_same_mesh_p.bind(*args, **params), dims[0])


def _same_mesh_lowering(ctx, x, *, fn, axis_name, groups):
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)  # concrete when JAX knows the devices
    if isinstance(mesh, jax.sharding.Mesh) and axis_name in mesh.axis_names:
        here = ep_groups(mesh, axis_name)
        if here != groups:
            theirs, ours = next((a, b) for a, b in zip(here, groups) if a != b)
            raise ValueError(
                f"{fn}: the shard_map's mesh orders the devices otherwise than the Buffer's mesh: an EP group "
                f"(device ids in rank order along {axis_name!r}) is {list(theirs)} there, {list(ours)} in the "
                f"Buffer's. A device's rank is its place in the Buffer's mesh (the CUDA kernels find their peers "
                f"by it), its axis_index its place in the shard_map's: tokens would reach other ranks' experts. "
                f"Make the Buffer on the mesh the shard_map uses"
            )
    return [x]


mlir.register_lowering(_same_mesh_p, _same_mesh_lowering)


def same_mesh(x, buffer, fn: str):
    """x, checked when lowered: the program's mesh puts every device in the same
    EP group at the same rank as the Buffer's mesh (docs/design.md section 1)."""
    return _same_mesh_p.bind(x, fn=fn, axis_name=buffer.axis_name, groups=buffer.ep_groups)
