"""Deprecated location of `mlxkv.testing.factory` (kept so `mlxkv.factory.build_model` still
works); import from `mlxkv.testing.factory` instead."""

import warnings

from mlxkv.testing.factory import ARCHITECTURES, build_model, build_scripted_model

warnings.warn(
    "mlxkv.factory moved to mlxkv.testing.factory; import it from there",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["ARCHITECTURES", "build_model", "build_scripted_model"]
