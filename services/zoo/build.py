"""Spec -> model, parameter counts on the meta device, and deterministic synthetic batches."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from ballast.v1 import model_pb2
from services.runtime.errors import InvalidArgument
from services.specs.model import validate_model_spec
from services.zoo.base import IGNORE_INDEX, ZooModel
from services.zoo.custom import CustomZooModel
from services.zoo.t5 import T5
from services.zoo.text import GPT, Bert
from services.zoo.vision import Swin, ViT, swin_geometry

F = model_pb2.ModelFamily
FAMILIES: dict[int, type[ZooModel]] = {
    F.MODEL_FAMILY_GPT: GPT,
    F.MODEL_FAMILY_BERT: Bert,
    F.MODEL_FAMILY_T5: T5,
    F.MODEL_FAMILY_VIT: ViT,
    F.MODEL_FAMILY_SWIN: Swin,
    F.MODEL_FAMILY_CUSTOM: CustomZooModel,
}
MLM_FRACTION = 0.15


def check_spec(spec: model_pb2.ModelSpec, allowed_factories: Iterable[str] = ()) -> None:
    """The store's validation plus what only the zoo knows (Swin geometry); raises InvalidArgument."""
    validate_model_spec(spec, allowed_factories)
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
    allowed_factories: Iterable[str] = (),
    seed: int | None = None,
) -> ZooModel:
    """Build the spec's model in fp32 on `device` ("meta" allocates nothing).

    A custom factory is imported only if it is in `allowed_factories` (the operator's allow-list).
    With `seed`, initialisation is reproducible (per device type) and leaves the global RNG untouched.
    """
    check_spec(spec, allowed_factories)
    device = torch.device(device)
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked, enabled=seed is not None), device:
        if seed is not None:
            torch.manual_seed(seed)
        model = FAMILIES[spec.family](spec)
    return model


def count_parameters(spec: model_pb2.ModelSpec, *, allowed_factories: Iterable[str] = ()) -> int:
    """Distinct parameters (a tied weight counts once), from a meta-device build: no memory used."""
    model = build_model(spec, device="meta", allowed_factories=allowed_factories)
    return sum(p.numel() for p in model.parameters())


def example_input(
    spec: model_pb2.ModelSpec,
    batch_size: int,
    *,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    allowed_factories: Iterable[str] = (),
) -> dict[str, Tensor]:
    """A synthetic batch, drawn on the CPU from `generator` (default: seeded 0) so it is the same
    on every device. Keys match the layers' `batch_keys`."""
    check_spec(spec, allowed_factories)
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    b = batch_size
    if spec.family == F.MODEL_FAMILY_CUSTOM:
        batch = build_model(spec, device="meta", allowed_factories=allowed_factories).example_input(b, g)
    elif spec.family in (F.MODEL_FAMILY_VIT, F.MODEL_FAMILY_SWIN):
        v = spec.vision
        batch = {
            "pixel_values": torch.randn(b, v.channels, v.image_size, v.image_size, generator=g),
            "labels": torch.randint(v.num_classes, (b,), generator=g),
        }
    else:
        batch = _text_batch(spec.family, spec.transformer, b, g)
    return {k: t.to(device) for k, t in batch.items()}


def _text_batch(family: int, cfg: model_pb2.TransformerConfig, b: int, g: torch.Generator) -> dict[str, Tensor]:
    vocab, s = cfg.vocab_size, cfg.seq_length
    if family == F.MODEL_FAMILY_GPT:
        tokens = torch.randint(vocab, (b, s + 1), generator=g)
        return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    if family == F.MODEL_FAMILY_T5:
        labels = torch.randint(vocab, (b, cfg.decoder_seq_length), generator=g)
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
