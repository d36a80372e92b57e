"""Communication: the Buffer and the public dispatch/combine operations.

Each public function validates its arguments, owns shapes and gradients, and
calls its Buffer's backend (`deep_ep_jax.backends`):

  buffer.py         the Buffer: one EP mesh axis's state, its backend and path
  normal.py         dispatch, combine, the layout; their gradients (training, prefill)
  low_latency.py    low-latency dispatch/combine and their halves (decoding)
  expert_major.py   rows grouped by expert for the experts' GEMM, and back
  handle.py         the handles dispatch returns
  validation.py     trace-time argument checks; Config(checks=True)'s run-time checks
  ordering.py       a Buffer's calls chained in program order
  mesh.py           which device is which rank; a program's mesh checked against the Buffer's
  varying.py        shard_map's varying-axes types for custom calls and zero cotangents
"""
