"""A job's data checked against its model before anything is stored (issue 40; services/data/check.py as the
profiler's Inspect runs it at Submit): what a token file, a saved dataset and a data factory hold, and every
refusal, naming the field and the fix."""

from __future__ import annotations

import textwrap

import datasets
import numpy as np
import pytest
import torch
from google.protobuf.json_format import ParseDict
from tokenizers import Tokenizer, models, pre_tokenizers

from ballast.v1 import job_pb2, model_pb2
from services.data.batches import batch_for, validation_batch_for
from services.data.check import inspect_data
from services.runtime.errors import InvalidArgument
from services.specs.user_inputs import UserInputs
from tests.user_model_support import hf_spec

SEQ, VOCAB = 16, 64
GPT = ParseDict({"name": "g", "family": "MODEL_FAMILY_GPT", "transformer": {
    "num_layers": 1, "hidden_size": 16, "num_heads": 2, "vocab_size": VOCAB, "seq_length": SEQ}},
    model_pb2.ModelSpec())


def tokens(path, count: int, dtype=np.uint16, largest: int = VOCAB - 1) -> str:
    """`count` token ids cycling through 0..largest."""
    (np.arange(count) % (largest + 1)).astype(dtype).tofile(path)
    return str(path)


def token_data(**fields) -> job_pb2.DataSpec:
    return ParseDict({"tokens": fields}, job_pb2.DataSpec())


@pytest.fixture
def roots(tmp_path) -> UserInputs:
    return UserInputs.of(data_roots=[str(tmp_path)], data_factories=["data_module:samples"],
                         path=[str(tmp_path)])


def test_a_token_file_and_its_held_out_file(tmp_path, roots):
    train, held = tokens(tmp_path / "train.bin", 10 * (SEQ + 1) + 5), tokens(tmp_path / "val.bin", 2 * (SEQ + 1))
    got = inspect_data(GPT, token_data(path=train, validation_path=held), roots)
    assert (got.source, got.train_samples, got.validation_samples, got.largest_token) == ("tokens", 10, 2, VOCAB - 1)
    assert list(got.fields) == ["input_ids", "labels"]
    wide = tokens(tmp_path / "wide.bin", 3 * (SEQ + 1), np.uint32)
    assert inspect_data(GPT, token_data(path=wide, dtype="TOKEN_DTYPE_UINT32"), roots).train_samples == 3
    assert inspect_data(GPT, job_pb2.DataSpec(), roots).source == "synthetic"


@pytest.mark.parametrize(("make", "field", "words", "fix"), [
    (lambda d: token_data(path="/etc/passwd"), "spec.data.tokens.path", "outside the data roots",
     "BALLAST_DATA_ROOTS"),
    (lambda d: token_data(path=str(d / "missing.bin")), "spec.data.tokens.path", "does not exist", "existing file"),
    (lambda d: token_data(path=tokens(d / "odd.bin", 10 * (SEQ + 1) + 1, np.uint8)), "spec.data.tokens.path",
     "not a whole number of 16-bit ids", "TOKEN_DTYPE_UINT32"),
    (lambda d: token_data(path=tokens(d / "big.bin", 5 * (SEQ + 1), largest=VOCAB + 6)), "spec.data.tokens.path",
     f"token id {VOCAB + 6} is not below the model's vocabulary of {VOCAB}", "vocabulary"),
    (lambda d: token_data(path=tokens(d / "short.bin", SEQ)), "spec.data.tokens.path",
     "fewer than one sample", f"at least {SEQ + 1} tokens"),
    (lambda d: token_data(path=tokens(d / "ok.bin", 3 * (SEQ + 1)),
                          validation_path=tokens(d / "bad.bin", 12 * (SEQ + 1), largest=199)),
     "spec.data.tokens.validation_path", "token id 199", "vocabulary"),
], ids=["outside-roots", "missing", "wrong-dtype", "token-past-vocab", "empty", "bad-validation"])
def test_a_bad_token_file_is_refused_naming_the_field_and_the_fix(tmp_path, roots, make, field, words, fix):
    with pytest.raises(InvalidArgument) as err:
        inspect_data(GPT, make(tmp_path), roots)
    assert (err.value.field, words in err.value.message, fix in (err.value.fix or "")) == (field, True, True), \
        err.value


def saved(tmp_path, rows: dict, splits: bool = True) -> str:
    table = datasets.Dataset.from_dict(rows)
    path = tmp_path / "dataset"
    (datasets.DatasetDict({"train": table, "validation": table.select([0])}) if splits else table).save_to_disk(path)
    return str(path)


def test_a_saved_dataset_of_token_ids_and_one_of_text_through_a_local_tokenizer(tmp_path, roots):
    path = saved(tmp_path, {"ids": [[1, 2, 3, 4], [5, 6], list(range(40))]})
    data = ParseDict({"hf_dataset": {"path": path, "column": "ids"}}, job_pb2.DataSpec())
    got = inspect_data(GPT, data, roots)
    assert (got.train_samples, got.validation_samples, got.largest_token) == (3, 1, 39)
    batch = batch_for(GPT, data, 0, 0, 0, 3, global_batch_size=3, user_inputs=roots)
    row = next(r for r in range(3) if batch["input_ids"][r, 0] == 5)  # the row [5, 6]: one label, padding after
    assert batch["labels"][row].tolist() == [6] + [-100] * (SEQ - 1)
    held = validation_batch_for(GPT, data, 0, 0, 0, 2, global_batch_size=2, user_inputs=roots)
    assert torch.equal(held["input_ids"][0], held["input_ids"][1])  # one validation row, drawn in order

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "bye": 3}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    text = saved(tmp_path / "text", {"text": ["hello world bye", "bye bye"]}, splits=False)
    data = ParseDict({"hf_dataset": {"path": text, "text_column": "text", "tokenizer_dir": str(tmp_path / "tok")}},
                     job_pb2.DataSpec())
    assert inspect_data(GPT, data, roots).train_samples == 2
    batch = batch_for(GPT, data, 0, 0, 0, 2, global_batch_size=2, user_inputs=roots)
    assert sorted(batch["input_ids"][:, :2].tolist()) == [[1, 2], [3, 0]]  # "bye bye": one input, then padding


@pytest.mark.parametrize(("hf", "field", "words"), [
    ({"column": "tokens"}, "spec.data.hf_dataset.column", "unknown column 'tokens'"),
    ({"column": "ids", "split": "test"}, "spec.data.hf_dataset.split", "no split 'test'"),
    ({"column": "ids", "text_column": "ids"}, "spec.data.hf_dataset.column", "either the column of token ids"),
    ({"text_column": "ids"}, "spec.data.hf_dataset.tokenizer_dir", "needs a tokenizer"),
])
def test_a_bad_dataset_spec_is_refused(tmp_path, roots, hf, field, words):
    data = ParseDict({"hf_dataset": {"path": saved(tmp_path, {"ids": [[1, 2]]}), **hf}}, job_pb2.DataSpec())
    with pytest.raises(InvalidArgument) as err:
        inspect_data(GPT, data, roots)
    assert err.value.field == field and words in err.value.message and err.value.fix


def test_an_empty_dataset_is_refused(tmp_path, roots):
    data = ParseDict({"hf_dataset": {"path": saved(tmp_path, {"ids": [[1]]}, splits=False), "column": "ids"}},
                     job_pb2.DataSpec())
    datasets.Dataset.from_dict({"ids": [[1]]}).filter(lambda row: False).save_to_disk(tmp_path / "empty")
    data.hf_dataset.path = str(tmp_path / "empty")
    with pytest.raises(InvalidArgument, match="is empty") as err:
        inspect_data(GPT, data, roots)
    assert err.value.field == "spec.data.hf_dataset.split"


FACTORY = '''
    import torch


    class Samples:
        def __init__(self, n, width):
            self.n, self.width = n, width

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"x": torch.randn(self.width, generator=g), "labels": torch.tensor(i % 3)}


    def samples(split, n=10, width=4):
        return Samples(n, width) if split == "train" else None
'''


def test_a_data_factory_feeds_a_users_model_and_is_refused_when_its_samples_do_not_fit(tmp_path, roots):
    from tests.user_model_support import user_model

    (tmp_path / "data_module.py").write_text(textwrap.dedent(FACTORY))
    spec, models_ = user_model(tmp_path / "models", name="factory_fed")
    inputs = UserInputs.of(models_.factories, [*models_.path, str(tmp_path)], ["data_module:samples"])
    spec.custom.kwargs.update({"features": 4})
    data = ParseDict({"factory": {"factory": "data_module:samples"}}, job_pb2.DataSpec())
    got = inspect_data(spec, data, inputs)
    assert (got.source, got.train_samples, got.validation_samples, list(got.fields)) == ("factory", 10, 0,
                                                                                          ["labels", "x"])
    batch = batch_for(spec, data, 0, 0, 0, 4, global_batch_size=4, user_inputs=inputs)
    assert batch["x"].shape == (4, 4) and batch["labels"].shape == (4,)
    data.factory.kwargs.update({"width": 5})  # the model's first layer takes 4 features
    with pytest.raises(InvalidArgument, match="failed on the factory's samples") as err:
        inspect_data(spec, data, inputs)
    assert err.value.field == "spec.data.factory.factory"
    with pytest.raises(InvalidArgument, match="is not allowed") as err:
        inspect_data(spec, data, UserInputs.of(models_.factories, models_.path))
    assert "BALLAST_ALLOWED_DATA_FACTORIES" in err.value.fix


def test_token_data_feeds_a_hugging_face_masked_lm_with_masks_drawn_per_sample(tmp_path, roots):
    spec = hf_spec("bert")  # vocabulary 64, 16 tokens a sample
    data = token_data(path=tokens(tmp_path / "t.bin", 8 * SEQ))
    assert inspect_data(spec, data, roots).fields == ["input_ids", "token_type_ids", "labels"]
    batch = batch_for(spec, data, 1, 0, 0, 8, global_batch_size=8, user_inputs=roots)
    masked = batch["labels"] != -100
    assert masked.any(1).all() and (batch["input_ids"][masked] == VOCAB - 1).all()
    with pytest.raises(InvalidArgument, match="next-token and masked-token models only"):
        inspect_data(hf_spec("vit"), data, roots)
