"""Users' models (issue 39): how exactly and how fast Ballast runs a model it did not write.

1. Fidelity of the cut: for each Hugging Face architecture Ballast adapts, the layered loss against the unmodified
   transformers model's own `model(**batch).loss` (and the worst gradient), on a tiny config built in code.
2. Distributed training equals one process: the example user module (examples/models/mlp.py), HF GPT-2 and HF
   Llama as 2 pipeline stages x 2 data-parallel replicas, and Llama with both blocks tensor-parallel 2, on real
   gloo process groups: the worst relative loss deviation from the single-process run over every iteration.
3. The price of the adapter: single-process training time per iteration of a zoo GPT against the Hugging Face
   GPT-2 of the very same shape (both GPT-2 blocks), and a Llama of matched parameters.
4. The check at Submit: `ProfilerService.Inspect`'s worker process, cold (a fresh process imports torch, and
   transformers for an HF model) and warm (answered from the profiler's memory).

    .venv/bin/python benchmarks/user_models.py [--steps 6] [--timing-steps 20]

Exit status 0 when every deviation is within its tolerance (rtol 1e-6 for the cut, 1e-5 for training).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from google.protobuf.json_format import MessageToDict, ParseDict  # noqa: E402

from ballast.v1 import model_pb2, services_pb2  # noqa: E402
from services.data.batches import batch_for  # noqa: E402
from services.executor.train.config import WorkerConfig  # noqa: E402
from services.executor.train.launch import plan_configs, run_local  # noqa: E402
from services.executor.train.reference import train_single  # noqa: E402
from services.executor.train.stage import make_optimizer  # noqa: E402
from services.profiler.runner import Runner  # noqa: E402
from services.runtime.allocator import STEADY_ALLOCATOR  # noqa: E402
from services.specs.model import load_model_spec  # noqa: E402
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs  # noqa: E402
from services.zoo import build_model, example_input  # noqa: E402
from services.zoo.graph import run_layers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = UserInputs.of(["mlp:build"], [str(ROOT / "examples" / "models")])
ADAM = {"name": "adam", "learning_rate": 3e-3, "weight_decay": 0.01}
DATA = {}
DECODER = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
TINY = {
    "gpt2": ("HF_TASK_CAUSAL_LM", {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4,
                                   "n_positions": 64}),
    "llama": ("HF_TASK_CAUSAL_LM", {"model_type": "llama", **DECODER}),
    "mistral": ("HF_TASK_CAUSAL_LM", {"model_type": "mistral", **DECODER, "sliding_window": 8}),
    "qwen2": ("HF_TASK_CAUSAL_LM", {"model_type": "qwen2", **DECODER}),
    "bert": ("HF_TASK_MASKED_LM", {"model_type": "bert", "vocab_size": 64, "hidden_size": 32,
                                   "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}),
    "vit": ("HF_TASK_IMAGE_CLASSIFICATION", {"model_type": "vit", "image_size": 16, "patch_size": 4,
                                             "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                             "intermediate_size": 64, "num_labels": 5}),
}


def hf(name: str, task: str, config: dict, seq: int = 16) -> model_pb2.ModelSpec:
    cfg = {"task": task, "config": config, **({"seq_length": seq} if "IMAGE" not in task else {})}
    return ParseDict({"name": name, "family": "MODEL_FAMILY_HF", "hf": cfg}, model_pb2.ModelSpec())


def cut_fidelity() -> float:
    print("1. the layered loss against the transformers model's own (batch 3, seed 1)")
    print(f"   {'model_type':<10} {'layers':>6} {'loss rel. dev.':>15} {'worst grad rel.':>16}")
    worst = 0.0
    for arch, (task, config) in TINY.items():
        spec = hf(f"bench-{arch}", task, config)
        model = build_model(spec, seed=1)
        batch = example_input(spec, 3)
        if task == "HF_TASK_CAUSAL_LM":
            ids = batch["input_ids"]
            theirs = model.hf(input_ids=ids, labels=ids).loss
            batch = {"input_ids": ids, "labels": torch.cat([ids[:, 1:], torch.full((3, 1), -100)], 1)}
        elif arch == "bert":
            theirs = model.hf(**batch).loss
        else:
            theirs = model.hf(**batch).loss
        theirs.backward()
        their_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        dec = model.decompose()
        ours = run_layers(dec, batch) / model.loss_count(batch)
        ours.backward()
        grad_dev = max(float((p.grad - their_grads[n]).abs().max() / their_grads[n].abs().max().clamp_min(1e-12))
                       for n, p in model.named_parameters())
        dev = abs(float(ours.detach()) / float(theirs.detach()) - 1)
        worst = max(worst, dev)
        print(f"   {arch:<10} {len(dec):>6} {dev:>15.2e} {grad_dev:>16.2e}")
    return worst


def distributed(steps: int) -> float:
    print(f"2. {steps} iterations on real gloo process groups against one process (global batch 8)")
    llama = hf("bench-llama", *TINY["llama"])
    runs = [("user module (examples/models/mlp.py)", load_model_spec(ROOT / "examples" / "user-mlp.yaml"),
             [[0, 3], [3, 6]], 2, EXAMPLE, {}),
            ("HF GPT-2 (tied embedding)", hf("bench-gpt2", *TINY["gpt2"]), [[0, 2], [2, 4]], 2, NO_USER_INPUTS, {}),
            ("HF Llama (GQA)", llama, [[0, 2], [2, 4]], 2, NO_USER_INPUTS, {}),
            ("HF Llama, blocks TP 2", llama, [[0, 4]], 2, NO_USER_INPUTS, {"tp_layers": [[1, 2], [2, 2]],
                                                                           "online": False})]
    worst = 0.0
    for label, spec, bounds, replicas, user_inputs, extra in runs:
        micro, num_micro = 8 // (replicas * 2), 2
        template = WorkerConfig(
            job_id="bench", model=MessageToDict(spec, preserving_proto_field_name=True), stage_bounds=bounds,
            num_replicas=1, stage_index=0, replica_index=0, rank=0, world_size=1, micro_batch_size=micro,
            num_micro_batches=num_micro, iterations=steps, init_method="", optimizer=ADAM, seed=4, data=DATA,
            timeout_s=120, user_inputs=user_inputs, **extra)
        started = time.perf_counter()
        events = run_local(plan_configs(template, bounds, replicas), env=STEADY_ALLOCATOR, timeout_s=300)
        wall = time.perf_counter() - started
        got = [e["loss"] for e in events[-1] if e["event"] == "iteration"]
        torch.set_num_threads(1)
        want = train_single(spec, DATA, 4, 8, steps, ADAM, user_inputs=user_inputs)
        dev = max(abs(a / b - 1) for a, b in zip(got, want, strict=True))
        worst = max(worst, dev)
        shape = f"{len(bounds)} stage(s) x {replicas}"
        print(f"   {label:<38} {shape:<14} max rel. dev. {dev:.2e}  (loss {want[0]:.3f} -> {want[-1]:.3f}; "
              f"{len(events)} processes, {wall:.1f} s with start-up)")
    return worst


def per_iteration(spec: model_pb2.ModelSpec, steps: int, batch: int = 8) -> float:
    torch.manual_seed(0)
    model = build_model(spec, seed=0)
    model.train()
    opt = make_optimizer(list(model.parameters()), ADAM)
    times = []
    for i in range(steps + 2):
        data = batch_for(spec, DATA, 0, i, 0, batch, global_batch_size=batch)
        started = time.perf_counter()
        loss = model(data) / model.loss_count(data)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def adapter_price(steps: int) -> None:
    h, heads, layers, vocab, seq = 256, 4, 4, 2048, 128
    gpt = ParseDict({"name": "zoo-gpt", "family": "MODEL_FAMILY_GPT", "transformer": {
        "num_layers": layers, "hidden_size": h, "num_heads": heads, "vocab_size": vocab, "seq_length": seq,
        "tie_embeddings": True}}, model_pb2.ModelSpec())
    gpt2 = hf("hf-gpt2", "HF_TASK_CAUSAL_LM", {"model_type": "gpt2", "vocab_size": vocab, "n_embd": h,
                                               "n_layer": layers, "n_head": heads, "n_positions": seq}, seq)
    llama = hf("hf-llama", "HF_TASK_CAUSAL_LM", {"model_type": "llama", "vocab_size": vocab, "hidden_size": h,
                                                 "intermediate_size": 8 * h // 3 // 32 * 32,
                                                 "num_hidden_layers": layers, "num_attention_heads": heads,
                                                 "num_key_value_heads": heads, "max_position_embeddings": seq,
                                                 "tie_word_embeddings": True}, seq)
    torch.set_num_threads(1)
    print(f"3. single-process training step, 1 thread, batch 8 x {seq} tokens, hidden {h}, {layers} blocks "
          f"(median of {steps})")
    base = None
    for label, spec in (("zoo GPT", gpt), ("HF GPT-2, same shape", gpt2), ("HF Llama, matched parameters", llama)):
        params = sum(p.numel() for p in build_model(spec, device="meta").parameters())
        seconds = per_iteration(spec, steps)
        base = base or seconds
        print(f"   {label:<30} {params / 1e6:>6.2f} M parameters  {seconds * 1e3:>7.1f} ms/iteration  "
              f"({seconds / base:.2f}x the zoo GPT)")


def inspect_latency() -> None:
    runner = Runner(store=None, user_inputs=EXAMPLE)  # Inspect reads and writes no store
    print("4. ProfilerService.Inspect (the check at Submit), in its worker process")
    for label, spec in (("user module", load_model_spec(ROOT / "examples" / "user-mlp.yaml")),
                        ("HF Llama", load_model_spec(ROOT / "examples" / "hf-llama-tiny.yaml"))):
        started = time.perf_counter()
        inspection = runner.inspect(services_pb2.InspectRequest(model=spec)).model
        cold = time.perf_counter() - started
        started = time.perf_counter()
        runner.inspect(services_pb2.InspectRequest(model=spec))
        warm = time.perf_counter() - started
        print(f"   {label:<12} {len(inspection.layers)} layers: cold {cold:.2f} s, warm {warm * 1e3:.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timing-steps", type=int, default=20)
    args = parser.parse_args()
    cut = cut_fidelity()
    trained = distributed(args.steps)
    adapter_price(args.timing_steps)
    inspect_latency()
    ok = cut <= 1e-6 and trained <= 1e-5
    print(f"{'met' if ok else 'MISSED'}: the cut {cut:.1e} (<= 1e-6), training {trained:.1e} (<= 1e-5)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
