"""What a new user of the command line meets first: a busy port, --version, help texts, other
tools' flags, the start-up banner and progress, serve's log lines, Hub errors and chat."""

from __future__ import annotations

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
