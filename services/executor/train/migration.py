"""Plan changes while training: "plan" commands, agreement on when they apply, and live layer migration (vPipe §4).

Commands. The worker reads JSON lines on stdin in a daemon thread (`read_commands`; EOF, /dev/null or no stdin
means no commands). A command is a complete description of the new runtime shape, same stage and replica
counts:
  {"command": "plan", "version": V, "not_before": K, "stage_bounds": [[b, e], ...],
   "checkpoint_layers": [...], "swap_layers": [...], "zero1_layers": [...], "zero2_layers": [...]}
(the two ZeRO lists are optional: a layer in neither is plain DP; they must be disjoint).
`PlanInbox.submit` validates it (contiguous non-empty bounds covering every layer, the same stage count, layer
indices in range, a version above the initial one, every shared (tied) parameter left on the same set of
stages); a bad command becomes a {"event": "command_rejected", "message": ...} warning naming the field, and is
never applied. A rank's ready version is the highest accepted version whose not_before <= iterations completed.

Agreement. At every iteration boundary every rank contributes its ready version to one MIN all_reduce on a
dedicated gloo group made up front (so it works beside NCCL). It is launched asynchronously when the iteration
starts, with the ready version as of the END of that iteration (not_before <= iterations done after it), and
waited after the optimizer step: all ranks see the same minimum, so all decide the same thing at the same
boundary. If the minimum exceeds the version in force, every rank applies that plan (intermediate versions
are skipped). The agent must send every plan to every rank: a rank that lacks the agreed version fails.
The same all_reduce carries a drain flag (MIN of -drain: set if any rank was asked to drain), so a drain
delivered to one rank stops every rank at the same boundary (trainer.py). No boundary follows the last
iteration, and the start of a run is not a boundary.

Migration. The plan is applied between iterations: after the optimizer step of the last completed iteration,
before the first micro-batch of the next. That is the micro-batch boundary where synchronous-SGD parameters
have a single version: no forward is waiting for its backward, no p2p transfer is posted, gradients are
zeroed, so moving a layer there changes nothing in the training semantics (vPipe's transparency requirement
for BSP, without its activation transfer: nothing is in flight). For every layer whose stage changes, source
replica r sends target replica r (same replica index) bare tensors with isend/irecv, never pickles:
  1. an int64 header [num_params, 2]: per parameter (has optimizer state, Adam step), parameters in
     `named_parameters` order minus the tied ones the target already holds;
  2. the parameters, then every buffer (`named_buffers` order);
  3. after the header arrived, per parameter with state: the optimizer's state tensors (Adam: exp_avg,
     exp_avg_sq; the scalar step travelled in the header). "No state yet" (before the first step, or a
     parameter that never had a gradient, e.g. of an inactive layer) is flag 0 and nothing is sent.
Shapes and dtypes come from the model spec: the target copies the layer's module from the cached meta-device
model (stage.model_info), materialises it with `to_empty(device=...)` and receives straight into its
parameters and buffers. Both sides post phase 1 for all moved layers (ascending index), then phase 2, so the
order per peer is the same on both ends (NCCL matches p2p in order; gloo also by tag). A rank posts all its
sends before it waits on any receive.

Groups (`Mesh.migration_group`): a move between adjacent stages reuses that pair's forward p2p group (idle at
the boundary); a move that skips stages uses a dedicated group per (stage pair, replica) for every non-adjacent
pair, created up front by every rank in the same order (mesh.Mesh). With contiguous bounds a pair only moves
one way in a plan.

Tied parameters: plans that would change the set of stages holding any shared parameter are rejected
(command_rejected names it); so a moved layer's shared parameter is always already held by the target, which
reuses its own Parameter object (not sent), and the tied groups and `Stage.tied` stay valid. The stage's
aliases, boundaries and receive/send lists are recomputed from the cached meta model; the schedule order and
the p2p peers are unchanged; the optimizer is rebuilt over the new parameter list with the state of kept
parameters carried by identity and the received state installed. The source drops the moved layers.
`apply_plan` returns that stage and optimizer (`Applied`) for the trainer to install: it never reaches into
the trainer, so this module does not know it.

ZeRO layers (sharding.py): the trainer unshards every layer that moves (or turns plain) before `apply_plan`, so
a moved layer's FULL optimizer state travels as above, each source replica sending its copy to the same replica
index of the target, which slices its own chunk again if the new plan keeps the layer under ZeRO. Layers
that stay on their stage under ZeRO keep their chunks untouched (they are in the stage's parameters without
state here). A plan may also switch a layer's flavour (plain, zero1, zero2) without moving it.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TextIO

import torch
import torch.distributed as dist
from torch import Tensor, nn

from services.executor.train.config import WorkerConfig, is_int
from services.executor.train.hold import Hold
from services.executor.train.mesh import Mesh
from services.executor.train.sharding import flavours
from services.executor.train.stage import ModelInfo, Stage, make_optimizer, restage, stage_of
from services.zoo.graph import Layer

STATE_TENSORS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ()}  # optimizer state beyond Adam's scalar step
TAG_STRIDE = 1 << 16  # gloo tag = layer index * TAG_STRIDE + slot within the layer


@dataclass(frozen=True)
class Plan:
    version: int
    not_before: int
    stage_bounds: tuple[tuple[int, int], ...]
    checkpoint_layers: tuple[int, ...]
    swap_layers: tuple[int, ...]
    zero1_layers: tuple[int, ...] = ()  # data-parallel flavour per layer (sharding.py); plain DP otherwise
    zero2_layers: tuple[int, ...] = ()

    @classmethod
    def initial(cls, config: WorkerConfig) -> Plan:
        """The plan a worker starts under (its config); commands must carry higher versions."""
        return cls(config.plan_version, 0, tuple((b, e) for b, e in config.stage_bounds),
                   tuple(config.checkpoint_layers), tuple(config.swap_layers), tuple(config.zero1_layers),
                   tuple(config.zero2_layers))

    def flavours(self) -> dict[int, str]:
        """Layer index -> "zero1" / "zero2" (sharding.flavours); absent layers are plain DP."""
        return flavours(self.zero1_layers, self.zero2_layers)

    def describe(self) -> dict[str, Any]:
        return {"plan_version": self.version, "stage_bounds": [list(b) for b in self.stage_bounds],
                "checkpoint_layers": list(self.checkpoint_layers), "swap_layers": list(self.swap_layers),
                "zero1_layers": list(self.zero1_layers), "zero2_layers": list(self.zero2_layers)}


class Rejected(ValueError):
    pass


class PlanInbox:
    """Accepted plans by version and rejection messages; `submit` may run on the reader thread."""

    def __init__(self, info: ModelInfo, num_stages: int, initial: Plan, hybrid: frozenset[int] = frozenset()) -> None:
        self.info, self.num_stages, self.initial = info, num_stages, initial
        self.hybrid = hybrid  # the job's TP / SDP layers: no plan command puts them under ZeRO or swap
        self._tied = info.tied_stage_sets(initial.stage_bounds)
        self._plans: dict[int, Plan] = {}
        self._rejected: list[tuple[int, str]] = []  # (the command's version, or 0 if it had none; why)
        self._lock = threading.Lock()

    def parse(self, raw: Any) -> Plan:
        """A validated Plan from a decoded command, or Rejected naming the bad field."""
        n, s = self.info.num_layers, self.num_stages

        def need(ok: bool, name: str, fix: str) -> None:
            if not ok:
                raise Rejected(f"plan command field {name!r}: {fix}")

        need(isinstance(raw, dict), "command", "a command is a JSON object")
        need(raw.get("command") == "plan", "command", f"unknown command {raw.get('command')!r}; use 'plan'")
        known = {"command", "version", "not_before", "stage_bounds", "checkpoint_layers", "swap_layers",
                 "zero1_layers", "zero2_layers"}
        unknown = sorted(set(raw) - known)
        need(not unknown, str(unknown[0]) if unknown else "", f"unknown fields {unknown}")
        for name in ("version", "not_before", "stage_bounds", "checkpoint_layers", "swap_layers"):
            need(name in raw, name, "missing: a plan command describes the whole runtime shape")
        version, not_before, bounds = raw["version"], raw["not_before"], raw["stage_bounds"]
        need(is_int(version) and version > self.initial.version, "version",
             f"must be an integer above the initial plan_version {self.initial.version}")
        need(is_int(not_before) and not_before >= 0, "not_before", "must be an integer >= 0 (iterations completed)")
        need(isinstance(bounds, list) and len(bounds) == s, "stage_bounds",
             f"give exactly {s} [begin, end) stages (the stage count never changes while training)")
        need(all(isinstance(b, list) and len(b) == 2 and all(is_int(v) for v in b) for b in bounds), "stage_bounds",
             "each stage is a [begin, end) pair of integers")
        need(all(b < e for b, e in bounds), "stage_bounds", "every stage must be non-empty (begin < end)")
        need(bounds[0][0] == 0 and bounds[-1][1] == n, "stage_bounds", f"stages must cover layers [0, {n})")
        need(all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False)), "stage_bounds",
             "stages must be contiguous: each begin equals the previous end")
        for name in ("checkpoint_layers", "swap_layers", "zero1_layers", "zero2_layers"):
            values = raw.get(name, [])
            need(isinstance(values, list) and all(is_int(i) and 0 <= i < n for i in values), name,
                 f"give a list of layer indices in [0, {n})")
        both = sorted(set(raw.get("zero1_layers", [])) & set(raw.get("zero2_layers", [])))
        need(not both, "zero2_layers", f"layers {both} are also in zero1_layers; give each layer one flavour")
        for name in ("swap_layers", "zero1_layers", "zero2_layers"):
            clash = sorted(self.hybrid & set(raw.get(name, [])))
            need(not clash, name, f"layers {clash} are TP or SDP layers of this job; ZeRO-1/2 and activation swap "
                 "do not combine with them (drop them from the list)")
        tied = self.info.tied_stage_sets(bounds)
        changed = sorted(k for k in tied if tied[k] != self._tied[k])
        need(not changed, "stage_bounds",
             f"the plan moves shared (tied) parameter {changed[:1]} from stages {[self._tied[k] for k in changed[:1]]} "
             f"to {[tied[k] for k in changed[:1]]}; changing the stages that hold a tied weight is not supported "
             "while training (restart from a checkpoint with the new plan)")
        plan = Plan(version, not_before, tuple((b, e) for b, e in bounds), tuple(sorted(set(raw["checkpoint_layers"]))),
                    tuple(sorted(set(raw["swap_layers"]))), tuple(sorted(set(raw.get("zero1_layers", [])))),
                    tuple(sorted(set(raw.get("zero2_layers", [])))))
        with self._lock:
            known_plan = self._plans.get(version)
        need(known_plan is None or known_plan == plan, "version", f"version {version} was already given another plan")
        return plan

    def submit(self, line: str) -> Plan | None:
        raw: Any = None
        try:
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as e:
                raise Rejected(f"command is not JSON ({e.msg})") from None
            plan = self.parse(raw)
        except Rejected as e:
            version = raw.get("version") if isinstance(raw, dict) and is_int(raw.get("version")) else 0
            with self._lock:
                self._rejected.append((version, str(e)))  # the version lets the agent fail that instruction
            return None
        with self._lock:
            self._plans[plan.version] = plan
        return plan

    def take_rejections(self) -> list[tuple[int, str]]:
        with self._lock:
            out, self._rejected = self._rejected, []
        return out

    def ready(self, done: int, in_force: int) -> int:
        """Highest version at least `in_force` whose not_before <= `done` iterations completed."""
        with self._lock:
            return max([in_force] + [v for v, p in self._plans.items() if p.not_before <= done])

    def get(self, version: int) -> Plan:
        with self._lock:
            if version not in self._plans:
                raise RuntimeError(f"all ranks agreed on plan version {version} but this rank never received it "
                                   "(send every plan command to every rank)")
            return self._plans[version]


class Inbox(Protocol):
    """Whatever takes the worker's stdin commands, one line at a time (PlanInbox; chunk mode's refusals)."""

    def submit(self, line: str) -> None: ...


def read_commands(stream: TextIO | None, inbox: Inbox | None, hold: Hold | None = None) -> threading.Thread | None:
    """Feed `stream`'s lines to `inbox` on a daemon thread until EOF; never raises. Hold commands go to `hold`;
    with no `inbox` (a job that takes no plan commands) other lines are ignored."""
    if stream is None:
        return None

    def loop() -> None:
        try:
            for line in stream:
                if not line.strip() or (hold is not None and hold.take(line)):
                    continue
                if inbox is not None:
                    inbox.submit(line)
        except (OSError, ValueError):  # closed or unreadable stdin: no more commands
            pass

    thread = threading.Thread(target=loop, name="ballast-commands", daemon=True)
    thread.start()
    return thread


class Agreement:
    """One MIN all_reduce over the world of [ready version, -drain, -hold] on a gloo group of every rank: every
    rank learns the lowest ready version and whether ANY rank asked to drain or to hold, so all decide alike."""

    def __init__(self, group: object | None) -> None:
        self.group = group  # None: a single rank (its own values are the agreement)

    def launch(self, ready: int, drain: bool = False, hold: bool = False) -> tuple[Tensor, Any]:
        value = torch.tensor([ready, -int(drain), -int(hold)], dtype=torch.int64)
        work = dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group, async_op=True) if self.group else None
        return value, work

    @staticmethod
    def result(pending: tuple[Tensor, Any]) -> tuple[int, bool, bool]:
        """(agreed plan version, agreed drain, agreed hold)."""
        value, work = pending
        if work is not None:
            work.wait()
        version, drain, hold = value.tolist()
        return int(version), drain < 0, hold < 0


# --- the wire format of one layer -------------------------------------------------------------------------


def wire_names(module: nn.Module, skip: set[str]) -> list[str]:
    """Local names of the parameters that travel: all but the tied ones the target already holds."""
    return [name for name, _ in module.named_parameters() if name not in skip]


def state_header(module: nn.Module, names: list[str], optimizer: torch.optim.Optimizer,
                 device: torch.device) -> Tensor:
    """int64 [len(names), 2]: (has state, step) per travelling parameter."""
    params = dict(module.named_parameters())
    rows = []
    for name in names:
        state = optimizer.state.get(params[name], {})
        step = state.get("step", 0)
        rows.append([1 if state else 0, int(step.item() if isinstance(step, Tensor) else step)])
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(len(names), 2)


def first_tensors(module: nn.Module, names: list[str]) -> list[Tensor]:
    """Phase 1 after the header: parameters (travelling ones), then every buffer."""
    params = dict(module.named_parameters())
    return [params[n].detach() for n in names] + [b.detach() for _, b in module.named_buffers()]


def state_tensors(module: nn.Module, names: list[str], header: Tensor, optimizer: torch.optim.Optimizer,
                  optimizer_name: str) -> list[Tensor]:
    """Phase 2 on the source: the state tensors of parameters flagged in the header."""
    params = dict(module.named_parameters())
    out = []
    for name, (has, _) in zip(names, header.tolist(), strict=True):
        if has:
            state = optimizer.state[params[name]]
            out += [state[key].detach() for key in STATE_TENSORS[optimizer_name]]
    return out


def empty_state(module: nn.Module, names: list[str], header: Tensor, optimizer_name: str) -> list[Tensor]:
    """Phase 2 on the target: tensors to receive into, laid out as `state_tensors`."""
    params = dict(module.named_parameters())
    out = []
    for name, (has, _) in zip(names, header.tolist(), strict=True):
        if has:
            out += [torch.empty_like(params[name], memory_format=torch.contiguous_format)
                    for _ in STATE_TENSORS[optimizer_name]]
    return out


def install_state(module: nn.Module, names: list[str], header: Tensor, received: list[Tensor],
                  optimizer: torch.optim.Optimizer, optimizer_name: str) -> None:
    """Put received state into `optimizer.state` (Adam: step as a CPU float scalar, as torch keeps it)."""
    params = dict(module.named_parameters())
    keys = STATE_TENSORS[optimizer_name]
    it = iter(received)
    for name, (has, step) in zip(names, header.tolist(), strict=True):
        if has:
            state: dict[str, Any] = {"step": torch.tensor(float(step))} if optimizer_name == "adam" else {}
            for key in keys:
                state[key] = next(it)
            optimizer.state[params[name]] = state


# --- applying a plan at an iteration boundary --------------------------------------------------------------


@dataclass
class Applied:
    """What a plan change hands back for the trainer to install; `apply_plan` never touches the trainer."""

    stage: Stage  # kept layers by identity, received ones materialised, boundaries and policies of the plan
    optimizer: torch.optim.Optimizer  # over the new parameters: kept state by identity, received state installed
    events: list[dict[str, Any]]  # one "migration" event per layer this rank received


@dataclass
class _Move:
    """One layer leaving or reaching this rank's stage; what travels is filled in phase by phase."""

    layer: int
    source: int
    target: int
    module: nn.Module  # the held module (source) or the one materialised from the meta model (target)
    names: list[str]  # travelling parameters (wire_names)
    header: Tensor | None = None
    phase1: list[Tensor] = field(default_factory=list)  # target only: parameters and buffers received into
    state: list[Tensor] = field(default_factory=list)  # target only: optimizer state received into
    works: list[Any] = field(default_factory=list)  # target only: pending receives

    @property
    def state_tag(self) -> int:
        """Phase 2's first tag: after the header and every parameter and buffer of phase 1."""
        return self.layer * TAG_STRIDE + 1 + len(self.names) + len(list(self.module.buffers()))


def plan_moves(old_bounds: Sequence[Sequence[int]], new_bounds: Sequence[Sequence[int]],
               num_layers: int) -> list[tuple[int, int, int]]:
    """(layer, source stage, target stage) of every layer whose stage changes, ascending layer index."""
    moves = []
    for i in range(num_layers):
        a, b = stage_of(old_bounds, i), stage_of(new_bounds, i)
        if a != b:
            moves.append((i, a, b))
    return moves


def apply_plan(stage: Stage, optimizer: torch.optim.Optimizer, current: Plan, plan: Plan, *, mesh: Mesh,
               info: ModelInfo, optimizer_config: dict[str, Any], device: torch.device, done: int,
               decided: float) -> Applied:
    """Migrate this rank's layers from the `current` plan to `plan` and switch its policies; every rank calls it
    at the same boundary. Phases: plan the moves, materialise the incoming layers, post every send, receive,
    then build the new stage and optimizer. All sends are posted before any receive is waited on, and a stage
    pair moves layers one way only, so each peer sees one order on both ends and no two ranks wait crosswise."""
    name, me, bounds = optimizer_config["name"], stage.index, current.stage_bounds
    held = {layer.index: layer for layer in stage.layers}
    moves = plan_moves(bounds, plan.stage_bounds, info.num_layers)
    incoming = _materialise([(i, a) for i, a, b in moves if b == me], stage, held, info, bounds, device)
    outgoing = [_Move(i, me, b, held[i].module, wire_names(held[i].module, set(_tied_names(info, bounds, i, b))))
                for i, a, b in moves if a == me]
    sends = _send(outgoing, mesh, optimizer, name, device)
    _post_receives(incoming, mesh, name, device)
    events = _wait_received(incoming, plan, done, decided)
    for _, work in sends:
        work.wait()
    new_stage, new_optimizer = _rebuild(stage, optimizer, plan, held, incoming, info, optimizer_config)
    return Applied(new_stage, new_optimizer, events)


def _tied_names(info: ModelInfo, bounds: Sequence[Sequence[int]], index: int, at_stage: int) -> dict[str, str]:
    """Local name -> shared name of layer `index`'s tied parameters that stage `at_stage` already holds under
    `bounds` (through another of its layers): they never travel."""
    meta_params = dict(info.model.named_parameters())
    out = {}
    for shared in info.dec.shared:
        if index in shared.layers and at_stage in {stage_of(bounds, j) for j in shared.layers if j != index}:
            p = meta_params[shared.name]
            out[next(n for n, q in info.dec.layers[index].module.named_parameters() if q is p)] = shared.name
    return out


def _shared_here(info: ModelInfo, held: dict[int, Layer]) -> dict[str, nn.Parameter]:
    """This stage's real Parameter for every shared parameter it holds (an arriving layer reuses it)."""
    meta_params = dict(info.model.named_parameters())
    out = {}
    for shared in info.dec.shared:
        holders = [i for i in shared.layers if i in held]
        if holders:
            local = next(n for n, p in info.dec.layers[holders[0]].module.named_parameters()
                         if p is meta_params[shared.name])
            out[shared.name] = dict(held[holders[0]].module.named_parameters())[local]
    return out


def _materialise(arriving: list[tuple[int, int]], stage: Stage, held: dict[int, Layer], info: ModelInfo,
                 bounds: Sequence[Sequence[int]], device: torch.device) -> list[_Move]:
    """Moves for the (layer, source stage) pairs arriving here: each module copied from the meta model and
    materialised on the device (received straight into), its tied parameters this stage's own."""
    shared = _shared_here(info, held)
    out = []
    for layer, source in arriving:
        module = copy.deepcopy(info.dec.layers[layer].module).to_empty(device=device)
        module.train(stage.layers[0].module.training)
        skip = _tied_names(info, bounds, layer, stage.index)
        for local, shared_name in skip.items():
            _set_parameter(module, local, shared[shared_name])
        out.append(_Move(layer, source, stage.index, module, wire_names(module, set(skip))))
    return out


def _set_parameter(module: nn.Module, name: str, parameter: nn.Parameter) -> None:
    prefix, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(prefix) if prefix else module, leaf, parameter)


def _isend(tensors: list[Tensor], peer: int, group: object, tag: int) -> list[tuple[Tensor, Any]]:
    """Start sends; each contiguous tensor is returned with its work so it stays alive until waited."""
    out = []
    for k, t in enumerate(tensors):
        if t.numel():  # empty tensors (a layer without parameters has an empty header) never travel
            t = t.contiguous()
            out.append((t, dist.isend(t, dst=peer, group=group, tag=tag + k)))
    return out


def _irecv(tensors: list[Tensor], peer: int, group: object, tag: int) -> list[Any]:
    return [dist.irecv(t, src=peer, group=group, tag=tag + k) for k, t in enumerate(tensors) if t.numel()]


def _send(outgoing: list[_Move], mesh: Mesh, optimizer: torch.optim.Optimizer, optimizer_name: str,
          device: torch.device) -> list[tuple[Tensor, Any]]:
    """Post phase 1 (header, parameters, buffers) of every outgoing layer, then phase 2 (optimizer state)."""
    sends: list[tuple[Tensor, Any]] = []
    for m in outgoing:
        m.header = state_header(m.module, m.names, optimizer, device)
        tensors = [m.header] + first_tensors(m.module, m.names)
        sends += _isend(tensors, mesh.peer("pp", m.target), mesh.migration_group(m.target), m.layer * TAG_STRIDE)
    for m in outgoing:
        assert m.header is not None
        tensors = state_tensors(m.module, m.names, m.header, optimizer, optimizer_name)
        sends += _isend(tensors, mesh.peer("pp", m.target), mesh.migration_group(m.target), m.state_tag)
    return sends


def _post_receives(incoming: list[_Move], mesh: Mesh, optimizer_name: str, device: torch.device) -> None:
    """Post phase 1 of every incoming layer; then, as each header arrives, its phase 2 (the header says which
    parameters have optimizer state)."""
    for m in incoming:
        group, peer, tag = mesh.migration_group(m.source), mesh.peer("pp", m.source), m.layer * TAG_STRIDE
        m.header = torch.empty((len(m.names), 2), dtype=torch.int64, device=device)
        m.phase1 = first_tensors(m.module, m.names)
        m.works = _irecv([m.header], peer, group, tag)  # waited alone before phase 2
        m.works += _irecv(m.phase1, peer, group, tag + 1)
    for m in incoming:
        assert m.header is not None
        if m.names:  # (an empty header never travels; a gloo work must be waited only once)
            m.works.pop(0).wait()
        m.state = empty_state(m.module, m.names, m.header, optimizer_name)
        m.works += _irecv(m.state, mesh.peer("pp", m.source), mesh.migration_group(m.source), m.state_tag)


def _wait_received(incoming: list[_Move], plan: Plan, done: int, decided: float) -> list[dict[str, Any]]:
    """Wait for every incoming layer, in layer order; one "migration" event each."""
    events = []
    for m in incoming:
        assert m.header is not None
        for work in m.works:
            work.wait()
        nbytes = sum(t.numel() * t.element_size() for t in [m.header, *m.phase1, *m.state])
        events.append({"event": "migration", "layer_index": m.layer, "from_stage": m.source, "to_stage": m.target,
                       "bytes": nbytes, "duration_s": time.perf_counter() - decided, "iteration": done,
                       "plan_version": plan.version})
    return events


def _rebuild(stage: Stage, optimizer: torch.optim.Optimizer, plan: Plan, held: dict[int, Layer],
             incoming: list[_Move], info: ModelInfo,
             optimizer_config: dict[str, Any]) -> tuple[Stage, torch.optim.Optimizer]:
    """The new stage (the source drops what it sent) and its optimizer: rebuilt over the new parameter list,
    kept parameters' state carried by identity, received state installed."""
    begin, end = plan.stage_bounds[stage.index]
    arrived = {m.layer: m.module for m in incoming}
    layers = [held[i] if i in held else replace(info.dec.layers[i], module=arrived[i]) for i in range(begin, end)]
    new_stage = restage(stage, info, plan.stage_bounds, layers, plan.checkpoint_layers, plan.swap_layers)
    new_optimizer = make_optimizer(new_stage.parameters(), optimizer_config)
    for p in new_stage.parameters():
        if p in optimizer.state:
            new_optimizer.state[p] = optimizer.state[p]
    for m in incoming:
        assert m.header is not None
        install_state(m.module, m.names, m.header, m.state, new_optimizer, optimizer_config["name"])
    return new_stage, new_optimizer
