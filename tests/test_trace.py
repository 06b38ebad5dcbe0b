"""--trace FILE: a Chrome-trace JSON with every step's host phases, in order, one set per step."""

from __future__ import annotations

import json

import pytest

from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model

PHASES = ["schedule", "prepare batch", "launch forward", "sample", "read sampled ids", "apply, detokenize"]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_trace_has_every_step_and_its_phases_in_order(tmp_path, overlap):
    """Serial: every step's phases, in order. Overlap scheduling: a step launches its forward before it
    reads back the step before (the last step only reads back)."""
    model = build_demo_model(tmp_path / "tiny", "tiny")
    path = tmp_path / "trace" / "steps.json"
    llm = LLM(str(model), device="cpu", max_model_len=256, max_num_batched_tokens=32, trace=str(path),
              async_scheduling=overlap)
    prompts = ["def parse(tokens):\n" * 6, "import os\n"]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    llm.engine.close()
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    steps = trace["otherData"]["steps"]
    marks = [e for e in events if e["name"] == "step"]
    assert steps == len(marks) >= 5 + 1  # at least one prefill step (chunks of 32 tokens) and 5 decodes
    assert sum(m["args"]["tokens"] for m in marks) == sum(
        len(llm.engine.tokenizer.encode(p)) for p in prompts) + 2 * 5 - 2  # the last tokens are never fed back
    by_step: dict[int, list[dict]] = {}
    for event in events:
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["tid"] == "host"
            by_step.setdefault(event["args"]["step"], []).append(event)
    assert sorted(by_step) == list(range(steps))
    launched_before_read = 0
    for step, phases in by_step.items():
        names = [e["name"] for e in sorted(phases, key=lambda e: e["ts"])]
        if not overlap:
            assert names == PHASES, step
            continue
        assert names[0] == "schedule" and set(names) <= set(PHASES), (step, names)
        if "launch forward" in names and "read sampled ids" in names:
            assert names.index("launch forward") < names.index("read sampled ids"), (step, names)
            launched_before_read += 1
    if overlap:
        assert launched_before_read >= 5  # every decode step but the first ran behind the one before
        ends = [e["ts"] + e["dur"] for e in sorted(phases, key=lambda e: e["ts"])]
        starts = [e["ts"] for e in sorted(phases, key=lambda e: e["ts"])]
        assert all(end <= next_start + 1e-3 for end, next_start in zip(ends, starts[1:]))  # no overlap
