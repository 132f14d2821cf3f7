"""`jaxllm chat`: answer through the model's chat template, once or as a conversation, streaming."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, TextIO

from jaxllm.cli.args import (
    DEFAULT_MODEL,
    HelpFormatter,
    add_engine_args,
    add_sampling_args,
    sampling_params,
)
from jaxllm.cli.distributed_args import add_distributed_args
from jaxllm.cli.startup import resolve_model_arg, start_executor, status


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser(
        "chat",
        help="chat with a model (one answer if PROMPT is given, else a conversation)",
        description="Chat through the model's chat template, streaming the answer. With PROMPT "
        "it answers once and exits; without it it keeps the conversation going.",
        formatter_class=HelpFormatter,
    )
    chat.add_argument("prompt", nargs="*", help="a question to answer once")
    chat.add_argument("--system", default=None, help="system message (default: the chat template's own)")
    add_engine_args(chat, DEFAULT_MODEL)
    add_distributed_args(chat)
    chat.set_defaults(max_batch_size=4, max_num_tokens=256, max_seq_len=2048)
    add_sampling_args(chat, max_tokens=256, temperature=None)


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` rendered by the model's chat template, ready for the answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template; use `jaxllm generate` for plain completion")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def stream_answer(result, out: TextIO) -> tuple[str, bool]:
    """Print a streaming result's text as it arrives. Returns (text so far, interrupted): Ctrl-C
    (KeyboardInterrupt while streaming) aborts this request only."""
    text = ""
    try:
        for output in result:
            completion = output.outputs[0]
            if completion.text_diff:
                out.write(completion.text_diff)
                out.flush()
            text = completion.text
    except KeyboardInterrupt:
        result.abort()
        return text, True
    return text, False


@dataclass
class Conversation:
    """A chat's history and how one turn runs on an executor (its `tokenizer`, `max_seq_len` and
    `generate_async`): the oldest turns give way when the history outgrows max_seq_len, Ctrl-C
    stops only the answer being streamed."""

    executor: Any
    params: Any
    system: Optional[str] = None
    out: TextIO = field(default_factory=lambda: sys.stdout)
    say: Callable[[str], None] = status
    history: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self, question: str) -> list[int]:
        """The prompt of `question` after the history, dropping the oldest user/assistant turns
        (never the system message) until prompt + max_tokens fits max_seq_len (ValueError when
        the question alone does not)."""
        first = 1 if self.system else 0
        limit = self.executor.max_seq_len - self.params.max_tokens
        dropped = 0
        while True:
            ids = chat_prompt_ids(self.executor.tokenizer, [*self.history, {"role": "user", "content": question}])
            if len(ids) <= limit:
                break
            if len(self.history) <= first:
                raise ValueError(
                    f"the message ({len(ids)} tokens with the chat template) + --max-tokens "
                    f"{self.params.max_tokens} does not fit max_seq_len {self.executor.max_seq_len}"
                )
            del self.history[first : first + 2]  # the oldest question and its answer
            dropped += 1
        if dropped:
            self.say(
                f"chat: the conversation outgrew max_seq_len {self.executor.max_seq_len}: dropped the "
                f"oldest {dropped} turn{'s' if dropped > 1 else ''}" + (" (the system message kept)" if first else "")
            )
        return ids

    def answer(self, question: str) -> bool:
        """Stream the answer to `question` and keep both in the history; False when Ctrl-C
        stopped it (what it had said stays in the history)."""
        ids = self.prompt_ids(question)
        text, interrupted = stream_answer(self.executor.generate_async(ids, self.params, streaming=True), self.out)
        print(file=self.out, flush=True)
        self.history += [{"role": "user", "content": question}, {"role": "assistant", "content": text}]
        if interrupted:
            self.say("chat: answer stopped (Ctrl-C at the prompt, /exit or Ctrl-D quits)")
        return not interrupted

    def run(self, read: Callable[[str], str] = input) -> int:
        """The conversation loop until /exit, end of input or Ctrl-C at the prompt."""
        self.say("chat: type a message; /reset clears the history, /exit (or Ctrl-D) quits")
        while True:
            try:
                question = read("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=self.out)
                return 0
            command = question.strip()
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                self.reset()
                self.say("chat: history cleared" + (" (the system message kept)" if self.system else ""))
            elif command:
                try:
                    self.answer(question)
                except ValueError as exc:  # a request the engine refuses: one line, the conversation goes on
                    self.say(f"error: {exc}")


def run_chat(args: argparse.Namespace, started: float) -> int:
    executor = start_executor(
        args, resolve_model_arg(args), all_variants=False, background_warmup=True, started=started
    )
    try:
        conversation = Conversation(executor, sampling_params(args), system=args.system)
        if args.prompt:
            return 0 if conversation.answer(" ".join(args.prompt)) else 130
        return conversation.run()
    finally:
        executor.shutdown()
