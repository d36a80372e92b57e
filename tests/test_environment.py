"""The environment overrides: every DEEP_EP_JAX_* variable the package reads
reaches what it sets, is read when its object is made (not at import), and a
value that does not parse is an error naming the variable. CPU; the test
marked `extension` lowers a CUDA call to see the values in its attributes."""

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import deep_ep_jax as dej
from deep_ep_jax import launch
from deep_ep_jax import testing as dt
from deep_ep_jax.backends.cuda import internode, intranode, sizes
from deep_ep_jax.distributed import topology

# Config's variables: (variable, Config field, a value, the field's value then, the field's default).
CONFIG_VARIABLES = [
    ("DEEP_EP_JAX_NUM_SMS", "num_sms", "7", 7, 24),
    ("DEEP_EP_JAX_TIMEOUT_S", "timeout_s", "2.5", 2.5, 20.0),
    ("DEEP_EP_JAX_CHECKS", "checks", "1", True, False),
    ("DEEP_EP_JAX_LL_OVERLAP_SMS", "low_latency_overlap_sms", "16", 16, 0),
    ("DEEP_EP_JAX_GPUS_PER_HOST", "gpus_per_host", "1", 1, None),
    ("DEEP_EP_JAX_GPUS_PER_NVLINK_DOMAIN", "gpus_per_nvlink_domain", "4", 4, None),
    ("DEEP_EP_JAX_DISPATCH_BUDGET_GIB", "dispatch_budget_gib", "inf", float("inf"), 1.0),
    ("DEEP_EP_JAX_COUNT_TRAFFIC", "count_traffic", "1", True, False),
    ("DEEP_EP_JAX_INTERNODE_PIPELINE", "internode_pipeline", "0", False, True),
    ("DEEP_EP_JAX_POISON_PADDING", "poison_padding", "1", True, False),
    ("DEEP_EP_JAX_MASK_FAILED_RANKS", "mask_failed_ranks", "1", True, False),
]
OTHER_VARIABLES = [intranode.STAGED_ENV, launch.LOCAL_DEVICE_VAR, launch.RECOVERABLE_VAR, topology.DOMAIN_VAR]
LAUNCH_VARIABLES = [launch.COORDINATOR_VAR, launch.NUM_PROCESSES_VAR, launch.PROCESS_ID_VAR]


@pytest.fixture(autouse=True)
def unset(monkeypatch):
    """Each test starts with none of the variables set (the caller's shell may set some)."""
    for name in [v[0] for v in CONFIG_VARIABLES] + OTHER_VARIABLES + LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_every_variable_is_tested():
    """A DEEP_EP_JAX_ variable the package reads, and this file does not test, fails here."""
    package = pathlib.Path(dej.__file__).parent
    read = set()
    for path in package.rglob("*.py"):
        read |= set(re.findall(r"[\"'](DEEP_EP_JAX_[A-Z0-9_]+)[\"']", path.read_text()))
    assert read == {v[0] for v in CONFIG_VARIABLES} | set(OTHER_VARIABLES)


@pytest.mark.parametrize("name, field, value, expected, default", CONFIG_VARIABLES)
def test_config_variable(monkeypatch, name, field, value, expected, default):
    made_before = dej.Config()
    assert getattr(made_before, field) == default
    monkeypatch.setenv(name, value)
    assert getattr(dej.Config(), field) == expected  # read when a Config is made
    assert getattr(made_before, field) == default
    assert getattr(dej.Config(**{field: default}), field) == default  # an argument wins
    monkeypatch.setenv(name, "")
    assert getattr(dej.Config(), field) == default  # empty means unset


def test_timeout_reaches_timeout_ns(monkeypatch):
    monkeypatch.setenv("DEEP_EP_JAX_TIMEOUT_S", "0.25")
    assert dej.Config().timeout_ns == 250_000_000


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off", False),
    ],
)
def test_checks_spellings(monkeypatch, value, expected):
    monkeypatch.setenv("DEEP_EP_JAX_CHECKS", value)
    assert dej.Config().checks is expected


@pytest.mark.parametrize(
    "name, value",
    [
        ("DEEP_EP_JAX_NUM_SMS", "many"),
        ("DEEP_EP_JAX_NUM_SMS", "2.5"),
        ("DEEP_EP_JAX_TIMEOUT_S", "20s"),
        ("DEEP_EP_JAX_CHECKS", "ture"),
        ("DEEP_EP_JAX_LL_OVERLAP_SMS", "half"),
        ("DEEP_EP_JAX_GPUS_PER_HOST", "two"),
        ("DEEP_EP_JAX_GPUS_PER_NVLINK_DOMAIN", "eight"),
        ("DEEP_EP_JAX_DISPATCH_BUDGET_GIB", "4GiB"),
        ("DEEP_EP_JAX_MASK_FAILED_RANKS", "maybe"),
    ],
)
def test_unparsable_value_names_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"^environment variable {name}='{value}' is not "):
        dej.Config()


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("DEEP_EP_JAX_NUM_SMS", "0", r"Config.num_sms must be >= 1, got 0"),
        ("DEEP_EP_JAX_TIMEOUT_S", "0", r"Config.timeout_s must be in \[0.001, 3600\], got 0.0"),
        ("DEEP_EP_JAX_LL_OVERLAP_SMS", "-1", r"Config.low_latency_overlap_sms must be >= 0, got -1"),
        ("DEEP_EP_JAX_GPUS_PER_HOST", "0", r"Config.gpus_per_host must be >= 1 or None, got 0"),
        ("DEEP_EP_JAX_DISPATCH_BUDGET_GIB", "0", r"Config.dispatch_budget_gib must be > 0 \(inf: no budget\), got 0.0"),
    ],
)
def test_out_of_range_value_is_refused(monkeypatch, name, value, match):
    """The message names the variable the value came from (a user who never wrote a Config)."""
    monkeypatch.setenv(name, f" {value} ")
    with pytest.raises(ValueError, match=f"^{match} \\(from {name}='{value}'\\)$"):
        dej.Config()


def test_out_of_range_value_passed_names_no_variable(monkeypatch):
    monkeypatch.setenv("DEEP_EP_JAX_NUM_SMS", "8")
    with pytest.raises(ValueError, match=r"^Config.num_sms must be >= 1, got 0$"):
        dej.Config(num_sms=0)


def test_checks_variable_turns_checks_on():
    """DEEP_EP_JAX_CHECKS=1 when a Buffer is made: its calls check the data
    (a Buffer made without it masks bad ids silently)."""
    num_ranks, num_experts = 4, 8
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    idx, _ = dt.make_routing(3, num_ranks * 6, num_experts, 2, num_ranks)
    bad = jnp.asarray(idx).at[5, 1].set(num_experts + 1)

    def layout(buffer):
        return dej.checked(
            dt.per_rank(lambda i: dej.get_dispatch_layout(i, num_experts=num_experts, buffer=buffer), mesh, "ep")
        )

    unchecked = layout(dej.Buffer(mesh, "ep", backend="xla"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DEEP_EP_JAX_CHECKS", "1")
        checked = layout(dej.Buffer(mesh, "ep", backend="xla"))
    unchecked(bad)
    checked(jnp.asarray(idx))
    with pytest.raises(dej.CheckError, match=r"^get_dispatch_layout: topk_idx holds expert ids outside \[-1, 8\)"):
        checked(bad)


@pytest.mark.parametrize(
    "value, expected",
    [("1", True), ("true", True), ("on", True), ("0", False), ("no", False), ("enable", None), ("2", None)],
)
def test_staged_variable(monkeypatch, value, expected):
    """Spelled as the other flags; anything else is an error naming it (not off)."""
    assert intranode.staged_requested() is False
    monkeypatch.setenv(intranode.STAGED_ENV, value)
    if expected is None:
        with pytest.raises(ValueError, match=f"^environment variable DEEP_EP_JAX_STAGED='{value}' is not one of"):
            intranode.staged_requested()
    else:
        assert intranode.staged_requested() is expected


def test_local_device_variable(monkeypatch):
    """--all-gpus-visible: the launcher names each process's GPU in
    DEEP_EP_JAX_LOCAL_DEVICE, and initialize() hands it to jax.distributed."""
    env = launch._child_env(1, 2, "127.0.0.1:5555", ["4", "6"], cpu=False, all_gpus_visible=True)
    assert env[launch.LOCAL_DEVICE_VAR] == "1" and env["CUDA_VISIBLE_DEVICES"] == "4,6"
    assert launch.LOCAL_DEVICE_VAR not in launch._child_env(1, 2, "127.0.0.1:5555", ["4", "6"], cpu=False)

    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(jax.config, "update", lambda *args: None)  # leave this process's CPU collectives alone
    for name in LAUNCH_VARIABLES + [launch.LOCAL_DEVICE_VAR]:
        monkeypatch.setenv(name, env[name])
    launch.initialize()
    monkeypatch.delenv(launch.LOCAL_DEVICE_VAR)
    launch.initialize()
    common = {
        "coordinator_address": "127.0.0.1:5555",
        "num_processes": 2,
        "process_id": 1,
        "cluster_detection_method": "deactivate",
    }
    assert calls == [dict(common, local_device_ids=[1]), common]


@pytest.mark.parametrize("value, expected", [("1", True), ("yes", True), ("0", False), ("false", False), ("x", None)])
def test_recoverable_variable(monkeypatch, value, expected):
    """DEEP_EP_JAX_RECOVERABLE (launch --keep-going) is spelled as the other flags; anything else is an error
    naming it (not on)."""
    updates = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: None)
    monkeypatch.setattr(jax.config, "update", lambda *args: updates.append(args))
    for name, v in zip(LAUNCH_VARIABLES, ("127.0.0.1:5555", "2", "1")):
        monkeypatch.setenv(name, v)
    monkeypatch.setenv(launch.RECOVERABLE_VAR, value)
    if expected is None:
        with pytest.raises(ValueError, match=f"^environment variable {launch.RECOVERABLE_VAR}='x' is not one of"):
            launch.initialize()
    else:
        launch.initialize()
        assert (("jax_enable_recoverability", True) in updates) is expected


@pytest.mark.extension
def test_launch_variables_reach_the_kernels(monkeypatch):
    """DEEP_EP_JAX_NUM_SMS and DEEP_EP_JAX_TIMEOUT_S end up in the attributes
    of the CUDA dispatch (through the Config a Buffer makes)."""
    monkeypatch.setenv("DEEP_EP_JAX_NUM_SMS", "7")
    monkeypatch.setenv("DEEP_EP_JAX_TIMEOUT_S", "2.5")
    buffer = dt.stand_in_cuda_buffer(2, num_nvl_bytes=1 << 16)
    x = jax.ShapeDtypeStruct((16, 256), jnp.bfloat16)
    idx, w = jax.ShapeDtypeStruct((16, 4), jnp.int32), jax.ShapeDtypeStruct((16, 4), jnp.float32)

    def dispatch(x, idx, w):
        return intranode.dispatch((x,), idx, w, num_experts=8, num_worst_tokens=None, buffer=buffer)

    text = jax.jit(dispatch).lower(x, idx, w).as_text()
    assert "num_sms = 7 : i64" in text, text
    assert "timeout_ns = 2500000000 : i64" in text, text


@pytest.mark.extension
@pytest.mark.parametrize("value, expected", [(None, 1), ("0", 0), ("off", 0), ("1", 1)])
def test_internode_pipeline_variable_reaches_the_kernels(monkeypatch, value, expected):
    """DEEP_EP_JAX_INTERNODE_PIPELINE (default on) ends up in the attributes
    of every internode call: dispatch, cached dispatch and combine."""
    if value is not None:
        monkeypatch.setenv("DEEP_EP_JAX_INTERNODE_PIPELINE", value)
    num_ranks, num_nodes, tokens, hidden, topk = 4, 2, 16, 256, 4
    buffer = dt.stand_in_cuda_buffer(
        num_ranks,
        num_nodes=num_nodes,
        spans_hosts=True,
        num_nvl_bytes=sizes.internode_region_bytes(num_ranks, num_nodes, hidden, tokens, topk),
    )
    x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
    idx, w = jax.ShapeDtypeStruct((tokens, topk), jnp.int32), jax.ShapeDtypeStruct((tokens, topk), jnp.float32)

    def round_trip(x, idx, w):
        recv_xs, _, recv_w, handle = internode.dispatch(
            (x,), idx, w, num_experts=8, num_worst_tokens=None, buffer=buffer
        )
        again = internode.cached_dispatch((x,), w, handle, buffer=buffer)
        return again, internode.combine(recv_xs[0], recv_w, handle, buffer=buffer)

    text = jax.jit(round_trip).lower(x, idx, w).as_text()
    assert text.count(f"pipeline = {expected} : i64") == 3, text
