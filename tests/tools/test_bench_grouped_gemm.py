"""benchmarks/bench_grouped_gemm.py on one CPU device at small shapes: on a host without Hopper the
Mosaic impl is left out and says so; the xla impl runs in bf16 and with both FP8 weight copies, the groups
padded to --align, every row in the JSON; unknown impls and sweep kernels are refused before any work.
With tokamax installed (Python >= 3.12: .whl/tokamax/INSTALL.sh), its rows and --compare-shapes' table
are there too, every output checked; without it, asking for it is refused."""

import importlib.util
import json

import pytest
from script_run import run_script, run_scripts

# 16 experts: the compile time of 256 groups adds nothing here.
SMALL = ["--tokens", "64", "--hidden", "128", "--ffn", "64", "--experts", "16", "--chain", "1", "--repeats", "2"]


def _run(*extra):
    return run_script("benchmarks/bench_grouped_gemm.py", *SMALL, *extra, devices=1)


def test_xla_impl_bf16_and_fp8(tmp_path):
    out = tmp_path / "gemm.json"
    run = _run("--align", "4", "--fp8", "--fp8-weight-grad", "--json", str(out))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "# no Hopper GPU here: impl=mgpu left out" in run.stdout, run.stdout
    data = json.loads(out.read_text())
    rows = [(r["impl"], r["op"]) for r in data["results"]]
    variants = ("xla", "xla fp8", "xla fp8 dw")
    assert rows == [(v, op) for v in variants for op in ("forward", "forward+backward")] + [
        ("fp8_weights", "w_in and w_out")
    ], rows
    assert all(len(r["samples_ms"]) == 2 for r in data["results"])
    sizes = data["sizes"]
    assert len(sizes) == 8 and all(s % 4 == 0 for s in sizes)  # 16 experts over 2 ranks, each group aligned
    assert 0 < data["pairs"] <= sum(sizes) <= data["rows"] and data["rows"] % 128 == 0
    assert data["swept"] == []


UNKNOWN_NAMES = [
    ("--impls", "xla,bogus", "--impls: ['bogus'] not among ['mgpu', 'xla', 'tokamax']"),
    ("--sweep-kernels", "forward,bogus", "--sweep-kernels: ['bogus'] not among"),
]
HAVE_TOKAMAX = importlib.util.find_spec("tokamax") is not None
WITHOUT_TOKAMAX = [] if HAVE_TOKAMAX else [["--impls", "xla,tokamax"], ["--compare-shapes"]]


@pytest.fixture(scope="module")
def refused():
    """The runs the script refuses, in one process (run_scripts): Python's start and the imports are most of
    each."""
    argvs = [[flag, value] for flag, value, _ in UNKNOWN_NAMES] + WITHOUT_TOKAMAX
    runs = run_scripts([("benchmarks/bench_grouped_gemm.py", [*SMALL, *argv]) for argv in argvs], devices=1)
    return dict(unknown_names=runs[: len(UNKNOWN_NAMES)], without_tokamax=runs[len(UNKNOWN_NAMES) :])


def test_unknown_names_refused(refused):
    for (_, _, message), run in zip(UNKNOWN_NAMES, refused["unknown_names"]):
        assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
        assert message in run.stderr and "pairs in" not in run.stdout, run.stderr[-2000:]


@pytest.mark.skipif(HAVE_TOKAMAX, reason="tokamax is installed: the tests below run it")
def test_tokamax_missing_refused(refused):
    assert len(refused["without_tokamax"]) == 2
    for run in refused["without_tokamax"]:
        assert run.returncode == 2 and "tokamax is not installed" in run.stderr, run.stdout[-2000:] + run.stderr[-2000:]


@pytest.mark.skipif(not HAVE_TOKAMAX, reason="tokamax is not installed (bash .whl/tokamax/INSTALL.sh, Python >= 3.12)")
def test_tokamax_rows_checked(tmp_path):
    out = tmp_path / "gemm.json"
    run = _run("--impls", "xla,tokamax", "--align", "4", "--fp8", "--json", str(out))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    rows = [r["impl"] for r in json.loads(out.read_text())["results"]]
    assert {"tokamax default", "tokamax xla", "tokamax default fp8w", "tokamax xla fp8w"} <= set(rows), rows
    for name in ("tokamax default", "tokamax xla"):  # the same maths as ours' xla path: the same bits
        assert f"# {name} vs xla output: max error 0.00e+00" in run.stdout, run.stdout


@pytest.mark.skipif(not HAVE_TOKAMAX, reason="tokamax is not installed (bash .whl/tokamax/INSTALL.sh, Python >= 3.12)")
def test_compare_shapes_table(tmp_path):
    out = tmp_path / "cmp.json"
    run = _run("--compare-shapes", "--compare-ranks", "2,8", "--align", "8", "--repeats", "2", "--json", str(out))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    data = json.loads(out.read_text())
    cases = [(r["load"].split()[0], r["case"]) for r in data["table"]]
    kinds = [
        "bf16 forward",
        "bf16 input grad",
        "bf16 weight grad",
        "bf16 SwiGLU forward",
        "bf16 SwiGLU forward+backward",
        "FP8 SwiGLU forward",
        "FP8 SwiGLU forward+backward",
    ]
    assert cases == [(ranks, kind) for ranks in ("2", "8") for kind in kinds], cases
    assert all(r["ours"] and r["tokamax"] for r in data["table"]), data["table"]
    checked = [r for r in data["results"] if isinstance(r.get("error"), float)]
    assert checked and all(r["ok"] for r in checked), checked
    assert out.with_suffix(".md").read_text() in run.stdout
