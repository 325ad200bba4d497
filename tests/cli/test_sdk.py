"""The commands that go through the SDK (`ballast submit`, `sql`, `explain`, `queue`) against real store and planner
servers in this process (no worker: a submitted job stays SUBMITTED): their output and exit codes, refusals
included, are what they were before the SDK carried them."""

from __future__ import annotations

import json

import pytest

from tests.harness import ROOT, in_process_cli, make_settings, start_plane


@pytest.fixture
def ballast(tmp_path, monkeypatch, capsys):
    plane = start_plane(make_settings(tmp_path / "plane"), ("store", "planner"), send=lambda request_id: None)
    monkeypatch.chdir(ROOT)
    try:
        yield in_process_cli(plane.settings, monkeypatch, capsys)
    finally:
        plane.stop()


def test_submit_sql_explain_and_queue(ballast) -> None:
    code, out, _ = ballast("submit", "examples/gpt-tiny.yaml", "--batch", "4", "--iterations", "3",
                           "--min-devices", "1", "--max-devices", "2")
    assert code == 0 and "submitted; `ballast watch job-" in out
    code, out, _ = ballast("sql", "--json", "SELECT state, spec ->> 'max_devices' AS most FROM jobs")
    assert code == 0 and json.loads(out) == {"columns": ["state", "most"], "rows": [["JOB_STATE_SUBMITTED", 2]],
                                             "truncated": False}
    code, out, _ = ballast("queue")
    assert code == 0 and "the queue is empty" in out and "1 job(s) still being profiled or planned" in out


@pytest.mark.parametrize("argv, code, words", [
    (["sql", "DELETE FROM jobs"], 1, "PERMISSION_DENIED: read-only"),
    (["sql", " "], 2, "query: no SQL statement given"),
    (["explain", "pln-nope"], 1, "NOT_FOUND: id: plan 'pln-nope' not found"),
    (["submit", "examples/gpt-tiny.yaml", "--memory", "lots"], 2, "memory: cannot read 'lots' as bytes"),
    (["submit", "examples/gpt-tiny.yaml", "--micro-batches", "3", "--batch", "4"], 1,
     "INVALID_ARGUMENT: spec.micro_batches"),
])
def test_refusals_keep_their_exit_code_and_words(ballast, argv, code, words) -> None:
    got, _, err = ballast(*argv)
    assert got == code and words in " ".join(err.split()), err
