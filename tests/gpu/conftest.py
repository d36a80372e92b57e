"""Fixtures the GPU suites share: the mesh of every GPU over axis "ep", and a
CUDA Buffer beside an xla one on it (freed when the module is done). A module
that needs another mesh or Buffer defines its own fixture of the same name."""

import jax
import pytest

import deep_ep_jax
from deep_ep_jax import testing

AXIS = "ep"


@pytest.fixture(scope="module")
def mesh():
    return testing.ep_mesh(len(jax.devices("gpu")), AXIS, platform="gpu")


@pytest.fixture(scope="module")
def buffers(mesh):
    """(cuda, xla) Buffers of `mesh`, sized by their defaults."""
    with deep_ep_jax.Buffer(mesh, AXIS, backend="cuda") as cuda:
        yield cuda, deep_ep_jax.Buffer(mesh, AXIS, backend="xla")
