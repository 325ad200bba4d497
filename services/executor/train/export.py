"""Export worker: `python -m services.executor.train.export`, one export per process.

The planner spawns this to turn a checkpoint into the user's weights (weights.export), so that a user's model
code (a factory, transformers) runs in a process of its own, never in the service. Protocol, JSON only:

* stdin: one JSON object {"checkpoint": a checkpoint directory, "spec": ModelSpec (MessageToDict), "format":
  "safetensors" | "torch" | "hf", "out": an empty directory to write into, "user_inputs": UserInputs.to_json(),
  "meta": what the export's ballast.json records beside the weights (job id, checkpoint id)}.
* stdout: one JSON line, {"files": [{"name", "bytes", "sha256"}], "iteration": N} (exit 0) or {"error": {"code",
  "message", "field", "fix"}} (exit 1). stderr: logs; stray prints go there too.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, TextIO

from google.protobuf.json_format import ParseDict, ParseError

from ballast.v1 import model_pb2
from services.runtime.errors import BallastError, InvalidArgument
from services.specs.user_inputs import UserInputs

log = logging.getLogger("ballast.executor.export")


def parse(text: str) -> dict[str, Any]:
    try:
        job = json.loads(text)
        spec = ParseDict(job["spec"], model_pb2.ModelSpec())
        return {"checkpoint": str(job["checkpoint"]), "spec": spec, "format": str(job.get("format") or "safetensors"),
                "out": Path(job["out"]), "user_inputs": UserInputs.from_json(job.get("user_inputs") or {}),
                "meta": dict(job.get("meta") or {})}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, ParseError) as exc:
        raise InvalidArgument(f"not an export job: {exc}", field="stdin",
                              fix='{"checkpoint", "spec", "format", "out", "user_inputs", "meta"}') from exc


def run(stdin: TextIO, out: TextIO) -> int:
    try:
        job = parse(stdin.read())
        job["user_inputs"].importable()
        from services.executor.train import weights  # imports torch: after stdout is diverted

        files, iteration = weights.export(job["checkpoint"], job["spec"], job["format"], job["out"],
                                          job["user_inputs"], job["meta"])
        result: dict[str, Any] = {"files": files, "iteration": iteration}
        code = 0
    except BallastError as exc:
        log.info("export refused: %s", exc)
        result = {"error": {"code": exc.code, "message": exc.message, "field": exc.field, "fix": exc.fix}}
        code = 1
    except Exception as exc:
        log.exception("export failed")
        result = {"error": {"code": "INTERNAL", "message": f"{type(exc).__name__}: {exc}"}}
        code = 1
    out.write(json.dumps(result, separators=(",", ":")) + "\n")
    out.flush()
    return code


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints (libraries, warnings) must not corrupt the protocol
    try:
        return run(sys.stdin, out)
    finally:
        sys.stdout = out


if __name__ == "__main__":
    raise SystemExit(main())
