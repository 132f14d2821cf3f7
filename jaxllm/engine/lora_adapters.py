"""The engine's LoRA adapters: each request's adapter checked and read once, and written into
its device slot before the first step that reads it."""

from __future__ import annotations

from typing import Any, Optional

from jaxllm.lora import LoraAdapter, LoRARequest
from jaxllm.lora.cache import AdapterCache
from jaxllm.lora.slots import LoraSlots
from jaxllm.lora.weights import empty_slot, slot_update


class EngineAdapters:
    """Admission's adapter look-up (any thread) and the slot writes of the engine's steps."""

    def __init__(
        self, cache: Optional[AdapterCache], slots: Optional[LoraSlots], runner: Any, max_lora_rank: int
    ) -> None:
        """`cache`, `slots`: None when the engine was built without LoRA."""
        self.cache, self.slots, self.runner, self.max_lora_rank = cache, slots, runner, max_lora_rank

    def resolve(self, lora_request: Any) -> Optional[LoraAdapter]:
        """The checked adapter of `lora_request` (None for the base model); ValueError when it
        cannot be served. Safe from any thread; adapters are read once and kept."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a jaxllm.LoRARequest, got {type(lora_request).__name__}")
        if self.cache is None:
            raise ValueError(
                f"lora_request {lora_request.lora_name!r}: this engine was built without LoRA "
                "support; build it with enable_lora=True (CLI: --enable-lora)"
            )
        return self.cache.get(lora_request)

    def slot_update(self, adapter: Optional[LoraAdapter]) -> Any:
        """The weights a slot holds for `adapter` (zeros for None)."""
        config, params = self.runner.model_config, self.runner.params
        if adapter is None:
            return empty_slot(config, params, self.max_lora_rank, config.dtype)
        return slot_update(adapter, config, params, self.max_lora_rank, config.dtype)

    def write_loads(self) -> None:
        """Adapters newly given a slot: written before the step reads them."""
        if self.slots is not None:
            for slot, adapter in self.slots.take_loads():
                self.runner.write_lora_slot(slot, self.slot_update(adapter))

    def warmup(self) -> None:
        """Compile the slot write: slot 0 rewritten with what it holds."""
        if self.slots is not None:
            self.runner.write_lora_slot(0, self.slot_update(self.slots.adapter_in(0)))
