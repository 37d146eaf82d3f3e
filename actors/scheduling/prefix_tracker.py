"""The scheduler's side of prefix caching: hash a request's blocks once, build its lookup
query at admission and its commits after each step. Pure (no asyncio, no torch).

A request's identity is the engine's model fingerprint plus its `cache_salt`, its LoRA
adapter (two adapters never share KV; requests of one adapter do) and, for a longrope
model, whether its prompt outgrew the original window (its KV then rotates with the long
factors throughout); its block
hashes are extended as tokens are computed, so every block is hashed exactly once over the
request's life (preemption and re-admission included).
"""

from __future__ import annotations

from tokenloom.actors.kv.block_hash import LONG_ROPE, Identities, extend_block_hashes
from tokenloom.actors.kv.prefix_cache import PrefixQuery
from tokenloom.actors.messages import KVCommit
from tokenloom.actors.scheduling.request import Request


class PrefixTracker:
    def __init__(self, model_fingerprint: str, block_size: int, enabled: bool):
        self.fingerprint = model_fingerprint
        self.block_size = block_size
        self.enabled = enabled
        self._identities = Identities(model_fingerprint)

    def _extend(self, req: Request, num_tokens: int) -> None:
        """Hash req's full blocks among its first num_tokens tokens (only the new ones)."""
        if num_tokens // self.block_size <= len(req.block_hashes):
            return
        variant = LONG_ROPE if req.rope_long else None
        ident, content = self._identities.encoded(req.cache_salt, req.lora_name, variant)
        upto = req.token_ids[:num_tokens]
        extend_block_hashes(req.block_hashes, upto, self.block_size, ident)  # appends in place
        if content is not None:
            extend_block_hashes(req.content_hashes, upto, self.block_size, content)

    def query(self, req: Request) -> PrefixQuery:
        """The lookup for a request being admitted (prompt, plus outputs after preemption).
        A request still owed prompt logprobs looks up nothing: the prefill must compute every
        prompt position's logits (vLLM skips the cache read likewise); its blocks are still
        committed for others."""
        if self.enabled:
            self._extend(req, req.num_tokens)
        n = (req.num_tokens // self.block_size
             if self.enabled and not req.wants_prompt_logprobs else 0)
        return PrefixQuery(token_ids=req.token_ids, block_hashes=req.block_hashes[:n],
                           content_hashes=req.content_hashes[:n] if req.cache_salt else None,
                           preempted=req.num_preemptions > 0, export=req.meta.kv_export)

    def forget_hashes(self, req: Request) -> None:
        """req's identity changed (a longrope request recomputed under the long factors):
        its chain is hashed again from the first block. New lists: a commit still on its
        way to the KV manager holds the old ones (its blocks were computed as they say)."""
        req.block_hashes = []
        req.content_hashes = []

    def commit(self, req: Request, num_computed_tokens: int) -> KVCommit | None:
        """Newly full blocks among the first `num_computed_tokens` (computed by a step that
        has completed) to offer to the cache, or None."""
        if not self.enabled:
            return None
        num_full = num_computed_tokens // self.block_size
        if num_full <= req.num_committed_blocks:
            return None
        self._extend(req, num_full * self.block_size)
        req.num_committed_blocks = num_full
        return KVCommit(request_id=req.request_id, num_computed_tokens=num_computed_tokens,
                        block_hashes=req.block_hashes, token_ids=req.token_ids,
                        content_hashes=req.content_hashes if req.cache_salt else None,
                        cache_salt=req.cache_salt, lora_name=req.lora_name)
