"""Replaying KV cache events into the set of cached blocks they describe (KV manager, engine and
attention-DP tests compare it with the block pools' own prefix index)."""

from __future__ import annotations


def replay(events: list[dict], live: dict, lora_ids: dict | None = None) -> None:
    """Apply events to `live` = {block_hash: (parent_hash, tokens, priority)} (and the blocks'
    adapters to `lora_ids`)."""
    for event in events:
        data = event["data"]
        if data["type"] == "stored":
            parent = data["parent_hash"]
            for block in data["blocks"]:
                assert block["block_hash"] not in live, "a block was stored twice"
                assert block["cache_level"] == 0
                if lora_ids is not None:
                    lora_ids[block["block_hash"]] = block["lora_id"]
                tokens = tuple(t["token_id"] for t in block["tokens"])
                live[block["block_hash"]] = (parent, tokens, block["priority"])
                parent = block["block_hash"]
        elif data["type"] == "removed":
            for block_hash in data["block_hashes"]:
                del live[block_hash]
        elif data["type"] == "updated":
            parent, tokens, priority = live[data["block_hash"]]
            assert data["priority"]["old_value"] == priority
            live[data["block_hash"]] = (parent, tokens, data["priority"]["new_value"])
        else:
            raise AssertionError(f"unexpected event {data}")
