"""Test-only (tests/serving/test_server_tp_cpu.py puts this folder on the CPU server's PYTHONPATH).

SGLang 0.5.23 cannot start a `--device cpu` server with more than one rank on a build without sgl-kernel's
CPU ops, for two reasons outside the model:
- `init_model_parallel_group` asks for PyNccl on every non-NPU / non-XPU platform, and PyNccl's constructor
  opens a CUDA device (`ValueError: Expected a cuda device, but got: cpu`): here it is turned off when no CUDA
  device exists, so the groups' collectives take SGLang's own CPU fallback (`torch.distributed` over gloo);
- `adjust_config_with_unaligned_cpu_tp` (CPU only) pads head counts for ranks that do not divide them, counting
  one KV head for ERNIE-5.5's single shared latent, and writes `qk_head_dim`, a derived property of our
  config: for the ERNIE-5.5 architecture it is skipped (the attention layers shard heads themselves and refuse
  a TP size that does not divide them).
Nothing else changes: the ranks, groups, model sharding, collectives and scheduler are SGLang's and ours."""

import importlib.abc
import importlib.util
import sys


def _parallel_state(module):
    orig = module.init_model_parallel_group

    def init_model_parallel_group(*a, **k):
        import torch

        if not torch.cuda.is_available():
            k["use_pynccl"] = False
        return orig(*a, **k)

    module.init_model_parallel_group = init_model_parallel_group


def _model_runner(module):
    orig = module.adjust_config_with_unaligned_cpu_tp

    def adjust(model_config, load_config, tp_size):
        if "Ernie5_5_MoeForCausalLM" in (getattr(model_config.hf_config, "architectures", None) or []):
            return model_config
        return orig(model_config, load_config, tp_size)

    module.adjust_config_with_unaligned_cpu_tp = adjust


_PATCHES = {
    "sglang.srt.distributed.parallel_state": _parallel_state,
    "sglang.srt.model_executor.model_runner": _model_runner,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
