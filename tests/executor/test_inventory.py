"""What an executor host reports: GPUs under their catalog kind (so plans and spec.fleet match them), CPU slots."""

from __future__ import annotations

from services.executor import inventory
from services.specs import catalog

H100 = """Model: \t\t NVIDIA H100 80GB HBM3
IRQ:   \t\t 0
GPU UUID: \t GPU-00000000-0000-0000-0000-000000000000
Video BIOS: \t 96.00.99.00.01
Bus Type: \t PCIe
"""


def test_a_gpu_the_catalog_knows_reports_its_catalog_kind_and_memory():
    spec = inventory.gpu_spec(H100)
    assert spec.kind == "nvidia-h100-sxm-80gb"
    assert spec.memory_bytes == catalog.device("h100").memory_bytes


def test_an_unknown_gpu_is_the_generic_kind():
    assert inventory.gpu_spec("Model: \t\t NVIDIA Future 1TB\n").kind == "nvidia-gpu"
    assert inventory.gpu_spec("").kind == "nvidia-gpu"


def test_without_gpus_the_host_offers_cpu_slots():
    slots = inventory.devices(cpu_slots=3)
    assert [d.index for d in slots] == [0, 1, 2] and {d.spec.kind for d in slots} == {"cpu"}


def test_agents_declare_the_backends_their_workers_run(tmp_path, monkeypatch):
    from services.executor import inventory

    assert inventory.backends(tmp_path / "absent") == ["gloo"]  # no GPU: gloo only
    (tmp_path / "gpus" / "0000:01:00.0").mkdir(parents=True)
    monkeypatch.setattr(inventory, "_has_nccl", lambda: False)
    assert inventory.backends(tmp_path / "gpus") == ["gloo"]  # GPUs but a CPU-only torch
    monkeypatch.setattr(inventory, "_has_nccl", lambda: True)
    assert inventory.backends(tmp_path / "gpus") == ["gloo", "nccl"]
    assert inventory.host_labels()["backends"].split(",")[0] == "gloo"
