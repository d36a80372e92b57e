"""benchmarks/bench_moe_layer.py on 4 CPU devices at small shapes: several
expert paths in one run, each beside the XLA-collectives layer and its
experts alone, sizes from the true routing (nothing dropped), memory per
device and the impl in every JSON row (--profile runs, finding no GPU
kernels); too few expert rows, unknown --expert-impl names (all of which --help
lists) and sizes below 1 are refused."""

import json
import re

import pytest
from script_run import run_script, run_scripts

SMALL = [
    "--tokens",
    "64",
    "--hidden",
    "128",
    "--ffn",
    "64",
    "--experts",
    "16",
    "--top-k",
    "4",
    "--backends",
    "xla",
    "--steps",
    "2",
    "--reps",
    "2",
]


def _run(*extra):
    return run_script("benchmarks/bench_moe_layer.py", *SMALL, *extra, devices=4)


BAD_SIZES = [
    (["--tokens", "0"], "--tokens 0 must be at least 1"),
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--top-k", "17"], "--top-k 17 must be at most --experts 16"),
    (["--experts", "6"], "--experts 6 must divide by the 4 devices"),
]
# The runs the script refuses, in one process (run_scripts): Python's start and the imports are most of each.
# A bad size comes after SMALL: the later flag wins.
REFUSED = {
    "help": ["--help"],
    "bogus impl": [*SMALL, "--expert-impl", "grouped,bogus"],
    **{f"bad size {i}": [*SMALL, "--expert-impl", "grouped", *argv] for i, (argv, _) in enumerate(BAD_SIZES)},
    "too few rows": [*SMALL, "--expert-impl", "grouped", "--expert-rows", "128", "--no-local"],  # after the routing
}


@pytest.fixture(scope="module")
def refused():
    runs = run_scripts([("benchmarks/bench_moe_layer.py", argv) for argv in REFUSED.values()], devices=4)
    return dict(zip(REFUSED, runs))


def test_capacity_and_grouped_in_one_run(tmp_path):
    out = tmp_path / "moe.json"
    run = _run("--expert-impl", "capacity,grouped", "--json", str(out), "--profile")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.count("no GPU kernels in the profile") == 4, run.stdout  # a CPU run has no GPU plane
    assert re.search(
        r"grouped experts \(\d+ expert-major rows per rank, largest count \d+, nothing dropped\)", run.stdout
    ), run.stdout
    for impl in ("capacity", "grouped"):
        assert re.search(rf"memory per device, GiB, {impl} experts: xla [0-9.]+, local [0-9.]+", run.stdout), run.stdout
    # The grouped layer's forward equals the capacity layer's up to bf16 rounding.
    diff = float(re.search(r"xla: grouped experts .* max \|diff\| = ([0-9.e-]+)", run.stdout).group(1))
    assert diff < 0.05, run.stdout
    data = json.loads(out.read_text())
    rows = [(r["impl"], r["layer"]) for r in data["results"]]
    assert rows == [("capacity", "xla"), ("capacity", "local"), ("grouped", "xla"), ("grouped", "local")]
    assert all(r["memory_gib"] > 0 and r["median_ms"] > 0 for r in data["results"])
    assert data["config"]["expert_impls"] == ["capacity", "grouped"]
    assert data["config"]["expert_rows"] % 128 == 0
    assert data["config"]["largest_rows_per_rank"] <= data["config"]["expert_rows"]


def test_too_few_expert_rows_refused(refused):
    run = refused["too few rows"]
    assert run.returncode != 0
    assert re.search(r"--expert-rows 128 drops [1-9][0-9]* \(token, expert\) pairs", run.stdout + run.stderr), (
        run.stdout + run.stderr
    )


def test_grouped_fp8_beside_grouped():
    """grouped_fp8 and grouped_fp8_dw (FP8 expert matmuls, the weights' copies made once per call; the
    latter's weight gradients on FP8 too) run beside grouped, their forwards close to the bf16 one's."""
    run = _run("--expert-impl", "grouped,grouped_fp8,grouped_fp8_dw", "--no-local")  # local: the test above
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "grouped_fp8 experts (" in run.stdout and "FP8 forward and input gradients," in run.stdout, run.stdout
    assert "grouped_fp8_dw experts (" in run.stdout, run.stdout
    assert "FP8 forward, input and weight gradients, rows sent as FP8" in run.stdout, run.stdout
    for impl in ("grouped_fp8", "grouped_fp8_dw"):
        diff = float(re.search(rf"xla: {impl} experts .* max \|diff\| = ([0-9.e-]+)", run.stdout).group(1))
        assert 0 < diff < 0.5, run.stdout


def test_expert_impl_names_in_help_and_refusal(refused):
    """--help lists every --expert-impl the run takes, and an unknown one is refused naming them all."""
    names = "auto, ragged_dot, capacity, grouped, grouped_fp8, grouped_fp8_dw"
    shown = refused["help"]
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert names in " ".join(shown.stdout.split()), shown.stdout
    run = refused["bogus impl"]
    assert run.returncode != 0
    assert f"--expert-impl: 'bogus' is not one of {names}" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("argv, message", BAD_SIZES)
def test_bad_sizes_refused(argv, message, refused):
    run = refused[f"bad size {BAD_SIZES.index((argv, message))}"]
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1].endswith(message), run.stderr[-2000:]
