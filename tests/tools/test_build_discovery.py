"""Where build_tools/discover.py finds nvcc: CUDA_HOME, then /usr/local/cuda,
then PATH, then NVIDIA's CUDA 13 pip wheels (site-packages/nvidia/cu13), on
fake layouts in a temporary directory. .ci/pip_cuda_check.sh compiles the
extension with the real wheels."""

import os
import sys
import sysconfig

import pytest

from build_tools import discover

SYSTEM_NVCC = "/usr/local/cuda/bin/nvcc"


def _touch(path, executable=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    if executable:
        path.chmod(0o755)


def _fake_wheels(site, leave_out=()):
    """site/nvidia/cu13 as the wheels install it, without the files of the wheels in leave_out."""
    root = site / "nvidia" / "cu13"
    _touch(root / "bin" / "nvcc", executable=True)
    for path, wheel in discover.CUDA_WHEEL_FILES.items():
        if wheel not in leave_out:
            _touch(root / path)
    return root


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site-packages that is this Python's (sysconfig) but not on sys.path,
    as the target environment is in pip's isolated build; no CUDA_HOME."""
    site = tmp_path / "site-packages"
    site.mkdir()
    paths = dict(sysconfig.get_paths(), purelib=str(site), platlib=str(site))
    monkeypatch.setattr(discover.sysconfig, "get_paths", lambda: paths)
    monkeypatch.setitem(sys.modules, "nvidia", None)  # `import nvidia` fails: only site counts
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    return site


def test_wheels_when_no_system_cuda(site, monkeypatch):
    monkeypatch.setenv("DEEP_EP_JAX_NO_SYSTEM_CUDA", "1")
    assert discover.find_nvcc() is None
    root = _fake_wheels(site)
    assert discover.find_nvcc() == (str(root / "bin" / "nvcc"), "the nvidia-cuda-nvcc wheel")
    assert discover.nvcc() == str(root / "bin" / "nvcc")


def test_cuda_home_comes_first(site, tmp_path, monkeypatch):
    _fake_wheels(site)
    home = tmp_path / "toolkit"
    _touch(home / "bin" / "nvcc", executable=True)
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert discover.find_nvcc() == (str(home / "bin" / "nvcc"), "CUDA_HOME")
    monkeypatch.setenv("DEEP_EP_JAX_NO_SYSTEM_CUDA", "1")  # skips system toolkits, not CUDA_HOME
    assert discover.find_nvcc() == (str(home / "bin" / "nvcc"), "CUDA_HOME")


def test_system_toolkits_before_wheels(site, tmp_path, monkeypatch):
    _fake_wheels(site)
    on_path = tmp_path / "bin" / "nvcc"
    _touch(on_path, executable=True)
    monkeypatch.setenv("PATH", str(on_path.parent))
    if os.access(SYSTEM_NVCC, os.X_OK):
        assert discover.find_nvcc() == (SYSTEM_NVCC, "/usr/local/cuda")
    else:
        assert discover.find_nvcc() == (str(on_path), "PATH")
    monkeypatch.setenv("DEEP_EP_JAX_NO_SYSTEM_CUDA", "1")
    assert discover.find_nvcc()[1] == "the nvidia-cuda-nvcc wheel"


@pytest.mark.parametrize("wheel", sorted(set(discover.CUDA_WHEEL_FILES.values())))
def test_wheel_nvcc_without_a_companion_wheel_says_which(site, monkeypatch, wheel):
    monkeypatch.setenv("DEEP_EP_JAX_NO_SYSTEM_CUDA", "1")
    _fake_wheels(site, leave_out=(wheel,))
    with pytest.raises(discover.NotFound, match=f"without {wheel}: pip install"):
        discover.find_nvcc()


def test_nvshmem_wheel_in_the_target_environment(site, monkeypatch):
    monkeypatch.delenv("NVSHMEM_HOME", raising=False)
    monkeypatch.delenv("DEEP_EP_JAX_NO_NVSHMEM", raising=False)
    assert discover.nvshmem() == (None, "NVSHMEM not found (pip install nvidia-nvshmem-cu13, or set NVSHMEM_HOME)")
    home = site / "nvidia" / "nvshmem"
    for path in ("include/nvshmem.h", "lib/libnvshmem_device.a", "lib/libnvshmem_host.so.3"):
        _touch(home / path)
    assert discover.nvshmem() == (str(home), None)
