"""The load benchmark's job: a small GPT on an analytical A100 fleet, cheap to plan and never trained (load.py
submits it in a loop; hot_paths.py times the store and planner calls it makes)."""

from __future__ import annotations

from ballast.v1 import job_pb2, model_pb2
from services.specs.fleet import fleet_from_dict

MODEL = model_pb2.ModelSpec(name="load-gpt", family=model_pb2.MODEL_FAMILY_GPT, transformer=model_pb2.TransformerConfig(
    num_layers=2, hidden_size=64, num_heads=2, vocab_size=256, seq_length=32))
FLEET = {"name": "load-1x2-a100", "device": "nvidia-a100-80gb", "nodes": 1, "devices_per_node": 2}


def spec(name: str) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(name=name, model=MODEL, global_batch_size=8, iterations=10, fleet=fleet_from_dict(FLEET))
