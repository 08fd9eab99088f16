"""Test-only (tests/serving/test_server_tp_cpu.py puts this folder on the CPU server's PYTHONPATH).

SGLang 0.5.23 cannot start a `--device cpu` server with more than one rank on a build without sgl-kernel's
CPU ops, for two reasons outside the model:
- `init_model_parallel_group` asks for PyNccl on every non-NPU / non-XPU platform, and PyNccl's constructor
  opens a CUDA device (`ValueError: Expected a cuda device, but got: cpu`): here it is turned off when no CUDA
  device exists, so the groups' collectives take SGLang's own CPU fallback (`torch.distributed` over gloo);
- `adjust_config_with_unaligned_cpu_tp` (CPU only) pads head counts for ranks that do not divide them, counting
  one KV head for ERNIE-5.5's single shared latent, and writes `qk_head_dim`, a derived property of our
  config: for the ERNIE-5.5 architectures (the model and its ECHO draft) it is skipped (the attention layers shard heads themselves and refuse
  a TP size that does not divide them).
Expert parallelism (`--ep`) adds two, in SGLang's standard dispatch:
- `StandardDispatcher.dispatch` builds its global -> local expert map on `get_device()`, which raises on a host
  with neither CUDA nor `SGLANG_USE_CPU_ENGINE=1`: there it answers "cpu";
- the CPU MoE (`moe_forward_native`) counts tokens per expert with `scatter_`, which cannot take the -1 ids
  that mark another rank's experts (the GPU runners drop them) and counts a repeated id in a row once: there
  each top-k column runs on its own, a -1 id as local expert 0 with routing weight 0 (which adds exactly zero).
Attention DP adds four, in SGLang's DP-attention machinery:
- `ForwardBatch.prepare_mlp_sync_batch` builds the per-rank token counts with `pin_memory=True`, which needs a
  CUDA driver: there without pinning;
- `dp_attention.memcpy` places a rank's rows into the gather buffer with Triton unless `SGLANG_USE_CPU_ENGINE=1`:
  there with its torch copy (`memcpy_cpu`);
- `GroupCoordinator.all_gather_into_tensor` goes through a custom op registered for accelerators only: for CPU
  tensors it takes the group's own gather (gloo), into an output viewed as [world * rows, ...] (gloo's shape
  check; the DP LM head's logits gather over attn_tp hands a [world, rows, vocab / world] output);
- at attention TP > 1, `GroupCoordinator.reduce_scatter_tensor` (the gather's first step over attn_tp) likewise:
  for CPU tensors the group's own reduce-scatter (gloo).
Attention CP (`--enable-prefill-cp`) adds one, in SGLang's CP extend path:
- `EagerRunner._execute_extend_cp` asks `torch.cuda.current_stream()` for the stream of its hidden-state gather,
  which raises without an NVIDIA driver: there the module's `torch.cuda.current_stream` answers None (the
  interleave gather takes no stream).
Nothing else changes: the ranks, groups, model sharding, collectives and scheduler are SGLang's and ours."""

from ernie55_shim_lib import patch_after_import


def _parallel_state(module):
    orig = module.init_model_parallel_group

    def init_model_parallel_group(*a, **k):
        import torch

        if not torch.cuda.is_available():
            k["use_pynccl"] = False
        return orig(*a, **k)

    module.init_model_parallel_group = init_model_parallel_group

    # the DP-attention gather's all-gather is a custom op registered for accelerators only
    gather = module.GroupCoordinator.all_gather_into_tensor

    def all_gather_into_tensor(self, output, input):
        if output.device.type == "cpu":
            # NCCL fills any output of world x input elements (the DP LM head's logits gather hands [world, T, V']
            # for a [T, V'] input); gloo's wants [world * T, V']: the same memory, viewed so
            if output.dim() != input.dim():
                output = output.view(-1, *input.shape[1:])
            return self._all_gather_into_tensor(output, input)
        return gather(self, output, input)

    module.GroupCoordinator.all_gather_into_tensor = all_gather_into_tensor

    # so is the reduce-scatter of the gather at attention TP > 1 (each attn_tp rank keeps a slice of its DP rows)
    scatter = module.GroupCoordinator.reduce_scatter_tensor

    def reduce_scatter_tensor(self, output, input):
        if output.device.type == "cpu":
            return self._reduce_scatter_tensor(output, input)
        return scatter(self, output, input)

    module.GroupCoordinator.reduce_scatter_tensor = reduce_scatter_tensor


def _model_runner(module):
    orig = module.adjust_config_with_unaligned_cpu_tp

    def adjust(model_config, load_config, tp_size):
        archs = getattr(model_config.hf_config, "architectures", None) or []
        if {"Ernie5_5_MoeForCausalLM", "Ernie5_5MoeMTPModel"} & set(archs):  # the model, its ECHO draft
            return model_config
        return orig(model_config, load_config, tp_size)

    module.adjust_config_with_unaligned_cpu_tp = adjust


def _standard_dispatcher(module):
    orig = module.get_device

    def get_device(device_id=None):
        import torch

        return orig(device_id) if torch.cuda.is_available() else "cpu"

    module.get_device = get_device


def _fused_moe_native(module):
    orig = module.moe_forward_native

    def moe_forward_native(layer, x, topk_output, moe_runner_config):
        ids = topk_output.topk_ids
        if not bool((ids < 0).any()):
            return orig(layer, x, topk_output, moe_runner_config)
        w = topk_output.topk_weights.masked_fill(ids < 0, 0)
        ids = ids.clamp_min(0)
        out = None
        for j in range(ids.shape[1]):
            col = topk_output._replace(topk_weights=w[:, j : j + 1], topk_ids=ids[:, j : j + 1])
            y = orig(layer, x, col, moe_runner_config)
            out = y if out is None else out + y
        return out

    module.moe_forward_native = moe_forward_native


def _forward_batch_info(module):
    import torch

    if torch.cuda.is_available():
        return

    class _UnpinnedTorch:
        """`torch` for this module, whose `tensor(..., pin_memory=True)` needs a CUDA driver."""

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def tensor(*a, pin_memory=False, **k):
            return torch.tensor(*a, **k)

    module.torch = _UnpinnedTorch()


def _dp_attention(module):
    import torch

    if not torch.cuda.is_available():
        module.memcpy_func = module.memcpy_cpu


def _eager_runner(module):
    import torch

    if torch.cuda.is_available():
        return

    class _Cuda:
        """`torch.cuda` for this module, whose current_stream() needs an NVIDIA driver."""

        def __getattr__(self, name):
            return getattr(torch.cuda, name)

        @staticmethod
        def current_stream(device=None):
            return None

    class _Torch:
        cuda = _Cuda()

        def __getattr__(self, name):
            return getattr(torch, name)

    module.torch = _Torch()


_PATCHES = {
    "sglang.srt.distributed.parallel_state": _parallel_state,
    "sglang.srt.model_executor.model_runner": _model_runner,
    "sglang.srt.layers.moe.token_dispatcher.standard": _standard_dispatcher,
    "sglang.srt.layers.moe.fused_moe_native": _fused_moe_native,
    "sglang.srt.model_executor.forward_batch_info": _forward_batch_info,
    "sglang.srt.layers.dp_attention": _dp_attention,
    "sglang.srt.model_executor.runner.eager_runner": _eager_runner,
}


patch_after_import(_PATCHES)
