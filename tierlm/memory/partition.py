"""Which decoder layers each pipeline rank holds: given (`--pp-layer-partition 16,17,15`) or balanced.

The balanced split gives every rank a contiguous run of layers so that the most loaded rank, relative
to its memory, is as light as possible. A rank's load is the bytes it would hold for the engine's
settings: its layers' weights (quantized modules at their packed size) and their cache at full
occupancy (max_num_seqs requests of max_model_len: state slots, QSA K/V and indexer keys), plus the
embedding on the first rank and the final mixer and lm_head on the last. Memory per rank is each
device's total memory on CUDA (ranks may differ), equal shares on CPU.
"""

from __future__ import annotations

from tierlm.config import ModelConfig
from tierlm.memory.plan import layer_bytes, weight_bytes
from tierlm.model.pipeline_stage import StageLayout


class PartitionError(ValueError):
    """A layer partition that does not fit the model or the number of ranks; the message says why."""


def parse_partition(text: str | list[int] | tuple[int, ...] | None) -> tuple[int, ...] | None:
    """'16,17,15' (or a list of ints) -> (16, 17, 15); None stays None."""
    if text is None:
        return None
    if isinstance(text, str):
        try:
            return tuple(int(part) for part in text.split(","))
        except ValueError:
            raise PartitionError(f"--pp-layer-partition {text!r}: give layer counts separated by commas, "
                                 "e.g. 16,17,15") from None
    return tuple(int(n) for n in text)


def check_partition(counts: tuple[int, ...], num_layers: int, world_size: int) -> None:
    if len(counts) != world_size:
        raise PartitionError(f"--pp-layer-partition has {len(counts)} entries, but --pipeline-parallel-size is "
                             f"{world_size}: give one layer count per rank")
    if min(counts) < 1:
        raise PartitionError(f"--pp-layer-partition {','.join(map(str, counts))}: every rank needs at least one layer")
    if sum(counts) != num_layers:
        raise PartitionError(f"--pp-layer-partition {','.join(map(str, counts))} sums to {sum(counts)}, but the "
                             f"model has {num_layers} layers")


def layouts(config: ModelConfig, counts: tuple[int, ...]) -> list[StageLayout]:
    """The StageLayout of every rank for layer counts per rank."""
    out, start = [], 0
    for rank, count in enumerate(counts):
        out.append(StageLayout(rank, len(counts), tuple(range(start, start + count)), config.tie_word_embeddings))
        start += count
    return out


def rank_loads(
    config: ModelConfig, dtype: str, world_size: int, max_num_seqs: int, max_model_len: int,
    quantization=None, ple_mapped: bool = False, mtp=None, num_speculative_tokens: int = 0,
) -> tuple[list[int], int, int]:
    """(bytes of each layer, bytes only the first rank holds, bytes only the last rank holds). mtp (an
    `MTPLayout`, speculative decoding): the last rank also holds the draft head, the embedding it reads and
    its layers' caches; every layer keeps num_speculative_tokens more per-request states."""
    def held(layout: StageLayout) -> int:
        return sum(weight_bytes(config, dtype, quantization, ple_mapped, stage=layout, mtp=mtp).values())

    def cache(layer: int) -> float:
        return sum(lb.per_request * (1 + num_speculative_tokens) + lb.per_token * max_model_len
                   for lb in layer_bytes(config, dtype, (layer,)))

    per_layer = [held(StageLayout(1, 3, (i,))) + int(max_num_seqs * cache(i)) for i in range(config.num_hidden_layers)]
    tied = config.tie_word_embeddings
    first = held(StageLayout(0, world_size, (), tied))
    last = held(StageLayout(world_size - 1, world_size, (), tied, draft_head=mtp is not None))
    if mtp is not None:  # the draft head's layers: QSA layers' caches
        qsa = config.layer_types.index("indexed_attention")
        last += int(mtp.num_layers * max_num_seqs * cache(qsa))
    return per_layer, first, last


def balanced_partition(
    per_layer: list[int], first_extra: int, last_extra: int, capacities: list[int]
) -> tuple[int, ...]:
    """Layer counts per rank (contiguous, each >= 1) minimising the largest load / capacity."""
    ranks, layers = len(capacities), len(per_layer)
    if layers < ranks:
        raise PartitionError(f"the model has {layers} layers, fewer than --pipeline-parallel-size {ranks}")
    prefix = [0]
    for b in per_layer:
        prefix.append(prefix[-1] + b)

    def load(rank: int, start: int, end: int) -> float:
        extra = (first_extra if rank == 0 else 0) + (last_extra if rank == ranks - 1 else 0)
        return (prefix[end] - prefix[start] + extra) / capacities[rank]

    # best[r][e]: the smallest worst load of ranks 0..r holding layers 0..e-1; cut[r][e]: where rank r starts
    inf = float("inf")
    best = [[inf] * (layers + 1) for _ in range(ranks)]
    cut = [[0] * (layers + 1) for _ in range(ranks)]
    for e in range(1, layers + 1):
        best[0][e] = load(0, 0, e)
    for r in range(1, ranks):
        for e in range(r + 1, layers + 1):
            for s in range(r, e):
                worst = max(best[r - 1][s], load(r, s, e))
                if worst < best[r][e]:
                    best[r][e], cut[r][e] = worst, s
    counts, end = [], layers
    for r in range(ranks - 1, 0, -1):
        start = cut[r][end]
        counts.append(end - start)
        end = start
    counts.append(end)
    return tuple(reversed(counts))
