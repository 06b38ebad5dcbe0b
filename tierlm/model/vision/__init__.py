"""The vision side of Qwen4-Exp: images in, rows of the prompt embedding out.

- `grid`: what follows from each image's patch grid (t, h, w) alone: patch coordinates in the merge-block
  order the processor emits, the learned position table's bilinear taps, per-frame attention segments.
- `tower`: the ViT and merger (`model.visual.*`): patches -> merged features of the text width.
- `mrope`: the prompt's 3-D M-RoPE positions (image tokens on their (t, h, w) grid, text resuming after).
"""
