"""tierlm: large hybrid MoE inference with every byte in the right memory tier.

The public Python surface mirrors vLLM's: `LLM`, `SamplingParams`, `RequestOutput`.
"""

from tierlm.outputs import CompletionOutput, Logprob, RequestOutput
from tierlm.sampling_params import SamplingParams


def __getattr__(name: str):
    # LLM pulls in torch and the model; keep `import tierlm` light for tools that need neither
    if name == "LLM":
        from tierlm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
