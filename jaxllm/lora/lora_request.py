"""`LoRARequest`: which adapter a request runs with (TensorRT-LLM's and vLLM's name)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter in the Hugging Face PEFT layout (`adapter_config.json` and
    `adapter_model.safetensors` in `lora_path`).

    `lora_int_id` identifies the adapter to the engine (its device slot, its prefix cache):
    requests with the same id share one loaded copy, so one id must always name one path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if (
            not isinstance(self.lora_int_id, numbers.Integral)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty str (a PEFT adapter directory), got {self.lora_path!r}")
        object.__setattr__(self, "lora_int_id", int(self.lora_int_id))

    # TensorRT-LLM's accessors
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
