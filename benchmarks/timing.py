"""Timing shared by the benchmarks.

`chain_seconds`: wall-clock seconds per operation from two jitted chains of n
and 2n operations (docs/design.md section 3: the difference cancels the fixed host
cost of a call). `kernel_events` / `kernel_durations` / `kernel_breakdown` (and its printer):
kernels' times, read from a JAX profile (CUPTI) of one run (kernel_breakdown: the second of two
made back to back); `device_times`: the device time of repeated profiled calls; `span_per_op`: the
device's time per operation of a profiled chain. `same_bits`: outputs compared bit for bit.
`gpu_meters` / `power_summary`: the GPUs' energy over a timed run, and how long the power cap held their
clocks down (a run held down by it gets faster only with less work); `sustained`: time and energy per
operation under sustained load. `environment`: what a result was measured on."""

from __future__ import annotations

import collections
import ctypes
import glob
import sys
import tempfile
import time

import jax
import numpy as np
from jax import lax


def _gpu_kernels(run, args, runs=1):
    """[(gpu plane, kernel name, start_ns, end_ns)] of the last of `runs` calls of run made back to
    back, from a JAX profile (CUPTI). With runs=2 the measured call follows a like one with no idle
    gap (and no compile) before it, so the GPU runs it at the clocks it holds under load: a short
    run after idle runs faster than the same work in a long chain."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            jax.block_until_ready([run(*args) for _ in range(runs)])
        paths = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        if not paths:
            return []
        profile = ProfileData.from_file(paths[0])
    events = [
        (plane.name, event.name, event.start_ns, event.end_ns)
        for plane in profile.planes
        if plane.name.startswith("/device:GPU:")
        for line in plane.lines
        for event in line.events
    ]
    return last_of_runs(events, runs)


def last_of_runs(events, runs):
    """The events of the last of `runs` runs of one program: on each plane, the last 1/runs of
    them in start order (every run launches the same kernels)."""
    last = []
    for plane in sorted({plane for plane, *_ in events}):
        on_plane = sorted((e for e in events if e[0] == plane), key=lambda e: e[2])
        last += on_plane[len(on_plane) - len(on_plane) // runs :]
    return last


def kernel_events(run, args, patterns):
    """{(gpu plane, pattern): [(start_ns, end_ns) of each kernel whose name contains pattern]},
    from a JAX profile (CUPTI) of one run."""
    found = {}
    for plane, name, start, end in _gpu_kernels(run, args):
        for pattern in patterns:
            if pattern in name:
                found.setdefault((plane, pattern), []).append((start, end))
    return found


def kernel_breakdown(run, args, num_steps, split_up_to=8):
    """Where one run's device time goes (the second of two back to back), per step of its
    num_steps: ({kernel name: (launches, seconds)}, busy seconds, span seconds), over the
    first GPU; span runs from the first kernel's start to the last one's end, so span - busy
    is the time between kernels. Names are shortened (`short_kernel_name`). A name launched
    the same 2..split_up_to times in every step (e.g. every Mosaic GPU kernel is
    `body_mosaic_gpu_kernel`) gets a row per launch of a step, in launch order: "name #1",
    "name #2", ..."""
    events = _gpu_kernels(run, args, runs=2)
    first = min((plane for plane, *_ in events), default=None)
    events = sorted((start, end, short_kernel_name(name)) for plane, name, start, end in events if plane == first)
    if not events:
        return {}, 0.0, 0.0
    counts = collections.Counter(name for *_, name in events)
    seen = collections.Counter()
    per_name = {}
    for start, end, name in events:
        per_step, whole = divmod(counts[name], num_steps)
        if not whole and 1 < per_step <= split_up_to:
            seen[name] += 1
            name = f"{name} #{(seen[name] - 1) % per_step + 1}"
        launches, ns = per_name.get(name, (0, 0))
        per_name[name] = (launches + 1, ns + end - start)
    table = {name: (launches / num_steps, ns * 1e-9 / num_steps) for name, (launches, ns) in per_name.items()}
    busy = sum(seconds for _, seconds in table.values())
    span = (max(end for _, end, _ in events) - events[0][0]) * 1e-9 / num_steps
    return table, busy, span


def short_kernel_name(name):
    """A profile's kernel name without `void`, our namespace, anonymous namespaces
    and the argument list: "void deep_ep_jax::intranode::(anonymous namespace)::
    CombineKernel<2>(...)" -> "intranode::CombineKernel<2>"."""
    for noise in ("void ", "deep_ep_jax::", "(anonymous namespace)::"):
        name = name.replace(noise, "")
    return name.split("(", 1)[0] or name


def kernel_durations(run, args, patterns):
    """{(gpu plane, pattern): [seconds of each kernel whose name contains pattern]}."""
    return {key: [(end - start) * 1e-9 for start, end in v] for key, v in kernel_events(run, args, patterns).items()}


def print_kernel_breakdown(title, run, args, num_steps, top=12):
    """Prints kernel_breakdown's table: the `top` kernels by device time per step, then the rest."""
    table, busy, span = kernel_breakdown(run, args, num_steps)
    if not table:
        print(f"\n# {title}: no GPU kernels in the profile")
        return
    print(
        f"\n{title}, device time per step (a profiled run of {num_steps} steps right after a like one, first GPU): "
        f"kernels busy {busy * 1e3:.3f} ms of a {span * 1e3:.3f} ms span\n\n"
        "| kernel | launches | ms | share |\n|---|---|---|---|"
    )
    ranked = sorted(table.items(), key=lambda item: -item[1][1])
    for name, (launches, seconds) in ranked[:top]:
        print(f"| {name[:70]} | {launches:g} | {seconds * 1e3:.3f} | {seconds / busy:.1%} |")
    rest = sum(seconds for _, (_, seconds) in ranked[top:])
    if rest:
        print(f"| {len(ranked) - top} others | | {rest * 1e3:.3f} | {rest / busy:.1%} |")


def device_times(run, args, repeats):
    """(span seconds of each of `repeats` profiled calls (kernel_breakdown's), {kernel: seconds} of the last)."""
    spans, table = [], {}
    for _ in range(repeats):
        table, _, span = kernel_breakdown(run, args, 1)
        spans.append(span)
    return np.asarray(spans), {name: seconds for name, (_, seconds) in table.items()}


def same_bits(got, want):
    """Whether two arrays, or pytrees of them, hold the same values in the same shapes, NaN for NaN."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    return len(got) == len(want) and all(
        g.shape == w.shape
        and np.array_equal(np.asarray(g.astype(np.float32)), np.asarray(w.astype(np.float32)), equal_nan=True)
        for g, w in zip(got, want)
    )


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


def sustained(run, args, ops_per_call, seconds=2.0):
    """(seconds per operation, power_summary's pair per operation) of a compiled run(*args) of ops_per_call
    operations, called back to back without waiting for about `seconds`: the clock the GPU holds under
    sustained load, as inside a model's step (chain_seconds' short chains, idle between them, can run
    at a higher clock where the power cap binds)."""
    t0 = time.perf_counter()
    jax.block_until_ready(run(*args))
    calls = max(2, int(seconds / max(time.perf_counter() - t0, 1e-6)))
    meters = gpu_meters()
    t0 = time.perf_counter()
    jax.block_until_ready([run(*args) for _ in range(calls)])
    elapsed = time.perf_counter() - t0
    ops = calls * ops_per_call
    return elapsed / ops, power_summary(meters, gpu_meters(), elapsed, ops, unit="call")


def touch(a, value):
    """a with its first element replaced by `value` ([1, 1]): the data
    dependency that links one operation of a chain to the next, as an
    in-place one-element update XLA cannot drop."""
    return lax.dynamic_update_slice(a, value.astype(a.dtype), (0, 0))


def gpu_meters():
    """[(energy in mJ since the driver loaded, ns the power cap has held the clocks down, or None)] per GPU
    that NVML sees (the driver's libnvidia-ml, through ctypes); [] where it is absent or fails."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return []
    if nvml.nvmlInit_v2() != 0:
        return []
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return []
        readings = []
        for i in range(count.value):
            handle, energy = ctypes.c_void_p(), ctypes.c_ulonglong()
            violation = (ctypes.c_ulonglong * 2)()  # nvmlViolationTime_t: reference time, violation time (ns)
            if (
                nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0
                or nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(energy)) != 0
            ):
                return []
            capped = nvml.nvmlDeviceGetViolationStatus(handle, 0, violation) == 0  # 0: NVML_PERF_POLICY_POWER
            readings.append((energy.value, violation[1] if capped else None))
        return readings
    finally:
        nvml.nvmlShutdown()


def power_summary(before, after, seconds, steps, unit="step"):
    """(joules per step per GPU, a line saying it with the mean power and the share of the time the power cap
    held the clocks down), from gpu_meters() read before and after `steps` steps (or calls: `unit`) that took
    `seconds`, averaged over the GPUs; (None, "") without readings."""
    if not before or len(before) != len(after) or seconds <= 0 or steps <= 0:
        return None, ""
    joules = np.mean([a[0] - b[0] for b, a in zip(before, after)]) / 1e3
    line = f"{joules / steps:.3g} J per {unit} per GPU, mean {joules / seconds:.0f} W"
    if all(r[1] is not None for r in before + after):
        share = np.mean([a[1] - b[1] for b, a in zip(before, after)]) / 1e9 / seconds
        line += f", clocks held down by the power cap {min(share, 1.0):.0%} of the time"
    return joules / steps, line


def check_counts(parser, args, *names):
    """parser.error on the first of the integer options `names` (args' attribute names) below 1, and on a
    top-k past the experts: sizes, chain lengths and repeats that would fail later inside a trace."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    for name in ("topk", "top_k"):
        if name in names and getattr(args, name) > args.experts:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at most --experts {args.experts}")


def environment():
    """Versions, devices, date and command line, recorded beside the results."""
    devices = jax.devices()
    return dict(
        jax=jax.__version__,
        devices=[d.device_kind for d in devices],
        platform=devices[0].platform,
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        command=" ".join(sys.argv),
    )
