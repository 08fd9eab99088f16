"""Checkpoints in the real ERNIE-5.5 format (docs/checkpoints.md).

- `spec`: the tensor list derived from the config (names, shapes, kinds; what FP8 covers).
- `fp8`: block-128 e4m3 quantize / dequantize (convention 12).
- `writer` / `loader`: sharded safetensors + index, strict and atomic writing, strict reading.
- `tokenizer`: the tiny checkpoints' byte-level BPE tokenizer (BOS once).
- `random_init`, `tiny`: random weights and the `make-tiny` presets.

Modules import torch; this package file imports nothing, so importing one module stays cheap.
"""
