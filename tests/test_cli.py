"""The command line: help with defaults and known aliases, --config YAML, one-line load
errors, and chat / generate end to end on the tiny-moe preset."""

from __future__ import annotations

import io
import json

import pytest

from jaxllm.cli import build_parser, main
from jaxllm.cli.args import engine_kwargs
from jaxllm.cli.bench import BENCHMARK_HELP

SMALL = [
    "--model",
    "tiny-moe",
    "--max-num-tokens",
    "16",
    "--max-seq-len",
    "128",
    "--max-batch-size",
    "2",
    "--kv-cache-max-tokens",
    "512",
    "--tokens-per-block",
    "8",
]


def test_help_shows_defaults_and_the_aliases_users_know(capsys):
    from jaxllm.cli.serve import build_parser as serve_parser

    for argv in (["chat", "--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        text = capsys.readouterr().out
        assert "(default: smollm2)" in text and "(default: auto)" in text
        for alias in (
            "--max-model-len",
            "--max-num-seqs",
            "--max-num-batched-tokens",
            "--gpu-memory-utilization",
            "--kv_cache_free_gpu_memory_fraction",
            "--extra_llm_api_options",
            "--tokenizer",
            "--revision",
        ):
            assert alias in text, alias
    serve_help = serve_parser().format_help()
    assert "(default: 8000)" in serve_help and "--max-model-len" in serve_help


def test_bench_help_describes_every_benchmark(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for name, description in BENCHMARK_HELP.items():
        assert name in out and description.split()[0] in out
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_aliases_and_config_file(tmp_path):
    args = build_parser().parse_args(
        [
            "generate",
            "--max-model-len",
            "300",
            "--max-num-seqs",
            "3",
            "--max-num-batched-tokens",
            "64",
            "--gpu-memory-utilization",
            "0.5",
        ]
    )
    kwargs = engine_kwargs(args)
    assert (kwargs["max_seq_len"], kwargs["max_batch_size"], kwargs["max_num_tokens"]) == (300, 3, 64)
    assert kwargs["kv_cache_config"].free_gpu_memory_fraction == 0.5
    args = build_parser().parse_args(["generate", "--kv_cache_free_gpu_memory_fraction", "0.25"])
    assert engine_kwargs(args)["kv_cache_config"].free_gpu_memory_fraction == 0.25

    config = tmp_path / "llm.yaml"
    config.write_text(
        "max_batch_size: 7\nkv_cache_config:\n  enable_block_reuse: false\n  tokens_per_block: 16\n"
        "scheduler_config:\n  capacity_scheduler_policy: MAX_UTILIZATION\n"
    )
    args = build_parser().parse_args(["chat", "--max-num-seqs", "3", "--config", str(config)])
    kwargs = engine_kwargs(args)
    assert kwargs["max_batch_size"] == 7  # the file overrides the flags, as --extra_llm_api_options does
    assert kwargs["kv_cache_config"].enable_block_reuse is False and kwargs["kv_cache_config"].tokens_per_block == 16
    config.write_text("max_batch_size: 7\nno_such_field: 1\n")
    with pytest.raises(ValueError, match="unknown field.*no_such_field"):
        engine_kwargs(args)
    config.write_text("[1, 2")
    with pytest.raises(ValueError, match="not valid YAML"):
        engine_kwargs(args)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--model", "/nonexistent/model.gguf"],
        ["chat", "--model", "not-a-model", "hi"],
        ["chat", "--model", "some-org/absent-model", "hi"],
    ],
)
def test_model_loading_failure_is_one_line_and_exit_code_2(capsys, monkeypatch, tmp_path, argv):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"jaxllm {argv[0]}: error: ")
    assert "Traceback" not in captured.err and captured.out == ""


def test_serve_model_loading_failure_is_one_line(capsys):
    from jaxllm.cli.serve import main as serve_main

    assert serve_main(["--model", "/nonexistent/dir/model.gguf"]) == 2
    err = capsys.readouterr().err
    assert "jaxllm serve: error: GGUF file not found" in err and "Traceback" not in err


def test_chat_and_generate_end_to_end(capsys, monkeypatch):
    from jaxllm.models import materialize_preset
    from jaxllm.tokenizer import load_tokenizer

    assert main(["chat", *SMALL, "--max-tokens", "6", "Hello there"]) == 0
    captured = capsys.readouterr()
    answer = captured.out.rstrip("\n")
    for expected in (
        "jaxllm: tiny-moe (Qwen3MoeForCausalLM",
        "device    cpu x",
        "dtype=float32",
        "blocks x 8 tokens",
        "max_batch_size=2 max_num_tokens=16 max_seq_len=128",
        "forwards + sampler",
        "ready in",
    ):
        assert expected in captured.err, expected

    # The same conversation through plain `generate` on the chat-templated text gives the same greedy answer.
    tokenizer = load_tokenizer(materialize_preset("tiny-moe"))
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], tokenize=False, add_generation_prompt=True
    )
    assert main(["generate", *SMALL, "--max-tokens", "6", "--json", "--prompt", templated]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["text"] == answer and len(record["token_ids"]) == 6

    assert main(["generate", *SMALL, "--max-tokens", "6", "--stream", "--prompt", templated]) == 0
    assert capsys.readouterr().out.startswith(f"{templated!r} -> {answer}")

    # Interactive: the first answer is the one-shot answer; the second turn sees the history.
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\nAnd then?\n/exit\n"))
    assert main(["chat", *SMALL, "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out  # input() writes its "> " prompt to stdout
    assert out.startswith(f"> {answer}\n> ") and out.endswith("\n> ") and len(out) > len(answer) + 8
