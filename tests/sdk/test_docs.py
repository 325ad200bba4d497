"""docs/sdk.md: its examples are one session, run in order against a real control plane (store, profiler and
planner over TLS on loopback, a Celery worker, two executor agents), with the settings in the environment as a
user's shell would have them. A fast check keeps every block parseable and every `client.…` it calls real.

Blocks are found by their markers, `<!-- sdk-example: NAME -->` right before a ```python fence.
"""

from __future__ import annotations

import ast
import os
import re
import uuid

import pytest

from ballast.client import Client
from tests.harness import ROOT, executor_plane, settings_env

DOC = ROOT / "docs" / "sdk.md"
MARKER = "<!-- sdk-example:"
BLOCK = re.compile(r"<!-- sdk-example: (?P<name>[\w-]+) -->\n```python\n(?P<code>.*?)```", re.S)
# The session's story: each must stay (a rename is an edit here too).
NAMES = ["connect", "submit-and-watch", "metrics", "cancel", "plan", "profiles", "fleet", "sql", "errors"]


def examples() -> list[tuple[str, str]]:
    text = DOC.read_text(encoding="utf-8")
    return [(m["name"], m["code"]) for m in BLOCK.finditer(text)]


def test_every_example_is_marked_parses_and_calls_what_the_client_has() -> None:
    found = examples()
    assert DOC.read_text(encoding="utf-8").count(MARKER) == len(found), "a marker not right before a ```python fence"
    assert [name for name, _ in found] == NAMES
    for name, code in found:
        tree = ast.parse(code, filename=f"docs/sdk.md:{name}")
        called = {node.attr for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "client"}
        assert not {attr for attr in called if not hasattr(Client, attr) and attr not in
                    ("store", "planner", "jobs", "fleet", "profiler")}, (name, called)


@pytest.mark.slow
def test_the_examples_run_in_order_against_a_real_plane(tmp_path, monkeypatch) -> None:
    with executor_plane(tmp_path / "plane", f"sdk-{uuid.uuid4().hex[:8]}") as plane:
        for key in [k for k in os.environ if k.startswith("BALLAST_")]:
            monkeypatch.delenv(key)
        for key, value in settings_env(plane.settings).items():
            monkeypatch.setenv(key, value)
        monkeypatch.chdir(ROOT)  # the examples name examples/… relative to the repository
        session: dict[str, object] = {}
        try:
            for name, code in examples():
                exec(compile(code, f"docs/sdk.md:{name}", "exec"), session)  # noqa: S102 - the docs are the test
        finally:
            client = session.get("client")
            if isinstance(client, Client):
                client.close()
        assert session["job"].state == session["job_pb2"].JOB_STATE_SUCCEEDED
        assert session["ended"].state == session["job_pb2"].JOB_STATE_CANCELLED
