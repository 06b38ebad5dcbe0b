"""Admission-time prefetch of a prompt's n-gram table pages, on a background thread.

A request's table rows depend only on its token ids, which are all known when it is admitted. So at
admission a thread hashes the whole prompt and, per ~1024 tokens, turns the rows into unique pages,
merges adjacent pages into ranges and asks the kernel for all of them at once (`NgramStore.advise_rows`,
process_madvise). The prefill's gathers then find the pages resident or in flight instead of faulting
them in one by one. The gather never depends on this: prefetch only changes when the I/O happens.

A request's remaining work is dropped when it finishes, is aborted or is preempted. Between jobs the
thread samples the table's resident fraction for /metrics (mincore; never on the hot path).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from tierlm.memory.ngram_rows_np import carry_context
from tierlm.memory.ngram_store import NgramStore

logger = logging.getLogger("tierlm")

PIECE_TOKENS = 1024
PREFETCH_NICENESS = 10
RESIDENCY_EVERY_SECONDS = 5.0


@dataclass
class _Job:
    request_id: str
    tokens: np.ndarray  # the ids to prefetch
    context: np.ndarray  # the ngram_size-1 ids before them


class PrefetchWorker:
    def __init__(self, store: NgramStore) -> None:
        self.store = store
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[str, int] = {}  # request id -> its jobs not finished yet
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._backlog = 0  # tokens submitted but not yet advised
        self.submitted_tokens = 0
        self.advised_tokens = 0
        self.dropped_tokens = 0  # of requests that finished or were preempted first
        self._thread = threading.Thread(target=self._run, name="tierlm-ple-prefetch", daemon=True)
        self._thread.start()

    @property
    def backlog_tokens(self) -> int:
        return self._backlog

    def submit(self, request_id: str, token_ids: list[int], start: int) -> None:
        """Prefetch the rows of token_ids[start:] (the part of a request still to be computed)."""
        tokens = np.asarray(token_ids[start:], dtype=np.int64)
        if tokens.size == 0:
            return
        with self._lock:
            self._cancelled.discard(request_id)
            self._active[request_id] = self._active.get(request_id, 0) + 1
            self._backlog += tokens.size
            self.submitted_tokens += tokens.size
        self._jobs.put(_Job(request_id, tokens, self.store.context_of(token_ids[:start])))

    def cancel(self, request_id: str) -> None:
        """Drop what is left of a request's prefetch (it finished or was preempted)."""
        with self._lock:
            if request_id in self._active:
                self._cancelled.add(request_id)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """For tests and benchmarks: True once every submitted token is advised or dropped."""
        deadline = time.monotonic() + timeout
        while self._backlog and time.monotonic() < deadline:
            time.sleep(0.005)
        return self._backlog == 0

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        # background work: let the engine and the HTTP side win every contest for a core (on a warm
        # table the advice is wasted, so it must cost nothing the user can see)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREFETCH_NICENESS)
        last_sample = 0.0
        while True:
            try:
                job = self._jobs.get(timeout=RESIDENCY_EVERY_SECONDS)
            except queue.Empty:
                job = False
            if job is None:
                return
            if time.monotonic() - last_sample >= RESIDENCY_EVERY_SECONDS:
                self.store.sample_residency()
                last_sample = time.monotonic()
            if job:
                try:
                    self._prefetch(job)
                except Exception:  # prefetch is advice: a failure must not stop serving
                    logger.exception("n-gram prefetch for request %s failed", job.request_id)

    def _prefetch(self, job: _Job) -> None:
        context, done = job.context, 0
        try:
            while done < job.tokens.size:
                if job.request_id in self._cancelled:
                    return
                piece = job.tokens[done : done + PIECE_TOKENS]
                self.store.advise_rows(self.store.rows_for(context, piece), merge=True)
                context = carry_context(context, piece)
                done += piece.size
                with self._lock:
                    self._backlog -= piece.size
                self.advised_tokens += piece.size
        finally:
            with self._lock:
                self._backlog -= job.tokens.size - done
                self.dropped_tokens += job.tokens.size - done
                self._active[job.request_id] -= 1
                if not self._active[job.request_id]:
                    del self._active[job.request_id]
                    self._cancelled.discard(job.request_id)
