"""Quantized weights: formats (compressed-tensors pack-quantized, GPTQ / AutoRound), the quant methods
layers are built with, and the checkpoint's quantization_config (see `base` for the shape of it all)."""
