"""Hugging Face transformers models as zoo models (MODEL_FAMILY_HF). Importing this package imports transformers
(seconds): the zoo does so only when a spec asks for a Hugging Face model. Nothing is ever fetched from a hub:
HF_HUB_OFFLINE is set here, before any module of the package imports transformers."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
