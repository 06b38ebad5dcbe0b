"""Image placeholders in a prompt's token ids.

A chat template marks each image with one `<vision_start><image><vision_end>` (Qwen's
`<|vision_start|><|image_pad|><|vision_end|>`); before the engine sees the prompt, each image's single
image token becomes as many as the image has merged features (`ImageProcessor.num_tokens`), the rows the
vision tower's features replace.
"""

from __future__ import annotations

from tierlm.config import VisionConfig


def image_marker(vision: VisionConfig) -> list[int]:
    """The ids that stand for one image before expansion."""
    return [vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id]


def expand_image_tokens(token_ids: list[int], vision: VisionConfig, counts: list[int]) -> list[int]:
    """Each image's marker `<vision_start><image><vision_end>` with its one image token repeated
    counts[i] times (images in prompt order). A prompt whose markers do not match the images (another
    number, or an image token outside a marker) is a ValueError."""
    marker = image_marker(vision)
    out, image, i = [], 0, 0
    while i < len(token_ids):
        if token_ids[i : i + 3] == marker:
            if image == len(counts):
                raise ValueError(f"the prompt has more image markers than the {len(counts)} images given")
            out += [marker[0], *[marker[1]] * counts[image], marker[2]]
            image += 1
            i += 3
            continue
        if token_ids[i] == vision.image_token_id:
            raise ValueError(f"image token {vision.image_token_id} at {i} outside <vision_start> ... <vision_end>")
        out.append(token_ids[i])
        i += 1
    if image != len(counts):
        raise ValueError(f"{len(counts)} images given, but the prompt has {image} image markers")
    return out
