"""The benchmarks no other test runs, run as a user on a CPU-only machine would: those that time XLA
run at small shapes and write what they say; those that need the CUDA kernels or a Hopper GPU refuse up
front, saying why, instead of failing inside a trace."""

import json
import re

import pytest
from script_run import run_script


def test_bench_low_latency_xla(tmp_path):
    out = tmp_path / "ll.json"
    run = run_script(
        "benchmarks/bench_low_latency.py",
        "--tokens",
        "16",
        "--hidden",
        "256",
        "--experts",
        "16",
        "--topk",
        "4",
        "--chain",
        "2",
        "--repeats",
        "2",
        "--overlap",
        "--json",
        str(out),
        devices=4,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "# low-latency mode, EP=4 on cpu" in run.stdout, run.stdout
    rows = [(r["op"], r["backend"]) for r in json.loads(out.read_text())["results"]]
    assert rows == [
        ("glue", "-"),
        ("dispatch", "xla"),
        ("combine", "xla"),
        ("pair", "xla"),
        ("compute", "-"),
        ("pair+compute", "xla"),
    ], rows


def test_combine_precision_bf16_partials_cost_accuracy():
    """Partials kept in float32 are as exact as the rank-order sum; bf16 partials are not."""
    run = run_script("benchmarks/combine_precision.py", "--tokens", "32", devices=1)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    table = re.findall(r"\| (\d+ x \d+) \| (none \(rank order\)|float32|bf16) \| ([0-9.e+-]+) \|", run.stdout)
    errors = {}
    for layout, partials, error in table:
        errors.setdefault(layout, {})[partials] = float(error)
    assert len(errors) >= 3, run.stdout
    for layout, by_partials in errors.items():
        exact = by_partials["none (rank order)"]
        assert exact < 3e-3 and by_partials["float32"] <= 1.01 * exact < by_partials["bf16"], (layout, by_partials)


def test_cuda_only_benchmarks_refuse_on_cpu():
    """Why is the extension's own reason: not built, or (here) no CUDA device visible."""
    for argv, message in (
        (
            ["benchmarks/bench_expert_major.py", "--tokens", "64"],
            "the CUDA kernels cannot run here, and this benchmark compares them: ",
        ),
        (
            ["benchmarks/bench_fp8_quant.py", "--experts", "4", "--rows", "256"],
            "--impls cuda: the CUDA kernels cannot run here (",
        ),
    ):
        run = run_script(*argv, devices=1)
        assert run.returncode == 2 and message in run.stderr, run.stdout[-2000:] + run.stderr[-2000:]


def test_hopper_only_benchmarks_refuse_on_cpu():
    for script in ("hopper_gemm_sweep.py", "fp8_gemm_sweep.py", "ncu_grouped_gemm.py"):
        run = run_script(f"benchmarks/{script}", devices=1)
        assert run.returncode != 0, script
        assert "needs a Hopper GPU (compute capability 9.x) for the Mosaic GPU kernels; JAX sees cpu" in run.stderr, (
            run.stdout[-2000:] + run.stderr[-2000:]
        )


def test_bench_fp8_quant_xla_alone():
    run = run_script(
        "benchmarks/bench_fp8_quant.py",
        "--experts",
        "1",  # one expert's weights (7168 x 4096) already take most of the time on CPU
        "--rows",
        "256",
        "--repeats",
        "2",
        "--impls",
        "xla",
        devices=1,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert re.search(r"^\| swiglu h \| xla \|", run.stdout, re.M), run.stdout


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("bench_low_latency.py", ["--chain", "0"], "--chain 0 must be at least 1"),
        ("bench_normal.py", ["--repeats", "0"], "--repeats 0 must be at least 1"),
        ("tune_normal.py", ["--experts", "16", "--topk", "17"], "--topk 17 must be at most --experts 16"),
        ("bench_grouped_gemm.py", ["--align", "0"], "--align 0 must be at least 1"),
    ],
)
def test_counts_below_one_refused(script, argv, message):
    """timing.check_counts: one argparse error naming the flag, before any device work."""
    run = run_script(f"benchmarks/{script}", *argv, devices=4)
    assert run.returncode == 2 and run.stderr.strip().endswith(message), run.stdout[-2000:] + run.stderr[-2000:]
