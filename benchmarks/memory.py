"""The largest GPT each memory mode trains under one device budget per worker, on this CPU (issue 19).

Why: Ballast takes models larger than device memory (PatrickStar, Harmony). This measures how much larger, under
an enforced budget B per worker and `--workers` data-parallel workers. Goal: chunks train >= 4x the parameters
of plain DP under the same B.

Modes (a zoo GPT of `--hidden` width; the layer count is what grows):
- plain DP: every worker holds the whole model: parameters, gradients and Adam's two states (16 bytes per fp32
  parameter) plus its activations. Its largest model is the largest L with 16 P(L) + A(L) <= B, where A(L) is
  the peak of activations saved for backward, measured by the device pool on a short run of L layers (A is
  linear in L; two runs fix it). Its throughput is measured by really training that model with the executor's
  plain DP workers (`services.executor.train.launch`, one stage x `--workers` replicas).
- chunks (PatrickStar, services/executor/train/chunks.py): `--workers` gloo ranks of
  `python -m services.executor.train.offload` under the budget B, host memory unlimited; a model counts when
  all ranks finish `--iterations` iterations (a placement over B raises and the rank exits non-zero). Probed
  upwards from 4x plain's parameters in steps of `--step` layers until a run fails or `--max-layers`.
- Harmony schedule (services/executor/train/harmony.py): `--workers` gloo ranks of
  `python -m services.executor.train.harmony` on one host store in /dev/shm, each rank one device of the
  wrap-around pipeline under the budget B; the schedule is what the planner's search (sim/harmony_search.py)
  picks for the global batch, fed per-layer costs measured on a 1-block model of the same width (every block
  is the same). The model is untied (the schedule moves each layer's weights on their own), so it has
  vocab x hidden more parameters than the tied GPT of the same depth. Probed like chunks. Its swap bytes per
  device are compared with the schedule's traffic (services/memory/harmony_schedule.py).

Swap bytes: each Harmony run's iteration, every device, against the schedule's traffic; each chunked run's
steady iteration (rank 0: bytes to the device, to the host, gathered, reduced)
beside the planner's chunk simulator (services/planner/sim/chunks.py) fed what the planner has: the model's
parameter tensors and, per layer, the profile's stashed + boundary activation bytes at the micro-batch size
(the profiler measures a 2-layer model of the same width once; every block of the larger ones is the same).
Goal: within 10% each way.

Run from the repository root:

    .venv/bin/python benchmarks/memory.py [--budget-mib 256] [--workers 2] [--hidden 512] [--heads 8]
        [--vocab 4096] [--seq 64] [--micro-batch 1] [--iterations 3] [--chunk-mib 8] [--max-layers 40] [--step 8]
        [--modes chunks harmony]

A few minutes on a 2-core VM. Exits 1 if a goal is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from google.protobuf.json_format import MessageToDict, ParseDict  # noqa: E402

from ballast.v1 import model_pb2, services_pb2  # noqa: E402
from services.data.batches import batch_for  # noqa: E402
from services.executor.train.config import WorkerConfig  # noqa: E402
from services.executor.train.harmony import measure_layers, store_root  # noqa: E402
from services.executor.train.launch import plan_configs, run_local  # noqa: E402
from services.executor.train.offload import tensor_map, train_chunked  # noqa: E402
from services.memory.harmony_schedule import HarmonyLayer  # noqa: E402
from services.planner.sim.chunks import ChunkModel, ChunkOptions, simulate_chunks  # noqa: E402
from services.planner.sim.harmony_search import Machine, search  # noqa: E402
from services.profiler import driver  # noqa: E402
from services.runtime.allocator import STEADY_ALLOCATOR  # noqa: E402
from services.zoo import build_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ADAM = {"name": "adam", "learning_rate": 1e-4}
MIB = 2**20


def spec(args: argparse.Namespace, layers: int, tied: bool = True) -> model_pb2.ModelSpec:
    return ParseDict({"name": f"gpt-{layers}x{args.hidden}", "family": "MODEL_FAMILY_GPT", "transformer": {
        "num_layers": layers, "hidden_size": args.hidden, "num_heads": args.heads, "vocab_size": args.vocab,
        "seq_length": args.seq, "tie_embeddings": tied}}, model_pb2.ModelSpec())


def parameters(args: argparse.Namespace, layers: int, tied: bool = True) -> int:
    model = build_model(spec(args, layers, tied), device="meta")
    return sum(p.numel() for p in dict.fromkeys(model.parameters()))


def activation_peak(args: argparse.Namespace, layers: int) -> int:
    run = train_chunked(spec(args, layers), {}, 1, args.micro_batch, 1, ADAM,
                        device_budget=None, chunk_bytes=args.chunk_mib * MIB)
    return run.non_model_peak


def plain_largest(args: argparse.Namespace, budget: int) -> tuple[int, int]:
    a1, a2 = activation_peak(args, 1), activation_peak(args, 2)
    per_layer, base = a2 - a1, 2 * a1 - a2
    layers = 0
    while 16 * parameters(args, layers + 1) + base + per_layer * (layers + 1) <= budget:
        layers += 1
    return layers, 16 * parameters(args, layers) + base + per_layer * layers


def plain_throughput(args: argparse.Namespace, layers: int) -> float:
    model = spec(args, layers)
    bounds = [[0, layers + 2]]
    template = WorkerConfig(
        job_id="bench-memory-plain", model=MessageToDict(model, preserving_proto_field_name=True),
        stage_bounds=bounds, num_replicas=1, stage_index=0, replica_index=0, rank=0, world_size=1,
        micro_batch_size=args.micro_batch, num_micro_batches=1, iterations=args.iterations, init_method="",
        optimizer=ADAM, seed=1, data={}, timeout_s=300, online=False)
    events = run_local(plan_configs(template, bounds, args.workers), env=STEADY_ALLOCATOR, timeout_s=600)
    seconds = [e["iteration_s"] for e in events[0] if e["event"] == "iteration"][1:]
    return args.workers * args.micro_batch / (sum(seconds) / len(seconds))


def profiled_activations(args: argparse.Namespace) -> dict[str, int]:
    """Saved activation bytes per layer kind at the micro-batch size, from the profiler (stashed + boundary)."""
    request = services_pb2.ProfileRequest(options=services_pb2.ProfileOptions(
        micro_batch_sizes=sorted({1, args.micro_batch}), intra_op_threads=1, skip_memory_trace=True))
    profile = driver.profile(spec(args, 2), request)
    out = {}
    for layer in profile.layers:
        sample = next(s for s in layer.samples if s.micro_batch_size == args.micro_batch)
        out[layer.kind] = sample.stashed_activation_bytes + sample.boundary_activation_bytes
    return out


def simulated(args: argparse.Namespace, layers: int, budget: int, kinds: dict[str, int]) -> dict[str, int]:
    model = build_model(spec(args, layers), device="meta")
    tensors, per_layer = tensor_map(model)
    acts = tuple(kinds[layer.kind] for layer in model.decompose().layers)
    sim = simulate_chunks(ChunkModel(tuple(tensors), tuple(map(tuple, per_layer)), acts),
                          ChunkOptions(args.chunk_mib * MIB, budget, world=args.workers), iterations=args.iterations)
    return vars(sim.steady) if sim.feasible else {}


def chunked(args: argparse.Namespace, layers: int, budget: int, kinds: dict[str, int]) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp, "config.json")
        config.write_text(json.dumps({
            "model": MessageToDict(spec(args, layers), preserving_proto_field_name=True), "seed": 1,
            "global_batch_size": args.workers * args.micro_batch, "iterations": args.iterations, "optimizer": ADAM,
            "device_budget": budget, "chunk_bytes": args.chunk_mib * MIB}))
        results = ranks(args, "services.executor.train.offload", config, tmp, f"chunks, {layers} layers")
    if results is None:
        return None
    seconds = results[0]["iteration_s"][1:]
    out = {"layers": layers, "parameters": results[0]["model_bytes"] // 4,
           "samples_per_s": args.workers * args.micro_batch / (sum(seconds) / len(seconds)),
           "device_peak": max(r["device_peak"] for r in results), "host_peak": max(r["host_peak"] for r in results),
           "to_device": results[0]["traffic"][-1]["to_device"], "gathered": results[0]["traffic"][-1]["gathered"]}
    print(f"  chunks, {layers} layers: {out['parameters'] / 1e6:.1f}M parameters, "
          f"{out['samples_per_s']:.2f} samples/s, device peak {out['device_peak'] / MIB:.0f} MiB, "
          f"host peak {out['host_peak'] / MIB:.0f} MiB per rank")
    measured, predicted = results[0]["traffic"][-1], simulated(args, layers, budget, kinds)
    errors = []
    for key in ("to_device", "to_host", "gathered", "reduced"):
        m, p = measured[key], predicted.get(key, 0)
        errors.append(abs(p - m) / m if m else float(p != 0))
        print(f"    {key}: measured {m / MIB:.1f} MiB, simulated {p / MIB:.1f} MiB ({(p - m) / m:+.1%})"
              if m else f"    {key}: measured 0, simulated {p / MIB:.1f} MiB")
    out["swap_error"] = max(errors)
    return out


def harmony_costs(args: argparse.Namespace, layers: int) -> list[HarmonyLayer]:
    """Per-layer costs of the untied GPT of `layers` blocks, measured on one block (the blocks are alike)."""
    one = spec(args, 1, tied=False)
    batch = batch_for(one, {}, 1, 0, 0, 1, global_batch_size=args.workers * args.micro_batch)
    embed, block, head = measure_layers(build_model(one, seed=1).decompose(), batch, "adam")
    return [embed, *[block] * layers, head]


def harmony(args: argparse.Namespace, layers: int, budget: int) -> dict | None:
    global_batch_size = args.workers * args.micro_batch
    costs = harmony_costs(args, layers)
    choice = search(costs, global_batch_size, Machine(args.workers, budget, 5e9, 2e9))
    if choice is None:
        print(f"  harmony, {layers} layers: no schedule fits")
        return None
    s = choice.schedule
    store = store_root()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp, "config.json")
        config.write_text(json.dumps({
            "model": MessageToDict(spec(args, layers, tied=False), preserving_proto_field_name=True), "seed": 1,
            "global_batch_size": global_batch_size, "iterations": args.iterations, "optimizer": ADAM,
            "device_budget": budget,
            "store_dir": store, "prefetch": choice.prefetch,
            "schedule": {"forward_micro_batch": s.forward_micro_batch, "forward_packs": s.forward_packs,
                         "backward_micro_batch": s.backward_micro_batch, "backward_packs": s.backward_packs,
                         "devices": s.devices}}))
        try:
            results = ranks(args, "services.executor.train.harmony", config, tmp, f"harmony, {layers} layers")
        finally:
            shutil.rmtree(store, ignore_errors=True)
    if results is None:
        return None
    seconds = results[0]["iteration_s"][1:]
    out = {"layers": layers, "parameters": results[0]["model_bytes"] // 4,
           "samples_per_s": global_batch_size / (sum(seconds) / len(seconds)),
           "device_peak": max(r["device_peak"] for r in results), "predicted_peak": max(choice.peak_bytes),
           "packs": (len(s.forward_packs), len(s.backward_packs)), "micro_batches": (s.forward_micro_batch,
                                                                                     s.backward_micro_batch)}
    print(f"  harmony, {layers} layers: {out['parameters'] / 1e6:.1f}M parameters, {out['samples_per_s']:.2f} "
          f"samples/s, device peak {out['device_peak'] / MIB:.0f} MiB (search said {out['predicted_peak'] / MIB:.0f}),"
          f" {out['packs'][0]} forward / {out['packs'][1]} backward packs, U_F {s.forward_micro_batch}, "
          f"U_B {s.backward_micro_batch}, prefetch {choice.prefetch}; estimator {choice.iteration_s:.2f} s per "
          f"iteration against {sum(seconds) / len(seconds):.2f} s measured")
    errors = []
    for r in results:
        moved = r["traffic"][-1]
        for key, predicted in (("to_device", choice.traffic.to_device), ("to_host", choice.traffic.to_host),
                               ("peer", choice.traffic.peer)):
            m, p = moved[key], predicted[r["rank"]]
            errors.append(abs(p - m) / m if m else float(p != 0))
        print(f"    device {r['rank']}: in {moved['to_device'] / MIB:.1f} MiB (schedule "
              f"{choice.traffic.to_device[r['rank']] / MIB:.1f}), out {moved['to_host'] / MIB:.1f} MiB (schedule "
              f"{choice.traffic.to_host[r['rank']] / MIB:.1f}), peer {moved['peer'] / MIB:.2f} MiB, swap "
              f"{moved['swap_s']:.2f} s, waiting on peers {moved['peer_s']:.2f} s")
    out["swap_error"] = max(errors)
    return out


def ranks(args: argparse.Namespace, module: str, config: Path, tmp: str, label: str) -> list[dict] | None:
    """Run `--workers` ranks of `module` on gloo; their JSON results, or None (printed why) if one failed."""
    procs = [subprocess.Popen(
        [sys.executable, "-m", module, "--config", str(config), "--rank", str(r), "--world", str(args.workers),
         "--init", f"file://{tmp}/rendezvous", "--out", f"{tmp}/{r}.json"],
        cwd=ROOT, env={**os.environ, **STEADY_ALLOCATOR}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for r in range(args.workers)]
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        errors = [p.stderr.read().decode().strip().splitlines()[-1:] for p in procs if p.stderr]
        print(f"  {label}: failed ({[e for e in errors if e]})")
        return None
    return [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(args.workers)]


def probe(args: argparse.Namespace, start: int, run) -> tuple[dict | None, float]:  # noqa: ANN001 - a mode's runner
    """The largest model `run(layers)` trains, from `start` layers up by --step to --max-layers; worst swap error."""
    best, worst, candidate = None, 0.0, start
    while candidate <= args.max_layers:
        result = run(candidate)
        if result is None:
            break
        best, worst = result, max(worst, result["swap_error"])
        candidate += args.step
    return best, worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--max-layers", type=int, default=40)
    parser.add_argument("--step", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=["chunks", "harmony"], choices=["chunks", "harmony"])
    args = parser.parse_args()
    budget = args.budget_mib * MIB
    started = time.perf_counter()
    layers, need = plain_largest(args, budget)
    plain_params = parameters(args, layers)
    print(f"plain DP: {layers} layers, {plain_params / 1e6:.1f}M parameters, {need / MIB:.0f} MiB of "
          f"{args.budget_mib} MiB per worker")
    plain_rate = plain_throughput(args, layers) if layers else 0.0
    print(f"  plain DP throughput: {plain_rate:.2f} samples/s ({args.workers} workers)")
    kinds = profiled_activations(args)
    start = layers + 1
    while parameters(args, start) < 4 * plain_params:
        start += 1
    met = True
    for name, run in (("chunks", lambda n: chunked(args, n, budget, kinds)),
                      ("harmony", lambda n: harmony(args, n, budget))):
        if name not in args.modes:
            continue
        best, worst_swap = probe(args, start, run)
        ratio = best["parameters"] / plain_params if best and plain_params else 0.0
        swap_met = best is not None and worst_swap <= 0.10
        met = met and ratio >= 4 and swap_met
        print(f"{name} / plain DP parameters: {ratio:.1f}x (goal >= 4x: {'met' if ratio >= 4 else 'MISSED'}) at "
              f"{best['samples_per_s'] if best else 0:.2f} samples/s; swap bytes predicted within {worst_swap:.1%} "
              f"(goal <= 10%: {'met' if swap_met else 'MISSED'})")
    print(f"{time.perf_counter() - started:.0f} s")
    print("command: .venv/bin/python benchmarks/memory.py " + shlex.join(sys.argv[1:]))
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
