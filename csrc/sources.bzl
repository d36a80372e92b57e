# The one list of native sources and compile flags of deep_ep_jax._C.
#
# Plain assignments only: this file is both Starlark (a Bazel BUILD load()s it)
# and Python (setup.py exec()s it). Paths are relative to the repository root.
# Everything is compiled by nvcc: .cu files as CUDA, .cc files as host C++
# (nvcc hands them to the host compiler with CXX_FLAGS), so both see the same
# CUDA headers. setup.py skips, with a note, a listed file that does not exist.

# Device code and kernel launchers.
CUDA_SOURCES = [
    "csrc/kernels/layout.cu",
    "csrc/kernels/intranode.cu",
    "csrc/kernels/low_latency.cu",
    "csrc/kernels/expert_major.cu",
    "csrc/kernels/fp8_quant.cu",
]

# Host code: runtime, XLA FFI handlers, the pybind11 module.
CXX_SOURCES = [
    "csrc/runtime/registry.cc",
    "csrc/runtime/side_stream.cc",
    "csrc/ffi/registration.cc",
    "csrc/ffi/common.cc",
    "csrc/ffi/layout.cc",
    "csrc/ffi/intranode.cc",
    "csrc/ffi/low_latency.cc",
    "csrc/ffi/internode.cc",
    "csrc/ffi/expert_major.cc",
    "csrc/ffi/fp8_quant.cc",
    "csrc/module.cc",
]

# With NVSHMEM (EP groups across hosts; the nvidia-nvshmem-cu13 wheel or
# NVSHMEM_HOME, found at build time): the sources that use it. They are
# compiled with NVSHMEM_NVCC_FLAGS and NVSHMEM's include dir, device-linked
# (nvcc -dlink) with libnvshmem_device.a, and the module links
# libnvshmem_host with an rpath to NVSHMEM's lib dir. Every source then gets
# NVSHMEM_DEFINES. Without NVSHMEM they are left out and the rest builds alone.
NVSHMEM_CUDA_SOURCES = [
    "csrc/runtime/nvshmem.cu",
    "csrc/kernels/low_latency_nvshmem.cu",
    "csrc/kernels/internode.cu",
]
NVSHMEM_NVCC_FLAGS = ["-rdc=true"]
# The device-link step (its registration code stays private to the module).
NVSHMEM_DLINK_FLAGS = ["-Xcompiler=-fPIC", "-Xcompiler=-fvisibility=hidden"]
NVSHMEM_DEFINES = ["-DDEEP_EP_JAX_WITH_NVSHMEM"]

# Sources another source #includes (besides headers): source -> what it includes.
INCLUDED_SOURCES = {
    "csrc/kernels/low_latency_nvshmem.cu": ["csrc/kernels/low_latency.cu"],
}

# Headers every source may include; a change to one rebuilds everything.
HEADER_GLOBS = [
    "csrc/**/*.h",
    "csrc/**/*.cuh",
]

INCLUDE_DIRS = ["csrc"]

# Default GPU architectures (compute capability without the dot): Ampere,
# Hopper, Blackwell (datacenter and consumer), and PTX of the newest for GPUs
# after them. The kernels need sm_80 at least and nothing newer: one build
# serves every GPU. DEEP_EP_JAX_CUDA_ARCHS overrides it, e.g. "90" for a
# faster build on a Hopper host.
CUDA_ARCHS = ["80", "90", "100", "120+PTX"]

# Flags for .cu files (the -gencode flags are added from CUDA_ARCHS).
NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    "-Xcompiler=-fPIC",
    "-Xcompiler=-fvisibility=hidden",
]

# Host compiler flags for .cc files (passed through nvcc with -Xcompiler).
CXX_FLAGS = [
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-fvisibility=hidden",
    "-Wall",
    "-Wno-unused-function",
]

# Link: static CUDA runtime (no libcudart.so needed at run time; only the
# driver), and keep the static libraries' symbols private to the module.
LINK_FLAGS = [
    "-shared",
    "--cudart=static",
    "-Xlinker=--exclude-libs,ALL",
]
