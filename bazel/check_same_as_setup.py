"""Checks that Bazel builds the extension setup.py builds:

1. the same nvcc commands, source by source and the link (flags and their
   order; paths are compared by what they name). setup.py's commands are
   recorded by running its build_ext with a stand-in nvcc that only logs;
   Bazel's come from `bazel aquery`, so neither build runs twice.
2. the Bazel-built deep_ep_jax._C (from the package's runfiles tree) imports
   and has the same FFI targets and GPU architectures as the pip-built one.

Run from the repository root with the configured Python, after
`bazel build //:extension //:cpu_tests`:  python bazel/check_same_as_setup.py
"""

import json
import os
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # build_tools/, when run as `python bazel/check_same_as_setup.py`

from build_tools import discover  # noqa: E402

WORKSPACE_NAME = "deep_ep_jax_repo"  # as in WORKSPACE
RUNFILES = os.path.join(ROOT, "bazel-bin", "cpu_tests.runfiles", WORKSPACE_NAME)

FAKE_NVCC = """#!{python}
# Logs its arguments and creates the output file; compiles nothing.
import json, sys
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
open(sys.argv[sys.argv.index("-o") + 1], "w").close()
"""

PROBE = """
import json, deep_ep_jax._C as m
print(json.dumps({"file": m.__file__, "ffi_targets": sorted(m.ffi_targets()), "cuda_archs": m.cuda_archs()}))
"""


def setup_py_commands():
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "nvcc.log")
        nvcc = os.path.join(tmp, "cuda", "bin", "nvcc")
        os.makedirs(os.path.dirname(nvcc))
        with open(nvcc, "w") as f:
            f.write(FAKE_NVCC.format(python=sys.executable, log=log))
        os.chmod(nvcc, 0o755)
        result = subprocess.run(
            [
                sys.executable,
                "setup.py",
                "-q",
                "build_ext",
                "--build-temp",
                os.path.join(tmp, "temp"),
                "--build-lib",
                os.path.join(tmp, "lib"),
            ],
            cwd=ROOT,
            env=dict(os.environ, CUDA_HOME=os.path.join(tmp, "cuda")),
            capture_output=True,
            text=True,
        )
        if result.returncode != 0 or not os.path.exists(log):
            sys.exit(f"setup.py build_ext with a logging nvcc failed:\n{result.stdout}{result.stderr}")
        with open(log) as f:
            return [json.loads(line) for line in f]


def bazel_commands(nvcc):
    out = subprocess.run(
        ["bazel", "aquery", "deps(//:extension)", "--output=jsonproto"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    commands = []
    for action in json.loads(out)["actions"]:
        if action.get("mnemonic") != "Genrule":
            continue
        script = action["arguments"][-1].split("genrule-setup.sh; ", 1)[-1]
        argv = shlex.split(script)
        if argv[0] == nvcc:
            commands.append(argv[1:])
    return commands


def normalize(args, names, nvshmem_home=""):
    """Paths replaced by what they name: sources relative to the root, objects
    by file name, third-party include dirs by repository name, NVSHMEM's
    files (its root, or Bazel's external/nvshmem) under @nvshmem."""
    out = []
    for i, arg in enumerate(args):
        for root in [nvshmem_home, os.path.join(ROOT, "external", "nvshmem"), "external/nvshmem"]:
            if root and root in arg:
                arg = arg.replace(root, "@nvshmem")
                break
        if i > 0 and args[i - 1] == "-o":
            arg = "OUTPUT"
        elif arg.endswith(".o") and not arg.startswith("@nvshmem"):
            arg = "OBJECT:" + os.path.basename(arg)
        elif arg.endswith((".cu", ".cc")):
            arg = os.path.relpath(os.path.join(ROOT, arg), ROOT)
        else:
            for flag in ("-I", "-isystem="):
                if arg.startswith(flag):
                    path = os.path.normpath(os.path.join(ROOT, arg[len(flag) :]))
                    arg = flag + names.get(path, os.path.relpath(path, ROOT))
        out.append(arg)
    return out


def by_source(commands, names, nvshmem_home=""):
    compiles, links = {}, []
    for args in commands:
        args = normalize(args, names, nvshmem_home)
        if "-c" in args:
            compiles[args[args.index("-c") + 1]] = args
        else:
            links.append(args)
    return compiles, sorted(links)  # the device link (with NVSHMEM) and the link, in any order


def compare_commands(config):
    # Each third-party include dir, as setup.py and as Bazel name it.
    names = {}
    for key, repo in (
        ("XLA_FFI_INCLUDE", "xla_ffi_headers"),
        ("PYBIND11_INCLUDE", "pybind11_headers"),
        ("PYTHON_INCLUDE", "python_headers"),
    ):
        names[os.path.normpath(config[key])] = "@" + repo
        names[os.path.join(ROOT, "external", repo)] = "@" + repo
    home = config.get("NVSHMEM_HOME", "")
    pip_compiles, pip_links = by_source(setup_py_commands(), names, home)
    bazel_compiles, bazel_links = by_source(bazel_commands(config["NVCC"]), names, home)
    ok = True
    for src in sorted(set(pip_compiles) | set(bazel_compiles)):
        pip, bazel = pip_compiles.get(src), bazel_compiles.get(src)
        if pip != bazel:
            ok = False
            print(f"DIFFERENT nvcc command for {src}:\n  setup.py: {pip}\n  bazel:    {bazel}")
    if pip_links != bazel_links:
        ok = False
        print(f"DIFFERENT link command:\n  setup.py: {pip_links}\n  bazel:    {bazel_links}")
    if ok:
        print(f"same nvcc commands: {len(pip_compiles)} sources and the link")
    return ok


def probe(cwd):
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True)
    return json.loads(result.stdout) if result.returncode == 0 else None


def compare_modules():
    if not os.path.isdir(RUNFILES):
        print(f"{RUNFILES} is missing: `bazel build //:cpu_tests` first")
        return False
    bazel = probe(RUNFILES)
    if bazel is None or ".runfiles" not in bazel["file"]:
        print(f"the Bazel-built deep_ep_jax._C does not import from {RUNFILES}: {bazel}")
        return False
    # pip-built: installed (imported from outside the checkout), else built in place.
    with tempfile.TemporaryDirectory() as elsewhere:
        pip = probe(elsewhere) or probe(ROOT)
    if pip is None:
        print(
            "no pip-built deep_ep_jax._C to compare with: `pip install -e .` or "
            "`python setup.py build_ext --inplace` first"
        )
        return False
    print(f"bazel: {bazel['file']}\npip:   {pip['file']}")
    ok = True
    for key in ("ffi_targets", "cuda_archs"):
        if bazel[key] != pip[key]:
            ok = False
            print(f"DIFFERENT {key}:\n  pip:   {pip[key]}\n  bazel: {bazel[key]}")
    if ok:
        print(
            f"same {len(bazel['ffi_targets'])} FFI targets ({', '.join(bazel['ffi_targets'])}) "
            f"and architectures {bazel['cuda_archs']}"
        )
    return ok


def main():
    config = discover.read_bzl(os.path.join(ROOT, "bazel", "local_config.bzl"))
    if os.path.dirname(os.path.abspath(sys.executable)) != os.path.dirname(config["PYTHON"]):
        sys.exit(f"run this with the configured Python {config['PYTHON']}")
    same_commands = compare_commands(config)
    same_modules = compare_modules()
    sys.exit(0 if same_commands and same_modules else 1)


if __name__ == "__main__":
    main()
