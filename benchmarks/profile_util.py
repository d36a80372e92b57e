"""Device times of kernels, read from a JAX profile (CUPTI) of one run."""

from __future__ import annotations

import glob
import tempfile

import jax
import numpy as np


def kernel_durations(run, args, patterns):
    """{(gpu plane, pattern): [seconds of each kernel whose name contains pattern]}."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            jax.block_until_ready(run(*args))
        paths = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        if not paths:
            return {}
        profile = ProfileData.from_file(paths[0])
    found = {}
    for plane in profile.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        for line in plane.lines:
            for event in line.events:
                for pattern in patterns:
                    if pattern in event.name:
                        found.setdefault((plane.name, pattern), []).append(event.duration_ns * 1e-9)
    return found


def median_durations(run, args, patterns):
    return {key: float(np.median(v)) for key, v in kernel_durations(run, args, patterns).items()}
