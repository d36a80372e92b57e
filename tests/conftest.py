"""Test setup: 8 virtual CPU devices for the CPU suite; GPU tests marked.

CPU tests build their meshes from jax.devices("cpu"), so they run the same on
a GPU host. Tests marked `gpu` need 2 CUDA GPUs and the built extension;
tests marked `extension` need only the extension (its sizes and limits, on
CPU).

A GPU test never passes by skipping where it could run: on a host where JAX
sees CUDA GPUs, an extension that does not load (or does not run there) fails
every `gpu` and `extension` test with the reason. They are skipped, with the
reason, only where the hardware lacks what they need: no CUDA GPU (CI's CPU
machines), or fewer GPUs than the test needs. With DEEP_EP_JAX_REQUIRE_GPU=1
(scripts/device_run.sh sets it) every skip of a `gpu` test is a failure, so a
device run cannot be green by skipping. DEEP_EP_JAX_ONLY_TESTS_THAT_FIT=1
deselects the gpu tests that need more GPUs than the host has (the summary
counts them), so one command runs all that a one-GPU host can.

Random inputs come from the `rng` fixture: a fresh seed each run, printed, so
that a failure's report says how to make its inputs again.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

REQUIRE_GPU_ENV = "DEEP_EP_JAX_REQUIRE_GPU"
MIN_GPUS = 2


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs and the built extension")
    config.addinivalue_line("markers", "extension: needs the built extension deep_ep_jax._C (no GPU)")


def gpu_required() -> bool:
    return os.environ.get(REQUIRE_GPU_ENV, "").strip() not in ("", "0")


def cuda_gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no CUDA plugin, or no device
        return []


def verdict(marker, min_gpus=MIN_GPUS):
    """What to do with a test marked `marker` ("gpu" or "extension") here:
    (None, None) to run it, ("skip", why) or ("fail", why). A gpu test needs
    `min_gpus` GPUs (`@pytest.mark.gpu(min_gpus=1)`; default MIN_GPUS)."""
    from deep_ep_jax import _native

    if marker == "extension":
        reason = _native.load_error()
        if reason is None:
            return None, None
        gpus = cuda_gpus()
        if gpus or gpu_required():
            return "fail", f"JAX sees {len(gpus)} CUDA GPU(s) but the extension does not load: {reason}"
        return "skip", reason
    gpus = cuda_gpus()
    if not gpus:
        why = f"no CUDA GPU visible to JAX (devices: {sorted({d.platform for d in jax.devices()})})"
        return ("fail", f"{REQUIRE_GPU_ENV}=1 but {why}") if gpu_required() else ("skip", why)
    reason = _native.unavailable_reason()
    if reason:
        return "fail", f"JAX sees {len(gpus)} CUDA GPU(s) but the CUDA backend cannot run: {reason}"
    if len(gpus) < min_gpus:
        why = f"needs at least {min_gpus} GPUs, found {len(gpus)}"
        return ("fail", f"{REQUIRE_GPU_ENV}=1 but it {why}") if gpu_required() else ("skip", why)
    return None, None


def pytest_runtest_setup(item):
    for marker in ("gpu", "extension"):
        mark = item.get_closest_marker(marker)
        if mark:
            action, why = verdict(marker, mark.kwargs.get("min_gpus", MIN_GPUS))
            if action == "fail":
                pytest.fail(why, pytrace=False)
            if action == "skip":
                pytest.skip(why)


FIT_ENV = "DEEP_EP_JAX_ONLY_TESTS_THAT_FIT"


def pytest_collection_modifyitems(config, items):
    """With DEEP_EP_JAX_ONLY_TESTS_THAT_FIT=1, `gpu` tests that need more GPUs
    than JAX sees are deselected (counted in the summary, never passed), so a
    one-GPU host runs every test it can in one command."""
    if os.environ.get(FIT_ENV, "").strip() in ("", "0"):
        return
    have = len(cuda_gpus())
    too_big = [
        i
        for i in items
        if i.get_closest_marker("gpu") and i.get_closest_marker("gpu").kwargs.get("min_gpus", MIN_GPUS) > have
    ]
    if too_big:
        config.hook.pytest_deselected(items=too_big)
        items[:] = [i for i in items if i not in too_big]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With DEEP_EP_JAX_REQUIRE_GPU=1, a `gpu` test that skips itself fails."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and gpu_required() and item.get_closest_marker("gpu") and not hasattr(report, "wasxfail"):
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_GPU_ENV}=1: a gpu test must not skip, but this one did: {why}"


SEED_ENV = "DEEP_EP_JAX_TEST_SEED"


@pytest.fixture
def rng():
    """A numpy Generator on a fresh seed each run (fresh inputs), or on $DEEP_EP_JAX_TEST_SEED. The seed is
    printed, so a failure's report shows it and the same inputs can be made again."""
    seed = int(os.environ.get(SEED_ENV) or np.random.SeedSequence().entropy % (1 << 63))
    print(f"rng seed {seed} (the same inputs again: {SEED_ENV}={seed})")
    return np.random.default_rng(seed)
