"""Images into model inputs, before the engine: decoding and resizing them as the Qwen VL processors do
(`image_processor`), and the prompt's placeholder tokens (`prompt`). No model code here: the tower that
encodes the patches is `model/vision/`."""
