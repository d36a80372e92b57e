"""Runs one of the repository's scripts (an example, a benchmark) in a subprocess on N virtual CPU
devices, on any host, the way a user on a CPU-only machine would."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(path, *argv, devices=8):
    """`python ROOT/path argv...` with JAX on `devices` CPU devices; the finished process (output captured)."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    return subprocess.run(
        [sys.executable, str(ROOT / path), *argv], env=env, capture_output=True, text=True, timeout=300, check=False
    )
