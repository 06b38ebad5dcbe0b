"""`tierlm bench`: a client-side serving benchmark for any OpenAI-compatible server.

It measures what a user feels (time to first token, inter-token latency, end-to-end latency) by
streaming requests and timestamping every SSE chunk on arrival. The package is split by concern:

- `workload`: prompt text for the warm and cold lanes, the state file that keeps cold text unseen,
  and prompt-length approximation;
- `images`: the image each conversation's first message carries (`--image FILE`, `--image-size WxH`);
- `client`: one streamed HTTP request, its timings and its failure modes, plus the `/metrics` scrape;
- `runner`: scheduling (closed loop, Poisson open loop, multi-turn conversations) and progress;
- `stats`: per-run summaries, the median across runs and the result JSON;
- `report`: the rich tables, the A/B comparison and the plot;
- `cli`: the argument parser and the orchestration of warmup and measured runs.

Nothing here imports torch: the benchmark must start instantly on a client machine.
"""
