"""The planner benchmark's cases and a fingerprint of the plans each one picks (issue 44: a faster search
must keep every plan). `benchmarks/planner.py --record` writes the fingerprints; a test re-plans the cases and
compares them.

Galvatron cases: the benchmark's model (an analytical GPT: L blocks, hidden 4096, 32 heads, sequence 2048)
on its fleets, the default search options, top_k 5. Varuna cases: the same models at a fixed global batch.
The plans were recorded before sequence parallelism existed, so the cases search Galvatron-BMW's own space
(`GALVATRON_DIMS`, the default without "sp"); `sequence=True` searches the default space.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from google.protobuf.json_format import ParseDict  # noqa: E402

from ballast.v1 import fleet_pb2, model_pb2  # noqa: E402
from services.planner.cost import CostContext, ModelView, from_profile  # noqa: E402
from services.planner.search import galvatron, varuna  # noqa: E402
from services.planner.search.problem import PricedPlan, SearchOptions  # noqa: E402
from services.profiler.projection import analytical_profile  # noqa: E402
from services.specs.fleet import fleet_from_dict, load_fleet  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "planner" / "search" / "data" / "benchmark_plans.json"
LAYERS = (24, 48, 96)
DEVICES = (8, 16, 64)
GALVATRON_CASES = [(layers, devices) for layers in LAYERS for devices in DEVICES] + [(96, 1024)]
VARUNA_CASES = [(24, 16, 256), (48, 64, 512), (96, 1024, 1024)]


def view(layers: int) -> ModelView:
    spec = {"name": f"gpt-{layers}", "family": "MODEL_FAMILY_GPT", "dtype": "DTYPE_FP16",
            "transformer": {"num_layers": layers, "hidden_size": 4096, "num_heads": 32, "vocab_size": 50257,
                            "seq_length": 2048}}
    return from_profile(analytical_profile(ParseDict(spec, model_pb2.ModelSpec()), "nvidia-a100-80gb"))


def fleet(devices: int) -> fleet_pb2.Fleet:
    if devices <= 16:
        return load_fleet(ROOT / "examples" / "fleet-2x8xA100.yaml")
    return fleet_from_dict({"name": f"{devices // 8}x8-a100-80gb", "device": "nvidia-a100-80gb",
                            "nodes": devices // 8, "devices_per_node": 8, "intra_node": "nvlink3",
                            "inter_node": "ib-hdr-200"})


GALVATRON_DIMS = ("dp", "sdp", "tp")


def options(devices: int, sequence: bool = False, **extra: object) -> SearchOptions:
    dims = SearchOptions.dims if sequence else GALVATRON_DIMS
    return SearchOptions(memory_budget_bytes=fleet(devices).device.memory_bytes, dims=dims,  # type: ignore[arg-type]
                         **extra)


def galvatron_plans(layers: int, devices: int, sequence: bool = False) -> list[PricedPlan]:
    f = fleet(devices)
    return galvatron.Planner(CostContext(view(layers), f), devices, options(devices, sequence)).run()


def varuna_plans(layers: int, devices: int, batch: int) -> list[PricedPlan]:
    return varuna.configure(CostContext(view(layers), fleet(devices)), devices, batch, options(devices))


def fingerprint(plans: list[PricedPlan]) -> list[dict]:
    """What must not change: each plan's shape, strategies and price (floats as repr, compared with a tolerance
    of 1e-9 by the test: summing in another order may move the last bit)."""
    return [{
        "engine": p.engine, "name": p.name, "stages": [list(b) for b in p.stage_bounds],
        "strategies": [st.describe() for st in p.strategies], "replicas": p.replicas,
        "micro_batch_size": p.micro_batch_size, "num_micro_batches": p.num_micro_batches,
        "schedule": p.schedule.value, "global_batch_size": p.global_batch_size, "iteration_s": p.iteration_s,
        "peak_memory_bytes": list(p.peak_memory_bytes), "out_of_memory": p.out_of_memory,
    } for p in plans]


def record() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for layers, devices in GALVATRON_CASES:
        out[f"galvatron {layers} {devices}"] = fingerprint(galvatron_plans(layers, devices))
    for layers, devices, batch in VARUNA_CASES:
        out[f"varuna {layers} {devices} {batch}"] = fingerprint(varuna_plans(layers, devices, batch))
    return out
