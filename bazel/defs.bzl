"""Build rules that need nothing from the network (Bazel 4.2's own genrule and
a small test rule), so Debian's bazel-bootstrap builds offline.

nvcc_extension() compiles and links exactly as setup.py does: every source by
nvcc (.cu as CUDA with NVCC_FLAGS and -gencode, .cc as host C++ with
CXX_FLAGS passed through -Xcompiler), one action per source, then one nvcc
link. Keep the flag composition here in step with setup.py's NvccBuildExt;
bazel/check_same_as_setup.py (run by .ci/bazel_check.sh) fails when they differ.
"""

load(
    "//bazel:local_config.bzl",
    "NVCC",
    "NVSHMEM_HOME",
    "NVSHMEM_HOST_LIB",
    "PYTHON",
    "PYTHON_EXT_SUFFIX",
    CONFIGURED_CUDA_ARCHS = "CUDA_ARCHS",
)

# Header repositories declared by bazel/repositories.bzl, on the include path
# after the project's own include dirs (the order setup.py uses).
_EXTERNAL_HEADERS = [
    "@xla_ffi_headers//:headers",
    "@pybind11_headers//:headers",
    "@python_headers//:headers",
]

def _quote(arg):
    return "'" + arg.replace("'", "'\\''") + "'"

def _gencode_flags(archs):
    """(flags, names) for archs like "90", "90a", "90+PTX", as setup.py."""
    flags, names = [], []
    for arch in archs:
        ptx = arch.endswith("+PTX")
        if ptx:
            arch = arch[:-len("+PTX")]
        flags.append("-gencode=arch=compute_%s,code=sm_%s" % (arch, arch))
        names.append("sm_" + arch)
        if ptx:  # also embed PTX so newer GPUs can JIT-compile it
            flags.append("-gencode=arch=compute_%s,code=compute_%s" % (arch, arch))
            names.append("compute_" + arch)
    return flags, names

def _existing(srcs):
    """The listed sources that exist; setup.py skips missing ones too."""
    found = []
    for src in srcs:
        if native.glob([src]):
            found.append(src)
        else:
            print("deep_ep_jax: skipping %s (not written yet)" % src)
    return found

def _object_name(name, src):
    return name + "_obj_" + src.replace("/", "_").replace(".", "_")

def nvcc_extension(
        name,
        module,
        cuda_srcs,
        cxx_srcs,
        hdrs,
        include_dirs,
        cuda_archs,
        nvcc_flags,
        cxx_flags,
        link_flags,
        nvshmem_cuda_srcs = [],
        nvshmem_nvcc_flags = [],
        nvshmem_dlink_flags = [],
        nvshmem_defines = [],
        included_srcs = {},
        visibility = None):
    """The Python extension module `module` (e.g. "deep_ep_jax/_C"), built by
    nvcc into `<module><EXT_SUFFIX>` (the configured Python's suffix).

    cuda_archs is overridden by DEEP_EP_JAX_CUDA_ARCHS as seen by configure.
    With NVSHMEM configured (NVSHMEM_HOME), nvshmem_cuda_srcs are compiled
    with nvshmem_nvcc_flags and NVSHMEM's headers, device-linked with
    libnvshmem_device.a, and the module links libnvshmem_host with an rpath
    to NVSHMEM's lib dir, as setup.py does.
    """
    gencode, arch_names = _gencode_flags(CONFIGURED_CUDA_ARCHS or cuda_archs)

    # Paths relative to the execution root; workspace_root is "" here and
    # "external/<name>" when this repository is someone else's dependency.
    root = Label("//:BUILD").workspace_root
    common = ["-I" + ((root + "/" + d) if root else d) for d in include_dirs]

    # Third-party headers as system headers (their warnings are not ours).
    common += ["-isystem=" + Label(h).workspace_root for h in _EXTERNAL_HEADERS]
    if NVSHMEM_HOME:
        common += nvshmem_defines
    common.append('-DDEEP_EP_JAX_CUDA_ARCHS="%s"' % ",".join(arch_names))

    # nvcc hands .cc files to the host compiler; -std must be given to nvcc itself.
    host_flags = [f if f.startswith("-std=") else "-Xcompiler=" + f for f in cxx_flags]
    jobs = [(src, nvcc_flags + gencode + common, []) for src in _existing(cuda_srcs)]
    jobs += [(src, host_flags + common, []) for src in _existing(cxx_srcs)]
    nvshmem_jobs = []
    if NVSHMEM_HOME:
        nvshmem_flags = nvcc_flags + gencode + common + nvshmem_nvcc_flags + [
            "-isystem=" + Label("@nvshmem//:headers").workspace_root + "/include",
        ]
        nvshmem_jobs = [(src, nvshmem_flags, ["@nvshmem//:headers"]) for src in _existing(nvshmem_cuda_srcs)]

    objects = []
    for src, flags, extra in jobs + nvshmem_jobs:
        obj = _object_name(name, src)
        native.genrule(
            name = obj,
            srcs = [src] + included_srcs.get(src, []) + hdrs + _EXTERNAL_HEADERS + extra,
            outs = ["_objs/%s/%s.o" % (name, src.replace("/", "_"))],
            cmd = " ".join([_quote(NVCC), "-c", "$(location %s)" % src, "-o", "$@"] + [_quote(f) for f in flags]),
            message = "nvcc " + src,
        )
        objects.append(":" + obj)

    link_srcs, link_args = objects, ["$(location %s)" % o for o in objects]
    if NVSHMEM_HOME:
        # The -rdc objects device-linked with libnvshmem_device.a; the host
        # library by its versioned name, found at run time through the rpath.
        rdc_objects = objects[len(jobs):]
        native.genrule(
            name = name + "_nvshmem_dlink",
            srcs = rdc_objects + ["@nvshmem//:device_lib"],
            outs = ["_objs/%s/nvshmem_dlink.o" % name],
            cmd = " ".join(
                [_quote(NVCC), "-dlink"] + [_quote(f) for f in nvshmem_dlink_flags + gencode] +
                ["$(location %s)" % o for o in rdc_objects] + ["$(location @nvshmem//:device_lib)", "-o", "$@"],
            ),
            message = "nvcc -dlink (NVSHMEM)",
        )
        lib = Label("@nvshmem//:headers").workspace_root + "/lib"
        link_srcs = objects + [":" + name + "_nvshmem_dlink", "@nvshmem//:device_lib", "@nvshmem//:host_lib"]
        link_args = link_args + [
            "$(location :%s_nvshmem_dlink)" % name,
            "$(location @nvshmem//:device_lib)",
            "-L" + lib,
            "-l:" + NVSHMEM_HOST_LIB,
            _quote("-Xlinker=-rpath=" + NVSHMEM_HOME + "/lib"),
        ]

    native.genrule(
        name = name,
        srcs = link_srcs,
        outs = [module + PYTHON_EXT_SUFFIX],
        cmd = " ".join(
            [_quote(NVCC)] + [_quote(f) for f in link_flags + gencode] + link_args + ["-o", "$@"],
        ),
        message = "nvcc link " + module + PYTHON_EXT_SUFFIX,
        visibility = visibility,
    )

def _pytest_test_impl(ctx):
    launcher = ctx.actions.declare_file(ctx.label.name)

    # Runs in the runfiles tree (Bazel's working directory for tests and
    # `bazel run`), whose directory comes first on sys.path with -m, so the
    # tests import the Bazel-built package, not a source checkout's.
    ctx.actions.write(
        launcher,
        "\n".join([
            "#!/bin/sh",
            "if [ $# -eq 0 ]; then set -- %s; fi" % " ".join([_quote(a) for a in ctx.attr.default_args]),
            "exec %s -m pytest -p no:cacheprovider \"$@\"" % _quote(ctx.attr.python),
            "",
        ]),
        is_executable = True,
    )
    runfiles = ctx.runfiles(files = ctx.files.srcs + ctx.files.data)
    for dep in ctx.attr.deps:
        runfiles = runfiles.merge(dep[DefaultInfo].default_runfiles)
        runfiles = runfiles.merge(ctx.runfiles(transitive_files = dep[DefaultInfo].files))
    return [DefaultInfo(executable = launcher, runfiles = runfiles)]

_pytest_test = rule(
    implementation = _pytest_test_impl,
    test = True,
    attrs = {
        "srcs": attr.label_list(allow_files = [".py"]),
        "deps": attr.label_list(),
        "data": attr.label_list(allow_files = True),
        "python": attr.string(mandatory = True),
        "default_args": attr.string_list(),
    },
)

def pytest_test(name, python = PYTHON, **kwargs):
    """pytest with the configured Python over the runfiles of srcs, deps and
    data. Arguments (`--test_arg=...`) replace default_args, e.g.
    `--test_arg=tests/test_validation.py` runs one file."""
    _pytest_test(name = name, python = python, **kwargs)
