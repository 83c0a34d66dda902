"""GGUF files (llama.cpp's format): checked, then converted once into an mlx-lm directory."""

from mlxkv.models.gguf.convert import (
    ProgressCallback,
    convert_gguf,
    converted_dir,
    drop_conversion,
)

__all__ = ["ProgressCallback", "convert_gguf", "converted_dir", "drop_conversion"]
