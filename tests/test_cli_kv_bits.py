"""`--kv-bits` is one option, defined once, that every command running a model takes alike:
4 or 8 (the quantized K/V layer's widths), any other width refused by argparse by name."""

from __future__ import annotations

import argparse

import pytest

from mlxkv.cli.parser import build_parser

# each command with the arguments it requires
COMMANDS = {"generate": ["generate", "-p", "Hi"], "chat": ["chat"], "serve": ["serve"]}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("bits", [4, 8])
def test_each_command_takes_4_and_8(command, bits):
    argv = COMMANDS[command]
    assert build_parser().parse_args([*argv, "--kv-bits", str(bits)]).kv_bits == bits
    assert build_parser().parse_args(argv).kv_bits is None


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_refuses_another_width_alike(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*COMMANDS[command], "--kv-bits", "3"])
    assert "--kv-bits: invalid choice: 3 (choose from 4, 8)" in capsys.readouterr().err


def test_each_command_shows_the_same_help():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {
        name: next(a.help for a in commands.choices[name]._actions if a.dest == "kv_bits")
        for name in COMMANDS
    }
    assert len(set(helps.values())) == 1
