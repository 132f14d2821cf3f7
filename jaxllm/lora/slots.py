"""Which adapter sits in which device slot: a resource the capacity scheduler hands out.

A started request holds its adapter's slot from admission (`acquire`) until it finishes or
is paused (`release`), so a slot's weights never change under a running request. An adapter
that is not resident goes into a free slot, else into the least recently used slot that no
started request holds; when every slot is held by running requests, `acquire` says no and
the request waits (the scheduler tries it again next step). Newly filled slots are queued
(`take_loads`) and written to the device before the step that first uses them.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

from jaxllm.lora.adapter import LoraAdapter

NO_SLOT = -1  # the per-token slot of tokens without an adapter


class LoraSlots:
    """Host bookkeeping of `max_loras` device slots (LRU over the slots nobody holds)."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self._adapter_in: list[Optional[int]] = [None] * max_loras  # slot -> lora_int_id
        self._adapters: list[Optional[LoraAdapter]] = [None] * max_loras  # slot -> its adapter
        self._slot_of: dict[int, int] = {}  # lora_int_id -> slot
        self._holders = [0] * max_loras  # started requests holding each slot
        self._last_used = [0] * max_loras
        self._clock = itertools.count(1)
        self._held: dict[Any, int] = {}  # request -> slot
        self._pending: dict[int, LoraAdapter] = {}  # slot -> adapter to write before the next step
        self.loads = 0  # adapters written into a slot so far
        self.evictions = 0  # resident adapters replaced by another

    # ------------------------------------------------------------------ scheduling
    def acquire(self, request: Any) -> bool:
        """Give `request` a slot holding its adapter (loading it if needed); False when every
        slot is held by other adapters' running requests. True at once for requests without
        an adapter and for requests that already hold their slot."""
        adapter: Optional[LoraAdapter] = getattr(request, "lora_adapter", None)
        if adapter is None or request in self._held:
            return True
        lora_id = adapter.lora_int_id
        slot = self._slot_of.get(lora_id)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            previous = self._adapter_in[slot]
            if previous is not None:
                del self._slot_of[previous]
                self.evictions += 1
            self._adapter_in[slot] = lora_id
            self._adapters[slot] = adapter
            self._slot_of[lora_id] = slot
            self._pending[slot] = adapter
            self.loads += 1
        self._holders[slot] += 1
        self._last_used[slot] = next(self._clock)
        self._held[request] = slot
        return True

    def _free_slot(self) -> Optional[int]:
        empty = [s for s in range(self.max_loras) if self._adapter_in[s] is None]
        if empty:
            return empty[0]
        idle = [s for s in range(self.max_loras) if self._holders[s] == 0]
        return min(idle, key=self._last_used.__getitem__) if idle else None

    def release(self, request: Any) -> None:
        """The request finished or was paused: it no longer holds its slot (the adapter stays
        resident until the slot is needed for another)."""
        slot = self._held.pop(request, None)
        if slot is not None:
            self._holders[slot] -= 1

    # ------------------------------------------------------------------ steps
    def slot_of(self, request: Any) -> int:
        """The slot of a scheduled request's adapter, `NO_SLOT` without one. Looked up by the
        adapter, so rows that run for a request holding the slot (its beams) find it too."""
        adapter = getattr(request, "lora_adapter", None)
        return NO_SLOT if adapter is None else self._slot_of.get(adapter.lora_int_id, NO_SLOT)

    def take_loads(self) -> list[tuple[int, LoraAdapter]]:
        """The (slot, adapter) writes the next step needs, once."""
        loads = sorted(self._pending.items())
        self._pending.clear()
        return loads

    def adapter_in(self, slot: int) -> Optional[LoraAdapter]:
        """The adapter slot `slot` holds (or is about to), None when empty."""
        return self._adapters[slot]

    def resident(self) -> dict[int, int]:
        """lora_int_id -> slot of the adapters in device memory (or about to be written)."""
        return dict(self._slot_of)
