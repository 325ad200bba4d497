"""Hostile requests for every public RPC, built from the protos' descriptors (hardening issue, fuzz suite).

A case is one request message: empty, or a valid-looking base (a small GPT model, a CPU fleet, a job spec)
with one to three fields set to hostile values -- empty, huge and path-like strings, the extremes of each
integer type, NaN and infinities, unknown enum values, long repeated fields -- down to nested messages.
`call` sends it on a raw channel and reduces the answer to a Verdict: a clean status is OK or a refusal the
caller can act on, and an INVALID_ARGUMENT also names the field (Ballast's error metadata). INTERNAL,
UNKNOWN, UNIMPLEMENTED, a hang past the deadline or a dead server are findings. Deterministic for a seed.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
import random
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor as d
from google.protobuf import message_factory
from google.protobuf.message import Message

import ballast.v1 as api
from ballast.v1 import fleet_pb2, job_pb2, model_pb2
from services.runtime.errors import ERROR_FIELD

CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ALREADY_EXISTS,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAUTHENTICATED,
         grpc.StatusCode.ABORTED}
STRINGS = ["", " ", "../../x", "/etc/passwd", "x" * 100_000, "\u00e9\u4e2d\U0001f4a5" * 300, "job-" + "9" * 40,
           "'; DROP TABLE jobs; --", "%s%n", "\t\n", "a" * 64 + "/" + "b" * 64, "*"]
FLOATS = [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e308, -1e-308, 5e-324]
LIMITS = {d.FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), d.FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
          d.FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), d.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
          d.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), d.FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
          d.FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), d.FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
          d.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), d.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1)}
# Bytes no protobuf library would send: garbage, a field cut short, groups nested past the parser's depth limit, a
# varint of eleven bytes. They must be refused as the caller's (INVALID_ARGUMENT), never INTERNAL.
MALFORMED = [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x0b" * 200 + b"\x0c" * 200, b"\x08" + b"\xff" * 11]
MAX_DEPTH = 3
DEADLINE_S = 10.0  # an answer later than this is a hang ...
# ... except where the RPC's work is a measurement that takes longer by design: a link calibration starts its
# ranks as processes and times real collectives (the empty request runs the default one, 5-20 s here)
LONG_S = {"/ballast.v1.ProfilerService/Calibrate": 120.0}


def _tiny_gpt() -> model_pb2.ModelSpec:
    return model_pb2.ModelSpec(name="fuzz-gpt", family=model_pb2.MODEL_FAMILY_GPT,
                               transformer=model_pb2.TransformerConfig(num_layers=2, hidden_size=32, num_heads=2,
                                                                       vocab_size=64, seq_length=16))


def _cpu_fleet() -> fleet_pb2.Fleet:
    return fleet_pb2.Fleet(name="fuzz", nodes=1, devices_per_node=2,
                           device=fleet_pb2.DeviceSpec(kind="cpu", memory_bytes=8 << 30, peak_flops=1e11))


# Valid-looking values for the messages that carry most of the validation: a mutation of one field of these
# reaches the checks behind the first "is it set" test.
BASES = {
    "ballast.v1.ModelSpec": _tiny_gpt,
    "ballast.v1.Fleet": _cpu_fleet,
    "ballast.v1.JobSpec": lambda: job_pb2.JobSpec(name="fuzz", model=_tiny_gpt(), global_batch_size=4, iterations=2),
}


@dataclass(frozen=True)
class Method:
    service: str  # full name, "ballast.v1.StoreService"
    name: str
    request: type[Message]
    response: type[Message]
    server_streaming: bool

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"


@dataclass(frozen=True)
class Verdict:
    method: str
    case: int
    code: grpc.StatusCode
    detail: str
    clean: bool
    why: str = ""


def methods(services: set[str] | None = None) -> list[Method]:
    """Every RPC in the protos (optionally only these services), from the generated descriptors."""
    out = []
    for info in sorted(pkgutil.iter_modules(api.__path__), key=lambda m: m.name):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(f"{api.__name__}.{info.name}")
        for service in module.DESCRIPTOR.services_by_name.values():
            if services is not None and service.full_name not in services:
                continue
            for m in service.methods:
                if m.client_streaming:
                    continue  # none today; a client stream needs its own driver
                out.append(Method(service.full_name, m.name, message_factory.GetMessageClass(m.input_type),
                                  message_factory.GetMessageClass(m.output_type), m.server_streaming))
    return out


def _scalar(field: d.FieldDescriptor, rng: random.Random) -> object:
    t = field.type
    if t == d.FieldDescriptor.TYPE_STRING:
        return rng.choice(STRINGS)
    if t == d.FieldDescriptor.TYPE_BYTES:
        return rng.choice([b"", b"\x00" * 1000, bytes(range(256)), b"\xff" * 100_000])
    if t in (d.FieldDescriptor.TYPE_DOUBLE, d.FieldDescriptor.TYPE_FLOAT):
        return rng.choice(FLOATS)
    if t == d.FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if t == d.FieldDescriptor.TYPE_ENUM:
        values = [v.number for v in field.enum_type.values]
        return rng.choice([*values, 9999, -7])
    lo, hi = LIMITS[t]
    return rng.choice([lo, hi, 0, -1 if lo < 0 else 1, hi // 2, rng.randint(lo, hi)])


def _mutate(msg: Message, rng: random.Random, depth: int) -> None:
    fields = list(msg.DESCRIPTOR.fields)
    if not fields:
        return
    for field in rng.sample(fields, k=min(len(fields), rng.randint(1, 3))):
        _set(msg, field, rng, depth)


def _set(msg: Message, field: d.FieldDescriptor, rng: random.Random, depth: int) -> None:
    repeated = field.is_repeated
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        target = getattr(msg, field.name)
        key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        for _ in range(rng.choice([1, 3, 200])):
            key = _scalar(key_field, rng)
            if value_field.message_type is None:
                target[key] = _scalar(value_field, rng)
            elif depth < MAX_DEPTH:
                _fill(target[key], rng, depth + 1)
        return
    if field.message_type is not None:
        if depth >= MAX_DEPTH:
            return
        if repeated:
            for _ in range(rng.choice([1, 2, 50])):
                _fill(getattr(msg, field.name).add(), rng, depth + 1)
        else:
            _fill(getattr(msg, field.name), rng, depth + 1)
        return
    if repeated:
        target = getattr(msg, field.name)
        target.extend(_scalar(field, rng) for _ in range(rng.choice([1, 5, 10_000])))
        return
    setattr(msg, field.name, _scalar(field, rng))


def _fill(msg: Message, rng: random.Random, depth: int) -> None:
    """A base value for the message where one is known (half the time), then hostile fields."""
    base = BASES.get(msg.DESCRIPTOR.full_name)
    if base is not None and rng.random() < 0.5:
        msg.CopyFrom(base())
    _mutate(msg, rng, depth)


def cases(method: Method, count: int, seed: int) -> Iterator[Message | bytes]:
    """`count` hostile requests for `method`: the empty one first, then malformed bytes, then mutations, the same
    for a seed."""
    rng = random.Random(f"{seed}:{method.path}")
    yield method.request()
    malformed = MALFORMED[:max(0, count - 1)]
    yield from malformed
    for _ in range(count - 1 - len(malformed)):
        msg = method.request()
        _fill(msg, rng, 0)
        yield msg


def call(channel: grpc.Channel, method: Method, request: Message | bytes, case: int) -> Verdict:
    """Send one case (a message, or raw bytes as they are); a stream is read to its first message (or its end)."""
    parse = method.response.FromString
    serialize = (lambda raw: raw) if isinstance(request, bytes) else method.request.SerializeToString
    timeout_s = LONG_S.get(method.path, DEADLINE_S)
    try:
        if method.server_streaming:
            stream = channel.unary_stream(method.path, request_serializer=serialize, response_deserializer=parse)(
                request, timeout=timeout_s)
            try:
                next(iter(stream), None)
            finally:
                stream.cancel()
        else:
            channel.unary_unary(method.path, request_serializer=serialize, response_deserializer=parse)(
                request, timeout=timeout_s)
    except grpc.RpcError as err:
        code, detail = err.code(), err.details() or ""
        if code == grpc.StatusCode.CANCELLED and method.server_streaming:
            return Verdict(method.path, case, grpc.StatusCode.OK, "", True)  # our own cancel after a message
        if code not in CLEAN:
            return Verdict(method.path, case, code, detail, False, f"status {code.name}")
        if code == grpc.StatusCode.INVALID_ARGUMENT and not _names_field(err):
            return Verdict(method.path, case, code, detail, False, "INVALID_ARGUMENT without the field")
        return Verdict(method.path, case, code, detail, True)
    return Verdict(method.path, case, grpc.StatusCode.OK, "", True)


def _names_field(err: grpc.RpcError) -> bool:
    trailers = dict(err.trailing_metadata() or ())
    return bool(trailers.get(ERROR_FIELD))


# A store a fuzz run leaves behind holds nothing half-written: each query counts rows that break a rule.
CONSISTENCY = {
    "plans without layers": "SELECT count(*) FROM plans p WHERE NOT EXISTS "
                            "(SELECT 1 FROM plan_layers l WHERE l.plan_id = p.id)",
    "profiles without layers": "SELECT count(*) FROM profiles p WHERE NOT EXISTS "
                               "(SELECT 1 FROM profile_layers l WHERE l.profile_id = p.id)",
    "jobs without events": "SELECT count(*) FROM jobs j WHERE NOT EXISTS "
                           "(SELECT 1 FROM job_events e WHERE e.job_id = j.id)",
    "jobs whose plan is missing": "SELECT count(*) FROM jobs j WHERE j.plan_id IS NOT NULL AND NOT EXISTS "
                                  "(SELECT 1 FROM plans p WHERE p.id = j.plan_id)",
    "jobs behind their last event": "SELECT count(*) FROM jobs j WHERE j.last_event_seq < "
                                    "(SELECT MAX(e.seq) FROM job_events e WHERE e.job_id = j.id)",
}


def inconsistencies(database_url: str) -> dict[str, int]:
    """Each rule of CONSISTENCY with the rows breaking it (all 0 for a consistent store)."""
    import sqlalchemy as sa

    from services.store.db import create_engine

    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return {rule: int(conn.execute(sa.text(sql)).scalar_one()) for rule, sql in CONSISTENCY.items()}
    finally:
        engine.dispose()
