"""tests/conftest.py's rules for `gpu` and `extension` tests, run on an inner
pytest session with that conftest and the host simulated (monkeypatched): on
a host with CUDA GPUs an extension that does not load fails the tests, it
never skips them; only missing hardware skips, and DEEP_EP_JAX_REQUIRE_GPU=1
turns every skip of a `gpu` test into a failure."""

import os

import jax
import pytest

from deep_ep_jax import _native

pytest_plugins = ["pytester"]

CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")
NOT_BUILT = "the extension deep_ep_jax._C is not built (simulated)"

INNER_TESTS = """
import pytest

@pytest.mark.gpu
def test_kernel():
    pass

@pytest.mark.gpu
def test_needs_four_gpus():
    pytest.skip("needs 4 GPUs, found 2")

@pytest.mark.extension
def test_sizes():
    pass
"""


class _FakeGpu:
    platform = "gpu"


def _host(monkeypatch, *, gpus, extension_loads, require=None):
    """Simulates the host: `gpus` CUDA devices, the extension loading or not."""
    real_devices = jax.devices

    def devices(backend=None):
        if backend in ("gpu", "cuda"):
            if not gpus:
                raise RuntimeError("Unknown backend gpu (simulated)")
            return [_FakeGpu() for _ in range(gpus)]
        return real_devices(backend)

    monkeypatch.setattr(jax, "devices", devices)
    monkeypatch.setattr(_native, "load_error", lambda: None if extension_loads else NOT_BUILT)
    monkeypatch.setattr(_native, "unavailable_reason", lambda: None if extension_loads else NOT_BUILT)
    if require is None:
        monkeypatch.delenv("DEEP_EP_JAX_REQUIRE_GPU", raising=False)
    else:
        monkeypatch.setenv("DEEP_EP_JAX_REQUIRE_GPU", require)


def _run(pytester):
    with open(CONFTEST) as f:
        pytester.makeconftest(f.read())
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_inprocess("-rA", "-p", "no:cacheprovider")
    return result, result.parseoutcomes()


def test_gpus_without_the_extension_fail_not_skip(pytester, monkeypatch):
    _host(monkeypatch, gpus=2, extension_loads=False)
    result, outcomes = _run(pytester)
    # Every test fails in setup (pytest counts them as errors), before any could skip itself.
    assert outcomes == {"errors": 3}, result.stdout.str()
    result.stdout.fnmatch_lines(
        ["*ERROR at setup of test_kernel*", "JAX sees 2 CUDA GPU(s) but the CUDA backend cannot run: *not built*"]
    )
    result.stdout.fnmatch_lines(
        ["*ERROR at setup of test_sizes*", "JAX sees 2 CUDA GPU(s) but the extension does not load: *not built*"]
    )
    assert result.ret != 0


def test_no_gpu_skips_with_the_reason(pytester, monkeypatch):
    _host(monkeypatch, gpus=0, extension_loads=False)
    result, outcomes = _run(pytester)
    assert outcomes == {"skipped": 3}, result.stdout.str()
    result.stdout.fnmatch_lines(["*SKIPPED*no CUDA GPU visible to JAX*"])
    assert result.ret == 0


def test_too_few_gpus_skip_saying_so(pytester, monkeypatch):
    _host(monkeypatch, gpus=1, extension_loads=True)
    result, outcomes = _run(pytester)
    assert outcomes == {"passed": 1, "skipped": 2}, result.stdout.str()  # test_sizes runs: it needs no GPU
    result.stdout.fnmatch_lines(["*SKIPPED*needs at least 2 GPUs, found 1*"])


def test_enough_gpus_run(pytester, monkeypatch):
    _host(monkeypatch, gpus=2, extension_loads=True)
    result, outcomes = _run(pytester)
    assert outcomes == {"passed": 2, "skipped": 1}, result.stdout.str()


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_require_gpu_turns_every_gpu_skip_into_a_failure(pytester, monkeypatch, gpus):
    _host(monkeypatch, gpus=gpus, extension_loads=True, require="1")
    result, outcomes = _run(pytester)
    assert outcomes.get("skipped", 0) == 0, result.stdout.str()
    if gpus == 2:  # the skip inside the test fails
        assert outcomes == {"passed": 2, "failed": 1}, result.stdout.str()
        result.stdout.fnmatch_lines(["*DEEP_EP_JAX_REQUIRE_GPU=1: a gpu test must not skip*needs 4 GPUs, found 2*"])
    else:  # the missing hardware fails every gpu test
        assert outcomes.get("errors", 0) + outcomes.get("failed", 0) == 2, result.stdout.str()
        result.stdout.fnmatch_lines(["*DEEP_EP_JAX_REQUIRE_GPU=1 but*"])
    assert result.ret != 0


def test_device_run_requires_gpus():
    script = os.path.join(os.path.dirname(os.path.dirname(CONFTEST)), "scripts", "device_run.sh")
    with open(script) as f:
        assert "export DEEP_EP_JAX_REQUIRE_GPU=1" in f.read()
