"""deep_ep_jax: DeepEP's expert-parallel dispatch and combine for JAX.

    from deep_ep_jax import Buffer, dispatch, combine
    from deep_ep_jax import dispatch_expert_major, combine_expert_major  # rows grouped by expert
    from deep_ep_jax import dropless_moe  # dispatch, experts, combine in rounds of bounded memory

All operations run per rank inside `jax.shard_map` over the buffer's axis.
"""

from deep_ep_jax.comm.buffer import Buffer
from deep_ep_jax.comm.dropless import default_capacity, dropless_moe
from deep_ep_jax.comm.expert_major import (
    combine_expert_major,
    dispatch_expert_major,
    expand,
    grouped_matmul_reduce,
    reduce,
)
from deep_ep_jax.comm.handle import DispatchHandle, ExpertLayout, LowLatencyHandle
from deep_ep_jax.comm.low_latency import (
    drop_masked_experts,
    low_latency_combine,
    low_latency_combine_recv,
    low_latency_combine_send,
    low_latency_dispatch,
    low_latency_dispatch_recv,
    low_latency_dispatch_send,
    low_latency_mask,
    low_latency_overlap,
    low_latency_set_mask,
)
from deep_ep_jax.comm.normal import CHECKPOINT_NAMES, combine, dispatch, get_dispatch_layout
from deep_ep_jax.comm.quantize import dequantize, quantize
from deep_ep_jax.comm.validation import CheckError, checked
from deep_ep_jax.config import Config
from deep_ep_jax.experts.grouped_gemm import grouped_matmul

__version__ = "0.1.0"

__all__ = [
    "CHECKPOINT_NAMES",
    "Buffer",
    "CheckError",
    "Config",
    "DispatchHandle",
    "ExpertLayout",
    "LowLatencyHandle",
    "checked",
    "combine",
    "combine_expert_major",
    "default_capacity",
    "dequantize",
    "dispatch",
    "dispatch_expert_major",
    "drop_masked_experts",
    "dropless_moe",
    "expand",
    "get_dispatch_layout",
    "grouped_matmul",
    "grouped_matmul_reduce",
    "low_latency_combine",
    "low_latency_combine_recv",
    "low_latency_combine_send",
    "low_latency_dispatch",
    "low_latency_dispatch_recv",
    "low_latency_dispatch_send",
    "low_latency_mask",
    "low_latency_overlap",
    "low_latency_set_mask",
    "quantize",
    "reduce",
]
