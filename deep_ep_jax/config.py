"""One place for tunables: kernel launch shapes, timeouts and checks.

Defaults are tuned on 2x H200 (NVLink NV18); `benchmarks/tune_normal.py`
sweeps them. Environment variables override the defaults so a user can change
them without touching code:

  DEEP_EP_JAX_NUM_SMS        SMs the normal-mode kernels use (default 24; staged
                             mode, e.g. one process per GPU, adds up to as many
                             again that copy rows beside them)
  DEEP_EP_JAX_TIMEOUT_S      seconds a device-side wait spins before failing
  DEEP_EP_JAX_CHECKS         1: raise on bad data (expert ids out of range,
                             rows dropped, a low-latency combine's topk_idx
                             other than its dispatch's) instead of masking
  DEEP_EP_JAX_LL_OVERLAP_SMS SMs of the low-latency send halves run beside XLA's
                             work (default 0: on XLA's stream, see Config)
  DEEP_EP_JAX_MASK_FAILED_RANKS
                             1: low-latency mode masks a rank that does not
                             answer within the timeout instead of failing
                             (Config.mask_failed_ranks)
  DEEP_EP_JAX_GPUS_PER_HOST  GPUs of an EP group per host (default: as the
                             hostnames say); fewer than the group has makes it
                             span hosts (NVSHMEM), e.g. 1 to emulate two hosts
                             of one GPU each on one machine
  DEEP_EP_JAX_GPUS_PER_NVLINK_DOMAIN
                             GPUs per NVLink domain: the ranks that map each
                             other's memory are cut into nodes of this many
  DEEP_EP_JAX_DISPATCH_BUDGET_GIB
                             GiB per GPU that dispatch's worst-case results
                             may take (default 1; inf: none)
  DEEP_EP_JAX_NVLINK_DOMAIN  the NVLink domain across hosts of this process's
                             GPUs (default: NVML's fabric info; "none": none):
                             processes naming the same one are one node, their
                             memory mapped by NVSHMEM (distributed/topology.py)
  DEEP_EP_JAX_COUNT_TRAFFIC  1: normal mode counts the rows and bytes it moves
                             over NVLink and the network (Buffer.traffic())
  DEEP_EP_JAX_INTERNODE_PIPELINE
                             0: normal-mode dispatch and combine across hosts
                             run their send and forward stages one after the
                             other (default 1: pipelined by chunk; for A/B)
  DEEP_EP_JAX_POISON_PADDING 1: the xla backend's dispatches (normal and
                             low-latency) leave NaN in their padding rows, as
                             the kernels may (debug, on CPU)
  DEEP_EP_JAX_STAGED         1: one host's normal mode lands rows in the Buffer
                             first, as across processes (read when a CUDA
                             Buffer is made; for A/B and tests)

Unset or empty means the default; a value that does not parse is a ValueError
naming the variable.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import TypeVar

import ml_dtypes
import numpy as np

# Channels per FP8 scale: FP8 rows [T, H] come with float32 scales [T, H // FP8_BLOCK]
# (the API's contract; the CUDA extension's own value is checked equal when its
# FFI targets are registered).
FP8_BLOCK = 128
# Channels per MXFP8 scale (float8_e8m0fnu), low-latency dispatch's mxfp8 rows (the extension's too).
MXFP8_BLOCK = 32


@dataclasses.dataclass(frozen=True)
class RowFormat:
    """A quantized row format dispatch moves as bytes: data [T, H // pack] and scales
    [T, H // block], one scale per `block` channels (pack: channels per data element)."""

    name: str
    data: np.dtype
    scales: np.dtype
    block: int
    pack: int = 1


# The pairs dispatch takes besides bf16 rows [T, H], told apart by their dtypes. Wire formats
# are data: a format with a fixed number of bytes per row is one more line here.
ROW_FORMATS = (
    RowFormat("FP8", np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.float32), FP8_BLOCK),  # DeepEP's
    RowFormat("MXFP8", np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu), MXFP8_BLOCK),
    RowFormat("NVFP4", np.dtype(ml_dtypes.float4_e2m1fn), np.dtype(ml_dtypes.float8_e4m3fn), 16),
    RowFormat("NVFP4 packed", np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e4m3fn), 16, pack=2),  # 2 per byte
)
# Every pair's hidden is a multiple of this: each of its rows' arrays is then a whole number of
# 4-byte words, which the kernels copy.
PAIR_HIDDEN_MULTIPLE = 128


def row_bytes(xs) -> int:
    """Bytes of one row of arrays xs ([rows, ...] each; only their shapes and dtypes are read)."""
    return sum(int(np.prod(a.shape[1:])) * np.dtype(a.dtype).itemsize for a in xs)


def row_format(data_dtype, scales_dtype) -> RowFormat | None:
    """The ROW_FORMATS entry of a pair of these dtypes, or None."""
    key = (np.dtype(data_dtype), np.dtype(scales_dtype))
    return next((f for f in ROW_FORMATS if (f.data, f.scales) == key), None)


# What Buffer.traffic() reports per rank and operation (Config.count_traffic).
TRAFFIC_FIELDS = ("nvlink_rows", "nvlink_bytes", "network_rows", "network_bytes")


# The scalar checks of every module's argument checks (here: this module
# imports nothing of the package, so every module can use them).
def is_bool(value) -> bool:
    """A bool (a string such as "false" would count as true)."""
    return isinstance(value, (bool, np.bool_))


def is_int(value) -> bool:
    """An int, Python's or numpy's, but not a bool."""
    return isinstance(value, (int, np.integer)) and not is_bool(value)


def _env(name: str, default, parse, what: str):
    """The variable parsed, or default when unset or empty; a value that does
    not parse is an error naming the variable."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return parse(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not {what}") from None


_Default = TypeVar("_Default")  # int, or None for an optional setting


def _env_int(name: str, default: _Default) -> int | _Default:
    return _env(name, default, int, "an integer")


def _env_float(name: str, default: float) -> float:
    return _env(name, default, float, "a number")


def _env_optional_int(name: str) -> int | None:
    return _env_int(name, None)


def _parse_bool(value: str) -> bool:
    for result, spellings in ((True, ("1", "true", "yes", "on")), (False, ("0", "false", "no", "off"))):
        if value.lower() in spellings:
            return result
    raise ValueError(value)


def env_bool(name: str, default: bool) -> bool:
    return _env(name, default, _parse_bool, "one of 1/true/yes/on or 0/false/no/off")


# The variable of each Config field that has one, for messages on values read from it.
_ENV_VARS = dict(
    num_sms="DEEP_EP_JAX_NUM_SMS",
    timeout_s="DEEP_EP_JAX_TIMEOUT_S",
    low_latency_overlap_sms="DEEP_EP_JAX_LL_OVERLAP_SMS",
    gpus_per_host="DEEP_EP_JAX_GPUS_PER_HOST",
    gpus_per_nvlink_domain="DEEP_EP_JAX_GPUS_PER_NVLINK_DOMAIN",
    dispatch_budget_gib="DEEP_EP_JAX_DISPATCH_BUDGET_GIB",
)


def _from_env(var: str, value) -> bool:
    """Whether `value` is what environment variable `var` holds (so it most likely came from there)."""
    try:
        held = float(os.environ.get(var, "").strip())
    except ValueError:
        return False
    return held == value or (math.isnan(held) and isinstance(value, float) and math.isnan(value))


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch configuration of the CUDA kernels (ignored by the xla backend,
    except `checks`, `gpus_per_host`, `gpus_per_nvlink_domain`, `count_traffic`,
    `poison_padding`, `dispatch_budget_gib`, and `timeout_s` for the processes
    to meet when a Buffer spans several)."""

    num_sms: int = dataclasses.field(default_factory=lambda: _env_int("DEEP_EP_JAX_NUM_SMS", 24))
    # Tokens a warp takes at a time (normal mode).
    chunk_tokens: int = 2  # tuned on 2x H200: 1-2 balance the warps best (benchmarks/RESULTS.md)
    # Warps per block of the normal-mode copy kernels.
    num_warps: int = 16
    timeout_s: float = dataclasses.field(default_factory=lambda: _env_float("DEEP_EP_JAX_TIMEOUT_S", 20.0))
    checks: bool = dataclasses.field(default_factory=lambda: env_bool("DEEP_EP_JAX_CHECKS", False))
    # Ranks of an EP group on one host, in rank order, are cut into hosts of this
    # many GPUs; ranks on different (real or such) hosts talk through NVSHMEM.
    gpus_per_host: int | None = dataclasses.field(
        default_factory=lambda: _env_optional_int("DEEP_EP_JAX_GPUS_PER_HOST")
    )
    # A node's ranks (one host's, or one NVLink domain's across hosts), in rank
    # order, are cut into nodes of this many: the kernels' peer memory spans one
    # node, and ranks of other nodes talk through NVSHMEM. None: the whole node
    # (distributed/topology.py).
    gpus_per_nvlink_domain: int | None = dataclasses.field(
        default_factory=lambda: _env_optional_int("DEEP_EP_JAX_GPUS_PER_NVLINK_DOMAIN")
    )
    # Low-latency send halves (low_latency_*_send): 0 runs them on XLA's stream
    # (command-buffer compatible; compute placed before the receive waits for
    # the send). N > 0 runs them on N SMs on a stream beside XLA's, so that
    # compute between a send and its receive runs while the rows travel; the
    # send's receive must then come before any other low-latency operation of
    # the buffer (a second overlapped send excepted).
    low_latency_overlap_sms: int = dataclasses.field(default_factory=lambda: _env_int("DEEP_EP_JAX_LL_OVERLAP_SMS", 0))
    # Low-latency mode (CUDA backend): a rank that does not answer within timeout_s is masked
    # (low_latency_mask) and served around from then on, instead of the wait failing the kernel
    # (which loses the CUDA context: the process must restart). docs/usage.md, "When a rank fails".
    mask_failed_ranks: bool = dataclasses.field(
        default_factory=lambda: env_bool("DEEP_EP_JAX_MASK_FAILED_RANKS", False)
    )
    # Debug: normal-mode dispatch, cached dispatch and combine count the rows and
    # bytes they move over NVLink and over the network, per rank (Buffer.traffic(),
    # docs/internode.md). Off: no counting at all (a kernel argument, null).
    count_traffic: bool = dataclasses.field(default_factory=lambda: env_bool("DEEP_EP_JAX_COUNT_TRAFFIC", False))
    # Normal mode across hosts: dispatch's network send and NVLink forward, and
    # combine's NVLink gather and per-host reduction, overlap by chunk in one
    # kernel each (docs/internode.md). False runs them one after the other, as
    # separate kernels: for A/B measurements. Every process of the group must
    # agree (a mismatch stops the call with a message).
    internode_pipeline: bool = dataclasses.field(
        default_factory=lambda: env_bool("DEEP_EP_JAX_INTERNODE_PIPELINE", True)
    )
    # Debug, xla backend: dispatch's padding rows of recv_x (past num_recv_tokens; in low-latency mode past
    # each expert's recv_count) hold NaN, as they may on GPUs, instead of what XLA leaves there; so a test on
    # CPU shows an expert layer that does not mask them (a weight gradient recv_x^T @ dy turns NaN * 0 into NaN).
    poison_padding: bool = dataclasses.field(default_factory=lambda: env_bool("DEEP_EP_JAX_POISON_PADDING", False))
    # GiB per GPU that dispatch's results may take when sized for the worst case (num_worst_tokens
    # None: every token of every rank, T x R rows). Past it dispatch raises at trace time, naming
    # num_worst_tokens= and dropless_moe (bounded buffers): the worst case grows with the EP group.
    dispatch_budget_gib: float = dataclasses.field(
        default_factory=lambda: _env_float("DEEP_EP_JAX_DISPATCH_BUDGET_GIB", 1.0)
    )

    def __post_init__(self):
        # Types first: a string "false" would count as true, 2.5 SMs would be cut to 2.
        optionals = ("gpus_per_host", "gpus_per_nvlink_domain")
        for name in ("num_sms", "chunk_tokens", "num_warps", "low_latency_overlap_sms", *optionals):
            value, optional = getattr(self, name), name in optionals
            if not (is_int(value) or optional and value is None):
                raise TypeError(
                    f"Config.{name} must be an int{' or None' if optional else ''}, "
                    f"got {type(value).__name__} {value!r}"
                )
        for name in ("checks", "count_traffic", "internode_pipeline", "poison_padding", "mask_failed_ranks"):
            value = getattr(self, name)
            if not is_bool(value):
                raise TypeError(f"Config.{name} must be a bool, got {type(value).__name__} {value!r}")
        for name, unit in (("timeout_s", "seconds"), ("dispatch_budget_gib", "GiB")):
            value = getattr(self, name)
            if is_bool(value) or not isinstance(value, numbers.Real):
                raise TypeError(f"Config.{name} must be a number of {unit}, got {type(value).__name__} {value!r}")
        # Upper bounds of the launch shapes are the CUDA kernels' (checked when a CUDA Buffer is made).
        # Waits count whole milliseconds (the key-value store's) or nanoseconds: under 1 ms none could finish.
        for name, ok, requirement in (
            ("num_sms", self.num_sms >= 1, ">= 1"),
            ("chunk_tokens", self.chunk_tokens >= 1, ">= 1"),
            ("num_warps", self.num_warps >= 1, ">= 1"),
            ("timeout_s", 0.001 <= self.timeout_s <= 3600, "in [0.001, 3600]"),
            ("low_latency_overlap_sms", self.low_latency_overlap_sms >= 0, ">= 0"),
            ("dispatch_budget_gib", self.dispatch_budget_gib > 0, "> 0 (inf: no budget)"),
            ("gpus_per_host", self.gpus_per_host is None or self.gpus_per_host >= 1, ">= 1 or None"),
            (
                "gpus_per_nvlink_domain",
                self.gpus_per_nvlink_domain is None or self.gpus_per_nvlink_domain >= 1,
                ">= 1 or None",
            ),
        ):
            if not ok:
                value = getattr(self, name)
                var = _ENV_VARS.get(name)
                source = f" (from {var}={os.environ[var].strip()!r})" if var and _from_env(var, value) else ""
                raise ValueError(f"Config.{name} must be {requirement}, got {value}{source}")

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)
