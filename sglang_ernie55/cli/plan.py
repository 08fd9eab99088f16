"""`sglang-ernie55 plan`: the memory budget of a hardware cell (or of N GPUs), from the model config."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "memory planner: weights and KV per GPU, max tokens / context, fits or not (and why)"

LONG_CONTEXT = 1048576


def configure(parser: argparse.ArgumentParser) -> None:
    """Plan the GPU memory of one hardware cell, or of N GPUs of one kind, from the model config.

    Prints the weight bytes per GPU (by sharding group), the KV bytes per token per layer kind and KV
    dtype, the pool sizes, the maximum tokens per attention-DP rank and for the whole server, the
    maximum context at a concurrency, and a verdict (fits / does not fit, with the reason).
    `--table` prints the minimum-GPU table (the vendor's, reproduced: FP8 2x B300, 4x B200, 8x H100;
    BF16 4x B300, 8x B200, 16x H100; this project's H200: 4 / 8). `--explain-1m` explains what a
    1,048,576-token context costs.

    Assumptions (all GB are 10^9 bytes; GPU memory as the vendor states it: B300/GB300 288,
    B200/GB200 192, H200 141, H100 80):
      - weights: every checkpoint tensor counted from config.json (default: the full-size
        Ernie55Config; the sum is checked against its parameter_counts()). FP8: Linears 1 B + one fp32
        scale per 128x128 block; embeddings, lm_head, norms, routers, weights_proj BF16; mHC, biases,
        ape, attn_sink FP32. BF16: Linears 2 B. Attention modules shard over attention TP
        (tp / attn-dp / attn-cp), FFN and experts over tp, embedding over attention TP, lm_head over
        tp, routers / norms / mHC replicated; ECHO's own tensors only when speculating.
      - runtime reserve: 10% of the GPU (CUDA context and graphs, NCCL / all-to-all buffers,
        activations of one prefill chunk, allocator slack).
      - prefill scratch: the DSA indexer's fp32 scores of one chunk against the context,
        chunk per attention-DP rank x context x 4 B.
      - request state: the HCA compressor's open block, fp32 [128, 1024] per HCA layer per running
        request (~19 MB at full size; two blocks, ~39 MB, with --speculative-algorithm).
      - KV pool: the rest, at the layouts of sglang_ernie55.kernels.layout with their page padding,
        the serving pool's own numbers (FP8: MLA-DSA 656 B + indexer 132 B per token, HCA 585 B per
        window token and 864 B per compressed entry; BF16: 1152 + 256, 1024 and 1024); SWA window pool
        at --swa-full-tokens-ratio 0.1 (+ the ECHO draft's window row when speculating); replicated
        over attention TP.
      - verdict: fits when the KV pool keeps at least 25% of each GPU (the sizing rule behind the
        vendor's table) and holds one full-context request.
    Unverified: these are estimates for planning; SGLang's own profiler decides the real pool at start.

    Examples:
      sglang-ernie55 plan --hardware h100 --precision bf16 --strategy high-throughput
      sglang-ernie55 plan --hardware b200 --precision fp8 --gpus 2        # why the vendor says 4
      sglang-ernie55 plan --hardware b300 --strategy long-context --concurrency 4
      sglang-ernie55 plan --table
    """
    parser.add_argument("--hardware", help="b300 | gb300 | b200 | gb200 | h100 | h200")
    parser.add_argument("--precision", default="fp8", help="fp8 | bf16 (default: fp8)")
    parser.add_argument("--strategy", default="balanced", help="the cell's strategy (default: balanced)")
    parser.add_argument(
        "--gpus",
        type=int,
        help="plan N GPUs in the minimum-table layout (TP N; attention DP N/8 beyond 8) instead of a cell",
    )
    parser.add_argument(
        "--kv-cache-dtype", choices=["fp8_e4m3", "bfloat16"], help="override the cell's KV dtype"
    )
    parser.add_argument("--context-length", type=int, help="override the cell's context length")
    parser.add_argument("--max-running-requests", type=int, help="override the cell's request limit")
    parser.add_argument(
        "--concurrency",
        type=int,
        action="append",
        help="report the maximum context at C requests (repeatable)",
    )
    parser.add_argument(
        "--config", help="a config.json to plan for (default: the full-size ERNIE-5.5-Flash config)"
    )
    parser.add_argument("--table", action="store_true", help="print the minimum-GPU table and exit")
    parser.add_argument(
        "--explain-1m", action="store_true", help="explain the 1M-context constraints of the cell"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _load_config(path: str | None):
    from ..configuration import Ernie55Config

    if not path:
        return Ernie55Config()
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data.pop("model_type", None)
    return Ernie55Config(**data)


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def format_table(cfg) -> str:
    from ..deploy.cells import GPUS
    from ..deploy.memory import checkpoint_bytes, minimum_gpus

    lines = [
        f"weights: FP8 {_gb(checkpoint_bytes(cfg, 'fp8'))}, BF16 {_gb(checkpoint_bytes(cfg, 'bf16'))}",
        f"{'GPU (memory)':22} {'FP8':>12} {'BF16':>12}",
    ]
    for g in GPUS.values():
        row = []
        for p in ("fp8", "bf16"):
            n, pl = minimum_gpus(cfg, g, p)
            nodes = pl.layout.nodes
            row.append(f"{n} ({nodes} x {n // nodes})" if nodes > 1 else str(n))
        lines.append(f"{g.label + f' ({g.memory_gb:g} GB)':22} {row[0]:>12} {row[1]:>12}")
    return "\n".join(lines)


def explain_1m(cfg, p) -> list[str]:
    """The 1M-context constraints of a plan, as lines."""
    from ..deploy.memory import pool_bytes_per_token

    L = p.layout
    per_tok = pool_bytes_per_token(
        cfg, L.kv_cache_dtype, speculative=L.speculative, swa_ratio=L.swa_full_tokens_ratio
    )
    one = LONG_CONTEXT * per_tok["full"]
    fit = p.max_concurrency_at(LONG_CONTEXT)
    scratch = L.prefill_chunk_per_rank * LONG_CONTEXT * 4.0
    return [
        f"1M context ({LONG_CONTEXT:,} tokens) on this layout:",
        f"  - KV of one 1M request: {_gb(one)} in the full pool per attention-DP rank "
        f"(MLA-DSA {len(cfg.mla_dsa_layer_ids)} layers keep every token; the {len(cfg.hca_layer_ids)} HCA layers keep "
        f"one entry per {cfg.compress_ratio} tokens plus a {cfg.window_size}-token window), replicated on each of the "
        f"{L.attn_tp} attention-TP GPUs.",
        f"  - the pool holds {fit} such requests in the whole server: --max-running-requests must come down to "
        "single digits, and --cuda-graph-max-bs-decode with it (graphs for batches that never run waste memory).",
        f"  - prefill: the DSA indexer scores each chunk against the whole context in fp32: "
        f"{L.prefill_chunk_per_rank} x 1M x 4 B = {_gb(scratch)} per chunk; a smaller --chunked-prefill-size trades "
        "prefill speed for this scratch (the long-context cells use 4096, 2048 on 80 GB cards).",
        "  - 1M is a capability of the model (max_position_embeddings), not a default: the other cells keep "
        "--context-length 131072, the training context.",
    ]


def refused_note(cell, runnable) -> str | None:
    """Why this version does not serve `cell`'s own recipe and what is planned instead, else None."""
    if runnable is cell:
        return None
    head = f"this version refuses the recipe: {cell.layout_refusal()}"
    if runnable is None:
        return f"{head} No layout of this cell runs yet. Planned: the recipe as it is."
    return f"{head} Planned: the nearest layout that runs, the same flags without attention DP / CP (what `cmd` prints)."


def render(
    cfg, p, concurrency: list[int], cell_name: str | None, refused: str | None = None, servable: bool = True
) -> str:
    """The plan as text; `refused` / `servable`: `refused_note` of the cell and whether any layout of it runs."""
    L = p.layout
    head = f"cell {cell_name}: " if cell_name else ""
    layout = f"tp {L.tp}"
    if L.attn_dp > 1:
        layout += f", attention DP {L.attn_dp}"
    if L.attn_cp > 1:
        layout += f", attention CP {L.attn_cp}"
    layout += f" (attention TP {L.attn_tp})"
    nodes = f"{L.nodes} x {L.gpus_per_node}" if L.nodes > 1 else f"{L.num_gpus}"
    out = [f"note: {refused}", ""] if refused else []
    out += [
        f"{head}{nodes} {L.gpu.label} ({L.gpu.memory_gb:g} GB), {L.precision.upper()} weights, {layout}, "
        f"KV {L.kv_cache_dtype}, context {L.context_length:,}"
        + (f", max-running-requests {L.max_running_requests}" if L.max_running_requests else ""),
        "",
        "per GPU:",
        f"  weights          {_gb(p.weights_total):>10}   "
        + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in p.weights.items()),
        f"  runtime reserve  {_gb(p.reserve):>10}   10% of the GPU: CUDA graphs, NCCL, activations, slack",
        f"  prefill scratch  {_gb(p.scratch):>10}   indexer scores: {L.prefill_chunk_per_rank} x {L.context_length:,} x 4 B",
        f"  request state    {_gb(p.state):>10}   HCA open blocks of {L.requests_per_rank or 0} requests per rank",
        f"  KV pool          {_gb(p.kv_pool):>10}   {p.kv_pool / (L.gpu.memory_gb * 1e9):.0%} of the GPU",
        "",
        f"KV bytes per token per layer ({L.kv_cache_dtype}):",
        f"  MLA-DSA x{len(cfg.mla_dsa_layer_ids):<3} latent+rope {p.kv_per_token['mla']:g} B + indexer key "
        f"{p.kv_per_token['indexer']:g} B (every token)",
        f"  HCA     x{len(cfg.hca_layer_ids):<3} window {p.kv_per_token['hca_window']:g} B (SWA pool) + compressed "
        f"{p.kv_per_token['hca_compressed']:g} B per {cfg.compress_ratio} tokens",
        f"  per token: full pool {p.pool_per_token['full']:.0f} B + SWA {p.pool_per_token['swa']:.0f} B x ratio "
        f"{L.swa_full_tokens_ratio:g} = {p.pool_per_token['per_token']:.0f} B",
        "",
        f"max tokens: {p.max_tokens_per_rank:,} per attention-DP rank (SWA window pool {p.swa_tokens_per_rank:,}), "
        f"{p.max_tokens_server:,} in the server ({L.kv_ranks} rank(s))",
    ]
    cs = list(concurrency)
    if L.max_running_requests and L.max_running_requests not in cs:
        cs.append(L.max_running_requests)
    for c in sorted(set(cs)):
        out.append(f"max context at concurrency {c}: {p.max_context_at(c):,} tokens")
    out.append(
        f"concurrency at the full context ({L.context_length:,}): {p.max_concurrency_at(L.context_length)}"
    )
    out.append("")
    if not servable:
        out.append("verdict: NOT SERVED BY THIS VERSION")
        out.append(f"  - {refused}")
    elif p.fits:
        out.append("verdict: FITS")
    else:
        out.append("verdict: DOES NOT FIT")
        out += [f"  - {r}" for r in p.reasons]
    out += [f"note: {n}" for n in p.notes]
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    from ..deploy.cells import GPUS, CellError, find_cell
    from ..deploy.memory import Layout, minimum_gpu_table, plan

    try:
        cfg = _load_config(args.config)
    except Exception as e:  # a broken config.json: say which and why
        print(f"error: cannot load config {args.config}: {e}", file=sys.stderr)
        return 2
    if args.table:
        if args.json:
            table = minimum_gpu_table(cfg)
            print(json.dumps({f"{g}/{p}": n for (g, p), n in table.items()}, indent=2))
        else:
            print(format_table(cfg))
        return 0
    if not args.hardware:
        print("error: --hardware is required (or --table)", file=sys.stderr)
        return 2
    overrides = dict(
        kv_cache_dtype=args.kv_cache_dtype,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
    )
    cell_name, refused, servable = None, None, True
    try:
        if args.gpus:
            gpu = GPUS.get(args.hardware.lower())
            if gpu is None:
                raise CellError(f"unknown hardware {args.hardware!r} (known: {', '.join(GPUS)})")
            if args.precision not in ("fp8", "bf16"):
                raise CellError(f"unknown precision {args.precision!r} (known: fp8, bf16)")
            layout = Layout.minimal(
                gpu, args.precision, args.gpus, **{k: v for k, v in overrides.items() if v}
            )
        else:
            cell = find_cell(args.hardware, args.precision, args.strategy)
            cell_name, runnable = cell.name, cell.runnable()
            refused, servable = refused_note(cell, runnable), runnable is not None
            layout = Layout.from_cell(runnable or cell, **overrides)
    except CellError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    p = plan(cfg, layout)
    concurrency = args.concurrency or [1]
    long_ctx = args.explain_1m or layout.context_length >= LONG_CONTEXT
    if args.json:
        d = p.as_dict() | {"cell": cell_name, "servable": servable, "refused": refused}
        d["max_context_at"] = {str(c): p.max_context_at(c) for c in concurrency}
        if long_ctx:
            d["explain_1m"] = explain_1m(cfg, p)
        print(json.dumps(d, indent=2))
    else:
        print(render(cfg, p, concurrency, cell_name, refused, servable))
        if long_ctx:
            print()
            print("\n".join(explain_1m(cfg, p)))
    return 0 if p.fits and servable else 1
