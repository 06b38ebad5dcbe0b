"""tierlm's model vs transformers' Qwen4ExpForCausalLM: same config, same weights, one run.

Builds a random (perturbed) checkpoint with transformers, loads it into both, and measures
  prefill tokens/s: one forward over a prompt (transformers: `generate(max_new_tokens=1)`),
  decode tokens/s: greedy steps after the prompt (transformers: `generate` with its cache, the
                   prefill time subtracted; tierlm: its forward on the pooled cache, one token a step,
                   eagerly and through `StaticDecodeRunner` (CUDA graphs on GPU, torch.compile on CPU),
and prints both side by side with the ratio tierlm / transformers, plus how many greedy tokens agree.

    python bench/model_vs_reference.py                       # CPU, fp32, hidden 256, 6 layers, 32 experts
    python bench/model_vs_reference.py --device cuda --dtype bfloat16 --hidden 1024 --layers 8 --experts 64
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.loader import load_model
from tierlm.model.model_cache import ModelCache
from tierlm.model.static_decode import StaticDecodeRunner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def reference_config(args) -> dict:
    h = args.hidden
    return {
        "vocab_size": args.vocab, "hidden_size": h, "num_hidden_layers": args.layers,
        "full_attention_interval": 4, "num_attention_heads": max(2, h // 64), "num_key_value_heads": 2,
        "head_dim": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "linear_num_key_heads": max(1, h // 128), "linear_num_value_heads": max(2, h // 64),
        "num_experts": args.experts, "num_experts_per_tok": 4, "moe_intermediate_size": h // 2,
        "shared_expert_intermediate_size": h // 2, "hc_count": 4, "hc_lowrank": 32, "ple_layer_ids": [1],
        "ple_embed_dim": h, "heads_per_ngram": 4, "ngram_vocab_size_base": 20000, "split_ngram_parts": 4,
        "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 64, "indexer_budget": 64,
        "indexer_compress_ratio": 4, "eos_token_id": 0, "max_position_embeddings": 65536,
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def run_reference(model, prompt: torch.Tensor, steps: int, device) -> tuple[float, float, list[int]]:
    kwargs = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
        prefill, _ = timed(lambda: model.generate(prompt, max_new_tokens=1, min_new_tokens=1, **kwargs), device)
        total, out = timed(
            lambda: model.generate(prompt, max_new_tokens=steps + 1, min_new_tokens=steps + 1, **kwargs), device
        )
    return prefill, total - prefill, out[0, prompt.shape[1] :].tolist()


def run_tierlm(model, config, prompt: list[int], steps: int, dtype, device, mode: str):
    """mode: "eager", or "cuda_graph" / "compile" for decode steps through `StaticDecodeRunner`."""
    block_size = 16
    blocks = (len(prompt) + steps + block_size) // block_size + 1
    cache = ModelCache(config, 1, blocks, block_size, dtype, device)
    table = [list(range(blocks))]
    static = None if mode == "eager" else StaticDecodeRunner(model, cache, 1, blocks, mode)
    decode = static.run if static is not None else (lambda batch: model(batch, cache))

    def generate(n_new: int) -> list[int]:
        cache.reset_slot(0)
        logits = model(ForwardBatch.build([prompt], [0], [0], table, block_size, device=device), cache)
        tokens = [int(logits[-1].argmax())]
        for _ in range(n_new - 1):
            pos = len(prompt) + len(tokens) - 1
            batch = ForwardBatch.build([[tokens[-1]]], [pos], [0], table, block_size, device=device)
            tokens.append(int(decode(batch)[-1].argmax()))
        return tokens

    generate(2)  # warm-up
    prefill, _ = timed(lambda: generate(1), device)
    total, tokens = timed(lambda: generate(steps + 1), device)
    return prefill, total - prefill, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument(
        "--static-mode", choices=["cuda_graph", "compile", "none"], default=None,
        help="tierlm's fixed-shape decode beside its eager one (default: cuda_graph on GPU, compile on CPU)",
    )
    args = parser.parse_args()

    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    reference = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**reference_config(args))).eval()
    with torch.no_grad():
        for param in reference.parameters():
            if param.dtype.is_floating_point:
                param.add_(0.05 * torch.randn_like(param))
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        model, config = load_model(folder, dtype=args.dtype, device=args.device)
    reference = reference.to(device=device, dtype=dtype)
    prompt = torch.randint(1, args.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))

    ref_prefill, ref_decode, ref_tokens = run_reference(reference, prompt.to(device), args.decode_steps, device)
    static_mode = args.static_mode or ("cuda_graph" if device.type == "cuda" else "compile")
    modes = ["eager"] + ([static_mode] if static_mode != "none" else [])
    ours = {m: run_tierlm(model, config, prompt[0].tolist(), args.decode_steps, dtype, device, m) for m in modes}
    n = args.prompt_len
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"device={args.device} dtype={args.dtype} hidden={args.hidden} layers={args.layers} "
          f"experts={args.experts} vocab={args.vocab} params={params:.1f}M prompt={n} decode_steps={args.decode_steps}")
    print(f"{'metric':<28}{'transformers':>14}{'tierlm':>12}{'ratio':>9}")
    print(f"{'prefill tok/s':<28}{n / ref_prefill:>14.1f}{n / ours['eager'][0]:>12.1f}"
          f"{ref_prefill / ours['eager'][0]:>8.2f}x")
    for mode, (_, decode, tokens) in ours.items():
        ref_rate, our_rate = args.decode_steps / ref_decode, args.decode_steps / decode
        print(f"{'decode tok/s (' + mode + ')':<28}{ref_rate:>14.1f}{our_rate:>12.1f}{our_rate / ref_rate:>8.2f}x")
    for mode, (_, _, tokens) in ours.items():
        agree = sum(a == b for a, b in zip(ref_tokens, tokens))
        print(f"greedy tokens agreeing with transformers ({mode}): {agree}/{len(ref_tokens)}")


if __name__ == "__main__":
    main()
