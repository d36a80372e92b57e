"""Which GPUs share an NVLink domain, and what peer memory can cross it.

An NVLink domain that spans trays (GB200 NVL72: 72 GPUs over 18 hosts) is
told by NVML's fabric info: GPUs of one domain report the same cluster UUID
and clique id once the fabric manager has registered them
(DEEP_EP_JAX_NVLINK_DOMAIN names it by hand). Within a host every GPU pair
with peer access is one domain as far as the kernels go.

The ranks of one node (one host, or one domain across hosts) map each
other's memory and run the one-node kernels. Within a host the memory is
mapped with CUDA IPC; across the hosts of a domain it is NVSHMEM's symmetric
heap, which NVSHMEM maps over the NVLink fabric (its multi-node NVLink
support, fabric handles with IMEX underneath). Ranks of other nodes are
reached through NVSHMEM's transports.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
from collections.abc import Callable

FABRIC_STATE_COMPLETED = 3  # nvmlGpuFabricState_t: the fabric manager registered the GPU
NVML_SUCCESS = 0
DOMAIN_VAR = "DEEP_EP_JAX_NVLINK_DOMAIN"
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 128


@dataclasses.dataclass(frozen=True)
class Domain:
    """An NVLink domain across trays: NVML's cluster UUID (hex) and clique id."""

    cluster_uuid: str
    clique_id: int

    def __str__(self):
        return f"cluster {self.cluster_uuid} clique {self.clique_id}"

    def key(self) -> str:
        """Its text for the key-value store (Domain.from_key reads it back)."""
        return f"{self.cluster_uuid}/{self.clique_id}"

    @staticmethod
    def from_key(text: str) -> Domain | None:
        if not text:
            return None
        uuid, clique = text.rsplit("/", 1)
        return Domain(uuid, int(clique))


@dataclasses.dataclass(frozen=True)
class FabricInfo:
    """One GPU's answer from nvmlDeviceGetGpuFabricInfo."""

    status: int  # nvmlReturn_t of the registration (0: success)
    state: int  # nvmlGpuFabricState_t
    cluster_uuid: bytes
    clique_id: int

    def domain(self) -> Domain | None:
        """Its domain, or None unless the fabric manager registered it (a GPU outside any
        multi-tray domain: NVLink within its host only)."""
        if self.state != FABRIC_STATE_COMPLETED or self.status != NVML_SUCCESS or not any(self.cluster_uuid):
            return None
        return Domain(self.cluster_uuid.hex(), self.clique_id)


class _NvmlFabricInfo(ctypes.Structure):  # nvmlGpuFabricInfo_t (v1)
    _fields_ = [
        ("cluster_uuid", ctypes.c_ubyte * 16),
        ("status", ctypes.c_int),
        ("clique_id", ctypes.c_uint),
        ("state", ctypes.c_ubyte),
    ]


@functools.cache
def _nvml():
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    if lib.nvmlInit_v2() != NVML_SUCCESS:
        raise OSError("nvmlInit_v2 failed")
    return lib


def nvml_fabric_info(pci_bus_id: str) -> FabricInfo | str:
    """NVML's fabric info of the GPU at pci_bus_id, or why there is none (no NVML, a driver
    without the call, a GPU that does not support it: Hopper and older)."""
    try:
        lib = _nvml()
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(handle)) != NVML_SUCCESS:
            return f"NVML does not know the GPU at {pci_bus_id}"
        info = _NvmlFabricInfo()
        code = lib.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
    except (OSError, AttributeError) as e:
        return f"no NVML fabric info here ({e})"
    if code != NVML_SUCCESS:
        return f"nvmlDeviceGetGpuFabricInfo returned {code} (3: not supported by this GPU)"
    return FabricInfo(info.status, info.state, bytes(info.cluster_uuid), info.clique_id)


def _cuda_driver():
    lib = ctypes.CDLL("libcuda.so.1")
    if lib.cuInit(0):
        raise OSError("cuInit failed")
    return lib


def pci_bus_id(ordinal: int) -> str | None:
    """The PCI bus id of this process's CUDA device `ordinal`, None without one."""
    try:
        lib, device = _cuda_driver(), ctypes.c_int()
        name = ctypes.create_string_buffer(32)
        if lib.cuDeviceGet(ctypes.byref(device), ordinal) or lib.cuDeviceGetPCIBusId(name, len(name), device):
            return None
    except OSError:
        return None
    return name.value.decode()


def _domain_variable() -> str:
    return os.environ.get(DOMAIN_VAR, "").strip()


def local_domain(ordinal: int | None, fabric_info: Callable = nvml_fabric_info) -> Domain | None:
    """The NVLink domain across hosts of this process's GPU `ordinal` (None: no GPU), None where
    its NVLink stays within its host: DEEP_EP_JAX_NVLINK_DOMAIN when set (a name: the processes
    naming the same one share a domain; "none": no domain), else NVML's fabric info."""
    name = _domain_variable()
    if name:
        return None if name.lower() == "none" else Domain(name, 0)
    pci = None if ordinal is None else pci_bus_id(ordinal)
    info = fabric_info(pci) if pci else "no GPU"
    return info.domain() if isinstance(info, FabricInfo) else None


def fabric_handles_supported(ordinal: int) -> bool | str:
    """Whether CUDA can export this device's memory as fabric handles, or why unknown."""
    try:
        lib, device, value = _cuda_driver(), ctypes.c_int(), ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(device), ordinal):
            return "the CUDA driver did not start"
        if lib.cuDeviceGetAttribute(ctypes.byref(value), CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, device):
            return "the CUDA driver does not know the attribute"
    except OSError as e:
        return f"no CUDA driver here ({e})"
    return bool(value.value)


def describe(pci_bus_ids, ordinals, fabric_info: Callable = nvml_fabric_info, handles: Callable = None) -> list[str]:
    """Lines for `python -m deep_ep_jax.info`: each GPU's NVLink domain and fabric-handle support."""
    handles = handles or fabric_handles_supported
    lines = []
    for pci, ordinal in zip(pci_bus_ids, ordinals):
        info = fabric_info(pci)
        if isinstance(info, str):
            where = f"this host's NVLink only: {info}"
        else:
            domain = info.domain()
            where = f"NVLink domain {domain}" if domain else f"this host's NVLink only (fabric state {info.state})"
        supported = handles(ordinal)
        fabric = {True: "supported", False: "not supported"}.get(supported, f"unknown ({supported})")
        lines.append(
            f"GPU {ordinal} ({pci}): {where}; fabric handles {fabric} (peer memory: CUDA IPC within a host, "
            f"NVSHMEM's mapping across the hosts of a domain)"
        )
    name = _domain_variable()
    if name:
        lines.append(f"{DOMAIN_VAR}={name}: this process's NVLink domain, in place of NVML's")
    return lines
