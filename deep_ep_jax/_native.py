"""Access to the CUDA extension `deep_ep_jax._C`, loaded lazily.

Importing this module does not import the extension; nothing here fails on a
machine without CUDA: `load_error()` says why the extension cannot be
imported, `unavailable_reason()` why the CUDA backend cannot run (None when
it can).
"""

from __future__ import annotations

import functools
import importlib

BUILD_HINT = (
    "build it with a CUDA toolkit (nvcc) visible, or with NVIDIA's CUDA 13 pip wheels installed first "
    '(`pip install -e ".[cuda]"`): `pip install -e ".[test]"` '
    "(or offline: `pip install --no-build-isolation --no-deps -e .`, or `python setup.py build_ext --inplace`)"
)


@functools.cache
def _load():
    """(module, None) or (None, why it could not be imported)."""
    try:
        return importlib.import_module("deep_ep_jax._C"), None
    except ImportError as e:
        return None, f"the extension deep_ep_jax._C is not built ({e}); {BUILD_HINT}"


def load_error() -> str | None:
    """Why `deep_ep_jax._C` cannot be imported (and how to build it), or None."""
    return _load()[1]


def extension():
    """The `deep_ep_jax._C` module; raises ImportError saying how to build it."""
    module, reason = _load()
    if module is None:
        raise ImportError(reason)
    return module


@functools.cache
def limits() -> dict:
    """The CUDA kernels' limits, `_C.limits()`: "max_group_ranks" (low-latency
    mode), "max_nvlink_ranks", "max_internode_host_ranks" and
    "max_internode_normal_ranks" (normal mode),
    "control_bytes", "fp8_block", "max_blocks", ... (needs the extension)."""
    return dict(extension().limits())


def _arch_matches(compiled: list[str], compute_capability: str) -> bool:
    """Whether code compiled for `compiled` (e.g. ["sm_80", "sm_90", "compute_120"]) runs on a GPU
    of compute capability "8.6": SASS of its major version and an equal or lower minor one (an
    "a" variant, e.g. sm_90a, only on that very GPU), or PTX of an older or equal architecture."""
    major, minor = (int(n) for n in compute_capability.split(".")[:2])
    for arch in compiled:
        kind, _, number = arch.partition("_")
        specific = number.endswith("a")
        number = number.rstrip("af")
        if not number.isdigit():
            continue
        arch_major, arch_minor = divmod(int(number), 10)
        if kind == "compute" and (arch_major, arch_minor) <= (major, minor):
            return True
        if kind == "sm" and arch_major == major and (arch_minor == minor or not specific and arch_minor < minor):
            return True
    return False


def _machine_code(compiled: list[str]) -> list[str]:
    """The architectures of `compiled` with machine code (sm_*): all that the device-linked (-rdc)
    NVSHMEM kernels carry, since device linking keeps no PTX."""
    return [arch for arch in compiled if arch.startswith("sm_")]


@functools.cache
def unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here, or None if it can."""
    module, reason = _load()
    if module is None:
        return reason
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        return f"no CUDA devices are visible to JAX (devices: {sorted({d.platform for d in jax.devices()})})"
    compiled = module.cuda_archs()
    for device in gpus:
        capability = getattr(device, "compute_capability", None)
        if capability and not _arch_matches(compiled, capability):
            return (
                f"deep_ep_jax._C was compiled for {compiled}, which does not run on {device.device_kind} "
                f"(compute capability {capability}); rebuild with DEEP_EP_JAX_CUDA_ARCHS="
                f"{capability.replace('.', '')}"
            )
    return None


def build_summary() -> str:
    """One line: what was built, for CI logs."""
    module, reason = _load()
    if module is None:
        return f"deep_ep_jax._C: not built ({reason})"
    targets = sorted(module.ffi_targets())
    return (
        f"deep_ep_jax._C: built for {','.join(module.cuda_archs())} with CUDA "
        f"{module.device_info()['cuda_version_compiled']}, {len(targets)} FFI targets ({', '.join(targets)})"
    )
