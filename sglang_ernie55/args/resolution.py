"""Validation of user-given server arguments, as wrappers of SGLang's named resolution steps.

Each wrapper runs at its step's position, falls through for other architectures and always calls the step.
Values are read through `resolving_view` (given plus decided so far); "user-given" checks read the raw
field. Which rules each step checks, before or after it: docs/hooks.md.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import envs
from ..arch import architecture
from . import rules

logger = logging.getLogger(__name__)

_SOURCE = "sglang_ernie55.args"


def ernie_architecture(server_args: Any) -> str | None:
    """The ERNIE-5.5 architecture of the served checkpoint, or None for any other model (and for the
    dummy / instance-connector paths, which have no config). Uses SGLang's memoized ModelConfig."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.connector import ConnectorType
    from sglang.srt.utils import parse_connector_type

    cfg = resolving_view(server_args)
    if str(cfg.model_path).lower() in ("none", "dummy"):
        return None
    if parse_connector_type(cfg.model_path) == ConnectorType.INSTANCE:
        return None
    return architecture(_hf_config(server_args))


def _hf_config(server_args: Any) -> Any:
    from sglang.srt.arg_groups.model_override_base import model_config_of

    return model_config_of(server_args).hf_config


def _declare(server_args: Any, **fields: Any) -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(server_args, _SOURCE, **fields)


# ---------------------------------------------------------------------------------------------- wrappers
def model_specific_adjustments(server_args: Any, previous) -> None:
    from sglang.srt.arg_groups.model_override_base import resolving_view

    if ernie_architecture(server_args) is None:
        previous(server_args)
        return
    cfg = resolving_view(server_args)
    for flag in rules.ATTENTION_BACKEND_FLAGS + ("--speculative-draft-attention-backend",):
        rules.check_attention_backend(flag, getattr(server_args, flag[2:].replace("-", "_")))
    rules.check_page_size(server_args.page_size)
    # an fp8_e4m3 asked for by name must fit the checkpoint's widths (the default becomes bfloat16 instead)
    hf_config = _hf_config(server_args)
    rules.resolve_kv_cache_dtype(cfg.kv_cache_dtype, "--kv-cache-dtype", hf_config)
    if cfg.speculative_draft_kv_cache_dtype is not None:
        rules.resolve_kv_cache_dtype(
            cfg.speculative_draft_kv_cache_dtype, "--speculative-draft-kv-cache-dtype", hf_config
        )
    warning = rules.check_parsers(cfg.reasoning_parser, cfg.tool_call_parser, envs.allow_parsers())
    if warning:
        logger.warning("ERNIE-5.5: %s", warning)
    rules.check_hicache_size(cfg.hicache_size)
    rules.check_disaggregation(cfg.disaggregation_mode, cfg.disaggregation_transfer_backend)
    rules.check_hicache_options(
        bool(cfg.enable_hierarchical_cache), cfg.hicache_storage_backend, server_args.hicache_host_memory_mode
    )

    previous(server_args)  # applies ernie55_overrides (overrides.py) among the model overrides

    _prefill_graphs_off(server_args)
    cfg = resolving_view(server_args)
    warning = rules.long_context_guidance(cfg.context_length, cfg.max_running_requests)
    if warning:
        logger.warning("ERNIE-5.5: %s", warning)


def _prefill_graphs_off(server_args: Any) -> None:
    """Prefill CUDA graphs off (refused when asked for by name): the backend's extend runs on host-side
    lengths (ragged prefixes, chunked prefill, block compression jobs) that a captured graph would freeze."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.arg_groups.overrides import declare_resolution
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    graphs = resolving_view(server_args).cuda_graph_config
    backend = graphs.prefill.backend
    if backend == Backend.DISABLED:
        return
    if (Phase.PREFILL, "backend") in getattr(server_args, "_cuda_graph_config_locked", ()):
        rules.refuse_prefill_cuda_graph(str(getattr(backend, "value", backend)))
    prefill_off = with_phase(graphs, Phase.PREFILL, backend=Backend.DISABLED)
    declare_resolution(server_args, "ernie55_prefill_cuda_graph", cuda_graph_config=prefill_off)
    logger.info("ERNIE-5.5: prefill CUDA graph off (%s): %s", backend, rules.PREFILL_GRAPH_WHY)


def _check_attention_tp(server_args: Any) -> None:
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    groups = int(getattr(_hf_config(server_args), "o_groups", rules.DEFAULT_ATTENTION_OUTPUT_GROUPS))
    rules.check_attention_tp(cfg.tp_size, cfg.attn_dp_size, cfg.attn_cp_size, groups)


def data_parallelism(server_args: Any, previous) -> None:
    # Before the step: it asserts tp % attn_dp_size == 0 without a message.
    if ernie_architecture(server_args) is not None:
        _check_attention_tp(server_args)
    previous(server_args)


def context_parallelism(server_args: Any, previous) -> None:
    from sglang.srt.arg_groups.model_override_base import resolving_view

    if ernie_architecture(server_args) is not None:
        # Before the step: it raises its own bare error for --enable-prefill-cp without --cp-strategy.
        cfg = resolving_view(server_args)
        rules.check_prefill_cp(cfg.attn_cp_size, bool(cfg.enable_prefill_cp), cfg.cp_strategy)
    # After the step: prefill context parallelism may rewrite attn_cp_size; this is the final layout.
    previous(server_args)
    if ernie_architecture(server_args) is not None:
        _check_attention_tp(server_args)


def a2a_moe(server_args: Any, previous) -> None:
    from sglang.srt.arg_groups.model_override_base import resolved_view

    ernie = ernie_architecture(server_args) is not None
    if ernie:
        # Before the step with the EP it will set (deepep: ep = tp), so our message comes first; after it on
        # the final values (--enable-waterfill switches the backend to deepep).
        n_experts = int(getattr(_hf_config(server_args), "n_routed_experts", rules.FULL_MODEL_ROUTED_EXPERTS))
        view = resolved_view(server_args)
        ep = view.tp_size if view.moe_a2a_backend == "deepep" else view.ep_size
        rules.check_a2a(view.moe_a2a_backend, ep, view.pp_size, n_experts, user_ep=server_args.ep_size)
    previous(server_args)
    if ernie:
        view = resolved_view(server_args)
        rules.check_a2a(
            view.moe_a2a_backend, view.ep_size, view.pp_size, n_experts, user_ep=server_args.ep_size
        )


def speculative_decoding(server_args: Any, previous) -> None:
    from sglang.srt.arg_groups.model_override_base import resolving_view

    if ernie_architecture(server_args) is not None:
        cfg = resolving_view(server_args)
        decision = rules.resolve_speculative(
            cfg.speculative_algorithm,
            cfg.speculative_num_steps,
            cfg.speculative_eagle_topk,
            cfg.speculative_num_draft_tokens,
        )
        if decision is not None:
            fields: dict[str, Any] = {
                "speculative_num_steps": decision.steps,
                "speculative_eagle_topk": decision.topk,
                "speculative_num_draft_tokens": decision.draft_tokens,
            }
            if cfg.speculative_draft_model_path is None:
                # ECHO ships inside the checkpoint (SGLang does the same for DSV4's MTP layer).
                fields["speculative_draft_model_path"] = cfg.model_path
                fields["speculative_draft_model_revision"] = cfg.revision
            _declare(server_args, **fields)
    previous(server_args)
