"""The CUDA backend: the per-rank operations as XLA FFI custom calls.

One module per FFI file of the extension (csrc/ffi/): `layout`
(get_dispatch_layout), `intranode` (normal mode, an EP group on one host),
`internode` (normal mode across hosts, NVSHMEM), `low_latency`,
`expert_major` (local, no Buffer); `common`
holds what they share. `lifecycle` makes and frees a Buffer's memory and
registers the FFI targets; `sizes` says how large a Buffer's regions are
when not told. Sizes and limits come from the extension (`deep_ep_jax._C`),
which computes them with the code the kernels lay memory out with.
"""
