"""SGLang's pool set-up for an ERNIE-5.5 checkpoint, step by step and in-process: argument resolution, our pool
configurator for a byte budget, then what SGLang's KVCacheConfigurator builds for the sizes it returns (its
request-to-token pool, the target pool through our hook, its SWA allocator, and the ECHO draft pool), with the
device bytes that set-up allocated."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from sglang_ernie55.configuration import SERVING_PAGE_SIZE

PAGE = SERVING_PAGE_SIZE


@dataclass
class Built:
    sizes: object
    conf: object
    pool: object
    allocator: object
    draft: object | None
    req_to_token: object
    planned: dict
    allocated: int  # device bytes (CUDA: memory_allocated delta; CPU: the tensors' bytes)
    server_args: object
    model_config: object


def _tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def build_like_sglang(ckpt: str, *flags: str, budget: int, device: str = "cpu") -> Built:
    import sglang.srt.model_executor.pool_configurator as pc  # hooked once the plugin loads
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_ernie55.args import resolve_server_args
    from sglang_ernie55.configuration import ARCH_ECHO

    sa = resolve_server_args(["--model-path", ckpt, *flags], device="cuda" if device != "cpu" else "cpu")
    mc = model_config_of(sa)
    resolved = sa.resolved_dict()
    kv = resolved["kv_cache_dtype"]
    kv_dtype = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16
    spec = SpeculativeAlgorithm.from_string(resolved.get("speculative_algorithm"))

    def kvc(hf_config, draft: bool):
        ns = SimpleNamespace(
            model_config=SimpleNamespace(hf_config=hf_config, context_len=mc.context_len),
            kv_cache_dtype_str=kv,
            kv_cache_dtype=kv_dtype,
            is_hybrid_swa=mc.is_hybrid_swa,
            sliding_window_size=mc.sliding_window_size,
            spec_algorithm=spec,
            is_draft_worker=draft,
            pool_page_size=PAGE,
            device=device,
            hybrid_gdn_config=None,
            kv_shard_size=1,
            is_hybrid_swa_mtp_draft=False,
            draft_swa_full_capacity=False,
            attn_dp_size=1,
            mambaish_config=None,
        )
        ns.resolve_max_num_reqs = lambda n: KVCacheConfigurator.resolve_max_num_reqs(ns, n)
        ns._build_default_req_pool = lambda **kw: KVCacheConfigurator._build_default_req_pool(ns, **kw)
        return ns

    cuda = device != "cpu"
    with use_context(create_context(sa, role="test")):
        t = kvc(mc.hf_config, False)
        conf = pc.create_memory_pool_configurator(t)
        sizes = conf.calculate_pool_sizes(budget, PAGE)
        full = sizes.max_total_num_tokens
        psizes = SimpleNamespace(
            max_total_num_tokens=full,
            full_max_total_num_tokens=full,
            swa_max_total_num_tokens=sizes.swa_max_total_num_tokens,
        )
        max_reqs = t.resolve_max_num_reqs(full)
        if cuda:
            torch.cuda.synchronize()
            m0 = torch.cuda.memory_allocated()
        r2t = KVCacheConfigurator._build_req_to_token_pool(t, max_num_reqs=max_reqs)
        pool = KVCacheConfigurator._build_token_to_kv_pool(
            t, sizes=psizes, is_dsa_model=False, is_dsv4_model=False, req_to_token_pool=r2t
        )
        alloc = KVCacheConfigurator._build_token_to_kv_pool_allocator(
            t,
            sizes=psizes,
            token_to_kv_pool=pool,
            is_dsv4_model=False,
            req_to_token_pool=r2t,
            token_to_kv_pool_allocator=None,
        )
        draft = None
        if not spec.is_none():
            d = kvc(type(mc.hf_config)(**{**mc.hf_config.to_dict(), "architectures": [ARCH_ECHO]}), True)
            draft = KVCacheConfigurator._build_token_to_kv_pool(
                d, sizes=psizes, is_dsa_model=False, is_dsv4_model=False, req_to_token_pool=r2t
            )
            KVCacheConfigurator._build_token_to_kv_pool_allocator(
                d,
                sizes=psizes,
                token_to_kv_pool=draft,
                is_dsv4_model=False,
                req_to_token_pool=r2t,
                token_to_kv_pool_allocator=alloc,
            )
        if cuda:
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated() - m0
        else:
            subs = [
                getattr(alloc, "full_attn_allocator", None),
                getattr(alloc, "swa_attn_allocator", None),
                alloc,
            ]
            allocated = (
                _tensor_bytes(
                    r2t.req_to_token,
                    getattr(alloc, "full_to_swa_index_mapping", None),
                    *(getattr(a, "free_pages", None) for a in subs if a is not None),
                )
                + pool.get_kv_size_bytes()
                + (draft.get_kv_size_bytes() if draft is not None else 0)
            )
        planned = conf.planned_bytes(full, PAGE)
    return Built(sizes, conf, pool, alloc, draft, r2t, planned, allocated, sa, mc)
