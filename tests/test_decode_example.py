"""The decoding example (examples/moe_decode.py): its experts on the
low-latency dispatch's expert-major rows against dense maths, its logits
check, and the script end to end on 8 virtual CPU devices (reference backend)."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import moe_decode as md
import numpy as np
import pytest
from script_run import run_script

ROOT = Path(__file__).resolve().parents[1]

H, F = 256, 64


def _bf16(a):
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def _dense_experts(rows, counts, w_in, w_out):
    """Per expert, SwiGLU of its first counts[e] rows (float32 [L, C, H]),
    with the example's bf16 roundings; zeros elsewhere."""
    out = np.zeros(rows.shape, np.float32)
    for e, n in enumerate(counts):
        gate_up = _bf16(_bf16(rows[e, :n]) @ _bf16(w_in[e]))
        gate, up = np.split(gate_up, 2, axis=-1)
        hidden = _bf16(gate / (1 + np.exp(-gate)) * up)
        out[e, :n] = _bf16(hidden @ _bf16(w_out[e]))
    return out


def _close(got, want, what, rel=2e-2):
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    err, scale = np.abs(got - want).max(), np.abs(want).max() + 1e-6
    assert err <= rel * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def _counts(rng, kind, num_local, capacity):
    if kind == "random":
        counts = rng.integers(0, capacity + 1, num_local)
        counts[rng.integers(num_local)] = 0  # an expert that gets nothing
        return counts
    if kind == "one_expert":  # every row on one expert, full
        counts = np.zeros(num_local, np.int64)
        counts[rng.integers(num_local)] = capacity
        return counts
    return np.zeros(num_local, np.int64)  # nothing received


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("kind", ["random", "one_expert", "none"])
def test_expert_mlp_matches_dense(kind, fp8, rng):
    """Compaction, grouped matmuls and expansion: the outputs of the valid
    rows equal per-expert dense maths, padding rows (NaN in the input) give
    zeros, whether the packed bound is tight or loose."""
    num_local, capacity = 5, 12
    counts = _counts(rng, kind, num_local, capacity)
    x = rng.standard_normal((num_local, capacity, H)).astype(np.float32)
    w_in = (rng.standard_normal((num_local, H, 2 * F)) * 0.1).astype(np.float32)
    w_out = (rng.standard_normal((num_local, F, H)) * 0.1).astype(np.float32)
    padding = np.arange(capacity)[None, :] >= counts[:, None]
    if fp8:
        scales = (rng.random((num_local, capacity, H // 128)) + 0.5).astype(np.float32) / 448
        q = jnp.asarray(np.clip(x, -3, 3) * 100, jnp.float8_e4m3fn)
        rows = np.asarray(q, np.float32).reshape(num_local, capacity, -1, 128) * scales[..., None]
        rows = rows.reshape(x.shape)
        q = jnp.where(padding[..., None], jnp.asarray(np.nan, jnp.float8_e4m3fn), q)
        recv_x = (q, jnp.asarray(np.where(padding[..., None], np.nan, scales)))
    else:
        rows = _bf16(x)
        recv_x = jnp.asarray(np.where(padding[..., None], np.nan, x), jnp.bfloat16)
    want = _dense_experts(rows, counts, w_in, w_out)
    for num_rows in (max(int(counts.sum()), 1), num_local * capacity):
        got = jax.jit(md.expert_mlp, static_argnums=4)(recv_x, jnp.asarray(counts, jnp.int32), w_in, w_out, num_rows)
        assert got.shape == x.shape and got.dtype == jnp.bfloat16
        _close(got, want, f"{kind}, fp8={fp8}, {num_rows} packed rows")
        assert (np.asarray(got, np.float32)[padding] == 0).all()


def test_check_logits_fails_beyond_tolerance(capsys, rng):
    """The example's check: passes within tolerance and with a few outlying
    sequences (router near-ties), fails on more of them or on NaN."""
    want = rng.standard_normal((100, 32)).astype(np.float32)
    scale = np.abs(want).max()
    assert md.check_logits(want + 0.009 * scale, want, "xla", fp8=False)
    assert not md.check_logits(want + 0.011 * scale, want, "xla", fp8=False)
    assert md.check_logits(want + 0.029 * scale, want, "xla", fp8=True)
    assert not md.check_logits(want + 0.031 * scale, want, "xla", fp8=True)
    outliers = want.copy()
    outliers[rng.choice(100, 2, replace=False)] += 0.5 * scale
    assert md.check_logits(outliers, want, "xla", fp8=False)
    outliers[rng.choice(np.flatnonzero(outliers[:, 0] == want[:, 0]), 1)] += 0.5 * scale
    assert not md.check_logits(outliers, want, "xla", fp8=False)
    nan = want.copy()
    nan[3, 4] = np.nan
    assert not md.check_logits(nan, want, "xla", fp8=False)
    assert "FAILED" in capsys.readouterr().out


def test_steps_sets_the_training_steps():
    """--steps (moe_flax's name) is --train-steps, not overridden by it."""
    args, margs = md.parse_args(["--steps", "5", "--hidden", "64"])
    assert (args.train_steps, margs.steps, margs.hidden) == (5, 5, 64)


@pytest.mark.parametrize("flag", ["--train-steps", "--overlap-sms"])
def test_negative_counts_exit_with_a_message(flag):
    with pytest.raises(SystemExit, match="^--train-steps .* and --overlap-sms .* must be at least 0$"):
        md.main([flag, "-1"])


@pytest.mark.parametrize("train_steps", ["3", "0"])
def test_decode_example_runs(train_steps):
    """The script with tiny sizes: the reference backend on a 2 x 4 mesh, the
    check passes with no sequence beyond the tolerance and every one within
    0.1% of the largest logit (the check itself allows more, for the GPU's
    kernels and near-ties), timings and tokens per second are printed; also
    an untrained model (--train-steps 0)."""
    run = run_script(
        "examples/moe_decode.py",
        "--train-steps",
        train_steps,
        "--train-batch",
        "16",
        "--batch",
        "4",
        "--prompt-len",
        "3",
        "--decode-steps",
        "2",
        "--repeats",
        "1",
        "--hidden",
        "64",
        "--ffn",
        "64",
        "--vocab",
        "64",
        "--seq-len",
        "8",
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "mesh {'data': 2, 'expert': 4}, backends ['xla']" in run.stdout, run.stdout
    checks = [line for line in run.stdout.splitlines() if line.startswith("check (xla): ")]
    assert len(checks) == 1 and checks[0].endswith(": OK"), run.stdout
    error = re.search(r"= ([\d.]+)% of max \|logit\| [\d.]+ on (\d+) of (\d+) sequences.*; 0 beyond it", checks[0])
    assert error and float(error[1]) <= 0.1 and error[2] == error[3], checks[0]
    assert re.search(
        r"xla: [\d,]+ tokens/s \(all devices\); per step [\d.]+ ms .*; MoE part alone [\d.]+ ms", run.stdout
    ), run.stdout
