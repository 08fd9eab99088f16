"""Checkpoints in the real ERNIE-5.5 format (docs/checkpoints.md).

`spec`: the tensor list; `fp8`: block e4m3 weights; `writer` / `loader`: sharded safetensors, strict;
`tokenizer`: the tiny checkpoints' tokenizer; `random_init` / `tiny`: random weights and the `make-tiny`
presets. This file imports nothing, so importing one module stays cheap.
"""
