"""Evaluation's arithmetic, the same in every training mode: when it is due, and what it reports."""

from __future__ import annotations

import math
from typing import Any

from ballast.v1 import model_pb2
from services.data.sources import text_shape
from services.specs.user_inputs import UserInputs


def evaluation_due(config: Any, done: int) -> bool:
    """After every `eval_every` iterations and after the last (eval_every 0: never)."""
    every = int(config.eval_every)
    return every > 0 and (done % every == 0 or done == config.iterations)


def evaluation(loss_sum: float, labels: float, eval_s: float, samples: int, spec: model_pb2.ModelSpec,
               user_inputs: UserInputs) -> dict[str, Any]:
    """An "evaluation" event's fields: the mean loss per label, the perplexity for a language model (exp of the
    mean token loss; 0 for other models), the seconds it took and the samples and labels it read."""
    loss = loss_sum / max(labels, 1.0)
    language = text_shape(spec, user_inputs) is not None
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)) if language else 0.0, "eval_s": eval_s,
            "samples": samples, "labels": int(labels)}
