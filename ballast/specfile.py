"""Spec files (YAML, field names as in the proto): read into a message, each mistake named by its path in the
file with a fix ("did you mean 'num_heads'?"), never a protobuf traceback. The CLI and the SDK read model specs
here (`read_model_spec`), so both say the same."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.json_format import ParseDict, ParseError
from google.protobuf.message import Message

from ballast.errors import InvalidInput
from ballast.v1 import job_pb2, model_pb2

M = TypeVar("M", bound=Message)
FREE_FORM = ("google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue")
SpecFileError = InvalidInput  # a spec file that cannot be read; `field` is the offending key's path in the file


def read_data_spec(path: str | os.PathLike[str]) -> job_pb2.DataSpec:
    """A DataSpec from YAML; relative paths are taken from the file's directory and made absolute."""
    spec = message_from_dict(read_yaml(path, "a data.yaml with tokens:, hf_dataset: or factory:"), job_pb2.DataSpec(),
                             where=str(path))
    base = Path(path).resolve().parent
    for message, names in ((spec.tokens, ("path", "validation_path")), (spec.hf_dataset, ("path", "tokenizer_dir"))):
        for name in names:
            value = os.path.expanduser(getattr(message, name))
            if value and not os.path.isabs(value):
                setattr(message, name, str(base / value))
    return spec


def read_model_spec(path: str | os.PathLike[str]) -> model_pb2.ModelSpec:
    """A ModelSpec from YAML (JSON is YAML too). A Hugging Face config or weights directory given relative to the
    file is made absolute: the services read it at that path."""
    spec = message_from_dict(read_yaml(path, "examples/gpt-tiny.yaml"), model_pb2.ModelSpec(), where=str(path))
    if spec.WhichOneof("config") == "hf":
        base = Path(path).resolve().parent
        for name in ("config_dir", "weights_dir"):
            value = os.path.expanduser(getattr(spec.hf, name))
            if value:
                setattr(spec.hf, name, value if os.path.isabs(value) else str(base / value))
    return spec


MAX_YAML_CHARS = 1 << 20
MAX_YAML_DEPTH = 64


def safe_yaml(text: str) -> Any:
    """yaml.safe_load for a file a user wrote, without what only a bomb needs: no aliases (a "billion laughs" file
    is small until its shared nodes are walked), nesting at most 64 deep (PyYAML's composer recurses), at most
    1 MiB. Scanned first by the parser's flat event stream; a refusal is a yaml.YAMLError."""
    if len(text) > MAX_YAML_CHARS:
        raise yaml.YAMLError(f"{len(text)} characters; a spec file holds at most {MAX_YAML_CHARS}")
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            raise yaml.YAMLError(f"it uses an alias (*{event.anchor}); spec files take no anchors or aliases: "
                                 "write the value out")
        if isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise yaml.YAMLError(f"it nests deeper than {MAX_YAML_DEPTH} levels")
        elif isinstance(event, yaml.MappingEndEvent | yaml.SequenceEndEvent):
            depth -= 1
    return yaml.safe_load(text)


def yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error on one line: where and what (PyYAML's own text spans several, with a snippet)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(err).split())
    context = getattr(err, "context", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")


def read_yaml(path: str | os.PathLike[str], example: str) -> Any:
    """The parsed file; a missing or unreadable file, or bad YAML, is one SpecFileError line."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise SpecFileError(f"cannot read {os.fspath(path)!r}: {err.strerror}", field="model",
                            fix=f"give the path of an existing spec file, e.g. {example}") from None
    try:
        return safe_yaml(text)
    except yaml.YAMLError as err:
        raise SpecFileError(f"{os.fspath(path)} is not valid YAML: {yaml_problem(err)}", field="model",
                            fix="fix the YAML syntax") from None


def message_from_dict(data: Any, message: M, *, where: str) -> M:
    """`message` filled from `data`, after every key and enum name was checked against the message's fields."""
    if not isinstance(data, Mapping):
        raise SpecFileError(f"{where} holds no mapping of fields (a {type(data).__name__})", field="model",
                            fix=f"write `field: value` lines, e.g. `name: my-model` ({message.DESCRIPTOR.name})")
    check_fields(data, message.DESCRIPTOR, "", where)
    try:
        return ParseDict(data, message)
    except ParseError as err:  # a value of the wrong type: the keys and enum names are already right
        raise SpecFileError(f"{where}: {err}", field="model", fix="give each field a value of its type") from None


def check_fields(data: Mapping[str, Any], descriptor: Descriptor, prefix: str, where: str) -> None:
    """Unknown keys and enum names, by their path in the file (`transformer.num_heads`), with the closest name."""
    names = {f.name: f for f in descriptor.fields} | {f.json_name: f for f in descriptor.fields}
    for key, value in data.items():
        field = names.get(str(key))
        path = f"{prefix}{key}"
        if field is None:
            known = [f.name for f in descriptor.fields]
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise SpecFileError(f"{where}: unknown field {key!r}", field=path,
                                fix=f"{hint}known: {', '.join(known)}")
        _check_value(field, value, path, where)


def _check_value(field: FieldDescriptor, value: Any, path: str, where: str) -> None:
    repeated = field.is_repeated
    items = value if repeated and isinstance(value, list) else [value]
    for i, item in enumerate(items):
        at = f"{path}[{i}]" if repeated and isinstance(value, list) else path
        if field.type == FieldDescriptor.TYPE_ENUM and isinstance(item, str):
            _check_enum(field.enum_type, item, at, where)
        elif (field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.full_name not in FREE_FORM
              and isinstance(item, Mapping)):
            check_fields(item, field.message_type, f"{at}.", where)


def _check_enum(enum: EnumDescriptor, name: str, path: str, where: str) -> None:
    known = [v.name for v in enum.values if not v.name.endswith("_UNSPECIFIED")]
    if name in enum.values_by_name:
        return
    close = difflib.get_close_matches(name, known, n=1) or [k for k in known if k.endswith(f"_{name.upper()}")]
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise SpecFileError(f"{where}: {name!r} is not a {enum.name}", field=path, fix=f"{hint}one of: {', '.join(known)}")
