"""Model specs: loading a spec file, and validation of ModelSpec and JobSpec, independent of transport.

The CLI loads spec files here; the store validates what it stores, the profiler what it measures and
the zoo what it builds, all with the same rules and the same signature (equal models share profiles).
Errors name the proto path of the offending field ("spec.model.transformer.num_heads") and how
to fix it, so the CLI can point at the exact line of a user's spec file.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from ballast.specfile import read_model_spec
from ballast.v1 import job_pb2, model_pb2, plan_pb2
from services.runtime.errors import InvalidArgument
from services.specs.data import validate_data_spec
from services.specs.ranges import check_bounds
from services.specs.user_inputs import ALLOWED_FACTORIES_FIX, FACTORY_FIX, FACTORY_RE, NO_USER_INPUTS, UserInputs

F = model_pb2.ModelFamily
_CONFIG_FOR_FAMILY = {
    F.MODEL_FAMILY_GPT: "transformer",
    F.MODEL_FAMILY_BERT: "transformer",
    F.MODEL_FAMILY_T5: "transformer",
    F.MODEL_FAMILY_VIT: "vision",
    F.MODEL_FAMILY_SWIN: "vision",
    F.MODEL_FAMILY_CUSTOM: "custom",
    F.MODEL_FAMILY_HF: "hf",
}
OPTIMIZERS = ("", "adam", "sgd")
T = model_pb2.HFTask
# Hugging Face architectures (config model_type) Ballast cuts into layers itself, per task (zoo/hf/adapters.py).
HF_ARCHITECTURES = {
    T.HF_TASK_CAUSAL_LM: ("gpt2", "llama", "mistral", "qwen2"),
    T.HF_TASK_MASKED_LM: ("bert",),
    T.HF_TASK_IMAGE_CLASSIFICATION: ("vit",),
}
HF_TEXT_TASKS = (T.HF_TASK_CAUSAL_LM, T.HF_TASK_MASKED_LM)
MAX_SEQ_LENGTH = 1 << 20
HF_REMOTE_CODE = ("auto_map", "trust_remote_code")  # config keys that would ask for code from the hub


def load_model_spec(path: Path) -> model_pb2.ModelSpec:
    """A ModelSpec from YAML (field names as in the proto; enums by name); unknown fields and enum names are
    refused with the closest name (ballast.specfile, shared with the SDK)."""
    return read_model_spec(path)


def _positive(msg, names: Iterable[str], prefix: str) -> None:
    for name in names:
        if getattr(msg, name) <= 0:
            raise InvalidArgument("must be positive", field=f"{prefix}.{name}", fix=f"set {name} > 0")


def _transformer(cfg: model_pb2.TransformerConfig, family: int, prefix: str) -> None:
    _positive(cfg, ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length"), prefix)
    if cfg.hidden_size % cfg.num_heads:
        raise InvalidArgument(
            f"num_heads {cfg.num_heads} does not divide hidden_size {cfg.hidden_size}",
            field=f"{prefix}.num_heads",
            fix="pick num_heads that divides hidden_size",
        )
    if cfg.max_positions and cfg.max_positions < cfg.seq_length:
        raise InvalidArgument(
            f"max_positions {cfg.max_positions} is below seq_length {cfg.seq_length}",
            field=f"{prefix}.max_positions",
            fix="set max_positions >= seq_length, or 0 to use seq_length",
        )
    if family == F.MODEL_FAMILY_T5:
        _positive(cfg, ("num_decoder_layers", "decoder_seq_length"), prefix)


def _vision(cfg: model_pb2.VisionConfig, family: int, prefix: str) -> None:
    _positive(cfg, ("image_size", "patch_size", "channels", "num_classes", "hidden_size"), prefix)
    if cfg.image_size % cfg.patch_size:
        raise InvalidArgument(
            f"patch_size {cfg.patch_size} does not divide image_size {cfg.image_size}",
            field=f"{prefix}.patch_size",
            fix="pick a patch size that divides the image side",
        )
    if cfg.mlp_ratio < 0 or math.isnan(cfg.mlp_ratio):
        raise InvalidArgument("must not be negative", field=f"{prefix}.mlp_ratio", fix="use e.g. 4.0")
    if family == F.MODEL_FAMILY_VIT:
        _positive(cfg, ("num_layers", "num_heads"), prefix)
        if cfg.hidden_size % cfg.num_heads:
            raise InvalidArgument(
                f"num_heads {cfg.num_heads} does not divide hidden_size {cfg.hidden_size}",
                field=f"{prefix}.num_heads",
                fix="pick num_heads that divides hidden_size",
            )
        return
    if not cfg.depths:
        raise InvalidArgument(
            "Swin needs blocks per stage", field=f"{prefix}.depths", fix="e.g. depths: [2, 2, 6, 2]"
        )
    for i, depth in enumerate(cfg.depths):
        if depth <= 0:
            raise InvalidArgument(
                "must be positive", field=f"{prefix}.depths[{i}]", fix="every stage needs a block"
            )
    if cfg.head_dim and cfg.hidden_size % cfg.head_dim:
        raise InvalidArgument(
            f"head_dim {cfg.head_dim} does not divide hidden_size {cfg.hidden_size}",
            field=f"{prefix}.head_dim",
            fix="pick head_dim that divides hidden_size",
        )


def _custom(cfg: model_pb2.CustomModel, user_inputs: UserInputs, prefix: str) -> None:
    field = f"{prefix}.factory"
    if not FACTORY_RE.match(cfg.factory):
        raise InvalidArgument(
            f"factory {cfg.factory!r} is not an import path",
            field=field,
            fix=FACTORY_FIX,
        )
    if not user_inputs.allows(cfg.factory):
        raise InvalidArgument(
            f"factory {cfg.factory!r} is not allowed", field=field, fix=ALLOWED_FACTORIES_FIX
        )


def hf_model_type(cfg: model_pb2.HuggingFaceModel) -> str:
    """The inline config's model_type ("" when the config comes from a directory)."""
    value = cfg.config.fields.get("model_type") if cfg.HasField("config") else None
    return value.string_value if value is not None else ""


def check_hf_architecture(model_type: str, task: int, field: str) -> None:
    """Refuse an architecture Ballast has no adapter for, naming the ones it has and the factory way out."""
    supported = HF_ARCHITECTURES.get(task, ())
    if model_type not in supported:
        others = {model_pb2.HFTask.Name(t): types for t, types in HF_ARCHITECTURES.items() if model_type in types}
        also = f" ({model_type!r} is supported as {', '.join(others)})" if others else ""
        raise InvalidArgument(
            f"no Ballast adapter for Hugging Face model_type {model_type!r} with {model_pb2.HFTask.Name(task)}{also}",
            field=field,
            fix=f"use one of {list(supported)}, or wrap the model in an allow-listed factory whose top-level "
                "children run in order (docs/models.md)")


def _hf(cfg: model_pb2.HuggingFaceModel, user_inputs: UserInputs, prefix: str) -> None:
    if cfg.task not in HF_ARCHITECTURES:
        raise InvalidArgument("the task is not set", field=f"{prefix}.task",
                              fix=f"one of {[model_pb2.HFTask.Name(t) for t in HF_ARCHITECTURES]}")
    inline, directory = cfg.HasField("config") and bool(cfg.config.fields), bool(cfg.config_dir)
    if inline == directory:
        raise InvalidArgument("give the model's config either inline or as a directory, not both" if inline else
                              "the model's config is missing", field=f"{prefix}.config",
                              fix="set config (model_type and its fields) or config_dir (a directory with config.json)")
    if inline:
        keys = MessageToDict(cfg.config)
        remote = [k for k in HF_REMOTE_CODE if k in keys]
        if remote:
            raise InvalidArgument(f"the config asks for code from the hub ({remote[0]})", field=f"{prefix}.config",
                                  fix=f"remove {remote[0]}: Ballast never runs remote code")
        if not isinstance(keys.get("model_type"), str) or not keys["model_type"]:
            raise InvalidArgument("the config has no model_type", field=f"{prefix}.config.model_type",
                                  fix='set model_type, e.g. "llama"')
        check_hf_architecture(keys["model_type"], cfg.task, f"{prefix}.config.model_type")
    else:
        user_inputs.directory(cfg.config_dir, f"{prefix}.config_dir")
    if cfg.weights_dir:
        user_inputs.directory(cfg.weights_dir, f"{prefix}.weights_dir")
    if cfg.task in HF_TEXT_TASKS and not 0 < cfg.seq_length <= MAX_SEQ_LENGTH:
        raise InvalidArgument(f"seq_length {cfg.seq_length} is outside [1, {MAX_SEQ_LENGTH}]",
                              field=f"{prefix}.seq_length", fix="set the tokens per training sequence, e.g. 128")


def validate_model_spec(
    spec: model_pb2.ModelSpec, user_inputs: UserInputs = NO_USER_INPUTS, *, prefix: str = "spec"
) -> None:
    """Raise InvalidArgument naming the first bad field; `prefix` is the spec's own proto path."""
    check_bounds(spec, prefix)
    if spec.family not in _CONFIG_FOR_FAMILY:
        raise InvalidArgument(
            "model family is not set", field=f"{prefix}.family", fix="set family, e.g. MODEL_FAMILY_GPT"
        )
    family_name = F.Name(spec.family)
    expected, actual = _CONFIG_FOR_FAMILY[spec.family], spec.WhichOneof("config")
    if actual != expected:
        raise InvalidArgument(
            f"{family_name} needs a {expected} config, got {actual or 'none'}",
            field=f"{prefix}.{expected}",
            fix=f"set {expected} (and no other config)",
        )
    if expected == "transformer":
        _transformer(spec.transformer, spec.family, f"{prefix}.transformer")
    elif expected == "vision":
        _vision(spec.vision, spec.family, f"{prefix}.vision")
    elif expected == "hf":
        _hf(spec.hf, user_inputs, f"{prefix}.hf")
    else:
        _custom(spec.custom, user_inputs, f"{prefix}.custom")
    if not 0.0 <= spec.dropout < 1.0:  # also rejects NaN
        raise InvalidArgument(
            f"dropout {spec.dropout} is outside [0, 1)", field=f"{prefix}.dropout", fix="use 0 to 0.9"
        )


def validate_job_spec(spec: job_pb2.JobSpec, user_inputs: UserInputs = NO_USER_INPUTS) -> None:
    """Raise InvalidArgument naming the first bad field of a job spec (paths start at "spec")."""
    check_bounds(spec, "spec")
    if not spec.HasField("model"):
        raise InvalidArgument("a job needs a model", field="spec.model", fix="set model (a ModelSpec)")
    validate_model_spec(spec.model, user_inputs, prefix="spec.model")
    _positive(spec, ("global_batch_size", "iterations"), "spec")
    if spec.optimizer.name not in OPTIMIZERS:
        raise InvalidArgument(
            f"unknown optimizer {spec.optimizer.name!r}",
            field="spec.optimizer.name",
            fix='use "adam" or "sgd"',
        )
    if spec.optimizer.learning_rate < 0 or math.isnan(spec.optimizer.learning_rate):
        raise InvalidArgument("must not be negative", field="spec.optimizer.learning_rate", fix="e.g. 1e-4")
    if spec.HasField("fleet"):
        fleet = spec.fleet
        if not fleet.device.kind:
            raise InvalidArgument(
                "fleet device kind is not set", field="spec.fleet.device.kind", fix='e.g. "cpu"'
            )
        _positive(fleet, ("devices_per_node", "nodes"), "spec.fleet")
    _device_range(spec)
    if spec.micro_batches and spec.global_batch_size % spec.micro_batches:
        raise InvalidArgument(f"{spec.micro_batches} micro-batches do not split a global batch of "
                              f"{spec.global_batch_size}", field="spec.micro_batches",
                              fix="use a divisor of the global batch, or 0 to let the planner choose")
    if spec.micro_batches and spec.engine == plan_pb2.PLAN_ENGINE_GALVATRON:
        raise InvalidArgument("a pinned micro-batch count is planned by the Varuna engine", field="spec.micro_batches",
                              fix="leave the engine unset or VARUNA, or set micro_batches to 0")
    seen: set[tuple[int, int]] = set()
    for i, toggle in enumerate(spec.layer_toggles):
        if toggle.iteration >= spec.iterations:
            raise InvalidArgument(f"iteration {toggle.iteration} is past the job's last ({spec.iterations - 1})",
                                  field=f"spec.layer_toggles[{i}].iteration",
                                  fix=f"use an iteration below {spec.iterations}, or remove the toggle")
        key = (toggle.layer_index, toggle.iteration)
        if key in seen:
            raise InvalidArgument(f"layer {key[0]} is switched twice at iteration {key[1]}",
                                  field=f"spec.layer_toggles[{i}]", fix="keep one toggle per layer and iteration")
        seen.add(key)
    if spec.HasField("data"):
        validate_data_spec(spec.data, user_inputs)
    _training_inputs(spec, user_inputs)


MAX_EVAL_BATCHES = 10_000
MAX_KEPT_CHECKPOINTS = 1000
JOB_REF = re.compile(r"^(job-[A-Za-z0-9]+)(?::(\d+))?$")  # init_from "JOB" or "JOB:ITERATION"


def _training_inputs(spec: job_pb2.JobSpec, user_inputs: UserInputs) -> None:
    """Evaluation, checkpoint retention and the weights a job starts from (which job they name, and whether it has
    them, is the store's to check)."""
    if spec.eval_batches > MAX_EVAL_BATCHES:
        raise InvalidArgument(f"{spec.eval_batches} evaluation batches", field="spec.eval_batches",
                              fix=f"use at most {MAX_EVAL_BATCHES} (0 means 4)")
    if spec.keep_checkpoints > MAX_KEPT_CHECKPOINTS:
        raise InvalidArgument(f"{spec.keep_checkpoints} kept checkpoints", field="spec.keep_checkpoints",
                              fix=f"keep at most {MAX_KEPT_CHECKPOINTS} (0 means 3)")
    if spec.init_from and spec.resume_from:
        raise InvalidArgument("a job either starts from weights or continues a job, not both",
                              field="spec.init_from", fix="drop init_from to continue the job (with its optimizer), "
                                                          "or resume_from to fine-tune from its weights")
    if spec.resume_from and (not JOB_REF.match(spec.resume_from) or ":" in spec.resume_from):
        raise InvalidArgument(f"{spec.resume_from!r} is not a job id", field="spec.resume_from",
                              fix="name a job of yours, e.g. job-1a2b3c (it continues from its last checkpoint)")
    if spec.init_from and not JOB_REF.match(spec.init_from):
        field = "spec.init_from"
        try:
            user_inputs.data_path(spec.init_from, field)
        except InvalidArgument as under_data:
            try:
                user_inputs.directory(spec.init_from, field)
            except InvalidArgument:
                raise InvalidArgument(f"{spec.init_from!r} is neither a job (JOB or JOB:ITERATION) nor a directory "
                                      "of weights under BALLAST_DATA_ROOTS or BALLAST_MODEL_PATH", field=field,
                                      fix=under_data.fix) from None


def _device_range(spec: job_pb2.JobSpec) -> None:
    """min/max devices come as a pair of counts >= 1, low before high (both 0: no re-plan range)."""
    low, high = spec.min_devices, spec.max_devices
    if spec.elastic and not (low and high):
        raise InvalidArgument("an elastic job needs the device range it may be resized within",
                              field="spec.min_devices" if not low else "spec.max_devices",
                              fix="set --min-devices and --max-devices with --elastic")
    if not low and not high:
        return
    if not low or not high:
        field = "spec.min_devices" if not low else "spec.max_devices"
        raise InvalidArgument("the device range needs both ends, each at least 1", field=field,
                              fix="set --min-devices and --max-devices together (or neither)")
    if low > high:
        raise InvalidArgument(f"min_devices {low} is above max_devices {high}", field="spec.min_devices",
                              fix=f"use a min_devices of at most {high}, or raise max_devices")


def model_signature(spec: model_pb2.ModelSpec) -> str:
    """Content hash of everything but the name: equal models share profiles whatever they are called."""
    unnamed = model_pb2.ModelSpec()
    unnamed.CopyFrom(spec)
    unnamed.ClearField("name")
    return hashlib.sha256(unnamed.SerializeToString(deterministic=True)).hexdigest()
