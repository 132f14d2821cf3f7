"""`jaxllm chat`: answer through the model's chat template, once or as a conversation, streaming."""

from __future__ import annotations

import argparse
import sys

from jaxllm.cli.args import (
    DEFAULT_MODEL,
    HelpFormatter,
    add_distributed_args,
    add_engine_args,
    add_sampling_args,
    sampling_params,
)
from jaxllm.cli.generate import print_stream
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


def run_chat(args: argparse.Namespace, started: float) -> int:
    executor = start_executor(
        args, resolve_model_arg(args), all_variants=False, background_warmup=True, started=started
    )
    try:
        params = sampling_params(args)
        history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []

        def answer(question: str) -> None:
            history.append({"role": "user", "content": question})
            ids = chat_prompt_ids(executor.tokenizer, history)
            final = print_stream(executor.generate_async(ids, params, streaming=True))
            print(flush=True)
            history.append({"role": "assistant", "content": final.outputs[0].text if final else ""})

        if args.prompt:
            answer(" ".join(args.prompt))
            return 0
        status("chat: type a message; /reset clears the history, /exit (or Ctrl-D) quits")
        while True:
            try:
                question = input("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            if question.strip() in ("/exit", "/quit"):
                return 0
            if question.strip() == "/reset":
                del history[1 if args.system else 0 :]
                continue
            if question.strip():
                try:
                    answer(question)
                except ValueError as exc:  # e.g. the conversation outgrew max_seq_len
                    history.pop()
                    status(f"error: {exc}")
    finally:
        executor.shutdown()
