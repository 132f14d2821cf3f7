"""What a new user of the command line meets first: a busy port, --version, help texts, other
tools' flags, the start-up banner and progress, serve's log lines, Hub errors and chat."""

from __future__ import annotations

import dataclasses
import io
import logging
import re
import socket
import types
from pathlib import Path

import pytest

from jaxllm.cli import build_parser, main
from jaxllm.cli.serve import build_parser as serve_parser
from jaxllm.cli.startup import engine_banner, serve_logs, status, warm_up


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


def parse_exit(argv: list[str], capsys) -> tuple[int, list[str]]:
    """Exit status and stderr lines of a command line that fails while parsing."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    return exit_info.value.code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_vllm_tp_flag_maps_to_tp_size():
    args = build_parser().parse_args(["generate", "-tp", "2"])
    assert args.tensor_parallel_size == 2
    assert build_parser().parse_args(["chat", "-tp=4"]).tensor_parallel_size == 4
    assert serve_parser().parse_args(["-tp", "2"]).tensor_parallel_size == 2


@pytest.mark.parametrize("flag", ["--enable-prefix-caching", "--enforce-eager"])
def test_harmless_vllm_flags_are_accepted_with_a_note(capsys, flag):
    args = build_parser().parse_args(["generate", flag, "--max-tokens", "3"])
    assert args.max_tokens == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"jaxllm generate: note: {flag} accepted")
    expected = "on by default" if flag == "--enable-prefix-caching" else "compiled fixed-shape steps"
    assert expected in err[0]


def test_trust_remote_code_is_refused_in_one_line(capsys):
    code, err = parse_exit(["chat", "--trust-remote-code"], capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("jaxllm chat: error: --trust-remote-code") and "never runs" in err[0]
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--trust-remote-code"])
    assert "safetensors and GGUF" in capsys.readouterr().err


def test_unknown_flag_is_one_line_naming_the_closest_known_flag(capsys):
    code, err = parse_exit(["generate", "--max-seq-lne", "64"], capsys)
    assert code == 2 and len(err) == 1
    assert "unknown flag --max-seq-lne" in err[0] and "closest known flag is --max-seq-len" in err[0]
    code, err = parse_exit(["chat", "--frobnicate"], capsys)
    assert code == 2 and len(err) == 1 and "unknown flag --frobnicate" in err[0]
    with pytest.raises(SystemExit) as exit_info:
        serve_parser().parse_args(["--tensor-paralel-size", "2"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(err) == 1 and "--tensor-parallel-size" in err[0]
    assert "usage:" not in err[0]


@pytest.fixture(scope="module")
def engine():
    from conftest import tiny_engine

    # No small decode buckets: the all-variants warm-up below compiles each sampler variant once
    # per row count, and the progress totals are what is checked, not the buckets.
    return tiny_engine("tiny-moe", max_num_tokens=32, max_batch_size=2, decode_batch_sizes=[])


def test_banner_names_the_parallel_layout(engine):
    banner = engine_banner(engine, "tiny-moe")
    line = next(line for line in banner.splitlines() if line.strip().startswith("parallel"))
    assert line.split() == ["parallel", "tp=1", "ep=1", "moe_tp=1", "attention=tp"]
    # An EP x attention-DP layout, as `--tp-size 8 --ep-size 8 --enable-attention-dp` gives.
    wide = dataclasses.replace(
        engine.config, tensor_parallel_size=8, moe_expert_parallel_size=8, enable_attention_dp=True
    )
    view = types.SimpleNamespace(**{**vars(engine), "config": wide})
    line = next(line for line in engine_banner(view, "m").splitlines() if line.strip().startswith("parallel"))
    assert line.split() == ["parallel", "tp=8", "ep=8", "moe_tp=1", "attention=dp", "x8"]


@pytest.mark.parametrize("all_variants,background", [(True, False), (False, True)])
def test_compile_progress_total_is_fixed_and_the_bar_ends_full(engine, capsys, all_variants, background):
    calls: list[tuple[int, int]] = []
    expected = engine.program_warmup.num_pieces(all_variants, background)
    engine.warmup(
        all_variants=all_variants, progress=lambda done, total: calls.append((done, total)), background=background
    )
    assert calls and {total for _, total in calls} == {expected}
    assert calls[-1][0] == expected and [done for done, _ in calls] == sorted(done for done, _ in calls)

    warm_up(engine, all_variants, background)  # the CLI's bar: the same total from its first frame on
    counts = re.findall(r"(\d+)/(\d+) \[", capsys.readouterr().err)
    assert counts and {int(total) for _, total in counts} == {expected}
    assert counts[-1] == (str(expected), str(expected))


@pytest.fixture
def saved_loggers():
    """serve_logs reconfigures uvicorn's and JAX's loggers: put them back afterwards."""
    names = ["uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi", "jax._src.xla_bridge"]
    saved = {name: (lg.handlers[:], lg.level, lg.propagate) for name in names if (lg := logging.getLogger(name))}
    yield
    for name, (handlers, level, propagate) in saved.items():
        lg = logging.getLogger(name)
        lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate


def test_serve_logs_have_one_format_and_no_tpu_probe(capsys, saved_loggers):
    serve_logs("info")
    status("ready in 1.0 s")
    logging.getLogger("jaxllm.server.lifecycle").warning("draining")
    logging.getLogger("uvicorn.error").info("Uvicorn running on %s", "http://127.0.0.1:8000")
    logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", "/health", "1.1", 200)
    logging.getLogger("jax._src.xla_bridge").warning("Unable to initialize backend 'tpu': libtpu.so not found")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4, lines
    line_format = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) [\w.]+: \S")
    for line in lines:
        assert line_format.match(line), line
    assert [line.split()[3] for line in lines] == [
        "jaxllm.cli:",
        "jaxllm.server.lifecycle:",
        "uvicorn.error:",
        "uvicorn.access:",
    ]
    serve_logs("info")  # twice: still one line per record
    status("again")
    assert len(capsys.readouterr().err.splitlines()) == 1


@pytest.mark.parametrize("offline", [True, False])
def test_hub_miss_mentions_hf_hub_offline_only_when_it_is_set(tmp_path, monkeypatch, offline):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from jaxllm.models.resolve import resolve_model

    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:  # no network: the download finds neither the Hub nor a cached copy
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

        def no_network(*args, **kwargs):
            raise LocalEntryNotFoundError("cannot reach the Hub")

        monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    with pytest.raises(ValueError) as info:
        resolve_model("some-org/absent", hub_cache_dir=str(tmp_path / "hub"))
    message = str(info.value)
    assert "hf download some-org/absent" in message
    assert ("HF_HUB_OFFLINE" in message) == offline
    assert ("could not be reached" in message) != offline


def test_more_devices_than_heads_points_at_attention_dp():
    from jaxllm.models import load_model_config, materialize_preset
    from sharding.rules import model_rules

    config = load_model_config(materialize_preset("tiny-moe"))  # 4 attention heads
    with pytest.raises(ValueError) as info:
        model_rules(
            tensor_parallel_size=8,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            intermediate_size=config.intermediate_size,
            moe_intermediate_size=config.moe_intermediate_size,
            vocab_size=config.vocab_size,
            expert_parallel_size=8,
        )
    message = str(info.value)
    assert "tensor_parallel_size=8 must divide num_attention_heads=4" in message
    assert "--enable-attention-dp" in message and "\n" not in message


def test_every_llm_config_class_is_importable_from_jaxllm():
    import jaxllm
    from jaxllm import (  # noqa: F401  (the import itself is the test)
        LLM,
        CapacitySchedulerPolicy,
        CompletionOutput,
        ContextChunkingPolicy,
        KvCacheConfig,
        KvCacheRetentionConfig,
        LoRARequest,
        MoeConfig,
        MoeLoadBalancerConfig,
        RequestOutput,
        SamplingParams,
        SchedulerConfig,
        TokenRangeRetentionConfig,
    )
    from sharding.eplb.eplb_config import MoeLoadBalancerConfig as defined

    assert MoeLoadBalancerConfig is defined
    for name in jaxllm.__all__:
        assert getattr(jaxllm, name) is not None, name
    assert "MoeLoadBalancerConfig" in jaxllm.__all__ and "SchedulerConfig" in jaxllm.__all__
    with pytest.raises(AttributeError):
        jaxllm.NoSuchThing  # noqa: B018


ROOT = Path(__file__).parents[1]


def readme_transcript() -> list[str]:
    """The lines of the README's Quick start transcript (the text block after "The first command prints")."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("The first command prints") :].split("```text\n", 1)[1].split("```", 1)[0]
    return block.splitlines()


def test_readme_transcript_matches_the_banner_and_the_progress_line(engine):
    from jaxllm.batch_builder import choose_token_bucket, decode_batch_sizes, token_buckets

    lines = readme_transcript()
    banner_labels = [line[2:12].strip() for line in engine_banner(engine, "m").splitlines()[1:]]
    readme_labels = [line[2:12].strip() for line in lines if line.startswith("  ") and line[2] != " "]
    assert readme_labels == banner_labels
    # chat's limits (max_batch_size 4, max_num_tokens 256), the engine's smallest bucket 16:
    buckets = token_buckets(256, 16)
    decode_bucket = choose_token_bucket(4, 256, 16)
    rows = decode_batch_sizes(4, decode_bucket)
    assert next(line for line in lines if line.startswith("  compiled")).split()[1:7] == [
        str(len(buckets) + len(rows)),
        "forwards:",
        "token",
        "buckets",
        ",".join(map(str, buckets)),
        "+",
    ]
    first = 4  # the decode token bucket, the 256-token bucket and the decode buckets of 1 and 2 rows
    forwards = len(buckets) + len(rows)
    progress = next(line for line in lines if line.startswith("compiling"))
    total = first + 2  # ProgramWarmup.num_pieces in the background mode: + samplers, + context logits
    later = forwards - first
    assert progress.startswith(f"compiling {first} of {forwards} forwards + sampler, {later} more when idle: ")
    assert progress.endswith(f"| {total}/{total}")


def test_docs_list_every_benchmark():
    from jaxllm.cli.bench import BENCHMARKS

    text = (ROOT / "docs" / "performance.md").read_text()
    table = text[text.index("## Benchmarks") :]
    listed = re.findall(r"^\| `([a-z-]+)` \|", table, flags=re.M)
    assert sorted(listed) == sorted(BENCHMARKS)


def test_license_is_the_apache_2_text_pyproject_declares():
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"]["text"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190


class InterruptingExecutor:
    """An executor whose chosen answers raise KeyboardInterrupt (Ctrl-C) after their first piece."""

    def __init__(self, executor, interrupt: set[int]) -> None:
        self.executor, self.interrupt, self.calls, self.aborted = executor, interrupt, 0, []
        self.tokenizer, self.max_seq_len = executor.tokenizer, executor.max_seq_len

    def generate_async(self, ids, params, streaming):
        result = self.executor.generate_async(ids, params, streaming=streaming)
        self.calls += 1
        return InterruptedStream(result, self.aborted) if self.calls in self.interrupt else result


class InterruptedStream:
    def __init__(self, result, aborted: list) -> None:
        self.result, self.aborted = result, aborted

    def __iter__(self):
        for output in self.result:
            yield output
            raise KeyboardInterrupt

    def abort(self) -> None:
        self.aborted.append(self.result)
        self.result.abort()


def scripted(lines: list):
    """input() from a script: each item is a line, or an exception to raise (KeyboardInterrupt: Ctrl-C)."""
    pending = list(lines)

    def read(prompt: str) -> str:
        if not pending:
            raise EOFError
        item = pending.pop(0)
        if isinstance(item, type) and issubclass(item, BaseException):
            raise item
        return item

    return read


@pytest.fixture(scope="module")
def chat_executor():
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.executor.executor import GenerationExecutor
    from jaxllm.llm_args import KvCacheConfig

    config = EngineConfig(
        model="tiny-moe",
        max_batch_size=2,
        max_num_tokens=32,
        max_seq_len=128,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=1024),
    )
    executor = GenerationExecutor(config)
    yield executor
    executor.shutdown()


def test_chat_ctrl_c_stops_the_answer_only_and_reset_confirms(chat_executor):
    from jaxllm import SamplingParams
    from jaxllm.cli.chat import Conversation

    said: list[str] = []
    out = io.StringIO()
    fake = InterruptingExecutor(chat_executor, interrupt={2})
    conversation = Conversation(fake, SamplingParams(max_tokens=8), system="Be brief.", out=out, say=said.append)
    read = scripted(["Hi", "Tell me a story", "And then?"])
    assert conversation.run(read) == 0  # the script ends: end of input quits
    assert len(fake.aborted) == 1  # the interrupted request was aborted (unless it had just finished)
    assert fake.aborted[0].result(timeout=60).outputs[0].finish_reason in ("cancelled", "length")
    assert sum("answer stopped" in line for line in said) == 1
    roles = [turn["role"] for turn in conversation.history]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert [turn["content"] for turn in conversation.history if turn["role"] == "user"] == [
        "Hi",
        "Tell me a story",
        "And then?",
    ]
    assert not any(line.startswith("error") for line in said)

    said.clear()
    assert conversation.run(scripted(["/reset", KeyboardInterrupt, "never read"])) == 0  # Ctrl-C at the prompt quits
    assert any("history cleared" in line for line in said)
    assert conversation.history == [{"role": "system", "content": "Be brief."}]


def test_chat_drops_the_oldest_turns_when_the_history_outgrows_max_seq_len(chat_executor):
    from jaxllm import SamplingParams
    from jaxllm.cli.chat import Conversation

    said: list[str] = []
    conversation = Conversation(
        chat_executor, SamplingParams(max_tokens=8), system="Be brief.", out=io.StringIO(), say=said.append
    )
    questions = [f"question number {i}: what is {i} plus {i}?" for i in range(8)]
    assert conversation.run(scripted(questions)) == 0
    assert not any(line.startswith("error") for line in said), said
    dropped = [line for line in said if "outgrew max_seq_len 128" in line]
    assert dropped and all("dropped the oldest" in line for line in dropped)
    assert conversation.history[0] == {"role": "system", "content": "Be brief."}
    assert conversation.history[-2] == {"role": "user", "content": questions[-1]}
    assert conversation.history[1]["content"] != questions[0]  # the first question gave way
    # A message that cannot fit even alone is one line, and the conversation goes on.
    said.clear()
    assert conversation.run(scripted(["word " * 200, "short"])) == 0
    assert sum(line.startswith("error: ") and "does not fit max_seq_len" in line for line in said) == 1
    assert conversation.history[-2] == {"role": "user", "content": "short"}


def test_examples_default_to_a_real_model_and_show_a_cpu_collect_command():
    import shlex

    from sharding.eplb.statistics import ITER_RANGE_ENV, PATH_ENV

    assert 'default="smollm2"' in (ROOT / "examples" / "generate_offline.py").read_text()
    text = (ROOT / "examples" / "ep_load_balancer" / "README.md").read_text()
    collect = text[text.index("XLA_FLAGS=--xla_force_host_platform_device_count=8") :].split("```", 1)[0]
    words = shlex.split(collect.replace("\\\n", " "))
    env = dict(word.split("=", 1) for word in words if "=" in word and not word.startswith("-"))
    assert {ITER_RANGE_ENV, PATH_ENV, "XLA_FLAGS"} <= set(env)
    command = words[words.index("jaxllm") + 1 :]
    args = build_parser().parse_args(command)
    assert (args.model, args.tensor_parallel_size, args.moe_expert_parallel_size) == ("tiny-moe", 8, 8)
    assert args.enable_attention_dp


def test_cost_model_table_columns_fit_long_case_names():
    from jaxllm.bench.kernels import cost_model_table
    from pallas_kernels import cost_model

    # Three launches of one shape (the full default table compiles dozens of kernels).
    shape = cost_model.ATTENTION_MODELS[0]
    batches = cost_model.default_attention_batches()[:3]
    costs = [cost for batch in batches for cost in cost_model.attention_costs(shape, batch)]
    costs.append(dataclasses.replace(costs[0], case="a very long case name " * 5))
    gpus = [cost_model.GPUS["h100"], cost_model.GPUS["h200"]]
    lines = cost_model_table(costs, gpus).splitlines()
    header = lines[0]
    case_at, grid_at, mb_end = header.index("case"), header.index("grid"), header.index(" MB ") + 3
    for line, cost in zip(lines[1:], costs, strict=True):
        assert line[case_at:].startswith(cost.case)
        grid = "x".join(str(x) for x in cost.grid) if cost.grid else "xla"
        assert line[grid_at:].startswith(grid + " ") and line[grid_at - 1] == " "
        assert line[:mb_end].endswith(f" {cost.bytes / 1e6:.2f}")  # numbers right-aligned under their header
