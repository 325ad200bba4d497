"""What this host offers, discovered without importing torch (agents must start fast)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ballast.v1 import common_pb2, fleet_pb2
from services.runtime.errors import InvalidArgument
from services.specs import catalog

_GPU_DIR = Path("/proc/driver/nvidia/gpus")


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def gpu_spec(information: str) -> fleet_pb2.DeviceSpec:
    """The catalog kind of the driver's "Model:" line (what plans and spec.fleet name), so admission can match
    a plan for "h100" to this host; a model the catalog lacks is the generic "nvidia-gpu"."""
    model = next((line.split(":", 1)[1].strip() for line in information.splitlines()
                  if line.startswith("Model:")), "")
    try:
        entry = catalog.device(model)
    except InvalidArgument:
        return fleet_pb2.DeviceSpec(kind="nvidia-gpu")
    return fleet_pb2.DeviceSpec(kind=entry.kind, memory_bytes=entry.memory_bytes)


def _information(gpu_dir: Path) -> str:
    try:
        return (gpu_dir / "information").read_text()
    except OSError:
        return ""


def devices(cpu_slots: int = 1) -> list[fleet_pb2.Device]:
    """NVIDIA GPUs if the driver lists any, else `cpu_slots` CPU worker slots."""
    gpus = sorted(_GPU_DIR.iterdir()) if _GPU_DIR.is_dir() else []
    if gpus:
        return [fleet_pb2.Device(index=i, spec=gpu_spec(_information(p)), uuid=p.name) for i, p in enumerate(gpus)]
    memory = _host_memory_bytes()
    spec = fleet_pb2.DeviceSpec(
        kind="cpu",
        memory_bytes=memory // max(1, cpu_slots),
        host_link=fleet_pb2.Link(kind=fleet_pb2.LINK_KIND_SHARED_MEMORY),
    )
    return [fleet_pb2.Device(index=i, spec=spec) for i in range(cpu_slots)]


# ZeRO-1 / ZeRO-2 are per-layer data-parallel flavours the workers run (train/sharding.py) with torch.distributed's
# reduce-scatter and all-gather; TP and SDP per layer inside a stage (train/hybrid.py: DTensor tensor parallelism,
# FSDP2 sharding), in the shapes the planner's executable_only search keeps. Gloo and NCCL alike. CHUNKS is a
# capability, not a mesh dim: the workers run a Plan.offload (PatrickStar chunks, train/worker.py chunk mode), so
# the planner may fall back to it for a model that fits no plan in device memory. HARMONY likewise: the workers
# run a Plan.harmony (the wrap-around swap schedule over one host's devices, train/worker.py Harmony mode). SP:
# sequence parallelism on the TP layers whose module declares its TP regions (train/hybrid.py).
SUPPORTED = [common_pb2.PARALLEL_DIM_DP, common_pb2.PARALLEL_DIM_PP, common_pb2.PARALLEL_DIM_ZERO1,
             common_pb2.PARALLEL_DIM_ZERO2, common_pb2.PARALLEL_DIM_TP, common_pb2.PARALLEL_DIM_SDP,
             common_pb2.PARALLEL_DIM_CHUNKS, common_pb2.PARALLEL_DIM_HARMONY, common_pb2.PARALLEL_DIM_SP]


def host_labels() -> dict[str, str]:
    """What a calibration's host class needs beyond the devices: the CPU cores this agent's workers share
    (the scheduler's affinity mask where one is set, so a container's limit counts, not the machine's); and the
    torch.distributed backends its workers run ("backends": gloo always, nccl where CUDA and NCCL are there),
    which the scheduler reads before it asks for NCCL."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 0
    return {"cpu_cores": str(cores), "backends": ",".join(backends())}


def backends(gpu_dir: Path = _GPU_DIR) -> list[str]:
    """gloo always; nccl where the driver lists GPUs and the installed torch carries NCCL (the CUDA wheels'
    `nvidia.nccl` package or a libnccl in torch/lib), found without importing torch."""
    out = ["gloo"]
    if gpu_dir.is_dir() and any(gpu_dir.iterdir()) and _has_nccl():
        out.append("nccl")
    return out


def _has_nccl() -> bool:
    try:
        if importlib.util.find_spec("nvidia.nccl") is not None:
            return True
    except (ImportError, ValueError):  # no `nvidia` namespace at all
        pass
    spec = importlib.util.find_spec("torch")
    roots = spec.submodule_search_locations if spec is not None else None
    return any(any((Path(root) / "lib").glob("libnccl*")) for root in roots or ())
