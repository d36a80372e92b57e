"""The decoding example (examples/moe_decode.py) on all GPUs: the low-latency
CUDA kernels and the reference backend each pass the example's check against
the full forward, with bf16 dispatch on XLA's stream and with FP8 dispatch
whose sends run beside the attention (Config.low_latency_overlap_sms).

    pytest tests/gpu/test_decode_example_gpu.py -v -s
"""

import re

import moe_decode
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("extra", [[], ["--fp8", "--overlap-sms", "16"]], ids=["bf16", "fp8-overlapped"])
def test_decode_example_on_both_backends(extra, capsys):
    moe_decode.main(
        [
            "--train-steps",
            "10",
            "--batch",
            "32",
            "--prompt-len",
            "6",
            "--decode-steps",
            "8",
            "--repeats",
            "3",
            "--hidden",
            "256",
            "--ffn",
            "128",
            "--experts",
            "16",
            "--top-k",
            "4",
            "--backend",
            "cuda",
            *extra,
        ]
    )
    out = capsys.readouterr().out
    print(out)
    assert "backends ['cuda', 'xla']" in out, out
    for backend in ("cuda", "xla"):
        checks = [line for line in out.splitlines() if line.startswith(f"check ({backend}): ")]
        assert len(checks) == 1 and checks[0].endswith(": OK"), out
        assert re.search(
            rf"{backend}: [\d,]+ tokens/s \(all devices\); per step [\d.]+ ms .*; MoE part alone "
            r"[\d.]+ ms",
            out,
        ), out
