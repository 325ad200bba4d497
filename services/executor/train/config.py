"""WorkerConfig: everything one worker process needs, as plain JSON (the agent writes it, never a pickle).

Rank layout: `dims` (dims.ParallelDims, axes pp = stages, dp = replicas) owns it; stage-major, so
`rank = stage_index * num_replicas + replica_index`.

Iteration numbers count completed iterations: `start_iteration` iterations are already done (0 for a fresh
run), the worker trains until `iterations` are done, and iteration index i (0-based) draws the samples
`i * global_batch_size + k`. Events and checkpoints report the count done after the step.

The plan may change while training (issue 7): `plan_version`, `stage_bounds`, `checkpoint_layers`,
`swap_layers`, `zero1_layers` and `zero2_layers` are the INITIAL plan; a "plan" command on the worker's stdin
(services/executor/train/migration.py) replaces them at an iteration boundary that every rank agrees on. Stage
count and replica count never change.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from google.protobuf.json_format import ParseDict, ParseError

from ballast.v1 import job_pb2, model_pb2
from services.specs.parallel import ParallelDims
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs

SCHEDULES = ("1f1b", "gpipe")
OPTIMIZERS = ("adam", "sgd")
BACKENDS = ("gloo", "nccl")
HARMONY_KEYS = frozenset({"forward_micro_batch", "forward_packs", "backward_micro_batch", "backward_packs", "devices",
                          "prefetch", "device_budget_bytes", "store_dir"})


@dataclass(frozen=True)
class WorkerConfig:
    job_id: str
    model: dict[str, Any]  # ModelSpec as MessageToDict(spec, preserving_proto_field_name=True)
    stage_bounds: list[list[int]]  # [begin, end) layer indices per stage: contiguous, covering every layer
    num_replicas: int
    stage_index: int
    replica_index: int
    rank: int
    world_size: int
    micro_batch_size: int  # samples per micro-batch per replica
    num_micro_batches: int
    iterations: int  # train until this many iterations are done
    init_method: str  # e.g. "tcp://127.0.0.1:29500"
    schedule: str = "1f1b"
    checkpoint_layers: list[int] = field(default_factory=list)  # layers recomputed in backward
    # Layers whose activations saved for backward go to a host buffer pool after forward and come back before
    # their backward (swap.py). A layer in both lists is recomputed, never swapped: checkpoint wins.
    swap_layers: list[int] = field(default_factory=list)
    # Data-parallel flavour per layer over the stage's replicas (sharding.py): ZeRO-1 shards the optimizer state,
    # ZeRO-2 the optimizer state and the reduced gradient; a layer in neither list is plain DP. Disjoint; with one
    # replica both are a no-op.
    zero1_layers: list[int] = field(default_factory=list)
    zero2_layers: list[int] = field(default_factory=list)
    # Per-layer tensor parallelism ([layer, degree] pairs: the stage's ranks in groups of `degree`) and sharded data
    # parallelism (FSDP over the stage's ranks) inside a stage (hybrid.py). Fixed for the run: a plan command
    # cannot change them.
    tp_layers: list[list[int]] = field(default_factory=list)
    sdp_layers: list[int] = field(default_factory=list)
    # TP layers that also split the sequence over their tp ranks (sequence parallelism, hybrid.py); a subset of
    # tp_layers' layers.
    sp_layers: list[int] = field(default_factory=list)
    # [layer_index, iteration, active (0 | 1)]: from 0-based iteration `iteration` on, the layer computes (1) or
    # is the identity on its first input (0; its parameters get no gradient). Only layers whose output has the
    # shape and dtype of their first input may be toggled (checked when the stage is built).
    layer_toggles: list[list[int]] = field(default_factory=list)
    optimizer: dict[str, Any] = field(default_factory=lambda: {"name": "adam", "learning_rate": 1e-3})
    seed: int = 0
    start_iteration: int = 0
    data: dict[str, Any] = field(default_factory=dict)  # a DataSpec as MessageToDict writes it; {}: synthetic
    checkpoint_dir: str = ""
    checkpoint_every: int = 0  # 0 = never
    # Validation loss on `eval_batches` validation batches (of global_batch_size samples) after every `eval_every`
    # iterations and after the last; 0 = never. Forward only, outside the iteration's time.
    eval_every: int = 0
    eval_batches: int = 4
    # Write cadence checkpoints in the background (the boundary only copies tensors to host memory); drains and
    # the last iteration's wait are synchronous either way. False: the whole write at the boundary.
    checkpoint_background: bool = True
    resume_from: str = ""  # "" or a checkpoint directory holding manifest.json
    # "" or weights to start from (fine-tuning, a fresh optimizer): a checkpoint directory (its parameters only) or
    # a directory of exported weights (model.safetensors, the model's own names)
    init_from: str = ""
    # Also checkpoint after the last iteration (jobs through the plane: their final weights can be exported, and a
    # job can be continued from them)
    final_checkpoint: bool = False
    backend: str = "gloo"
    device: str = "cpu"  # "cpu" with gloo; "cuda:N" with nccl (or gloo)
    timeout_s: float = 300.0  # process-group timeout: a dead peer fails the group after this long
    intra_op_threads: int = 1
    plan_version: int = 0  # version of the initial plan; "plan" commands must carry higher versions
    # Take "plan" commands (live repartitioning): the agreement group and the per-iteration MIN all-reduce, and the
    # migration groups, exist only then.
    online: bool = True
    predicted_iteration_s: float = 0.0
    chunk_bytes: int = 0  # > 0: chunk offload with chunks of this many bytes; 0: the model stays in device memory
    device_budget_bytes: int = 0  # chunk offload's device memory per worker; 0: no budget
    # Harmony's swap schedule (train/harmony.py): {} = off; else HARMONY_KEYS: the schedule (forward_micro_batch,
    # forward_packs [[begin, end], ...], backward_micro_batch, backward_packs, devices), prefetch,
    # device_budget_bytes (0: no budget) and store_dir (the host store every rank of the job maps). Ranks are the
    # devices of one pipeline over the whole global batch, not replicas: global_batch_size is not multiplied by them.
    harmony: dict[str, Any] = field(default_factory=dict)
    # The operator's word on users' models, from the agent's settings (BALLAST_ALLOWED_MODEL_FACTORIES,
    # BALLAST_MODEL_PATH): the worker imports a factory only if allowed, from its import path plus these directories.
    user_inputs: UserInputs = NO_USER_INPUTS

    @property
    def num_stages(self) -> int:
        return len(self.stage_bounds)

    @property
    def global_batch_size(self) -> int:
        if self.harmony:  # one wrap-around pipeline over the global batch: the ranks are its devices
            return self.micro_batch_size * self.num_micro_batches
        return self.micro_batch_size * self.num_micro_batches * self.num_replicas

    @property
    def bounds(self) -> tuple[int, int]:
        begin, end = self.stage_bounds[self.stage_index]
        return begin, end

    @property
    def dims(self) -> ParallelDims:
        """The job's parallel axes and rank layout (built from validated sizes: call after `validate`)."""
        return ParallelDims(pp=self.num_stages, dp=self.num_replicas)

    def spec(self) -> model_pb2.ModelSpec:
        return ParseDict(self.model, model_pb2.ModelSpec())

    def data_spec(self) -> job_pb2.DataSpec:
        return ParseDict(self.data, job_pb2.DataSpec())

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        raw = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"WorkerConfig: unknown fields {unknown} (remove them; known fields: {sorted(known)})")
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = sorted(required - set(raw))
        if missing:
            raise ValueError(f"WorkerConfig: missing required fields {missing} (the launcher must set them)")
        if "user_inputs" in raw:
            raw["user_inputs"] = UserInputs.from_json(raw["user_inputs"])
        config = cls(**raw)
        config.validate()
        return config

    def validate(self) -> None:
        """Checks that need no model; layer-count checks happen when the stage is built."""

        def need(ok: bool, name: str, fix: str) -> None:
            if not ok:
                raise ValueError(f"WorkerConfig.{name}: {fix}")

        need(self.num_replicas >= 1, "num_replicas", "must be >= 1")
        need(self.num_stages >= 1, "stage_bounds", "give at least one [begin, end) stage")
        need(all(len(b) == 2 and b[0] < b[1] for b in self.stage_bounds), "stage_bounds",
             "each stage is [begin, end) with begin < end")
        need(self.stage_bounds[0][0] == 0, "stage_bounds", "the first stage must begin at layer 0")
        need(all(a[1] == b[0] for a, b in zip(self.stage_bounds, self.stage_bounds[1:], strict=False)),
             "stage_bounds", "stages must be contiguous: each begin equals the previous end")
        need(self.world_size == self.num_stages * self.num_replicas, "world_size",
             f"must equal stages x replicas = {self.num_stages * self.num_replicas}")
        need(0 <= self.stage_index < self.num_stages, "stage_index", f"must be in [0, {self.num_stages})")
        need(0 <= self.replica_index < self.num_replicas, "replica_index", f"must be in [0, {self.num_replicas})")
        expected = self.dims.rank(pp=self.stage_index, dp=self.replica_index)
        need(self.rank == expected, "rank", f"must be stage_index * num_replicas + replica_index = {expected}")
        need(self.micro_batch_size >= 1 and self.num_micro_batches >= 1, "micro_batch_size",
             "micro_batch_size and num_micro_batches must be >= 1")
        need(self.schedule in SCHEDULES, "schedule", f"use one of {SCHEDULES}")
        need(self.optimizer.get("name") in OPTIMIZERS, "optimizer.name", f"use one of {OPTIMIZERS}")
        need(float(self.optimizer.get("learning_rate", 0)) > 0, "optimizer.learning_rate", "must be > 0")
        need(isinstance(self.data, dict), "data", "give a DataSpec as JSON ({} trains on synthetic samples)")
        try:
            self.data_spec()
        except ParseError as exc:
            need(False, "data", f"give a DataSpec as JSON (proto field names): {exc}")
        need(self.backend in BACKENDS, "backend", f"use one of {BACKENDS}")
        need(self.backend != "nccl" or self.device.startswith("cuda"), "device", "nccl needs a cuda device")
        need(0 <= self.start_iteration <= self.iterations, "start_iteration", "must be in [0, iterations]")
        need(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0 (0 = never)")
        need(self.eval_every >= 0, "eval_every", "must be >= 0 (0 = never)")
        need(self.eval_batches >= 1, "eval_batches", "must be >= 1")
        need((self.checkpoint_every == 0 and not self.final_checkpoint) or bool(self.checkpoint_dir), "checkpoint_dir",
             "set a directory when checkpoint_every > 0 or final_checkpoint")
        need(not (self.init_from and self.resume_from), "init_from",
             "start from weights (init_from) or resume a checkpoint (resume_from), not both")
        need(self.timeout_s > 0, "timeout_s", "must be > 0 seconds")
        need(self.intra_op_threads >= 1, "intra_op_threads", "must be >= 1")
        need(bool(self.init_method), "init_method", "give a rendezvous such as tcp://HOST:PORT")
        need(all(is_int(i) for i in self.checkpoint_layers), "checkpoint_layers", "give layer indices (integers)")
        need(all(is_int(i) for i in self.swap_layers), "swap_layers", "give layer indices (integers)")
        need(all(is_int(i) for i in self.zero1_layers), "zero1_layers", "give layer indices (integers)")
        need(all(is_int(i) for i in self.zero2_layers), "zero2_layers", "give layer indices (integers)")
        both = sorted(set(self.zero1_layers) & set(self.zero2_layers))
        need(not both, "zero2_layers", f"layers {both} are also in zero1_layers; give each layer one flavour")
        need(all(isinstance(t, list | tuple) and len(t) == 2 and all(is_int(v) for v in t) for t in self.tp_layers),
             "tp_layers", "each entry is [layer_index, tp degree]")
        need(all(is_int(i) for i in self.sdp_layers), "sdp_layers", "give layer indices (integers)")
        need(all(is_int(i) for i in self.sp_layers), "sp_layers", "give layer indices (integers)")
        loose = sorted(set(self.sp_layers) - {t[0] for t in self.tp_layers if isinstance(t, list | tuple) and t})
        need(not loose, "sp_layers", f"layers {loose} are not TP layers; sequence parallelism splits a tensor-parallel "
             "layer's sequence over its tp ranks: add them to tp_layers or drop them")
        hybrid = {int(t[0]) for t in self.tp_layers} | set(self.sdp_layers)
        for name, other in (("zero1_layers", self.zero1_layers), ("zero2_layers", self.zero2_layers),
                            ("swap_layers", self.swap_layers)):
            clash = sorted(hybrid & set(other))
            need(not clash, name, f"layers {clash} are also TP or SDP layers; ZeRO-1/2 and activation swap do not "
                 "combine with tensor or sharded data parallelism yet: drop them from one list")
        need(all(isinstance(t, list | tuple) and len(t) == 3 and all(is_int(v) for v in t) and t[1] >= 0
                 and t[2] in (0, 1) for t in self.layer_toggles), "layer_toggles",
             "each entry is [layer_index, iteration >= 0, active 0 or 1]")
        if self.harmony:
            self._validate_harmony(need)
        self._validate_chunks(need)

    def _validate_harmony(self, need: Callable[[bool, str, str], None]) -> None:
        h = self.harmony
        need(isinstance(h, dict), "harmony", f"give a JSON object with {sorted(HARMONY_KEYS)}")
        missing, unknown = sorted(HARMONY_KEYS - set(h)), sorted(set(h) - HARMONY_KEYS)
        need(not missing, "harmony", f"missing {missing}: the plan's HarmonySwap and the store directory set them")
        need(not unknown, "harmony", f"unknown keys {unknown}: remove them (known: {sorted(HARMONY_KEYS)})")
        for key in ("forward_micro_batch", "backward_micro_batch", "devices"):
            need(is_int(h[key]) and h[key] >= 1, f"harmony.{key}", "must be an integer >= 1")
        for key in ("forward_packs", "backward_packs"):
            need(isinstance(h[key], list) and all(isinstance(p, list) and len(p) == 2 and all(is_int(v) for v in p)
                                                  for p in h[key]), f"harmony.{key}", "give [begin, end) layer pairs")
        need(bool(h["backward_packs"]), "harmony.backward_packs", "give at least one pack (the last ends the model)")
        for key in ("forward_micro_batch", "backward_micro_batch"):
            need(self.global_batch_size % h[key] == 0, f"harmony.{key}",
                 f"must divide the global batch of {self.global_batch_size} samples "
                 "(micro_batch_size x num_micro_batches)")
        need(h["devices"] == self.world_size, "harmony.devices",
             f"must equal world_size {self.world_size}: one worker per device of the schedule")
        need(isinstance(h["prefetch"], bool), "harmony.prefetch", "must be true or false")
        need(is_int(h["device_budget_bytes"]) and h["device_budget_bytes"] >= 0, "harmony.device_budget_bytes",
             "must be an integer >= 0 (0 = no budget)")
        need(isinstance(h["store_dir"], str) and h["store_dir"].startswith("/"), "harmony.store_dir",
             "give an absolute directory path, the same for every rank of the job (e.g. under /dev/shm)")
        need(self.chunk_bytes == 0, "chunk_bytes",
             "Harmony's swap schedule and chunk offload exclude each other: set chunk_bytes 0 or harmony {}")
        need(self.device_budget_bytes == 0, "device_budget_bytes",
             "Harmony's budget is harmony.device_budget_bytes: leave this 0")
        need(self.num_stages == 1, "stage_bounds",
             f"Harmony runs one stage holding every layer (its packs split it), got {self.num_stages} stages")
        need(self.backend == "gloo", "backend", "the Harmony worker sends CPU tensors between its ranks: use 'gloo'")
        need(self.device == "cpu", "device", "the Harmony worker computes on the CPU under its budgeted device pool "
             "(train/harmony.py has no CUDA path yet): set device 'cpu'")
        need(not self.layer_toggles, "layer_toggles", "Harmony runs every layer every iteration: leave it empty")
        for name in ("checkpoint_layers", "swap_layers", "zero1_layers", "zero2_layers", "tp_layers", "sdp_layers",
                     "sp_layers"):
            need(not getattr(self, name), name, "Harmony's schedule decides what moves and what is recomputed: "
                 "leave it empty")

    def _validate_chunks(self, need: Callable[[bool, str, str], None]) -> None:
        need(is_int(self.chunk_bytes) and self.chunk_bytes >= 0, "chunk_bytes",
             "must be an integer >= 0 (0 = no chunk offload)")
        need(is_int(self.device_budget_bytes) and self.device_budget_bytes >= 0, "device_budget_bytes",
             "must be an integer >= 0 (0 = no budget)")
        if self.chunk_bytes == 0:
            need(self.device_budget_bytes == 0, "device_budget_bytes",
                 "a device budget applies to chunk offload only: set chunk_bytes too, or leave it 0")
            return
        need(self.num_stages == 1, "stage_bounds",
             f"chunk offload runs one stage holding every layer, got {self.num_stages} stages")
        need(not self.layer_toggles, "layer_toggles", "chunk offload runs every layer every iteration: leave it empty")
        for name in ("checkpoint_layers", "swap_layers", "zero1_layers", "zero2_layers", "tp_layers", "sdp_layers",
                     "sp_layers"):
            need(not getattr(self, name), name, "chunk offload runs every layer as plain data parallel with its "
                 "model data in chunks: leave it empty")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
