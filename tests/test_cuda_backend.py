"""The CUDA backend's Python side on CPU: what registration checks against
the extension (result names, FP8 block, launch bounds), FFI targets with
named results, and the Buffer's operations picked once. The tests marked
`extension` compare with the built extension itself."""

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import deep_ep_jax as dej
from deep_ep_jax import _native
from deep_ep_jax.backends import Ops, reference
from deep_ep_jax.backends.cuda import (
    common,
    expert_major,
    fp8_quant,
    internode,
    intranode,
    layout,
    lifecycle,
    low_latency,
)
from deep_ep_jax.config import FP8_BLOCK

LIMITS = dict(
    max_group_ranks=1024,
    max_nvlink_ranks=72,
    max_internode_host_ranks=32,
    max_internode_normal_ranks=8,
    control_bytes=1 << 16,
    max_local_experts=4096,
    fp8_block=128,
    low_latency_max_topk=64,
    low_latency_max_experts=2048,
    low_latency_max_shared_bytes=48 * 1024,
    max_layout_bins=12288,
    max_blocks=132,
    max_warps=16,
)


def test_declared_results():
    declared = lifecycle.declared_ffi_outputs()
    targets = [t for m in (layout, intranode, internode, low_latency, expert_major, fp8_quant) for t in m.TARGETS]
    assert len(declared) == len(targets) == 25  # each of csrc/ffi/*.cc, once
    arrays = tuple(f.name for f in dataclasses.fields(dej.DispatchHandle) if not f.metadata.get("static"))
    assert declared["deep_ep_jax_dispatch"][4:-1] == arrays
    local = {"deep_ep_jax_get_dispatch_layout"} | {t.name for t in expert_major.TARGETS + fp8_quant.TARGETS}
    for name, results in declared.items():  # every call that communicates returns its Buffer's order state last
        assert (results[-1] == "order_out") == (name not in local), name
    assert declared["deep_ep_jax_internode_dispatch"] == declared["deep_ep_jax_dispatch"][:-1] + (
        "node_pos",
        "order_out",
    )
    for name, results in declared.items():
        assert len(set(results)) == len(results), name
        if name.endswith("_overlapped"):  # the same results as the half on XLA's stream
            assert results == declared[name.removesuffix("_overlapped")]


def test_registration_refuses_another_extension():
    declared = lifecycle.declared_ffi_outputs()
    lifecycle.check_ffi_outputs(declared, {k: list(v) for k, v in declared.items()})
    lifecycle.check_ffi_outputs(declared, {**declared, "deep_ep_jax_new_target": ["a"]})  # unused extras are fine
    swapped = dict(declared, deep_ep_jax_combine=["out_weights", "out"])
    with pytest.raises(RuntimeError, match=r"deep_ep_jax_combine: the extension returns \['out_weights', 'out'\]"):
        lifecycle.check_ffi_outputs(declared, swapped)
    missing = {k: v for k, v in declared.items() if k != "deep_ep_jax_low_latency_combine"}
    with pytest.raises(
        RuntimeError, match="rebuild the extension.*deep_ep_jax_low_latency_combine: not in the extension"
    ):
        lifecycle.check_ffi_outputs(declared, missing)
    lifecycle.check_fp8_block(LIMITS)
    with pytest.raises(RuntimeError, match="per 64 channels, the Python API per 128"):
        lifecycle.check_fp8_block(dict(LIMITS, fp8_block=64))


def test_launch_bounds_are_the_kernels():
    """Config takes any positive launch shape; a CUDA Buffer checks the kernels' bounds."""
    lifecycle.check_config(dej.Config(num_sms=132, num_warps=16, low_latency_overlap_sms=132), LIMITS)
    for field, value in (("num_sms", 133), ("num_warps", 17), ("low_latency_overlap_sms", 133)):
        with pytest.raises(ValueError, match=f"Config.{field} must be <= "):
            lifecycle.check_config(dej.Config(**{field: value}), LIMITS)
    with pytest.raises(ValueError, match="num_sms"):
        dej.Config(num_sms=0)


def test_ffi_target_results_by_name():
    target = common.FfiTarget("deep_ep_jax_test", ("a", "b"))
    with pytest.raises(TypeError, match=r"out_types names \['a'\], the target returns \('a', 'b'\)"):
        target(None, dict(a=jax.ShapeDtypeStruct((1,), jnp.int32)))


def test_ops_of_modules():
    assert Ops.of(reference).combine is reference.combine
    ops = Ops.of(layout, intranode, low_latency)
    assert ops.get_dispatch_layout is layout.get_dispatch_layout and ops.dispatch is intranode.dispatch
    with pytest.raises(TypeError, match=r"dispatch must be defined by exactly one module, found \[\]"):
        Ops.of(layout, low_latency)
    with pytest.raises(TypeError, match="found .*intranode.*internode"):
        Ops.of(layout, intranode, internode, low_latency)


def test_targets_registered_in_one_place():
    package = pathlib.Path(dej.__file__).parent
    callers = sorted(
        str(p.relative_to(package)) for p in package.rglob("*.py") if "register_ffi_target(" in p.read_text()
    )
    assert callers == ["backends/cuda/lifecycle.py"]


@pytest.mark.extension
def test_the_extension_matches():
    """The built extension returns what this package declares, with the interface's limits."""
    ext = _native.extension()
    lifecycle.check_ffi_outputs(lifecycle.declared_ffi_outputs(), ext.ffi_outputs())
    assert set(ext.ffi_outputs()) == set(ext.ffi_targets())
    limits = _native.limits()
    assert set(LIMITS) <= set(limits)
    assert limits["fp8_block"] == FP8_BLOCK
    assert limits["max_group_ranks"] >= limits["max_nvlink_ranks"] >= 2 and limits["control_bytes"] > 0


def test_every_trap_message_says_to_restart():
    """A trap loses the process's CUDA context: each message the kernels print before one ends with
    DEEP_EP_JAX_TRAP_NOTE (kernels/device.cuh), which says so and to restart."""
    csrc = pathlib.Path(__file__).resolve().parent.parent / "csrc"
    traps = messages = 0
    for path in sorted(csrc.rglob("*.cu*")):
        text = path.read_text()
        traps += len(re.findall(r"__trap\(\);", text))
        for message in re.findall(r"printf\((.*?)\);\s*__trap\(\);", text, re.S):
            assert "DEEP_EP_JAX_TRAP_NOTE" in message, (path.name, message[:200])
            messages += 1
    assert traps == messages >= 7, (traps, messages)
