"""Device and link catalog, so the planner can price a fleet that is not at hand.

Every figure is a vendor peak (datasheet or whitepaper) and names its source next to it. Peaks are
what the hardware could do, not what training achieves: projection (services/profiler/projection.py)
calibrates the achieved fraction from a measured profile, and measured link samples (CommCalibration)
override the nominal link rows here. Pure Python on purpose: the planner and the CLI import it (through
fleet files) and must not load torch.

Units: memory in bytes (datasheet "GB" of GPU memory is read as GiB, 2**30, the way the drivers
count it; the CUDA context and ECC reserve part of it), bandwidth in bytes/s (decimal, as quoted),
FLOP/s dense, i.e. datasheet figures marked "with sparsity" are halved as their footnotes say.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ballast.v1 import common_pb2, fleet_pb2
from services.runtime.errors import InvalidArgument

GiB = 2**30
GB = 1e9
TFLOPS = 1e12

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
_DTYPE_NAMES = {common_pb2.DTYPE_FP32: "fp32", common_pb2.DTYPE_FP16: "fp16", common_pb2.DTYPE_BF16: "bf16"}


@dataclass(frozen=True)
class LinkEntry:
    """A link class: nominal one-direction line rate and a typical per-message latency."""

    name: str
    kind: int  # fleet_pb2.LinkKind
    bandwidth_bytes_per_s: float
    latency_s: float
    source: str

    def to_proto(self) -> fleet_pb2.Link:
        return fleet_pb2.Link(
            kind=self.kind, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s, latency_s=self.latency_s
        )


@dataclass(frozen=True)
class DeviceEntry:
    """One device model. `None` FLOP/s means no fast path for that precision (not "unknown")."""

    kind: str
    title: str
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    fp32_flops: float
    tf32_flops: float | None
    fp16_flops: float | None
    bf16_flops: float | None
    host_link: str  # key of LINKS
    intra_node_link: str  # key of LINKS
    sources: Mapping[str, str]  # figure -> document it comes from
    aliases: tuple[str, ...] = ()
    notes: str = ""
    nominal: bool = False  # True: figures are placeholders, measured profiles are the truth

    def peak_flops(self, precision: str | int) -> float | None:
        """Dense peak for a precision name ("fp32", "tf32", "fp16", "bf16") or a common_pb2.DType."""
        return getattr(self, f"{precision_name(precision)}_flops")

    @property
    def default_dtype(self) -> int:
        """The fastest training precision the device supports (bf16 > fp16 > fp32)."""
        if self.bf16_flops:
            return common_pb2.DTYPE_BF16
        if self.fp16_flops:
            return common_pb2.DTYPE_FP16
        return common_pb2.DTYPE_FP32


def precision_name(precision: str | int) -> str:
    if isinstance(precision, str) and precision.lower() in PRECISIONS:
        return precision.lower()
    if isinstance(precision, int) and precision in _DTYPE_NAMES:
        return _DTYPE_NAMES[precision]
    raise InvalidArgument(f"unknown precision {precision!r}", field="dtype", fix=f"one of {', '.join(PRECISIONS)}")


# --- Links -----------------------------------------------------------------------------------------
# Bandwidth is one direction (the Link proto's contract); NVIDIA quotes NVLink and PCIe as the sum of
# both directions, so those figures are halved. NVLink rows are the per-GPU aggregate over all links.
_NVLINK_LATENCY = 2e-6  # GPU P2P over NVLink is ~1-2 us end to end; hardware hop is far lower
_PCIE_LATENCY = 5e-6  # CUDA P2P/H2D small copies ~4-10 us (p2pBandwidthLatencyTest-style measurements)
_IB_LATENCY = 5e-6  # ~0.6 us switch port-to-port, 1-2 us MPI ping-pong; NCCL adds a few us of software
_ETH_LATENCY = 50e-6  # kernel TCP 20-50 us one way; cloud VMs add jitter (Varuna §3, Obs. 3)
_LATENCY_NOTE = "latency: typical order of magnitude, not a datasheet figure; calibrate with LinkSamples"

LINKS: dict[str, LinkEntry] = {
    link.name: link
    for link in (
        LinkEntry("nvlink2", fleet_pb2.LINK_KIND_NVLINK, 150 * GB, _NVLINK_LATENCY,
                  f"NVIDIA Tesla V100 datasheet: NVLink 300 GB/s (both directions, 6 links); {_LATENCY_NOTE}"),
        LinkEntry("nvlink3", fleet_pb2.LINK_KIND_NVLINK, 300 * GB, _NVLINK_LATENCY,
                  f"NVIDIA A100 datasheet: NVLink 600 GB/s (both directions, 12 links); {_LATENCY_NOTE}"),
        LinkEntry("nvlink4", fleet_pb2.LINK_KIND_NVLINK, 450 * GB, _NVLINK_LATENCY,
                  f"NVIDIA H100/H200 datasheets: NVLink 900 GB/s (both directions, 18 links); {_LATENCY_NOTE}"),
        LinkEntry("pcie3", fleet_pb2.LINK_KIND_PCIE, 15.75 * GB, _PCIE_LATENCY,
                  f"PCIe 3.0 x16: 8 GT/s x 16 lanes, 128b/130b = 15.75 GB/s per direction "
                  f"(datasheets quote 32 GB/s both ways); {_LATENCY_NOTE}"),
        LinkEntry("pcie4", fleet_pb2.LINK_KIND_PCIE, 31.5 * GB, _PCIE_LATENCY,
                  f"PCIe 4.0 x16: 16 GT/s x 16, 128b/130b = 31.5 GB/s per direction "
                  f"(A100/L4 datasheets: 64 GB/s both ways); {_LATENCY_NOTE}"),
        LinkEntry("pcie5", fleet_pb2.LINK_KIND_PCIE, 63.0 * GB, _PCIE_LATENCY,
                  f"PCIe 5.0 x16: 32 GT/s x 16, 128b/130b = 63 GB/s per direction "
                  f"(H100/H200 datasheets: 128 GB/s both ways); {_LATENCY_NOTE}"),
        LinkEntry("ib-edr-100", fleet_pb2.LINK_KIND_INFINIBAND, 12.5 * GB, _IB_LATENCY,
                  f"InfiniBand EDR 4x: 100 Gb/s data rate; Galvatron-BMW §VII (RTX TITAN and A100 "
                  f"clusters on 100 Gb IB); {_LATENCY_NOTE}"),
        LinkEntry("ib-hdr-200", fleet_pb2.LINK_KIND_INFINIBAND, 25 * GB, _IB_LATENCY,
                  f"InfiniBand HDR 4x: 200 Gb/s data rate; Varuna §7 (DGX-2 hypercluster on 200 Gb/s "
                  f"IB); {_LATENCY_NOTE}"),
        LinkEntry("ib-ndr-400", fleet_pb2.LINK_KIND_INFINIBAND, 50 * GB, _IB_LATENCY,
                  f"InfiniBand NDR 4x: 400 Gb/s data rate; Galvatron-BMW §VII (32 A100 80GB on 400 Gb "
                  f"IB); {_LATENCY_NOTE}"),
        LinkEntry("eth-10", fleet_pb2.LINK_KIND_ETHERNET, 1.25 * GB, _ETH_LATENCY,
                  f"10 Gb/s Ethernet line rate; Varuna §7 (Azure NC6_v3/NC24_v3 VMs, 10 Gbps); {_LATENCY_NOTE}"),
        LinkEntry("eth-25", fleet_pb2.LINK_KIND_ETHERNET, 3.125 * GB, _ETH_LATENCY,
                  f"25 Gb/s Ethernet line rate; {_LATENCY_NOTE}"),
        LinkEntry("eth-100", fleet_pb2.LINK_KIND_ETHERNET, 12.5 * GB, _ETH_LATENCY,
                  f"100 Gb/s Ethernet line rate; {_LATENCY_NOTE}"),
        LinkEntry("shm", fleet_pb2.LINK_KIND_SHARED_MEMORY, 25.6 * GB, 1e-6,
                  "nominal: one DDR4-3200 channel (JEDEC, 25.6 GB/s) for a copy between processes on one "
                  "host; latency ~1 us is an order of magnitude; measure it (CPU executors)"),
    )
}

# --- Devices ---------------------------------------------------------------------------------------
_H100 = "NVIDIA H100 Tensor Core GPU datasheet, SXM column"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet, SXM column"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (SXM4)"
_V100 = "NVIDIA Tesla V100 GPU datasheet (SXM2)"
_SPARSE = "; datasheet figure is 'with sparsity', halved for dense"


def _hopper(kind: str, title: str, memory_gb: int, bandwidth: float, doc: str, aliases: tuple[str, ...]) -> DeviceEntry:
    return DeviceEntry(
        kind=kind, title=title, memory_bytes=memory_gb * GiB, memory_bandwidth_bytes_per_s=bandwidth,
        fp32_flops=67 * TFLOPS, tf32_flops=494.5 * TFLOPS, fp16_flops=989.5 * TFLOPS, bf16_flops=989.5 * TFLOPS,
        host_link="pcie5", intra_node_link="nvlink4",
        sources={
            "memory": f"{doc}: {memory_gb} GB", "bandwidth": f"{doc}: {bandwidth / 1e12:g} TB/s",
            "fp32": f"{doc}: FP32 67 TFLOPS", "tf32": f"{doc}: TF32 Tensor Core 989 TFLOPS{_SPARSE}",
            "fp16": f"{doc}: FP16 Tensor Core 1,979 TFLOPS{_SPARSE}",
            "bf16": f"{doc}: BFLOAT16 Tensor Core 1,979 TFLOPS{_SPARSE}",
            "links": f"{doc}: NVLink 900 GB/s, PCIe Gen5 128 GB/s",
        },
        aliases=aliases,
    )


def _a100(memory_gb: int, bandwidth_gbs: int, aliases: tuple[str, ...]) -> DeviceEntry:
    return DeviceEntry(
        kind=f"nvidia-a100-{memory_gb}gb", title=f"NVIDIA A100 {memory_gb}GB SXM4",
        memory_bytes=memory_gb * GiB, memory_bandwidth_bytes_per_s=bandwidth_gbs * GB,
        fp32_flops=19.5 * TFLOPS, tf32_flops=156 * TFLOPS, fp16_flops=312 * TFLOPS, bf16_flops=312 * TFLOPS,
        host_link="pcie4", intra_node_link="nvlink3",
        sources={
            "memory": f"{_A100}: {memory_gb}GB HBM2{'e' if memory_gb == 80 else ''}",
            "bandwidth": f"{_A100}: {bandwidth_gbs:,} GB/s",
            "fp32": f"{_A100}: FP32 19.5 TFLOPS",
            "tf32": f"{_A100}: TF32 Tensor Core 156 TFLOPS (312 with sparsity)",
            "fp16": f"{_A100}: FP16 Tensor Core 312 TFLOPS (624 with sparsity)",
            "bf16": f"{_A100}: BFLOAT16 Tensor Core 312 TFLOPS (624 with sparsity)",
            "links": f"{_A100}: NVLink 600 GB/s, PCIe Gen4 64 GB/s",
        },
        aliases=aliases,
        notes="Galvatron-BMW §VII evaluates 16-64 A100 (40GB, NVLink, 100 Gb IB) and 32 A100 80GB (400 Gb IB).",
    )


def _v100(memory_gb: int, aliases: tuple[str, ...]) -> DeviceEntry:
    return DeviceEntry(
        kind=f"nvidia-v100-{memory_gb}gb", title=f"NVIDIA Tesla V100 {memory_gb}GB SXM2",
        memory_bytes=memory_gb * GiB, memory_bandwidth_bytes_per_s=900 * GB,
        fp32_flops=15.7 * TFLOPS, tf32_flops=None, fp16_flops=125 * TFLOPS, bf16_flops=None,
        host_link="pcie3", intra_node_link="nvlink2",
        sources={
            "memory": f"{_V100}: {memory_gb} GB HBM2", "bandwidth": f"{_V100}: 900 GB/s",
            "fp32": f"{_V100}: single precision 15.7 TFLOPS",
            "fp16": f"{_V100}: Tensor Performance 125 TFLOPS (FP16 in, FP32 accumulate)",
            "tf32": "Volta has no TF32 tensor cores (introduced with Ampere)",
            "bf16": "Volta has no BF16 tensor cores (introduced with Ampere)",
            "links": f"{_V100}: NVLink 300 GB/s; PCIe Gen3 32 GB/s",
        },
        aliases=aliases,
        notes="SXM2 figures. The V100 PCIe card (Azure NC_v3, Varuna's commodity VMs) peaks lower: "
        "14 TFLOPS FP32, 112 TFLOPS tensor, PCIe only (V100 PCIe product brief).",
    )


DEVICES: dict[str, DeviceEntry] = {
    entry.kind: entry
    for entry in (
        _hopper("nvidia-h100-sxm-80gb", "NVIDIA H100 80GB SXM5", 80, 3.35e12, _H100,
                ("H100", "H100-80GB", "H100-SXM", "nvidia-h100-80gb", "NVIDIA H100 80GB HBM3")),
        _hopper("nvidia-h200-141gb", "NVIDIA H200 141GB SXM", 141, 4.8e12, _H200,
                ("H200", "H200-141GB", "NVIDIA H200")),
        _a100(40, 1555, ("A100", "A100-40GB", "NVIDIA A100-SXM4-40GB")),
        _a100(80, 2039, ("A100-80GB", "NVIDIA A100-SXM4-80GB")),
        _v100(16, ("V100", "V100-16GB", "Tesla V100-SXM2-16GB")),
        _v100(32, ("V100-32GB", "Tesla V100-SXM2-32GB")),
        DeviceEntry(
            kind="nvidia-titan-rtx-24gb", title="NVIDIA TITAN RTX 24GB",
            memory_bytes=24 * GiB, memory_bandwidth_bytes_per_s=672 * GB,
            fp32_flops=16.3 * TFLOPS, tf32_flops=None, fp16_flops=130 * TFLOPS, bf16_flops=None,
            host_link="pcie3", intra_node_link="pcie3",
            sources={
                "memory": "NVIDIA TITAN RTX product page: 24 GB GDDR6",
                "bandwidth": "NVIDIA TITAN RTX product page: 672 GB/s",
                "fp32": "NVIDIA TITAN RTX launch specifications: 16.3 TFLOPS FP32 (4608 cores, 1770 MHz boost)",
                "fp16": "NVIDIA TITAN RTX product page: 130 Tensor TFLOPS (576 Turing tensor cores)",
                "tf32": "Turing has no TF32 tensor cores", "bf16": "Turing has no BF16 tensor cores",
                "links": "PCIe 3.0 x16 (TITAN RTX specifications); Galvatron-BMW §VII-A: 8 per node over PCIe 3.0",
            },
            aliases=("TITAN RTX", "RTX TITAN", "TITAN-RTX-24GB", "NVIDIA TITAN RTX"),
            notes="A 2-way NVLink bridge (100 GB/s) exists but Galvatron-BMW's nodes use PCIe 3.0.",
        ),
        DeviceEntry(
            kind="nvidia-gtx-1080-ti", title="NVIDIA GeForce GTX 1080 Ti 11GB",
            memory_bytes=11 * GiB, memory_bandwidth_bytes_per_s=484 * GB,
            fp32_flops=11.3 * TFLOPS, tf32_flops=None, fp16_flops=None, bf16_flops=None,
            host_link="pcie3", intra_node_link="pcie3",
            sources={
                "memory": "NVIDIA GeForce GTX 1080 Ti specifications: 11 GB GDDR5X",
                "bandwidth": "NVIDIA GeForce GTX 1080 Ti specifications: 11 Gbps on 352-bit = 484 GB/s",
                "fp32": "NVIDIA GTX 1080 Ti launch: 11.3 TFLOPS (3584 cores x 1582 MHz boost x 2)",
                "fp16": "none: Pascal GP102 has no tensor cores and runs native FP16 math at 1/64 the FP32 rate",
                "tf32": "none (Pascal)", "bf16": "none (Pascal)",
                "links": "PCIe 3.0 x16 (GTX 1080 Ti specifications); Harmony §5.1: 4-8 per server",
            },
            aliases=("GTX 1080 Ti", "1080 Ti", "GTX1080Ti", "NVIDIA GeForce GTX 1080 Ti"),
            notes="Train in fp32: mixed precision brings no speed-up on Pascal.",
        ),
        DeviceEntry(
            kind="nvidia-l4", title="NVIDIA L4 24GB",
            memory_bytes=24 * GiB, memory_bandwidth_bytes_per_s=300 * GB,
            fp32_flops=30.3 * TFLOPS, tf32_flops=60 * TFLOPS, fp16_flops=121 * TFLOPS, bf16_flops=121 * TFLOPS,
            host_link="pcie4", intra_node_link="pcie4",
            sources={
                "memory": "NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6",
                "bandwidth": "NVIDIA L4 Tensor Core GPU datasheet: 300 GB/s",
                "fp32": "NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TFLOPS",
                "tf32": f"NVIDIA L4 Tensor Core GPU datasheet: TF32 Tensor Core 120 TFLOPS{_SPARSE}",
                "fp16": f"NVIDIA L4 Tensor Core GPU datasheet: FP16 Tensor Core 242 TFLOPS{_SPARSE}",
                "bf16": f"NVIDIA L4 Tensor Core GPU datasheet: BFLOAT16 Tensor Core 242 TFLOPS{_SPARSE}",
                "links": "NVIDIA L4 datasheet: PCIe Gen4 x16 64 GB/s; no NVLink",
            },
            aliases=("L4", "NVIDIA L4"),
        ),
        DeviceEntry(
            kind="cpu", title="CPU worker slot (nominal)",
            memory_bytes=64 * GiB, memory_bandwidth_bytes_per_s=204.8 * GB,
            fp32_flops=2.56 * TFLOPS, tf32_flops=None, fp16_flops=None, bf16_flops=None,
            host_link="shm", intra_node_link="shm",
            sources={
                "memory": "nominal: 64 GiB; the agent reports the real host memory per slot",
                "bandwidth": "nominal: 8 channels DDR4-3200 x 25.6 GB/s (JEDEC) = 204.8 GB/s",
                "fp32": "nominal: 16 cores x 2.5 GHz x 2 FMA units x 16 fp32 lanes (AVX-512) x 2 = 2.56 TFLOP/s",
                "fp16": "not modelled: CPU half-precision speed varies by ISA (AVX512-FP16, AMX); measure",
                "tf32": "none", "bf16": "not modelled: depends on AVX512-BF16/AMX; measure",
                "links": "processes on one host share memory",
            },
            aliases=("CPU", "host"),
            notes="Figures are nominal placeholders for planning tests; CPUs differ by an order of magnitude. "
            "Measured CPU profiles are the source of truth; never project from or onto this entry for real plans.",
            nominal=True,
        ),
    )
}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_INDEX: dict[str, str] = {}
for _entry in DEVICES.values():
    for _name in (_entry.kind, *_entry.aliases):
        assert _INDEX.setdefault(_key(_name), _entry.kind) == _entry.kind, f"alias clash: {_name}"


def device(name: str) -> DeviceEntry:
    """Catalog entry by kind or alias; case, spaces, dashes and underscores are ignored."""
    kind = _INDEX.get(_key(name or ""))
    if kind is None:
        raise InvalidArgument(f"unknown device {name!r}", field="device", fix=f"one of {', '.join(DEVICES)}")
    return DEVICES[kind]


def link(name: str) -> LinkEntry:
    """Link class by name ("nvlink4", "pcie4", "ib-hdr-200", "eth-10", ...)."""
    entry = LINKS.get((name or "").lower())
    if entry is None:
        raise InvalidArgument(f"unknown link {name!r}", field="link", fix=f"one of {', '.join(LINKS)}")
    return entry


def peak_flops(entry: DeviceEntry, dtype: str | int, *, tf32: bool = False) -> float:
    """Dense peak for training in `dtype`; fp32 uses TF32 tensor cores only when asked.

    PyTorch leaves TF32 matmuls off by default (torch.backends.cuda.matmul.allow_tf32), so plain fp32
    training runs at the FP32 rate unless the job opts in.
    """
    name = precision_name(dtype)
    value = entry.tf32_flops if (name == "fp32" and tf32 and entry.tf32_flops) else entry.peak_flops(name)
    if not value:
        usable = [p for p in ("fp32", "fp16", "bf16") if entry.peak_flops(p)]
        raise InvalidArgument(
            f"{entry.kind} has no fast {name} path ({entry.sources.get(name, 'unsupported')})",
            field="dtype", fix=f"train in one of {', '.join(usable)} on {entry.kind}",
        )
    return value


def to_proto(entry: DeviceEntry | str, dtype: str | int | None = None, *, tf32: bool = False) -> fleet_pb2.DeviceSpec:
    """DeviceSpec at one training precision (peak_flops is per precision in the proto)."""
    entry = device(entry) if isinstance(entry, str) else entry
    return fleet_pb2.DeviceSpec(
        kind=entry.kind,
        memory_bytes=entry.memory_bytes,
        peak_flops=peak_flops(entry, entry.default_dtype if dtype is None else dtype, tf32=tf32),
        memory_bandwidth_bytes_per_s=entry.memory_bandwidth_bytes_per_s,
        host_link=link(entry.host_link).to_proto(),
    )


def fleet(
    device_name: DeviceEntry | str,
    devices_per_node: int,
    nodes: int = 1,
    inter_node: str = "ib-hdr-200",
    *,
    intra_node: str | None = None,
    dtype: str | int | None = None,
    tf32: bool = False,
    name: str = "",
    host_memory_bytes_per_node: int = 0,
) -> fleet_pb2.Fleet:
    """A homogeneous what-if fleet; intra_node defaults to the device's usual in-node link."""
    entry = device(device_name) if isinstance(device_name, str) else device_name
    if devices_per_node < 1:
        raise InvalidArgument("must be at least 1", field="devices_per_node", fix="pass a positive count")
    if nodes < 1:
        raise InvalidArgument("must be at least 1", field="nodes", fix="pass a positive count")
    return fleet_pb2.Fleet(
        name=name or f"{nodes}x{devices_per_node}-{entry.kind}",
        device=to_proto(entry, dtype, tf32=tf32),
        devices_per_node=devices_per_node,
        nodes=nodes,
        intra_node=link(intra_node or entry.intra_node_link).to_proto(),
        inter_node=link(inter_node).to_proto(),
        host_memory_bytes_per_node=host_memory_bytes_per_node,
    )
