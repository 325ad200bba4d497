"""Fleet files: the shipped examples, inline links, precision, and every bad input naming its field."""

from __future__ import annotations

from pathlib import Path

import pytest

from ballast.v1 import common_pb2, fleet_pb2
from services.runtime.errors import InvalidArgument
from services.specs import catalog
from services.specs.fleet import FleetFileError, fleet_from_dict, load_fleet

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GiB = 2**30
BASE = {"device": "A100-80GB", "nodes": 1, "devices_per_node": 4}


def test_titan_example():
    fleet = load_fleet(EXAMPLES / "fleet-8xTITAN.yaml")
    assert (fleet.name, fleet.nodes, fleet.devices_per_node) == ("8x-titan", 1, 8)
    assert fleet.device.kind == "nvidia-titan-rtx-24gb"
    assert fleet.device.memory_bytes == 24 * GiB
    assert fleet.device.peak_flops == 130e12  # fp16 tensor cores: Turing has no bf16
    assert fleet.intra_node == fleet_pb2.Link(
        kind=fleet_pb2.LINK_KIND_PCIE, bandwidth_bytes_per_s=15.75e9, latency_s=5e-6
    )
    assert not fleet.HasField("inter_node")  # one node: nothing to price between nodes
    assert fleet.host_memory_bytes_per_node == 0


def test_a100_example():
    fleet = load_fleet(str(EXAMPLES / "fleet-2x8xA100.yaml"))
    assert (fleet.name, fleet.nodes, fleet.devices_per_node) == ("2x8-a100-80gb", 2, 8)
    assert fleet.device == catalog.to_proto("nvidia-a100-80gb")
    assert fleet.device.memory_bytes == 80 * GiB and fleet.device.peak_flops == 312e12
    assert fleet.intra_node.kind == fleet_pb2.LINK_KIND_NVLINK and fleet.intra_node.bandwidth_bytes_per_s == 300e9
    assert fleet.inter_node.kind == fleet_pb2.LINK_KIND_INFINIBAND and fleet.inter_node.bandwidth_bytes_per_s == 25e9
    # Same figures as the catalog's own what-if builder.
    assert fleet == catalog.fleet("A100-80GB", 8, 2, "ib-hdr-200", name="2x8-a100-80gb")


def test_local_cpu_example():
    fleet = load_fleet(EXAMPLES / "fleet-local-cpu.yaml")
    assert (fleet.name, fleet.nodes, fleet.devices_per_node) == ("local-cpu", 1, 2)
    assert fleet.device.kind == "cpu" and fleet.device.peak_flops == 2.56e12
    assert fleet.intra_node.kind == fleet_pb2.LINK_KIND_SHARED_MEMORY
    assert fleet.device.host_link.kind == fleet_pb2.LINK_KIND_SHARED_MEMORY
    assert not fleet.HasField("inter_node")


def test_text_defaults_and_overrides():
    fleet = load_fleet("device: RTX TITAN\nnodes: 1\ndevices_per_node: 4\nmemory_gib: 22.5\nhost_memory_gib: 256\n")
    assert fleet.name == "1x4-nvidia-titan-rtx-24gb"
    assert fleet.intra_node.kind == fleet_pb2.LINK_KIND_PCIE  # the device's usual in-node link
    assert fleet.device.memory_bytes == round(22.5 * GiB)
    assert fleet.host_memory_bytes_per_node == 256 * GiB


def test_precision():
    assert fleet_from_dict({**BASE, "dtype": "fp32"}).device.peak_flops == 19.5e12
    assert fleet_from_dict({**BASE, "dtype": "fp32", "tf32": True}).device.peak_flops == 156e12
    assert fleet_from_dict({**BASE, "dtype": "fp32"}, dtype=common_pb2.DTYPE_BF16).device.peak_flops == 312e12
    assert load_fleet(EXAMPLES / "fleet-local-cpu.yaml", dtype="fp32").device.peak_flops == 2.56e12


def test_inline_links():
    fleet = fleet_from_dict(
        {
            **BASE,
            "nodes": 3,
            "intra_node": {"kind": "pcie", "bandwidth_gbytes_per_s": 12, "latency_us": 8},
            "inter_node": {"kind": "LINK_KIND_ETHERNET", "bandwidth_gbits_per_s": 40, "latency_us": 30.5},
        }
    )
    assert fleet.intra_node == fleet_pb2.Link(kind=fleet_pb2.LINK_KIND_PCIE, bandwidth_bytes_per_s=12e9, latency_s=8e-6)
    assert fleet.inter_node.kind == fleet_pb2.LINK_KIND_ETHERNET
    assert fleet.inter_node.bandwidth_bytes_per_s == 5e9  # 40 Gb/s = 5 GB/s
    assert fleet.inter_node.latency_s == pytest.approx(30.5e-6)
    inline = fleet_from_dict(
        {**BASE, "intra_node": {"kind": "shared_memory", "bandwidth_gbytes_per_s": 10, "latency_us": 0}}
    )
    assert inline.intra_node.latency_s == 0 and inline.intra_node.bandwidth_bytes_per_s == 10e9


def test_inline_link_in_yaml_text():
    text = """
    device: cpu
    nodes: 2
    devices_per_node: 1
    inter_node: {kind: ethernet, bandwidth_gbits_per_s: 10, latency_us: 50}
    """
    fleet = load_fleet("\n".join(line.strip() for line in text.splitlines()))
    assert fleet.inter_node.bandwidth_bytes_per_s == 1.25e9 and fleet.inter_node.latency_s == pytest.approx(50e-6)


LINK = {"kind": "pcie", "bandwidth_gbytes_per_s": 12, "latency_us": 8}


@pytest.mark.parametrize(
    "data, field",
    [
        ([1, 2], "fleet file"),
        ({**BASE, "memory_gb": 24}, "memory_gb"),  # unknown key (the fix suggests memory_gib)
        ({"nodes": 1, "devices_per_node": 8}, "device"),
        ({"device": "cpu", "devices_per_node": 8}, "nodes"),
        ({"device": "cpu", "nodes": 1}, "devices_per_node"),
        ({**BASE, "nodes": 0}, "nodes"),
        ({**BASE, "devices_per_node": -8}, "devices_per_node"),
        ({**BASE, "devices_per_node": 2.5}, "devices_per_node"),
        ({**BASE, "nodes": True}, "nodes"),
        ({**BASE, "nodes": "2"}, "nodes"),
        ({**BASE, "device": "nvidia-b200"}, "device"),
        ({**BASE, "device": 100}, "device"),
        ({**BASE, "name": ""}, "name"),
        ({**BASE, "intra_node": "pcie9"}, "intra_node"),
        ({**BASE, "intra_node": 12}, "intra_node"),
        ({**BASE, "nodes": 2}, "inter_node"),  # more than one node needs an inter-node link
        ({**BASE, "nodes": 2, "inter_node": "ethernet-10g"}, "inter_node"),
        ({**BASE, "memory_gib": 0}, "memory_gib"),
        ({**BASE, "host_memory_gib": -1}, "host_memory_gib"),
        ({**BASE, "memory_gib": float("nan")}, "memory_gib"),
        ({**BASE, "dtype": "fp8"}, "dtype"),
        ({**BASE, "device": "V100", "dtype": "bf16"}, "dtype"),  # no bf16 on Volta
        ({**BASE, "tf32": "yes"}, "tf32"),
        ({**BASE, "intra_node": {**LINK, "speed": 1}}, "intra_node.speed"),
        ({**BASE, "intra_node": {"bandwidth_gbytes_per_s": 12, "latency_us": 8}}, "intra_node.kind"),
        ({**BASE, "intra_node": {"kind": "pcie", "bandwidth_gbytes_per_s": 12}}, "intra_node.latency_us"),
        ({**BASE, "intra_node": {"kind": "pcie", "latency_us": 8}}, "intra_node.bandwidth_gbytes_per_s"),
        ({**BASE, "intra_node": {**LINK, "bandwidth_gbits_per_s": 96}}, "intra_node.bandwidth_gbytes_per_s"),
        ({**BASE, "intra_node": {**LINK, "kind": "carrier-pigeon"}}, "intra_node.kind"),
        ({**BASE, "intra_node": {**LINK, "bandwidth_gbytes_per_s": 0}}, "intra_node.bandwidth_gbytes_per_s"),
        ({**BASE, "intra_node": {**LINK, "latency_us": -1}}, "intra_node.latency_us"),
        (
            {**BASE, "nodes": 2, "inter_node": {"kind": "ethernet", "bandwidth_gbits_per_s": "fast", "latency_us": 1}},
            "inter_node.bandwidth_gbits_per_s",
        ),
    ],
)
def test_bad_input_names_the_field(data, field):
    with pytest.raises(FleetFileError) as err:
        fleet_from_dict(data)
    assert isinstance(err.value, InvalidArgument) and isinstance(err.value, ValueError)
    assert err.value.code == "INVALID_ARGUMENT"
    assert err.value.field == field
    assert err.value.fix  # every error says how to fix it
    assert str(err.value).startswith(f"{field}: ")


def test_error_messages_help():
    with pytest.raises(FleetFileError, match=r"memory_gb: unknown key 'memory_gb' \(did you mean 'memory_gib'\?"):
        fleet_from_dict({**BASE, "memory_gb": 24})
    with pytest.raises(FleetFileError, match=r"device: unknown device 'nvidia-b200' \(a catalog kind or alias: .*cpu"):
        fleet_from_dict({**BASE, "device": "nvidia-b200"})
    with pytest.raises(FleetFileError, match=r"dtype: nvidia-v100-16gb has no fast bf16 path .*train in one of"):
        fleet_from_dict({**BASE, "device": "V100", "dtype": "bf16"})


def test_bad_files(tmp_path):
    with pytest.raises(FleetFileError, match="cannot read") as err:
        load_fleet(tmp_path / "missing.yaml")
    assert err.value.field == "fleet file"
    with pytest.raises(FleetFileError, match="cannot read"):
        load_fleet("examples/no-such-fleet.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("device: cpu\nnodes: [1\n")
    with pytest.raises(FleetFileError, match="not valid YAML") as err:
        load_fleet(bad)
    assert err.value.field == "fleet file"
    with pytest.raises(FleetFileError) as err:
        load_fleet("device: cpu\nnodes: 1\n")
    assert err.value.field == "devices_per_node"
