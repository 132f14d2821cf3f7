"""What a new user of the command line meets first: a busy port, --version, help texts, other
tools' flags, the start-up banner and progress, serve's log lines, Hub errors and chat."""

from __future__ import annotations

import re
import socket

import pytest

from jaxllm.cli import main


def test_serve_on_a_busy_port_fails_before_loading_the_model(capsys):
    from jaxllm.cli.serve import main as serve_main

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        # The model does not exist either: the port is checked first, so that is not what is reported.
        assert serve_main(["--model", "/nonexistent/model.gguf", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], err
    assert "GGUF" not in err


def test_version(capsys):
    from pathlib import Path

    import tomllib

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert capsys.readouterr().out.strip() == f"jaxllm {pyproject['project']['version']}"


def option_entries(help_text: str) -> list[str]:
    """The help text of each option: its `  -x, --xx ...` line and the indented lines under it."""
    entries: list[str] = []
    for line in help_text.splitlines():
        if re.match(r" {2}-", line):
            entries.append(line)
        elif entries and line.startswith("   ") and not line.strip().startswith("-"):
            entries[-1] += " " + line.strip()
        else:
            entries.append("")
    return [entry for entry in entries if entry]


def every_help_command() -> list[list[str]]:
    from jaxllm.cli.bench import BENCHMARKS

    commands = [["chat"], ["generate"], ["serve"], ["worker"], ["convert"]]
    commands += [["eplb", "report"], ["eplb", "generate-config"]]
    return commands + [["bench", name] for name in BENCHMARKS]


@pytest.mark.parametrize("command", every_help_command(), ids=" ".join)
def test_no_option_names_two_defaults(capsys, command):
    try:
        code = main([*command, "--help"])
    except SystemExit as exit_info:
        code = exit_info.code
    assert code in (0, None)
    text = capsys.readouterr().out
    entries = option_entries(text)
    assert entries, text
    for entry in entries:
        assert entry.lower().count("default") <= 1, entry


def test_chat_max_seq_len_help_shows_the_default_chat_sets(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    text = capsys.readouterr().out
    entry = next(e for e in option_entries(text) if e.lstrip().startswith("--max-seq-len"))
    assert "(default: 2048)" in entry and "unset" not in entry
