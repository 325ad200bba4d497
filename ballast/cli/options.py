"""Option vocabularies shared by `ballast plan`, `submit` and `profile`: engines, schedules, precisions, sizes.

They live apart from any one subcommand so the subcommands import them without importing each other.
"""

from __future__ import annotations

import re

from ballast.v1 import common_pb2, plan_pb2

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
ENGINES = {"galvatron": plan_pb2.PLAN_ENGINE_GALVATRON, "varuna": plan_pb2.PLAN_ENGINE_VARUNA}
SCHEDULES = {"gpipe": plan_pb2.SCHEDULE_GPIPE, "1f1b": plan_pb2.SCHEDULE_1F1B, "varuna": plan_pb2.SCHEDULE_VARUNA}
DTYPES = {"fp32": common_pb2.DTYPE_FP32, "fp16": common_pb2.DTYPE_FP16, "bf16": common_pb2.DTYPE_BF16}


def parse_bytes(text: str) -> int:
    """'16GiB' -> 16 * 2**30, '16GB' -> 16 * 10**9, '123' -> 123 (units as written, never guessed)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"cannot read {text!r} as bytes (e.g. 16GiB, 16GB, 800MiB)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])
