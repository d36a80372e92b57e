"""benchmarks/timing.py's kernel breakdown on made-up profile events: time
per step by kernel name, busy time against the span, the first GPU only."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import timing


def test_kernel_breakdown_per_step(monkeypatch):
    ms = 1_000_000
    events = [("/device:GPU:0", "gemm", 0, 3 * ms), ("/device:GPU:0", "mask", 4 * ms, 5 * ms),
              ("/device:GPU:0", "gemm", 5 * ms, 8 * ms), ("/device:GPU:0", "mask", 9 * ms, 10 * ms),
              ("/device:GPU:1", "gemm", 0, 50 * ms)]
    monkeypatch.setattr(timing, "_gpu_kernels", lambda run, args: events)
    table, busy, span = timing.kernel_breakdown(None, (), num_steps=2)
    assert table == {"gemm": (1, pytest.approx(3e-3)), "mask": (1, pytest.approx(1e-3))}
    assert busy == pytest.approx(4e-3) and span == pytest.approx(5e-3)


def test_kernel_breakdown_without_gpu_kernels(monkeypatch):
    monkeypatch.setattr(timing, "_gpu_kernels", lambda run, args: [])
    assert timing.kernel_breakdown(None, (), num_steps=3) == ({}, 0.0, 0.0)
