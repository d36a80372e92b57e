"""benchmarks/bench_grouped_gemm.py on one CPU device at small shapes: on a host without Hopper the
Mosaic impl is left out and says so; the xla impl runs in bf16 and with both FP8 weight copies, the groups
padded to --align, every row in the JSON; unknown impls and sweep kernels are refused before any work."""

import json

from script_run import run_script

SMALL = ["--tokens", "64", "--hidden", "128", "--ffn", "64", "--chain", "1", "--repeats", "2"]


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
    assert rows == [(v, op) for v in variants for op in ("forward", "forward+backward")] + \
        [("fp8_weights", "w_in and w_out")], rows
    assert all(len(r["samples_ms"]) == 2 for r in data["results"])
    sizes = data["sizes"]
    assert len(sizes) == 128 and all(s % 4 == 0 for s in sizes)  # 256 experts over 2 ranks, each group aligned
    assert 0 < data["pairs"] <= sum(sizes) <= data["rows"] and data["rows"] % 128 == 0
    assert data["swept"] == []


def test_unknown_names_refused():
    for flag, value, message in (("--impls", "xla,bogus", "--impls: ['bogus'] not among ['mgpu', 'xla']"),
                                 ("--sweep-kernels", "forward,bogus", "--sweep-kernels: ['bogus'] not among")):
        run = _run(flag, value)
        assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
        assert message in run.stderr and "pairs in" not in run.stdout, run.stderr[-2000:]
