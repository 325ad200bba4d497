"""Conversions between the store's ORM rows and the v1 protos.

Most fields are the same on both sides, so `shared_fields` copies every plain field two objects
share by name, in either direction; callers name only the exceptions (a different name, a JSON
column, a value the store decides). Adding a proto field with a matching column then needs no edit here.

Every value written is first checked against its column (`check_column`): proto uint64s exceed
BIGINT, strings can exceed VARCHAR(n) (which SQLite never enforces) and NaN becomes NULL on
SQLite; checking here makes each of these an InvalidArgument naming the field, on both backends.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from functools import cache
from typing import Any, TypeVar

import sqlalchemy as sa
from google.protobuf import json_format, timestamp_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper
from google.protobuf.message import Message

from services.runtime.errors import InvalidArgument
from services.specs.ranges import MAX_ATTRIBUTE_CHARS, MAX_ATTRIBUTES, MAX_MESSAGE_CHARS
from services.store.models import Base

M = TypeVar("M", bound=Message)
TIMESTAMP = timestamp_pb2.Timestamp.DESCRIPTOR.full_name
# Signed range of each integer column type on PostgreSQL (SQLite stores any of them in 64 bits).
INT_BITS = ((sa.SmallInteger, 16), (sa.BigInteger, 64), (sa.Integer, 32))


def ts(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    out = timestamp_pb2.Timestamp()
    out.FromDatetime(value)
    return out


def to_datetime(value: timestamp_pb2.Timestamp, field: str) -> datetime:
    """A client's timestamp as aware UTC; one outside years 1-9999 (or with bad nanos) is its mistake."""
    try:
        return value.ToDatetime(UTC)
    except (ValueError, OverflowError) as err:
        raise InvalidArgument(
            f"invalid timestamp: {err}", field=field, fix="send a time between years 1 and 9999, nanos in [0, 1e9)"
        ) from None


def column_of(attr: Any) -> sa.Column:
    """The Column behind a mapped attribute such as `m.Host.name`."""
    return attr.property.columns[0]


def check_column(column: sa.Column, value: Any, field: str) -> Any:
    """`value` if the column can store it unchanged on every backend, else InvalidArgument at `field`."""
    kind = column.type
    if value is None or isinstance(value, bool) or isinstance(kind, sa.Boolean):
        return value
    if isinstance(value, int) and isinstance(kind, sa.Integer):
        bits = next(b for t, b in INT_BITS if isinstance(kind, t))
        low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        if not low <= value <= high:
            bound = f"at most {high}" if value > high else f"at least {low}"
            raise InvalidArgument(f"{value} does not fit a {bits}-bit integer", field=field, fix=f"send {bound}")
    elif isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgument(f"{value} is not a finite number", field=field, fix="send a finite number")
    elif isinstance(value, str):
        length = getattr(kind, "length", None)
        if length is not None and len(value) > length:
            raise InvalidArgument(
                f"{len(value)} characters is too long", field=field, fix=f"use at most {length} characters"
            )
        if "\x00" in value:  # PostgreSQL text cannot hold NUL; SQLite would store it
            raise InvalidArgument("contains a NUL character", field=field, fix="remove the NUL (\\x00) character")
    return value




def bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text`, cut to `limit` characters with a marker saying how much went."""
    if len(text) <= limit:
        return text
    marker = f" [... {len(text) - limit} more characters cut]"
    return text[:max(0, limit - len(marker))] + marker


def bounded_attributes(attributes: Mapping[str, str], field: str) -> dict[str, str]:
    """An event's attributes: at most 64 keys (a caller's mistake beyond that), each value bounded."""
    if len(attributes) > MAX_ATTRIBUTES:
        raise InvalidArgument(f"{len(attributes)} attributes", field=field, fix=f"send at most {MAX_ATTRIBUTES}")
    return {bounded(str(k), 256): bounded(str(v), MAX_ATTRIBUTE_CHARS) for k, v in attributes.items()}


def to_json(msg: Message) -> dict[str, Any]:
    """A nested proto as stored in a JSON column (proto field names, so SQL users can read it)."""
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def from_json(data: dict[str, Any] | None, cls: type[M]) -> M:
    return json_format.ParseDict(data or {}, cls(), ignore_unknown_fields=True)


def enum_name(enum: Any, value: int, field: str) -> str:
    """Enums are stored by name; an unknown number is the caller's mistake, reported at `field`."""
    try:
        return enum.Name(value)
    except ValueError:
        raise InvalidArgument(f"unknown enum value {value}", field=field) from None


@cache
def _columns(table: type[Base]) -> dict[str, sa.Column]:
    return {attr.key: attr.columns[0] for attr in sa.inspect(table).column_attrs}


def shared_fields(
    src: Message | Base,
    dst: type[Message] | type[Base],
    *,
    rename: Mapping[str, str] | None = None,
    skip: Collection[str] = (),
    field: str = "",
    table: type[Base] | None = None,
) -> dict[str, Any]:
    """Constructor kwargs for `dst` from the plain fields it shares with `src`, proto->row or row->proto.

    Fields match by proto field name; `rename` maps a proto name to a differently named column and
    `skip` lists proto names the caller sets itself. Nested messages are left to the caller (JSON
    columns stay explicit), except timestamps towards a proto. Enums are stored by name, and proto3's
    empty string stands for NULL in a nullable column. Towards a row every value is checked against
    its column; `field` is the proto path of `src`, for the errors a bad value raises. Towards a proto, `src`
    may be a Core result row of `table`'s columns instead of a mapped object.
    """
    to_proto = isinstance(dst, type) and issubclass(dst, Message)
    renamed = tuple(sorted(rename.items())) if rename else ()
    if to_proto:
        out: dict[str, Any] = {}
        for f, name, kind in _plan(table or type(src), dst, renamed, frozenset(skip), True):
            value = getattr(src, name)
            if value is not None:
                out[f.name] = _proto_value(f, kind, value)
        return out
    columns = _columns(dst)
    return {name: _row_value(f, kind, getattr(src, f.name), columns[name], f"{field}.{f.name}" if field else f.name)
            for f, name, kind in _plan(dst, type(src), renamed, frozenset(skip), False)}


@cache
def _plan(table: type[Base], proto: type[Message], renamed: tuple[tuple[str, str], ...], skip: frozenset[str],
          to_proto: bool) -> tuple[tuple[FieldDescriptor, str, str], ...]:
    """(field, column name, kind) that shared_fields copies between `table` and `proto`: worked out once per
    pair, not on every row (a page of jobs converted every row's fields from the descriptors again)."""
    rename, columns, out = dict(renamed), _columns(table), []
    for f in proto.DESCRIPTOR.fields:
        name, kind = rename.get(f.name, f.name), _kind(f)
        if f.name in skip or name not in columns or kind == "message" or (kind == "timestamp" and not to_proto):
            continue
        out.append((f, name, kind))
    return tuple(out)


def _kind(f: FieldDescriptor) -> str:
    if f.type == f.TYPE_ENUM:
        return "enum"
    if f.type != f.TYPE_MESSAGE:
        return "plain"
    if f.message_type.GetOptions().map_entry:
        return "map"
    return "timestamp" if f.message_type.full_name == TIMESTAMP else "message"


def _proto_value(f: FieldDescriptor, kind: str, value: Any) -> Any:
    if kind == "timestamp":
        return ts(value)
    if kind == "enum":
        enum = _enum(f.enum_type)
        return [enum.Value(v) for v in value] if f.is_repeated else enum.Value(value)
    return value


@cache
def _enum(descriptor: Any) -> EnumTypeWrapper:
    return EnumTypeWrapper(descriptor)


def _row_value(f: FieldDescriptor, kind: str, value: Any, column: sa.Column, path: str) -> Any:
    if kind == "map":
        return dict(value)
    if kind == "enum":
        enum = _enum(f.enum_type)
        return [enum_name(enum, v, path) for v in value] if f.is_repeated else enum_name(enum, value, path)
    if f.is_repeated:
        return list(value)
    return None if value == "" and column.nullable else check_column(column, value, path)
