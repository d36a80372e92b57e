"""Processes and hosts: one process per GPU (multiprocess.py: the key-value
store, hosts, barriers) and NVSHMEM across hosts (nvshmem.py). The launcher
is `python -m deep_ep_jax.launch`."""
