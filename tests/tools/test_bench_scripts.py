"""The benchmarks no other test runs, run as a user on a CPU-only machine would: those that time XLA
run at small shapes and write what they say; those that need the CUDA kernels or a Hopper GPU refuse up
front, saying why, instead of failing inside a trace."""

import json
import re

import pytest
from script_run import run_script, run_scripts


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
        "--chain",  # chains of 1 and 2 operations: each timed as at any length, in smaller programs
        "1",
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


CUDA_ONLY = [
    (
        ["benchmarks/bench_expert_major.py", "--tokens", "64"],
        "the CUDA kernels cannot run here, and this benchmark compares them: ",
    ),
    (
        ["benchmarks/bench_fp8_quant.py", "--experts", "4", "--rows", "256"],
        "--impls cuda: the CUDA kernels cannot run here (",
    ),
]
HOPPER_ONLY = ["hopper_gemm_sweep.py", "fp8_gemm_sweep.py", "ncu_grouped_gemm.py"]
COUNTS_BELOW_ONE = [
    ("bench_low_latency.py", ["--chain", "0"], "--chain 0 must be at least 1"),
    ("bench_normal.py", ["--repeats", "0"], "--repeats 0 must be at least 1"),
    ("tune_normal.py", ["--experts", "16", "--topk", "17"], "--topk 17 must be at most --experts 16"),
    ("bench_grouped_gemm.py", ["--align", "0"], "--align 0 must be at least 1"),
]


@pytest.fixture(scope="module")
def refused():
    """The runs the scripts refuse, in one process per device count (run_scripts): Python's start and the
    imports are most of each."""
    on_one = run_scripts(
        [(argv[0], argv[1:]) for argv, _ in CUDA_ONLY] + [(f"benchmarks/{script}", []) for script in HOPPER_ONLY],
        devices=1,
    )
    on_four = run_scripts([(f"benchmarks/{script}", argv) for script, argv, _ in COUNTS_BELOW_ONE], devices=4)
    return dict(cuda_only=on_one[: len(CUDA_ONLY)], hopper_only=on_one[len(CUDA_ONLY) :], counts_below_one=on_four)


def test_cuda_only_benchmarks_refuse_on_cpu(refused):
    """Why is the extension's own reason: not built, or (here) no CUDA device visible."""
    for (_, message), run in zip(CUDA_ONLY, refused["cuda_only"]):
        assert run.returncode == 2 and message in run.stderr, run.stdout[-2000:] + run.stderr[-2000:]


def test_hopper_only_benchmarks_refuse_on_cpu(refused):
    for script, run in zip(HOPPER_ONLY, refused["hopper_only"]):
        assert run.returncode != 0, script
        assert "needs a Hopper GPU (compute capability 9.x) for the Mosaic GPU kernels; JAX sees cpu" in run.stderr, (
            run.stdout[-2000:] + run.stderr[-2000:]
        )


def test_bench_fp8_quant_xla_alone():
    run = run_script(
        "benchmarks/bench_fp8_quant.py",
        "--experts",
        "1",
        "--rows",
        "256",
        "--hidden",  # every case's maths at small shapes: DeepSeek-V3's take most of the time on CPU
        "256",
        "--ffn",
        "128",
        "--repeats",
        "2",
        "--impls",
        "xla",
        devices=1,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert re.search(r"^\| swiglu h \| xla \|", run.stdout, re.M), run.stdout


@pytest.mark.parametrize("script, argv, message", COUNTS_BELOW_ONE)
def test_counts_below_one_refused(script, argv, message, refused):
    """timing.check_counts: one argparse error naming the flag, before any device work."""
    run = refused["counts_below_one"][COUNTS_BELOW_ONE.index((script, argv, message))]
    assert run.returncode == 2 and run.stderr.strip().endswith(message), run.stdout[-2000:] + run.stderr[-2000:]
