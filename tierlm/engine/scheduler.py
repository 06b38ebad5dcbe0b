"""Each step, decide which requests compute how many tokens, under a token budget.

Counter model (as vLLM v1): running requests first, in admission order, each catching its computed
count up to its total (a decode is 1 token, a prefill chunk up to the remaining budget); then waiting
requests are admitted while the budget, `max_num_seqs`, a free state slot and enough blocks allow.
When a running request cannot get the blocks it needs, the most recently admitted running request is
preempted: its memory is freed and it waits again at the front, to be recomputed (its prefix-cache hits
included). A new request starts after its longest cached prefix; prefill chunks stop at the prompt's
checkpoint boundary so the prefix cache can snapshot the state there. A paused running request keeps
its memory and is skipped until it is let go on.

With overlap scheduling a request whose sampled token is still on the device counts it already (a
placeholder id, see engine/request.py), so it is scheduled like any decode; one with nothing to compute
(its step failed at launch; the engine ends it when it reads that step back) is skipped.

With pipeline parallelism several batches are in flight at once: `schedule(busy=...)` leaves out the
requests of batches not yet back (and never preempts them), and `max_requests` splits the running
requests between the batches.

The vision tower's work counts in the budget (coarsely, as vLLM's encoder budget): a chunk that
encodes an image spends the image's feature count too, and stops before an image the rest of the budget
cannot hold (engine/images.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tierlm.engine.cache_manager import CacheManager
from tierlm.engine.images import encoder_tokens
from tierlm.engine.request import Request, RequestStatus


@dataclass(eq=False)
class ScheduledChunk:
    request: Request
    num_tokens: int
    # speculative decoding: drafts verified after the request's last token (not counted in num_tokens)
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last known token, so its logits pick the next one."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens + len(c.draft_token_ids) for c in self.chunks)


class RequestListener:
    """Told when a request starts running and when it stops (finished, aborted or preempted): the hooks
    for work that follows a request's life, such as the n-gram table prefetch."""

    def admitted(self, request: Request) -> None:
        pass

    def released(self, request: Request) -> None:
        pass


class Scheduler:
    def __init__(
        self, cache_manager: CacheManager, max_num_seqs: int, max_num_batched_tokens: int,
        listener: RequestListener | None = None, num_speculative_tokens: int = 0, encoder_cache=None,
    ) -> None:
        """num_speculative_tokens: K of speculative decoding (0: off): a decoding request's drafts ride with
        its last token, and a chunk that samples reserves blocks for K positions past it (the draft head's).
        encoder_cache: the engine's EncoderCache (an image it holds costs no encoder budget)."""
        self.num_speculative_tokens = num_speculative_tokens
        self.encoder_cache = encoder_cache
        self.listener = listener or RequestListener()
        self.cache_manager = cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, busy: frozenset[Request] | set[Request] = frozenset(), max_requests: int | None = None
                 ) -> SchedulerOutput:
        """busy: requests in batches still in flight (left out, never preempted); max_requests: chunks in
        this batch at most (default max_num_seqs)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        room = max_requests or self.max_num_seqs
        index = 0
        while index < len(self.running) and budget > 0 and len(out.chunks) < room:
            request = self.running[index]
            if request.paused or request in busy or request.num_computed_tokens >= request.num_tokens:
                index += 1
                continue
            n = self._chunk(request, request.num_computed_tokens, budget)
            drafts = self._drafts(request, n, budget)
            if not self._reserve(request, n + len(drafts) + self._lookahead(request, n), out, busy):
                break  # the request itself was preempted; nothing after it remains
            out.chunks.append(ScheduledChunk(request, n, drafts))
            budget -= n + len(drafts) + encoder_tokens(
                request, request.num_computed_tokens, request.num_computed_tokens + n, self.encoder_cache)
            index += 1
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted
               and len(out.chunks) < room):
            request = self.waiting[0]
            hit = self.cache_manager.match_prefix(request)
            n = self._chunk(request, hit, budget)
            if not self.cache_manager.can_admit(request, hit, hit + n):
                break
            self.waiting.popleft()
            self.cache_manager.admit(request, hit)
            self.cache_manager.grow(request, hit + n)
            self.cache_manager.grow(request, hit + n + self._lookahead(request, n))  # best effort
            request.status = RequestStatus.RUNNING
            self.listener.admitted(request)
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, n))
            budget -= n + encoder_tokens(request, hit, hit + n, self.encoder_cache)
        return out

    def _chunk(self, request: Request, start: int, budget: int) -> int:
        """Tokens to compute from `start`: up to the budget, stopping at the prompt's checkpoint boundary."""
        n = min(request.num_tokens - start, budget)
        boundary = self.cache_manager.prompt_checkpoint_at(request)
        if start < boundary < start + n:
            n = boundary - start
        # the vision tower's features count too: a chunk that would encode more than the budget holds
        # stops before the first image it reaches past its start (a chunk starting at one takes it whole)
        while n + encoder_tokens(request, start, start + n, self.encoder_cache) > budget:
            later = [image.start for image in request.images if start < image.start < start + n]
            if not later:
                break
            n = min(later) - start
        return n

    def _drafts(self, request: Request, n: int, budget: int) -> list[int]:
        """A decoding request's drafts to verify this step: as many as the budget, max_tokens and
        max_model_len leave room for (accepted drafts and one more token must fit)."""
        if not request.draft_token_ids or n != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return []
        room = min(budget - 1, request.max_model_len - request.num_tokens - 1)
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - len(request.output_token_ids) - 1)
        return request.draft_token_ids[: max(room, 0)]

    def _lookahead(self, request: Request, n: int) -> int:
        """Positions past a sampling chunk that the draft head writes while proposing (within max_model_len)."""
        if not self.num_speculative_tokens or request.num_computed_tokens + n != request.num_tokens:
            return 0
        return max(0, min(self.num_speculative_tokens, request.max_model_len - request.num_tokens - 1))

    def _reserve(self, request: Request, n: int, out: SchedulerOutput, busy) -> bool:
        """Blocks for the request's next n tokens, preempting from the back (busy requests are skipped);
        False if it was the victim."""
        while not self.cache_manager.grow(request, request.num_computed_tokens + n):
            victim = next(r for r in reversed(self.running) if r not in busy)  # `request` itself is not busy
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.cache_manager.free(request)
        self.listener.released(request)
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Take a finished (or aborted) request out and free its memory at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache_manager.free(request)
        self.listener.released(request)
