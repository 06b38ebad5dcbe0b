"""Host cost of a pipeline step on each rank (PP=2 on CPU, gloo), phase by phase, as CUDA graphs would see it.

The demo model decodes --tokens tokens per stream (1 and 4 streams, greedy, overlap scheduling) with PP=2
on CPU. Both ranks run in processes this script starts (torchrun's environment: rank 0 here, rank 1 in a
child that runs this file with --rank1), so both can be watched. Every decode step goes through the static
decode runners in mode "eager" (the padded batches CUDA graphs replay, run eagerly: the same host path as
on a GPU). Per rank, medians per decode step (every stream in one static forward) after --warmup of them:
- each host phase of the pipeline's own timers (`PipelineDriver.timing`, the worker's phases; bench/
  pipeline_decode.py prints the same on a GPU), the time inside the fixed-shape forwards taken out of
  the phase that runs them (on a GPU they are one graph replay: "fwd" is that CPU time, shown apart);
  the waits (rank 0's ids wait and wait for the answer, rank 1's wait for the message and receive wait)
  are other ranks' work on CPU, shown but not host work;
- a second pass counts, outside the forwards: torch ops dispatched (each a launch or host-side tensor op
  on a GPU; views not counted), Python function calls (sys.setprofile: Python and builtin calls), and
  device reads (`.tolist()`, `.item()`).

    python bench/pipeline_host_cost.py                  # demo tiny, 1 and 4 streams
    python bench/pipeline_host_cost.py --ops            # also the ops counted per step, by name
    python bench/pipeline_host_cost.py --context 8000 --max-model-len 8192 --streams 1   # long block tables
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tierlm.demo_model import build_demo_model
from tierlm.model.static_decode import StaticDecodeRunner

STREAMS = [1, 4]  # --streams
COUNTING = "counted-"  # the request ids of the counting pass (rank 1 starts counting when it sees one)
SYNC_OPS = {"aten::_local_scalar_dense", "tolist"}
RANK0_PHASES = {"ids_wait_seconds": "ids wait*", "prepare_seconds": "prepare", "send_seconds": "send",
                "forward_seconds": "own layers", "wait_seconds": "read ids*", "rest": "engine rest"}
RANK1_PHASES = {"idle_seconds": "wait for message*", "host_seconds": "host", "receive_wait_seconds": "receive wait*",
                "forward_seconds": "launch layers", "sample_seconds": "sample",
                "read_wait_seconds": "read wait*", "send_seconds": "read back"}


class Watch(TorchDispatchMode):
    """One rank's counters for the step under way: time inside the fixed-shape forwards; in the counting
    pass, ops dispatched and Python calls outside them."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.counting = False
        self.forward_s = 0.0
        self.ops: Counter = Counter()
        self.calls = 0
        self.timed: Counter = Counter()  # --time: seconds in each watched function this step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting and not self.inside and not func.is_view and func.name() != "aten::detach":
            self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))

    def profile(self, frame, event, arg) -> None:
        if not self.inside and event in ("call", "c_call"):
            self.calls += 1

    def start_counting(self) -> None:
        self.counting = True
        self.__enter__()
        sys.setprofile(self.profile)

    def take(self) -> dict:
        """This step's counters, reset."""
        out = {"forward_s": self.forward_s, "ops": dict(self.ops), "calls": self.calls, "timed": dict(self.timed)}
        self.forward_s, self.ops, self.calls, self.timed = 0.0, Counter(), 0, Counter()
        return out


def watch_forwards(watch: Watch) -> None:
    """Every StaticDecodeRunner forward: timed apart, nothing inside it counted (a graph replay on a GPU)."""
    original = StaticDecodeRunner._forward
    tolist = torch.Tensor.tolist

    def forward(self, shape):
        watch.inside = True
        start = clock()
        try:
            return original(self, shape)
        finally:
            watch.forward_s += clock() - start
            watch.inside = False

    def counted_tolist(self):
        if watch.counting and not watch.inside:
            watch.ops["tolist"] += 1
        return tolist(self)

    StaticDecodeRunner._forward = forward
    torch.Tensor.tolist = counted_tolist


def use_clock(name: str) -> None:
    """The pipeline's phase timers (and this script's) on `name`'s clock: "cpu" is this thread's CPU time
    (host work only: a blocking wait, or the process descheduled on a busy machine, adds nothing), "wall"
    is time.perf_counter as the engine has it."""
    from types import SimpleNamespace

    from tierlm.engine import pipeline, pipeline_worker, stream_clock

    global clock
    clock = time.thread_time if name == "cpu" else time.perf_counter
    shim = SimpleNamespace(perf_counter=clock, monotonic=time.monotonic, sleep=time.sleep)
    for module in (pipeline, pipeline_worker, stream_clock):
        module.time = shim


clock = time.perf_counter


def time_functions(watch: Watch, paths: list[str]) -> None:
    """--time: each `module:Class.function` (or `module:function`) named, timed per step on the script's
    clock (the forward inside one counts in it). A name this checkout lacks is skipped."""
    import importlib

    for path in paths:
        module_name, _, qualname = path.partition(":")
        *owners, name = qualname.split(".")
        owner = importlib.import_module(module_name)
        for part in owners:
            owner = getattr(owner, part, None)
        original = getattr(owner, name, None)
        if original is None:
            continue

        def timed(*args, _original=original, _path=path, **kwargs):
            start = clock()
            try:
                return _original(*args, **kwargs)
            finally:
                watch.timed[_path] += clock() - start

        setattr(owner, name, staticmethod(timed) if isinstance(owner, type) and isinstance(
            owner.__dict__.get(name), staticmethod) else timed)


def engine_options(args) -> dict:
    return {"dtype": "float32", "device": "cpu", "max_model_len": args.max_model_len,
            "max_num_seqs": max(STREAMS), "pipeline_parallel_size": 2}


# ---- rank 1 (a child process) ----------------------------------------------------------------------------
def rank1_main(args) -> None:
    """Serve rank 1 with its steps watched; at the stop message, write each step's counters to args.rank1."""
    from tierlm import LLM
    from tierlm.distributed import group as group_module
    from tierlm.engine import pipeline_worker

    watch, steps = Watch(), []
    watch_forwards(watch)
    time_functions(watch, args.time)
    get, run_worker = group_module.Inbox.get, pipeline_worker.run_worker
    state = {"stats": None, "count_from": None}

    def inbox_get(self):
        """A step boundary: the worker's phase sums so far (its `stats` local) and this step's counters."""
        frame = sys._getframe(1)
        while frame is not None and "stats" not in frame.f_locals:  # run_worker's frame, a call or two up
            frame = frame.f_back
        stats = None if frame is None else frame.f_locals["stats"]
        if stats is not None and self.tag == group_module.STEP_TAG and self.src == 0:
            steps.append({"phases": dict(stats), **watch.take()})
            if state["count_from"] is not None and stats["steps"] >= state["count_from"] and not watch.counting:
                watch.start_counting()
        message = get(self)
        if state["count_from"] is None and any(new.request_id.startswith(COUNTING) for new in
                                               getattr(message, "new_requests", ())):
            state["count_from"] = stats["steps"] + 1  # the counting pass's requests are in: count from the next step
        return message

    def watched(group, stage, config):
        try:
            run_worker(group, stage, config)
        finally:
            sys.setprofile(None)
            Path(args.rank1).write_text(json.dumps(steps))

    group_module.Inbox.get = inbox_get
    pipeline_worker.run_worker = watched
    LLM(args.model, **engine_options(args))  # serves rank 1 until rank 0 stops it; exits the process


# ---- rank 0 ----------------------------------------------------------------------------------------------
def run(args) -> tuple[list[dict], list[dict]]:
    """Both ranks' per-step records over every stream count (rank 0's tagged with its stream count)."""
    from tierlm import LLM, SamplingParams

    port = 29500 + os.getpid() % 1000
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    rank1_out = Path(args.scratch) / "rank1.json"
    child = subprocess.Popen([sys.executable, __file__, "--rank1", str(rank1_out), "--model", args.model,
                              "--max-model-len", str(args.max_model_len), "--context", str(args.context), "--streams", *map(str, args.streams), "--clock", args.clock, "--time", *args.time],
                             env=dict(env, RANK="1"))
    os.environ.update(env, RANK="0")
    watch = Watch()
    watch_forwards(watch)
    time_functions(watch, args.time)
    llm = LLM(args.model, **engine_options(args))
    engine = llm.engine
    assert engine.overlap and engine.runner.static_decode is not None
    records = []
    try:
        for counting in (False, True):
            for streams in args.streams:
                params = SamplingParams(temperature=0, max_tokens=args.warmup + args.tokens + 8, ignore_eos=True)
                vocab = engine.model_config.vocab_size
                for i in range(streams):
                    # --context: a prompt of that many ids (block tables of context / block_size entries)
                    prompt = ([(7 + 31 * i + 17 * j) % (vocab - 2) + 1 for j in range(args.context)] if args.context
                              else f"# stream {i}\ndef f(x):")
                    engine.add_request(prompt, params, request_id=f"{COUNTING if counting else ''}{streams}-{i}")
                if counting and not watch.counting:
                    watch.start_counting()
                step = 0
                while engine.has_unfinished_requests():
                    before = engine.pipeline.timing
                    watch.take()
                    start = clock()
                    engine.step()
                    wall = clock() - start
                    after = engine.pipeline.timing
                    # decode steps only (one static forward of every stream), after the first --warmup of them
                    decode = after["static_steps"] - before["static_steps"] == 1 and len(engine.scheduler.running) == streams
                    step += decode
                    if decode and args.warmup < step <= args.warmup + args.tokens:
                        phases = {k: after[k] - before[k] for k in RANK0_PHASES if k != "rest"}
                        phases["rest"] = wall - sum(phases.values())
                        records.append({"streams": streams, "counting": counting, "wall": wall, "phases": phases,
                                        "steps": (before["steps"] + 1, after["steps"]), **watch.take()})
    finally:
        sys.setprofile(None)
        engine.close()
    child.wait(timeout=60)
    return records, json.loads(rank1_out.read_text())


def rank1_records(rank1: list[dict], rank0: list[dict]) -> list[dict]:
    """Rank 1's per-step phases and counters for the steps rank 0 recorded (matched by step number)."""
    by_step = {}
    for before, after in itertools.pairwise(rank1):
        number = after["phases"]["steps"]
        if number == before["phases"]["steps"] + 1:
            by_step[number] = {"phases": {k: after["phases"][k] - before["phases"][k] for k in RANK1_PHASES},
                               "forward_s": after["forward_s"], "ops": after["ops"], "calls": after["calls"],
                               "timed": after["timed"]}
    out = []
    for record in rank0:
        first, last = record["steps"]
        for number in range(first, last + 1):
            if number in by_step:
                out.append(dict(by_step[number], streams=record["streams"], counting=record["counting"]))
    return out


def summarize(records: list[dict], phases: dict[str, str], forward_phase: str) -> dict:
    """Per stream count: the median of each phase (the forwards taken out of forward_phase), of the
    forwards, and (counting pass) of ops, Python calls and device reads per step."""
    out = {}
    for streams in sorted({r["streams"] for r in records}):
        timed = [r for r in records if r["streams"] == streams and not r["counting"]]
        counted = [r for r in records if r["streams"] == streams and r["counting"]]
        row = {}
        for key, name in phases.items():
            values = [r["phases"][key] - (r["forward_s"] if key == forward_phase else 0.0) for r in timed]
            row[name] = 1e3 * statistics.median(values)
        row["fwd (a replay)"] = 1e3 * statistics.median(r["forward_s"] for r in timed)
        row["host (no waits, no fwd)"] = sum(v for k, v in row.items() if not k.endswith("*") and k[:3] != "fwd")
        row["ops"] = statistics.median(sum(r["ops"].values()) for r in counted)
        row["py calls"] = statistics.median(r["calls"] for r in counted)
        row["reads"] = statistics.median(sum(n for k, n in r["ops"].items() if k in SYNC_OPS) for r in counted)
        total = Counter()
        for r in counted:
            total.update(r["ops"])
        row["by op"] = {k: n / len(counted) for k, n in total.most_common()}
        row["functions"] = {name: 1e3 * statistics.median(r["timed"].get(name, 0.0) for r in timed)
                            for name in sorted({name for r in timed for name in r["timed"]})}
        out[streams] = row
    return out


def report(rank0: dict, rank1: dict, show_ops: bool) -> None:
    print("# PP=2 on CPU (gloo), demo tiny, static decode runners eager; ms per step (medians). *: waiting for "
          "another rank (on CPU: its compute); fwd: the fixed-shape forward (one graph replay on a GPU)")
    for streams, row0 in rank0.items():
        print(f"\n{streams} stream(s)")
        for rank, row in (("rank 0", row0), ("rank 1", rank1[streams])):
            times = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float) and k not in
                              ("ops", "py calls", "reads"))
            print(f"  {rank}: {times}")
            print(f"          outside the forward: {row['ops']:.0f} ops, {row['py calls']:.0f} Python calls, "
                  f"{row['reads']:.0f} device reads")
            for name, ms in row["functions"].items():
                print(f"          {name}: {ms:.3f}")
            if show_ops:
                print("          " + ", ".join(f"{k.removeprefix('aten::')} {n:.1f}" for k, n in row["by op"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48, help="decode steps measured per stream count")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--streams", type=int, nargs="+", default=STREAMS, help="stream counts (default 1 4)")
    parser.add_argument("--context", type=int, default=0, help="prompt tokens per stream (default: a short prompt)")
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the tiny demo model)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu (default): each rank's main thread CPU time (robust on a shared machine); wall")
    parser.add_argument("--ops", action="store_true", help="also the ops counted per step, by name")
    parser.add_argument("--time", nargs="*", default=[], metavar="MODULE:FUNCTION",
                        help="also the median time per step in these functions, on each rank (e.g. "
                             "tierlm.engine.sampler:Sampler.launch)")
    parser.add_argument("--json", default=None, help="also write the summaries here")
    parser.add_argument("--rank1", default=None, help=argparse.SUPPRESS)  # the child: rank 1's output file
    args = parser.parse_args()
    os.environ["TIERLM_STATIC_DECODE_EAGER"] = "1"
    torch.set_num_threads(1)
    use_clock(args.clock)
    if args.rank1:
        rank1_main(args)
        return
    with tempfile.TemporaryDirectory() as scratch:
        args.scratch = scratch
        if args.model is None:
            args.model = str(build_demo_model(Path(scratch) / "tiny", "tiny"))
        rank0, rank1 = run(args)
    rank0_rows = summarize(rank0, RANK0_PHASES, "forward_seconds")
    rank1_rows = summarize(rank1_records(rank1, rank0), RANK1_PHASES, "forward_seconds")
    report(rank0_rows, rank1_rows, args.ops)
    if args.json:
        Path(args.json).write_text(json.dumps({"rank0": rank0_rows, "rank1": rank1_rows}, indent=2))


if __name__ == "__main__":
    main()
