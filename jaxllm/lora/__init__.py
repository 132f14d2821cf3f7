"""LoRA adapters: requests, PEFT checkpoints, device slots (see `jaxllm.lora.slots`)."""

from jaxllm.lora.adapter import LORA_TARGETS, LoraAdapter, load_adapter
from jaxllm.lora.lora_request import LoRARequest
from jaxllm.lora.slots import LoraSlots

__all__ = ["LORA_TARGETS", "LoRARequest", "LoraAdapter", "LoraSlots", "load_adapter"]
