"""The operator's word on users' own models: which factories may be imported, and where their files may live.

A user's model is code (an allow-listed `pkg.module:callable`) or a Hugging Face directory (config.json,
safetensors weights). Both come from the directories the operator lists in BALLAST_MODEL_PATH: they are put on
the import path of every process that builds a model (the profiler's workers, the executors' workers), and a
Hugging Face config or weights directory is read only from inside one of them. The value is carried whole from
the settings to every builder (zoo.build_model, the profiler, the worker config) instead of each re-reading the
environment.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.runtime.errors import InvalidArgument

if TYPE_CHECKING:
    from ballast.config import Settings

ALLOWED_FACTORIES_FIX = "ask the platform operator to add it to BALLAST_ALLOWED_MODEL_FACTORIES"
MODEL_PATH_FIX = ("put it in a directory on the operator's BALLAST_MODEL_PATH (the same path on every host) and "
                  "give its absolute path")


@dataclass(frozen=True)
class UserModels:
    """Allow-listed factories ("pkg.module:callable") and the model directories (absolute, resolved)."""

    factories: tuple[str, ...] = ()
    path: tuple[str, ...] = ()

    @classmethod
    def of(cls, factories: Iterable[str] = (), path: Iterable[str] = ()) -> UserModels:
        return cls(tuple(factories), tuple(os.path.realpath(os.path.expanduser(p)) for p in path if p))

    @classmethod
    def of_settings(cls, settings: Settings) -> UserModels:
        return cls.of(settings.allowed_model_factories, settings.model_path)

    @classmethod
    def from_json(cls, raw: object) -> UserModels:
        """From the worker config's JSON object; ValueError naming the field when malformed."""
        if not isinstance(raw, dict) or set(raw) - {"factories", "path"}:
            raise ValueError("WorkerConfig.user_models: give {\"factories\": [...], \"path\": [...]}")
        values = {key: raw.get(key) or [] for key in ("factories", "path")}
        for key, items in values.items():
            if not isinstance(items, list | tuple) or not all(isinstance(v, str) for v in items):
                raise ValueError(f"WorkerConfig.user_models.{key}: give a list of strings")
        return cls.of(values["factories"], values["path"])

    def allows(self, factory: str) -> bool:
        return factory in self.factories

    def directory(self, value: str, field: str) -> str:
        """`value` resolved, if it lies inside one of the model directories; InvalidArgument naming `field`."""
        if not os.path.isabs(value):
            raise InvalidArgument(f"{value!r} is not an absolute path", field=field, fix=MODEL_PATH_FIX)
        if not self.path:
            raise InvalidArgument(f"{value!r}: this platform has no model directories (BALLAST_MODEL_PATH is empty)",
                                  field=field, fix="ask the platform operator to set BALLAST_MODEL_PATH, or give "
                                                   "the config inline")
        resolved = os.path.realpath(value)
        if not any(resolved == root or resolved.startswith(root.rstrip(os.sep) + os.sep) for root in self.path):
            raise InvalidArgument(f"{value!r} is outside the model directories {list(self.path)}", field=field,
                                  fix=MODEL_PATH_FIX)
        return resolved

    def importable(self) -> None:
        """Put the model directories on this process's import path (once each, after what is installed, so a user
        file can never shadow a library module): the user's module file need not be installed as a package."""
        added = [root for root in self.path if root not in sys.path]
        sys.path.extend(added)
        if added:
            importlib.invalidate_caches()


NO_USER_MODELS = UserModels()
