"""`ballast inspect SPEC.yaml`: what Ballast makes of a model before it is submitted: the rule it breaks and the
fix, or the layers it is cut into (what a pipeline stage holds, what splits tensor-parallel, what is tied)."""

from __future__ import annotations

import argparse
import json

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.table import Table

from ballast.cli.jobs import data_of
from ballast.cli.options import refused
from ballast.client import Client
from ballast.config import Settings

console = Console()


def run(settings: Settings, args: argparse.Namespace) -> int:
    with Client.of(settings) as client:
        try:
            both = client.inspect(args.spec, data_of(args))
        except grpc.RpcError as exc:
            return refused(exc)
    if args.json:
        print(json.dumps(MessageToDict(both, preserving_proto_field_name=True)))
        return 0
    inspection, data = both.model, both.data
    table = Table("#", "layer", "kind", "parameters", "tp ways", "sp ways", "tied to", "reads", "output (batch 2)")
    for layer in inspection.layers:
        reads = [f"#{i}" for i in layer.inputs] + list(layer.batch_keys)
        table.add_row(str(layer.index), layer.name, layer.kind, f"{layer.parameter_count:,}",
                      str(layer.tensor_parallel or "-"), str(layer.sequence_parallel or "-"),
                      ", ".join(f"#{i}" for i in layer.tied_with) or "-",
                      ", ".join(reads), "loss" if not layer.output_shape else "x".join(map(str, layer.output_shape)))
    console.print(table)
    console.print("tp ways: tensor-parallel degrees dividing it can split the layer (- : DP or SDP only); sp ways: "
                  "those dividing it can also split its sequence (sequence parallelism)")
    code = f"; built by {inspection.code_version}" if inspection.code_version else ""
    console.print(f"{len(inspection.layers)} layers, {inspection.parameter_count:,} parameters{code}: "
                  "the model keeps Ballast's rules (docs/models.md)")
    if data.source != "synthetic":
        held = f", {data.validation_samples:,} held out" if data.validation_samples else ", none held out"
        top = f"; token ids up to {data.largest_token:,}" if data.largest_token else ""
        console.print(f"data ({data.source}): {data.train_samples:,} samples an epoch{held}{top}; each sample "
                      f"holds {', '.join(data.fields)}")
    return 0
