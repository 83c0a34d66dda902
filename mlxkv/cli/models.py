"""The `convert` and `info` commands: a GGUF file to a model directory, and what a model is."""

from __future__ import annotations

import argparse

from mlxkv.cli.common import progress_bar


def convert_command(args: argparse.Namespace) -> int:
    from mlxkv.models.gguf.convert import convert_gguf

    out = convert_gguf(args.gguf, args.out_dir, progress=progress_bar("converting (tensors)"))
    print(out)
    return 0


def info_command(args: argparse.Namespace) -> int:
    from mlxkv.models.inspect import describe
    from mlxkv.models.loading import load_model

    loaded = load_model(args.model, progress=progress_bar("converting GGUF (tensors)"))
    for key, value in describe(loaded).items():
        print(f"{key}: {value}")
    return 0
