"""Kernel launches of one decode step vs one whole greedy speculative step, counted on CPU, by phase.

What a CUDA graph of the step replays is the ops and Triton launches its eager form issues. On CPU the
model takes its torch paths; --gpu-paths counts what a GPU runs instead: Triton in interpreter mode
(TRITON_INTERPRET=1, set here before triton is imported) and every tensor answering is_cuda = True, so
each layer takes its CUDA branch (fused kernels) on CPU tensors. Counted: every non-view torch op except
allocations (what becomes a kernel, or a cuBLAS call, on a GPU) and every Triton launch; the ops inside
an interpreted launch are not. Phases: the verify forward, the draft head's forwards, the K-1 draft
steps' own ops, slot copies, and the rest (acceptance, the readback tensor, the input ids).

    python bench/spec_step_ops.py                   # demo tiny, K = 0 (no drafts), 1, 3; torch paths
    python bench/spec_step_ops.py --gpu-paths -k 1  # the CUDA paths (slow: the kernels are interpreted)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

ALLOCATIONS = ("aten::empty", "aten::new_empty", "aten::_unsafe_view", "aten::detach", "aten::lift_fresh")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("-k", type=int, nargs="+", default=[0, 1, 3], help="drafts per step (0: plain decode)")
    parser.add_argument("--gpu-paths", action="store_true", help="count the CUDA paths (see above)")
    parser.add_argument("--ops", action="store_true", help="also each phase's ops by name")
    args = parser.parse_args()
    if args.gpu_paths:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    if args.gpu_paths:
        from triton.runtime import interpreter

        torch.Tensor.is_cuda = property(lambda self: True)
    from tierlm.demo_model import build_demo_model
    from tierlm.engine.llm_engine import EngineConfig, LLMEngine
    from tierlm.model import qwen4_exp, speculative_step
    from tierlm.model.cache.slot_state import SlotState
    from tierlm.model.static_decode import StaticDecodeRunner
    from tierlm.sampling_params import SamplingParams

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counting, self.phases, self.ops = False, ["other"], defaultdict(Counter)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name()
            if self.counting and not func.is_view and not name.startswith(ALLOCATIONS):
                self.ops[self.phases[-1]][name.removeprefix("aten::")] += 1
            return func(*args, **(kwargs or {}))

    ops = Ops()

    def in_phase(name, function):
        def run(*a, **k):
            ops.phases.append(name)
            try:
                return function(*a, **k)
            finally:
                ops.phases.pop()
        return run

    if args.gpu_paths:
        launch = interpreter.InterpretedFunction.run

        def counted_launch(self, *a, **k):
            counting = ops.counting
            if counting:
                ops.ops[ops.phases[-1]]["triton:" + self.fn.__name__] += 1
            ops.counting = False  # not the interpreter's own torch ops
            try:
                return launch(self, *a, **k)
            finally:
                ops.counting = counting
        interpreter.InterpretedFunction.run = counted_launch
    model_class = qwen4_exp.Qwen4ExpForCausalLM
    model_class.forward_with_streams = in_phase("verify forward", model_class.forward_with_streams)
    model_class.draft = in_phase("draft head", model_class.draft)
    SlotState.copy_slots = in_phase("slot copies", SlotState.copy_slots)
    speculation = speculative_step.GreedySpeculation
    speculation._draft_steps = in_phase("draft steps", speculation._draft_steps)

    def counting(replay):
        """The step's replay (eager here) with its ops counted."""
        def counted(*a, **kw):
            ops.counting = True
            try:
                return replay(*a, **kw)
            finally:
                ops.counting = False
        return counted

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as scratch:
        model = build_demo_model(Path(scratch) / "demo", args.size, mtp=True)
        print(f"# demo {args.size}, one request, {'CUDA' if args.gpu_paths else 'torch'} paths: launches per step")
        for k in args.k:
            engine = LLMEngine(EngineConfig(
                model=str(model), dtype="float32", device="cpu", max_num_seqs=1, max_model_len=512,
                kv_cache_memory_bytes=256 << 20,
                speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None))
            blocks, runner = math.ceil(engine.max_model_len / engine.cache.block_size), engine.runner
            if k:
                runner.static_verify = step = StaticDecodeRunner(
                    engine.model, engine.cache, 1, blocks, "eager", rows_per_request=1 + k, greedy_speculation=True)
                name = "replay_greedy"
            else:
                runner.static_decode = step = StaticDecodeRunner(engine.model, engine.cache, 1, blocks, "eager")
                name = "_forward"

            setattr(step, name, counting(getattr(step, name)))
            engine.add_request("The history of the city begins with a small settlement",
                               SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            engine.step()  # prefill
            engine.step()  # the first decode (or drafting) step
            ops.ops.clear()
            with ops:
                engine.step()
            engine.close()
            phases = {phase: sum(c.values()) for phase, c in ops.ops.items()}
            print(f"K={k}: {sum(phases.values())} (" + ", ".join(f"{p} {n}" for p, n in phases.items()) + ")")
            if args.ops:
                for phase, counter in ops.ops.items():
                    print(f"    {phase}: " + ", ".join(f"{op} {n}" for op, n in counter.most_common()))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
