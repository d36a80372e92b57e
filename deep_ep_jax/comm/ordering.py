"""Calls of one Buffer run one at a time, in one order on every rank.

A Buffer's calls share state on the device (sequence numbers, flags, work
counters), and peers meet by call: rank 0's n-th call on a Buffer exchanges
with rank 1's n-th call. So XLA must run them one after another, in program
order, on every rank, whatever its schedule (concurrent command buffers,
several streams, independent micro-batches in one program).

To make that order a data dependence XLA sees, each CUDA call of a Buffer
takes the Buffer's *order state* (int32 [1]) as an operand aliased to a
result, and the next call takes that result: the calls form a chain. The
state holds the call's position along the chain; the kernels publish it with
their ready flags and stop with a message when a peer is at another position
(csrc/kernels/device.cuh, CheckPeerCall).

While a function is traced, each Buffer keeps the latest state of each
trace: a call takes the newest state of its own trace or of one it is nested
in, or starts a chain with a fresh state. A chain cannot leave
the body it was traced in (a `shard_map`, `scan` or `cond` body), so calls in
two separate bodies of one program are ordered only by the data flowing
between them; the device checks turn a wrong order there into an error, never
into mixed data. `custom_vjp` functions pass the state through explicitly
(`deep_ep_jax.comm.normal`), so a chain runs through gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import core

_chains: dict = {}  # Buffer key -> [state of each enclosing trace, outermost first]


def _enclosing_traces() -> list:
    """The current trace and those it is nested in (values of these may be used now)."""
    traces, trace = [], core.trace_ctx.trace
    while trace is not None:
        traces.append(trace)
        trace = getattr(trace, "parent_trace", None)
    return traces


def _usable(buffer) -> list:
    """The Buffer's recorded states that the current trace may use, outermost first."""
    traces = _enclosing_traces()
    return [state for state in _chains.get(buffer.buffer_id, []) if any(state._trace is t for t in traces)]


def take(buffer) -> jax.Array:
    """The Buffer's order state for the next call: the newest usable one, or a fresh one."""
    chain = _usable(buffer)
    _chains[buffer.buffer_id] = chain
    return chain[-1] if chain else jnp.zeros((1,), jnp.int32)


def put(buffer, state) -> None:
    """Records a call's resulting order state. Outside a trace (eager calls
    run in program order) nothing is kept."""
    state = core.get_referent(state)  # a differentiated value's primal: usable by the backward pass
    if not isinstance(state, core.Tracer):
        return
    chain = [s for s in _usable(buffer) if s._trace is not state._trace]
    _chains[buffer.buffer_id] = chain + [state]
