"""Version pin and the SGLang symbols this plugin attaches to, checked at plugin load.

SGLang internals move fast. `check()` fails with a message that names the installed and the pinned
version before anything is hooked, so a mismatch never turns into a silent misbehaviour.
"""

from __future__ import annotations

import importlib
import inspect

from . import envs
from ._version import SGLANG_PIN


class SGLangVersionError(RuntimeError):
    """The installed SGLang is not the version this plugin was written against."""


# (module, attribute path, parameters the attribute must accept, in order; None = only existence)
# Every hook target of the plugin goes here (the patch ledger in docs/hooks.md explains each).
REQUIRED_SYMBOLS: list[tuple[str, str, tuple[str, ...] | None]] = [
    ("sglang.srt.models.registry", "ModelRegistry.register", ("package_name", "overwrite", "strict")),
    ("sglang.srt.utils.hf_transformers.common", "_CONFIG_REGISTRY", None),
    # server arguments (sglang_ernie55/args; docs/server-args.md)
    ("sglang.srt.server_args", "prepare_server_args", ("argv",)),
    ("sglang.srt.server_args", "ServerArgs.resolve_once", ()),
    ("sglang.srt.arg_groups.choices", "ATTENTION_BACKEND_CHOICES", None),
    ("sglang.srt.arg_groups.choices", "DRAFT_ATTENTION_BACKEND_CHOICES", None),
    ("sglang.srt.arg_groups.choices", "add_attention_backend_choices", None),
    ("sglang.srt.arg_groups.choices", "add_draft_attention_backend_choices", None),
    ("sglang.srt.arg_groups.choices", "DETERMINISTIC_ATTENTION_BACKEND_CHOICES", None),
    ("sglang.srt.arg_groups.choices", "RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND", None),
    ("sglang.srt.arg_groups.choices", "add_deterministic_attention_backend_choices", None),
    ("sglang.srt.arg_groups.choices", "add_radix_supported_deterministic_attention_backend_choices", None),
    ("sglang.srt.runtime_context", "get_exec", ()),
    ("sglang.srt.arg_groups.model_override_base", "register_model_override", ("architecture",)),
    ("sglang.srt.arg_groups.model_override_base", "_MODEL_OVERRIDE_FNS", None),
    ("sglang.srt.arg_groups.model_override_base", "model_config_of", ("server_args",)),
    ("sglang.srt.arg_groups.model_override_base", "resolving_view", ("server_args",)),
    ("sglang.srt.arg_groups.model_override_base", "resolved_view", ("server_args",)),
    ("sglang.srt.arg_groups.overrides", "declare_resolution", ("server_args", "source")),
    ("sglang.srt.utils", "parse_connector_type", None),
    ("sglang.srt.connector", "ConnectorType", None),
    ("sglang.srt.arg_groups.resolution_hooks", "register_resolution_hook", ("name",)),
    ("sglang.srt.arg_groups.resolution_hooks", "_OVERRIDABLE_HOOKS", None),
    ("sglang.srt.arg_groups.model_hook", "handle_model_specific_adjustments", ("server_args",)),
    ("sglang.srt.arg_groups.parallel_hook", "handle_data_parallelism", ("server_args",)),
    ("sglang.srt.arg_groups.parallel_hook", "handle_context_parallelism", ("server_args",)),
    ("sglang.srt.arg_groups.moe_hook", "handle_a2a_moe", ("server_args",)),
    ("sglang.srt.arg_groups.speculative_hook", "handle_speculative_decoding", ("server_args",)),
    ("sglang.srt.plugins.hook_registry", "HookRegistry.register", ("target", "hook", "hook_type")),
    ("sglang.srt.entrypoints.openai.serving_base", "OpenAIServingBase._parse_model_parameter", ("model",)),
    (
        "sglang.srt.entrypoints.openai.serving_completions",
        "OpenAIServingCompletion._validate_request",
        ("request",),
    ),
    ("sglang.srt.entrypoints.openai.serving_chat", "OpenAIServingChat._validate_request", ("request",)),
    # model, ernie55 backend and KV pool (sglang_ernie55/{models,attention,mem_cache}; docs/serving-design.md)
    ("sglang.srt.model_executor.pool_configurator", "create_memory_pool_configurator", ("kvc",)),
    ("sglang.srt.model_executor.pool_configurator", "MemoryPoolConfigurator.calculate_pool_sizes",
     ("available_bytes", "page_size")),
    # what the pool sizing charges besides our pools: SGLang's request count and request-table headroom
    ("sglang.srt.mem_cache.kv_cache_configurator", "KVCacheConfigurator.resolve_max_num_reqs", ("token_capacity",)),
    ("sglang.srt.mem_cache.allocation_sizing", "get_req_to_token_extra_context_len", ()),
    ("sglang.srt.runtime_context", "get_disagg", ()),
    (
        "sglang.srt.mem_cache.kv_cache_configurator",
        "KVCacheConfigurator._build_token_to_kv_pool",
        ("sizes", "is_dsa_model", "is_dsv4_model", "req_to_token_pool"),
    ),
    # hybrid SWA (no hook: the config opt-in and SGLang's own allocator / radix cache; docs/hooks.md)
    ("sglang.srt.configs.model_config", "is_hybrid_swa_model", ("model_architectures", "hf_text_config")),
    ("sglang.srt.configs.model_config", "get_hybrid_layer_ids", ("model_architectures", "hf_text_config")),
    ("sglang.srt.mem_cache.base_swa_memory_pool", "BaseSWAKVPool.register_mapping", ("full_to_swa_index_mapping",)),
    ("sglang.srt.mem_cache.base_swa_memory_pool", "BaseSWAKVPool.translate_loc_from_full_to_swa", ("kv_indices",)),
    ("sglang.srt.mem_cache.allocator.swa", "SWATokenToKVPoolAllocator.__init__",
     ("size", "size_swa", "page_size", "dtype", "device", "kvcache", "need_sort")),
    ("sglang.srt.mem_cache.allocator.swa", "SWATokenToKVPoolAllocator.free_swa_segment", ("free_index",)),
    ("sglang.srt.model_executor.pool_configurator", "MemoryPoolConfig",
     ("max_total_num_tokens", "max_running_requests", "full_max_total_num_tokens", "swa_max_total_num_tokens")),
    ("sglang.srt.model_executor.pool_configurator", "MemoryPoolConfigurator.validate_swa_pool_size",
     ("swa_tokens", "sliding_window_size", "page_size")),
    ("sglang.srt.mem_cache.memory_pool", "KVCache.__init__",
     ("size", "page_size", "dtype", "layer_num", "device", "enable_memory_saver", "start_layer", "end_layer")),
    ("sglang.srt.layers.attention.attention_registry", "register_attention_backend", ("name",)),
    ("sglang.srt.layers.attention.base_attn_backend", "AttentionBackend.init_forward_metadata_out_graph",
     ("forward_batch", "in_capture")),
    ("sglang.srt.layers.radix_attention", "RadixAttention.forward", ("q", "k", "v", "forward_batch")),
    ("sglang.srt.model_executor.forward_context", "ForwardContext", None),
    ("sglang.srt.layers.moe.topk", "StandardTopKOutput", ("topk_weights", "topk_ids", "router_logits")),
    # the MoE's sum over ranks and the attention-TP group of the attention projections (docs/serving-design.md 8)
    ("sglang.srt.layers.moe.utils", "sum_post_experts_output", ("hidden_states",)),
    ("sglang.srt.layers.moe", "get_moe_a2a_backend", ()),
    ("sglang.srt.distributed.communication_op", "tensor_model_parallel_all_reduce", ("input_",)),
    ("sglang.srt.layers.linear", "ColumnParallelLinear.__init__", ("input_size", "output_size")),
    ("sglang.srt.layers.linear", "RowParallelLinear.__init__", ("input_size", "output_size")),
    (
        "sglang.srt.model_executor.model_runner_components.moe_ep_setup",
        "check_quantized_moe_compatibility",
        ("model_config", "tp_size", "moe_ep_size", "moe_dp_size"),
    ),
    # ECHO speculative decoding (sglang_ernie55/speculative; docs/echo.md)
    ("sglang.srt.configs.model_config", "ModelConfig._config_draft_model", ()),
    ("sglang.srt.configs.model_config", "resolve_spec_hidden_size", ("hf_config", "hidden_size", "hc_mult")),
    ("sglang.srt.speculative.draft_utils", "DraftBackendFactory.__init__",
     ("draft_model_runner", "topk", "speculative_num_steps")),
    ("sglang.srt.speculative.draft_utils", "DraftBackendFactory.create_decode_backend", ()),
    ("sglang.srt.speculative.draft_utils", "DraftBackendFactory.create_draft_extend_backend", ()),
    ("sglang.srt.speculative.eagle_worker_v2", "EagleDraftWorker.init_lm_head", ()),
    # the draft-extend CUDA graph for ECHO: the hooked capture step and what the hook reads / builds there
    ("sglang.srt.speculative.eagle_worker_v2", "EagleDraftWorker._capture_cuda_graphs", ()),
    ("sglang.srt.speculative.eagle_worker_v2", "EAGLEDraftExtendCudaGraphRunner.__init__",
     ("eagle_worker", "draft_extend_attn_backend", "speculative_num_steps")),
    ("sglang.srt.speculative.eagle_worker_v2", "check_cuda_graph_backend", ("phase", "backend")),
    ("sglang.srt.speculative.eagle_worker_v2", "get_batch_sizes_to_capture", ("model_runner",)),
    ("sglang.srt.speculative.eagle_worker_v2", "get_available_gpu_memory", ("device", "gpu_id")),
    ("sglang.srt.speculative.eagle_worker_v2", "log_info_on_rank0", ("logger", "msg")),
    ("sglang.srt.speculative.eagle_worker_v2", "_is_cpu", None),
    ("sglang.srt.speculative.eagle_worker_v2", "current_platform.is_out_of_tree", ()),
    ("sglang.srt.speculative.eagle_worker_v2", "envs.SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH", None),
    ("sglang.srt.speculative.eagle_worker_v2", "get_model", ()),
    ("sglang.srt.speculative.eagle_worker_v2", "get_exec", ()),
    # what that runner calls on the draft-extend backend (EchoDraftAttnBackend answers each)
    ("sglang.srt.layers.attention.base_attn_backend", "AttentionBackend.init_forward_metadata_in_graph",
     ("forward_batch",)),
    ("sglang.srt.layers.attention.base_attn_backend", "AttentionBackend.init_cuda_graph_state",
     ("max_bs", "max_num_tokens")),
    ("sglang.srt.layers.attention.base_attn_backend", "AttentionBackend.get_cuda_graph_seq_len_fill_value", ()),
    ("sglang.srt.layers.attention.base_attn_backend", "AttentionBackend.shared_read_ends", ("fm",)),
    ("sglang.srt.model_executor.model_runner_components.attention_backend_setup", "_build_resolved_backend",
     ("model_runner", "resolved", "init_new_workspace")),
    ("sglang.srt.layers.logits_processor", "LogitsProcessor.forward",
     ("input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states", "hidden_states_before_norm")),
]


def installed_sglang_version() -> str:
    import sglang

    return getattr(sglang, "__version__", "unknown")


def check_version() -> None:
    have = installed_sglang_version()
    if have != SGLANG_PIN and not envs.skip_version_check():
        raise SGLangVersionError(
            f"sglang-ernie55 is pinned to sglang=={SGLANG_PIN} but sglang=={have} is installed. "
            f"Install the pinned version (pip install sglang=={SGLANG_PIN}) or an sglang-ernie55 built for "
            f"{have}; SGLANG_ERNIE55_SKIP_VERSION_CHECK=1 loads anyway (unsupported)."
        )


def _resolve(module: str, attr_path: str):
    obj = importlib.import_module(module)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


def check_symbols(symbols=None) -> None:
    """Each hooked symbol exists and takes the expected parameters; else SGLangVersionError naming it."""
    have = installed_sglang_version()
    for module, attr_path, params in symbols if symbols is not None else REQUIRED_SYMBOLS:
        where = f"{module}.{attr_path}"
        try:
            obj = _resolve(module, attr_path)
        except (ImportError, AttributeError) as e:
            raise SGLangVersionError(
                f"sglang {have}: `{where}` is missing ({e}); sglang-ernie55 needs sglang=={SGLANG_PIN}"
            ) from e
        if params is None:
            continue
        try:
            names = list(inspect.signature(obj).parameters)
        except (TypeError, ValueError) as e:
            raise SGLangVersionError(f"sglang {have}: cannot inspect `{where}`: {e}") from e
        if names and names[0] in ("self", "cls"):
            names = names[1:]
        if names[: len(params)] != list(params):
            raise SGLangVersionError(
                f"sglang {have}: `{where}` takes {names}, expected it to start with {list(params)} "
                f"(as in sglang=={SGLANG_PIN}); this sglang-ernie55 does not support that SGLang"
            )


def check() -> None:
    check_version()
    check_symbols()
