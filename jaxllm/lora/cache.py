"""Adapters read from disk, kept on the host so admission reads each one once."""

from __future__ import annotations

import collections
import threading

from jaxllm.lora.adapter import LoraAdapter, load_adapter
from jaxllm.lora.lora_request import LoRARequest
from jaxllm.models.model_config import ModelConfig


class AdapterCache:
    """lora_int_id -> checked `LoraAdapter` (LRU over `capacity` adapters; thread-safe).

    An id stands for one adapter: a request naming a known id with another path is refused,
    since the device slot and the prefix cache of that id already hold the first adapter."""

    def __init__(self, config: ModelConfig, max_rank: int, capacity: int = 64) -> None:
        self.config = config
        self.max_rank = max_rank
        self.capacity = capacity
        self._lock = threading.Lock()
        self._adapters: collections.OrderedDict[int, LoraAdapter] = collections.OrderedDict()
        self._paths: dict[int, str] = {}

    def get(self, request: LoRARequest) -> LoraAdapter:
        lora_id = request.lora_int_id
        with self._lock:
            known = self._paths.get(lora_id)
            if known is not None and known != request.lora_path:
                raise ValueError(
                    f"lora_request {request.lora_name!r}: lora_int_id {lora_id} already names the "
                    f"adapter at {known!r}, not {request.lora_path!r}; give each adapter its own id"
                )
            adapter = self._adapters.get(lora_id)
            if adapter is not None:
                self._adapters.move_to_end(lora_id)
                return adapter
            adapter = load_adapter(request, self.config, self.max_rank)
            self._paths[lora_id] = request.lora_path
            self._adapters[lora_id] = adapter
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
            return adapter
