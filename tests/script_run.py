"""Runs one of the repository's scripts (an example, a benchmark) in a subprocess on N virtual CPU
devices, on any host, the way a user on a CPU-only machine would.

run_scripts runs several in one such subprocess, one after another, each as `python path argv...`
would (its argv, its directory first on sys.path, its exit status and output apart): for runs a
script refuses before any work, whose cost is Python's start and the imports, paid there once. This
file is that subprocess's driver when run as a script.

The scripts of one test session share a JAX compilation cache (a fresh directory, removed at exit):
a program a run compiled, a later run of the same program loads (the decode example's programs with
and without training, bench_moe_layer's grouped layer in two runs), as it would for a user with a
cache. Only one process at a time writes it (no run_script launches several).

start_script starts one in the background instead (a test module run as a script on more devices
than pytest's, beside the tests), without that cache: several may run at once."""

import contextlib
import io
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_CACHE = None


def _env(devices):
    global _CACHE
    if _CACHE is None:  # made on the first run, removed when this process exits
        _CACHE = tempfile.TemporaryDirectory(prefix="deep_ep_jax_scripts_cache_")
    return dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_COMPILATION_CACHE_DIR=_CACHE.name,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",  # eager ops' programs too: the examples' model init
    )


def run_script(path, *argv, devices=8):
    """`python ROOT/path argv...` with JAX on `devices` CPU devices; the finished process (output captured)."""
    return subprocess.run(
        [sys.executable, str(ROOT / path), *argv],
        env=_env(devices),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


class Background:
    """A script start_script started; its output goes to files, so no pipe fills while nothing reads it."""

    def __init__(self, args, env):
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self._out, stderr=self._err, text=True)

    def result(self, timeout):
        """Waits for it to end: (exit status, stdout, stderr)."""
        self.process.wait(timeout=timeout)
        self._out.seek(0)
        self._err.seek(0)
        return self.process.returncode, self._out.read(), self._err.read()

    def stop(self):
        """Kills it if it still runs (a test that timed out) and frees its files."""
        self.process.kill()
        self.process.wait()
        self._out.close()
        self._err.close()


def session_items(request, test_name):
    """The items of this pytest session that run test function `test_name` (any parameters): what a
    fixture starting a script for them (start_script) needs to know."""
    return [item for item in request.session.items if getattr(item, "originalname", None) == test_name]


def start_script(path, *argv, devices):
    """`python path argv...` started in the background with JAX on `devices` CPU devices (whatever
    XLA_FLAGS asked for here), the repository and tests/ on its path: a Background."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    path_entries = [str(ROOT), str(ROOT / "tests")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(path_entries)
    return Background([sys.executable, str(path), *map(str, argv)], env)


def run_scripts(runs, devices=8):
    """[run_script(path, *argv, devices=devices) for path, argv in runs], all in one process: a
    CompletedProcess per run, with the exit status and output `python ROOT/path argv...` gives."""
    runs = [(str(ROOT / path), [str(a) for a in argv]) for path, argv in runs]
    driver = subprocess.run(
        [sys.executable, __file__],
        input=json.dumps(runs),
        env=_env(devices),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    results = json.loads(driver.stdout) if driver.returncode == 0 and driver.stdout else None
    assert results is not None and len(results) == len(runs), (
        f"the driver failed (status {driver.returncode}):\n{driver.stdout[-2000:]}\n{driver.stderr[-4000:]}"
    )
    return [subprocess.CompletedProcess([sys.executable, path, *argv], *r) for (path, argv), r in zip(runs, results)]


def _exit_status(code, stderr):
    """The status Python exits with on SystemExit(code), writing what it writes."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=stderr)
    return 1


def _run_as_main(path, argv):
    """(status, stdout, stderr) of `python path argv...`, run here."""
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_path, saved_env = sys.argv, sys.path[:], dict(os.environ)
    sys.argv, sys.path[0] = [path, *argv], os.path.dirname(path)  # as python sets them for a script
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(path, run_name="__main__")
                status = 0
            except SystemExit as e:
                status = _exit_status(e.code, err)
            except BaseException:  # noqa: BLE001 (as the interpreter: the traceback, status 1)
                traceback.print_exc(file=err)
                status = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)
    return status, out.getvalue(), err.getvalue()


if __name__ == "__main__":  # run_scripts' driver: [[path, argv], ...] on stdin, [[status, stdout, stderr], ...] out
    runs = json.load(sys.stdin)
    results = [_run_as_main(path, argv) for path, argv in runs]
    sys.stdout.write(json.dumps(results))
