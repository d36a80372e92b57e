"""Environment report: `python -m deep_ep_jax.info`.

Versions, devices, GPU peer access and NVLink topology, whether the CUDA
extension is built (and for which architectures), the NVSHMEM library, the
backend Buffer(backend="auto") would choose, and the buffer sizes the
standard cases need. Works on a CPU-only machine without the extension.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys

# DeepEP's standard cases (docs/design.md).
NORMAL_CASE = dict(num_tokens=4096, hidden=7168, num_topk=8)
LOW_LATENCY_CASE = dict(num_max_dispatch_tokens_per_rank=128, hidden=7168, num_experts=288, num_topk=8)
# Low-latency mode in large EP groups (across hosts): E = 256 experts, or one per rank beyond 256 ranks.
LARGE_EP_CASE = {"num_max_dispatch_tokens_per_rank": 128, "hidden": 7168, "num_topk": 8}
LARGE_EP_RANKS = (16, 32, 64, 128, 256)
# A GPU of each generation deep_ep_jax builds for, by compute capability (DEEP_EP_JAX_CUDA_ARCHS).
GENERATIONS = {"A100": "8.0", "H100/H200": "9.0", "B200/GB200": "10.0", "RTX PRO 6000": "12.0"}


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _coverage(module, capability: str) -> str:
    """What this build runs on a GPU of compute capability `capability`."""
    from deep_ep_jax import _native

    compiled = module.cuda_archs()
    if not _native._arch_matches(compiled, capability):
        return "NOT covered by this build (DEEP_EP_JAX_CUDA_ARCHS)"
    if getattr(module, "with_nvshmem", False) and not _native._arch_matches(
        _native._machine_code(compiled), capability
    ):
        return "covered by this build's PTX, but not its NVSHMEM kernels (machine code only)"
    return "covered by this build"


def print_configuration():
    """The Config a Buffer made here would get, the variables that set it, or why Config() fails."""
    import dataclasses

    from deep_ep_jax.config import Config
    from deep_ep_jax.distributed import topology

    set_here = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("DEEP_EP_JAX_"))
    print("variables set: " + (", ".join(set_here) if set_here else "none"))
    if os.environ.get(topology.DOMAIN_VAR, "").strip():
        print(f"{topology.DOMAIN_VAR} names this process's NVLink domain in place of NVML's fabric info")
    try:
        config = Config()
    except (TypeError, ValueError) as e:
        print(f"Config() FAILS here, and so does every Buffer: {e}")
        return
    print(", ".join(f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)))


def _section(title):
    print(f"\n== {title}")


def find_nvshmem():
    """(version, path of libnvshmem_host.so) from the nvidia-nvshmem-cu13 wheel, or None."""
    try:
        nvidia = importlib.import_module("nvidia")
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        libs = sorted(glob.glob(os.path.join(root, "nvshmem", "lib", "libnvshmem_host.so*")))
        if libs:
            return _version("nvidia-nvshmem-cu13"), libs[-1]
    return None


def _mib(num_bytes):
    return f"{num_bytes / 2**20:.1f} MiB per GPU ({num_bytes} bytes)"


def _case(case):
    return ", ".join(f"{k}={v}" for k, v in case.items())


def print_buffer_sizes():
    """The Buffer sizes of the standard cases, from the extension's layout functions."""
    from deep_ep_jax import _native

    reason = _native.load_error()
    if reason:
        print("needs the CUDA extension deep_ep_jax._C, which computes them (not importable here: see above)")
        return
    from deep_ep_jax.backends.cuda import sizes

    print(
        "Device memory a CUDA Buffer allocates on each GPU, for DeepEP's standard cases (R ranks):\n"
        "  normal: its normal-mode region (num_nvl_bytes). In one process the rows go straight into\n"
        "    XLA's buffers, so only a control block; staged (one process per GPU) it holds the rows.\n"
        "  normal across hosts: the region in NVSHMEM's symmetric heap (EP groups spanning hosts).\n"
        "  low latency: its low-latency region (num_rdma_bytes, with low_latency_mode=True).\n"
        "A Buffer sizes itself from its hidden= (and num_max_dispatch_tokens_per_rank=) hints, for top-k up to 16;\n"
        "num_nvl_bytes= / num_rdma_bytes= override."
    )
    tokens, hidden, topk = NORMAL_CASE["num_tokens"], NORMAL_CASE["hidden"], NORMAL_CASE["num_topk"]
    for num_ranks in (2, 8):
        direct = sizes.normal_region_bytes(num_ranks, hidden, tokens, topk, staged=False)
        staged = sizes.normal_region_bytes(num_ranks, hidden, tokens, topk, staged=True)
        print(
            f"normal ({_case(NORMAL_CASE)}, R={num_ranks}): {_mib(direct)}; "
            f"staged (one process per GPU): {_mib(staged)}"
        )
    # Hosts of 8 GPUs beyond 8 ranks; the NVSHMEM heap holds about twice the region.
    for num_ranks, num_nodes in ((2, 2), (8, 2)) + tuple((r, r // 8) for r in LARGE_EP_RANKS if r <= 128):
        size = sizes.internode_region_bytes(num_ranks, num_nodes, hidden, tokens, topk)
        print(f"normal across hosts ({_case(NORMAL_CASE)}, R={num_ranks}, {num_nodes} hosts): {_mib(size)}")
    case = LOW_LATENCY_CASE
    for num_ranks in (2, 8):
        size = sizes.low_latency_region_bytes(
            num_ranks, case["num_experts"], case["hidden"], case["num_max_dispatch_tokens_per_rank"], case["num_topk"]
        )
        print(f"low latency ({_case(case)}, R={num_ranks}): {_mib(size)}")
    print_large_ep_sizes()


def large_ep_sizes(num_ranks) -> dict:
    """Low-latency bytes per GPU of LARGE_EP_CASE at num_ranks ranks across
    hosts, from the extension's size queries: the region, the send area, and
    the combine's staged rows that dominate the send area."""
    from deep_ep_jax import _native

    ext = _native.extension()
    m, h, k = (LARGE_EP_CASE[key] for key in ("num_max_dispatch_tokens_per_rank", "hidden", "num_topk"))
    num_experts = max(256, num_ranks)
    return {
        "num_experts": num_experts,
        "region": ext.low_latency_region_bytes(num_ranks, num_experts // num_ranks, h, m, k),
        "send": ext.low_latency_send_bytes(num_ranks, h, m, k),
        "combine_stage": ext.low_latency_combine_stage_bytes(num_ranks, h, m, k),
    }


def print_large_ep_sizes():
    print(
        f"low latency across hosts ({_case(LARGE_EP_CASE)}, E=max(256, R)): region (num_rdma_bytes) + send area, "
        f"where a combine stages R*M*K*H*2 bytes:"
    )
    for num_ranks in LARGE_EP_RANKS:
        s = large_ep_sizes(num_ranks)
        print(
            f"  EP {num_ranks}: region {_mib(s['region'])} + send area {s['send'] / 2**20:.1f} MiB "
            f"(combine staging {s['combine_stage'] / 2**20:.1f} MiB) = {(s['region'] + s['send']) / 2**30:.2f} GiB "
            f"per GPU"
        )


def main(argv=None):
    argparse.ArgumentParser(prog="python -m deep_ep_jax.info", description=__doc__.split("\n\n")[1]).parse_args(argv)
    import jax

    from deep_ep_jax import _native
    from deep_ep_jax.distributed import topology

    _section("versions")
    print(f"python {platform.python_version()} ({sys.executable})")
    for dist in ("deep_ep_jax", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "numpy"):
        print(f"{dist}: {_version(dist)}")

    _section("JAX devices")
    try:
        devices = jax.devices()
    except Exception as e:  # a platform that fails to start raises more than RuntimeError; the report goes on
        devices = []
        print(f"none: {type(e).__name__}: {e}")
    for d in devices:
        extra = f", compute capability {d.compute_capability}" if hasattr(d, "compute_capability") else ""
        print(f"{d.id}: {d.platform} {d.device_kind} (process {d.process_index}{extra})")
    has_gpu = any(d.platform in ("gpu", "cuda") for d in devices)
    if not has_gpu:
        print(
            "No GPU here: JAX sees no CUDA device. The xla backend (pure JAX) runs on any device; the CUDA "
            "kernels need NVIDIA GPUs (and a CUDA build of jax, e.g. jax[cuda13])."
        )

    _section("CUDA extension")
    print(_native.build_summary())
    try:
        module = _native.extension()
    except ImportError:
        module = None

    if module is not None:
        print(
            "GPU generations: "
            + "; ".join(f"{name} ({cap}): {_coverage(module, cap)}" for name, cap in GENERATIONS.items())
        )
        info = module.device_info()
        if info["driver_cuda_version"] == "none" and not info["devices"]:
            print(
                f"CUDA compiled: {info['cuda_version_compiled']}; no NVIDIA driver or GPU on this host "
                f"(CUDA says: {info['error'] or 'no devices'})"
            )
        else:
            print(f"CUDA compiled: {info['cuda_version_compiled']}, driver supports: {info['driver_cuda_version']}")
            if info["error"]:
                print(f"CUDA runtime: {info['error']}")
        for dev in info["devices"]:
            print(
                f"GPU {dev['ordinal']}: {dev['name']}, sm_{dev['compute_capability'].replace('.', '')}, "
                f"{dev['sm_count']} SMs, {dev['total_memory_bytes'] / 2**30:.1f} GiB, PCI {dev['pci_bus_id']}; "
                + _coverage(module, dev["compute_capability"])
            )
        if info["devices"]:
            _section("NVLink domains (NVML fabric info) and peer memory")
            for line in topology.describe(
                [d["pci_bus_id"] for d in info["devices"]], [d["ordinal"] for d in info["devices"]]
            ):
                print(line)
        if len(info["devices"]) > 1:
            print("peer access (row can access column; P2P performance rank, lower is faster; A: native atomics):")
            n = len(info["devices"])
            print("      " + "".join(f"GPU{j:<6}" for j in range(n)))
            for i in range(n):
                cells = []
                for j in range(n):
                    if i == j:
                        cells.append("X")
                    elif info["can_access_peer"][i][j]:
                        atomics = "A" if info["p2p_native_atomics"][i][j] else ""
                        cells.append(f"yes/{info['p2p_performance_rank'][i][j]}{atomics}")
                    else:
                        cells.append("no")
                print(f"GPU{i:<3}" + "".join(f"{c:<9}" for c in cells))

    if shutil.which("nvidia-smi"):
        _section("nvidia-smi topo -m")
        try:
            result = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
            print((result.stdout or result.stderr).rstrip())
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"failed: {e}")

    _section("NVSHMEM")
    found = find_nvshmem()
    print(f"nvidia-nvshmem-cu13 {found[0]}: {found[1]}" if found else "not found (pip install nvidia-nvshmem-cu13)")
    from deep_ep_jax.distributed import nvshmem

    if not has_gpu:
        print("EP groups across hosts: need GPUs (none here)")
    else:
        why_not = nvshmem.unavailable_reason()
        print("EP groups across hosts: " + ("available" if why_not is None else f"unavailable: {why_not}"))

    _section("backend")
    try:
        reason = _native.unavailable_reason()
    except Exception as e:  # JAX's platform failed to start (as under "JAX devices")
        reason = f"JAX failed to start its platform: {type(e).__name__}: {e}"
    if reason is None:
        print('Buffer(backend="auto") -> "cuda"')
    else:
        print(f'Buffer(backend="auto") -> "xla" ({reason})')

    _section("configuration (Config() here, from DEEP_EP_JAX_* variables; docs/usage.md)")
    print_configuration()

    _section("buffer sizes for the standard cases")
    print_buffer_sizes()
    if has_gpu:
        print(
            "XLA preallocates 75% of GPU memory; if a Buffer does not fit, set XLA_PYTHON_CLIENT_MEM_FRACTION "
            "(e.g. 0.6) or XLA_PYTHON_CLIENT_PREALLOCATE=false before importing jax."
        )


if __name__ == "__main__":
    main()
