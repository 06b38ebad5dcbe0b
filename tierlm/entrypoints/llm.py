"""`LLM`: offline batch generation with vLLM's interface (`generate`, `chat`), on the engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tierlm.engine.llm_engine import EngineConfig, LLMEngine
from tierlm.outputs import RequestOutput
from tierlm.sampling_params import SamplingParams

Prompt = str | dict[str, Any]


class LLM:
    """LLM(model, dtype="auto", device=None, **engine options) -> generate(prompts, sampling_params)."""

    def __init__(self, model: str, dtype: str = "auto", device: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), dtype=dtype, device=device, **engine_options))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        temperature, top_p, top_k, repetition_penalty = self.engine.default_params()
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Prompts are strings or {"prompt_token_ids": [...]}; a list is one batch, run together. With
        `use_tqdm` a batch of more than one prompt shows a progress bar (finished prompts) on stderr."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                text = prompt.get("prompt") if isinstance(prompt, dict) else None
                ids.append(self.engine.add_request(_prompt_input(prompt), params, prompt_text=text))
        except ValueError:
            for request_id in ids:  # a batch is accepted whole or not at all
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm and len(ids) > 1)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a batch of them, rendered with the chat template (and
        `tools`, OpenAI-shaped, for the template to list)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tools=tools,
                template_kwargs=chat_template_kwargs,
            )
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], progress: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", unit="prompt", disable=not progress)
        with bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in request_ids]


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}")
