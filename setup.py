"""Builds deep_ep_jax, with its CUDA extension deep_ep_jax._C when nvcc is found.

Metadata lives in pyproject.toml; the native sources and flags in
csrc/sources.bzl (shared with Bazel). Every source is compiled by nvcc, in
parallel, into one shared module linked against the static CUDA runtime.

  pip install -e ".[test]"                      # here: isolated build, fetches jax for the FFI headers
  pip install --no-build-isolation --no-deps -e .  # offline, with jax and pybind11 already installed
  python setup.py build_ext --inplace           # offline, incremental, no install

Environment (all but MAX_JOBS read by build_tools/discover.py, which bazel/configure.py uses too):
  CUDA_HOME                  CUDA toolkit to use (else /usr/local/cuda, else nvcc on PATH, else the
                             CUDA 13 pip wheels: nvidia-cuda-nvcc & co., as jax[cuda13] or .[cuda] install them)
  DEEP_EP_JAX_NO_SYSTEM_CUDA=1  skip /usr/local/cuda and PATH (CUDA_HOME or the pip wheels only)
  DEEP_EP_JAX_CUDA_ARCHS     architectures, e.g. "90", "90;100", "90a", "90+PTX" (default: sources.bzl)
  DEEP_EP_JAX_NO_CUDA=1      install the pure-Python package even when nvcc is present
  NVSHMEM_HOME               NVSHMEM with include/ and lib/ (else the nvidia-nvshmem-cu13 wheel, if installed)
  DEEP_EP_JAX_NO_NVSHMEM=1   build without NVSHMEM even when it is installed (no EP groups across hosts)
  MAX_JOBS                   parallel compile jobs (default: number of CPUs)
"""

import concurrent.futures
import glob
import os
import subprocess
import sys
import time

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)  # build_tools/, which pip's build backend does not put on the path

from build_tools import discover  # noqa: E402  (nvcc, headers, NVSHMEM: shared with bazel/configure.py)

SOURCES = discover.read_bzl(os.path.join(ROOT, "csrc", "sources.bzl"))


def gencode_flags(archs):
    flags, names = [], []
    for arch in archs:
        ptx = arch.endswith("+PTX")
        arch = arch[: -len("+PTX")] if ptx else arch
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        names.append(f"sm_{arch}")
        if ptx:  # also embed PTX so newer GPUs can JIT-compile it
            flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
            names.append(f"compute_{arch}")
    return flags, names


def include_flags():
    ours = [f"-I{os.path.join(ROOT, d)}" for d in SOURCES["INCLUDE_DIRS"]]
    # Third-party headers as system headers: their warnings are not ours.
    theirs = [
        f"-isystem={d}" for d in (discover.xla_ffi_include(), discover.pybind11_include(), discover.python_include())
    ]
    return ours + theirs


def read_text(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def existing(paths):
    found = []
    for path in paths:
        if os.path.exists(os.path.join(ROOT, path)):
            found.append(path)
        else:
            print(f"deep_ep_jax: skipping {path} (not written yet)")
    return found


class NvccBuildExt(build_ext):
    """Compiles the sources of sources.bzl with nvcc, in parallel and incrementally
    (a source is recompiled when it, any csrc header, or its command changed)."""

    def build_extension(self, ext):
        start = time.time()
        nvcc, nvcc_from = discover.find_nvcc()
        gencode, arch_names = gencode_flags(discover.cuda_archs() or SOURCES["CUDA_ARCHS"])
        common = include_flags()
        nvshmem, why_not = discover.nvshmem()
        if nvshmem:
            common += list(SOURCES["NVSHMEM_DEFINES"])
        common.append(f'-DDEEP_EP_JAX_CUDA_ARCHS="{",".join(arch_names)}"')
        cuda_flags = list(SOURCES["NVCC_FLAGS"]) + gencode + common
        # nvcc hands .cc files to the host compiler; -std must be given to nvcc itself.
        cxx_flags = [f if f.startswith("-std=") else f"-Xcompiler={f}" for f in SOURCES["CXX_FLAGS"]] + common

        jobs = []
        obj_dir = os.path.join(self.build_temp, "deep_ep_jax_C")
        for src in existing(SOURCES["CUDA_SOURCES"]):
            jobs.append((src, cuda_flags))
        for src in existing(SOURCES["CXX_SOURCES"]):
            jobs.append((src, cxx_flags))
        nvshmem_jobs = []
        if nvshmem:
            nvshmem_flags = cuda_flags + list(SOURCES["NVSHMEM_NVCC_FLAGS"]) + [f"-isystem={nvshmem}/include"]
            nvshmem_jobs = [(src, nvshmem_flags) for src in existing(SOURCES["NVSHMEM_CUDA_SOURCES"])]
        headers_mtime = max(
            [
                os.path.getmtime(h)
                for pattern in SOURCES["HEADER_GLOBS"]
                for h in glob.glob(os.path.join(ROOT, pattern), recursive=True)
            ]
            + [0.0]
        )

        def compile_one(job):
            src, flags = job
            obj = os.path.join(obj_dir, src.replace("/", "_") + ".o")
            cmd = [nvcc, "-c", os.path.join(ROOT, src), "-o", obj] + flags
            stamp = obj + ".cmd"
            inputs = [src] + list(SOURCES["INCLUDED_SOURCES"].get(src, []))
            if (
                os.path.exists(obj)
                and read_text(stamp) == " ".join(cmd)
                and os.path.getmtime(obj)
                >= max([os.path.getmtime(os.path.join(ROOT, i)) for i in inputs] + [headers_mtime])
            ):
                return obj, False
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"nvcc failed on {src}:\n{' '.join(cmd)}\n{result.stdout}{result.stderr}")
            if (result.stdout + result.stderr).strip():  # warnings
                print(f"deep_ep_jax: {src}:\n{result.stdout}{result.stderr}")
            with open(stamp, "w") as f:
                f.write(" ".join(cmd))
            return obj, True

        os.makedirs(obj_dir, exist_ok=True)
        max_jobs = int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, max_jobs)) as pool:
            results = list(pool.map(compile_one, jobs + nvshmem_jobs))
        objects = [obj for obj, _ in results]
        num_compiled = sum(changed for _, changed in results)

        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

        def run_if_stale(cmd, output, inputs, what):
            """Runs cmd unless output is newer than inputs and was made by the same command."""
            stamp = os.path.join(obj_dir, os.path.basename(output) + ".cmd")
            if (
                os.path.exists(output)
                and read_text(stamp) == " ".join(cmd)
                and os.path.getmtime(output) >= max(map(os.path.getmtime, inputs))
            ):
                return
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{what} failed:\n{' '.join(cmd)}\n{result.stdout}{result.stderr}")
            with open(stamp, "w") as f:
                f.write(" ".join(cmd))

        link_inputs, link_files = objects, list(objects)
        if nvshmem:  # device-link the -rdc objects with NVSHMEM's device library, then link its host library
            lib = os.path.join(nvshmem, "lib")
            device_lib = os.path.join(lib, "libnvshmem_device.a")
            rdc_objects = objects[len(jobs) :]
            dlink = os.path.join(obj_dir, "nvshmem_dlink.o")
            cmd = (
                [nvcc, "-dlink"]
                + list(SOURCES["NVSHMEM_DLINK_FLAGS"])
                + gencode
                + rdc_objects
                + [device_lib, "-o", dlink]
            )
            run_if_stale(cmd, dlink, rdc_objects + [device_lib], "nvcc -dlink")
            link_inputs = objects + [
                dlink,
                device_lib,
                f"-L{lib}",
                f"-l:{discover.nvshmem_host_lib(nvshmem)}",
                f"-Xlinker=-rpath={lib}",
            ]
            link_files = objects + [dlink, device_lib]
        cmd = [nvcc] + list(SOURCES["LINK_FLAGS"]) + gencode + link_inputs + ["-o", out]
        run_if_stale(cmd, out, link_files, "nvcc link")
        print(
            f"deep_ep_jax: built {ext.name} for {','.join(arch_names)} with {nvcc} (from {nvcc_from}) "
            f"({num_compiled} of {len(objects)} sources compiled, {time.time() - start:.0f} s); "
            + (f"NVSHMEM from {nvshmem}" if nvshmem else f"without NVSHMEM: {why_not}")
        )


def extensions():
    if discover.cuda_disabled():
        print("deep_ep_jax: DEEP_EP_JAX_NO_CUDA=1, installing the pure-Python package (xla backend only)")
        return []
    if discover.nvcc() is None:
        print(
            "deep_ep_jax: nvcc not found (set CUDA_HOME, or install the CUDA 13 nvcc wheels first: "
            'pip install "jax[cuda13]" or "deep_ep_jax[cuda]"), installing the pure-Python package (xla backend only)'
        )
        return []
    # The sources are listed for setuptools' checks; NvccBuildExt compiles them.
    sources = [s for s in SOURCES["CUDA_SOURCES"] + SOURCES["CXX_SOURCES"] if os.path.exists(os.path.join(ROOT, s))]
    return [Extension("deep_ep_jax._C", sources=sources)]


setup(ext_modules=extensions(), cmdclass={"build_ext": NvccBuildExt})
