"""Prefix reuse between sequences: finding a new prompt's cached blocks and indexing the
full blocks a sequence computed, through the block pool's prefix index.

When a request is first added, the longest chain of cached full prompt blocks becomes the
start of its block table; at least one prompt token is always left to compute, so the step
still produces the first output token. A full prompt block enters the index in the step
that computes it (steps run in order, so the KV is written before any later step reads
it); if the request is freed before that step ran, the entry is withdrawn again. A block
holding generated tokens is indexed once all its tokens are known on the host.
"""

from __future__ import annotations

from jaxllm.kv_cache.block_pool import ROOT_NODE, BlockPool
from jaxllm.kv_cache.retention import DEFAULT_RETENTION_PRIORITY
from jaxllm.kv_cache.sequence import KvSequence
from jaxllm.llm_request import LlmRequest


def prefix_root(request: LlmRequest) -> int:
    """The node prefixes of `request` hang from: with a LoRA adapter the KV differs from the
    base model's for the same tokens, so each adapter has its own prefix tree (a negative
    root, which no block's node id can equal)."""
    adapter = getattr(request, "lora_adapter", None)
    return ROOT_NODE if adapter is None else -adapter.lora_int_id


def num_computed_tokens(request: LlmRequest) -> int:
    """Tokens whose KV the finished steps have written (works for finished requests,
    which may have stopped in the middle of their prompt)."""
    position = request.context_current_position
    if position < len(request.prompt_token_ids):
        return position
    # Prompt done: every token but the last sampled one (not fed back yet) is in.
    return max(position, request.num_tokens - 1)


class PrefixReuse:
    """Matches prompts against the pool's prefix index and indexes computed blocks."""

    def __init__(self, pool: BlockPool, tokens_per_block: int, max_blocks_per_seq: int) -> None:
        self.pool = pool
        self.tokens_per_block = tokens_per_block
        self.max_blocks_per_seq = max_blocks_per_seq

    def match(self, request: LlmRequest) -> list[int]:
        """Cached blocks holding the longest prefix of the prompt, leaving >= 1 token."""
        tpb = self.tokens_per_block
        prompt = request.prompt_token_ids
        limit = min((len(prompt) - 1) // tpb, self.max_blocks_per_seq)
        pool = self.pool
        node = prefix_root(request)
        matched: list[int] = []
        for i in range(limit):
            block = pool.lookup(node, tuple(prompt[i * tpb : (i + 1) * tpb]))
            if block is None:
                break
            matched.append(block)
            node = pool.node_of(block)
        return matched

    def num_shared(self, request: LlmRequest) -> int:
        """Prefix blocks a new request would share with live sequences at no pool cost
        (cached-but-unowned matches still cost a block: they leave the evictable set)."""
        ref = self.pool.ref_count
        return sum(1 for b in self.match(request) if ref[b] > 0)

    def claim(self, seq: KvSequence, matched: list[int]) -> None:
        """Make the matched cached blocks the start of the sequence's blocks (owned, with
        the request's retention priorities)."""
        pool = self.pool
        for block in matched:
            pool.acquire(block)
        request = seq.request
        config = request.kv_cache_retention_config
        if config is not None:  # the request's priorities apply to the blocks it reuses
            tpb, plen = self.tokens_per_block, request.orig_prompt_len
            for i, block in enumerate(matched):
                priority, duration = config.block_retention(i, tpb, plen)
                if priority is not None:
                    pool.set_retention(block, priority, duration)
        seq.blocks = matched
        seq.nodes = [pool.node_of(b) for b in matched]

    def register_computed(self, seq: KvSequence, request: LlmRequest, num_computed: int) -> bool:
        """Index the sequence's full blocks among its first `num_computed` tokens. Returns
        True if any block was added to `seq.nodes`."""
        tpb = self.tokens_per_block
        full = min(num_computed // tpb, len(seq.blocks))
        start = seq.num_registered
        if full <= start:
            return False
        pool = self.pool
        nodes = seq.nodes
        node = nodes[-1] if nodes else prefix_root(request)
        base = start * tpb
        if full * tpb <= len(request.prompt_token_ids):
            tokens, base = request.prompt_token_ids, 0
        else:
            tokens = request.get_tokens(base, full * tpb)
        blocks = seq.blocks
        config = request.kv_cache_retention_config
        if config is None and pool.events is None:  # the common case
            for i in range(start, full):
                lo = i * tpb - base
                node = pool.register(blocks[i], node, tuple(tokens[lo : lo + tpb]))
                nodes.append(node)
        else:
            retentions = None
            if config is not None:
                plen = request.orig_prompt_len
                retentions = []
                for i in range(start, full):
                    priority, duration = config.block_retention(i, tpb, plen)
                    retentions.append((DEFAULT_RETENTION_PRIORITY, None) if priority is None else (priority, duration))
            lora = getattr(request, "lora_adapter", None)
            token_blocks = [tuple(tokens[i * tpb - base : (i + 1) * tpb - base]) for i in range(start, full)]
            nodes.extend(
                pool.register_chain(
                    blocks[start:full], node, token_blocks, retentions, getattr(lora, "lora_int_id", None)
                )
            )
        return True

    def withdraw_uncomputed(self, seq: KvSequence, num_computed: int) -> bool:
        """Un-index blocks registered for a step that never ran (the request was freed in
        between), so nobody reuses KV that was never written. Returns True if any was."""
        full = num_computed // self.tokens_per_block
        if seq.num_registered <= full:
            return False
        pool = self.pool
        for block in seq.blocks[full : seq.num_registered]:
            if pool.ref_count[block] == 1:
                pool.unregister(block)
        del seq.nodes[full:]
        return True
