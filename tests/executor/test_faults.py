"""A worker's own view of why it failed (lost infrastructure or the model), and the fault hooks tests use."""

from __future__ import annotations

import json

import pytest

from services.executor.train import faults
from services.executor.train.worker import is_infrastructure


@pytest.mark.parametrize("exc,infra", [
    (ConnectionResetError("peer"), True),
    (TimeoutError(), True),
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"), True),
    (RuntimeError("Socket Timeout"), True),
    (type("DistNetworkError", (RuntimeError,), {})("x"), True),
    (OSError(28, "No space left on device"), True),  # the host's disk: a checkpoint could not be written
    (OSError(122, "Disk quota exceeded"), True),
    (FileNotFoundError(2, "No such file or directory"), False),  # the model's own path
    (ValueError("shapes (4, 3) and (2,) not aligned"), False),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 2x5)"), False),
    (ZeroDivisionError(), False),
])
def test_a_broken_link_is_infrastructure_and_a_model_error_is_not(exc, infra):
    assert is_infrastructure(exc) is infra


def test_faults_apply_to_the_matching_model_and_rank(monkeypatch):
    monkeypatch.setenv(faults.ENV, json.dumps([{"model": "boom", "raise_at": 2}, {"rank": 1, "slow": 3.0}]))
    boom = faults.Faults.from_env("boom", 0)
    boom.before_forward(1)
    with pytest.raises(ValueError, match="forward pass at iteration 2"):
        boom.before_forward(2)
    assert [f.slow for f in faults.Faults.from_env("other", 1).faults] == [3.0]
    assert faults.Faults.from_env("other", 0).faults == []


def test_without_the_variable_nothing_is_injected(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    none = faults.Faults.from_env("boom", 0)
    none.before_forward(0)
    none.after_iteration(1.0)  # no sleep: returns at once
    assert none.faults == []
