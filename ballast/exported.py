"""The client's end of an export (`Client.export`, `ballast export`): the streamed pieces written into a directory,
each file checked against its size and SHA-256 before it takes its name."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ballast.errors import ClientError, InvalidInput
from ballast.v1 import services_pb2


@dataclass
class Export:
    """What an export wrote: the checkpoint it came from, and each file (name -> bytes)."""

    directory: Path
    checkpoint_id: str = ""
    iteration: int = 0
    files: dict[str, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(self.files.values())


def target(out: str | os.PathLike[str]) -> Path:
    """A new or empty directory (an export never mixes with other files)."""
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise InvalidInput(f"{path} exists and is not an empty directory", field="out",
                           fix="give a new or empty directory")
    return path


def receive(pieces: Iterable[services_pb2.ExportChunk], out: Path) -> Export:
    """Write the pieces into `out`; a file is written under a temporary name and renamed once its bytes match."""
    out.mkdir(parents=True, exist_ok=True)
    result = Export(out)
    current: tuple[str, int, str] | None = None  # (name, size, sha256)
    handle, digest, written = None, hashlib.sha256(), 0

    def finish() -> None:
        assert current is not None and handle is not None
        handle.close()
        name, size, sha = current
        if written != size or digest.hexdigest() != sha:
            (out / f".{name}.part").unlink(missing_ok=True)
            raise ClientError(f"export file {name}: {written} bytes with sha256 {digest.hexdigest()[:12]}…, the "
                              f"planner sent {size} with {sha[:12]}…", fix="export again")
        os.replace(out / f".{name}.part", out / name)
        result.files[name] = size

    for piece in pieces:
        if "/" in piece.file or piece.file.startswith(".") or not piece.file:
            raise ClientError(f"the planner sent a file named {piece.file!r}", fix="export again")
        if current is None or piece.file != current[0]:
            if current is not None:
                finish()
            current = (piece.file, piece.size, piece.sha256)
            handle, digest, written = open(out / f".{piece.file}.part", "wb"), hashlib.sha256(), 0
            result.checkpoint_id, result.iteration = piece.checkpoint_id, piece.iteration
        if piece.offset != written:
            raise ClientError(f"export file {piece.file}: a piece at {piece.offset}, expected {written}",
                              fix="export again")
        handle.write(piece.data)
        digest.update(piece.data)
        written += len(piece.data)
    if current is None:
        raise ClientError("the export stream ended without a file", fix="export again")
    finish()
    return result
