"""A user's own model through the real services (store, profiler, planner on loopback, TLS; issue 39): the
operator's allow-list and model directory; a model that breaks a rule refused at Submit with the rule and the
fix and nothing written; a name reused for a changed spec stored as its next version; `ballast inspect`, spec
file typos and `ballast cancel` as a new user meets them."""

from __future__ import annotations

import textwrap
from pathlib import Path

import grpc
import pytest

from ballast.errors import CallFailed
from ballast.v1 import job_pb2, model_pb2
from tests.harness import ROOT, in_process_cli, make_settings, start_plane

FACTORY = "users_net:build"  # the operator allows this one; its module lives in the model directory below
NET = '''
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self, width, hidden):
            super().__init__()
            self.embed = nn.Linear(4, width)
            self.body = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear({hidden_in}, width))
            self.out = nn.Linear(width, 3)

        def example_input(self, batch_size, generator):
            return {{"x": torch.randn(batch_size, 4, generator=generator),
                     "labels": torch.randint(3, (batch_size,), generator=generator)}}


    def build(width=8, hidden=16):
        return Net(width, hidden)


    def broken(width=8, hidden=16):
        return Net(width, hidden)
'''


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    models = tmp_path_factory.mktemp("operator-models")
    (models / "users_net.py").write_text(textwrap.dedent(NET.format(hidden_in="hidden")))
    (models / "users_broken.py").write_text(textwrap.dedent(NET.format(hidden_in="hidden + 1")))
    settings = make_settings(tmp_path_factory.mktemp("user-models"), model_path=(str(models),),
                             allowed_model_factories=(FACTORY, "users_broken:broken"))
    plane = start_plane(settings, send=lambda request_id: None)  # no worker: a submitted job stays SUBMITTED
    yield plane
    plane.stop()


def custom(name: str, factory: str = FACTORY, **kwargs: int) -> model_pb2.ModelSpec:
    spec = model_pb2.ModelSpec(name=name, family=model_pb2.MODEL_FAMILY_CUSTOM,
                               custom=model_pb2.CustomModel(factory=factory, cut_points=["embed"]))
    spec.custom.kwargs.update(kwargs)
    return spec


def submit(plane, model: model_pb2.ModelSpec) -> job_pb2.Job:
    with plane.client() as client:
        return client.submit(job_pb2.JobSpec(name=f"train-{model.name}", model=model, global_batch_size=4,
                                             iterations=2))


def hf(name: str, **fields) -> model_pb2.ModelSpec:
    spec = model_pb2.ModelSpec(name=name, family=model_pb2.MODEL_FAMILY_HF, hf=model_pb2.HuggingFaceModel(
        task=model_pb2.HF_TASK_CAUSAL_LM, seq_length=8, **fields.get("hf", {})))
    spec.hf.config.update(fields.get("config", {}))
    return spec


def counts(plane) -> tuple[int, ...]:
    with plane.client() as client:
        rows = client.sql("SELECT (SELECT count(*) FROM models), (SELECT count(*) FROM jobs), "
                          "(SELECT count(*) FROM queued_requests)").rows
    return tuple(int(v) for v in rows[0])


@pytest.mark.parametrize(("model", "field", "words", "fix"), [
    (custom("broken", "users_broken:broken"), "spec.model.custom.factory",
     "failed at child 'body' (on the output of 'embed')", "registration order"),
    (custom("not-allowed", "users_net:other"), "spec.model.custom.factory", "is not allowed",
     "BALLAST_ALLOWED_MODEL_FACTORIES"),
    (hf("t5", config={"model_type": "t5"}), "spec.model.hf.config.model_type", "no Ballast adapter",
     "wrap the model in an allow-listed factory"),
    (hf("outside", hf={"config_dir": "/etc"}), "spec.model.hf.config_dir", "outside the model directories",
     "BALLAST_MODEL_PATH"),
], ids=["children-do-not-chain", "not-allowed", "no-adapter", "outside-model-path"])
def test_a_model_that_breaks_a_rule_is_refused_at_submit_and_nothing_is_written(plane, model, field, words, fix):
    before = counts(plane)
    with pytest.raises(CallFailed) as err:
        submit(plane, model)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.field, words in err.value.message, fix in (err.value.fix or "")) == (field, True, True), \
        err.value
    assert counts(plane) == before


def test_a_name_resubmitted_with_another_spec_is_its_next_version(plane):
    first = submit(plane, custom("my-net", width=8))
    again = submit(plane, custom("my-net", width=12))  # the user changed the model: never a dead end
    same = submit(plane, custom("my-net", width=12))
    with plane.client() as client:
        rows = client.sql("SELECT id, version FROM models WHERE name = 'my-net' ORDER BY version").rows
    assert [row[1] for row in rows] == [1, 2]
    assert (first.model_id, again.model_id, same.model_id) == (rows[0][0], rows[1][0], rows[1][0])
    assert first.state == again.state == job_pb2.JOB_STATE_SUBMITTED


@pytest.fixture
def ballast(plane, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    return in_process_cli(plane.settings, monkeypatch, capsys)


def test_inspect_a_typo_a_missing_file_and_cancel_as_a_new_user_meets_them(ballast, tmp_path: Path):
    spec = tmp_path / "net.yaml"
    spec.write_text(f"name: cli-net\nfamily: MODEL_FAMILY_CUSTOM\ncustom:\n  factory: {FACTORY}\n"
                    "  cut_points: [embed, body]\n")
    code, out, _ = ballast("inspect", str(spec))
    flat = " ".join(out.split())
    assert code == 0 and "3 layers, 347 parameters" in flat and "keeps Ballast's rules" in flat
    assert all(name in out for name in ("embed", "body", "out"))
    spec.write_text(spec.read_text().replace("cut_points", "cut_point"))
    code, _, err = ballast("submit", str(spec))
    flat = " ".join(err.split())
    assert code == 2 and "custom.cut_point:" in flat and "net.yaml: unknown field 'cut_point'" in flat
    assert "did you mean 'cut_points'?" in flat and "Traceback" not in err
    code, _, err = ballast("submit", str(tmp_path / "nope.yaml"))
    assert code == 2 and "cannot read" in err and "Traceback" not in err
    code, out, _ = ballast("submit", "examples/gpt-tiny.yaml", "--batch", "4", "--iterations", "3")
    job = out.split()[1]
    code, out, _ = ballast("cancel", job, "--reason", "changed my mind")
    assert code == 0 and f"job {job} CANCELLED" in out
    code, _, err = ballast("cancel", "job-nope")
    assert code == 1 and "NOT_FOUND" in err


def test_data_that_cannot_feed_the_model_is_refused_at_submit_on_both_databases(empty_database_url, tmp_path):
    """Issue 40: the job's data is read at Submit (the profiler's Inspect, in a worker process) and refused with
    the field and the fix before anything is stored, whichever database the store is on."""
    import datasets
    import numpy as np

    data_root = tmp_path / "data"
    data_root.mkdir()
    (np.arange(400) % 300).astype(np.uint16).tofile(data_root / "wide.bin")  # ids up to 299: past gpt's 256
    datasets.Dataset.from_dict({"ids": [[1, 2, 3]]}).save_to_disk(data_root / "rows")
    settings = make_settings(tmp_path / "plane", database_url=empty_database_url, data_roots=(str(data_root),))
    plane = start_plane(settings, send=lambda request_id: None)
    gpt = model_pb2.ModelSpec(name="tiny", family=model_pb2.MODEL_FAMILY_GPT, transformer=model_pb2.TransformerConfig(
        num_layers=1, hidden_size=16, num_heads=2, vocab_size=256, seq_length=8))
    cases = [
        (job_pb2.DataSpec(tokens=job_pb2.TokenFile(path="/etc/passwd")), "spec.data.tokens.path", "outside"),
        (job_pb2.DataSpec(tokens=job_pb2.TokenFile(path=str(data_root / "wide.bin"))), "spec.data.tokens.path",
         "token id 299 is not below the model's vocabulary of 256"),
        (job_pb2.DataSpec(hf_dataset=job_pb2.HFDataset(path=str(data_root / "rows"), column="tokens")),
         "spec.data.hf_dataset.column", "unknown column 'tokens'"),
    ]
    try:
        with plane.client() as client:
            for data, field, words in cases:
                with pytest.raises(CallFailed) as err:
                    client.submit(job_pb2.JobSpec(name="bad-data", model=gpt, global_batch_size=2, iterations=2,
                                                  data=data))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (err.value.field, words in err.value.message) == (field, True), err.value
            rows = client.sql("SELECT (SELECT count(*) FROM models), (SELECT count(*) FROM jobs)").rows
            assert [int(v) for v in rows[0]] == [0, 0]  # nothing written
    finally:
        plane.stop()
