"""Host cost of a speculative decode step vs a plain one, on CPU, as CUDA graphs would see it.

One greedy stream of a demo model with an MTP head decodes --tokens tokens three ways: without drafts,
with the head's own drafts (random weights: nearly all rejected) and with oracle drafts (the known greedy
continuation: all accepted). Every fixed-shape forward goes through a `StaticDecodeRunner` in mode "eager"
(the padded batches CUDA graphs replay, run eagerly), and a dispatch counter watches every torch op:
- launches/step: the ops run outside those forwards (each a kernel launch, or a host-side tensor op, on a
  GPU) plus one per fixed-shape forward (a graph replay); views and metadata ops are not counted;
- replays/step: the fixed-shape forwards, and the rollback's fixed-size slot copies (`StaticSlotCopy`);
- syncs/step: reads of a device value by the host, counted as `.tolist()` calls and `.item()`s
  (`_local_scalar_dense`);
- host ms/step: the step's wall time minus the time inside the fixed-shape forwards (what the host spends
  on Python and on the ops around the graphs; on a GPU these run before, between and after the replays);
- idle ms/step (drafting columns): from the step's last device read to the next step's first replay: with
  --serial (no overlap scheduling) the host time a GPU sits idle; with overlap (the default) the greedy step
  after the one read is in flight already (launched before the read, on the device's own outputs), so a GPU
  idles only for what exceeds that step's device time (without drafts, see bench/host_overlap.py).
Per verify step for the drafting columns (a verify step yields 1..K+1 tokens). The oracle's drafts are
made on the device (`OracleSpeculation`), where the steps chained by overlap scheduling verify them.

    python bench/spec_host_cost.py                 # demo tiny, K=1
    python bench/spec_host_cost.py -k 3 --tokens 48
    python bench/spec_host_cost.py --repetition-penalty 1.05   # penalized: verify replay, edit, the rest replayed
    python bench/spec_host_cost.py --serial        # drafting steps without overlap scheduling (before/after)
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tierlm.demo_model import build_demo_model
from tierlm.engine.llm_engine import EngineConfig, LLMEngine
from tierlm.model.speculative_step import OracleSpeculation
from tierlm.model.static_decode import StaticDecodeRunner
from tierlm.model.static_slot_copy import StaticSlotCopy
from tierlm.sampling_params import SamplingParams

PROMPT = "The history of the city begins with a small settlement on the river, where"
SYNC_OPS = {"aten::_local_scalar_dense", "tolist"}


class OpCounter(TorchDispatchMode):
    """Counts the non-view ops dispatched while `counting` is set (the fixed-shape forwards unset it)."""

    def __init__(self) -> None:
        super().__init__()
        self.counting, self.ops = True, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting and not func.is_view and func.name() not in ("aten::detach",):
            self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))


def static_runners(engine: LLMEngine, k: int, oracle: bool) -> None:
    """The engine's fixed-shape forwards in mode "eager" (CPU has no graphs): what a GPU would replay; oracle:
    the greedy steps draft a known continuation (`OracleSpeculation`)."""
    blocks = math.ceil(engine.max_model_len / engine.cache.block_size)
    model, cache = engine.model, engine.cache
    runner = engine.runner
    if k == 0:
        runner.static_decode = StaticDecodeRunner(model, cache, 1, blocks, "eager")
        return
    runner.static_verify = StaticDecodeRunner(model, cache, 1, blocks, "eager", rows_per_request=1 + k,
                                              greedy_speculation=True)
    if oracle:
        runner.static_verify.greedy = OracleSpeculation(model, cache, k)
    runner.static_drafts = {(i, rows): StaticDecodeRunner(model, cache, 1, blocks, "eager", draft_layer=i,
                                                          rows_per_request=rows)
                            for i in range(len(model.mtp.layers)) for rows in (1, 1 + k)}
    runner.static_rollback = StaticSlotCopy(cache.target_slot_states, 1, cache.scratch_slot, cache.device, "eager")


def watch_forwards(counter: OpCounter, timing: list[float], replays: list[int], marks: list) -> None:
    """Every StaticDecodeRunner forward (and whole greedy speculative step, and its part after the verify)
    and StaticSlotCopy: one replay, its ops not counted, its time kept apart."""
    original_copy = StaticSlotCopy._copy

    def slot_copy(self, size):
        counter.counting = False
        start = time.perf_counter()
        try:
            return original_copy(self, size)
        finally:
            timing.append(time.perf_counter() - start)
            marks.append(("copy", timing[-1]))
            replays.append(1)
            counter.counting = True

    StaticSlotCopy._copy = slot_copy

    def as_replay(original):
        def replay(*args):
            counter.counting = False
            start = time.perf_counter()
            marks.append(("replay", start))
            try:
                return original(*args)
            finally:
                timing.append(time.perf_counter() - start)
                replays.append(1)
                counter.counting = True
        return replay

    # what a GPU replays as one graph each (the greedy step's eager forms: `replay_greedy` runs the step;
    # `replay_accept` copies the penalized rows' argmaxes in, then runs `_accept_step`)
    for name in ("_forward", "replay_greedy", "_accept_step"):
        setattr(StaticDecodeRunner, name, as_replay(getattr(StaticDecodeRunner, name)))
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        if counter.counting:
            counter.ops["tolist"] += 1
        values = tolist(self)
        marks.append(("read", time.perf_counter()))
        return values

    torch.Tensor.tolist = counted_tolist


def run(args, model: Path, k: int, oracle: list[int] | None) -> dict:
    engine = LLMEngine(EngineConfig(
        model=str(model), dtype="float32", device="cpu", max_num_seqs=1, max_model_len=args.max_model_len,
        kv_cache_memory_bytes=64 << 20, async_scheduling=not args.serial,
        speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None))
    static_runners(engine, k, oracle is not None)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                                              repetition_penalty=args.repetition_penalty))
    engine.step()  # prefill
    if oracle is not None and k:
        request = engine.scheduler.running[0]
        engine.runner.static_verify.greedy.know(request.home_slot, request.prompt_token_ids + oracle)
    counter, forward_s, replays, marks = OpCounter(), [], [], []
    watch_forwards(counter, forward_s, replays, marks)
    steps, out = [], None
    with counter:
        while engine.has_unfinished_requests():
            counter.ops.clear()
            forward_s.clear()
            replays.clear()
            read_at = max((i for i, (kind, _) in enumerate(marks) if kind == "read"), default=None)
            last_read = None if read_at is None else marks[read_at][1]
            # the slot copies after the read: a replay on a GPU, their CPU compute is not host time
            copies_after_read = 0.0 if read_at is None else sum(d for kind, d in marks[read_at:] if kind == "copy")
            marks.clear()
            start = time.perf_counter()
            for output in engine.step():
                out = output
            wall = time.perf_counter() - start
            if oracle is not None:
                for request in engine.scheduler.running:
                    request.draft_token_ids = oracle[len(request.output_token_ids):][:k]
            ops = sum(counter.ops.values())
            syncs = sum(n for name, n in counter.ops.items() if name in SYNC_OPS)
            first_replay = next((t for kind, t in marks if kind == "replay"), None)
            idle = (first_replay - last_read - copies_after_read
                    if last_read is not None and first_replay is not None else float("nan"))
            steps.append((ops + len(replays), len(replays), syncs, wall - sum(forward_s), dict(counter.ops), idle))
    steps = steps[args.warmup:-1]  # the first steps (lazy set-up) and the last (a partial one)
    ops_total = Counter()
    for step in steps:
        ops_total.update(step[4])
    return {
        "tokens": out.outputs[0].token_ids, "steps": len(steps),
        "launches": statistics.median(s[0] for s in steps), "replays": statistics.median(s[1] for s in steps),
        "syncs": statistics.median(s[2] for s in steps), "host_ms": 1000 * statistics.median(s[3] for s in steps),
        "idle_ms": 1000 * statistics.median(s[5] for s in steps) if k else float("nan"),
        "ops": {name: n / len(steps) for name, n in ops_total.most_common()},
        "stats": engine.stats(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("-k", type=int, default=1)
    parser.add_argument("--ops", action="store_true", help="also the ops counted per step, by name")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="the request's repetition_penalty")
    parser.add_argument("--serial", action="store_true", help="no overlap scheduling (the engine's before)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        model = build_demo_model(Path(scratch) / "demo", args.size, mtp=True)
        base = run(args, model, 0, None)
        own = run(args, model, args.k, None)
        oracle = run(args, model, args.k, base["tokens"])
    print(f"# demo {args.size}, CPU, K={args.k}, {'serial' if args.serial else 'overlap scheduling'}: per step "
          "medians (a drafting step verifies K drafts)")
    print(f"{'':34s} {'launches':>9} {'replays':>8} {'syncs':>6} {'host ms':>8} {'idle ms':>8} {'tokens/step':>12}")
    for name, row in (("no drafts", base), ("own drafts (rejected)", own), ("oracle drafts (accepted)", oracle)):
        stats = row["stats"]
        per_step = (stats.num_accepted_tokens + stats.num_drafts) / stats.num_drafts if stats.num_drafts else 1.0
        print(f"{name:34s} {row['launches']:9.0f} {row['replays']:8.0f} {row['syncs']:6.0f} {row['host_ms']:8.3f} "
              f"{row['idle_ms']:8.3f} {per_step:12.2f}")
        if args.ops:
            print("    " + ", ".join(f"{op.removeprefix('aten::')} {n:.1f}" for op, n in row["ops"].items()))
    same = base["tokens"] == own["tokens"] == oracle["tokens"]
    print("tokens identical in every column:", same)


if __name__ == "__main__":
    main()
