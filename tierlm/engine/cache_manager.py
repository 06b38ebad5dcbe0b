"""Who owns which recurrent-state slot and which QSA block.

Pure bookkeeping over the `ModelCache` pools: a free list of slots (one per running request) and of
blocks (block_size tokens of every QSA layer each). The scheduler asks before it schedules tokens;
finished, aborted and preempted requests give everything back at once. The model never allocates.
"""

from __future__ import annotations

import math
from collections import deque

from tierlm.engine.request import Request
from tierlm.model.model_cache import ModelCache


class CacheManager:
    def __init__(self, cache: ModelCache) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.free_slots = deque(range(cache.num_slots))
        self.free_blocks = deque(range(cache.num_blocks)) if cache.config.has_qsa else deque()
        self.uses_blocks = cache.config.has_qsa

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Blocks to add so the request can hold `num_tokens` tokens."""
        if not self.uses_blocks:
            return 0
        return max(0, math.ceil(num_tokens / self.block_size) - len(request.block_ids))

    def can_admit(self, request: Request, num_tokens: int) -> bool:
        return bool(self.free_slots) and self.blocks_needed(request, num_tokens) <= len(self.free_blocks)

    def admit(self, request: Request) -> None:
        request.state_slot = self.free_slots.popleft()
        self.cache.reset_slot(request.state_slot)

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Give the request blocks for `num_tokens` tokens; False (and nothing taken) if there are too few."""
        needed = self.blocks_needed(request, num_tokens)
        if needed > len(self.free_blocks):
            return False
        request.block_ids.extend(self.free_blocks.popleft() for _ in range(needed))
        return True

    def free(self, request: Request) -> None:
        if request.state_slot is not None:
            self.free_slots.append(request.state_slot)
            request.state_slot = None
        self.free_blocks.extend(request.block_ids)
        request.block_ids = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)
