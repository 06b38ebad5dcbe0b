"""Who owns which state slot and which QSA block, and the prefix cache over them.

Pure bookkeeping over the `ModelCache` pools; the model never allocates. The scheduler asks before it
schedules tokens; finished, aborted and preempted requests give everything back at once.

Prefix caching for a hybrid model needs two things at the reuse point: the QSA blocks before it
(identified by a hash chain over their tokens, as in vLLM and nano-vllm) and the recurrent state of
every GDN and PLE layer exactly there. That state is a whole slot (115 MB per request in the target
model, against 32 KB for a 16-token QSA block), so checkpoints are few and deliberate:
- one at the last block boundary inside the prompt (a resent conversation always shares it), and
- one at the latest block boundary reached while decoding (replacing the request's previous one),
each a copy of the request's slot into a row of the host checkpoint pool (pinned host RAM: device
memory keeps only the slots of running requests; `model/cache/host_checkpoints`), keyed by the hash
of the block it ends, and copied back into the slot of a request that hits it. A hit is the longest
run of cached blocks that ends at a block with a checkpoint. Blocks and checkpoints are evicted
least-recently-used; a cached block is reusable only while ref count is 0 or it is shared read-only
(full blocks are never written again).

Under overlap scheduling a step is launched before the ids sampled by the step before it are known, so
a block may be computed before its tokens can be hashed: blocks are registered only as far as the ids
are known (`on_computed(num_known=...)`, then `on_tokens_known`), and a decode checkpoint is still copied
right after the step that reaches its boundary (in stream order, so it holds exactly that state) into a
reserved host row, which is keyed by its block's hash once that hash is known.

A block that holds image placeholder rows hashes the image's digest with its tokens (vLLM's mm hashes,
engine/images.py): the same text around another image shares only the blocks before it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np

from tierlm.engine.request import Request
from tierlm.model.model_cache import ModelCache


def chain_hash(parent: bytes, tokens: list[int], images: bytes = b"") -> bytes:
    """A block's hash: its parent's, its token ids, and the digests of the images whose placeholder rows
    it holds (equal placeholder ids of different images must not match)."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes() + images, digest_size=16).digest()


class CacheManager:
    def __init__(
        self, cache: ModelCache, max_num_seqs: int, num_checkpoints: int = 0, enable_prefix_caching: bool = False
    ) -> None:
        if max_num_seqs > cache.num_slots:
            raise ValueError(f"{max_num_seqs} running requests > {cache.num_slots} state slots")
        host_rows = cache.checkpoints.count if cache.checkpoints else 0
        if num_checkpoints > host_rows:
            raise ValueError(f"{num_checkpoints} checkpoints > {host_rows} rows of the host checkpoint pool")
        self.cache = cache
        self.block_size = cache.block_size
        self.uses_blocks = cache.config.has_qsa
        self.prefix_caching = enable_prefix_caching and num_checkpoints > 0
        self.free_slots = deque(range(max_num_seqs))
        self.free_checkpoints = list(range(num_checkpoints))  # rows of the host checkpoint pool
        num_blocks = cache.num_blocks if self.uses_blocks else 0
        self.free_blocks = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.hash_of_block: list[bytes | None] = [None] * num_blocks
        self.block_of_hash: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody uses, oldest first
        self.checkpoints: OrderedDict[bytes, int] = OrderedDict()  # block hash -> host row, oldest first
        self.queried_tokens = 0
        self.hit_tokens = 0

    # ---- blocks -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached ones nobody uses count: they can be evicted)."""
        return len(self.free_blocks) + len(self.evictable)

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        if not self.uses_blocks:
            return 0
        return max(0, -(-num_tokens // self.block_size) - len(request.block_ids))

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Give the request blocks for `num_tokens` tokens; False (and nothing taken) if there are too few."""
        needed = self.blocks_needed(request, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            request.block_ids.append(self._take_block())
        return True

    def _take_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            self._forget(block)
        self.ref_counts[block] = 1
        return block

    def _forget(self, block: int) -> None:
        """Evict a cached block's identity (and the checkpoint that ends at it)."""
        digest = self.hash_of_block[block]
        self.hash_of_block[block] = None
        if digest is not None and self.block_of_hash.get(digest) == block:
            del self.block_of_hash[digest]
            row = self.checkpoints.pop(digest, None)
            if row is not None:
                self.free_checkpoints.append(row)

    # ---- admission ----------------------------------------------------------------------------------
    def match_prefix(self, request: Request) -> int:
        """Tokens of the request that the prefix cache can supply (a multiple of block_size, maybe 0)."""
        if not self.prefix_caching or request.prompt_logprobs is not None:  # those need every prompt row
            return 0
        count = (request.num_tokens - 1) // self.block_size  # leave >= 1 token to compute
        hashes = self._hashes(request, count)
        run = 0
        while run < count and hashes[run] in self.block_of_hash:
            run += 1
        while run and hashes[run - 1] not in self.checkpoints:
            run -= 1
        return run * self.block_size

    def can_admit(self, request: Request, hit_tokens: int, num_tokens: int) -> bool:
        """A free slot and blocks for `num_tokens` tokens, counting the `hit_tokens` it will share."""
        if not self.free_slots:
            return False
        if not self.uses_blocks:
            return True
        shared = hit_tokens // self.block_size
        hashes = request.block_hashes[:shared]
        reclaimed = sum(1 for h in hashes if self.block_of_hash[h] in self.evictable)  # leave the free pool
        return -(-num_tokens // self.block_size) - shared <= self.num_free_blocks - reclaimed

    def admit(self, request: Request, hit_tokens: int) -> None:
        """Give the request a slot; with a prefix hit, share its blocks and restore its checkpoint."""
        request.state_slot = request.home_slot = self.free_slots.popleft()
        request.num_cached_tokens = hit_tokens
        self.queried_tokens += request.num_tokens
        if hit_tokens == 0:
            self.cache.reset_slot(request.state_slot)
            request.num_computed_tokens = 0
            return
        shared = hit_tokens // self.block_size
        for digest in request.block_hashes[:shared]:
            block = self.block_of_hash[digest]
            self.evictable.pop(block, None)
            self.ref_counts[block] += 1
            request.block_ids.append(block)
        request.num_registered_blocks = shared  # they are cached blocks already
        last = request.block_hashes[shared - 1]
        self.checkpoints.move_to_end(last)
        self.cache.restore_checkpoint(self.checkpoints[last], request.state_slot)
        request.num_computed_tokens = hit_tokens
        self.hit_tokens += hit_tokens

    def prompt_checkpoint_at(self, request: Request) -> int:
        """The block boundary inside the prompt where a checkpoint is taken (0: none)."""
        if not self.prefix_caching:
            return 0
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    # ---- after each step ----------------------------------------------------------------------------
    def on_computed(self, request: Request, num_known: int | None = None, checkpoint: bool = True) -> None:
        """Right after a step that advanced the request's computed count was queued: register its newly
        full blocks, checkpoint at the boundaries of the policy above. num_known: tokens whose ids the host
        has (overlap scheduling; default: all computed ones): blocks past them wait for `on_tokens_known`.
        checkpoint False: register only (a speculative step read back behind the next one already queued:
        its slot no longer holds the state at the boundary by the time a copy would run; `save_ahead` took
        it before that step was queued)."""
        if not self.prefix_caching:
            return
        computed = request.num_computed_tokens
        known = computed if num_known is None else min(computed, num_known)
        self._register(request, known // self.block_size)
        if computed % self.block_size or computed == 0 or not checkpoint:
            return
        at_prompt_boundary = computed == self.prompt_checkpoint_at(request)
        if at_prompt_boundary or computed > request.num_prompt_tokens:
            if not at_prompt_boundary and request.decode_checkpoint is not None:
                self._drop_checkpoint(request.decode_checkpoint)
                request.decode_checkpoint = None
            if computed > known:  # the block's ids are not all known: save now, key it later
                row = self._take_row()
                if row is not None:
                    self.cache.save_checkpoint(request.state_slot, row)
                    self._release_pending(request)
                    request.pending_checkpoint = (computed, row)
                return
            digest = request.block_hashes[computed // self.block_size - 1]
            if self._checkpoint(request, digest) and not at_prompt_boundary:
                request.decode_checkpoint = digest

    def on_tokens_known(self, request: Request) -> None:
        """Overlap scheduling: more of the request's ids are known; register the blocks they complete and
        key a checkpoint saved before its block's ids were known."""
        if not self.prefix_caching or request.state_slot is None:
            return
        known = min(request.num_computed_tokens, request.num_known_tokens)
        self._register(request, known // self.block_size)
        pending = request.pending_checkpoint
        if pending is None or pending[0] > known:
            return
        boundary, row = pending
        request.pending_checkpoint = None
        digest = request.block_hashes[boundary // self.block_size - 1]
        if digest not in self.block_of_hash or digest in self.checkpoints:  # never hit, or one exists already
            self.free_checkpoints.append(row)
            return
        self.checkpoints[digest] = row
        if request.decode_checkpoint is not None:
            self._drop_checkpoint(request.decode_checkpoint)
        request.decode_checkpoint = digest

    def save_ahead(self, request: Request, boundary: int, slot: int) -> None:
        """Speculative decoding, overlap scheduling: a step in flight may bring the request's computed count
        past the block boundary `boundary`, the state there then being in `slot` (the row slot of the row
        ending there), which the next step, queued now, overwrites. Save it now (in stream order) into a
        reserved host row; `settle_ahead`, once that step is read back, keys it or gives the row back."""
        if not self.prefix_caching or boundary <= request.num_prompt_tokens:
            return
        row = self._take_row()
        if row is None:
            return
        self.cache.save_checkpoint(slot, row)
        self._release_pending(request)
        request.pending_checkpoint = (boundary, row)

    def settle_ahead(self, request: Request) -> None:
        """After a speculative step's read-back: a `save_ahead` checkpoint of a boundary it did not reach (its
        row's draft was rejected) is given back; one it reached is keyed (`on_tokens_known`)."""
        pending = request.pending_checkpoint
        if pending is not None and pending[0] > request.num_computed_tokens:
            self._release_pending(request)
        self.on_tokens_known(request)

    def _register(self, request: Request, full: int) -> None:
        """Make the request's first `full` blocks findable (those not registered yet)."""
        if full <= request.num_registered_blocks:
            return
        hashes = self._hashes(request, full)
        # only the blocks that became full since the last call: this runs every decode step
        for index in range(request.num_registered_blocks, full):
            block = request.block_ids[index]
            if self.hash_of_block[block] is None and hashes[index] not in self.block_of_hash:
                self.hash_of_block[block] = hashes[index]
                self.block_of_hash[hashes[index]] = block
        request.num_registered_blocks = full

    def _take_row(self) -> int | None:
        """A host checkpoint row: a free one, else the least recently used checkpoint's (None: no rows)."""
        if self.free_checkpoints:
            return self.free_checkpoints.pop()
        if self.checkpoints:
            return self.checkpoints.popitem(last=False)[1]
        return None

    def _release_pending(self, request: Request) -> None:
        if request.pending_checkpoint is not None:
            self.free_checkpoints.append(request.pending_checkpoint[1])
            request.pending_checkpoint = None

    def _checkpoint(self, request: Request, digest: bytes) -> bool:
        """Copy the request's state into a checkpoint for the block `digest` ends; False if none was made."""
        if digest not in self.block_of_hash:  # no cached block leads to it: it could never be hit
            return False
        if digest in self.checkpoints:
            self.checkpoints.move_to_end(digest)
            return False
        row = self._take_row()
        if row is None:
            return False
        self.cache.save_checkpoint(request.state_slot, row)
        self.checkpoints[digest] = row
        return True

    def _drop_checkpoint(self, digest: bytes) -> None:
        row = self.checkpoints.pop(digest, None)
        if row is not None:
            self.free_checkpoints.append(row)

    def _hashes(self, request: Request, count: int) -> list[bytes]:
        """The request's hash chain, extended to cover at least its first `count` full blocks (not copied:
        callers read only the first `count`)."""
        hashes = request.block_hashes
        while len(hashes) < count:
            start = len(hashes) * self.block_size
            end = start + self.block_size
            images = b"".join(image.digest for image in request.images if image.overlaps(start, end))
            hashes.append(chain_hash(hashes[-1] if hashes else b"", request.token_slice(start, end), images))
        return hashes

    # ---- release ------------------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        """Give back the slot and blocks at once; cached blocks stay findable until evicted."""
        if request.home_slot is not None:
            self.free_slots.append(request.home_slot)
            request.state_slot = request.home_slot = None
        for block in request.block_ids:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.hash_of_block[block] is not None:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        request.block_ids = []
        request.num_registered_blocks = 0
        request.decode_checkpoint = None
        self._release_pending(request)
