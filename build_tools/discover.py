"""Finds what building deep_ep_jax's CUDA extension needs on this machine:
nvcc (a CUDA toolkit, or NVIDIA's CUDA 13 pip wheels), the Python, XLA FFI and pybind11 headers, NVSHMEM, and the CUDA
architectures asked for. setup.py and bazel/configure.py both ask here, so the
two builds look in the same places and read the environment (listed in
setup.py's docstring) the same way.

Standard library only, and outside the deep_ep_jax package: setup.py runs it
before the package (or jax, in a fresh environment) is importable. jax and
pybind11 are imported only when their headers are asked for.
"""

import glob
import os
import shutil
import sys
import sysconfig


class NotFound(RuntimeError):
    """Something the build needs is missing; the message says what to do."""


def read_bzl(path):
    """The constants of a Starlark file made only of assignments (csrc/sources.bzl,
    bazel/local_config.bzl), which is also Python."""
    scope = {}
    with open(path) as f:
        exec(f.read(), scope)
    return {k: v for k, v in scope.items() if not k.startswith("__")}


def cuda_disabled():
    """DEEP_EP_JAX_NO_CUDA=1: build no extension, even where nvcc is found."""
    return os.environ.get("DEEP_EP_JAX_NO_CUDA") == "1"


def nvcc():
    """nvcc's absolute path (see find_nvcc); None if none."""
    found = find_nvcc()
    return found[0] if found else None


def find_nvcc():
    """(nvcc's absolute path, where it came from), or None. Looked for in
    CUDA_HOME, else /usr/local/cuda, else PATH, else the CUDA 13 pip wheels
    (site-packages/nvidia/cu13, which `jax[cuda13]` and deep_ep_jax[cuda]
    install). DEEP_EP_JAX_NO_SYSTEM_CUDA=1 skips /usr/local/cuda and PATH.
    Raises NotFound for a wheel nvcc whose companion wheels are missing."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append((os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"), "CUDA_HOME"))
    if os.environ.get("DEEP_EP_JAX_NO_SYSTEM_CUDA") != "1":
        candidates.append(("/usr/local/cuda/bin/nvcc", "/usr/local/cuda"))
        candidates.append((shutil.which("nvcc"), "PATH"))
    for path, where in candidates:
        if path and _is_executable(path):
            return os.path.abspath(path), where
    for nvidia in _nvidia_wheel_dirs():
        root = os.path.join(nvidia, "cu13")
        if _is_executable(os.path.join(root, "bin", "nvcc")):
            _check_cuda_wheels(root)
            return os.path.join(root, "bin", "nvcc"), "the nvidia-cuda-nvcc wheel"
    return None


# What the build needs from the CUDA 13 wheels besides nvcc (nvidia-cuda-nvcc):
# a file each wheel installs under nvidia/cu13, and the wheel. nvcc's own
# nvcc.profile points it at these (nvvm/, include/, include/cccl/, lib/).
CUDA_WHEEL_FILES = {
    "nvvm/bin/cicc": "nvidia-nvvm",
    "include/crt/host_config.h": "nvidia-cuda-crt",
    "include/cuda_runtime.h": "nvidia-cuda-runtime",
    "lib/libcudart_static.a": "nvidia-cuda-runtime",
    "include/nv/target": "nvidia-cuda-cccl",
}


def _check_cuda_wheels(root):
    missing = sorted(
        {wheel for path, wheel in CUDA_WHEEL_FILES.items() if not os.path.exists(os.path.join(root, path))}
    )
    if missing:
        raise NotFound(
            f"nvcc found in {root} (the nvidia-cuda-nvcc wheel) without {', '.join(missing)}: "
            f'pip install "deep_ep_jax[cuda]" (or {" ".join(missing)}), '
            "set CUDA_HOME to a CUDA toolkit, or set DEEP_EP_JAX_NO_CUDA=1"
        )


def _is_executable(path):
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _nvidia_wheel_dirs():
    """The site-packages/nvidia directories NVIDIA's wheels install into: this
    Python's, and the target environment's, which pip's isolated build does
    not put on the path (sys.prefix is still the target's)."""
    dirs = []
    try:
        import nvidia  # a namespace package, shared by NVIDIA's wheels

        dirs += list(nvidia.__path__)
    except ImportError:
        pass
    for key in ("purelib", "platlib"):
        dirs.append(os.path.join(sysconfig.get_paths()[key], "nvidia"))
    unique = []
    for d in dirs:
        if os.path.isdir(d) and os.path.realpath(d) not in map(os.path.realpath, unique):
            unique.append(d)
    return unique


def cuda_archs():
    """DEEP_EP_JAX_CUDA_ARCHS as a list like ["90", "90a", "100+PTX"] ("9.0,10.0"
    reads as ["90", "100"]); None when unset, meaning csrc/sources.bzl's CUDA_ARCHS."""
    env = os.environ.get("DEEP_EP_JAX_CUDA_ARCHS")
    if not env:
        return None
    return [a.strip().replace(".", "") for a in env.replace(",", ";").split(";") if a.strip()]


def python_include():
    """The directory with Python.h of the Python running this."""
    include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(include, "Python.h")):
        raise NotFound(f"Python.h not found in {include}: install the Python development headers")
    return include


def xla_ffi_include():
    """The XLA FFI headers, which jax's jaxlib ships."""
    try:
        import jax
    except ImportError as e:
        raise NotFound(
            f"{e}: the build needs jax (its jaxlib ships the XLA FFI headers) "
            f"in the Python that runs it ({sys.executable})"
        ) from e
    return jax.ffi.include_dir()


def pybind11_include():
    try:
        import pybind11
    except ImportError as e:
        raise NotFound(f"{e}: the build needs pybind11 in the Python that runs it ({sys.executable})") from e
    return pybind11.get_include()


def nvshmem():
    """(NVSHMEM's root, None), or (None, why it is not used). The root has
    include/nvshmem.h, lib/libnvshmem_device.a and lib/libnvshmem_host.so*.
    Looked for in NVSHMEM_HOME, else the nvidia-nvshmem-cu13 wheel; an
    NVSHMEM_HOME without NVSHMEM in it is an error, not a silent fallback."""
    if os.environ.get("DEEP_EP_JAX_NO_NVSHMEM") == "1":
        return None, "DEEP_EP_JAX_NO_NVSHMEM=1"
    home = os.environ.get("NVSHMEM_HOME")
    if home:
        if not _is_nvshmem(home):
            raise NotFound(
                f"NVSHMEM_HOME={home} is not NVSHMEM: it needs include/nvshmem.h, "
                "lib/libnvshmem_device.a and lib/libnvshmem_host.so* (or unset NVSHMEM_HOME)"
            )
        return os.path.abspath(home), None
    for nvidia in _nvidia_wheel_dirs():
        home = os.path.join(nvidia, "nvshmem")  # the nvidia-nvshmem-cu13 wheel
        if _is_nvshmem(home):
            return os.path.abspath(home), None
    return None, "NVSHMEM not found (pip install nvidia-nvshmem-cu13, or set NVSHMEM_HOME)"


def nvshmem_host_lib(home):
    """File name of NVSHMEM's host library in home/lib, e.g. libnvshmem_host.so.3
    (the wheel has no unversioned .so); None if there is none."""
    libs = sorted(os.path.basename(p) for p in glob.glob(os.path.join(home, "lib", "libnvshmem_host.so*")))
    return libs[0] if libs else None


def _is_nvshmem(home):
    return (
        os.path.isfile(os.path.join(home, "include", "nvshmem.h"))
        and os.path.isfile(os.path.join(home, "lib", "libnvshmem_device.a"))
        and nvshmem_host_lib(home) is not None
    )
