"""Timing shared by the benchmarks.

`chain_seconds`: wall-clock seconds per operation from two jitted chains of n
and 2n operations (docs/design.md section 3: the difference cancels the fixed host
cost of a call). `kernel_events` / `kernel_durations`: kernels' times, read
from a JAX profile (CUPTI) of one run; `span_per_op`: the device's time per
operation of a profiled chain. `environment`: what a result was measured on."""

from __future__ import annotations

import glob
import sys
import tempfile
import time

import jax
import numpy as np
from jax import lax


def kernel_events(run, args, patterns):
    """{(gpu plane, pattern): [(start_ns, end_ns) of each kernel whose name contains pattern]},
    from a JAX profile (CUPTI) of one run."""
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
                        found.setdefault((plane.name, pattern), []).append((event.start_ns, event.end_ns))
    return found


def kernel_durations(run, args, patterns):
    """{(gpu plane, pattern): [seconds of each kernel whose name contains pattern]}."""
    return {key: [(end - start) * 1e-9 for start, end in v] for key, v in kernel_events(run, args, patterns).items()}


def span_per_op(events, num_ops):
    """{gpu plane: seconds per operation}: from the first matching kernel's
    start to the last one's end, over the chain's num_ops operations. The
    device's steady pace, gaps between kernels included, free of the host
    timing noise of the n / 2n difference."""
    by_gpu = {}
    for (gpu, _), v in events.items():
        by_gpu.setdefault(gpu, []).extend(v)
    return {gpu: (max(e for _, e in v) - min(s for s, _ in v)) * 1e-9 / num_ops for gpu, v in by_gpu.items() if v}


def chain_seconds(short, long, args, length, repeats):
    """One sample per repeat: (time of the 2n chain - time of the n chain) / n."""
    for run in (short, long, short, long):  # compile, warm up
        jax.block_until_ready(run(*args))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(short(*args))
        t1 = time.perf_counter()
        jax.block_until_ready(long(*args))
        t2 = time.perf_counter()
        samples.append(((t2 - t1) - (t1 - t0)) / length)
    return np.asarray(samples)


def touch(a, value):
    """a with its first element replaced by `value` ([1, 1]): the data
    dependency that links one operation of a chain to the next, as an
    in-place one-element update XLA cannot drop."""
    return lax.dynamic_update_slice(a, value.astype(a.dtype), (0, 0))


def environment():
    """Versions, devices, date and command line, recorded beside the results."""
    devices = jax.devices()
    return dict(jax=jax.__version__, devices=[d.device_kind for d in devices], platform=devices[0].platform,
                date=time.strftime("%Y-%m-%d %H:%M:%S"), command=" ".join(sys.argv))
