"""`ServerConfig`: the OpenAI server's options (`jaxllm serve` flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxllm.lora.lora_request import LoRARequest

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompts_per_request: int = 256
    # Client-supplied Jinja templates can take unbounded time and memory to render (vLLM's flag).
    trust_request_chat_template: bool = False
    max_json_depth: int = 32  # deeper request bodies are refused (the API needs about 5 levels)
    body_timeout: float = 30.0  # seconds a request body may take to arrive (408 after)
    send_timeout: float = 30.0  # seconds a client may leave one response chunk unread (then dropped)
    shutdown_timeout: float = 30.0  # on SIGTERM, seconds streams may still run before they are aborted
    num_api_threads: int = 4  # threads that parse, render templates and tokenize off the event loop
    # LoRA adapters clients select by model name (`NAME` or `served_model_name:NAME`; --lora-modules).
    lora_modules: dict[str, LoRARequest] = field(default_factory=dict)
    # Tool calling and reasoning (vLLM's flags): `tool_choice="auto"` needs both of the first two.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a name in tool_parsers.TOOL_PARSERS
    reasoning_parser: str | None = None  # a name in reasoning.REASONING_PARSERS
    # Disaggregated serving (engine built with cache_transceiver_config): the address the KV
    # transfer server binds (its port: `kv_transfer_port`, 0 picks a free one) and the host name
    # generation workers reach it by (None: the bind address, or this host's name for 0.0.0.0).
    kv_transfer_host: str = "127.0.0.1"
    kv_transfer_port: int = 0
    kv_transfer_advertised_host: str | None = None
