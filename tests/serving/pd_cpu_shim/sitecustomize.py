"""Test-only (tests/serving/test_pd_cpu.py puts this folder on the PYTHONPATH of its `--device cpu` PD servers).

Two SGLang 0.5.23 PD prefill paths record CUDA events, which need the CUDA driver:
- the Mooncake sender declares `supports_host_tensor_indices`, so the prefill scheduler's `send_kv_chunk` copies
  a chunk's page indices into pinned host memory and records a CUDA event for the transfer thread to wait on.
  Without a CUDA device the sender here declares no such support, and the scheduler takes its other branch
  (`kv_to_page_indices`: the same page indices, copied synchronously), the one every other transfer backend
  takes;
- under the overlap scheduler, `maybe_send_cached_prefix_chunk` sends a prefix-cache hit's pages before the
  suffix's forward, after a CUDA event on the forward stream. `SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0`
  (SGLang's own switch, unless the server's environment sets it) leaves those pages to the send after the
  forward, which covers them.
Nothing else changes."""

import os

from ernie55_shim_lib import patch_after_import

os.environ.setdefault("SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX", "0")


def _host_indices_off_without_cuda(module):
    import torch

    if not torch.cuda.is_available():
        module.MooncakeKVSender.supports_host_tensor_indices = False


patch_after_import({"sglang.srt.disaggregation.mooncake.conn": _host_indices_off_without_cuda})
