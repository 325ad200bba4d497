"""A job's samples (docs/data.md): where they come from (`sources`: the model's synthetic samples, a token file, a
saved Hugging Face dataset, an allow-listed factory), the order they are drawn in (`order`: every sample once per
epoch, reshuffled each epoch from the seed), the batches the layers read (`batches`), and the check a job's data
passes at Submit (`check`). Sample k of iteration i is a pure function of (data, seed, i * global_batch_size + k):
whoever draws it (any stage, replica or micro-batch split, a morphed or resumed run, the single-process
reference) gets the same tensors."""
