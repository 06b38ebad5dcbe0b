"""Images for `tierlm bench --image FILE | --image-size WxH`: one per conversation, sent as a data: URL
`image_url` part before the text of its first user message (chat endpoint only).

`ImageFile` sends the same file every time (a server's encoder cache may serve it after the first).
`GeneratedImages` draws a smooth random picture of the given size (random 8 x 8 colours resized bicubic,
PNG) seeded by the conversation's first message: on the cold lane every conversation's text is unseen,
so its image is too (no prefix- or encoder-cache hit), and on the warm lane every request sends one
image. Pillow and numpy are imported on first use (no torch).
"""

from __future__ import annotations

import base64
import hashlib
import io
import re
from pathlib import Path

MAX_SIDE = 16384


class ImageFile:
    def __init__(self, path: str) -> None:
        from PIL import Image, UnidentifiedImageError

        file = Path(path)
        if not file.is_file():
            raise ValueError(f"--image: no such file: {path}")
        data = file.read_bytes()
        try:
            with Image.open(io.BytesIO(data)) as image:
                kind = image.format.lower()
        except (UnidentifiedImageError, OSError) as exc:
            raise ValueError(f"--image: {path} is not an image Pillow can read ({exc})") from None
        self._url = f"data:image/{kind};base64," + base64.b64encode(data).decode()

    def url(self, first_message: str) -> str:
        return self._url


class GeneratedImages:
    def __init__(self, size: str) -> None:
        match = re.fullmatch(r"(\d+)x(\d+)", size)
        if not match or not all(0 < int(side) <= MAX_SIDE for side in match.groups()):
            raise ValueError(f"--image-size must read WIDTHxHEIGHT, each side 1 to {MAX_SIDE}, got {size!r}")
        self.size = (int(match[1]), int(match[2]))

    def url(self, first_message: str) -> str:
        import numpy as np
        from PIL import Image

        seed = int.from_bytes(hashlib.blake2b(first_message.encode(), digest_size=8).digest(), "little")
        colours = np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)
        out = io.BytesIO()
        Image.fromarray(colours).resize(self.size, Image.Resampling.BICUBIC).save(out, format="PNG")
        return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def first_user_message(text: str, image_url: str | None) -> dict:
    """A conversation's first user message: the text alone, or the image part then the text."""
    if image_url is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                        {"type": "text", "text": text}]}
