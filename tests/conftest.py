"""Test setup: 8 virtual CPU devices for the CPU suite; GPU tests marked.

CPU tests build their meshes from jax.devices("cpu"), so they run the same on
a GPU host. Tests marked `gpu` need CUDA GPUs and the built extension; tests
marked `extension` need only the extension (its sizes and limits, on CPU).
Both are skipped elsewhere with the reason.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs and the built extension")
    config.addinivalue_line("markers", "extension: needs the built extension deep_ep_jax._C (no GPU)")


def _gpu_skip_reason():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return "no CUDA GPU visible to JAX"
    if len(gpus) < 2:
        return f"needs at least 2 GPUs, found {len(gpus)}"
    from deep_ep_jax import _native

    return _native.unavailable_reason()


def pytest_collection_modifyitems(config, items):
    from deep_ep_jax import _native

    reason = _native.load_error()
    if reason:
        for item in items:
            if item.get_closest_marker("extension"):
                item.add_marker(pytest.mark.skip(reason=reason))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = _gpu_skip_reason()
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
