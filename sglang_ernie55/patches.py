"""The patch ledger: every place this plugin attaches to SGLang 0.5.23, one table, one `register()`.

Each row names the SGLang symbol (`module:attr.path`), how we attach (a HookRegistry hook, a resolution
hook, a registry entry, ...), our function (`module:name`, imported when the ledger is applied), the
parameters the symbol must take (checked by `compat` at plugin load), why and when the row can go. Rows
of kind READS are symbols we call without patching, listed only for that check. docs/hooks.md is the prose.
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass
from enum import Enum
from itertools import groupby
from typing import Any

from .checkpoint.spec import FP8_BLOCK
from .configuration import SERVING_PAGE_SIZE


class Kind(Enum):
    CONFIG = "config registration"
    CHOICE = "choice-list addition"
    MODEL_OVERRIDE = "model override"
    RESOLUTION = "resolution hook"
    AROUND = "HookRegistry AROUND"
    AFTER = "HookRegistry AFTER"
    ATTENTION_BACKEND = "attention-backend registration"
    HICACHE_STRATEGY = "HiCache stack-strategy registration"
    MODELS = "model registration"
    READS = "read, not patched"


@dataclass(frozen=True)
class Patch:
    target: str  # the SGLang symbol, `module:attr.path`
    kind: Kind
    ours: str | None  # `module:name` we attach (a package for MODELS); None for READS
    params: tuple[str, ...] | None  # leading parameters the target must take (self dropped); None: exists
    why: str
    until: str = ""  # when the row can go
    by: str = ""  # READS: the module that reads the symbol

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def attr(self) -> str:
        return self.target.partition(":")[2]

    @property
    def dotted(self) -> str:
        """The target as HookRegistry names it (`module.attr.path`)."""
        return f"{self.module}.{self.attr}"

    def ours_module(self) -> str | None:
        return self.ours.partition(":")[0] if self.ours else None

    def function(self) -> Any:
        """What we attach, imported now."""
        return pkgutil.resolve_name(self.ours)


PUBLIC_API = "never (public registration API)"
_CHOICES = "sglang.srt.arg_groups.choices"
_BACKEND = "sglang_ernie55.attention:BACKEND_NAME"
_RESOLUTION = "sglang_ernie55.args.resolution"
_RESOLUTION_UNTIL = "when SGLang has per-architecture validation callbacks"
_VALIDATE = "sglang_ernie55.args.requests:validate_request_hook"
_VALIDATE_WHY = (
    "SGLang serves a request whatever its `model` names, and under PD disaggregation `n > 1` hangs "
    "(its samples share one bootstrap room); the content rules of the tokenizer manager's row are checked "
    "here too, so that the message names the field the client sent (`prompt`, `logprobs`, `top_logprobs`)"
)
_VALIDATE_UNTIL = (
    "when SGLang checks the served name itself, supports `n > 1` under PD and bounds token ids and "
    "logprob counts by the vocabulary"
)
_SPEC = "sglang_ernie55.speculative"
_EW2 = "sglang.srt.speculative.eagle_worker_v2"
_DRAFT_UTILS = "sglang.srt.speculative.draft_utils"
_DRAFT_FACTORY_UNTIL = (
    "when `DraftBackendFactory` consults a registry (or a model can name its draft backends)"
)
_BASE_BACKEND = "sglang.srt.layers.attention.base_attn_backend:AttentionBackend"
_POOL_CONF = "sglang.srt.model_executor.pool_configurator"
_ASSEMBLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
_MOE_CONFIG = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config"
_FP8_GEMM = "sglang.kernels.ops.gemm.fp8_kernel"
_DISAGG_UTILS = "sglang.srt.disaggregation.utils"
_PD_UNTIL = "when PD asks the pool for its transfer layout instead of testing its class"


def _reads(by: str, why: str, *symbols: tuple[str, tuple[str, ...] | None]) -> list[Patch]:
    """READS rows: SGLang symbols the module `by` calls or subclasses without patching them."""
    return [Patch(target, Kind.READS, None, params, why, by=by) for target, params in symbols]


LEDGER: tuple[Patch, ...] = (
    # ------------------------------------------------------------------ config and server arguments
    Patch(
        "sglang.srt.utils.hf_transformers.common:_CONFIG_REGISTRY",
        Kind.CONFIG,
        "sglang_ernie55.configuration:Ernie55Config",
        None,
        "model_type `ernie5_5_moe` is unknown to SGLang's config registry and to transformers' AutoConfig",
        "when SGLang has a config-registration call (today the registry dict is written directly)",
    ),
    Patch(
        f"{_CHOICES}:add_attention_backend_choices",
        Kind.CHOICE,
        _BACKEND,
        None,
        "`ernie55` must be a legal `--attention-backend` and resolved backend value",
        PUBLIC_API,
    ),
    Patch(
        f"{_CHOICES}:add_draft_attention_backend_choices",
        Kind.CHOICE,
        _BACKEND,
        None,
        "`ernie55` must be a legal `--speculative-draft-attention-backend` value",
        PUBLIC_API,
    ),
    Patch(
        f"{_CHOICES}:add_deterministic_attention_backend_choices",
        Kind.CHOICE,
        _BACKEND,
        None,
        "`--enable-deterministic-inference` accepts only listed backends; ours is batch invariant "
        "(fixed key splits, rows independent of each other)",
        PUBLIC_API,
    ),
    Patch(
        f"{_CHOICES}:add_radix_supported_deterministic_attention_backend_choices",
        Kind.CHOICE,
        _BACKEND,
        None,
        "deterministic inference keeps the radix cache only for listed backends; a prefix hit recomputes no "
        "cached row with ours",
        PUBLIC_API,
    ),
    Patch(
        "sglang.srt.arg_groups.model_override_base:register_model_override",
        Kind.MODEL_OVERRIDE,
        "sglang_ernie55.args.overrides:ernie55_overrides",
        ("architecture",),
        f"the model's defaults for both ERNIE-5.5 architectures: `ernie55` backend, page size {SERVING_PAGE_SIZE}, SWA ratio "
        "0.1, KV dtype `auto` -> `fp8_e4m3`",
        PUBLIC_API,
    ),
    Patch(
        "sglang.srt.arg_groups.model_hook:handle_model_specific_adjustments",
        Kind.RESOLUTION,
        f"{_RESOLUTION}:model_specific_adjustments",
        ("server_args",),
        "reject user-given backends, page size, KV dtypes, parsers and `--hicache-size` before our overrides "
        "apply; prefill CUDA graphs off; warn on a context over 131072",
        _RESOLUTION_UNTIL,
    ),
    Patch(
        "sglang.srt.arg_groups.parallel_hook:handle_data_parallelism",
        Kind.RESOLUTION,
        f"{_RESOLUTION}:data_parallelism",
        ("server_args",),
        "attention TP must divide `o_groups`; the step asserts `tp % attn_dp_size` without a message",
        _RESOLUTION_UNTIL,
    ),
    Patch(
        "sglang.srt.arg_groups.parallel_hook:handle_context_parallelism",
        Kind.RESOLUTION,
        f"{_RESOLUTION}:context_parallelism",
        ("server_args",),
        "`--attn-cp-size` > 1 needs `--enable-prefill-cp --cp-strategy interleave` (checked before the step, which "
        "raises a bare error for a missing strategy); the attention-TP check on the final layout (prefill context "
        "parallelism rewrites `attn_cp_size`)",
        _RESOLUTION_UNTIL,
    ),
    Patch(
        "sglang.srt.arg_groups.moe_hook:handle_a2a_moe",
        Kind.RESOLUTION,
        f"{_RESOLUTION}:a2a_moe",
        ("server_args",),
        "DeepEP needs EP >= 4; the a2a backend must be `none` under pipeline parallelism",
        _RESOLUTION_UNTIL,
    ),
    Patch(
        "sglang.srt.arg_groups.speculative_hook:handle_speculative_decoding",
        Kind.RESOLUTION,
        f"{_RESOLUTION}:speculative_decoding",
        ("server_args",),
        "ECHO's legal settings and draft path; SGLang hard-codes the draft-path default per architecture and "
        "silently rewrites the draft-token count",
        "when SGLang's `_handle_eagle_family` architecture lists become a registry",
    ),
    # ------------------------------------------------------------------ requests
    Patch(
        "sglang.srt.entrypoints.openai.serving_completions:OpenAIServingCompletion._validate_request",
        Kind.AROUND,
        _VALIDATE,
        ("request",),
        _VALIDATE_WHY,
        _VALIDATE_UNTIL,
    ),
    Patch(
        "sglang.srt.entrypoints.openai.serving_chat:OpenAIServingChat._validate_request",
        Kind.AROUND,
        _VALIDATE,
        ("request",),
        _VALIDATE_WHY,
        _VALIDATE_UNTIL,
    ),
    Patch(
        "sglang.srt.managers.tokenizer_manager:TokenizerManager._validate_one_request",
        Kind.AROUND,
        "sglang_ernie55.args.requests:validate_one_request_hook",
        ("obj", "input_ids"),
        "SGLang passes prompt token ids outside the vocabulary, a top-logprobs count above it and an empty "
        "prompt of a batch to the scheduler, where the embedding, `topk` or the KV write raises and the "
        "server exits; an empty stop string ends every answer before its first token; the scheduler refuses a "
        "`logprob_start_len` past the prompt only after running the prompt's prefill",
        "when SGLang bounds token ids and logprob counts by the vocabulary and refuses empty prompts, empty stop "
        "strings and logprob starts past the prompt itself, before the scheduler",
    ),
    Patch(
        "sglang.srt.entrypoints.http_server:serve_generate_request",
        Kind.AROUND,
        "sglang_ernie55.args.requests:serve_generate_request_hook",
        ("obj", "request"),
        "a streaming `/generate` request starts its 200 stream before the tokenizer manager validates it, so "
        "a refused request (a token id outside the vocabulary, a prompt over the context length, ...) gets a "
        "200 and an error event; SGLang's OpenAI handlers await the first event before answering",
        "when `/generate` awaits its stream's first event before answering, as the OpenAI handlers do",
    ),
    # ------------------------------------------------------------------ model, backend, pool
    Patch(
        "sglang.srt.layers.attention.attention_registry:register_attention_backend",
        Kind.ATTENTION_BACKEND,
        "sglang_ernie55.attention:create_ernie55_backend",
        ("name",),
        "`--attention-backend ernie55` must build our backend",
        PUBLIC_API,
    ),
    Patch(
        "sglang.srt.model_executor.model_runner_components.moe_ep_setup:check_quantized_moe_compatibility",
        Kind.AROUND,
        "sglang_ernie55.layers:around_moe_check",
        ("model_config", "tp_size", "moe_ep_size", "moe_dp_size"),
        f"SGLang refuses an FP8 block-quantized MoE whose expert width is not a multiple of {FP8_BLOCK}; ERNIE-5.5 "
        "dequantizes such experts on load, so nothing block-quantized is left to check",
        "when the check consults the layer's quant method instead of the config",
    ),
    Patch(
        f"{_MOE_CONFIG}:get_moe_configs",
        Kind.AROUND,
        "sglang_ernie55.kernels.moe_configs:around_get_moe_configs",
        ("E", "N", "dtype", "block_n", "block_k", "per_channel_quant", "down_moe"),
        "SGLang reads fused-MoE Triton kernel configs only from its own folder (or one `SGLANG_MOE_CONFIG_DIR` "
        "that replaces it), where ERNIE-5.5's expert shapes have none; its file names omit the hidden size and "
        "top-k, so a same-named file there may be tuned for another model's geometry",
        "when SGLang searches a list of config folders that a plugin can add to",
    ),
    Patch(
        f"{_FP8_GEMM}:get_w8a8_block_fp8_configs",
        Kind.AROUND,
        "sglang_ernie55.kernels.fp8_linear_configs:around_get_w8a8_block_fp8_configs",
        ("N", "K", "block_n", "block_k"),
        "SGLang reads block-FP8 GEMM Triton configs only from its own package folder, where ERNIE-5.5's Linear "
        "shapes have none, and then runs one default tile at every batch size (at one decode row an N of 2048 is "
        "16 programs on a 132-SM GPU)",
        "when SGLang searches a list of config folders that a plugin can add to",
    ),
    Patch(
        f"{_POOL_CONF}:create_memory_pool_configurator",
        Kind.AROUND,
        "sglang_ernie55.mem_cache:around_create_memory_pool_configurator",
        ("kvc",),
        "SGLang sizes pools from MHA / MLA cell sizes (or DSV4's); none knows our bytes per token nor the "
        "open-block state per request slot",
        "when a model can register its own pool configurator",
    ),
    Patch(
        "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator._build_token_to_kv_pool",
        Kind.AROUND,
        "sglang_ernie55.mem_cache:around_build_token_to_kv_pool",
        ("sizes", "is_dsa_model", "is_dsv4_model", "req_to_token_pool"),
        "the pool class is chosen by hard-coded architecture predicates: the target needs "
        "`Ernie55TokenToKVPool`, the ECHO draft worker `EchoDraftKVPool` (one layer of window rows)",
        "when SGLang has a pool-class registry for out-of-tree model families (the platform `get_kv_pool_cls` "
        "covers only the mha / mla / dsa kinds)",
    ),
    Patch(
        f"{_ASSEMBLER}:register_stack_strategy",
        Kind.HICACHE_STRATEGY,
        "sglang_ernie55.mem_cache.host_pool:Ernie55HiCacheStrategy",
        ("strategy",),
        "`--enable-hierarchical-cache` builds its host pools from a list of stack strategies, each for SGLang's "
        "own pool classes; none mirrors our window, compressed, latent and indexer pages",
        PUBLIC_API,
    ),
    Patch(
        f"{_DISAGG_UTILS}:is_mla_backend",
        Kind.AROUND,
        "sglang_ernie55.mem_cache.pd:around_is_mla_backend",
        ("target_kv_pool",),
        "PD disaggregation splits a pool's transfer buffers into K and V halves with per-head slicing unless the "
        "pool is one of SGLang's MLA / DeepSeek-V4 pool classes (an isinstance test); every ERNIE-5.5 buffer is one "
        "region of per-token rows, replicated over attention-TP ranks",
        _PD_UNTIL,
    ),
    Patch(
        f"{_DISAGG_UTILS}:setup_state_kv_args",
        Kind.AROUND,
        "sglang_ernie55.mem_cache.pd:around_setup_state_kv_args",
        ("kv_args", "token_to_kv_pool", "draft_token_to_kv_pool", "total_kv_layers", "req_to_token_pool"),
        "PD disaggregation transfers a draft pool's SWA rows beside the target's only for DeepSeek-V4 pool classes "
        "(an isinstance test), and gives every `BaseSWAKVPool` an SWA component even without an SWA pool",
        _PD_UNTIL,
    ),
    Patch(
        "sglang.srt.disaggregation.decode:DecodePreallocQueue._uses_swa_tail_prealloc",
        Kind.AROUND,
        "sglang_ernie55.mem_cache.pd:around_uses_swa_tail_prealloc",
        (),
        "a PD decode server allocates SWA slots for the window tail of a prompt only for SGLang's own SWA pool "
        "classes (an isinstance test); for any other hybrid pool it charges the whole prompt plus the decode reserve "
        "to the SWA pool, and a prompt longer than the SWA pool less that reserve waits for ever",
        _PD_UNTIL,
    ),
    # ------------------------------------------------------------------ ECHO speculative decoding
    Patch(
        "sglang.srt.configs.model_config:ModelConfig._config_draft_model",
        Kind.AFTER,
        f"{_SPEC}:after_config_draft_model",
        (),
        "SGLang maps a target architecture to its draft's in a hard-coded if-chain; the checkpoint's "
        "config.json names only the target architecture",
        "when SGLang reads the draft architecture from the config or has a draft-architecture registry",
    ),
    Patch(
        "sglang.srt.configs.model_config:resolve_spec_hidden_size",
        Kind.AROUND,
        f"{_SPEC}:around_resolve_spec_hidden_size",
        ("hf_config", "hidden_size", "hc_mult"),
        "the target->draft hidden width is `hc_mult * hidden_size` only for a hard-coded architecture list; "
        "ECHO reads all n residual streams",
        "when the predicate reads a config field",
    ),
    Patch(
        f"{_DRAFT_UTILS}:DraftBackendFactory.create_decode_backend",
        Kind.AROUND,
        f"{_SPEC}:around_create_decode_backend",
        (),
        "draft backends come from a hard-coded name -> factory map, where `ernie55` is unknown; the ECHO draft "
        "attends only its own window",
        _DRAFT_FACTORY_UNTIL,
    ),
    Patch(
        f"{_DRAFT_UTILS}:DraftBackendFactory.create_draft_extend_backend",
        Kind.AROUND,
        f"{_SPEC}:around_create_draft_extend_backend",
        (),
        "the draft-extend backend comes from the same hard-coded map",
        _DRAFT_FACTORY_UNTIL,
    ),
    Patch(
        "sglang.srt.model_executor.model_runner_components.attention_backend_setup:_build_resolved_backend",
        Kind.AROUND,
        f"{_SPEC}:around_build_resolved_backend",
        ("model_runner", "resolved", "init_new_workspace"),
        "the draft ModelRunner builds a backend of its own from the name `ernie55`, whose target backend refuses "
        "the draft's pool",
        "when attention-backend factories receive the runner's role, or with a draft-backend registry",
    ),
    Patch(
        f"{_EW2}:EagleDraftWorker.init_lm_head",
        Kind.AFTER,
        f"{_SPEC}:after_init_lm_head",
        (),
        "SGLang shares only the embedding and lm_head with a draft; ECHO also runs the target's last layer and "
        "hc_head and must not hold a copy",
        "when SGLang offers a share-modules-with-the-target protocol for drafts",
    ),
    Patch(
        f"{_EW2}:EagleDraftWorker._capture_cuda_graphs",
        Kind.AROUND,
        f"{_SPEC}:around_capture_cuda_graphs",
        (),
        "SGLang captures the draft-extend CUDA graph only for an isinstance allow-list of backends; without the "
        "hook every ECHO round runs the draft extend eagerly",
        "when the decision asks the backend (e.g. a `supports_draft_extend_cuda_graph` attribute on "
        "`AttentionBackend`) or the platform hook is consulted in tree too",
    ),
    # ------------------------------------------------------------------ models (last: imports them strictly)
    Patch(
        "sglang.srt.entrypoints.http_server:_wait_and_warmup",
        Kind.AROUND,
        "sglang_ernie55.warmup:around_wait_and_warmup",
        ("server_args", "launch_callback", "execute_warmup_func"),
        "the first long prompt of a fresh server waits for Triton to compile the kernels of a full prefill "
        "chunk; `--warmups` cannot be defaulted by a model (not overridable), so the warm-up thread sends a "
        "long prompt (four chunks and more) before SGLang's own warm-up request",
        "when a model can declare its start-up warm-ups",
    ),
    Patch(
        "sglang.srt.models.registry:ModelRegistry.register",
        Kind.MODELS,
        "sglang_ernie55.models",
        ("package_name", "overwrite", "strict"),
        "SGLang looks model classes up by architecture name; ours live outside `sglang.srt.models`",
        PUBLIC_API,
    ),
    # ------------------------------------------------------------------ read, not patched
    *_reads(
        "sglang_ernie55.patches",
        "the registration calls and tables the rows above go through",
        ("sglang.srt.plugins.hook_registry:HookRegistry.register", ("target", "hook", "hook_type")),
        ("sglang.srt.arg_groups.resolution_hooks:register_resolution_hook", ("name",)),
        ("sglang.srt.arg_groups.resolution_hooks:_OVERRIDABLE_HOOKS", None),
        ("sglang.srt.arg_groups.model_override_base:_MODEL_OVERRIDE_FNS", None),
        (f"{_ASSEMBLER}:_STRATEGIES", None),
    ),
    *_reads(
        "sglang_ernie55.warmup",
        "the prefill warm-up reads the server's settings and sends its prompt as SGLang's warm-up does",
        ("sglang.srt.entrypoints.http_server:_execute_server_warmup", ("server_args",)),
        ("sglang.srt.arg_groups.serving_hook:ssl_verify_of", ("cfg",)),
        ("sglang.srt.runtime_context:get_parallel", ()),
        ("sglang.srt.runtime_context:get_serving", ()),
    ),
    *_reads(
        "sglang_ernie55.args.api",
        "`resolve_server_args` parses and resolves as `sglang serve` does",
        ("sglang.srt.server_args:prepare_server_args", ("argv",)),
        ("sglang.srt.server_args:ServerArgs.resolve_once", ()),
    ),
    *_reads(
        "sglang_ernie55.args.resolution",
        "the checkpoint's config and the values given / decided during resolution; declarations",
        ("sglang.srt.arg_groups.model_override_base:model_config_of", ("server_args",)),
        ("sglang.srt.arg_groups.model_override_base:resolving_view", ("server_args",)),
        ("sglang.srt.arg_groups.model_override_base:resolved_view", ("server_args",)),
        ("sglang.srt.arg_groups.overrides:declare_resolution", ("server_args", "source")),
        ("sglang.srt.utils:parse_connector_type", None),
        ("sglang.srt.connector:ConnectorType", None),
    ),
    *_reads(
        "sglang_ernie55.args.requests",
        "splits `<served name>:<adapter>` as SGLang does; the `/generate` hook asks the HTTP server's tokenizer "
        "manager which model it serves",
        ("sglang.srt.entrypoints.openai.serving_base:OpenAIServingBase._parse_model_parameter", ("model",)),
        ("sglang.srt.entrypoints.http_server:get_global_state", ()),
    ),
    *_reads(
        "sglang_ernie55.mem_cache",
        "the memory-saver flag of both pools",
        ("sglang.srt.runtime_context:get_exec", ()),
    ),
    *_reads(
        "sglang_ernie55.mem_cache.sizing",
        "the configurator's interface and what the sizing charges besides our pools",
        (f"{_POOL_CONF}:MemoryPoolConfigurator.calculate_pool_sizes", ("available_bytes", "page_size")),
        (
            f"{_POOL_CONF}:MemoryPoolConfigurator.validate_swa_pool_size",
            ("swa_tokens", "sliding_window_size", "page_size"),
        ),
        (
            f"{_POOL_CONF}:MemoryPoolConfig",
            (
                "max_total_num_tokens",
                "max_running_requests",
                "full_max_total_num_tokens",
                "swa_max_total_num_tokens",
            ),
        ),
        (
            "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator.resolve_max_num_reqs",
            ("token_capacity",),
        ),
        ("sglang.srt.mem_cache.allocation_sizing:get_req_to_token_extra_context_len", ()),
        ("sglang.srt.runtime_context:get_disagg", ()),
        # the eager runner's static inputs, sized to the pool's token count (charged per pool token)
        (
            "sglang.srt.model_executor.cuda_graph_buffer_registry:build_decode_registry",
            ("device", "max_bs", "max_num_token", "seq_len_fill_value", "cache_loc_dtype"),
        ),
        ("sglang.srt.model_executor.runner.eager_runner:EagerRunner.__init__", ("model_runner",)),
        ("sglang.srt.runtime_context:max_prefill_buffer_tokens", ()),
    ),
    *_reads(
        "sglang_ernie55.configuration",
        "hybrid SWA without a hook: SGLang reads the config's `is_hybrid_swa` / `hybrid_layer_pattern` opt-in",
        ("sglang.srt.configs.model_config:is_hybrid_swa_model", ("model_architectures", "hf_text_config")),
        ("sglang.srt.configs.model_config:get_hybrid_layer_ids", ("model_architectures", "hf_text_config")),
    ),
    *_reads(
        "sglang_ernie55.mem_cache.pool",
        "the pool base classes and SGLang's SWA allocator, which runs over our pools unchanged",
        (
            "sglang.srt.mem_cache.memory_pool:KVCache.__init__",
            (
                "size",
                "page_size",
                "dtype",
                "layer_num",
                "device",
                "enable_memory_saver",
                "start_layer",
                "end_layer",
            ),
        ),
        (
            "sglang.srt.mem_cache.base_swa_memory_pool:BaseSWAKVPool.register_mapping",
            ("full_to_swa_index_mapping",),
        ),
        (
            "sglang.srt.mem_cache.base_swa_memory_pool:BaseSWAKVPool.translate_loc_from_full_to_swa",
            ("kv_indices",),
        ),
        (
            "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.__init__",
            ("size", "size_swa", "page_size", "dtype", "device", "kvcache", "need_sort"),
        ),
        ("sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.free_swa_segment", ("free_index",)),
    ),
    *_reads(
        "sglang_ernie55.mem_cache.host_pool",
        "the HiCache stack our strategy assembles: SGLang's controller, pool entries, host pools and names",
        (
            f"{_ASSEMBLER}:StackStrategy.build",
            ("cache", "kvcache", "params", "server_args", "load_cache_event", "storage_backend"),
        ),
        (
            f"{_ASSEMBLER}:StackBuildResult",
            ("host_pool_group", "cache_controller", "component_host_pools", "sidecars"),
        ),
        (f"{_ASSEMBLER}:build_pool_entry", ("name", "host_pool", "device_pool", "layer_mapping")),
        (
            "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller:HybridCacheController.__init__",
            ("token_to_kv_pool_allocator", "mem_pool_host", "page_size", "tp_group", "load_cache_event"),
        ),
        (
            "sglang.srt.mem_cache.memory_pool_host:DeepSeekV4PagedHostPool.__init__",
            ("pool_name", "device_buffers", "item_bytes", "num_host_pages", "slot_page_size", "layout"),
        ),
        (
            "sglang.srt.mem_cache.memory_pool_host:DeepSeekV4PagedHostPool.load_to_device_per_layer",
            ("device_pool", "host_indices", "device_indices", "layer_id", "io_backend"),
        ),
        (
            "sglang.srt.mem_cache.memory_pool_host:DeepSeekV4PagedHostPool.backup_from_device_all_layer",
            ("device_pool", "host_indices", "device_indices", "io_backend"),
        ),
        ("sglang.srt.mem_cache.memory_pool_host:LogicalHostPool.__init__", ("size", "page_size", "layout")),
        ("sglang.srt.mem_cache.pool_host.group:HostPoolGroup.__init__", ("entries",)),
        (
            "sglang.srt.mem_cache.hicache_storage:SidecarPoolSpec",
            ("pool_name", "indices_from_pool", "hit_policy"),
        ),
        ("sglang.srt.mem_cache.hicache_storage:PoolName", None),
        ("sglang.srt.mem_cache.unified_cache.component_type:ComponentType", None),
        ("sglang.srt.mem_cache.pool_host.common:get_allocator_type", ()),
        ("sglang.srt.mem_cache.base_prefix_cache:EvictParams", ("num_tokens", "swa_num_tokens")),
        (
            "sglang.srt.mem_cache.memory_pool:KVCache.register_layer_transfer_counter",
            ("layer_transfer_counter",),
        ),
    ),
    *_reads(
        "sglang_ernie55.mem_cache.pd",
        "the PD state components our pools describe and the interface SGLang's prefill and decode queues ask them "
        "for (`get_contiguous_buf_infos`, `get_state_buf_infos`, `get_request_state_buf_infos`, "
        "`request_state_transfer_indices`)",
        (
            f"{_DISAGG_UTILS}:append_state_component",
            ("kv_args", "state_type", "data_ptrs", "data_lens", "item_lens"),
        ),
        ("sglang.srt.disaggregation.base.conn:StateType.SWA", None),
        ("sglang.srt.disaggregation.base.conn:StateType.DSV4_REQUEST_STATE", None),
        (
            "sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool.request_state_transfer_indices",
            ("req_pool_idx", "seq_len"),
        ),
        (f"{_DISAGG_UTILS}:get_kv_transfer_buf_infos", ("pool",)),
    ),
    *_reads(
        "sglang_ernie55.attention.backend",
        "the backend interface: CUDA-graph metadata split, forward context",
        (f"{_BASE_BACKEND}.init_forward_metadata_out_graph", ("forward_batch", "in_capture")),
        ("sglang.srt.model_executor.forward_context:ForwardContext", None),
    ),
    *_reads(
        "sglang_ernie55.attention.interface",
        "the layers ask the forward's attention backend which dtype it rounds their queries to",
        ("sglang.srt.model_executor.forward_context:has_forward_context", ()),
        ("sglang.srt.model_executor.forward_context:get_attn_backend", ()),
    ),
    *_reads(
        "sglang_ernie55.attention.draft_backend",
        "what SGLang's draft-extend CUDA-graph runner calls on the ECHO draft backend",
        (f"{_BASE_BACKEND}.init_forward_metadata_in_graph", ("forward_batch",)),
        (f"{_BASE_BACKEND}.init_cuda_graph_state", ("max_bs", "max_num_tokens")),
        (f"{_BASE_BACKEND}.get_cuda_graph_seq_len_fill_value", ()),
        (f"{_BASE_BACKEND}.shared_read_ends", ("fm",)),
    ),
    *_reads(
        "sglang_ernie55.layers",
        "per-layer tensors reach the backend as keyword arguments; routing feeds FusedMoE directly; the MoE's "
        "sum over ranks and the attention-TP group of the projections",
        ("sglang.srt.layers.radix_attention:RadixAttention.forward", ("q", "k", "v", "forward_batch")),
        ("sglang.srt.layers.moe.topk:StandardTopKOutput", ("topk_weights", "topk_ids", "router_logits")),
        ("sglang.srt.layers.moe.utils:sum_post_experts_output", ("hidden_states",)),
        ("sglang.srt.layers.moe.utils:post_experts_output_is_complete", ("is_tp_path",)),
        ("sglang.srt.layers.moe:get_moe_a2a_backend", ()),
        ("sglang.srt.distributed.communication_op:tensor_model_parallel_all_reduce", ("input_",)),
        ("sglang.srt.layers.linear:ColumnParallelLinear.__init__", ("input_size", "output_size")),
        ("sglang.srt.layers.linear:RowParallelLinear.__init__", ("input_size", "output_size")),
    ),
    *_reads(
        "sglang_ernie55.kernels.moe_configs",
        "SGLang's own file name for a config, the served model, and the deterministic-inference flag its lookup "
        "obeys",
        (
            f"{_MOE_CONFIG}:get_config_file_name",
            ("E", "N", "dtype", "block_shape", "per_channel_quant", "down_moe"),
        ),
        (f"{_MOE_CONFIG}:get_exec", ()),
        ("sglang.srt.runtime_context:process_model_config", ()),
        ("sglang.kernels.ops.moe.fused_moe_triton_kernels:fused_moe_kernel", None),
    ),
    *_reads(
        "sglang_ernie55.kernels.fp8_linear_configs",
        "the device name SGLang's block-FP8 GEMM names its files with, and the kernels a file's entries configure",
        (f"{_FP8_GEMM}:get_device_name", ()),
        (f"{_FP8_GEMM}:_w8a8_block_fp8_matmul", None),
        (f"{_FP8_GEMM}:_w8a8_block_fp8_matmul_hopper", None),
    ),
    *_reads(
        "sglang_ernie55.models",
        "the residual streams reach the draft through `hidden_states_before_norm`, as DeepSeek-V4's do",
        (
            "sglang.srt.layers.logits_processor:LogitsProcessor.forward",
            (
                "input_ids",
                "hidden_states",
                "lm_head",
                "logits_metadata",
                "aux_hidden_states",
                "hidden_states_before_norm",
            ),
        ),
    ),
    *_reads(
        _SPEC,
        "the attributes the draft-backend hooks read; the capture hook applies SGLang's own conditions, log "
        "lines and memory accounting and builds SGLang's runner",
        (
            f"{_DRAFT_UTILS}:DraftBackendFactory.__init__",
            ("draft_model_runner", "topk", "speculative_num_steps"),
        ),
        (
            f"{_EW2}:EAGLEDraftExtendCudaGraphRunner.__init__",
            ("eagle_worker", "draft_extend_attn_backend", "speculative_num_steps"),
        ),
        (f"{_EW2}:check_cuda_graph_backend", ("phase", "backend")),
        (f"{_EW2}:get_batch_sizes_to_capture", ("model_runner",)),
        (f"{_EW2}:get_available_gpu_memory", ("device", "gpu_id")),
        (f"{_EW2}:log_info_on_rank0", ("logger", "msg")),
        (f"{_EW2}:_is_cpu", None),
        (f"{_EW2}:current_platform.is_out_of_tree", ()),
        (f"{_EW2}:envs.SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH", None),
        (f"{_EW2}:get_model", ()),
        (f"{_EW2}:get_exec", ()),
    ),
)


def rows(*kinds: Kind) -> list[Patch]:
    return [row for row in LEDGER if row.kind in kinds]


def required_symbols() -> list[tuple[str, str, tuple[str, ...] | None]]:
    """(module, attribute path, parameters) of every row, for `compat.check_symbols`."""
    return [(row.module, row.attr, row.params) for row in LEDGER]


# ---------------------------------------------------------------------------------------- applying rows
def _config(row: Patch) -> None:
    from transformers import AutoConfig

    cls = row.function()
    AutoConfig.register(cls.model_type, cls, exist_ok=True)
    pkgutil.resolve_name(row.target)[cls.model_type] = cls


def _choice(row: Patch) -> None:
    add = pkgutil.resolve_name(row.target)
    value = row.function()
    # SGLang's adders are `LIST.extend`: the list is the adder's `__self__`
    if value not in getattr(add, "__self__", ()):
        add([value])


def _model_override(row: Patch) -> None:
    from .configuration import ARCHITECTURES

    register_model_override = pkgutil.resolve_name(row.target)
    for arch in ARCHITECTURES:
        register_model_override(arch)(row.function())


def _resolution(row: Patch) -> None:
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    register_resolution_hook(row.attr)(row.function())


def _hook(row: Patch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(row.dotted, row.function(), HookType[row.kind.name])


def _attention_backend(row: Patch) -> None:
    from .attention import BACKEND_NAME

    pkgutil.resolve_name(row.target)(BACKEND_NAME)(row.function())


def _hicache_strategy(row: Patch) -> None:
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _STRATEGIES

    cls = row.function()
    if not any(isinstance(s, cls) for s in _STRATEGIES):
        pkgutil.resolve_name(row.target)(cls())


def _models(row: Patch) -> None:
    from sglang.srt.models.registry import ModelRegistry

    from .configuration import ARCHITECTURES

    owned = {a: ModelRegistry.models.get(a) for a in ARCHITECTURES}
    if all(c is not None and c.__module__.startswith("sglang_ernie55.") for c in owned.values()):
        return
    ModelRegistry.register(row.ours, overwrite=False, strict=True)


_APPLY = {
    Kind.CONFIG: _config,
    Kind.CHOICE: _choice,
    Kind.MODEL_OVERRIDE: _model_override,
    Kind.RESOLUTION: _resolution,
    Kind.AROUND: _hook,
    Kind.AFTER: _hook,
    Kind.ATTENTION_BACKEND: _attention_backend,
    Kind.HICACHE_STRATEGY: _hicache_strategy,
    Kind.MODELS: _models,
    Kind.READS: lambda row: None,
}

_applied = False


def applied() -> bool:
    return _applied


def register() -> None:
    """Apply every row, in table order, once per process."""
    global _applied
    if _applied:
        return
    for row in LEDGER:
        _APPLY[row.kind](row)
    _applied = True


# ---------------------------------------------------------------------------------------- docs/hooks.md
def ledger_markdown() -> str:
    """The index table of docs/hooks.md: one line per patched target, in the order they are applied."""
    lines = ["| target | kind | ours |", "| --- | --- | --- |"]
    for row in LEDGER:
        if row.kind is not Kind.READS:
            lines.append(f"| `{row.target}` | {row.kind.value} | `{row.ours}` |")
    return "\n".join(lines) + "\n"


def reads_markdown() -> str:
    """The READS rows of docs/hooks.md, grouped by the module that reads them (parameters checked in brackets)."""
    lines = []
    for by, group in groupby(rows(Kind.READS), key=lambda row: row.by):
        group = list(group)
        lines.append(f"- `{by}`: {group[0].why}")
        for row in group:
            params = "" if row.params is None else f" ({', '.join(row.params)})"
            lines.append(f"  - `{row.target}`{params}")
    return "\n".join(lines) + "\n"
