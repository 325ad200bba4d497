"""The largest GPT plain training and chunks train under one device budget on a GPU (issue 19, its last point).

Why: benchmarks/memory.py measures the chunk trainer on a CPU, where "device" and "host" are the same DRAM and the
budget is only accounted. On a GPU the budget is the allocator's: this holds both modes to
`torch.cuda.max_memory_allocated() <= B` (cuBLAS workspaces and every transient included) and measures what each
trains and how fast, the chunk trainer moving chunks over PCIe on a copy stream from pinned host buffers.

One GPU, one process, a zoo GPT of `--hidden` width whose layer count grows (memory.py's `spec`):
- plain: the whole model, its gradients, Adam's states (the executor's `make_optimizer`: foreach on CUDA) and
  the activations on the GPU, trained `--iterations` iterations; a model fits when the allocator's peak is <= B.
  The peak is near linear in the layers: two short runs place the guess, runs either side of it confirm it.
- chunks: `ChunkedTrainer` on the GPU under B (its pool gets B less the runtime's own allocations and the
  transients, `chunks.pool_budget`), host memory unlimited; a model fits when every iteration runs (no
  `BudgetExceeded`) and the allocator's peak is <= B. Probed from 4x plain's parameters upwards in steps of
  `--step` layers until a run fails, `--max-layers`, or the time guard (`--guard-s`) says the next would not end
  in time.
- both build the model on the host with the same seed (the chunk trainer must: a model over B cannot be built on
  the GPU), so at plain's largest size the chunk trainer's losses must equal plain's (rtol 1e-5, fp32).

Throughput is samples (and tokens) per second over the iterations after the first, each ended by a device sync.

Run from the repository root (exits 0 with a message where CUDA is not available):

    python benchmarks/memory_gpu.py [--budget-mib 1024] [--hidden 1024] [--heads 16] [--vocab 8192] [--seq 128]
        [--micro-batch 1] [--iterations 3] [--chunk-mib 32] [--step 16] [--max-layers 96] [--guard-s 200]
        [--json PATH]

Exits 1 if a chunked run's allocator peak passes B or the losses differ.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ballast.v1 import common_pb2  # noqa: E402
from benchmarks.memory import ADAM, MIB, parameters, spec  # noqa: E402
from services.data.batches import batch_for  # noqa: E402
from services.executor.train.data import dropout_seed  # noqa: E402
from services.executor.train.offload import ChunkedTrainer  # noqa: E402
from services.executor.train.stage import make_optimizer  # noqa: E402
from services.memory.pool import BudgetExceeded  # noqa: E402
from services.zoo import build_model  # noqa: E402

DATA = {}
SEED = 1
DEVICE = torch.device("cuda")


def settle() -> None:
    """Free what the last run left (device and pinned host caches) and restart the peak at what stays."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    empty_host = getattr(torch._C, "_host_emptyCache", None)
    if empty_host is not None:
        empty_host()
    torch.cuda.reset_peak_memory_stats()


def rates(args: argparse.Namespace, seconds: list[float]) -> tuple[float, float]:
    """(samples/s, tokens/s) over the iterations after the first (the warm-up)."""
    steady = seconds[1:] or seconds
    samples = args.micro_batch / (sum(steady) / len(steady))
    return samples, samples * args.seq


def plain_run(args: argparse.Namespace, layers: int) -> dict[str, Any]:
    """Train `layers` layers in GPU memory (reference.train_single's loop, the model built on the host)."""
    settle()
    model_spec = spec(args, layers)
    model = build_model(model_spec, seed=SEED).to(DEVICE)
    model.train()
    opt = make_optimizer(list(model.parameters()), ADAM)
    losses, seconds = [], []
    for it in range(args.iterations):
        began = time.perf_counter()
        batch = {k: v.to(DEVICE) for k, v in batch_for(model_spec, DATA, SEED, it, 0, args.micro_batch,
                                                       global_batch_size=args.micro_batch).items()}
        count = max(model.loss_count(batch), 1)
        torch.manual_seed(dropout_seed(SEED, it, 0))
        loss = model(batch)
        (loss / count).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()) / count)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated()
    del model, opt, loss, batch
    samples, tokens = rates(args, seconds)
    out = {"mode": "plain", "layers": layers, "parameters": parameters(args, layers), "allocator_peak": peak,
           "fits": peak <= args.budget_mib * MIB, "losses": losses, "samples_per_s": samples, "tokens_per_s": tokens}
    print(f"  plain {layers} layers: {out['parameters'] / 1e6:.1f}M parameters, allocator peak "
          f"{peak / MIB:.0f} MiB ({'fits' if out['fits'] else 'over'}), {samples:.2f} samples/s", flush=True)
    return out


def plain_largest(args: argparse.Namespace) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The largest layer count whose plain run fits, with a run one layer above it that does not."""
    runs: dict[int, dict[str, Any]] = {}

    def run(layers: int) -> dict[str, Any]:
        if layers not in runs:
            runs[layers] = plain_run(args, layers)
        return runs[layers]

    one, two = run(1), run(2)
    per_layer = max(two["allocator_peak"] - one["allocator_peak"], 1)
    layers = max(1, (args.budget_mib * MIB - one["allocator_peak"]) // per_layer + 1)
    for _ in range(8):
        if not run(layers)["fits"]:
            if layers == 1:
                return None, list(runs.values())
            layers -= 1
        elif run(layers + 1)["fits"]:
            layers += 1
        else:
            return runs[layers], list(runs.values())
    raise RuntimeError("plain: the fitting layer count did not settle in 8 runs; the peak is not near linear")


def chunk_run(args: argparse.Namespace, layers: int, bf16: bool = False) -> dict[str, Any]:
    """Train `layers` layers with the chunk trainer under the budget; `fits` when it ran and stayed within it.
    `bf16`: mixed precision (bf16 chunks and compute, fp32 master and Adam states)."""
    settle()
    budget = args.budget_mib * MIB
    began = time.perf_counter()
    out: dict[str, Any] = {"mode": "chunks bf16" if bf16 else "chunks", "layers": layers,
                           "parameters": parameters(args, layers)}
    out["allocated_at_start"] = torch.cuda.memory_allocated()  # the runtime's alone: earlier runs freed theirs
    model = spec(args, layers)
    if bf16:
        model.dtype = common_pb2.DTYPE_BF16
    trainer = None
    try:
        trainer = ChunkedTrainer(model, DATA, SEED, args.micro_batch, ADAM, device_budget=budget,
                                 chunk_bytes=args.chunk_mib * MIB, device=DEVICE)
        steps = [trainer.step(it) for it in range(args.iterations)]
    except BudgetExceeded as exc:
        out.update(fits=False, error=str(exc).split(": raise")[0], allocator_peak=torch.cuda.max_memory_allocated())
        print(f"  chunks {layers} layers: refused ({out['error']})", flush=True)
        return out
    finally:
        if trainer is not None:
            trainer.close()
        out["seconds"] = time.perf_counter() - began
    peak = torch.cuda.max_memory_allocated()
    samples, tokens = rates(args, [s.iteration_s for s in steps])
    out.update(allocator_peak=peak, fits=peak <= budget, honest=peak <= budget, losses=[s.loss for s in steps],
               samples_per_s=samples, tokens_per_s=tokens, pool_peak=trainer.device_pool.peak,
               pool_budget=trainer.pool_budget, runtime_bytes=trainer.runtime_bytes,
               host_peak=trainer.host_pool.peak, swap_s=[s.swap_s for s in steps],
               to_device=steps[-1].traffic.to_device, to_host=steps[-1].traffic.to_host,
               optimizer_chunks_on_device=trainer.manager.policy.os_on_device)
    print(f"  {out['mode']} {layers} layers: {out['parameters'] / 1e6:.1f}M parameters, allocator peak "
          f"{peak / MIB:.0f} MiB of {args.budget_mib} (pool peak {out['pool_peak'] / MIB:.0f} of "
          f"{out['pool_budget'] / MIB:.0f} MiB, "
          f"runtime {out['runtime_bytes'] / MIB:.1f} MiB), {samples:.2f} samples/s, swap "
          f"{out['swap_s'][-1]:.2f} s/iteration, {out['seconds']:.0f} s", flush=True)
    return out


def chunk_probe(args: argparse.Namespace, start: int, started: float) -> list[dict[str, Any]]:
    """Chunked runs from `start` layers up by `--step` until one fails, `--max-layers`, or the time guard."""
    runs: list[dict[str, Any]] = []
    layers = start
    while layers <= args.max_layers:
        if runs:
            last = runs[-1]
            expected = last["seconds"] * parameters(args, layers) / last["parameters"]
            if time.perf_counter() - started + expected > args.guard_s:
                print(f"  chunks {layers} layers: not tried (time guard: ~{expected:.0f} s more would pass "
                      f"{args.guard_s} s)", flush=True)
                break
        runs.append(chunk_run(args, layers))
        if not runs[-1]["fits"]:
            break
        layers += args.step
    return runs


def row(mode: str, run: dict[str, Any] | None, args: argparse.Namespace, note: str = "") -> str:
    if run is None:
        return f"| {mode} | none fits | — | — | — | — | {note} |"
    if "samples_per_s" not in run:
        return f"| {mode} | {run['layers']} layers: refused | {run['parameters'] / 1e6:.1f}M | — | — | — | {note} |"
    pool = (f"{run['pool_peak'] / MIB:.0f} of {run['pool_budget'] / MIB:.0f} MiB" if "pool_peak" in run else "—")
    return (f"| {mode} | {run['layers']} layers | {run['parameters'] / 1e6:.1f}M | {run['samples_per_s']:.2f} "
            f"samples/s ({run['tokens_per_s']:.0f} tokens/s) | {run['allocator_peak'] / MIB:.0f} MiB of "
            f"{args.budget_mib} | {pool} | {note} |")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mib", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--chunk-mib", type=int, default=32)
    parser.add_argument("--step", type=int, default=16)
    parser.add_argument("--max-layers", type=int, default=96)
    parser.add_argument("--guard-s", type=float, default=200.0, help="stop probing when the next run would pass it")
    parser.add_argument("--json", default="", help="also write the summary here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    if not torch.cuda.is_available():
        print("memory_gpu: no CUDA device here (torch.cuda.is_available() is False); nothing measured. "
              "benchmarks/memory.py is the CPU benchmark.")
        return 0
    args = parse(argv)
    started = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, budget {args.budget_mib} MiB", flush=True)
    plain, plain_runs = plain_largest(args)
    if plain is None:
        print("plain: not even one layer fits the budget; raise --budget-mib")
        return 1
    print(f"plain: {plain['layers']} layers fit", flush=True)
    common = chunk_run(args, plain["layers"])
    losses_equal = common["fits"] and all(
        abs(c - p) <= 1e-5 * abs(p) for c, p in zip(common["losses"], plain["losses"], strict=True))
    print(f"losses at {plain['layers']} layers: plain {plain['losses']}, chunks {common.get('losses')} "
          f"({'equal' if losses_equal else 'DIFFER'} at rtol 1e-5)", flush=True)
    # mixed precision against fp32 chunks on the same model, before any refused run
    mixed = chunk_run(args, plain["layers"], bf16=True)
    mixed_close = mixed["fits"] and common["fits"] and all(
        abs(m - c) <= 2e-2 * abs(c) for m, c in zip(mixed["losses"], common["losses"], strict=True))
    print(f"bf16 losses at {plain['layers']} layers: {mixed.get('losses')} ({'within' if mixed_close else 'NOT within'}"
          " 2% of fp32 chunks)", flush=True)
    start = plain["layers"] + 1
    while parameters(args, start) < 4 * plain["parameters"]:
        start += 1
    probes = chunk_probe(args, start, started)
    dishonest = [r for r in [common, *probes] if r.get("honest") is False]
    fitted = [r for r in [common, *probes] if r["fits"]]
    best = max(fitted, key=lambda r: r["layers"]) if fitted else None
    ratio = best["parameters"] / plain["parameters"] if best else 0.0
    speed = best["samples_per_s"] / plain["samples_per_s"] if best else 0.0
    limit = ("not probed: 4x plain's parameters is past --max-layers" if not probes else
             "a failed run above it" if not probes[-1]["fits"] else
             "the probe's end (--max-layers or the time guard), not a failure")
    mixed_best = chunk_run(args, best["layers"], bf16=True) if best else None
    dishonest += [r for r in (mixed, mixed_best) if r is not None and r.get("honest") is False]
    summary = {
        "mixed_precision": {"common_size": mixed, "largest_fp32_size": mixed_best, "losses_close": mixed_close},
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "budget_mib": args.budget_mib,
        "config": {k: v for k, v in vars(args).items() if k != "json"}, "plain": plain, "chunks": best,
        "common_size": common, "losses_equal": losses_equal, "parameter_ratio": ratio, "throughput_ratio": speed,
        "chunk_limit": limit,
        "budget_honest": not dishonest, "runs": plain_runs + probes, "seconds": time.perf_counter() - started}
    print("JSON " + json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print("\n| mode | largest model found | parameters | throughput | allocator peak | pool peak | note |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(row("plain (GPU memory)", plain, args))
    print(row("chunks, same size", common, args, "losses " + ("equal" if losses_equal else "DIFFER")))
    print(row("chunks", best, args, f"{ratio:.1f}x the parameters, {speed:.3f}x the samples/s; "
                                    + summary["chunk_limit"]))
    print(row("chunks bf16, plain's size", mixed, args, "losses " + ("within 2% of fp32" if mixed_close else
                                                                      "NOT within 2%")))
    print(row("chunks bf16, fp32's largest", mixed_best, args))
    print(f"\nchunks / plain parameters {ratio:.1f}x; allocator peak within the budget in every chunked run: "
          f"{'yes' if not dishonest else 'NO'}; {summary['seconds']:.0f} s")
    print("command: python benchmarks/memory_gpu.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    return 0 if losses_equal and mixed_close and not dishonest else 1


if __name__ == "__main__":
    raise SystemExit(main())
