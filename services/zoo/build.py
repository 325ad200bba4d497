"""Spec -> model, parameter counts on the meta device, and deterministic synthetic batches."""

from __future__ import annotations

import torch
from torch import Tensor

from ballast.v1 import model_pb2
from services.runtime.errors import InvalidArgument
from services.specs.model import validate_model_spec
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs
from services.zoo.base import IGNORE_INDEX, ZooModel
from services.zoo.custom import CustomZooModel
from services.zoo.t5 import T5
from services.zoo.text import GPT, Bert
from services.zoo.vision import Swin, ViT, swin_geometry

F = model_pb2.ModelFamily
T = model_pb2.HFTask
FAMILIES: dict[int, type[ZooModel]] = {
    F.MODEL_FAMILY_GPT: GPT,
    F.MODEL_FAMILY_BERT: Bert,
    F.MODEL_FAMILY_T5: T5,
    F.MODEL_FAMILY_VIT: ViT,
    F.MODEL_FAMILY_SWIN: Swin,
}  # the built-in zoo; custom factories and Hugging Face models are built with the operator's UserInputs
MLM_FRACTION = 0.15


def causal_lm_shape(spec: model_pb2.ModelSpec, user_inputs: UserInputs = NO_USER_INPUTS) -> tuple[int, int] | None:
    """(vocab size, sequence length) of a next-token model (the zoo's GPT, a Hugging Face causal LM), else None:
    the data path draws token sequences for them."""
    if spec.family == F.MODEL_FAMILY_GPT:
        return spec.transformer.vocab_size, spec.transformer.seq_length
    if spec.family == F.MODEL_FAMILY_HF and spec.hf.task == T.HF_TASK_CAUSAL_LM:
        from services.zoo.hf.config import hf_shape

        return hf_shape(spec, user_inputs).vocab_size, spec.hf.seq_length
    return None


def check_spec(spec: model_pb2.ModelSpec, user_inputs: UserInputs = NO_USER_INPUTS) -> None:
    """The store's validation plus what only the zoo knows (Swin geometry); raises InvalidArgument."""
    validate_model_spec(spec, user_inputs)
    if spec.family != F.MODEL_FAMILY_SWIN:
        return
    cfg = spec.vision
    _, sides, window = swin_geometry(cfg)
    side = cfg.image_size // cfg.patch_size
    if side % (1 << (len(sides) - 1)):
        raise InvalidArgument(
            f"patch grid side {side} cannot be halved {len(sides) - 1} times",
            field="spec.vision.depths",
            fix="use fewer stages or a grid side divisible by 2^(stages-1)",
        )
    for s, stage_side in enumerate(sides):
        if stage_side > window and stage_side % window:
            raise InvalidArgument(
                f"stage {s} grid side {stage_side} is not a multiple of window {window}",
                field="spec.vision.window_size",
                fix="pick a window dividing every stage's grid side, e.g. 7 for 224 px and patch 4",
            )


def build_model(
    spec: model_pb2.ModelSpec,
    *,
    device: str | torch.device = "cpu",
    user_inputs: UserInputs = NO_USER_INPUTS,
    seed: int | None = None,
) -> ZooModel:
    """Build the spec's model in fp32 on `device` ("meta" allocates nothing).

    A custom factory is imported only if `user_inputs` (the operator's allow-list) admits it, from the import
    path plus the operator's model directories; a Hugging Face model reads its config and weights only from
    those directories. With `seed`, initialisation is reproducible (per device type) and leaves the global RNG
    untouched.
    """
    check_spec(spec, user_inputs)
    device = torch.device(device)
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked, enabled=seed is not None), device:
        if seed is not None:
            torch.manual_seed(seed)
        if spec.family == F.MODEL_FAMILY_CUSTOM:
            model: ZooModel = CustomZooModel(spec, user_inputs)
        elif spec.family == F.MODEL_FAMILY_HF:
            from services.zoo.hf.model import HuggingFace  # imports transformers: only for such a model

            model = HuggingFace(spec, user_inputs)
        else:
            model = FAMILIES[spec.family](spec)
    return model


def count_parameters(spec: model_pb2.ModelSpec, *, user_inputs: UserInputs = NO_USER_INPUTS) -> int:
    """Distinct parameters (a tied weight counts once), from a meta-device build: no memory used."""
    model = build_model(spec, device="meta", user_inputs=user_inputs)
    return sum(p.numel() for p in model.parameters())


def example_input(
    spec: model_pb2.ModelSpec,
    batch_size: int,
    *,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    user_inputs: UserInputs = NO_USER_INPUTS,
) -> dict[str, Tensor]:
    """A synthetic batch, drawn on the CPU from `generator` (default: seeded 0) so it is the same
    on every device. Keys match the layers' `batch_keys`."""
    check_spec(spec, user_inputs)
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    b = batch_size
    if spec.family == F.MODEL_FAMILY_CUSTOM:
        batch = build_model(spec, device="meta", user_inputs=user_inputs).example_input(b, g)
    elif spec.family == F.MODEL_FAMILY_HF:
        batch = _hf_batch(spec, b, g, user_inputs)
    elif spec.family in (F.MODEL_FAMILY_VIT, F.MODEL_FAMILY_SWIN):
        v = spec.vision
        batch = _image_batch(b, v.channels, v.image_size, v.num_classes, g)
    else:
        batch = _text_batch(spec.family, spec.transformer.vocab_size, spec.transformer.seq_length, b, g,
                            spec.transformer.decoder_seq_length)
    return {k: t.to(device) for k, t in batch.items()}


def _image_batch(b: int, channels: int, side: int, classes: int, g: torch.Generator) -> dict[str, Tensor]:
    return {"pixel_values": torch.randn(b, channels, side, side, generator=g),
            "labels": torch.randint(classes, (b,), generator=g)}


def _hf_batch(spec: model_pb2.ModelSpec, b: int, g: torch.Generator, user_inputs: UserInputs) -> dict[str, Tensor]:
    from services.zoo.hf.config import hf_shape  # imports transformers: only for such a model

    shape = hf_shape(spec, user_inputs)
    if spec.hf.task == T.HF_TASK_IMAGE_CLASSIFICATION:
        return _image_batch(b, shape.channels, shape.image_size, shape.num_labels, g)
    family = F.MODEL_FAMILY_GPT if spec.hf.task == T.HF_TASK_CAUSAL_LM else F.MODEL_FAMILY_BERT
    batch = _text_batch(family, shape.vocab_size, spec.hf.seq_length, b, g)
    if shape.type_vocab_size < 2 and "token_type_ids" in batch:
        batch["token_type_ids"].zero_()
    if family == F.MODEL_FAMILY_BERT:
        batch.pop("next_sentence_label")  # a masked-LM head only
    return batch


def _text_batch(family: int, vocab: int, s: int, b: int, g: torch.Generator,
                decoder_length: int = 0) -> dict[str, Tensor]:
    if family == F.MODEL_FAMILY_GPT:
        tokens = torch.randint(vocab, (b, s + 1), generator=g)
        return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    if family == F.MODEL_FAMILY_T5:
        labels = torch.randint(vocab, (b, decoder_length), generator=g)
        start = torch.zeros(b, 1, dtype=labels.dtype)  # decoder start token 0, as in T5
        return {
            "input_ids": torch.randint(vocab, (b, s), generator=g),
            "decoder_input_ids": torch.cat([start, labels[:, :-1]], 1),
            "labels": labels,
        }
    # BERT: ~15% of positions (at least the second) masked with the stand-in [MASK] id vocab - 1.
    tokens = torch.randint(vocab, (b, s), generator=g)
    masked = torch.rand(b, s, generator=g) < MLM_FRACTION
    masked[:, min(1, s - 1)] = True
    token_type_ids = torch.zeros(b, s, dtype=torch.long)
    token_type_ids[:, s // 2 :] = 1
    return {
        "input_ids": tokens.masked_fill(masked, vocab - 1),
        "token_type_ids": token_type_ids,
        "labels": tokens.masked_fill(~masked, IGNORE_INDEX),
        "next_sentence_label": torch.randint(2, (b,), generator=g),
    }
