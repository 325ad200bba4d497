"""`ballast demo`: the newcomer's first run. Today: up, store a model, read it back with SQL, down.
Later issues extend it into profiling, planning and real training."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml
from google.protobuf.json_format import MessageToDict, ParseDict
from rich.console import Console

from ballast.client import Client
from ballast.config import Settings, load_settings
from ballast.v1 import model_pb2, store_pb2

console = Console()


def default_model_path() -> Path:
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = base / "examples" / "gpt-tiny.yaml"
        if candidate.exists():
            return candidate
    raise FileNotFoundError("examples/gpt-tiny.yaml not found; pass --model PATH")


def load_model_spec(path: Path) -> model_pb2.ModelSpec:
    """A ModelSpec from YAML (field names as in the proto; enums by name)."""
    return ParseDict(yaml.safe_load(path.read_text()), model_pb2.ModelSpec())


def run_demo(settings: Settings, args: argparse.Namespace) -> int:
    from ballast.cli import control_plane as cp

    if args.data_dir is None:
        settings = load_settings(data_dir=Path(tempfile.mkdtemp(prefix="ballast-demo-")))
    spec = load_model_spec(args.model or default_model_path())
    console.rule("1. bring the control plane up")
    ok, rows, message = cp.bring_up(settings, args.executors, 90.0)
    for name, address, status in rows:
        console.print(f"  {name:<12} {address:<18} {status}")
    if not ok:
        console.print(f"[red]{message}[/red]")
        return 1
    state = cp.State.load(settings)
    try:
        with Client(store=settings.address("store"), token=settings.resolved_token()) as client:
            console.rule("2. store the model")
            model = client.store.CreateModel(store_pb2.CreateModelRequest(spec=spec))
            console.print_json(json.dumps(MessageToDict(model, preserving_proto_field_name=True)))
            console.rule("3. read it back with SQL")
            query = f"SELECT id, name, family, signature FROM models WHERE id = '{model.id}'"
            console.print(f"  ballast sql \"{query}\"")
            reply = client.store.Query(store_pb2.QueryRequest(sql=query))
            rows = [MessageToDict(r) for r in reply.rows]
            for row in rows:
                console.print("  " + " | ".join(str(v) for v in row))
            if not rows or rows[0][0] != model.id:
                console.print("[red]model not found by SQL[/red]")
                return 1
    finally:
        console.rule("4. shut down")
        killed = cp.stop_all(settings, state)
        console.print(f"  stopped {len(state.children)} processes" + (f" (force-killed {killed})" if killed else ""))
    return 0
