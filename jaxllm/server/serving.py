"""`OpenAIServer`: what the routes share over one executor.

Admission (draining, engine health, the model name), reading and parsing bodies,
tokenizing and submitting off the event loop, the token text table for logprobs, and the
bookkeeping of live requests: waiting for them, aborting them when their client leaves or
the server shuts down, and observing them in the metrics when released.

Nothing slow runs on the event loop: parsing and validating a body, rendering the chat
template, tokenizing and submitting happen on a small thread pool, and token strings for
logprobs come from a table decoded once at start-up. Prompt text longer than
`max_seq_len` tokens could ever cover is refused before tokenizing. A request's checks are
the executor's (`GenerationExecutor.submit_many`); its ValueError becomes a 400.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from jaxllm.executor.executor import GenerationExecutor
from jaxllm.executor.result import GenerationResult
from jaxllm.kv_cache.retention import KvCacheRetentionConfig
from jaxllm.llm_args import DisaggregatedParams
from jaxllm.lora.lora_request import LoRARequest
from jaxllm.outputs import RequestOutput
from jaxllm.sampling import SamplingParams
from jaxllm.sampling.guided import compile_grammar
from jaxllm.server.disagg_worker import DisaggregatedWorker
from jaxllm.server.errors import APIError, bad_request, param_of, validation_error
from jaxllm.server.guard import BodyTooLarge, parse_json_body
from jaxllm.server.protocol import strip_guided_prefix
from jaxllm.server.server_config import ServerConfig
from jaxllm.server.server_metrics import ServerMetrics
from jaxllm.server.streaming import wait_for_disconnect


def ranked_logprobs(entry: dict) -> list:
    """The ranked (top-N) entries of one token's logprobs, most likely first."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)


class OpenAIServer:
    """Binds the routes to one executor."""

    def __init__(self, executor: GenerationExecutor, config: ServerConfig) -> None:
        self.executor = executor
        self.config = config
        self.tokenizer = executor.tokenizer
        self.created = int(time.time())
        self.requests_total = 0
        self.disconnects = 0  # responses whose client left before the end (their requests were aborted)
        self.draining = False  # set on SIGTERM: new requests get 503
        self._live: set[GenerationResult] = set()  # results some response is still waiting on
        self._shutdown_aborted: set[GenerationResult] = set()
        self._abort_sent: weakref.WeakSet[GenerationResult] = weakref.WeakSet()
        self.metrics = ServerMetrics(executor, config.served_model_name)
        # Disaggregated serving: the KV transfer server and the requests' disaggregated params.
        self.disagg = DisaggregatedWorker(executor, config, self.metrics)
        self._threads = ThreadPoolExecutor(max_workers=config.num_api_threads, thread_name_prefix="jaxllm-api")
        self._token_text = self._token_table()
        # A prompt of more characters than max_seq_len tokens can cover is refused before tokenizing.
        vocab = self._vocab_strings()
        longest = max((len(t) for t in vocab), default=0) or 64
        self.max_prompt_chars = 4 * longest * executor.max_seq_len

    # ------------------------------------------------------------------ start-up tables
    def _vocab_strings(self) -> list[str]:
        try:
            return list(self.tokenizer.get_vocab())
        except Exception:
            return []

    def _token_table(self) -> list[str]:
        """Every token's text, decoded once, so that logprobs never decode on the event loop."""
        engine = self.executor.engine
        size = len(self.tokenizer)
        model_config = getattr(engine, "model_config", None)
        if model_config is not None:
            size = max(size, int(model_config.vocab_size))
        with self.executor.tokenizer_lock:
            return [self.tokenizer.decode([i]) for i in range(size)]

    def token_text(self, token_id: int) -> str:
        """A token's text ("" for an id outside the vocabulary)."""
        table = self._token_text
        return table[token_id] if 0 <= token_id < len(table) else ""

    def close(self) -> None:
        self.disagg.stop()
        self._threads.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ requests in
    async def off_loop(self, fn: Callable, *args) -> Any:
        """Run slow work (parsing, templates, tokenization) on the API thread pool."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    def check_admission(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", None, "service_unavailable")
        if not self.executor.is_healthy:
            raise APIError(503, "the engine is not healthy", None, "service_unavailable")

    def check_model(self, model: str) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); 404 for an unknown name."""
        base = self.config.served_model_name
        if model == base:
            return None
        adapters = self.config.lora_modules
        name = model[len(base) + 1 :] if model.startswith(base + ":") else model
        if name in adapters:
            return adapters[name]
        served = ", ".join(f"`{m}`" for m in [base, *adapters])
        raise APIError(
            404, f"The model `{model}` does not exist; this server serves {served}.", "model", "not_found_error"
        )

    async def read_body(self, request: Request) -> bytes:
        try:
            body = await request.body()
        except BodyTooLarge:
            raise APIError(413, f"request body exceeds {self.config.max_body_bytes} bytes", None) from None
        if len(body) > self.config.max_body_bytes:
            raise APIError(413, f"request body exceeds {self.config.max_body_bytes} bytes", None)
        return body

    def parse(self, model_cls: type[BaseModel], body: bytes) -> Any:
        data = parse_json_body(body, self.config.max_json_depth)
        try:
            return model_cls.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None

    def encode(self, prompt: str, add_special_tokens: bool, field: str = "prompt") -> list[int]:
        if len(prompt) > self.max_prompt_chars:
            raise APIError(
                400,
                f"{field}: {len(prompt)} characters cannot fit in max_seq_len ({self.executor.max_seq_len}) tokens",
                field,
            )
        try:
            return self.executor.encode(prompt, add_special_tokens)
        except ValueError as exc:
            raise APIError(400, f"{field}: {exc}", field) from None

    def max_tokens_for(self, requested: int | None, prompt_len: int) -> int:
        if requested is not None:
            return requested
        return max(1, self.executor.max_seq_len - prompt_len)

    def sampling_params_for(self, body: Any, requested: int | None, prompt_len: int) -> SamplingParams:
        """The body's sampling params for a prompt of `prompt_len` tokens (max_tokens defaults to the rest)."""
        try:
            return body.to_sampling_params(self.max_tokens_for(requested, prompt_len))
        except ValueError as exc:
            raise bad_request(exc) from None

    def check_guided_decoding(self, body: Any) -> None:
        """Compile the body's output constraint now (cached by its text), so that one that does
        not compile is a 400 naming its request field (`response_format.json_schema.schema`,
        `guided_regex`, ...) before anything is submitted."""
        try:
            guided, field = body.guided_decoding()
        except ValueError as exc:
            raise bad_request(exc) from None
        if guided is None or field is None:
            return
        matchers = getattr(self.executor.engine, "guided", None)
        try:
            compile_grammar(guided)
            if matchers is not None:
                matchers.check(guided)
        except ValueError as exc:
            raise APIError(400, f"{field}: {strip_guided_prefix(str(exc))}", field) from None

    def submit_all(
        self,
        prompts: list[str | list[int]],
        params_for: Callable[[int], SamplingParams],
        streaming: bool,
        add_special_tokens: bool = True,
        texts: list[str | None] | None = None,
        field: str = "prompt",
        lora_request: LoRARequest | None = None,
        kv_cache_retention_config: KvCacheRetentionConfig | None = None,
        disaggregated_params: DisaggregatedParams | None = None,
    ) -> list[GenerationResult]:
        """Tokenize every prompt, then submit them all; the executor checks each before it
        queues any (ValueError -> 400). Runs on the API thread pool: tokenizing may take a
        while. `field`: the request field the prompts come from, named in length errors."""
        executor = self.executor
        self.check_admission()
        requests = []
        try:
            for i, prompt in enumerate(prompts):
                ids = self.encode(prompt, add_special_tokens) if isinstance(prompt, str) else prompt
                # Before any per-token work on a huge prompt; names the prompt, not max_tokens.
                if len(ids) >= executor.max_seq_len:
                    raise APIError(
                        400,
                        f"{field}: {len(ids)} tokens leave no room to generate within "
                        f"max_seq_len ({executor.max_seq_len})",
                        field,
                    )
                request = executor.make_request(
                    ids,
                    params_for(len(ids)),
                    streaming,
                    lora_request=lora_request,
                    kv_cache_retention_config=kv_cache_retention_config,
                    disaggregated_params=disaggregated_params,
                )
                text = prompt if isinstance(prompt, str) else (texts[i] if texts else None)
                if text is not None:
                    request.prompt = text
                requests.append(request)
        except ValueError as exc:
            raise bad_request(exc, "prompt") from None
        self.check_admission()
        try:
            results = executor.submit_many(requests)
        except ValueError as exc:
            raise bad_request(exc, "prompt") from None
        except RuntimeError as exc:
            raise APIError(503, str(exc), param_of(str(exc))) from None
        self._live.update(results)
        self.requests_total += len(results)
        return results

    # ------------------------------------------------------------------ draining (SIGTERM)
    @property
    def num_live(self) -> int:
        return len(self._live)

    def start_draining(self) -> None:
        """Refuse new requests (503); the ones running go on. Thread-safe."""
        self.draining = True

    def abort_live(self) -> int:
        """Abort every request a response still waits on (its stream ends with an error event)."""
        live = list(self._live)
        for result in live:
            if not result.finished:
                self._shutdown_aborted.add(result)
                self._abort_sent.add(result)
                result.abort()
        return len(live)

    def aborted_by_shutdown(self, results: list[GenerationResult]) -> bool:
        """Whether the shutdown aborted any of `results` (while they are not yet released)."""
        return not self._shutdown_aborted.isdisjoint(results)

    def release(self, results: list[GenerationResult]) -> bool:
        """Forget finished responses; True if the shutdown aborted any of them."""
        aborted = False
        self.metrics.observe([r for r in results if r in self._live], self._abort_sent)
        for result in results:
            self._live.discard(result)
            if result in self._shutdown_aborted:
                self._shutdown_aborted.discard(result)
                aborted = True
        return aborted

    # ------------------------------------------------------------------ requests out
    async def gather(self, request: Request, results: list[GenerationResult]) -> list[RequestOutput]:
        """Wait for every result, aborting them all if the client disconnects first."""
        work = asyncio.ensure_future(asyncio.gather(*(r.aresult() for r in results)))
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
                self.abort_unfinished(results)
            aborted = self.release(results)
        try:
            outputs = work.result()
        except asyncio.CancelledError:
            raise APIError(499, "client disconnected") from None
        except Exception as exc:
            raise APIError(500, f"{type(exc).__name__}: {exc}", None, "server_error") from None
        if aborted:
            raise APIError(503, "the server is shutting down: the request was aborted", None, "service_unavailable")
        return outputs

    def close_stream(self, results: list[GenerationResult]) -> None:
        """A streaming response ended, however it ended: nothing of it may keep running."""
        self.abort_unfinished(results)
        self.release(results)

    def abort_unfinished(self, results: list[GenerationResult]) -> None:
        """Abort what is still running (once per result); counts one disconnect per response."""
        aborted = False
        for result in results:
            if not result.finished and result not in self._abort_sent:
                self._abort_sent.add(result)
                result.abort()
                aborted = True
        if aborted:
            self.disconnects += 1

    def models(self) -> dict:
        base = {
            "id": self.config.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "jaxllm",
            "root": self.config.served_model_name,
            "parent": None,
            "max_model_len": self.executor.max_seq_len,
        }
        adapters = [
            {**base, "id": name, "root": lora.lora_path, "parent": self.config.served_model_name}
            for name, lora in self.config.lora_modules.items()
        ]
        return {"object": "list", "data": [base, *adapters]}
