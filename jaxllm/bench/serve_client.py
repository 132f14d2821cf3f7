"""`jaxllm bench serve`: a load generator for an OpenAI-compatible server (benchmark_serving).

Load shapes: `all` (every request at once), `concurrency` (at most C in flight) and
`poisson` (arrivals at --request-rate per second, exponential gaps). Requests stream
with `stream_options.include_usage`, so TTFT and ITL come from chunk arrival times and
token counts from the server's usage; EOS is ignored so each request produces exactly
its `output_tokens`. Token-id prompts go to /v1/completions as token lists, so input
lengths are exact.

    jaxllm bench serve --url http://127.0.0.1:8000 --num-requests 256 --load concurrency --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

from tqdm.auto import tqdm

from jaxllm.bench.dataset import BenchRequest, add_dataset_args, dataset_from_args
from jaxllm.bench.request_metrics import RequestRecord, format_table, summarize, write_report

LOADS = ("all", "concurrency", "poisson")


def _payload(request: BenchRequest, model: str, endpoint: str) -> dict[str, Any]:
    common = {
        "model": model,
        "max_tokens": request.output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        if request.prompt is None:
            raise ValueError(f"task {request.task_id}: the chat endpoint needs text prompts")
        return {**common, "messages": [{"role": "user", "content": request.prompt}]}
    return {**common, "prompt": request.prompt_input}


async def send_one(session, url: str, payload: dict, record: RequestRecord, headers: dict) -> None:
    """POST one streaming request and fill `record` from its server-sent events."""
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            chunks = 0
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    record.error = str(event["error"].get("message"))
                    return
                usage = event.get("usage")
                if usage:
                    record.input_tokens = usage.get("prompt_tokens", record.input_tokens)
                    record.output_tokens = usage.get("completion_tokens", record.output_tokens)
                for choice in event.get("choices", ()):
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        chunks += 1
                        record.chunk_times.append(now)
                        if record.first_token is None:
                            record.first_token = now
            record.end = time.perf_counter()
            if not record.output_tokens:
                record.output_tokens = chunks
    except Exception as exc:  # connection errors count as failed requests
        record.error = f"{type(exc).__name__}: {exc}"


async def run_load(
    url: str,
    model: str,
    requests: Sequence[BenchRequest],
    *,
    load: str = "all",
    concurrency: Optional[int] = None,
    request_rate: Optional[float] = None,
    endpoint: str = "completions",
    api_key: Optional[str] = None,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Drive the server with one load shape; returns (records, wall time)."""
    import aiohttp

    if load not in LOADS:
        raise ValueError(f"load must be one of {LOADS}, got {load!r}")
    if load == "concurrency" and not concurrency:
        raise ValueError("concurrency: the concurrency load needs --concurrency >= 1")
    if load == "poisson" and not (request_rate and request_rate > 0):
        raise ValueError("request_rate: the poisson load needs --request-rate > 0")
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    target = url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    payloads = [_payload(r, model, endpoint) for r in requests]
    records = [RequestRecord(input_tokens=len(r.input_ids or []), start=0.0) for r in requests]
    limit = asyncio.Semaphore(concurrency if load == "concurrency" else len(requests))
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, file=sys.stderr)
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def one(i: int) -> None:
            async with limit:
                records[i].start = time.perf_counter()
                await send_one(session, target, payloads[i], records[i], headers)
                bar.update(1)

        started = time.perf_counter()
        tasks = []
        for i in range(len(requests)):
            if load == "poisson" and i:
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
    bar.close()
    return records, wall


async def _served_model(url: str, api_key: Optional[str]) -> str:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as session:
        async with session.get(url.rstrip("/") + "/v1/models", headers=headers) as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]


def main(argv: Optional[list[str]] = None) -> int:
    from jaxllm.cli.args import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="jaxllm bench serve", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the server's first model)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer dir or preset whose vocabulary synthetic prompts use (default: --model)",
    )
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--load", choices=LOADS, default="all")
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=None, help="requests per second (poisson load)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--report-json", default=None)
    parser.add_argument("--no-progress", action="store_true")
    add_dataset_args(parser)
    args = parser.parse_args(argv)

    model = args.model or asyncio.run(_served_model(args.url, args.api_key))
    tokenizer = None
    if args.dataset is None:
        from jaxllm.models.resolve import resolve_model
        from jaxllm.tokenizer import load_tokenizer

        try:
            tokenizer = load_tokenizer(resolve_model(args.tokenizer or model))
        except ValueError as exc:
            raise SystemExit(f"synthetic prompts need a tokenizer (--tokenizer): {exc}") from exc
    requests = dataset_from_args(args, tokenizer)
    records, wall = asyncio.run(
        run_load(
            args.url,
            model,
            requests,
            load=args.load,
            concurrency=args.concurrency,
            request_rate=args.request_rate,
            endpoint=args.endpoint,
            api_key=args.api_key,
            seed=args.seed,
            progress=not args.no_progress,
        )
    )
    summary = summarize(records, wall_time=wall, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    shape = {
        "all": "all at once",
        "concurrency": f"concurrency {args.concurrency}",
        "poisson": f"poisson {args.request_rate} req/s",
    }[args.load]
    print(format_table(summary, f"serving: {shape}"))
    if args.report_json:
        write_report(
            args.report_json,
            summary,
            {
                k: v if isinstance(v, (int, float, bool, str, type(None))) else str(v)
                for k, v in vars(args).items()
                if k != "api_key"
            },
        )
    return 0 if summary["num_failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
