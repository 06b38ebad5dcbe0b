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

--variants SPEC [SPEC ...] (and --rounds N): instead of the table, the no-drafts, own-drafts and oracle columns
under each variant, interleaved in one process: `base`, or NAME=VALUE[,NAME=VALUE...] as bench/tiles_ab.py
takes them (environment variables, and the decode kernels' module constants its docstring names). Each round runs every variant (rotated order); printed: each round's
ms/token and speed-ups, then the medians and each variant's over the first's. A demo model's step is
launch- and host-bound, so its no-drafts column moves between runs of one process (0.33-0.55 ms/token,
demo-small on an H100, session 23): compare medians of several rounds, and read its ratios to the no-drafts
column with that spread in mind.

    python bench/spec_decode.py --device cuda --size small --tokens 256 --rounds 3 \
        --variants base DENSE_GEMV_MAX_ROWS=1

--kernels (CUDA): instead of timing, each column's kernels over 20 decode steps under torch.profiler (CUDA
graph replays included), PDL off (TIERLM_NO_PDL=1: under PDL a kernel's time includes its wait on the kernel
before it): device us a step and launches a step per kernel name, side by side, and the total a token.

    python bench/spec_decode.py --device cuda --real-width 4 -k 1 --token-map-size 32768 --kernels
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
from decode_roofline import environment, parse_variants
from device_timing import cuda_events
from tiles_ab import environment as variant_environment

from tierlm.demo_model import build_demo_model
from tierlm.engine.llm_engine import EngineConfig, LLMEngine
from tierlm.engine.speculative import speculates
from tierlm.model import static_decode
from tierlm.model.speculative_step import OracleSpeculation
from tierlm.sampling_params import SamplingParams

ORACLE_RUNS = 8
KERNEL_WARMUP_STEPS, KERNEL_STEPS = 10, 20  # --kernels' steps: untimed, then profiled
KERNEL_ROWS = 40  # --kernels' kernel names printed (the largest in any column)
PROMPT = "The history of the city begins with a small settlement on the river, where"


def make_engine(args, speculative: bool, eager: bool, oracle: bool = False, overlap: bool = True,
                token_map: str | None = None, trace: Path | None = None) -> LLMEngine:
    config = {"method": "mtp", "num_speculative_tokens": args.k} if speculative else None
    if token_map is not None:
        config["speculative_token_map"] = token_map
    # oracle: the greedy steps' graphs draft the known continuation on the device (steps chained by overlap
    # scheduling verify drafts the host has not read); the host sets the drafts of the other steps
    greedy_step = static_decode.GreedySpeculation
    if oracle:
        static_decode.GreedySpeculation = OracleSpeculation
    try:
        return LLMEngine(EngineConfig(model=str(args.model), dtype=args.dtype, device=args.device, max_num_seqs=1,
                                      load_format="auto" if args.real_width is None else "dummy",
                                      max_model_len=args.max_model_len, enforce_eager=eager,
                                      speculative_config=config, trace=str(trace) if trace else None,
                                      async_scheduling=overlap))
    finally:
        static_decode.GreedySpeculation = greedy_step


def start(engine: LLMEngine, args, oracle: list[int] | None):
    """The one request added and its prefill run (every chunk, see above); the step function that decodes the
    rest (with oracle: each step's drafts set first, as the engine drafts; a chained step's: the graph's)."""
    # --repetition-penalty unset: the model's generation_config default (the trained default's is 1.05,
    # so its verify rows are penalized with the drafts before them)
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

    def step() -> list:
        if oracle is not None:
            for running in filter(speculates, engine.scheduler.running):
                running.draft_token_ids = oracle[len(running.output_token_ids) :][: args.k]
        return engine.step()

    return request, step


def run(args, speculative: bool, eager: bool, oracle: list[int] | None = None, overlap: bool = True,
        token_map: str | None = None) -> tuple[list[int], float, object]:
    trace = None
    if args.phases:
        trace = Path(tempfile.mkdtemp(prefix="spec-trace-")) / "trace.json"
    engine = make_engine(args, speculative, eager, oracle is not None, overlap, token_map, trace)
    args.resolved_dtype = engine.cache.dtype
    _, step = start(engine, args, oracle)
    gc.collect()  # the earlier columns' engines (see the module docstring)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()  # the last prefill chunk may be in flight (overlap scheduling)
    began = time.perf_counter()
    out, steps = None, 0
    while engine.has_unfinished_requests():
        steps += 1
        for output in step():
            out = output
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    if trace is not None:
        engine.close()
        atexit.unregister(engine.trace.flush)
        print_phases(("drafts, " if speculative else "no drafts, ") + ("eager" if eager else "default")
                     + (", oracle" if oracle is not None else "") + ("" if overlap else ", serial"), trace,
                     1000 * seconds / steps, steps)
        shutil.rmtree(trace.parent)
    return out.outputs[0].token_ids, seconds, engine.stats()


def run_oracle(args, continuation: list[int], token_map: str | None = None,
               quiet: bool = False) -> tuple[list[int], float, object, list[int]]:
    """The oracle column, rerun (at most ORACLE_RUNS times) with its own output while that leaves the
    continuation it was given (see above): tokens, seconds and stats of the last run, and the continuation it
    was given."""
    for runs in range(1, ORACLE_RUNS + 1):
        oracle, seconds, stats = run(args, speculative=True, eager=False, oracle=continuation, token_map=token_map)
        if oracle == continuation:
            if not quiet:
                print(f"oracle continuation: the output of its own run {runs} (timed)")
            break
        if not quiet:
            first = next((i for i, (a, b) in enumerate(zip(continuation, oracle)) if a != b), None)
            print(f"oracle run {runs}: its output left the continuation at token {first}")
        continuation = oracle
    return oracle, seconds, stats, continuation


def kernel_table(args, speculative: bool, oracle: list[int] | None = None,
                 token_map: str | None = None) -> tuple[dict[str, tuple[float, float]], float]:
    """--kernels: {kernel name: (launches, device us)} per decode step over KERNEL_STEPS profiled steps
    (after KERNEL_WARMUP_STEPS; `device_timing.cuda_events`: CUPTI records the kernels of CUDA graph
    replays too), PDL off (with it a kernel's time includes its wait on the one before), and the tokens a
    step."""
    gc.collect()  # the earlier columns' engines (a real-width one holds ~24 GB)
    torch.cuda.empty_cache()
    with environment({"TIERLM_NO_PDL": "1"}):
        engine = make_engine(args, speculative, eager=False, oracle=oracle is not None, token_map=token_map)
        request, step = start(engine, args, oracle)
        for _ in range(KERNEL_WARMUP_STEPS):
            step()
        torch.cuda.synchronize()
        before = len(request.output_token_ids)
        events = cuda_events(lambda: [step() for _ in range(KERNEL_STEPS)])
        tokens = (len(request.output_token_ids) - before) / KERNEL_STEPS
    table: dict[str, list[float]] = {}
    for event in events:
        entry = table.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.device_time_total
    return {name: (n / KERNEL_STEPS, us / KERNEL_STEPS) for name, (n, us) in table.items()}, tokens


def print_kernel_tables(columns: dict[str, tuple[dict[str, tuple[float, float]], float]]) -> None:
    """Each column's kernels side by side: device us a step (launches a step), the KERNEL_ROWS largest."""
    names = sorted({name for table, _ in columns.values() for name in table},
                   key=lambda name: -max(table.get(name, (0, 0.0))[1] for table, _ in columns.values()))
    print("\nkernels per decode step (--kernels: PDL off, device us a step and launches a step; CUDA graph replays "
          "included):")
    print(f"  {'':>6s}" + "".join(f"{name[:22]:>24s}" for name in columns))
    totals = [(sum(us for _, us in table.values()), sum(n for n, _ in table.values()), tokens)
              for table, tokens in columns.values()]
    print("  total " + "".join(f"{us:>15.1f} ({n:>5.1f})" for us, n, _ in totals))
    print("  /token" + "".join(f"{us / tokens:>15.1f} {'':7s}" for us, _, tokens in totals))
    for name in names[:KERNEL_ROWS]:
        cells = "".join(f"{table[name][1]:>15.1f} ({table[name][0]:>5.1f})" if name in table else f"{'-':>23s} "
                        for table, _ in columns.values())
        print(f"  {'':6s}{cells}  {name[:90]}")


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


def compare_variants(args) -> None:
    """--variants: the no-drafts, own-drafts and oracle columns (the drafting ones with --token-map's map if
    given) under each variant, --rounds rounds, the variants' order rotated by one each round; each round's
    ms/token, then the medians and each variant's over the first's. The oracle's continuation is the own
    drafts column's output (the speculative path's greedy tokens), rerun as above while it leaves it."""
    variants, n = args.variants, args.tokens - 1
    names = {name for variant in variants for name in variant.assignments}
    if args.device.startswith("cuda"):  # every variant's Triton compiles before any timing
        untimed = argparse.Namespace(**{**vars(args), "phases": False})
        for variant in variants:
            with variant_environment(variant.environment(names)):
                run(untimed, speculative=False, eager=False)
                run(untimed, speculative=True, eager=False, token_map=args.token_map)
    rounds: dict[str, list[tuple[float, float, float]]] = {variant.spec: [] for variant in variants}
    for index in range(args.rounds):
        for variant in variants[index % len(variants):] + variants[: index % len(variants)]:
            with variant_environment(variant.environment(names)):
                _, base_s, _ = run(args, speculative=False, eager=False)
                own, own_s, _ = run(args, speculative=True, eager=False, token_map=args.token_map)
                _, oracle_s, stats, _ = run_oracle(args, own, token_map=args.token_map, quiet=True)
            ms = tuple(1000 * seconds / n for seconds in (base_s, own_s, oracle_s))
            rounds[variant.spec].append(ms)
            print(f"round {index + 1} {variant.spec}: no drafts {ms[0]:.3f}, own drafts {ms[1]:.3f} "
                  f"(x{ms[0] / ms[1]:.2f}), oracle {ms[2]:.3f} (x{ms[0] / ms[2]:.2f}; accepted "
                  f"{stats.num_accepted_tokens}/{stats.num_draft_tokens}) ms/token", flush=True)
    print(f"{args.model}, {args.device}, K={args.k}, {n} tokens timed, medians of {args.rounds} rounds, ms/token"
          + (f", drafting columns with the token map {args.token_map}" if args.token_map else ""))
    first = [statistics.median(column) for column in zip(*rounds[variants[0].spec])]
    for variant in variants:
        base, own, oracle = (statistics.median(column) for column in zip(*rounds[variant.spec]))
        print(f"  {variant.spec:40s} no drafts {base:.3f} (x{first[0] / base:.3f})  own drafts {own:.3f} "
              f"(x{first[1] / own:.3f}; x{base / own:.2f} no drafts)  oracle {oracle:.3f} (x{first[2] / oracle:.3f}; "
              f"x{base / oracle:.2f} no drafts)")


def kernel_columns(args) -> None:
    """--kernels: the tables of the no-drafts, own-drafts and oracle columns (and with a token map, its two)."""
    own, _, _ = run(args, speculative=True, eager=False)  # the oracle's continuation (see compare_variants)
    columns = {"no drafts": kernel_table(args, speculative=False),
               "own drafts": kernel_table(args, speculative=True),
               "oracle": kernel_table(args, speculative=True, oracle=own)}
    if args.token_map is not None:
        columns["own drafts, token map"] = kernel_table(args, speculative=True, token_map=args.token_map)
        columns["oracle, token map"] = kernel_table(args, speculative=True, oracle=own, token_map=args.token_map)
    print(f"{args.model}, {args.device}, K={args.k}; tokens a step: "
          + ", ".join(f"{name} {tokens:.2f}" for name, (_, tokens) in columns.items()))
    print_kernel_tables(columns)


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
    parser.add_argument("--variants", nargs="+", default=None, metavar="SPEC",
                        help="the no-drafts, own-drafts and oracle columns under each variant, interleaved (see above)")
    parser.add_argument("--rounds", type=int, default=3, help="--variants' rounds")
    parser.add_argument("--kernels", action="store_true",
                        help="instead of timing, each column's kernels a step (CUDA; see above)")
    maps = parser.add_mutually_exclusive_group()
    maps.add_argument("--token-map", default=None, metavar="FILE",
                      help="also the drafting columns with this speculative token map (`tierlm draft-vocab`)")
    maps.add_argument("--token-map-size", type=int, default=None, metavar="N",
                      help="also the drafting columns with a map of token ids 0..N-1 (random weights: any N ids cost "
                           "the same)")
    args = parser.parse_args()
    if args.kernels and not args.device.startswith("cuda"):
        parser.error("--kernels profiles CUDA kernels: give --device cuda")
    if args.kernels and args.variants:
        parser.error("--kernels and --variants: one or the other")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    try:
        args.variants = parse_variants(args.variants) if args.variants else None
    except ValueError as error:
        parser.error(str(error))
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
    if args.variants:
        compare_variants(args)
        return 0
    if args.kernels:
        kernel_columns(args)
        return 0
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
    oracle, oracle_s, oracle_stats, continuation = run_oracle(args, base)
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
