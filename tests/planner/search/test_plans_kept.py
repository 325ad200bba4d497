"""A faster search keeps every plan (issue 44): the planner benchmark's cases, re-planned, against the plans
recorded before the search was sped up (`benchmarks/planner.py --record`)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import planner_cases as cases  # noqa: E402

RECORDED = json.loads(cases.RECORD.read_text())
FLOATS = ("iteration_s",)


def same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for key, value in w.items():
            if key in FLOATS:
                assert math.isclose(g[key], value, rel_tol=1e-9), (key, g[key], value)
            else:
                assert g[key] == value, (key, g[key], value)


@pytest.mark.parametrize(("layers", "devices"), cases.GALVATRON_CASES)
def test_the_hybrid_search_keeps_the_benchmarks_plans(layers: int, devices: int) -> None:
    same(cases.fingerprint(cases.galvatron_plans(layers, devices)), RECORDED[f"galvatron {layers} {devices}"])


@pytest.mark.parametrize(("layers", "devices", "batch"), cases.VARUNA_CASES)
def test_the_varuna_engine_keeps_the_benchmarks_plans(layers: int, devices: int, batch: int) -> None:
    """Its top_k (5) plans: the first five of every depth's it recorded."""
    same(cases.fingerprint(cases.varuna_plans(layers, devices, batch)),
         RECORDED[f"varuna {layers} {devices} {batch}"][:5])
