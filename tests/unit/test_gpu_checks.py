"""bench/gpu_checks.sh is run on a lent GPU machine, whose minutes are few: every bench
command in it must be one its script accepts. Each command line is parsed by its script's own
argument parser here (the script stopped right after), with the shell's defaults put in."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_checks.sh"


class Parsed(Exception):
    """Raised in place of the script's work once its arguments parsed."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__()
        self.namespace = namespace


def bench_commands() -> list[list[str]]:
    """Each bench script's command line in gpu_checks.sh (``bench/NAME.py`` and what follows
    it), continuation lines joined, ``${N:-default}`` as its default and ``$OUT`` a folder."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        line = re.sub(r"\$\{\d+:-([^}]*)\}", r"\1", line.split("#", 1)[0]).replace("$OUT", "/tmp/out")
        words = shlex.split(line) if "bench/" in line and ".py" in line else []
        start = next((i for i, word in enumerate(words) if re.fullmatch(r"bench/\w+\.py", word)), None)
        if start is not None:
            commands.append(words[start:])
    return commands


def test_the_script_runs_the_benches_it_names():
    commands = bench_commands()
    assert len(commands) >= 8
    for script, *_ in commands:
        assert (ROOT / script).is_file(), script


@pytest.mark.parametrize("command", bench_commands(), ids=lambda c: " ".join(c)[:80])
def test_each_bench_command_parses(command, monkeypatch):
    parse = argparse.ArgumentParser.parse_args

    def parsed(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parsed)
    monkeypatch.setattr(sys, "argv", [str(ROOT / command[0]), *command[1:]])
    monkeypatch.setattr(sys, "path", [str(ROOT / "bench"), *sys.path])
    with pytest.raises(Parsed) as found:
        runpy.run_path(str(ROOT / command[0]), run_name="__main__")
    given = {word.lstrip("-").replace("-", "_") for word in command[1:] if word.startswith("--")}
    assert given <= set(vars(found.value.namespace)), command
