"""Benchmark datasets: JSON lines `{"task_id", "prompt" or "input_ids", "output_tokens"}`.

This is trtllm-bench's format. Synthetic datasets draw input and output lengths from a
distribution (normal, uniform or constant) and fill prompts with random token ids that
are not special tokens, so every request has exactly the lengths asked for.

    python -m jaxllm.bench.dataset --num-requests 256 --input-mean 128 --output-mean 128 \
        --input-stdev 16 --output-stdev 16 --output data.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

DISTRIBUTIONS = ("normal", "uniform", "constant")


@dataclass
class BenchRequest:
    task_id: Union[int, str]
    output_tokens: int
    input_ids: Optional[list[int]] = None
    prompt: Optional[str] = None

    def __post_init__(self) -> None:
        if (self.input_ids is None) == (self.prompt is None):
            raise ValueError(f"task {self.task_id}: give exactly one of prompt and input_ids")
        if not isinstance(self.output_tokens, int) or self.output_tokens < 1:
            raise ValueError(f"task {self.task_id}: output_tokens must be an integer >= 1, got {self.output_tokens!r}")
        if self.input_ids is not None and (
            not self.input_ids or not all(isinstance(t, int) and t >= 0 for t in self.input_ids)
        ):
            raise ValueError(f"task {self.task_id}: input_ids must be a non-empty list of token ids")
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt):
            raise ValueError(f"task {self.task_id}: prompt must be a non-empty string")

    @property
    def prompt_input(self) -> Union[str, list[int]]:
        return self.input_ids if self.input_ids is not None else self.prompt

    def to_json(self) -> dict:
        data: dict = {"task_id": self.task_id}
        if self.input_ids is not None:
            data["input_ids"] = self.input_ids
        else:
            data["prompt"] = self.prompt
        data["output_tokens"] = self.output_tokens
        return data


def load_dataset(path: Union[str, Path], num_requests: Optional[int] = None) -> list[BenchRequest]:
    """Read a JSON-lines dataset; ValueError names the line of a bad entry."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                if not isinstance(data, dict):
                    raise ValueError("each line must be a JSON object")
                unknown = set(data) - {"task_id", "prompt", "input_ids", "output_tokens"}
                if unknown:
                    raise ValueError(f"unknown field(s) {sorted(unknown)}")
                if "output_tokens" not in data:
                    raise ValueError("output_tokens is required")
                requests.append(
                    BenchRequest(
                        task_id=data.get("task_id", len(requests)),
                        output_tokens=data["output_tokens"],
                        input_ids=data.get("input_ids"),
                        prompt=data.get("prompt"),
                    )
                )
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: {exc}") from None
            if num_requests is not None and len(requests) >= num_requests:
                break
    if not requests:
        raise ValueError(f"{path}: the dataset is empty")
    return requests


def save_dataset(path: Union[str, Path], requests: Iterable[BenchRequest]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for request in requests:
            f.write(json.dumps(request.to_json()) + "\n")


def sample_lengths(
    rng: np.random.Generator, n: int, mean: float, stdev: float, dist: str, low: int = 1, high: Optional[int] = None
) -> list[int]:
    """n lengths from `dist`: normal(mean, stdev), uniform(mean ± stdev) or constant(mean), clipped to [low, high]."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"dist must be one of {DISTRIBUTIONS}, got {dist!r}")
    if mean < low:
        raise ValueError(f"mean length must be >= {low}, got {mean}")
    if dist == "normal":
        values = rng.normal(mean, stdev, size=n)
    elif dist == "uniform":
        values = rng.uniform(mean - stdev, mean + stdev, size=n)
    else:
        values = np.full(n, mean, dtype=np.float64)
    values = np.maximum(np.rint(values), low)
    if high is not None:
        values = np.minimum(values, high)
    return [int(v) for v in values]


def synthetic_dataset(
    num_requests: int,
    *,
    input_mean: float,
    output_mean: float,
    input_stdev: float = 0.0,
    output_stdev: float = 0.0,
    dist: str = "normal",
    vocab_size: int = 32000,
    exclude_ids: Sequence[int] = (),
    max_seq_len: Optional[int] = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """Random-token requests with input/output lengths drawn from `dist`.

    With `max_seq_len`, each output length is clipped so that input + output fits.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    inputs = sample_lengths(
        rng, num_requests, input_mean, input_stdev, dist, high=None if max_seq_len is None else max_seq_len - 1
    )
    outputs = sample_lengths(rng, num_requests, output_mean, output_stdev, dist)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(exclude_ids), dtype=np.int64))
    if allowed.size == 0:
        raise ValueError("no token ids left to sample prompts from")
    requests = []
    for i, (n_in, n_out) in enumerate(zip(inputs, outputs)):
        if max_seq_len is not None:
            n_out = max(1, min(n_out, max_seq_len - n_in))
        requests.append(
            BenchRequest(task_id=i, output_tokens=n_out, input_ids=rng.choice(allowed, size=n_in).astype(int).tolist())
        )
    return requests


def tokenizer_vocab(tokenizer) -> tuple[int, list[int]]:
    """(vocab size, special token ids) of a Hugging Face tokenizer, for synthetic prompts."""
    return len(tokenizer), sorted(set(getattr(tokenizer, "all_special_ids", []) or []))


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset", type=Path, default=None, help="JSON-lines dataset (else a synthetic one)")
    group.add_argument("--num-requests", type=int, default=None, help="use the first N requests (synthetic: 64)")
    group.add_argument("--input-mean", type=float, default=128, help="synthetic input length mean")
    group.add_argument("--input-stdev", type=float, default=0, help="synthetic input length stdev")
    group.add_argument("--output-mean", type=float, default=128, help="synthetic output length mean")
    group.add_argument("--output-stdev", type=float, default=0, help="synthetic output length stdev")
    group.add_argument("--dist", choices=DISTRIBUTIONS, default="normal", help="synthetic length distribution")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--save-dataset", type=Path, default=None, help="write the dataset used here")


def dataset_from_args(
    args: argparse.Namespace, tokenizer=None, max_seq_len: Optional[int] = None
) -> list[BenchRequest]:
    if args.dataset is not None:
        requests = load_dataset(args.dataset, args.num_requests)
    else:
        vocab, special = tokenizer_vocab(tokenizer) if tokenizer is not None else (32000, [])
        requests = synthetic_dataset(
            args.num_requests or 64,
            input_mean=args.input_mean,
            input_stdev=args.input_stdev,
            output_mean=args.output_mean,
            output_stdev=args.output_stdev,
            dist=args.dist,
            vocab_size=vocab,
            exclude_ids=special,
            max_seq_len=max_seq_len,
            seed=args.seed,
        )
    if args.save_dataset is not None:
        save_dataset(args.save_dataset, requests)
    return requests


def main(argv: Optional[list[str]] = None) -> int:
    from jaxllm.cli.args import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="python -m jaxllm.bench.dataset", description="Write a synthetic dataset.", formatter_class=HelpFormatter
    )
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory or preset (sets the vocabulary)")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--max-seq-len", type=int, default=None)
    add_dataset_args(parser)
    args = parser.parse_args(argv)
    vocab, special = args.vocab_size, []
    if args.tokenizer:
        from jaxllm.models.resolve import resolve_model
        from jaxllm.tokenizer import load_tokenizer

        vocab, special = tokenizer_vocab(load_tokenizer(resolve_model(args.tokenizer)))
    requests = synthetic_dataset(
        args.num_requests or 64,
        input_mean=args.input_mean,
        input_stdev=args.input_stdev,
        output_mean=args.output_mean,
        output_stdev=args.output_stdev,
        dist=args.dist,
        vocab_size=vocab,
        exclude_ids=special,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
    )
    save_dataset(args.output, requests)
    print(f"wrote {len(requests)} requests to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
