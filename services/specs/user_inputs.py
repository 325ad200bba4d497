"""The operator's word on what users bring: their models' and datasets' code, and where their files may live.

A user's model is code (an allow-listed `pkg.module:callable`) or a Hugging Face directory (config.json,
safetensors weights), both from the directories the operator lists in BALLAST_MODEL_PATH: they are put on the
import path of every process that builds a model (the profiler's workers, the executors' workers), and a Hugging
Face config or weights directory is read only from inside one of them. A user's data is a file or a saved dataset
under the operator's BALLAST_DATA_ROOTS, or an allow-listed data factory (BALLAST_ALLOWED_DATA_FACTORIES, its
module found like a model factory's). The value is carried whole from the settings to every process that reads
them (zoo.build_model, the profiler, the worker config) instead of each re-reading the environment.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from services.runtime.errors import InvalidArgument

if TYPE_CHECKING:
    from ballast.config import Settings

_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
FACTORY_RE = re.compile(rf"^{_DOTTED}:{_DOTTED}$")  # "pkg.module:callable", a model's or a data factory's
FACTORY_FIX = 'use the form "pkg.module:callable"'
ALLOWED_FACTORIES_FIX = "ask the platform operator to add it to BALLAST_ALLOWED_MODEL_FACTORIES"
ALLOWED_DATA_FACTORIES_FIX = "ask the platform operator to add it to BALLAST_ALLOWED_DATA_FACTORIES"
MODEL_PATH_FIX = ("put it in a directory on the operator's BALLAST_MODEL_PATH (the same path on every host) and "
                  "give its absolute path")
DATA_ROOTS_FIX = ("put it under one of the operator's BALLAST_DATA_ROOTS (the same path on every host) and give "
                  "its absolute path")


@dataclass(frozen=True)
class UserInputs:
    """Allow-listed model and data factories ("pkg.module:callable"), the model directories and the data roots
    (absolute, resolved)."""

    factories: tuple[str, ...] = ()
    path: tuple[str, ...] = ()
    data_factories: tuple[str, ...] = ()
    data_roots: tuple[str, ...] = ()

    @classmethod
    def of(cls, factories: Iterable[str] = (), path: Iterable[str] = (), data_factories: Iterable[str] = (),
           data_roots: Iterable[str] = ()) -> UserInputs:
        return cls(tuple(factories), resolved(path), tuple(data_factories), resolved(data_roots))

    @classmethod
    def of_settings(cls, settings: Settings) -> UserInputs:
        return cls.of(settings.allowed_model_factories, settings.model_path, settings.allowed_data_factories,
                      settings.data_roots)

    def to_json(self) -> dict[str, list[str]]:
        return {f.name: list(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_json(cls, raw: object) -> UserInputs:
        """From the worker config's JSON object; ValueError naming the field when malformed."""
        known = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or set(raw) - known:
            raise ValueError(f"WorkerConfig.user_inputs: give an object with lists of strings under {sorted(known)}")
        values = {key: raw.get(key) or [] for key in known}
        for key, items in values.items():
            if not isinstance(items, list | tuple) or not all(isinstance(v, str) for v in items):
                raise ValueError(f"WorkerConfig.user_inputs.{key}: give a list of strings")
        return cls.of(**values)

    def allows(self, factory: str) -> bool:
        return factory in self.factories

    def allows_data(self, factory: str) -> bool:
        return factory in self.data_factories

    def directory(self, value: str, field: str) -> str:
        """`value` resolved, if it lies inside one of the model directories; InvalidArgument naming `field`."""
        return inside(value, self.path, field, "model directories", "BALLAST_MODEL_PATH", MODEL_PATH_FIX,
                      "or give the config inline")

    def data_path(self, value: str, field: str) -> str:
        """`value` resolved, if it lies under one of the data roots; InvalidArgument naming `field`."""
        return inside(value, self.data_roots, field, "data roots", "BALLAST_DATA_ROOTS", DATA_ROOTS_FIX,
                      "or train on the model's synthetic samples")

    def importable(self) -> None:
        """Put the model directories on this process's import path (once each, after what is installed, so a user
        file can never shadow a library module): the user's module file need not be installed as a package."""
        added = [root for root in self.path if root not in sys.path]
        sys.path.extend(added)
        if added:
            importlib.invalidate_caches()


def resolved(paths: Iterable[str]) -> tuple[str, ...]:
    return tuple(os.path.realpath(os.path.expanduser(p)) for p in paths if p)


def inside(value: str, roots: tuple[str, ...], field: str, what: str, setting: str, fix: str, otherwise: str) -> str:
    """`value` resolved (symbolic links followed) if it lies in one of `roots`, else InvalidArgument."""
    if not os.path.isabs(value):
        raise InvalidArgument(f"{value!r} is not an absolute path", field=field, fix=fix)
    if not roots:
        raise InvalidArgument(f"{value!r}: this platform has no {what} ({setting} is empty)", field=field,
                              fix=f"ask the platform operator to set {setting}, {otherwise}")
    real = os.path.realpath(value)
    if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots):
        raise InvalidArgument(f"{value!r} is outside the {what} {list(roots)}", field=field, fix=fix)
    return real


NO_USER_INPUTS = UserInputs()
