"""The server-argument rules of ERNIE-5.5-Flash, as plain functions over values.

Each takes the values it judges and returns what this project decides, or raises `Ernie55ArgumentError`
naming the flag, the value, the legal values and why. Sources: docs/server-args.md, "Deployment facts";
`ERNIE55_FLAG_RULES` is that page's table.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from ..configuration import HCA_COMPRESS_RATIO, HCA_WINDOW, SERVING_PAGE_SIZE
from .errors import Ernie55ArgumentError

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------- defaults
ATTENTION_BACKEND = "ernie55"
ATTENTION_BACKEND_FLAGS = ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")
SWA_FULL_TOKENS_RATIO = 0.1

# ---------------------------------------------------------------------------------------------- KV dtype
KV_CACHE_DTYPE_DEFAULT = "fp8_e4m3"
KV_CACHE_DTYPES = ("fp8_e4m3", "bfloat16")
# Spellings that mean one of the legal dtypes. `auto` is SGLang's default value (also what an unset
# flag reads as), so it is the model's default, fp8_e4m3. `bf16` is SGLang's own alias of bfloat16.
KV_CACHE_DTYPE_ALIASES = {"auto": KV_CACHE_DTYPE_DEFAULT, "bf16": "bfloat16"}

# ---------------------------------------------------------------------------------------------- parallelism
DEFAULT_ATTENTION_OUTPUT_GROUPS = 8  # config.json o_groups
DEEPEP_MIN_EP = 4
FULL_MODEL_ROUTED_EXPERTS = 512

# ---------------------------------------------------------------------------------------------- ECHO
SPEC_ALGORITHMS = ("EAGLE", "NEXTN")
SPEC_STEPS = (1, 2, 3)
SPEC_DEFAULT_STEPS = 2  # the vendor's low-latency preset: two steps take most of the gain
SPEC_TOPK = 1

# ---------------------------------------------------------------------------------------------- context
LONG_CONTEXT_THRESHOLD = 131072
# Fixed guidance from the deployment guides (1M context on 2x B300); `sglang-ernie55 plan` gives a cell's numbers.
LONG_CONTEXT_MAX_RUNNING_REQUESTS = 8
LONG_CONTEXT_CUDA_GRAPH_MAX_BS = 8


def _flag_value(v: object) -> str:
    return repr(v) if isinstance(v, str) and not v else str(v)


# ---------------------------------------------------------------------------------------------- layouts
def parallel_layout_refusal(
    tp: int,
    attn_dp: int = 1,
    attn_cp: int = 1,
    ep: int = 1,
    dp_lm_head: bool = False,
    a2a_backend: str = "none",
    speculative: bool = False,
    *,
    device: str = "cuda",
) -> str | None:
    """Why the model refuses this parallel layout when it is built, naming what runs instead, or None when it
    runs (docs/serving-design.md section 8). The one list the model (`check_parallel_layout`) and the hardware
    cells (`cmd`, `plan`, `preflight`) both read, so what they print is what the server builds. `device`: the
    server's --device (the cells are GPU recipes)."""
    see = "See docs/serving-design.md section 8 (parallel layouts)."
    if attn_cp > 1:
        attn_tp = tp // max(1, attn_dp * attn_cp)
        unrun = [
            what
            for what, on in (
                (
                    f"--device {device or 'cuda'} (the CUDA kernel attention path does not attend a CP rank's own "
                    "query rows yet; CP has run on the CPU torch path)",
                    device != "cpu",
                ),
                (
                    f"attention TP {attn_tp} (only attention TP 1, --attn-cp-size = --tp, has run)",
                    attn_tp != 1,
                ),
                (f"attention DP (--attn-dp-size {attn_dp})", attn_dp > 1),
                ("--enable-dp-lm-head", dp_lm_head),
                (f"expert parallelism (--ep {ep})", ep > 1),
                ("speculative decoding (ECHO)", speculative),
            )
            if on
        ]
        if unrun:
            return (
                f"sglang-ernie55 has not run attention context parallelism with {' and '.join(unrun)}: got tp {tp}, "
                f"--attn-dp-size {attn_dp}, --attn-cp-size {attn_cp}. It runs SGLang's prefill CP as --tp {attn_cp} "
                f"--attn-cp-size {attn_cp} --enable-prefill-cp --cp-strategy interleave on --device cpu (each prefill "
                "batch split over the CP ranks, decode whole on every rank) without --attn-dp-size, --ep and "
                f"speculative decoding; or serve --tp {tp} without --attn-cp-size. See docs/serving-design.md "
                "section 8.2 (attention CP)."
            )
    if attn_dp > 1:
        # attention DP runs at any attention TP with --enable-dp-lm-head, and with ECHO at attention TP 1
        # (docs/serving-design.md section 8.1)
        attn_tp = tp // attn_dp
        unrun = [
            what
            for what, on in (
                (f"expert parallelism (--ep {ep})", ep > 1),
                (
                    f"speculative decoding (ECHO) at attention TP {attn_tp} (ECHO has run under attention DP at "
                    "attention TP 1, --attn-dp-size = --tp)",
                    speculative and attn_tp > 1,
                ),
            )
            if on
        ]
        if unrun:
            return (
                f"sglang-ernie55 has not run attention data parallelism with {' and '.join(unrun)}: got tp {tp}, "
                f"--attn-dp-size {attn_dp} (attention TP {attn_tp}). It runs --tp {tp} --attn-dp-size {attn_dp} "
                f"without --ep and speculative decoding (with or without --enable-dp-lm-head), ECHO at --tp {tp} "
                f"--attn-dp-size {tp}, or the same flags without --attn-dp-size (legal when {tp} divides the "
                f"{DEFAULT_ATTENTION_OUTPUT_GROUPS} HCA output groups). {see}"
            )
    if a2a_backend != "none":
        return (
            f"sglang-ernie55 has not run the MoE all-to-all backend `--moe-a2a-backend {a2a_backend}` (expert "
            f"parallel size {ep}): its latent MoE (latent_down before the experts, latent_up and the shared "
            "expert after them) is checked only with SGLang's standard dispatch, where every rank keeps every "
            f"token. Serve with --moe-a2a-backend none: --tp {tp} --ep {ep} then splits the routed experts "
            f"over {ep} ranks the same way. {see}"
        )
    return None


# ---------------------------------------------------------------------------------------------- rules
CP_STRATEGY = "interleave"


def check_prefill_cp(attn_cp: int, enable_prefill_cp: bool, cp_strategy: str | None) -> None:
    """--attn-cp-size > 1 needs SGLang's prefill split, --enable-prefill-cp --cp-strategy interleave
    (docs/serving-design.md section 8.2)."""
    if attn_cp <= 1:
        return
    if not enable_prefill_cp:
        raise Ernie55ArgumentError(
            "--attn-cp-size",
            attn_cp,
            f"1, or > 1 with --enable-prefill-cp --cp-strategy {CP_STRATEGY}",
            "SGLang splits a batch over the attention-CP ranks only with --enable-prefill-cp (and then only "
            f"prefill batches); without it each of the {attn_cp} CP ranks computes the same attention over every "
            "token, the attention work of attention TP 1 with none of its saving.",
            f"Add --enable-prefill-cp --cp-strategy {CP_STRATEGY}, or drop --attn-cp-size.",
        )
    if cp_strategy != CP_STRATEGY:
        raise Ernie55ArgumentError(
            "--cp-strategy",
            "unset" if cp_strategy is None else cp_strategy,
            CP_STRATEGY,
            "interleave (rank r takes tokens r, r + N, ...) is the split SGLang runs for DSA models (DeepSeek V3.2 "
            "refuses zigzag, DeepSeek V4's zigzag is NPU-only) and the one sglang-ernie55 has run.",
            f"Pass --cp-strategy {CP_STRATEGY}.",
        )


def check_attention_backend(flag: str, value: str | None) -> None:
    """A user-given attention backend must be `ernie55` (None: the model override sets it)."""
    if value is None or value == ATTENTION_BACKEND:
        return
    raise Ernie55ArgumentError(
        flag,
        value,
        ATTENTION_BACKEND,
        f"ERNIE-5.5 interleaves HCA layers (a {HCA_WINDOW}-token window plus 1/{HCA_COMPRESS_RATIO}-compressed blocks and an "
        "attention sink) with MLA-DSA layers (sparse top-k over a latent cache); only the `ernie55` "
        "backend implements both over this model's KV pools, generic backends would compute another attention.",
        f"Drop {flag}: the model selects `ernie55` by itself.",
    )


def check_page_size(value: int | None) -> None:
    if value is None or value == SERVING_PAGE_SIZE:
        return
    raise Ernie55ArgumentError(
        "--page-size",
        value,
        SERVING_PAGE_SIZE,
        f"ERNIE-5.5's KV pools are paged at {SERVING_PAGE_SIZE} tokens so that a page holds whole {HCA_COMPRESS_RATIO}-token "
        "compressed HCA blocks and whole sliding windows; the `ernie55` backend and pools assume it.",
        f"Drop --page-size: the model sets {SERVING_PAGE_SIZE} by itself.",
    )


def resolve_kv_cache_dtype(
    value: str | None, flag: str = "--kv-cache-dtype", config: object = None
) -> tuple[str, str | None]:
    """(legal dtype, note to log or None). `auto`/None -> fp8_e4m3, `bf16` -> bfloat16; vLLM's `fp8` and
    every other dtype raise. Where the fp8 layouts do not fit `config`'s widths (`kernels.layout.fp8_unfit`),
    the default resolves to bfloat16 with a note and an explicit fp8_e4m3 raises."""
    if value is None or value == "auto":
        unfit = _fp8_unfit(config)
        if unfit:
            shown = "unset" if value is None else "auto"
            return "bfloat16", (
                f"{flag} {shown} -> bfloat16, not the model's default fp8_e4m3: {unfit}. This checkpoint's KV "
                "cache is served in bfloat16."
            )
    if value is None:
        return KV_CACHE_DTYPE_DEFAULT, None
    if value in KV_CACHE_DTYPES:
        check_kv_cache_geometry(value, flag, config)
        return value, None
    if value in KV_CACHE_DTYPE_ALIASES:
        to = KV_CACHE_DTYPE_ALIASES[value]
        if value == "auto":
            note = (
                f"{flag} auto -> {to}: ERNIE-5.5's default KV cache. Note that vLLM's `auto` means BF16; "
                f"pass {flag} bfloat16 for a BF16 cache."
            )
        else:
            note = f"{flag} {value} -> {to} (the same dtype, SGLang's alias)."
        return to, note
    if value == "fp8":
        why = (
            "`fp8` is vLLM's spelling; SGLang names the format, and this model's FP8 KV layout is "
            "fp8_e4m3 (with ue8m0 scales)."
        )
        fix = f"Write {flag} fp8_e4m3 (what vLLM's fp8 means here) or {flag} bfloat16."
    else:
        why = (
            "the ERNIE-5.5 KV pools and kernels store fp8_e4m3 (with ue8m0 block scales) or bfloat16 "
            "only; another format would be written in a layout no ERNIE-5.5 kernel reads."
        )
        fix = ""
    raise Ernie55ArgumentError(flag, value, KV_CACHE_DTYPES, why, fix)


def _fp8_unfit(config: object) -> str:
    if config is None:
        return ""
    from ..kernels.layout import fp8_unfit

    return fp8_unfit(config)


def check_kv_cache_geometry(dtype: str, flag: str, config: object) -> None:
    """An fp8_e4m3 KV cache asked for by name must fit the checkpoint's widths; else the error names the
    config.json field, its value, the rule, and bfloat16 as the dtype that serves it."""
    unfit = _fp8_unfit(config) if dtype == "fp8_e4m3" else ""
    if unfit:
        fix = f"Use {flag} bfloat16 (or leave {flag} out: the default serves this checkpoint in bfloat16)."
        raise Ernie55ArgumentError(
            flag, dtype, "bfloat16 (for this checkpoint)", f"this checkpoint's {unfit}.", fix
        )


def attention_tp_size(tp: int, attn_dp: int, attn_cp: int) -> float:
    """tp / attn_dp / attn_cp as SGLang derives it (a float here, so a non-integer split shows)."""
    return tp / attn_dp / attn_cp


def legal_attention_layouts(tp: int, attn_dp: int, attn_cp: int, groups: int) -> list[str]:
    """The nearest legal settings: the same --tp with the two nearest other --attn-dp-size values, then the
    nearest legal --tp below and above with the same --attn-dp-size / --attn-cp-size."""
    cp = f" --attn-cp-size {attn_cp}" if attn_cp > 1 else ""
    same_tp = [
        d
        for d in range(1, tp + 1)
        if d != attn_dp and tp % (d * attn_cp) == 0 and groups % (tp // (d * attn_cp)) == 0
    ]
    same_tp.sort(key=lambda d: (abs(d - attn_dp), d))
    out = [f"--tp {tp} --attn-dp-size {d}{cp} (attention TP {tp // (d * attn_cp)})" for d in same_tp[:2]]
    legal_tps = [attn_dp * attn_cp * g for g in range(1, groups + 1) if groups % g == 0]
    below = [t for t in legal_tps if t < tp]
    above = [t for t in legal_tps if t > tp]
    dp = f" --attn-dp-size {attn_dp}" if attn_dp > 1 else ""
    for t in ([below[-1]] if below else []) + ([above[0]] if above else []):
        out.append(f"--tp {t}{dp}{cp} (attention TP {t // (attn_dp * attn_cp)})")
    return out


def check_attention_tp(
    tp: int, attn_dp: int, attn_cp: int, groups: int = DEFAULT_ATTENTION_OUTPUT_GROUPS
) -> int:
    """The attention TP size tp / attn_dp / attn_cp must be a whole divisor of the `groups` output groups.
    Returns it."""
    a = attention_tp_size(tp, attn_dp, attn_cp)
    if a == int(a) and a >= 1 and groups % int(a) == 0:
        return int(a)
    legal = [g for g in range(1, groups + 1) if groups % g == 0]
    shown = f"{a:g}" if a != int(a) else str(int(a))
    raise Ernie55ArgumentError(
        "--tp/--attn-dp-size/--attn-cp-size",
        f"{tp}/{attn_dp}/{attn_cp} (attention TP = tp / attn_dp_size / attn_cp_size = {shown})",
        f"attention TP in {legal}",
        f"ERNIE-5.5's attention output projection has {groups} groups (o_groups) and each attention-TP "
        "rank must own whole groups, so the attention TP size must divide "
        f"{groups} (e.g. BF16 on 2x8 H100 is --tp 16 --attn-dp-size 2: attention TP 8).",
        "Nearest legal settings: " + "; ".join(legal_attention_layouts(tp, attn_dp, attn_cp, groups)) + ".",
    )


def check_a2a(
    backend: str,
    ep: int,
    pp: int,
    n_routed_experts: int = FULL_MODEL_ROUTED_EXPERTS,
    user_ep: int | None = None,
) -> None:
    """`deepep` needs EP >= 4; under pipeline parallelism the a2a backend must be `none`.

    `ep`: the EP size that will run (SGLang sets it to --tp under deepep). `user_ep`: the `--ep` typed; 2 or
    3 with deepep is refused too, though SGLang would replace it (1 is SGLang's unset default).
    """
    if pp > 1 and backend != "none":
        raise Ernie55ArgumentError(
            "--moe-a2a-backend",
            backend,
            "none (with --pp-size > 1)",
            f"with pipeline parallelism (--pp-size {pp}) ERNIE-5.5's MoE all-to-all is not supported: "
            "the deployment guides set --moe-a2a-backend none under PP.",
            "Drop --moe-a2a-backend (or pass none), or drop --pp-size.",
        )
    if backend != "deepep":
        return
    asked = user_ep if user_ep is not None and 1 < user_ep < DEEPEP_MIN_EP else None
    if ep >= DEEPEP_MIN_EP and asked is None:
        return
    bad = ep if ep < DEEPEP_MIN_EP else asked
    per_rank = n_routed_experts // max(bad, 1)
    full = FULL_MODEL_ROUTED_EXPERTS // max(bad, 1)
    full_note = (
        "" if n_routed_experts == FULL_MODEL_ROUTED_EXPERTS else f" ({full} of 512 for the full model)"
    )
    runs = f" (SGLang would run EP = --tp = {ep} instead, against the --ep you gave)" if ep != bad else ""
    raise Ernie55ArgumentError(
        "--moe-a2a-backend deepep with --ep",
        bad,
        f"--ep >= {DEEPEP_MIN_EP}",
        f"at expert parallel size {bad} each rank holds {per_rank} of the {n_routed_experts} routed experts"
        f"{full_note}, beyond DeepEP's per-rank expert limit; from --ep {DEEPEP_MIN_EP} a rank holds at most "
        f"{FULL_MODEL_ROUTED_EXPERTS // DEEPEP_MIN_EP} of 512. Under deepep SGLang sets the expert parallel "
        f"size to --tp{runs}.",
        f"Use --tp >= {DEEPEP_MIN_EP} with --ep left out or equal to --tp, or drop --moe-a2a-backend deepep.",
    )


class SpecDecision(NamedTuple):
    algorithm: str
    steps: int
    topk: int
    draft_tokens: int


def resolve_speculative(
    algorithm: str | None, steps: int | None, topk: int | None, draft_tokens: int | None
) -> SpecDecision | None:
    """ECHO: EAGLE/NEXTN, chain drafts (topk 1), steps in {1,2,3} (default 2), draft tokens = steps + 1.
    None when speculative decoding is off."""
    if algorithm is None:
        return None
    algo = algorithm.upper()
    if algo == "DSPARK":
        raise Ernie55ArgumentError(
            "--speculative-algorithm",
            algorithm,
            SPEC_ALGORITHMS,
            "DSpark drafts exist only for the (unreleased) post-trained ERNIE-5.5; this Base checkpoint "
            "has no DSpark draft. Its speculative decoder is the ECHO layer it ships (MTP-style).",
            "Use --speculative-algorithm EAGLE --speculative-num-steps 2 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 3.",
        )
    if algo not in SPEC_ALGORITHMS:
        raise Ernie55ArgumentError(
            "--speculative-algorithm",
            algorithm,
            SPEC_ALGORITHMS,
            "ERNIE-5.5's speculative decoder is its ECHO draft layer, run by SGLang's EAGLE worker "
            "(NEXTN is SGLang's alias of it) with chain drafts; other algorithms have no ERNIE-5.5 draft "
            "or need tree verification the `ernie55` backend does not implement.",
        )
    if topk is not None and topk != SPEC_TOPK:
        raise Ernie55ArgumentError(
            "--speculative-eagle-topk",
            topk,
            SPEC_TOPK,
            "ECHO drafts a chain (one candidate per step); the `ernie55` backend has no tree attention.",
            "Pass --speculative-eagle-topk 1 or leave it out.",
        )
    if steps is not None and steps not in SPEC_STEPS:
        raise Ernie55ArgumentError(
            "--speculative-num-steps",
            steps,
            SPEC_STEPS,
            "the ECHO layer is trained for up to 3 draft steps; 2 take most of the gain (low-latency preset).",
        )
    s = SPEC_DEFAULT_STEPS if steps is None else steps
    if draft_tokens is not None and draft_tokens != s + 1:
        if draft_tokens in SPEC_STEPS:
            hint = (
                f" vLLM's num_speculative_tokens={draft_tokens} is SGLang's --speculative-num-steps "
                f"{draft_tokens}, with --speculative-num-draft-tokens {draft_tokens + 1}."
            )
        else:
            hint = " vLLM's num_speculative_tokens is SGLang's --speculative-num-steps, not the draft-token count."
        raise Ernie55ArgumentError(
            "--speculative-num-draft-tokens",
            draft_tokens,
            f"{s + 1} (= --speculative-num-steps {s} + 1)",
            "with chain drafts SGLang verifies the current token plus one drafted token per step, so the "
            "draft-token count is always steps + 1; any other value silently drafts a different number of "
            f"tokens. Copying vLLM's `num_speculative_tokens` here is the usual mistake.{hint}",
            f"Leave --speculative-num-draft-tokens out (it defaults to steps + 1 = {s + 1}).",
        )
    return SpecDecision("EAGLE", s, SPEC_TOPK, s + 1)


def check_parsers(reasoning_parser: str | None, tool_call_parser: str | None, allow: bool) -> str | None:
    """The Base model emits no reasoning sections or tool calls: refuse a parser unless the operator
    allowed it (SGLANG_ERNIE55_ALLOW_PARSERS=1). Returns a warning text when allowed, else None."""
    given = [
        (f, v)
        for f, v in (("--reasoning-parser", reasoning_parser), ("--tool-call-parser", tool_call_parser))
        if v is not None
    ]
    if not given:
        return None
    flag, value = given[0]
    why = (
        "the ERNIE-5.5-Flash Base checkpoint is a completion model: it was not trained to emit reasoning "
        "sections or tool calls, so a parser would never fire or would cut ordinary text that happens to "
        "look like its markers. The `ernie55` parsers belong to the post-trained model, which is not released."
    )
    if allow:
        return (
            f"{flag} {value} on the ERNIE-5.5 Base model (allowed by SGLANG_ERNIE55_ALLOW_PARSERS=1): {why}"
        )
    raise Ernie55ArgumentError(
        flag,
        value,
        "none (leave it out)",
        why,
        "If you serve your own fine-tune of this architecture that does emit that parser's format, set "
        "SGLANG_ERNIE55_ALLOW_PARSERS=1.",
    )


def check_hicache_size(hicache_size: int) -> None:
    if not hicache_size:
        return
    raise Ernie55ArgumentError(
        "--hicache-size",
        hicache_size,
        "0 (unset); size the host cache with --hicache-ratio",
        "ERNIE-5.5's hierarchical cache mirrors several pools (SWA window, compressed HCA, MLA-DSA latents "
        "and indexer keys) whose sizes follow the device pool; a byte size cannot be split across them, a "
        "ratio of the device pool can. (vLLM's offload connector takes bytes per rank; SGLang's takes a ratio.)",
        "Use --enable-hierarchical-cache --hicache-ratio 2.",
    )


def check_hicache_options(enabled: bool, storage_backend: str | None, host_memory_mode: str | None) -> None:
    """The host tier is what HiCache runs over the ERNIE-5.5 pools (docs/kv-layout.md, "HiCache"); an L3
    storage backend and the buffer-only host mode have not run on them."""
    if not enabled:
        return
    if storage_backend is not None:
        raise Ernie55ArgumentError(
            "--hicache-storage-backend",
            storage_backend,
            "none (unset): the host memory tier only",
            "ERNIE-5.5's HiCache host pools have run with SGLang's host tier only; no L3 storage backend has "
            "stored or read their pages (window, compressed, MLA latent and indexer pages under DeepSeek-V4's "
            "pool names)",
            "Leave it out: --enable-hierarchical-cache --hicache-ratio 2 keeps evicted prefixes in host memory.",
        )
    if host_memory_mode not in (None, "cache"):
        raise Ernie55ArgumentError(
            "--hicache-host-memory-mode",
            host_memory_mode,
            "cache",
            "ERNIE-5.5's HiCache host pools have run as a cache of evicted prefixes only; the buffer-only "
            "staging pipeline has not run on them",
        )


PD_TRANSFER_BACKENDS = ("mooncake",)


def check_disaggregation(mode: str | None, transfer_backend: str | None) -> None:
    """PD disaggregation over the ERNIE-5.5 pools has run with SGLang's Mooncake backend only
    (docs/serving-design.md section 10)."""
    if mode in (None, "null") or transfer_backend in PD_TRANSFER_BACKENDS:
        return
    raise Ernie55ArgumentError(
        "--disaggregation-transfer-backend",
        transfer_backend,
        ", ".join(PD_TRANSFER_BACKENDS),
        "PD disaggregation of the ERNIE-5.5 pools (window rows, compressed entries, MLA latents, indexer keys, "
        "open-block state, the ECHO draft's rows) has run with SGLang's Mooncake transfer backend only",
        "Use --disaggregation-transfer-backend mooncake on both servers.",
    )


PREFILL_GRAPH_WHY = (
    "the ernie55 attention backend's prefill (extend) reads each request's prefix and extend lengths on the "
    "host to lay out block compression and the DSA top-k, which a captured graph cannot replay; decode and "
    "ECHO verify / draft run as CUDA graphs"
)


def refuse_prefill_cuda_graph(backend: str) -> None:
    raise Ernie55ArgumentError(
        "--cuda-graph-backend-prefill",
        backend,
        "disabled (the default for this model)",
        f"{PREFILL_GRAPH_WHY}.",
        "Drop the flag, or pass --disable-prefill-cuda-graph.",
    )


def long_context_guidance(context_length: int | None, max_running_requests: int | None = None) -> str | None:
    """The warning for --context-length above 131072, or None."""
    if context_length is None or context_length <= LONG_CONTEXT_THRESHOLD:
        return None
    running = "" if max_running_requests is None else f" (now {max_running_requests})"
    return (
        f"--context-length {context_length} is above {LONG_CONTEXT_THRESHOLD}: supporting 1M tokens is a "
        "capability, not a default. Each request's KV can now take a large share of the pool, so also "
        f"lower --max-running-requests to single digits (about {LONG_CONTEXT_MAX_RUNNING_REQUESTS} for "
        f"1048576 on 2x B300){running} and --cuda-graph-max-bs-decode (about {LONG_CONTEXT_CUDA_GRAPH_MAX_BS}), "
        "or the server admits more long requests than the KV pool holds and captures graphs it never uses."
    )


# ---------------------------------------------------------------------------------------------- the table
class FlagRule(NamedTuple):
    flag: str
    behaviour: str


ERNIE55_FLAG_RULES: tuple[FlagRule, ...] = (
    FlagRule(
        "`--attention-backend` (and `--prefill-`, `--decode-`, `--speculative-draft-attention-backend`)",
        "default `ernie55`; any other value: error",
    ),
    FlagRule("`--page-size`", f"default {SERVING_PAGE_SIZE}; any other value: error"),
    FlagRule(
        "`--swa-full-tokens-ratio`",
        "default 0.1; a given value is kept (SGLang checks (0, 1]); sizes the SWA pool of the HCA window "
        "rows (SGLang refuses a pool below window + one page); `--disable-hybrid-swa-memory` keeps the "
        "window for every token",
    ),
    FlagRule(
        "`--kv-cache-dtype` (and `--speculative-draft-kv-cache-dtype`)",
        "default / `auto` -> `fp8_e4m3` (logged; vLLM's `auto` means BF16); `bf16` -> `bfloat16` (logged); "
        "`fp8_e4m3`, `bfloat16` kept; vLLM's `fp8` and every other dtype: error naming the legal values "
        "(on the CLI argparse already refuses `fp8`). A checkpoint whose widths the fp8 layouts cannot tile "
        "(HCA `head_dim - qk_rope_head_dim` not a multiple of 64, MLA-DSA `kv_lora_rank` not a multiple "
        "of 128): default / `auto` -> `bfloat16` (logged with the field), `fp8_e4m3`: error naming the "
        "field",
    ),
    FlagRule(
        "`--tp`, `--attn-dp-size`, `--attn-cp-size`",
        "attention TP = tp / attn_dp / attn_cp must divide 8 (o_groups); else error with the computed "
        "attention TP and the nearest legal settings (`--tp 16 --attn-dp-size 2` is legal). When the model is "
        "built: attention DP runs at any attention TP, with `--enable-dp-lm-head`, and with ECHO at attention TP "
        "1; attention DP with `--ep`, or with ECHO at attention TP > 1, is refused (not yet run); "
        "`--attn-cp-size` > 1: next row",
    ),
    FlagRule(
        "`--attn-cp-size` > 1, `--enable-prefill-cp`, `--cp-strategy`",
        "`--attn-cp-size` > 1 needs `--enable-prefill-cp --cp-strategy interleave` (SGLang's prefill split); "
        "without them, or with another strategy: error. When the model is built: runs at attention TP 1 "
        "(`--attn-cp-size` = `--tp`) on `--device cpu` without `--attn-dp-size`, `--ep` and ECHO; prefill "
        "batches split over the CP ranks, decode whole on every rank; other CP layouts and CUDA are refused "
        "(not yet run)",
    ),
    FlagRule(
        "`--ep N` (`--moe-a2a-backend none`)",
        "SGLang's standard EP dispatch: each of N ranks holds 1/N of the routed experts, every rank keeps every token",
    ),
    FlagRule(
        "`--moe-a2a-backend deepep`",
        "needs EP >= 4: SGLang runs ep = tp, so `--tp` >= 4, and a given `--ep 2`/`3` is refused too; "
        "else error (experts per rank vs DeepEP's limit). A legal DeepEP layout (and every all-to-all backend "
        "but `none`) is then refused when the model is built: not yet run",
    ),
    FlagRule("`--moe-a2a-backend` with `--pp-size` > 1", "must be `none`; else error"),
    FlagRule(
        "`--speculative-algorithm`",
        "`EAGLE` or `NEXTN` (ECHO); `DSPARK`: error (Base has no DSpark draft); "
        "others: error. The draft path defaults to the model path (ECHO ships in the checkpoint)",
    ),
    FlagRule("`--speculative-eagle-topk`", "default 1; any other value: error (chain drafts only)"),
    FlagRule("`--speculative-num-steps`", "default 2 (low-latency preset); legal 1, 2, 3; else error"),
    FlagRule(
        "`--speculative-num-draft-tokens`",
        "default steps + 1; any other value: error naming vLLM's `num_speculative_tokens` confusion",
    ),
    FlagRule(
        "`--reasoning-parser`, `--tool-call-parser`",
        "error on the Base model; `SGLANG_ERNIE55_ALLOW_PARSERS=1` lets them through with a warning "
        "(for your own fine-tune that emits that format)",
    ),
    FlagRule(
        "`--enable-hierarchical-cache`, `--hicache-*`",
        "host copies of every ERNIE-5.5 pool page, `--hicache-ratio` x the device pool (e.g. 2); `--hicache-size`: "
        "error, use `--hicache-ratio`; `--hicache-storage-backend` (L3) and `--hicache-host-memory-mode "
        "buffer_only`: error (not yet run on these pools)",
    ),
    FlagRule(
        "`--enable-deterministic-inference`",
        "accepted with `ernie55` and the radix cache kept: attention on the Triton kernels with fixed key "
        "splits (FlashMLA is skipped), SGLang's batch-invariant GEMMs / MoE config; greedy output is then "
        "bit-identical across batch composition, CUDA graphs, prefix hits and ECHO on / off",
    ),
    FlagRule(
        "`--cuda-graph-backend-prefill` (prefill CUDA graphs)",
        "off for this model (logged): the backend's prefill reads host-side lengths a captured graph cannot "
        "replay; decode, ECHO verify and draft graphs stay on; a prefill graph backend asked for by name: error "
        "(`--disable-prefill-cuda-graph` is fine)",
    ),
    FlagRule(
        "`--context-length` > 131072",
        "warning: also lower `--max-running-requests` (single digits) and `--cuda-graph-max-bs-decode`",
    ),
    FlagRule(
        "`--disaggregation-mode prefill` / `decode`, `--disaggregation-transfer-backend`",
        "PD disaggregation with `mooncake` (both servers the same pool flags; docs/serving-design.md section 10); "
        "any other transfer backend: error (not yet run on these pools)",
    ),
    FlagRule(
        "request `n` > 1 under PD disaggregation",
        "HTTP 400 (sub-requests would share one bootstrap room and hang)",
    ),
    FlagRule(
        "request `model` != served name",
        "HTTP 404 up front (SGLang itself serves any name); no `model` field: served",
    ),
    FlagRule(
        "request token ids outside [0, vocab_size), an empty prompt in a batch, `logprobs` / `top_logprobs` "
        "outside 0..vocab_size, an empty stop string; `n` < 1 (OpenAI endpoints)",
        "HTTP 400 naming the field and its legal values, on `/v1/completions`, `/v1/chat/completions` and "
        "`/generate`, before the scheduler (such a token id would fail in the embedding and stop the server)",
    ),
)


def flag_rules_markdown() -> str:
    """ERNIE55_FLAG_RULES as the markdown table of docs/server-args.md."""
    lines = ["| flag | what this project does |", "| --- | --- |"]
    lines += [f"| {r.flag} | {r.behaviour} |" for r in ERNIE55_FLAG_RULES]
    return "\n".join(lines)
