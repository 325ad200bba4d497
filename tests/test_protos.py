"""Contracts: committed stubs are fresh, every field and enum value is documented, enums start at UNSPECIFIED."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[1]
PROTOS = sorted((ROOT / "protos" / "ballast" / "v1").glob("*.proto"))


def _generate(out: Path, *extra: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={out}",
         f"--pyi_out={out}", f"--grpc_python_out={out}", *extra, *map(str, PROTOS)],
        check=True,
        capture_output=True,
    )


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    _generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    stale = [str(rel) for rel in generated if (ROOT / rel).read_bytes() != (tmp_path / rel).read_bytes()]
    assert not stale, f"stale generated stubs (run `make protos`): {stale}"
    committed = {p.relative_to(ROOT) for p in (ROOT / "ballast" / "v1").glob("*_pb2*.py*")}
    assert committed == set(generated), "committed stubs without a .proto (or the reverse): run `make protos`"


def _descriptor_set(tmp_path: Path) -> descriptor_pb2.FileDescriptorSet:
    out = tmp_path / "set.pb"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--descriptor_set_out={out}",
         "--include_source_info", *map(str, PROTOS)],
        check=True,
        capture_output=True,
    )
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def test_every_field_enum_value_and_rpc_is_commented(tmp_path: Path) -> None:
    undocumented = []
    for file in _descriptor_set(tmp_path).file:
        if not file.name.startswith("ballast/"):
            continue
        assert file.package == "ballast.v1"
        commented = {tuple(loc.path) for loc in file.source_code_info.location if loc.leading_comments.strip()}
        for m_i, message in enumerate(file.message_type):
            undocumented += _undocumented_message(file.name, message, (4, m_i), commented)
        for e_i, enum in enumerate(file.enum_type):
            undocumented += _undocumented_enum(file.name, enum, (5, e_i), commented)
        for s_i, service in enumerate(file.service):
            for r_i, rpc in enumerate(service.method):
                if (6, s_i, 2, r_i) not in commented:
                    undocumented.append(f"{file.name}: rpc {service.name}.{rpc.name}")
    assert not undocumented, "add a comment to: " + ", ".join(undocumented)


def _undocumented_message(fname, message, path, commented) -> list[str]:
    missing = [] if path in commented else [f"{fname}: message {message.name}"]
    for f_i, field in enumerate(message.field):
        if (*path, 2, f_i) not in commented:
            missing.append(f"{fname}: {message.name}.{field.name}")
    for n_i, nested in enumerate(message.nested_type):
        if not nested.options.map_entry:
            missing += _undocumented_message(fname, nested, (*path, 3, n_i), commented)
    for e_i, enum in enumerate(message.enum_type):
        missing += _undocumented_enum(fname, enum, (*path, 4, e_i), commented)
    return missing


def _undocumented_enum(fname, enum, path, commented) -> list[str]:
    missing = [] if path in commented else [f"{fname}: enum {enum.name}"]
    for v_i, value in enumerate(enum.value):
        if v_i > 0 and (*path, 2, v_i) not in commented:  # the UNSPECIFIED zero value speaks for itself
            missing.append(f"{fname}: {enum.name}.{value.name}")
    return missing


def test_enums_start_at_unspecified(tmp_path: Path) -> None:
    for file in _descriptor_set(tmp_path).file:
        if not file.name.startswith("ballast/"):
            continue
        for enum in file.enum_type:
            assert enum.value[0].number == 0
            assert enum.value[0].name.endswith("_UNSPECIFIED"), enum.name
            prefix = enum.value[0].name.removesuffix("_UNSPECIFIED")
            assert all(v.name.startswith(prefix + "_") for v in enum.value), enum.name


def test_times_are_timestamps(tmp_path: Path) -> None:
    offenders = []
    for file in _descriptor_set(tmp_path).file:
        for message in file.message_type:
            for field in message.field:
                if field.name.endswith("_at") and field.type_name != ".google.protobuf.Timestamp":
                    offenders.append(f"{message.name}.{field.name}")
    assert not offenders
