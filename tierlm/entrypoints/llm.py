"""`LLM`: offline batch generation with vLLM's interface (`generate`, `chat`), on the engine."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tierlm.engine.llm_engine import EngineConfig, LLMEngine
from tierlm.multimodal.image_processor import ImageProcessor, ProcessedImage, data_url_bytes
from tierlm.multimodal.prompt import expand_image_tokens
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
        """Prompts are strings or {"prompt_token_ids": [...]} (with "images": processed images whose markers
        the ids hold widened, as `chat` makes them); a list is one batch, run together. With
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
                images = prompt.get("images") if isinstance(prompt, dict) else None
                ids.append(self.engine.add_request(_prompt_input(prompt), params, prompt_text=text, images=images))
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
        `tools`, OpenAI-shaped, for the template to list). On a model with a vision tower a message's
        content parts may be images: {"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}
        or {"type": "image_pil", "image_pil": a PIL image} (vLLM's forms)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            conversation, images = self._chat_images(conversation)
            text = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tools=tools,
                template_kwargs=chat_template_kwargs,
            )
            token_ids = tokenizer.encode(text, add_special_tokens=False)
            if images:
                counts = [self._image_processor.num_tokens(image) for image in images]
                token_ids = expand_image_tokens(token_ids, self.engine.model_config.vision, counts)
            prompts.append({"prompt_token_ids": token_ids, "prompt": text, "images": images})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _chat_images(self, conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ProcessedImage]]:
        """The conversation with its image parts as {"type": "image"} (what chat templates mark), and the
        images processed, in order. A bad image or a model without a vision tower is a ValueError."""
        images, rendered = [], []
        for message in conversation:
            content = message.get("content")
            if not isinstance(content, list):
                rendered.append(message)
                continue
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("image_url", "image_pil"):
                    parts.append(part)
                    continue
                if self.engine.model_config.vision is None:
                    raise ValueError("this model has no vision tower (its config.json has no vision_config): it "
                                     f"takes no {kind} parts")
                processor = self._image_processor
                if kind == "image_pil":
                    image = part["image_pil"]
                else:
                    url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
                    image = processor.decode(data_url_bytes(url))
                images.append(processor(image))
                parts.append({"type": "image"})
            rendered.append({**message, "content": parts})
        return rendered, images

    @functools.cached_property
    def _image_processor(self) -> ImageProcessor:
        return ImageProcessor.for_model(self.engine.model_dir, self.engine.model_config.vision)

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
