"""Device and link catalog: lookups, sourced figures, relative sanity, proto helpers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ballast.v1 import common_pb2, fleet_pb2
from services.runtime.errors import InvalidArgument
from services.specs import catalog
from services.specs.catalog import DEVICES, LINKS, device, fleet, to_proto


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("H100", "nvidia-h100-sxm-80gb"),
        ("nvidia-h100-80gb", "nvidia-h100-sxm-80gb"),  # the proto's example kind
        ("NVIDIA H100 80GB HBM3", "nvidia-h100-sxm-80gb"),
        ("h200", "nvidia-h200-141gb"),
        ("A100", "nvidia-a100-40gb"),
        ("A100-80GB", "nvidia-a100-80gb"),
        ("a100_80gb", "nvidia-a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "nvidia-a100-40gb"),
        ("V100-32GB", "nvidia-v100-32gb"),
        ("v100", "nvidia-v100-16gb"),
        ("RTX TITAN", "nvidia-titan-rtx-24gb"),
        ("gtx 1080 ti", "nvidia-gtx-1080-ti"),
        ("L4", "nvidia-l4"),
        ("CPU", "cpu"),
        ("nvidia-a100-80gb", "nvidia-a100-80gb"),
    ],
)
def test_lookup_by_kind_and_alias_ignores_case_and_separators(name: str, kind: str) -> None:
    assert device(name).kind == kind


@pytest.mark.parametrize("name", ["tpu-v4", "", "H100-PCIe", "A100-PCIE-40GB"])
def test_unknown_device_names_the_field_and_the_choices(name: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        device(name)
    assert err.value.field == "device"
    assert "nvidia-h100-sxm-80gb" in err.value.fix and "cpu" in err.value.fix


def test_catalog_covers_the_issue_list() -> None:
    assert set(DEVICES) == {
        "nvidia-h100-sxm-80gb",
        "nvidia-h200-141gb",
        "nvidia-a100-40gb",
        "nvidia-a100-80gb",
        "nvidia-v100-16gb",
        "nvidia-v100-32gb",
        "nvidia-titan-rtx-24gb",
        "nvidia-gtx-1080-ti",
        "nvidia-l4",
        "cpu",
    }


@pytest.mark.parametrize("kind", list(DEVICES))
def test_every_entry_has_memory_bandwidth_flops_and_sources(kind: str) -> None:
    entry = DEVICES[kind]
    assert entry.memory_bytes > 0 and entry.memory_bandwidth_bytes_per_s > 0
    present = [p for p in catalog.PRECISIONS if entry.peak_flops(p)]
    assert present, "at least one FLOP/s figure"
    for figure in ("memory", "bandwidth", "links", *catalog.PRECISIONS):
        assert entry.sources.get(figure), f"{kind}: no source for {figure}"
    assert entry.host_link in LINKS and entry.intra_node_link in LINKS
    assert LINKS[entry.host_link].kind in (fleet_pb2.LINK_KIND_PCIE, fleet_pb2.LINK_KIND_SHARED_MEMORY)


def test_relative_sanity() -> None:
    h100, h200, a100, a100_80, v100 = (device(n) for n in ("H100", "H200", "A100", "A100-80GB", "V100"))
    assert h100.fp16_flops > a100.fp16_flops > v100.fp16_flops
    assert h100.fp32_flops > a100.fp32_flops > v100.fp32_flops
    assert h200.memory_bytes > h100.memory_bytes
    assert h200.memory_bandwidth_bytes_per_s > h100.memory_bandwidth_bytes_per_s
    assert a100_80.memory_bandwidth_bytes_per_s > a100.memory_bandwidth_bytes_per_s
    assert device("V100-32GB").memory_bytes == 2 * v100.memory_bytes
    for name in ("V100", "TITAN RTX", "GTX 1080 Ti"):
        assert device(name).bf16_flops is None and device(name).tf32_flops is None
    assert device("GTX 1080 Ti").fp16_flops is None  # no fast fp16 on Pascal
    # Dense, not "with sparsity": H100 fp16 is half the 1,979 TFLOPS datasheet figure.
    assert h100.fp16_flops == pytest.approx(989.5e12)
    assert a100.bf16_flops == pytest.approx(312e12)


def test_cpu_entry_is_nominal_and_says_measurements_rule() -> None:
    cpu = device("cpu")
    assert cpu.nominal and "source of truth" in cpu.notes
    assert all(not e.nominal for k, e in DEVICES.items() if k != "cpu")
    assert cpu.sources["fp32"].startswith("nominal")


def test_links_cover_the_classes_with_one_direction_bandwidth() -> None:
    expected = {
        "nvlink2",
        "nvlink3",
        "nvlink4",
        "pcie3",
        "pcie4",
        "pcie5",
        "ib-edr-100",
        "ib-hdr-200",
        "ib-ndr-400",
        "eth-10",
        "eth-25",
        "eth-100",
    }
    assert expected <= set(LINKS)
    bw = {k: v.bandwidth_bytes_per_s for k, v in LINKS.items()}
    assert bw["nvlink2"] < bw["nvlink3"] < bw["nvlink4"]
    assert bw["pcie3"] < bw["pcie4"] < bw["pcie5"]
    assert bw["ib-edr-100"] == 12.5e9 and bw["ib-hdr-200"] == 25e9 and bw["ib-ndr-400"] == 50e9
    assert bw["eth-10"] == 1.25e9
    assert bw["nvlink4"] == 450e9  # 900 GB/s datasheet figure counts both directions
    for entry in LINKS.values():
        assert entry.latency_s > 0 and entry.source
    assert LINKS["eth-10"].latency_s > LINKS["ib-hdr-200"].latency_s  # commodity networks (Varuna)


def test_to_proto_takes_peak_at_the_training_precision() -> None:
    spec = to_proto("A100", common_pb2.DTYPE_BF16)
    assert spec.kind == "nvidia-a100-40gb" and spec.peak_flops == 312e12
    assert spec.memory_bytes == 40 * 2**30 and spec.memory_bandwidth_bytes_per_s == 1555e9
    assert spec.host_link.kind == fleet_pb2.LINK_KIND_PCIE and spec.host_link.bandwidth_bytes_per_s == 31.5e9
    assert to_proto("A100", "fp32").peak_flops == 19.5e12
    assert to_proto("A100", "fp32", tf32=True).peak_flops == 156e12  # TF32 only when the job opts in
    assert to_proto("V100", "fp32", tf32=True).peak_flops == 15.7e12  # nothing to opt into on Volta
    assert to_proto("V100").peak_flops == 125e12  # default: fastest supported precision (fp16)


@pytest.mark.parametrize(("name", "dtype"), [("V100", common_pb2.DTYPE_BF16), ("GTX 1080 Ti", "fp16"), ("cpu", "bf16")])
def test_unsupported_precision_names_dtype(name: str, dtype) -> None:
    with pytest.raises(InvalidArgument) as err:
        to_proto(name, dtype)
    assert err.value.field == "dtype" and "fp32" in err.value.fix


def test_unknown_precision_names_dtype() -> None:
    with pytest.raises(InvalidArgument) as err:
        to_proto("H100", "fp8")
    assert err.value.field == "dtype"


def test_fleet_helper() -> None:
    f = fleet("A100-80GB", 8, 4, inter_node="ib-ndr-400", dtype="bf16", host_memory_bytes_per_node=2**40)
    assert (f.devices_per_node, f.nodes) == (8, 4) and f.name == "4x8-nvidia-a100-80gb"
    assert f.device.kind == "nvidia-a100-80gb" and f.device.peak_flops == 312e12
    assert f.intra_node.kind == fleet_pb2.LINK_KIND_NVLINK and f.intra_node.bandwidth_bytes_per_s == 300e9
    assert f.inter_node.kind == fleet_pb2.LINK_KIND_INFINIBAND and f.inter_node.bandwidth_bytes_per_s == 50e9
    assert f.host_memory_bytes_per_node == 2**40
    titan = fleet("TITAN RTX", 8, 2, inter_node="ib-edr-100")  # Galvatron-BMW's low-performance cluster
    assert titan.intra_node.kind == fleet_pb2.LINK_KIND_PCIE and titan.device.peak_flops == 130e12
    varuna = fleet("V100", 1, 32, inter_node="eth-10", intra_node="pcie3")  # Varuna's 1-GPU spot VMs
    assert varuna.inter_node.kind == fleet_pb2.LINK_KIND_ETHERNET
    assert fleet("H100", 8).inter_node.bandwidth_bytes_per_s == 25e9  # default HDR 200


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"devices_per_node": 0}, "devices_per_node"),
        ({"nodes": 0}, "nodes"),
        ({"inter_node": "token-ring"}, "link"),
        ({"device_name": "tpu"}, "device"),
    ],
)
def test_fleet_rejects_bad_arguments(kwargs: dict, field: str) -> None:
    args = {"device_name": "H100", "devices_per_node": 8, "nodes": 1} | kwargs
    with pytest.raises(InvalidArgument) as err:
        fleet(**args)
    assert err.value.field == field


def test_catalog_and_projection_do_not_import_torch() -> None:
    code = "import sys, services.specs.catalog, services.profiler.projection; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
