"""The worker side of disaggregated serving in the OpenAI server (as `trtllm-serve` workers).

A server whose engine has a cache transceiver (`cache_transceiver_config` in `--config`)
runs a KV transfer server (`jaxllm.engine.kv_transfer`) beside the HTTP one and accepts
`disaggregated_params` on /v1/completions and /v1/chat/completions:

- `context_only`: the prompt runs with max_tokens=1; the answer's choice carries
  `disaggregated_params` with the first token, `ctx_request_id`, `opaque_state` and
  `ctx_info_endpoint`, and the prompt's blocks stay held until claimed or expired.
- `generation_only`: before the request is submitted (on the API thread pool) its blocks are
  pulled from `ctx_info_endpoint`; a failed or cut transfer is a 502 for this request alone.
  The answer (or stream) is the whole completion, the context worker's first token included.
"""

from __future__ import annotations

import socket
from typing import Any, Optional

from jaxllm.engine.kv_transceiver import CacheTransceiver
from jaxllm.engine.kv_transfer import KvTransferError, KvTransferServer, fetch_kv, is_local, parse_endpoint
from jaxllm.executor.executor import GenerationExecutor
from jaxllm.executor.result import GenerationResult
from jaxllm.llm_args import DisaggregatedParams
from jaxllm.outputs import CompletionOutput
from jaxllm.server.errors import APIError
from jaxllm.server.server_config import ServerConfig
from jaxllm.server.server_metrics import ServerMetrics

_FIELD = "disaggregated_params"


def _advertised_host(config: ServerConfig) -> str:
    if config.kv_transfer_advertised_host:
        return config.kv_transfer_advertised_host
    if config.kv_transfer_host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return config.kv_transfer_host


class DisaggregatedWorker:
    """The transfer server of one OpenAI server, and its requests' disaggregated params."""

    def __init__(self, executor: GenerationExecutor, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.executor = executor
        self.config = config
        self.metrics = metrics
        self.transceiver: Optional[CacheTransceiver] = getattr(executor.engine, "kv_transceiver", None)
        self.transfer_server: Optional[KvTransferServer] = None

    @property
    def enabled(self) -> bool:
        return self.transceiver is not None

    def start(self) -> None:
        """Listen for claims (a no-op without a transceiver)."""
        transceiver = self.transceiver
        if transceiver is None or self.transfer_server is not None:
            return
        executor = self.executor
        self.transfer_server = KvTransferServer(
            self.config.kv_transfer_host,
            self.config.kv_transfer_port,
            export=lambda rid, token, to_host: executor.call_on_engine(
                lambda engine: engine.kv_transceiver.export(rid, token, to_host), timeout=30.0
            ),
            expire=lambda: executor.call_on_engine(lambda engine: engine.kv_transceiver.expire(), timeout=30.0),
            next_deadline=transceiver.next_deadline,
            advertised_host=_advertised_host(self.config),
        ).start()

    def stop(self) -> None:
        if self.transfer_server is not None:
            self.transfer_server.stop()
            self.transfer_server = None

    @property
    def endpoint(self) -> Optional[str]:
        return None if self.transfer_server is None else self.transfer_server.endpoint

    # ------------------------------------------------------------------ requests (API threads)
    def params_for(self, body: Any) -> Optional[DisaggregatedParams]:
        """The request's disaggregated params (None for an ordinary request); for a
        generation-only one, with its blocks pulled from the context worker. APIError 400 for
        a request this server cannot take, 502 when the transfer fails."""
        field = getattr(body, _FIELD, None)
        if field is None or field.request_type == "context_and_generation":
            return None
        try:
            params = field.to_params()
        except ValueError as exc:
            raise APIError(400, str(exc), _FIELD) from None
        if self.transceiver is None:
            raise APIError(
                400,
                f"{_FIELD}: this server was started without cache_transceiver_config (set it in --config)",
                _FIELD,
            )
        if body.n != 1 or (getattr(body, "best_of", None) or 1) != 1:
            raise APIError(400, f"{_FIELD}: n and best_of must be 1 for a disaggregated request", _FIELD)
        if body.use_beam_search:
            raise APIError(400, f"{_FIELD}: beam search is not supported with disaggregated serving", _FIELD)
        if getattr(body, "prompt_logprobs", None) is not None:
            raise APIError(400, f"{_FIELD}: prompt_logprobs are not supported with disaggregated serving", _FIELD)
        if params.context_only and body.stream:
            raise APIError(400, f"{_FIELD}: a context_only request cannot stream (it returns one token)", _FIELD)
        if params.generation_only:
            try:
                endpoint = str(params.ctx_info_endpoint)
                payload = fetch_kv(
                    endpoint,
                    int(params.ctx_request_id or 0),
                    str(params.opaque_state),
                    transport=self._transport(endpoint),
                    device=self.transceiver.device,
                    transfer_host=self.config.kv_transfer_host,
                )
            except ValueError as exc:
                raise APIError(400, str(exc), _FIELD) from None
            except KvTransferError as exc:
                raise APIError(502, str(exc), _FIELD, "server_error") from None
            self.metrics.observe_kv_transfer(payload.transfer_seconds, payload.num_bytes, payload.backend)
            params.kv_payload = payload
        return params

    def _transport(self, endpoint: str) -> str:
        """How to pull from `endpoint`: the backend, with SHM only to a context worker on this host."""
        assert self.transceiver is not None
        backend = self.transceiver.config.backend
        if backend == "SHM" and not is_local(parse_endpoint(endpoint)[0]):
            return "TCP"
        return backend

    def context_answer(self, result: GenerationResult, output: CompletionOutput) -> dict:
        """The `disaggregated_params` of a finished context-only request's choice: the handle
        a generation worker claims its blocks with (held only when it ended on its length),
        and the first token's logprobs when they were asked for."""
        assert self.transceiver is not None
        rid = result.engine_request_ids[0]
        token_ids, finish_reason = output.token_ids, output.finish_reason
        log_probs = None
        if output.logprobs:
            first = output.logprobs[0]
            log_probs = [[[int(t), float(lp.logprob), lp.rank] for t, lp in first.items()]]
        if finish_reason != "length":  # no generation phase follows: free its blocks now if they were held
            self.transceiver.drop(rid)
        return {
            "request_type": "context_only",
            "first_gen_tokens": list(token_ids[:1]),
            "ctx_request_id": rid,
            "opaque_state": self.transceiver.opaque_state(rid) if finish_reason == "length" else None,
            "ctx_info_endpoint": self.endpoint,
            "draft_tokens": None,
            "first_gen_log_probs": log_probs,
        }
