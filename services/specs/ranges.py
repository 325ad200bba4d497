"""The valid range of every number a client sends, and the size of its text (docs/limits.md is generated here).

Checked at the first service that sees a request (Submit, Profile, Plan and the store's writes of specs), before
anything is stored or started: a non-finite float, a negative bandwidth or a 2**32 - 1 layer count would otherwise
reach the planner's tables and the profiler's sweeps, whose memory grows with them. Upper bounds are generous for
any model or fleet trained today and keep both bounded. Zero keeps its documented meaning (proto3 cannot tell an
unset number from 0); the rules of each message (services/specs/model.py ...) say where a field must be set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from google.protobuf import struct_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from services.runtime.errors import InvalidArgument

_FLOATS = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)
_INTEGERS = (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32,
             FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64,
             FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_FIXED64)
GiB, TiB = 2**30, 2**40
ITERATIONS = 1_000_000_000
SEQUENCE = 1 << 20


@dataclass(frozen=True)
class Range:
    """[low, high] in `unit`; 0 is also allowed: unset, with the meaning `zero` (or the field's own rules)."""

    low: float
    high: float
    unit: str = ""
    zero: str = ""

    def admits(self, value: float) -> bool:
        if value == 0:
            return True
        return self.low <= value <= self.high

    def text(self) -> str:
        if self.unit == "bytes" and self.high >= 1 << 10:
            return f"[{_number(self.low)} bytes, {_bytes(self.high)}]"
        unit = f" {self.unit}" if self.unit else ""
        return f"[{_number(self.low)}, {_number(self.high)}]{unit}"


def _number(value: float) -> str:
    return f"{int(value):,}" if value == int(value) and 1e4 <= value < 1e10 else f"{value:g}"


def _bytes(value: float) -> str:
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if value >= 1 << shift and value % (1 << shift) == 0:
            return f"{int(value) >> shift:,} {unit}"
    return f"{_number(value)} bytes"


# Keyed by "Message.field". Every number reachable from SubmitJobRequest, ProfileRequest, PlanRequest and
# ProjectProfileRequest has an entry (tests/specs/test_ranges.py).
RANGES: dict[str, Range] = {
    # Models
    "TransformerConfig.num_layers": Range(1, 1024),
    "TransformerConfig.num_decoder_layers": Range(0, 1024),
    "TransformerConfig.hidden_size": Range(1, 65536),
    "TransformerConfig.num_heads": Range(1, 1024),
    "TransformerConfig.ffn_hidden_size": Range(1, 262144, zero="4 x hidden_size"),
    "TransformerConfig.vocab_size": Range(1, 4_194_304),
    "TransformerConfig.seq_length": Range(1, SEQUENCE),
    "TransformerConfig.decoder_seq_length": Range(1, SEQUENCE),
    "TransformerConfig.max_positions": Range(1, SEQUENCE, zero="seq_length"),
    "VisionConfig.image_size": Range(1, 16384, "pixels"),
    "VisionConfig.patch_size": Range(1, 1024, "pixels"),
    "VisionConfig.channels": Range(1, 64),
    "VisionConfig.num_classes": Range(1, 1 << 20),
    "VisionConfig.hidden_size": Range(1, 65536),
    "VisionConfig.num_layers": Range(1, 1024),
    "VisionConfig.num_heads": Range(1, 1024),
    "VisionConfig.depths": Range(1, 1024),
    "VisionConfig.window_size": Range(1, 1024, "patches"),
    "VisionConfig.mlp_ratio": Range(0.01, 64, zero="4"),
    "VisionConfig.head_dim": Range(1, 1024),
    "HuggingFaceModel.seq_length": Range(1, SEQUENCE, "tokens"),
    "ModelSpec.dropout": Range(0, 0.99),
    # Fleets: 0 is "unknown", and the catalog's figure for the device kind or the measured one is used
    "DeviceSpec.memory_bytes": Range(1, 16 * TiB, "bytes", zero="unknown"),
    "DeviceSpec.peak_flops": Range(1e6, 1e18, "FLOP/s", zero="unknown"),
    "DeviceSpec.memory_bandwidth_bytes_per_s": Range(1e6, 1e15, "bytes/s", zero="unknown"),
    "Link.bandwidth_bytes_per_s": Range(1e3, 1e14, "bytes/s", zero="unknown"),
    "Link.latency_s": Range(0, 10, "s"),
    "Fleet.devices_per_node": Range(1, 1024),
    "Fleet.nodes": Range(1, 65536),
    "Fleet.host_memory_bytes_per_node": Range(1, 1024 * TiB, "bytes", zero="unknown"),
    # Jobs
    "JobSpec.global_batch_size": Range(1, 1 << 20, "samples"),
    "JobSpec.iterations": Range(1, ITERATIONS),
    "JobSpec.memory_budget_bytes": Range(1, 16 * TiB, "bytes", zero="the device's memory"),
    "JobSpec.seed": Range(0, 2**64 - 1),
    "JobSpec.checkpoint_every": Range(1, ITERATIONS, "iterations", zero="never"),
    "JobSpec.pipeline_stages": Range(1, 1024, zero="the planner chooses"),
    "JobSpec.min_devices": Range(1, 1 << 20, zero="the plan's"),
    "JobSpec.max_devices": Range(1, 1 << 20, zero="the plan's"),
    "JobSpec.micro_batches": Range(1, 65536, zero="the planner chooses"),
    "JobSpec.eval_every": Range(1, ITERATIONS, "iterations", zero="never"),
    "JobSpec.eval_batches": Range(1, 10_000, zero="4"),
    "JobSpec.keep_checkpoints": Range(1, 1000, zero="3"),
    "OptimizerSpec.learning_rate": Range(0, 10),
    "OptimizerSpec.weight_decay": Range(0, 10),
    "LayerToggle.layer_index": Range(0, 4095),
    "LayerToggle.iteration": Range(0, ITERATIONS),
    # Profiles and plans
    "ProfileRequest.max_micro_batch_size": Range(1, 65536, "samples", zero="the bounded default sweep"),
    "ProfileRequest.memory_cap_bytes": Range(1, 16 * TiB, "bytes", zero="the device's memory"),
    "ProfileRequest.time_budget_s": Range(0.001, 7 * 86400, "s", zero="the default"),
    "ProfileOptions.repeats": Range(5, 1000, zero="5"),
    "ProfileOptions.warmup": Range(1, 1000, zero="2"),
    "ProfileOptions.stride": Range(1, 1024, zero="1"),
    "ProfileOptions.micro_batch_sizes": Range(1, 65536, "samples"),
    "ProfileOptions.intra_op_threads": Range(1, 1024, zero="1"),
    "ProfileOptions.calibrate_group_sizes": Range(2, 1024, "ranks"),
    "PlanRequest.global_batch_size": Range(1, 1 << 20, "samples", zero="the search chooses"),
    "PlanRequest.memory_budget_bytes": Range(1, 16 * TiB, "bytes", zero="the device's memory"),
}


# Free-form text in a request: a string or bytes field holds at most MAX_TEXT_BYTES (names, paths, kinds, an
# echo), a Struct (a model's kwargs, a Hugging Face config with its label maps) at most its STRUCT_BYTES.
MAX_TEXT_BYTES = 4096
STRUCT_BYTES = {"HuggingFaceModel.config": 1 << 20}
MAX_STRUCT_BYTES = 64 << 10
_TEXT = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
# What the store keeps of free-form text (services/store/convert.py, repo/queue.py): messages and event details
# are written by the services from errors, so longer ones are cut with a marker, never refused; a queued
# request's payload over its size is refused.
MAX_MESSAGE_CHARS = 4096
MAX_ATTRIBUTES = 64
MAX_ATTRIBUTE_CHARS = 1024
MAX_PAYLOAD_BYTES = 1 << 20


def check_bounds(message: Message, prefix: str = "") -> None:
    """Raise InvalidArgument naming the first number of `message` (recursively) outside its range, any non-finite
    float, or text over its size; `prefix` is the message's own path in the request ("spec", "spec.model")."""
    for field in message.DESCRIPTOR.fields:
        path = f"{prefix}.{field.name}" if prefix else field.name
        repeated = field.is_repeated
        value = getattr(message, field.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                continue
            if repeated:
                for i, item in enumerate(value):
                    _check_message(item, f"{path}[{i}]")
            elif message.HasField(field.name):
                if isinstance(value, struct_pb2.Struct):
                    _check_struct_size(value, f"{message.DESCRIPTOR.name}.{field.name}", path)
                _check_message(value, path)
            continue
        if field.type in _TEXT:
            for i, text in enumerate(value if repeated else [value]):
                size = len(text.encode() if isinstance(text, str) else text)
                if size > MAX_TEXT_BYTES:
                    raise InvalidArgument(f"{size} bytes of text", field=f"{path}[{i}]" if repeated else path,
                                          fix=f"send at most {MAX_TEXT_BYTES} bytes (docs/limits.md)")
            continue
        if field.type not in _FLOATS + _INTEGERS:
            continue
        rule = RANGES.get(f"{message.DESCRIPTOR.name}.{field.name}")
        for i, number in enumerate(value if repeated else [value]):
            _check_number(number, rule, f"{path}[{i}]" if repeated else path, field.type in _FLOATS)


def _check_message(message: Message, path: str) -> None:
    if isinstance(message, struct_pb2.Struct | struct_pb2.Value | struct_pb2.ListValue):
        _check_struct(message, path)
    elif not message.DESCRIPTOR.full_name.startswith("google.protobuf."):
        check_bounds(message, path)


def _check_struct_size(struct: struct_pb2.Struct, key: str, path: str) -> None:
    limit = STRUCT_BYTES.get(key, MAX_STRUCT_BYTES)
    if struct.ByteSize() > limit:
        raise InvalidArgument(f"{struct.ByteSize()} bytes", field=path,
                              fix=f"send at most {limit >> 10} KiB here (docs/limits.md)")


def _check_struct(value: struct_pb2.Struct | struct_pb2.Value | struct_pb2.ListValue, path: str) -> None:
    """A Struct's numbers (a Hugging Face config) must at least be finite: JSON has no NaN or infinity."""
    if isinstance(value, struct_pb2.Struct):
        for key, item in value.fields.items():
            _check_struct(item, f"{path}.{key}")
    elif isinstance(value, struct_pb2.ListValue):
        for i, item in enumerate(value.values):
            _check_struct(item, f"{path}[{i}]")
    elif value.WhichOneof("kind") == "number_value" and not math.isfinite(value.number_value):
        raise InvalidArgument(f"{value.number_value} is not a finite number", field=path, fix="use a finite number")
    elif value.WhichOneof("kind") in ("struct_value", "list_value"):
        _check_struct(getattr(value, value.WhichOneof("kind")), path)


def _check_number(value: float, rule: Range | None, path: str, floating: bool) -> None:
    if floating and not math.isfinite(value):
        raise InvalidArgument(f"{value} is not a finite number", field=path,
                              fix=f"use a number in {rule.text()} (docs/limits.md)" if rule else "use a finite number")
    if rule is None or rule.admits(value):
        return
    zero = f", or 0 for {rule.zero}" if rule.zero else ""
    raise InvalidArgument(f"{value:g} is outside {rule.text()}", field=path,
                          fix=f"use a value in {rule.text()}{zero} (docs/limits.md)")


def markdown() -> str:
    """docs/limits.md's table (tests/specs/test_ranges.py keeps the file equal to it)."""
    lines = ["| field | valid range | 0 means |", "| --- | --- | --- |"]
    for key, rule in RANGES.items():
        zero = rule.zero or ("not set" if rule.low > 0 else "itself")
        lines.append(f"| `{key}` | {rule.text()} | {zero} |")
    lines += ["", "| text | at most |", "| --- | --- |",
              f"| any string or bytes field of a request | {MAX_TEXT_BYTES} bytes |",
              *(f"| `{key}` (a Struct, serialized) | {size >> 10} KiB |" for key, size in STRUCT_BYTES.items()),
              f"| any other Struct (`CustomModel.kwargs`) | {MAX_STRUCT_BYTES >> 10} KiB |",
              f"| a job event's message, a job's message (longer ones are cut, marked) | {MAX_MESSAGE_CHARS} "
              "characters |",
              f"| a job event's attributes | {MAX_ATTRIBUTES} keys of {MAX_ATTRIBUTE_CHARS} characters |",
              f"| a queued request's payload (`Echo` text: the text limit) | {MAX_PAYLOAD_BYTES >> 10} KiB |"]
    return "\n".join(lines) + "\n"
