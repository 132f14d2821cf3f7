"""The `jaxllm disaggregated -c disagg.yaml` file (the layout of TensorRT-LLM's disaggregated
server config): where the router listens and which context and generation workers it uses.

    hostname: 0.0.0.0
    port: 8000
    context_servers:
      num_instances: 1
      urls: ["ctx-host:8001"]
    generation_servers:
      num_instances: 1
      urls: ["gen-host:8002"]

`urls` are `host:port` (or `http://host:port`); `num_instances`, when given, must match them.
jaxllm's own fields: `api_key` (clients must send it, as to `jaxllm serve`), `worker_api_key`
(sent to the workers), `request_timeout_s`, `health_check_interval_s`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

_TOP_FIELDS = {
    "hostname",
    "port",
    "context_servers",
    "generation_servers",
    "api_key",
    "worker_api_key",
    "request_timeout_s",
    "health_check_interval_s",
}
_SERVER_FIELDS = {"num_instances", "urls"}


@dataclass
class WorkerGroup:
    """The workers of one phase."""

    urls: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, name: str, data: Any) -> WorkerGroup:
        if not isinstance(data, dict):
            raise ValueError(f"{name} must be a mapping with urls (and num_instances)")
        unknown = sorted(set(data) - _SERVER_FIELDS)
        if unknown:
            raise ValueError(f"{name}: unknown field(s) {', '.join(unknown)}; known: num_instances, urls")
        urls = data.get("urls")
        if not isinstance(urls, list) or not urls or not all(isinstance(u, str) and u for u in urls):
            raise ValueError(f"{name}.urls must be a non-empty list of host:port strings")
        count = data.get("num_instances")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count != len(urls)):
            raise ValueError(f"{name}.num_instances is {count!r} but {len(urls)} urls are given")
        normalized = [u if u.startswith(("http://", "https://")) else f"http://{u}" for u in urls]
        if len(set(normalized)) != len(normalized):
            raise ValueError(f"{name}.urls lists a worker twice")
        return cls([u.rstrip("/") for u in normalized])


@dataclass
class DisaggConfig:
    context_servers: WorkerGroup
    generation_servers: WorkerGroup
    hostname: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    worker_api_key: Optional[str] = None
    request_timeout_s: float = 600.0
    health_check_interval_s: float = 2.0

    @classmethod
    def from_dict(cls, data: Any, source: str = "the config") -> DisaggConfig:
        if not isinstance(data, dict):
            raise ValueError(f"{source} must hold a mapping (hostname, port, context_servers, generation_servers)")
        unknown = sorted(set(data) - _TOP_FIELDS)
        if unknown:
            raise ValueError(
                f"{source}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_TOP_FIELDS))}"
            )
        for name in ("context_servers", "generation_servers"):
            if name not in data:
                raise ValueError(f"{source}: {name} is required")
        port = data.get("port", 8000)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"{source}: port must be an integer in [0, 65535], got {port!r}")
        for name in ("request_timeout_s", "health_check_interval_s"):
            value = data.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{source}: {name} must be a positive number of seconds, got {value!r}")
        return cls(
            context_servers=WorkerGroup.parse("context_servers", data["context_servers"]),
            generation_servers=WorkerGroup.parse("generation_servers", data["generation_servers"]),
            hostname=str(data.get("hostname", "127.0.0.1")),
            port=port,
            api_key=data.get("api_key"),
            worker_api_key=data.get("worker_api_key"),
            request_timeout_s=float(data.get("request_timeout_s", 600.0)),
            health_check_interval_s=float(data.get("health_check_interval_s", 2.0)),
        )

    @classmethod
    def from_yaml(cls, path: str) -> DisaggConfig:
        import yaml

        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
        return cls.from_dict(data, path)
