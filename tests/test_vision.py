"""The vision side against transformers 5.19 (tiny random configs): the tower alone (fp32 equal to the
reference's, bf16 within transformers' own bf16 error), and the whole model with an image in the prompt."""

from __future__ import annotations

import pytest
import torch
from test_bf16_parity import assert_within_reference_error

from tierlm.config import VisionConfig
from tierlm.model.vision.tower import VisionTower

# two attention heads of head_dim 8 (two rotary frequencies per axis), a 4 x 4 learned position table
TINY_VISION = {
    "depth": 2, "hidden_size": 16, "num_heads": 2, "intermediate_size": 24, "patch_size": 2,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64, "num_position_embeddings": 16,
}
# an image smaller than the position table and one larger than it, not square: the table is resampled
GRIDS = [(1, 2, 4), (1, 6, 8)]


def reference_tower(seed: int = 0):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpVisionModel

    torch.manual_seed(seed)
    model = Qwen4ExpVisionModel(Qwen4ExpVisionConfig(**TINY_VISION)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def tierlm_tower(reference) -> VisionTower:
    tower = VisionTower(VisionConfig.from_dict(TINY_VISION, {})).eval()
    tower.load_state_dict(reference.state_dict())  # names mirror the checkpoint's `model.visual.*`
    return tower


def test_tower_matches_reference_fp32_and_bf16():
    reference = reference_tower()
    tower = tierlm_tower(reference)
    c = tower.config
    patches = torch.randn(sum(t * h * w for t, h, w in GRIDS), c.patch_values,
                          generator=torch.Generator().manual_seed(1))
    grid_thw = torch.tensor(GRIDS)
    with torch.no_grad():
        expected = reference(patches, grid_thw=grid_thw).pooler_output
        ours = tower(patches, GRIDS)
        assert ours.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, c.out_hidden_size)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
        theirs_bf16 = reference.to(torch.bfloat16)(patches.bfloat16(), grid_thw=grid_thw).pooler_output
        ours_bf16 = tower.to(torch.bfloat16)(patches.bfloat16(), GRIDS)
    assert_within_reference_error(ours_bf16, theirs_bf16, expected, "vision tower bf16")


def test_tower_rejects_patches_that_do_not_fit_the_grids():
    tower = VisionTower(VisionConfig.from_dict(TINY_VISION, {}))
    with pytest.raises(ValueError, match=r"patches: expected \[8, 24\]"):
        tower(torch.zeros(9, 24), [(1, 2, 4)])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (side-stream copies)"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_tower_equals_the_resident_tower_bit_for_bit(dtype, device):
    """--mm-encoder-offload: the tower's weights in host buffers, each unit copied into one of two slots
    as the forward reaches it (plain copies on CPU; a side stream and events on CUDA), gives the resident
    tower's features exactly; on CUDA the streamed tower holds no device bytes between encodes."""
    resident = VisionTower(VisionConfig.from_dict(TINY_VISION, {})).to(device, dtype).eval()
    patches = torch.randn(sum(t * h * w for t, h, w in GRIDS), resident.config.patch_values,
                          generator=torch.Generator().manual_seed(1)).to(device, dtype)
    with torch.no_grad():
        expected = resident(patches, GRIDS)
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    streamed = VisionTower(VisionConfig.from_dict(TINY_VISION, {})).to(device, dtype).eval()
    streamed.load_state_dict(resident.state_dict())
    streamed.stream_from_host(device)
    with torch.no_grad():
        assert torch.equal(streamed(patches, GRIDS), expected)
        assert torch.equal(streamed(patches[:8], GRIDS[:1]), resident(patches[:8], GRIDS[:1]))  # twice
    if device == "cuda":
        assert torch.cuda.memory_allocated() == before
    units = streamed.streamed.units
    assert len(units) == 2 + TINY_VISION["depth"] + 1 and all(
        p.data_ptr() >= u.host.data_ptr() and p.data_ptr() < u.host.data_ptr() + u.host.nbytes
        for u in units for p in u.module.parameters())  # the module's own weights are views of the host buffers


# ---- the whole model: an image in the prompt -------------------------------------------------------
IMAGE, START, END = 500, 501, 502  # token ids of the tiny vocabulary (512)
PROMPT_GRID = (1, 4, 6)  # 6 merged features: a 2 x 3 grid, so text resumes 3 positions after the image
SECOND_GRID = (1, 6, 4)  # a 3 x 2 grid: the other way round


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny transformers VLM (text: the fact sheet's config; vision: TINY_VISION) saved as a checkpoint;
    (reference model, its folder)."""
    from reference_models import BASE
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen4ExpConfig(
        text_config=dict(BASE), vision_config=dict(TINY_VISION), image_token_id=IMAGE, video_token_id=503,
        vision_start_token_id=START, vision_end_token_id=END,
    )
    model = Qwen4ExpForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    folder = tmp_path_factory.mktemp("vlm")
    model.save_pretrained(folder)
    return model, folder


def image_prompt(grids: list[tuple[int, int, int]], text_after: int) -> list[int]:
    """Text, then per image <vision_start>, its placeholders, <vision_end> and 4 text tokens between two
    images, then text_after tokens."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(4, IMAGE, (13,), generator=gen).tolist()
    ids[5] = 1  # an EOS: the PLE n-gram context restarts
    for index, (t, h, w) in enumerate(grids):
        if index:
            ids += torch.randint(4, IMAGE, (4,), generator=gen).tolist()
        ids += [START, *[IMAGE] * (t * h * w // 4), END]
    return ids + torch.randint(4, IMAGE, (text_after,), generator=gen).tolist()


@pytest.mark.parametrize("grids", [[PROMPT_GRID], [PROMPT_GRID, SECOND_GRID]], ids=["one image", "two images"])
def test_model_with_images_matches_reference_fp32(vlm, grids):
    """Logits of every row of a prompt with one image, or two of different sizes, prefilled in chunks (the
    second starting inside the first image, in the middle of an indexer group) and then decoded a token at
    a time past the prompt (text after the images: M-RoPE's delta); against transformers' one forward over
    the whole sequence."""
    from reference_models import BLOCK_SIZE

    from tierlm.model.forward_batch import ForwardBatch
    from tierlm.model.loader import load_model
    from tierlm.model.model_cache import ModelCache
    from tierlm.model.vision.mrope import MropePositions

    reference, folder = vlm
    ids = image_prompt(grids, text_after=19)
    prompt_len = len(ids) - 10
    c = reference.config.vision_config
    patches = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 2 * 2,
                          generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference(
            input_ids=torch.tensor([ids]), pixel_values=patches, image_grid_thw=torch.tensor(grids),
            mm_token_type_ids=torch.tensor([[int(t == IMAGE) for t in ids]]), use_cache=False,
        ).logits[0]

    model, config = load_model(folder, dtype="float32", device="cpu")
    features = model.encode_images(patches, grids)
    mrope = MropePositions.of_prompt(ids[:prompt_len], IMAGE, grids, c.spatial_merge_size)
    cache = ModelCache(config, 1, 8, BLOCK_SIZE, torch.float32)
    cache.reset_slot(0)
    image_rows = [i for i, t in enumerate(ids) if t == IMAGE]
    logits = []
    chunks = [(0, 16), (16, prompt_len)] + [(p, p + 1) for p in range(prompt_len, len(ids))]
    for start, end in chunks:
        rows = [i for i in image_rows if start <= i < end]
        batch = ForwardBatch.build(
            [ids[start:end]], [start], [0], [list(range(8))], BLOCK_SIZE, logits="all", mrope=[mrope],
            compress_ratio=config.indexer_compress_ratio,
        )
        if rows:
            batch.image_features = features[[image_rows.index(i) for i in rows]]
            batch.image_rows = torch.tensor([i - start for i in rows])
        logits.append(model(batch, cache))
    torch.testing.assert_close(torch.cat(logits), expected, rtol=0, atol=1e-4)


# ---- image processing and prompt expansion ---------------------------------------------------------
def test_image_processor_matches_transformers():
    """Patches and grids of transformers' Qwen2-VL image processor (PIL backend, Qwen4-Exp's) for an image
    shrunk to max_pixels and a palette image grown to min_pixels, with a checkpoint's preprocessor config."""
    import json

    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tierlm.multimodal.image_processor import ImageProcessor

    rng = np.random.default_rng(0)
    large = Image.fromarray(rng.integers(0, 256, (70, 45, 3), dtype=np.uint8))
    small = Image.fromarray(rng.integers(0, 256, (9, 13, 3), dtype=np.uint8)).convert("P")
    settings = {"size": {"shortest_edge": 400, "longest_edge": 1200}, "image_mean": [0.5, 0.4, 0.3],
                "image_std": [0.2, 0.3, 0.25]}
    theirs = Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2, **settings)
    vision = VisionConfig.from_dict(TINY_VISION, {})
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "preprocessor_config.json").write_text(json.dumps(settings))
        ours = ImageProcessor.for_model(folder, vision)
    for image in (large, small):
        expected = theirs(images=[image], return_tensors="pt")
        got = ours(image)
        assert list(got.grid) == expected["image_grid_thw"][0].tolist()
        assert torch.equal(got.patches, expected["pixel_values"])
    assert ours(large).grid[1] * ours(large).grid[2] * 4 <= 1200 < large.width * large.height
    assert ours(small).grid[1] * ours(small).grid[2] * 4 >= 400 > small.width * small.height


def test_image_processor_rejects_bad_input():
    from tierlm.multimodal.image_processor import ImageError, ImageProcessor

    processor = ImageProcessor.for_model("/nonexistent", processor_vision(), {"min_pixels": 16, "max_pixels": 64})
    assert (processor.min_pixels, processor.max_pixels) == (16, 64)
    with pytest.raises(ImageError, match="could not be decoded"):
        processor.decode(b"not an image")
    with pytest.raises(ValueError, match="mm_processor_kwargs: unknown key 'fps'"):
        ImageProcessor.for_model("/nonexistent", processor_vision(), {"fps": 2})


def processor_vision() -> VisionConfig:
    return VisionConfig.from_dict(TINY_VISION, {"image_token_id": IMAGE, "vision_start_token_id": START,
                                                "vision_end_token_id": END})


def test_prompt_expansion():
    from tierlm.multimodal.prompt import expand_image_tokens

    vision = processor_vision()
    ids = [7, START, IMAGE, END, 8, START, IMAGE, END]
    assert expand_image_tokens(ids, vision, [2, 3]) == [7, START, IMAGE, IMAGE, END, 8, START, IMAGE, IMAGE, IMAGE, END]
    with pytest.raises(ValueError, match="more image markers than the 1 images given"):
        expand_image_tokens(ids, vision, [1])
    with pytest.raises(ValueError, match="3 images given, but the prompt has 2 image markers"):
        expand_image_tokens(ids, vision, [1, 1, 1])
    with pytest.raises(ValueError, match="outside <vision_start>"):
        expand_image_tokens([7, IMAGE], vision, [])


# ---- chat image_url parts ------------------------------------------------------------------------
def chat_with_images(*urls: str):
    from tierlm.server.protocol import ChatCompletionRequest

    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}]})


def png_data_url(width: int, height: int) -> str:
    import base64
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.mark.parametrize("urls,param,words", [
    (["http://example.com/cat.png"], "messages[1].content[0]", "not enabled on this server (--allowed-media-domains)"),
    (["ftp://example.com/cat.png"], "messages[1].content[0]", "only data: URLs are accepted, not 'ftp'"),
    (["data:image/png,rawbytes"], "messages[1].content[0]", "data:image/<type>;base64"),
    (["data:text/plain;base64,aGk="], "messages[1].content[0]", "data:image/<type>;base64"),
    (["data:image/png;base64,@@@"], "messages[1].content[0]", "not valid base64"),
    (["data:image/png;base64,aGVsbG8="], "messages[1].content[0]", "could not be decoded"),
    (["data:image/png;base64,aGk="] * 3, "messages[1].content[2]", "at most 2 (--limit-mm-per-prompt)"),
])
def test_chat_images_refused_with_a_400_naming_the_part(urls, param, words):
    from tierlm.server.images import ImageInputs, load_images
    from tierlm.server.protocol import ApiError

    inputs = ImageInputs.for_model("/nonexistent", processor_vision(), '{"image": 2}')
    with pytest.raises(ApiError) as caught:
        load_images(inputs, "m", chat_with_images(*urls), {})
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message
    with pytest.raises(ApiError, match="model 'm' has no vision tower"):
        load_images(None, "m", chat_with_images(*urls), {})


def test_chat_images_decoded_and_prompt_expanded():
    from tierlm.server.images import ImageInputs, expand_prompt, load_images
    from tierlm.server.protocol import ApiError

    inputs = ImageInputs.for_model("/nonexistent", processor_vision(), None, '{"min_pixels": 16, "max_pixels": 64}')
    images = load_images(inputs, "m", chat_with_images(png_data_url(30, 12), png_data_url(5, 5)), {})
    # 30 x 12 shrunk to 12 x 4 pixels (<= 64), 5 x 5 rounded to 4 x 4; sides multiples of patch x merge = 4
    assert [image.grid for image in images] == [(1, 2, 6), (1, 2, 2)]
    assert expand_prompt([7, START, IMAGE, END, START, IMAGE, END], inputs, images) == [
        7, START, *[IMAGE] * 3, END, START, IMAGE, END]
    with pytest.raises(ApiError, match="image markers do not fit the images"):
        expand_prompt([7], inputs, images)


def test_local_files_are_read_only_inside_the_allowed_folder(tmp_path):
    import base64

    from tierlm.server.images import ImageInputs, load_images
    from tierlm.server.protocol import ApiError

    allowed, resize = tmp_path / "media", '{"min_pixels": 16, "max_pixels": 64}'
    allowed.mkdir()
    png = base64.b64decode(png_data_url(30, 12).split(",", 1)[1])
    (allowed / "cat.png").write_bytes(png)
    (tmp_path / "secret.png").write_bytes(png)
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    inputs = ImageInputs.for_model("/nonexistent", processor_vision(), None, resize, str(allowed))
    [from_file] = load_images(inputs, "m", chat_with_images((allowed / "cat.png").as_uri()), {})
    [from_data] = load_images(inputs, "m", chat_with_images(png_data_url(30, 12)), {})
    assert from_file.grid == from_data.grid and torch.equal(from_file.patches, from_data.patches)
    for path, words in ((tmp_path / "secret.png", "outside"), (allowed / "link.png", "outside"),
                        (allowed / "none.png", "not a file")):
        with pytest.raises(ApiError, match=words) as caught:
            load_images(inputs, "m", chat_with_images(path.as_uri()), {})
        assert caught.value.status == 400 and caught.value.param == "messages[1].content[0]"
    without = ImageInputs.for_model("/nonexistent", processor_vision(), None, resize)
    with pytest.raises(ApiError, match="not enabled"):
        load_images(without, "m", chat_with_images((allowed / "cat.png").as_uri()), {})
    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        ImageInputs.for_model("/nonexistent", processor_vision(), None, None, str(tmp_path / "missing"))


@pytest.fixture
def image_host(monkeypatch):
    """A local http.server in a thread: /cat.png (a PNG), /big.png (past a 1,000-byte bound), /junk (not an
    image), /slow.png (held until the test ends), /moved (a redirect to localhost, another host name),
    anything else 404; yields its base URL on 127.0.0.1."""
    import base64
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    png = base64.b64decode(png_data_url(30, 12).split(",", 1)[1])
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_port}/cat.png")
                self.end_headers()
                return
            if self.path == "/slow.png":
                release.wait(30)
            body = {"/cat.png": png, "/slow.png": png, "/big.png": bytes(1001), "/junk": b"not an image"}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    release.set()
    server.shutdown()
    server.server_close()


def test_http_images_fetched_from_allowed_domains_only(image_host):
    """http(s) image_url parts: fetched (off the event loop) when the host is allowed, giving the data:
    URL's patches; refused with a 400 naming the part for another host (redirects too), a timeout, a body
    past the size bound, an HTTP error, bytes that are no image, or without --allowed-media-domains."""
    import asyncio
    import dataclasses

    from tierlm.server.images import ImageInputs, fetch_remote_images, load_images
    from tierlm.server.protocol import ApiError

    resize = '{"min_pixels": 16, "max_pixels": 64}'
    inputs = ImageInputs.for_model("/nonexistent", processor_vision(), None, resize, None, ["127.0.0.1"], 0.5)
    inputs = dataclasses.replace(inputs, fetcher=dataclasses.replace(inputs.fetcher, max_bytes=1000))

    def load(url: str, images=inputs):
        request = chat_with_images(url)
        return load_images(images, "m", request, asyncio.run(fetch_remote_images(images, "m", request)))

    [fetched] = load(f"{image_host}/cat.png")
    [expected] = load_images(inputs, "m", chat_with_images(png_data_url(30, 12)), {})
    assert fetched.grid == expected.grid and torch.equal(fetched.patches, expected.patches)
    with pytest.raises(TypeError, match="fetched"):  # no caller can leave out fetch_remote_images's bytes
        load_images(inputs, "m", chat_with_images(f"{image_host}/cat.png"))
    port = image_host.rsplit(":", 1)[1]
    for url, words in [(f"http://localhost:{port}/cat.png", "host 'localhost' is not in --allowed-media-domains"),
                       (f"{image_host}/moved", "redirected to http://localhost"),
                       (f"{image_host}/slow.png", "timed out after 0.5 s"),
                       (f"{image_host}/big.png", "larger than 1,000 bytes"),
                       (f"{image_host}/missing.png", "HTTP 404"),
                       (f"{image_host}/junk", "could not be decoded")]:
        with pytest.raises(ApiError, match=words) as caught:
            load(url)
        assert caught.value.status == 400 and caught.value.param == "messages[1].content[0]"
    without = ImageInputs.for_model("/nonexistent", processor_vision(), None, resize)
    with pytest.raises(ApiError, match="not enabled"):
        load(f"{image_host}/cat.png", without)
    for domains, timeout, words in [(["http://x.org"], 5, "not a host name"), (["x.org"], 0, "more than 0")]:
        with pytest.raises(ValueError, match=words):
            ImageInputs.for_model("/nonexistent", processor_vision(), None, None, None, domains, timeout)


def test_image_flags_are_checked():
    from tierlm.server.images import ImageInputs

    for limit, words in [("4", "expected a JSON object"), ('{"video": 1}', "images only"), ('{"image": -1}', ">= 0")]:
        with pytest.raises(ValueError, match=words):
            ImageInputs.for_model("/nonexistent", processor_vision(), limit)
    with pytest.raises(ValueError, match="--mm-processor-kwargs: mm_processor_kwargs: unknown key 'fps'"):
        ImageInputs.for_model("/nonexistent", processor_vision(), None, '{"fps": 1}')
    assert ImageInputs.for_model("/nonexistent", None, '{"image": 1}') is None


def test_demo_model_with_a_vision_tower(tmp_path):
    """`tierlm demo-model --vision`: transformers loads the VLM checkpoint whole, its vision tower gives
    tierlm's features for a processed image, and the chat template marks an image with the marker ids."""
    import numpy as np
    from PIL import Image
    from transformers import Qwen4ExpForConditionalGeneration

    from tierlm.demo_model import build_demo_model
    from tierlm.model.loader import load_model
    from tierlm.multimodal.image_processor import ImageProcessor
    from tierlm.multimodal.prompt import image_marker
    from tierlm.tokenizer import Tokenizer

    folder = build_demo_model(tmp_path / "vlm", "tiny", vision=True)
    reference, info = Qwen4ExpForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model, config = load_model(folder, dtype="float32", device="cpu")
    image = ImageProcessor.for_model(folder, config.vision)(
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 90, 3), dtype=np.uint8)))
    assert image.grid == (1, 4, 6)  # 40 x 90 grown to 64 x 96 pixels (>= 64 x 64, sides multiples of 32)
    with torch.no_grad():
        expected = reference.eval().model.get_image_features(image.patches, torch.tensor([image.grid])).pooler_output[0]
    torch.testing.assert_close(model.encode_images(image.patches, [image.grid]), expected, rtol=0, atol=1e-5)
    tokenizer = Tokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}, {"type": "text", "text": "hi"}]}],
        add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    marker = image_marker(config.vision)
    assert [ids[i : i + 3] for i in range(len(ids) - 2)].count(marker) == 1


# ---- image requests through the engine (the demo VLM) -----------------------------------------------
GREEDY_IMAGE = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def demo_vlm(tmp_path_factory):
    """`tierlm demo-model --vision` and an offline LLM on it whose prefill chunks are 16 tokens."""
    from tierlm import LLM
    from tierlm.demo_model import build_demo_model

    folder = build_demo_model(tmp_path_factory.mktemp("demo") / "vlm", "tiny", vision=True)
    return folder, LLM(str(folder), dtype="float32", device="cpu", max_model_len=256, max_num_batched_tokens=16)


def random_image(seed: int, size: tuple[int, int] = (160, 160)):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def image_chat(image, text: str = "what is it?") -> list[dict]:
    part = {"type": "image_url", "image_url": {"url": image}} if isinstance(image, str) else {
        "type": "image_pil", "image_pil": image}
    return [{"role": "system", "content": "you look at pictures and answer in a few words"},
            {"role": "user", "content": [{"type": "text", "text": "look:"}, part, {"type": "text", "text": text}]}]


def test_image_chat_matches_reference_greedy_fp32(demo_vlm):
    """LLM.chat with an image (25 features; prefill chunks of 16 tokens, one cut inside the image, decode
    with the prompt's M-RoPE delta) gives transformers' greedy tokens (its whole forward per token)."""
    from transformers import Qwen4ExpForConditionalGeneration

    from tierlm import SamplingParams
    from tierlm.multimodal.image_processor import ImageProcessor

    folder, llm = demo_vlm
    chunks = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        chunks.extend((c.start, c.start + c.num_tokens) for c in out.chunks)
        return out

    llm.engine.scheduler.schedule = recording_schedule
    try:
        out = llm.chat(image_chat(random_image(0)), SamplingParams(**GREEDY_IMAGE))[0]
    finally:
        llm.engine.scheduler.schedule = schedule
    ids = list(out.prompt_token_ids)
    vision = llm.engine.model_config.vision
    run = [i for i, t in enumerate(ids) if t == vision.image_token_id]
    assert len(run) == 25 and any(run[0] < end <= run[-1] for _, end in chunks), chunks

    reference = Qwen4ExpForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    image = ImageProcessor.for_model(folder, vision)(random_image(0))
    expected = []
    with torch.no_grad():
        for _ in range(GREEDY_IMAGE["max_tokens"]):
            logits = reference(
                input_ids=torch.tensor([ids]), pixel_values=image.patches, image_grid_thw=torch.tensor([image.grid]),
                mm_token_type_ids=torch.tensor([[int(t == vision.image_token_id) for t in ids]]), use_cache=False,
            ).logits[0, -1]
            expected.append(int(logits.argmax()))
            ids.append(expected[-1])
    assert list(out.outputs[0].token_ids) == expected


def test_prefix_cache_keeps_images_apart(demo_vlm):
    """Same text, two images, prefix caching on: the second image's request takes no cached block of its
    image rows (the first's tokens would follow), and the first image asked again hits past its image and
    answers as before."""
    from tierlm import SamplingParams

    _, llm = demo_vlm
    params = SamplingParams(**GREEDY_IMAGE)
    assert llm.engine.cache_manager.prefix_caching
    first, second, again = (llm.chat(image_chat(random_image(seed), "and this?"), params)[0] for seed in (1, 2, 1))
    rows = [i for i, t in enumerate(first.prompt_token_ids) if t == llm.engine.model_config.vision.image_token_id]
    assert second.prompt_token_ids == first.prompt_token_ids
    assert second.num_cached_tokens <= rows[0] and again.num_cached_tokens > rows[-1]
    assert list(second.outputs[0].token_ids) != list(first.outputs[0].token_ids)
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)


def test_encoder_cache_is_lru_within_its_bytes():
    from tierlm.engine.encoder import EncoderCache

    cache, feature = EncoderCache(max_bytes=2 * 4 * 16), torch.zeros(4, 4)  # two [4, 4] fp32 features
    cache.put(b"a", feature)
    cache.put(b"b", feature + 1)
    assert cache.get(b"a") is not None  # now b is the least recently used
    cache.put(b"c", feature + 2)
    assert b"b" not in cache and b"a" in cache and b"c" in cache and cache.nbytes == 128
    cache.put(b"huge", torch.zeros(9, 4))  # larger than the whole bound: not kept, nothing evicted
    assert len(cache) == 2 and b"huge" not in cache
    assert cache.hits == 1


def test_encoder_cache_skips_the_tower_for_an_image_seen_before(demo_vlm):
    """A second request with the same image behind other text (so no prefix-cache block reaches its rows)
    takes its features from the encoder cache: the tower runs once. Here the tower streams from host
    memory (--mm-encoder-offload), and the tokens equal the resident engine's."""
    from tierlm import LLM, SamplingParams

    folder, resident = demo_vlm
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=256, max_num_batched_tokens=16,
              mm_encoder_offload=True)
    tower = llm.engine.model.visual
    assert tower.streamed is not None
    calls = []
    encode = tower.forward
    tower.forward = lambda *args: calls.append(1) or encode(*args)
    params = SamplingParams(**GREEDY_IMAGE)
    image = random_image(4)
    first = llm.chat(image_chat(image), params)[0]
    other = [{"role": "system", "content": "a different system prompt"}, *image_chat(image)[1:]]
    second = llm.chat(other, params)[0]
    image_row = second.prompt_token_ids.index(llm.engine.model_config.vision.image_token_id)
    assert len(calls) == 1 and second.num_cached_tokens <= image_row and llm.engine.encoder_cache.hits == 1
    assert [list(o.outputs[0].token_ids) for o in (first, second)] == [
        list(resident.chat(m, params)[0].outputs[0].token_ids) for m in (image_chat(image), other)]
    llm.chat(image_chat(random_image(5)), params)
    assert len(calls) == 2


def test_server_answers_a_chat_with_a_data_url_image(demo_vlm, image_host):
    """/v1/chat/completions with a data: URL image (in-process, prefix caching off) answers the tokens
    LLM.chat gives for the same messages; an http URL on an allowed host is fetched and answered too."""
    import asyncio
    import base64
    import io

    import httpx

    from tierlm import SamplingParams
    from tierlm.engine.llm_engine import EngineConfig, LLMEngine
    from tierlm.server.api import build_app
    from tierlm.server.async_engine import AsyncEngine

    folder, llm = demo_vlm
    png = io.BytesIO()
    random_image(3, (96, 128)).save(png, format="PNG")
    messages = image_chat("data:image/png;base64," + base64.b64encode(png.getvalue()).decode())
    expected = llm.chat(messages, SamplingParams(**GREEDY_IMAGE))[0].outputs[0].text
    engine = AsyncEngine(LLMEngine(EngineConfig(str(folder), dtype="float32", device="cpu", max_model_len=256,
                                                enable_prefix_caching=False)), "vlm")

    async def ask() -> list[httpx.Response]:
        engine.start()
        try:
            app = build_app(engine, "vlm", allowed_media_domains=["127.0.0.1"])
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tierlm",
                                         timeout=60) as client:
                return [await client.post("/v1/chat/completions", json={"model": "vlm", "messages": m, **GREEDY_IMAGE})
                        for m in (messages, image_chat(f"{image_host}/cat.png"))]
        finally:
            engine.stop()

    response, fetched = asyncio.run(ask())
    assert response.status_code == 200, response.text
    assert expected and response.json()["choices"][0]["message"]["content"] == expected
    assert fetched.status_code == 200 and fetched.json()["usage"]["prompt_tokens"] > 0, fetched.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA graphs)")
def test_graph_decode_beside_an_image_request_gives_the_eager_tokens(demo_vlm):
    """A text request decoding beside an image request: steps with the image request run eagerly, the
    others replay graphs; fp32 tokens equal an all-eager run's."""
    from tierlm import LLM, SamplingParams

    folder, _ = demo_vlm
    chats = [image_chat(random_image(0)), [{"role": "user", "content": "hi there"}]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 24)]
    tokens, static_steps = {}, {}
    for eager in (False, True):
        llm = LLM(str(folder), dtype="float32", device="cuda", max_model_len=256, max_num_batched_tokens=16,
                  enforce_eager=eager)
        tokens[eager] = [list(o.outputs[0].token_ids) for o in llm.chat(chats, params, use_tqdm=False)]
        static_steps[eager] = llm.engine.runner.static_steps
    assert tokens[False] == tokens[True]
    assert static_steps[False] > 0 and static_steps[True] == 0
