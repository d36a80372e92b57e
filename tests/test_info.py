"""`python -m deep_ep_jax.info` on CPU: it runs, and says plainly that JAX
sees no GPU instead of leaving a CUDA driver error to be read."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_info_on_cpu_says_there_is_no_gpu():
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(path))
    result = subprocess.run(
        [sys.executable, "-m", "deep_ep_jax.info"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "No GPU here: JAX sees no CUDA device" in out, out
    assert "EP groups across hosts: need GPUs (none here)" in out, out
    assert 'Buffer(backend="auto") -> "xla"' in out, out
    assert "== buffer sizes for the standard cases" in out, out
    assert "== configuration" in out and "timeout_s=20.0" in out, out


def test_info_reports_the_configuration(monkeypatch, capsys):
    """The variables set, the Config they give, or why Config() (and so every Buffer) fails."""
    from deep_ep_jax import info

    monkeypatch.setenv("DEEP_EP_JAX_TIMEOUT_S", "0")
    monkeypatch.setenv("DEEP_EP_JAX_NVLINK_DOMAIN", "rack0")
    info.print_configuration()
    out = capsys.readouterr().out
    assert "DEEP_EP_JAX_NVLINK_DOMAIN=rack0" in out and "in place of NVML's fabric info" in out, out
    assert "Config() FAILS here" in out and "from DEEP_EP_JAX_TIMEOUT_S='0'" in out, out
    monkeypatch.setenv("DEEP_EP_JAX_TIMEOUT_S", "3")
    info.print_configuration()
    assert "timeout_s=3.0" in capsys.readouterr().out


def test_info_survives_a_platform_that_fails_to_start(monkeypatch, capsys):
    """JAX_PLATFORMS=cuda without a GPU makes jax.devices() raise (an AssertionError in some jax
    versions): the report says so and goes on."""
    import jax

    from deep_ep_jax import _native, info

    def fail(*args):
        raise AssertionError("no cuda platform")

    monkeypatch.setattr(jax, "devices", fail)
    monkeypatch.setattr(_native, "unavailable_reason", _native.unavailable_reason.__wrapped__)  # not its cache
    info.main([])
    out = capsys.readouterr().out
    assert "none: AssertionError: no cuda platform" in out, out
    assert 'Buffer(backend="auto") -> "xla" (JAX failed to start its platform: AssertionError' in out, out


def test_info_help_and_unknown_options():
    """--help prints what the command does (not the report); an unknown option is an error."""
    run = [sys.executable, "-m", "deep_ep_jax.info"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    result = subprocess.run(run + ["--help"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and "usage: python -m deep_ep_jax.info" in result.stdout, result.stdout
    assert "== versions" not in result.stdout
    result = subprocess.run(run + ["--no-such-option"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2 and "unrecognized arguments: --no-such-option" in result.stderr, result.stderr


def test_which_gpus_a_build_covers():
    """SASS runs on its major version at an equal or higher minor one (an "a" variant on its own
    GPU only); PTX on any newer GPU: the default build (sm_80, 90, 100, 120 + PTX) covers A10 to B200."""
    from deep_ep_jax._native import _arch_matches

    default = ["sm_80", "sm_90", "sm_100", "sm_120", "compute_120"]
    for capability in ("8.0", "8.6", "8.9", "9.0", "10.0", "10.3", "12.0", "12.1", "13.0"):
        assert _arch_matches(default, capability), capability
    assert not _arch_matches(default, "7.5")
    assert _arch_matches(["sm_90a"], "9.0") and not _arch_matches(["sm_90a"], "9.1")
    assert not _arch_matches(["sm_90"], "10.0") and not _arch_matches(["sm_86"], "8.0")
    assert _arch_matches(["compute_80"], "9.0") and not _arch_matches(["compute_90"], "8.0")


def test_info_says_ptx_does_not_reach_the_nvshmem_kernels():
    """An sm_80+PTX build on an H100: the kernels JIT from PTX, the device-linked NVSHMEM ones cannot."""
    import types

    from deep_ep_jax import info

    def build(archs, with_nvshmem=True):
        return types.SimpleNamespace(cuda_archs=lambda: archs, with_nvshmem=with_nvshmem)

    ampere = build(["sm_80", "compute_80"])
    assert info._coverage(ampere, "9.0") == (
        "covered by this build's PTX, but not its NVSHMEM kernels (machine code only)"
    )
    assert info._coverage(build(["sm_80", "compute_80"], with_nvshmem=False), "9.0") == "covered by this build"
    assert info._coverage(ampere, "8.0") == "covered by this build"
    assert info._coverage(build(["sm_90"]), "8.0").startswith("NOT covered")
