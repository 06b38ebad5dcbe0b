"""One greedy stream with MTP speculative decoding vs without, side by side as a ratio.

A demo model with an MTP head (built if missing, or --model DIR with `mtp.*` tensors), one prompt, --tokens
greedy tokens. Columns: without drafts (CUDA graphs on GPU, as the engine runs by default; and eager),
with the model's own draft head (random weights: acceptance near zero, so this is the rollback's cost),
and with oracle drafts (the known greedy continuation: every draft accepted, the ceiling of the speed-up;
made on the device by `OracleSpeculation` in the greedy steps' graphs, so the steps overlap scheduling
chains verify them too), each drafting column also without overlap scheduling (the engine before it
applied to drafting steps).
The drafting columns run as the engine does by default too (on GPU the verify steps replay CUDA graphs).
The oracle's continuation is the speculative path's own greedy output: a first oracle run takes the
no-draft tokens, and while its output differs from the continuation it was given (bf16: verify rows and
decode rows may round differently, and one flipped argmax puts every later draft out of step) the run is
repeated with that output (at most ORACLE_RUNS), the last one timed (a line says whether it converged: if
not, its later drafts are wrong, and its acceptance, printed beside its time, is below 100%). fp32: every
column must give the same tokens (the script exits non-zero otherwise); other dtypes: differences are
reported. The prefill and the first token are outside the timing: every chunk of it (with prefix caching
the prompt is split at its last block boundary, where its checkpoint is taken: the demo-small prompt's 21
tokens are two chunks, 16 + 5), which run eagerly, tens of ms each on a GPU. The timed loop took the
second chunk in before: on the H200 the wall time then exceeded the median step's device time by 37-51 ms
a run in every column (0.14-0.2 ms per token of 255), about what one eager chunk costs there. Each
timed loop starts after a garbage collection: an engine holds reference cycles, so the
earlier columns' engines (their CUDA graphs, pinned pools) are freed by the cyclic collector, which must not
run inside another column's timing.

    python bench/spec_decode.py                          # CPU
    python bench/spec_decode.py --device cuda --size small --tokens 256 -k 1
    python bench/spec_decode.py --device cuda --size small --tokens 256 -k 1 --phases   # + where a step's time goes
    python bench/spec_decode.py --model models/default_model --dtype float32 -k 1 --repetition-penalty 1
    python bench/spec_decode.py --device cuda --real-width 4 --tokens 128 -k 1   # decode_roofline's stack

--token-map FILE (a speculative token map, `tierlm draft-vocab`) or --token-map-size N (ids 0..N-1: with
random weights any N ids cost the same): two more columns, the head's drafts and the oracle's, with the draft
head's logits from the map's rows alone (its acceptance: how often the trained head's draft was in the map
and right; its time: what the smaller head saves).

    python bench/spec_decode.py --device cuda --real-width 4 --tokens 128 -k 1 --token-map-size 32768

--real-width LAYERS: instead of a demo model, the real-width stack of bench/decode_roofline.py (LAYERS layers,
3 GDN : 1 QSA) with an MTP head of one QSA layer, random weights drawn at load (`--load-format dummy`):
where a step costs its bytes, not its launches.

--repetition-penalty: the request's (default: the model's generation_config; the trained default's is 1.05,
so its verify rows are penalized with the drafts before them).

On CUDA an untimed run of the same length without and with drafts comes first, so no column's time
includes Triton compiles (a cold cache put seconds of them into the first columns; a 48-token warm-up was
not enough: the block-table widths a longer run reaches compile their own kernels).

--phases: each column runs under the engine's --trace and prints, per step, the median, mean and largest of
its host phases and (CUDA) of its device spans, and in how many steps each ran: "forward" (the decode
replay, or a greedy drafting step's one replay: verify, accept, roll back, draft; a penalized step's verify
replay alone), "accept, draft" (a penalized step's work queued after that) and "between forwards" (device
time from the end of the last span before a forward to its start: the time the device waited for the
host). The device spans tile the device's time from the first forward to the last, so their means per step
add up to the wall time per step (printed beside them); medians alone hide the steps that take far longer
(a stall of the host, a step that is not chained: "schedule" runs in every step that is not).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tierlm.demo_model import build_demo_model
from tierlm.engine.llm_engine import EngineConfig, LLMEngine
from tierlm.engine.speculative import speculates
from tierlm.model import static_decode
from tierlm.model.speculative_step import OracleSpeculation
from tierlm.sampling_params import SamplingParams

ORACLE_RUNS = 8
PROMPT = "The history of the city begins with a small settlement on the river, where"


def run(args, speculative: bool, eager: bool, oracle: list[int] | None = None, overlap: bool = True,
        token_map: str | None = None) -> tuple[list[int], float, object]:
    config = {"method": "mtp", "num_speculative_tokens": args.k} if speculative else None
    if token_map is not None:
        config["speculative_token_map"] = token_map
    trace = None
    if args.phases:
        trace = Path(tempfile.mkdtemp(prefix="spec-trace-")) / "trace.json"
    # oracle: the greedy steps' graphs draft the known continuation on the device (steps chained by overlap
    # scheduling verify drafts the host has not read); the host sets the drafts of the other steps
    greedy_step = static_decode.GreedySpeculation
    if oracle is not None:
        static_decode.GreedySpeculation = OracleSpeculation
    try:
        engine = LLMEngine(EngineConfig(model=str(args.model), dtype=args.dtype, device=args.device, max_num_seqs=1,
                                        load_format="auto" if args.real_width is None else "dummy",
                                        max_model_len=args.max_model_len, enforce_eager=eager,
                                        speculative_config=config, trace=str(trace) if trace else None,
                                        async_scheduling=overlap))
    finally:
        static_decode.GreedySpeculation = greedy_step
    args.resolved_dtype = engine.cache.dtype
    # --repetition-penalty unset: the model's generation_config default (the trained default's is 1.05)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                            repetition_penalty=args.repetition_penalty)
    engine.add_request(args.prompt, params)
    engine.step()
    request = engine.scheduler.running[0]
    while request.num_computed_tokens < request.num_prompt_tokens:  # the prefill's other chunks (see above)
        engine.step()
    verify = getattr(engine.runner, "static_verify", None)
    if oracle is not None and verify is not None and verify.greedy is not None:
        verify.greedy.know(request.home_slot, request.prompt_token_ids + oracle)
    gc.collect()  # the earlier columns' engines (see the module docstring)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()  # the last prefill chunk may be in flight (overlap scheduling)
    start = time.perf_counter()
    out, steps = None, 0
    while engine.has_unfinished_requests():
        if oracle is not None:  # the drafts the host has, as the engine drafts (a chained step's: the graph's)
            for running in filter(speculates, engine.scheduler.running):
                running.draft_token_ids = oracle[len(running.output_token_ids) :][: args.k]
        steps += 1
        for output in engine.step():
            out = output
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if trace is not None:
        engine.close()
        atexit.unregister(engine.trace.flush)
        print_phases(("drafts, " if speculative else "no drafts, ") + ("eager" if eager else "default")
                     + (", oracle" if oracle is not None else "") + ("" if overlap else ", serial"), trace,
                     1000 * seconds / steps, steps)
        shutil.rmtree(trace.parent)
    return out.outputs[0].token_ids, seconds, engine.stats()


def print_phases(name: str, trace: Path, wall_ms: float, steps: int) -> None:
    """Each host phase and device span of the trace in ms per step: median, mean (over every step after the
    first timed one: a phase a step skips counts 0 there) and largest, and in how many steps it ran."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"
              and e["args"].get("step", 0) > 1]
    spans: dict[tuple[str, str], dict[int, float]] = {}
    for event in events:
        per_step = spans.setdefault((event["tid"], event["name"]), {})
        per_step[event["args"]["step"]] = per_step.get(event["args"]["step"], 0.0) + event["dur"] / 1000
    counted = len({event["args"]["step"] for event in events})
    print(f"  {name}: {steps} steps, {wall_ms:.3f} ms per step of wall time; ms per step:")
    print(f"    {'':4s} {'':28s} {'median':>8s} {'mean':>8s} {'max':>8s} {'steps':>6s}")
    for (track, phase), per_step in spans.items():
        values = list(per_step.values())
        print(f"    {track:4s} {phase:28s} {statistics.median(values):8.3f} {sum(values) / counted:8.3f} "
              f"{max(values):8.3f} {len(values):6d}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint with mtp.* tensors (default: a demo model)")
    parser.add_argument("--size", default="tiny", help="demo model size when --model is not given")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("-k", type=int, default=1, help="num_speculative_tokens")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="the request's repetition_penalty (default: the model's generation_config, if any)")
    parser.add_argument("--prompt", default=PROMPT, help="the one request's prompt (default: a line of prose)")
    parser.add_argument("--phases", action="store_true", help="per column, where a step's time goes (see above)")
    parser.add_argument("--real-width", type=int, default=None, metavar="LAYERS",
                        help="decode_roofline's real-width stack of LAYERS layers with an MTP head, random weights")
    maps = parser.add_mutually_exclusive_group()
    maps.add_argument("--token-map", default=None, metavar="FILE",
                      help="also the drafting columns with this speculative token map (`tierlm draft-vocab`)")
    maps.add_argument("--token-map-size", type=int, default=None, metavar="N",
                      help="also the drafting columns with a map of token ids 0..N-1 (random weights: any N ids cost "
                           "the same)")
    args = parser.parse_args()
    if args.token_map_size is not None:
        if args.token_map_size < 1:
            parser.error(f"--token-map-size must be at least 1, got {args.token_map_size}")
        handle, args.token_map = tempfile.mkstemp(prefix="tierlm-bench-token-map-", suffix=".json")
        with open(handle, "w") as f:
            json.dump(list(range(args.token_map_size)), f)
        atexit.register(Path(args.token_map).unlink, True)
    if args.real_width is not None:
        if args.model is not None:
            parser.error("--real-width draws its own model: give it without --model")
        if args.real_width < 1:
            parser.error(f"--real-width: layers must be at least 1, got {args.real_width}")
        from long_context_resident import model_dir

        folder = Path(tempfile.mkdtemp(prefix="tierlm-bench-real-width-mtp-"))
        atexit.register(shutil.rmtree, folder, True)
        args.model = model_dir(folder, False, args.max_model_len, args.real_width, mtp=True)
    if args.model is None:
        args.model = Path(f"/tmp/tierlm-bench-demo-{args.size}-mtp")
        if not (args.model / "config.json").is_file():
            build_demo_model(args.model, args.size, mtp=True, overwrite=True)
    if args.device.startswith("cuda"):  # compile every Triton kernel both columns need before any timing
        untimed = argparse.Namespace(**{**vars(args), "phases": False})
        run(untimed, speculative=False, eager=False)
        run(untimed, speculative=True, eager=False)
        run(untimed, speculative=True, eager=False, overlap=False)  # the serial steps' own kernels and shapes
        if args.token_map is not None:
            run(untimed, speculative=True, eager=False, token_map=args.token_map)
    base, base_s, _ = run(args, speculative=False, eager=False)
    eager, eager_s, _ = run(args, speculative=False, eager=True)
    own, own_s, own_stats = run(args, speculative=True, eager=False)
    own_serial, own_serial_s, own_serial_stats = run(args, speculative=True, eager=False, overlap=False)
    continuation = base
    for runs in range(1, ORACLE_RUNS + 1):
        oracle, oracle_s, oracle_stats = run(args, speculative=True, eager=False, oracle=continuation)
        if oracle == continuation:
            print(f"oracle continuation: the output of its own run {runs} (timed)")
            break
        first = next((i for i, (a, b) in enumerate(zip(continuation, oracle)) if a != b), None)
        print(f"oracle run {runs}: its output left the continuation at token {first}")
        continuation = oracle
    oracle_serial, oracle_serial_s, oracle_serial_stats = run(args, speculative=True, eager=False,
                                                              oracle=continuation, overlap=False)
    n = len(base) - 1  # tokens timed (the first came with the prefill)
    rows = [("no drafts (default: graphs on GPU)", base_s, None), ("no drafts, eager", eager_s, None),
            ("MTP head (own drafts)", own_s, own_stats),
            ("MTP head, no overlap scheduling", own_serial_s, own_serial_stats),
            ("oracle drafts (all accepted)", oracle_s, oracle_stats),
            ("oracle drafts, no overlap scheduling", oracle_serial_s, oracle_serial_stats)]
    mapped = {}
    if args.token_map is not None:  # the draft head's logits from the map's rows alone
        mapped["MTP head, token map"] = run(args, speculative=True, eager=False, token_map=args.token_map)
        mapped["oracle, token map"] = run(args, speculative=True, eager=False, oracle=continuation,
                                          token_map=args.token_map)
        with open(args.token_map) as f:
            print(f"token map: {len(json.load(f)):,} token ids ({args.token_map})")
        rows += [(name, seconds, stats) for name, (_, seconds, stats) in mapped.items()]
    print(f"{args.model}, {args.device}, K={args.k}, {n} tokens timed")
    for name, seconds, stats in rows:
        accept = ""
        if stats is not None and stats.num_draft_tokens:
            accept = (f", accepted {stats.num_accepted_tokens}/{stats.num_draft_tokens} drafts, "
                      f"{(stats.num_accepted_tokens + stats.num_drafts) / stats.num_drafts:.2f} tokens/verify")
        print(f"  {name:38s} {1000 * seconds / n:8.2f} ms/token  x{base_s / seconds:5.2f} vs default, "
              f"x{eager_s / seconds:5.2f} vs eager{accept}")
    columns = [("eager", eager), ("MTP head", own), ("MTP head, serial", own_serial), ("oracle", oracle),
               ("oracle, serial", oracle_serial), *((name, tokens) for name, (tokens, _, _) in mapped.items())]
    same = all(tokens == base for _, tokens in columns)
    print("tokens identical in every column:", same)
    if not same:
        for name, tokens in columns:
            first = next((i for i, (a, b) in enumerate(zip(base, tokens)) if a != b), None)
            print(f"  {name}: {'same' if first is None else f'first differs at token {first}'}")
    print(json.dumps({"base_ms": 1000 * base_s / n, "own_ms": 1000 * own_s / n, "oracle_ms": 1000 * oracle_s / n,
                      "own_serial_ms": 1000 * own_serial_s / n, "oracle_serial_ms": 1000 * oracle_serial_s / n,
                      **{f"{name}_ms": 1000 * seconds / n for name, (_, seconds, _) in mapped.items()}}))
    return 0 if same or args.resolved_dtype != torch.float32 else 1


if __name__ == "__main__":
    sys.exit(main())
