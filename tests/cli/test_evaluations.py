"""`ballast evaluations JOB`: each validation loss beside the training loss of the iteration it followed."""

from __future__ import annotations

from ballast.cli.evaluations import rows
from ballast.v1 import job_pb2


def test_each_evaluation_meets_the_training_loss_of_the_iteration_it_followed():
    metrics = [job_pb2.IterationMetric(iteration=i, loss=5.0 - i, has_loss=True) for i in range(4)]
    metrics.append(job_pb2.IterationMetric(iteration=3, stage_index=0))  # a stage without the loss
    evaluations = [job_pb2.Evaluation(iteration=2, loss=4.5, perplexity=90.0, eval_s=0.1, samples=16),
                   job_pb2.Evaluation(iteration=6, loss=4.0, eval_s=0.1, samples=16)]
    got = rows(evaluations, metrics)
    assert [(r["iteration"], r["training_loss"], r["perplexity"]) for r in got] == [(2, 4.0, 90.0), (6, None, None)]
