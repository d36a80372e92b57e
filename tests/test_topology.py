"""NVLink domains: NVML fabric info read (faked answers), the ranks' nodes cut by host and by
domain (Config.gpus_per_nvlink_domain), and what `info` says; on CPU."""

import ctypes

import pytest

import deep_ep_jax as dej
from deep_ep_jax import testing
from deep_ep_jax.backends.cuda import lifecycle
from deep_ep_jax.distributed import multiprocess, topology

NVL72 = bytes(range(1, 17))  # a cluster UUID


def fabric(state=topology.FABRIC_STATE_COMPLETED, status=0, uuid=NVL72, clique=7):
    return topology.FabricInfo(status, state, uuid, clique)


def test_fabric_info_domain():
    assert fabric().domain() == topology.Domain(NVL72.hex(), 7)
    assert str(fabric().domain()) == f"cluster {NVL72.hex()} clique 7"
    assert fabric(state=2).domain() is None  # registration in progress: not (yet) in the domain
    assert fabric(status=1).domain() is None  # registration failed
    assert fabric(uuid=bytes(16)).domain() is None  # a GPU of no multi-tray domain (e.g. an 8-GPU host)


def test_nvml_fabric_struct_is_nvmls():
    """nvmlGpuFabricInfo_t (v1): uuid[16], status, clique id, state: 28 bytes with padding."""
    fields = {name: getattr(topology._NvmlFabricInfo, name).offset for name, _ in topology._NvmlFabricInfo._fields_}
    assert fields == {"cluster_uuid": 0, "status": 16, "clique_id": 20, "state": 24}
    assert ctypes.sizeof(topology._NvmlFabricInfo) == 28


def test_group_nodes_cut_by_domain():
    a, b = topology.Domain("aa", 1), topology.Domain("aa", 2)
    # One host, its GPUs in two cliques: two nodes, whatever the rank order.
    assert multiprocess.group_nodes(["h"] * 4, domains=[a, b, a, b]) == [0, 1, 0, 1]
    # A domain over two hosts is one node (its peer memory NVSHMEM's), cut hosts too.
    assert multiprocess.group_nodes(["h", "h", "g", "g"], domains=[a] * 4) == [0, 0, 0, 0]
    assert multiprocess.group_nodes(["h"] * 4, 2, domains=[a] * 4) == [0, 0, 0, 0]
    assert multiprocess.group_hosts(["h"] * 4, 2) == [0, 0, 1, 1]
    # Hosts outside any domain stay nodes of their own beside it.
    assert multiprocess.group_nodes(["h", "g", "f", "f"], domains=[a, a, None, None]) == [0, 0, 1, 1]
    # gpus_per_domain cuts a domain across hosts in rank order too.
    assert multiprocess.group_nodes(["h", "h", "g", "g"], domains=[a] * 4, gpus_per_domain=2) == [0, 0, 1, 1]
    # gpus_per_domain cuts a host's domain in rank order, as gpus_per_host cuts hosts.
    assert multiprocess.group_nodes(["h"] * 8, gpus_per_domain=4) == [0] * 4 + [1] * 4
    assert multiprocess.group_nodes(["h"] * 8, 4, gpus_per_domain=2) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert multiprocess.group_nodes(["h"] * 8, gpus_per_domain=8) == [0] * 8
    with pytest.raises(ValueError, match="4 hosts but 3 domains"):
        multiprocess.group_nodes(["h"] * 4, domains=[a] * 3)


def test_domain_keys_round_trip():
    for domain in (topology.Domain(NVL72.hex(), 7), topology.Domain("rack/a", 0)):
        assert topology.Domain.from_key(domain.key()) == domain
    assert topology.Domain.from_key("") is None


def test_local_domain_from_the_variable_or_nvml(monkeypatch):
    """DEEP_EP_JAX_NVLINK_DOMAIN names the domain (or "none"); else NVML's answer for the GPU."""
    monkeypatch.setattr(topology, "pci_bus_id", lambda ordinal: "0000:01:00.0")
    monkeypatch.delenv(topology.DOMAIN_VAR, raising=False)
    assert topology.local_domain(0, fabric_info=lambda pci: fabric()) == topology.Domain(NVL72.hex(), 7)
    assert topology.local_domain(0, fabric_info=lambda pci: fabric(state=1)) is None
    assert topology.local_domain(0, fabric_info=lambda pci: "no NVML here") is None
    monkeypatch.setenv(topology.DOMAIN_VAR, "rack3")
    assert topology.local_domain(0, fabric_info=lambda pci: fabric()) == topology.Domain("rack3", 0)
    monkeypatch.setenv(topology.DOMAIN_VAR, "none")
    assert topology.local_domain(0, fabric_info=lambda pci: fabric()) is None
    monkeypatch.delenv(topology.DOMAIN_VAR)
    monkeypatch.setattr(topology, "pci_bus_id", lambda ordinal: None)  # no GPU: NVML is not asked
    assert topology.local_domain(0, fabric_info=lambda pci: pytest.fail("asked NVML")) is None


def test_config_gpus_per_nvlink_domain(monkeypatch):
    monkeypatch.delenv("DEEP_EP_JAX_GPUS_PER_NVLINK_DOMAIN", raising=False)
    assert dej.Config().gpus_per_nvlink_domain is None
    monkeypatch.setenv("DEEP_EP_JAX_GPUS_PER_NVLINK_DOMAIN", "4")
    assert dej.Config().gpus_per_nvlink_domain == 4
    monkeypatch.setenv("DEEP_EP_JAX_GPUS_PER_NVLINK_DOMAIN", "0")
    with pytest.raises(ValueError, match=r"gpus_per_nvlink_domain must be >= 1 or None, got 0 \(from DEEP_EP"):
        dej.Config()
    monkeypatch.delenv("DEEP_EP_JAX_GPUS_PER_NVLINK_DOMAIN")
    with pytest.raises(TypeError, match="gpus_per_nvlink_domain must be an int or None"):
        dej.Config(gpus_per_nvlink_domain=2.5)


def test_buffer_nodes_follow_the_domain_cut():
    """Both backends cut an EP group alike: 8 ranks in domains of 4 are two nodes."""
    mesh = testing.ep_mesh(8, "ep", platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla", config=dej.Config(gpus_per_nvlink_domain=4))
    assert lifecycle.group_places(buffer, False)[0] == [[0] * 4 + [1] * 4]
    assert buffer.spans_hosts


def test_describe_says_what_each_gpu_has(monkeypatch):
    monkeypatch.setenv(topology.DOMAIN_VAR, "rack3")
    answers = {"0000:01:00.0": fabric(), "0000:02:00.0": fabric(state=1), "0000:03:00.0": "no NVML here"}
    handles = {0: True, 1: False, 2: "no CUDA driver here"}
    lines = topology.describe(list(answers), [0, 1, 2], fabric_info=answers.get, handles=handles.get)
    assert lines[0] == (
        f"GPU 0 (0000:01:00.0): NVLink domain cluster {NVL72.hex()} clique 7; fabric handles supported (peer "
        "memory: CUDA IPC within a host, NVSHMEM's mapping across the hosts of a domain)"
    )
    assert "this host's NVLink only (fabric state 1); fabric handles not supported" in lines[1]
    assert "this host's NVLink only: no NVML here; fabric handles unknown (no CUDA driver here)" in lines[2]
    assert lines[3] == "DEEP_EP_JAX_NVLINK_DOMAIN=rack3: this process's NVLink domain, in place of NVML's"


def test_probes_answer_without_a_gpu():
    """On a host without NVML or a GPU the probes say why, never raise."""
    info = topology.nvml_fabric_info("0000:01:00.0")
    assert isinstance(info, (str, topology.FabricInfo))
    supported = topology.fabric_handles_supported(0)
    assert isinstance(supported, (bool, str))
    assert topology.pci_bus_id(0) is None or topology.pci_bus_id(0).count(":") == 2
