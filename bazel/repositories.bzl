"""The machine-local repositories the build reads, at the paths that
bazel/configure.py found: @python_headers, @xla_ffi_headers, @pybind11_headers
and @nvshmem. Being repositories (not raw -I paths) makes their headers inputs,
so upgrading jax or pybind11 rebuilds what includes them."""

load(
    "//bazel:local_config.bzl",
    "NVSHMEM_HOME",
    "PYBIND11_INCLUDE",
    "PYTHON_INCLUDE",
    "XLA_FFI_INCLUDE",
)

# An include directory as a repository whose root is on the include path.
_HEADERS_BUILD = """
filegroup(
    name = "headers",
    srcs = glob(["**/*.h", "**/*.hpp", "**/*.inc"]),
    visibility = ["//visibility:public"],
)
"""

# NVSHMEM's root (include/, lib/): headers, the host library and the device
# library. Empty groups where NVSHMEM is not installed (configure says so).
_NVSHMEM_BUILD = """
filegroup(
    name = "headers",
    srcs = glob(["include/**/*.h", "include/**/*.cuh", "include/**/*.hpp"]),
    visibility = ["//visibility:public"],
)

filegroup(
    name = "host_lib",
    srcs = glob(["lib/libnvshmem_host.so*"]),
    visibility = ["//visibility:public"],
)

filegroup(
    name = "device_lib",
    srcs = glob(["lib/libnvshmem_device.a"]),
    visibility = ["//visibility:public"],
)

filegroup(
    name = "bootstrap_libs",
    srcs = glob(["lib/nvshmem_bootstrap_*.so*"]),
    visibility = ["//visibility:public"],
)
"""

def deep_ep_jax_repositories():
    native.new_local_repository(name = "python_headers", path = PYTHON_INCLUDE, build_file_content = _HEADERS_BUILD)
    native.new_local_repository(name = "xla_ffi_headers", path = XLA_FFI_INCLUDE, build_file_content = _HEADERS_BUILD)
    native.new_local_repository(name = "pybind11_headers", path = PYBIND11_INCLUDE, build_file_content = _HEADERS_BUILD)

    # Without NVSHMEM it points at bazel/ (no include/ or lib/ there), so
    # @nvshmem//:headers etc. exist and are empty.
    native.new_local_repository(
        name = "nvshmem",
        path = NVSHMEM_HOME or "bazel",
        build_file_content = _NVSHMEM_BUILD,
    )
