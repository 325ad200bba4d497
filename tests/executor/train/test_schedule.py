"""Training runtime, pure parts: micro-batch schedules and the worker config (no processes, no model)."""

from __future__ import annotations

import json

import pytest
from google.protobuf.json_format import MessageToDict

from ballast.v1 import model_pb2
from services.executor.train.config import WorkerConfig
from services.executor.train.schedule import max_in_flight, tasks

CASES = [(stages, stage, nm) for stages in range(1, 5) for stage in range(stages) for nm in range(1, 7)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_every_micro_batch_runs_forward_then_backward_once(schedule):
    for stages, stage, nm in CASES:
        order = tasks(schedule, stages, stage, nm)
        assert sorted(order) == sorted([("F", j) for j in range(nm)] + [("B", j) for j in range(nm)])
        for j in range(nm):
            assert order.index(("F", j)) < order.index(("B", j))
        assert [j for kind, j in order if kind == "F"] == list(range(nm))  # forwards in micro-batch order


def test_1f1b_bounds_in_flight_micro_batches():
    for stages, stage, nm in CASES:
        order = tasks("1f1b", stages, stage, nm)
        assert max_in_flight(order) == min(stages - stage, nm)
        assert max_in_flight(tasks("gpipe", stages, stage, nm)) == nm


def test_1f1b_shape_and_gpipe_reverse_backwards():
    assert tasks("1f1b", 4, 0, 5) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                      ("B", 2), ("B", 3), ("B", 4)]
    assert tasks("1f1b", 4, 3, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert tasks("1f1b", 4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # warm-up capped at nm
    assert tasks("gpipe", 2, 0, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]


def test_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="schedule"):
        tasks("zigzag", 2, 0, 2)
    with pytest.raises(ValueError, match="stage"):
        tasks("1f1b", 2, 2, 2)


def config(**changes) -> WorkerConfig:
    spec = model_pb2.ModelSpec(name="g", family=model_pb2.MODEL_FAMILY_GPT, transformer=model_pb2.TransformerConfig(
        num_layers=2, hidden_size=16, num_heads=2, vocab_size=32, seq_length=8))
    base = dict(job_id="job-1", model=MessageToDict(spec, preserving_proto_field_name=True),
                stage_bounds=[[0, 2], [2, 4]], num_replicas=2, stage_index=1, replica_index=1, rank=3, world_size=4,
                micro_batch_size=2, num_micro_batches=3, iterations=5, init_method="tcp://127.0.0.1:1")
    return WorkerConfig(**{**base, **changes})


def test_config_round_trips_as_plain_json():
    c = config(checkpoint_layers=[1], optimizer={"name": "sgd", "learning_rate": 0.1, "weight_decay": 0.0})
    text = c.to_json()
    assert json.loads(text)["stage_bounds"] == [[0, 2], [2, 4]]
    again = WorkerConfig.from_json(text)
    assert again == c
    assert again.spec().transformer.num_layers == 2
    assert again.global_batch_size == 2 * 3 * 2 and again.num_stages == 2 and again.bounds == (2, 4)


def test_config_rank_layout_is_the_dims_one():
    c = config()
    assert (c.dims.pp, c.dims.dp) == (2, 2) and c.dims.rank(pp=1, dp=0) == 2


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"rank": 2}, "rank"),
        ({"stage_bounds": [[0, 2], [3, 4]]}, "stage_bounds"),
        ({"world_size": 3}, "world_size"),
        ({"schedule": "zigzag"}, "schedule"),
        ({"optimizer": {"name": "lamb", "learning_rate": 1.0}}, "optimizer.name"),
        ({"data": {"tokens": {"dtype": "TOKEN_DTYPE_INT8"}}}, "data"),
        ({"checkpoint_every": 2}, "checkpoint_dir"),
        ({"backend": "nccl"}, "device"),
    ],
)
def test_config_errors_name_the_field(changes, field):
    with pytest.raises(ValueError, match=f"WorkerConfig.{field}"):
        config(**changes).validate()


def test_unknown_fields_are_refused():
    raw = json.loads(config().to_json()) | {"pickle": "no"}
    with pytest.raises(ValueError, match="unknown fields"):
        WorkerConfig.from_json(json.dumps(raw))
    raw = json.loads(config().to_json())
    del raw["init_method"]
    with pytest.raises(ValueError, match=r"missing required fields \['init_method'\]"):
        WorkerConfig.from_json(json.dumps(raw))
