"""benchmarks/timing.py's kernel breakdown on made-up profile events: time
per step by kernel name, busy time against the span, the first GPU only; its
energy summary on made-up meter readings."""

import pytest
import timing


def test_kernel_breakdown_per_step(monkeypatch):
    ms = 1_000_000
    events = [
        ("/device:GPU:0", "gemm", 0, 3 * ms),
        ("/device:GPU:0", "mask", 4 * ms, 5 * ms),
        ("/device:GPU:0", "gemm", 5 * ms, 8 * ms),
        ("/device:GPU:0", "mask", 9 * ms, 10 * ms),
        ("/device:GPU:1", "gemm", 0, 50 * ms),
    ]
    monkeypatch.setattr(timing, "_gpu_kernels", lambda run, args, runs=1: events)
    table, busy, span = timing.kernel_breakdown(None, (), num_steps=2)
    assert table == {"gemm": (1, pytest.approx(3e-3)), "mask": (1, pytest.approx(1e-3))}
    assert busy == pytest.approx(4e-3) and span == pytest.approx(5e-3)


def test_kernel_breakdown_splits_a_name_launched_several_times_a_step(monkeypatch):
    """Every Mosaic GPU kernel is `body_mosaic_gpu_kernel`: launched the same
    number of times in every step, it gets a row per launch of a step (in
    launch order); a name launched an uneven number of times keeps one row;
    names lose `void`, our namespace and their arguments."""
    ms = 1_000_000
    events = []
    for step in range(2):
        t = step * 100 * ms
        for i, (name, length) in enumerate(
            [("body_mosaic_gpu_kernel", 3), ("fusion", 1), ("body_mosaic_gpu_kernel", 2), ("body_mosaic_gpu_kernel", 5)]
        ):
            events.append(("/device:GPU:0", name, t + 10 * i * ms, t + (10 * i + length) * ms))
    events.append(
        (
            "/device:GPU:0",
            "void deep_ep_jax::intranode::(anonymous namespace)::Combine<2>(int4 const*)",
            150 * ms,
            151 * ms,
        )
    )
    monkeypatch.setattr(timing, "_gpu_kernels", lambda run, args, runs=1: events)
    table, busy, span = timing.kernel_breakdown(None, (), num_steps=2)
    ms_per_step = {name: round(seconds * 1e3, 6) for name, (_, seconds) in table.items()}
    assert ms_per_step == {
        "body_mosaic_gpu_kernel #1": 3,
        "body_mosaic_gpu_kernel #2": 2,
        "body_mosaic_gpu_kernel #3": 5,
        "fusion": 1,
        "intranode::Combine<2>": 0.5,
    }
    assert busy == pytest.approx(11.5e-3) and span == pytest.approx(75.5e-3)


def test_kernel_breakdown_without_gpu_kernels(monkeypatch):
    monkeypatch.setattr(timing, "_gpu_kernels", lambda run, args, runs=1: [])
    assert timing.kernel_breakdown(None, (), num_steps=3) == ({}, 0.0, 0.0)


def test_last_of_runs():
    """Two runs of one program: on each GPU, the second half of its events in start order."""
    events = [
        ("/device:GPU:0", "a", 0, 1),
        ("/device:GPU:0", "b", 2, 3),
        ("/device:GPU:1", "a", 0, 5),
        ("/device:GPU:0", "a", 10, 11),
        ("/device:GPU:0", "b", 12, 13),
        ("/device:GPU:1", "a", 6, 9),
    ]
    assert timing.last_of_runs(events, 2) == [
        ("/device:GPU:0", "a", 10, 11),
        ("/device:GPU:0", "b", 12, 13),
        ("/device:GPU:1", "a", 6, 9),
    ]
    assert sorted(timing.last_of_runs(events, 1)) == sorted(events)


def test_power_summary_averages_the_gpus():
    """Joules per step from the energy counters (mJ), mean power over the span, and the share of it the
    power cap held the clocks down (ns), each averaged over the GPUs."""
    before = [(1_000, 0), (5_000, 2 * 10**8)]
    after = [(21_000, 10**9), (35_000, 8 * 10**8)]  # 20 J and 30 J; 1.0 s and 0.6 s capped
    joules, line = timing.power_summary(before, after, seconds=2.5, steps=10)
    assert joules == pytest.approx(2.5)
    assert line == "2.5 J per step per GPU, mean 10 W, clocks held down by the power cap 32% of the time"


def test_power_summary_without_readings():
    """No NVML (a CPU machine): nothing to say; a GPU without the power-cap counter: energy only."""
    assert timing.power_summary([], [], seconds=1.0, steps=1) == (None, "")
    assert timing.power_summary([(0, None)], [], seconds=1.0, steps=1) == (None, "")
    joules, line = timing.power_summary([(0, None)], [(3_000, None)], seconds=1.0, steps=3, unit="call")
    assert joules == pytest.approx(1.0) and line == "1 J per call per GPU, mean 3 W"
