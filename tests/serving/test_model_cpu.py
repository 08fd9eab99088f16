"""CPU tests of the SGLang model class: import, strict BF16/FP8 weight mapping, and the `ernie55`
torch-twin backend + pool against the reference model (chunked prefill, decode, prefix hits)."""

from __future__ import annotations

import glob

import pytest
import torch

from sglang_ernie55.configuration import ARCH_MAIN, tiny_config  # noqa: E402
from tests.serving import twin_harness as th


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


@pytest.fixture(scope="module")
def ref(cfg):
    from sglang_ernie55.reference.model import build_reference

    return build_reference(cfg, seed=0)


@pytest.fixture(scope="module")
def model_fp32(cfg, ref):
    m = th.build_model(cfg, dtype=torch.float32)
    m.load_weights(ref.state_dict().items())
    th.torch_experts(m)
    return m


@pytest.fixture(scope="module")
def model_bf16(cfg, ref):
    m = th.build_model(cfg)
    m.load_weights(ref.state_dict().items())
    th.torch_experts(m)
    return m


def test_entry_class_is_the_architecture():
    from sglang_ernie55.models import ernie55

    assert [c.__name__ for c in ernie55.EntryClass] == [ARCH_MAIN]


def test_every_checkpoint_tensor_maps_to_one_parameter(cfg, model_bf16, ref):
    """The name table consumes every checkpoint key exactly once and leaves no parameter unloaded."""
    from sglang_ernie55.checkpoint.spec import expected_tensors

    m = model_bf16
    params = dict(m.named_parameters())
    hit: dict[str, int] = {}
    shards: dict[str, set] = {}
    for name in expected_tensors(cfg):
        if name.startswith(m._SKIP_PREFIXES):
            continue
        pname, where = m.checkpoint_to_param(name)
        assert pname in params, f"{name} -> {pname} is no parameter"
        hit[pname] = hit.get(pname, 0) + 1
        shards.setdefault(pname, set()).add(where)
        if where is None:
            assert hit[pname] == 1, f"{pname} is the target of two checkpoint tensors"
    assert set(hit) == set(params)
    E = cfg.n_routed_experts
    for pname, n in hit.items():
        if pname.endswith("experts.w13_weight"):
            assert n == 2 * E
        elif pname.endswith("experts.w2_weight"):
            assert n == E
    # merged Linears: each shard id exactly once, all of them (gate_up_proj: 2; x_proj groups: their parts)
    merged = {p: w for p, w in shards.items() if all(isinstance(i, int) for i in w)}
    assert any(p.endswith("mlp.gate_up_proj.weight") for p in merged)
    assert any(".self_attn.x_proj.linears." in p for p in merged)
    for pname, ids in merged.items():
        assert hit[pname] == len(ids) and ids == set(range(len(ids))), (pname, hit[pname], ids)
        assert len(ids) >= 2 or ".x_proj." in pname, f"{pname}: a merged Linear of one part"
    # loaded values are the reference's (a plain copy, a TP-1 shard, or an expert slice)
    sd = ref.state_dict()
    torch.testing.assert_close(
        params["model.layers.2.self_attn.wq_b.weight"], sd["model.layers.2.self_attn.wq_b.weight"]
    )
    # merged: each checkpoint Linear at its rows, in the order of its shard id
    for layer, parts in ((2, ("wq_a", "wkv", "compressor.wkv_gate")), (0, ("mlp.gate_proj", "mlp.up_proj"))):
        names = [f"model.layers.{layer}.{'' if p.startswith('mlp') else 'self_attn.'}{p}.weight" for p in parts]
        pname = m.checkpoint_to_param(names[0])[0]
        assert all(m.checkpoint_to_param(n)[0] == pname for n in names)
        torch.testing.assert_close(params[pname], torch.cat([sd[n] for n in names]))
    w13 = params["model.layers.1.mlp.experts.w13_weight"]
    inter = cfg.moe_intermediate_size
    torch.testing.assert_close(w13[3, :inter], sd["model.layers.1.mlp.experts.3.gate_proj.weight"])
    torch.testing.assert_close(w13[3, inter:], sd["model.layers.1.mlp.experts.3.up_proj.weight"])


def test_loader_names_every_problem(cfg, ref):
    from sglang_ernie55.models.ernie55 import Ernie55WeightError

    m = th.build_model(cfg)
    sd = dict(ref.state_dict())
    sd.pop("model.layers.3.self_attn.wkv.weight")
    sd["model.layers.0.mlp.bogus.weight"] = torch.zeros(2, 2)
    sd["model.layers.1.mlp.latent_up.weight"] = torch.zeros(3, 3)
    with pytest.raises(Ernie55WeightError) as e:
        m.load_weights(sd.items())
    msg = str(e.value)
    assert "missing checkpoint tensor model.layers.3.self_attn.wkv.weight" in msg
    assert "unexpected checkpoint tensor model.layers.0.mlp.bogus.weight" in msg
    assert "mis-shaped checkpoint tensor model.layers.1.mlp.latent_up.weight" in msg


def test_fp8_checkpoint_loads_strictly(cfg, tmp_path):
    """FP8 128x128: 128-multiple Linears keep SGLang's FP8 block method (codes + scales as stored); ragged
    ones, kv_b_proj, wo_a and the tiny experts are dequantized into BF16 exactly as the reference reads them."""
    from safetensors.torch import load_file
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    from sglang_ernie55.checkpoint.loader import load_checkpoint
    from sglang_ernie55.checkpoint.spec import FP8_QUANTIZATION_CONFIG
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    make_checkpoint(tmp_path, dtype="fp8", force=True)
    raw: dict[str, torch.Tensor] = {}
    for f in glob.glob(str(tmp_path / "*.safetensors")):
        raw.update(load_file(f))
    m = th.build_model(cfg, Fp8Config.from_config(dict(FP8_QUANTIZATION_CONFIG)))
    m.load_weights(raw.items())
    p = dict(m.named_parameters())
    # wkv and the compressor's wkv_gate (128-multiples) keep FP8 codes + scales as stored, at their rows of the
    # layer's merged FP8 Linear; wq_a (ragged) goes to its unquantized one
    at = 0
    for shard, part in enumerate(("wkv", "compressor.wkv_gate")):
        kept = f"model.layers.2.self_attn.{part}"
        w_name, where = m.checkpoint_to_param(f"{kept}.weight")
        s_name = m.checkpoint_to_param(f"{kept}.weight_scale_inv")[0]
        rows = raw[f"{kept}.weight"].shape[0]
        assert where == shard and p[w_name].dtype == torch.float8_e4m3fn
        codes = p[w_name][at : at + rows].view(torch.uint8)
        assert torch.equal(codes, raw[f"{kept}.weight"].view(torch.uint8))
        assert torch.equal(p[s_name][at // 128 : (at + rows) // 128], raw[f"{kept}.weight_scale_inv"])
        at += rows
    assert at == p[w_name].shape[0]
    deq_name = m.checkpoint_to_param("model.layers.2.self_attn.wq_a.weight")[0]
    assert deq_name != w_name and p[deq_name].dtype == torch.bfloat16
    _, deq = load_checkpoint(tmp_path, dtype=torch.float32)
    for name in (
        "model.layers.2.self_attn.wq_b.weight",
        "model.layers.1.self_attn.kv_b_proj.weight",
        "model.layers.3.self_attn.wo_a.weight",
    ):
        assert p[name].dtype == torch.bfloat16
        torch.testing.assert_close(p[name].float(), deq[name].bfloat16().float())
    torch.testing.assert_close(
        p["model.layers.1.mlp.experts.w2_weight"][5].float(),
        deq["model.layers.1.mlp.experts.5.down_proj.weight"].bfloat16().float(),
    )


def _prompt(cfg, n, seed, ref=None):
    """A random prompt; with `ref`, one without DSA top-k near-ties (twin_harness.well_posed_prompt), for the
    comparisons at fp32 rounding."""
    if ref is not None:
        return th.well_posed_prompt(cfg, ref, n, seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (n,), generator=g)
    ids[0] = cfg.bos_token_id
    return ids


@pytest.mark.slow
def test_twin_equals_reference_in_fp32(cfg, ref, model_fp32):
    """fp32 weights + fp32 pool rows: the serving path (chunked prefill crossing window / block / page
    boundaries, a mixed-length batch, decode) reproduces the reference logits to fp32 rounding."""
    a, b = _prompt(cfg, 300, 1, ref), _prompt(cfg, 140, 2, ref)
    ra, rb = ref.forward(a).logits, ref.forward(b).logits
    s = th.Session(model_fp32, cfg, torch.float32)
    out_a, out_b = [], []
    first = s.extend([0, 1], [a[:100], b[:127]])  # a mixed-length extend batch
    out_a.append(first[:100])
    out_b.append(first[100:])
    out_a.append(s.extend([0], [a[100:257]]))  # chunk crossing the window, block 1 and the page
    for t in range(13):  # batched decode: a at 257.., b at 127.. (crosses b's first block)
        logits = s.decode([0, 1], [int(a[257 + t]), int(b[127 + t])])
        out_a.append(logits[:1])
        out_b.append(logits[1:])
    out_a.append(s.extend([0], [a[270:]]))
    torch.testing.assert_close(torch.cat(out_a), ra, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(out_b), rb, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_prefix_hit_equals_miss(cfg, ref, model_fp32):
    """A request whose first 256 tokens are a cached page (radix hit) gets exactly the logits of a miss;
    its slot's stale open-block state (left by another request) is never read."""
    a = _prompt(cfg, 290, 3, ref)
    s = th.Session(model_fp32, cfg, torch.float32)
    miss = s.extend([0], [a])
    s.extend([1], [_prompt(cfg, 77, 4)])  # leaves an open block in slot 1's state
    s.share_prefix(0, 1, 256)
    hit = s.extend([1], [a[256:]])
    torch.testing.assert_close(hit, miss[256:], atol=2e-5, rtol=2e-5)  # same stored rows; GEMM shapes differ
    torch.testing.assert_close(hit, ref.forward(a).logits[256:], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float8_e4m3fn])
def test_twin_bf16_model_tracks_reference(cfg, ref, model_bf16, kv):
    """BF16 activations with a bf16 / fp8 KV cache stay close to the fp32 reference whose cached tensors
    are rounded as the pool stores them (server_harness.kv_rounded_reference: the fp8 byte layouts for
    fp8; against the unrounded reference, fp8 KV alone flips DSA top-k / routing near-ties and top-1 fell
    to 0.84 here), top-1 and cosine."""
    from tests.serving import server_harness as sh

    a = _prompt(cfg, 290, 5)
    s = th.Session(model_bf16, cfg, kv)
    got = torch.cat([s.extend([0], [a[:200]]), s.extend([0], [a[200:289]]), s.decode([0], [int(a[289])])])
    with sh.kv_rounded_reference("bfloat16" if kv == torch.bfloat16 else "fp8_e4m3", cfg):
        want = ref.forward(a).logits
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.mean() > (0.99 if kv == torch.bfloat16 else 0.97), (
        cos
    )  # fp8 KV flips some top-k / routing picks
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean()
    print(f"\n[twin bf16 act, {kv} KV] top-1 {top1:.4f}, cosine {cos.mean():.5f}")
    assert top1 > 0.85


@pytest.mark.parametrize("swa_pages", [None, 4])
def test_padded_graph_rows_do_not_touch_live_state(cfg, model_fp32, swa_pages):
    """A CUDA-graph padded decode row (req slot 0, out_cache_loc 0) writes only scratch rows: the padding
    page of the window rows (full slot 0 -> SWA slot 0 with an SWA pool), the compressed scratch entry and
    the scratch state slot."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, set_forward_context

    s = th.Session(model_fp32, cfg, torch.float32, swa_pages=swa_pages)
    s.extend([0], [_prompt(cfg, 70, 6)])
    snapshot = {lid: st.clone() for lid, st in s.pool.state.items()}
    cmp_before = {lid: c.data.clone() for lid, c in s.pool.cmp.items()}
    win_before = {lid: w.data.clone() for lid, w in s.pool.win.items()}
    fb = SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        out_cache_loc=torch.tensor([0]),
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([128]),
        seq_lens_cpu=torch.tensor([128]),
        global_num_token_non_padded_cpu=None,
    )
    s.backend.init_forward_metadata(fb)
    prev = set_forward_context(ForwardContext(attn_backend=s.backend))
    try:
        s.model.model(torch.tensor([5]), torch.tensor([127]), fb)
    finally:
        set_forward_context(prev)
    for lid, st in s.pool.state.items():
        assert torch.equal(st[: s.pool.state_scratch], snapshot[lid][: s.pool.state_scratch])
        assert torch.equal(s.pool.cmp[lid].data[:-1], cmp_before[lid][:-1])
        w = s.pool.win[lid].data
        assert torch.equal(w[256:], win_before[lid][256:]) and not torch.equal(w[:256], win_before[lid][:256])


@pytest.mark.slow
def test_twin_full_width_attention_geometry():
    """Real attention widths (H 4096, 64 heads, HCA head 512 in 8 output groups, MLA 512+64 latent,
    indexer 64x128) on two dense layers with a small vocab: the twin equals the reference in fp32 across
    the window / block boundary, chunked prefill and decode."""
    from sglang_ernie55.configuration import Ernie55Config
    from sglang_ernie55.reference.model import build_reference

    cfg = Ernie55Config(
        vocab_size=512,
        num_hidden_layers=2,
        layer_types=["hca", "mla_dsa"],
        first_k_dense_replace=2,
        intermediate_size=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    ref = build_reference(cfg, seed=0).float()
    model = th.build_model(cfg, dtype=torch.float32)
    model.load_weights(ref.state_dict().items())
    ids = _prompt(cfg, 150, 7)
    s = th.Session(model, cfg, torch.float32, num_pages=2, max_ctx=512, slots=2)
    got = torch.cat(
        [s.extend([0], [ids[:100]]), s.extend([0], [ids[100:149]]), s.decode([0], [int(ids[149])])]
    )
    torch.testing.assert_close(got, ref.forward(ids).logits, atol=2e-4, rtol=2e-4)


# ------------------------------------------------------------------ over SGLang's SWA pool (hybrid)
def _live_window_mapping_ok(s) -> None:
    """SGLang's SWA allocator keeps page offsets: every mapped full slot f sits at the same offset of its SWA
    page, all slots of a full page share one SWA page, and `window_pages` gives that page."""
    m, page = s.pool.full_to_swa_index_mapping[:-1], s.page
    f = torch.nonzero(m > 0)[:, 0]
    assert torch.equal(m[f] % page, f % page)
    assert torch.equal(s.pool.window_pages(f // page) * page + f % page, m[f])


@pytest.mark.slow
def test_twin_over_swa_pool_equals_reference(cfg, ref, model_fp32):
    """The pool with a 4-page SWA pool under SGLang's own SWATokenToKVPoolAllocator: chunked prefill crossing
    the window / block / page edges, a mixed-length batch, batched decode, SWA eviction of the out-of-window
    page while decoding, and a new request that gets the evicted SWA page (it overwrites those window rows):
    every request's logits equal the reference (fp32 rows)."""
    a, b, c = _prompt(cfg, 600, 11, ref), _prompt(cfg, 140, 12, ref), _prompt(cfg, 50, 13, ref)
    s = th.Session(model_fp32, cfg, torch.float32, num_pages=8, slots=4, swa_pages=4)
    out_a, out_b = [], []
    first = s.extend([0, 1], [a[:100], b[:127]])
    out_a.append(first[:100])
    out_b.append(first[100:])
    out_a.append(s.extend([0], [a[100:257]]))  # crosses the window, block 1 and the page
    out_a.append(s.extend([0], [a[257:530]]))  # a holds SWA pages for its pages 0..2: the SWA pool is full
    assert s.allocator.swa_available_size() == 0
    old = s.pool.window_loc(s.req_to_token[0, :1].long()) // 256
    assert s.evict_swa(0) == old.tolist()  # pre_len 530: page 0 (positions 0..255) left the window
    assert int(s.pool.window_loc(s.req_to_token[0, :256].long()).abs().sum()) == 0  # unmapped (padding page)
    for t in range(13):  # a at 530.., b at 127.. (crosses b's first block)
        logits = s.decode([0, 1], [int(a[530 + t]), int(b[127 + t])])
        out_a.append(logits[:1])
        out_b.append(logits[1:])
    got_c = s.extend([2], [c])  # the only free SWA page is a's evicted one
    assert (s.pool.window_loc(s.req_to_token[2, :1].long()) // 256).tolist() == old.tolist()
    out_a.append(s.extend([0], [a[543:]]))
    _live_window_mapping_ok(s)
    live = s.req_to_token[2, :50].long()
    assert (s.pool.window_loc(live) != live).all()  # c's SWA slots are not its full slots
    torch.testing.assert_close(torch.cat(out_a), ref.forward(a).logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(out_b), ref.forward(b).logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_c, ref.forward(c).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_prefix_hit_on_swa_evicted_prefix_equals_miss(cfg, ref, model_fp32):
    """A cached 512-token prefix whose first page lost its SWA rows (tombstone: SGLang matches it because the
    last window before the hit still has SWA rows) and whose freed SWA page was reused by another request:
    the hit gives the miss's logits. The request slot's stale open-block state (left by an aborted request)
    is never read; the retracted / aborted request, re-run from scratch in a reused slot, is exact too."""
    a = _prompt(cfg, 700, 14, ref)
    s = th.Session(model_fp32, cfg, torch.float32, num_pages=10, slots=4, swa_pages=4)
    miss = torch.cat([s.extend([0], [a[:300]]), s.extend([0], [a[300:]])])
    freed = s.evict_swa(0)  # pre_len 700: page 0 out of the window
    assert len(freed) == 1
    d = _prompt(cfg, 77, 15, ref)
    s.extend([1], [d[:60]])  # takes the freed SWA page, leaves an open block in slot 1's state
    assert (s.pool.window_loc(s.req_to_token[1, :1].long()) // 256).tolist() == freed
    s.release(1)  # aborted mid-block: its pages go back, slot 1's state rows stay stale
    s.extend([3], [_prompt(cfg, 40, 16)])  # reuses the SWA page again
    s.share_prefix(0, 1, 512)
    hit = s.extend([1], [a[512:]])
    torch.testing.assert_close(hit, miss[512:], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(hit, ref.forward(a).logits[512:], atol=1e-4, rtol=1e-4)
    s.release(1)
    # retraction: SGLang frees the request's KV and re-runs it later (here from scratch, in the freed slot 1)
    again = torch.cat([s.extend([1], [d[:60]]), s.decode([1], [int(d[60])]), s.extend([1], [d[61:]])])
    torch.testing.assert_close(again, ref.forward(d).logits, atol=1e-4, rtol=1e-4)
    _live_window_mapping_ok(s)


@pytest.mark.slow
def test_model_with_layers_on_kernels_equals_reference():
    """The tiny model end to end with SGLANG_ERNIE55_LAYER_IMPL=triton (mHC, routing, norms, RoPE on the
    Triton kernels, in Triton's CPU interpreter: a subprocess, tests/serving/layer_impl_check.py) and the
    backend's torch twin over an fp32 pool: chunked prefill crossing the compression block, 3 decode steps.
    Logits = the torch layers' and the reference's to 1e-4 (fp32; measured 5e-6), same greedy token at
    every position."""
    from tests.serving.test_layer_impl_cpu import run_check

    rep = run_check("model", "cpu")
    print(rep)
    for name in ("triton_vs_torch", "triton_vs_reference"):
        assert rep[name]["max_logit_diff"] <= 1e-4, rep
        assert rep[name]["top1_equal"] == rep["positions"], rep


def test_unimplemented_parallel_layouts_are_refused():
    """The layouts the model has not run are refused when it is built, each naming what runs instead: attention
    CP, attention DP with EP, MoE all-to-all backends. Attention DP builds at attention TP 1 and 2 (and above),
    with a DP LM head and with ECHO (tests/serving/test_server_tp_cpu.py, tests/echo/test_echo_server_cpu.py)."""
    from types import SimpleNamespace

    from sglang_ernie55.models.ernie55 import check_parallel_layout

    def par(tp=4, dp=1, cp=1, ep=1, dp_head=False):
        return SimpleNamespace(
            tp_size=tp, attn_dp_size=dp, attn_cp_size=cp, moe_ep_size=ep, enable_dp_lm_head=dp_head
        )

    check_parallel_layout(par())  # plain TP
    check_parallel_layout(par(dp=4))  # attention DP at attention TP 1
    check_parallel_layout(par(dp=2))  # attention DP at attention TP 2
    check_parallel_layout(par(dp=4, dp_head=True))  # the DP LM head, at attention TP 1
    check_parallel_layout(par(dp=2, dp_head=True))  # and at attention TP 2
    check_parallel_layout(par(dp=4), speculative=True)  # ECHO under attention DP at attention TP 1
    check_parallel_layout(par(ep=4), "none")  # EP with SGLang's standard dispatch
    for p in (par(cp=2), par(dp=2, cp=2)):
        with pytest.raises(NotImplementedError, match="context parallelism.*--attn-cp-size 2"):
            check_parallel_layout(p)
    for p, spec, what in (
        (par(dp=4, ep=4), False, r"expert parallelism \(--ep 4\)"),
        (par(dp=2), True, r"speculative decoding \(ECHO\) at attention TP 2"),
        (par(dp=2, ep=4, dp_head=True), True, r"expert parallelism \(--ep 4\) and speculative decoding"),
    ):
        with pytest.raises(
            NotImplementedError,
            match=rf"with {what}.*--tp 4 --attn-dp-size {p.attn_dp_size} without --ep and speculative decoding.*"
            r"ECHO at --tp 4 --attn-dp-size 4",
        ):
            check_parallel_layout(p, speculative=spec)
    with pytest.raises(
        NotImplementedError, match="a2a-backend deepep.*--moe-a2a-backend none: --tp 4 --ep 4"
    ):
        check_parallel_layout(par(ep=4), "deepep")


def test_attention_cp_runs_only_where_it_has_run():
    """Attention CP (SGLang's prefill split) builds at attention TP 1 on CPU without attention DP, EP and ECHO
    (what tests/serving/test_server_tp_cpu.py serves); every other CP layout is refused naming what is missing
    and the layout that runs (docs/serving-design.md section 8.2)."""
    from types import SimpleNamespace

    from sglang_ernie55.models.ernie55 import check_parallel_layout

    def par(tp=2, dp=1, cp=2, ep=1):
        return SimpleNamespace(
            tp_size=tp, attn_dp_size=dp, attn_cp_size=cp, moe_ep_size=ep, enable_dp_lm_head=False
        )

    check_parallel_layout(par(), device="cpu")
    for p, kw, what in (
        (par(), dict(device="cuda"), "--device cuda"),
        (par(tp=4), dict(device="cpu"), "attention TP 2"),
        (par(tp=4, dp=2), dict(device="cpu"), r"attention DP \(--attn-dp-size 2\)"),
        (par(ep=2), dict(device="cpu"), r"expert parallelism \(--ep 2\)"),
        (par(), dict(device="cpu", speculative=True), r"speculative decoding \(ECHO\)"),
    ):
        with pytest.raises(
            NotImplementedError, match=f"context parallelism with {what}.*--tp 2 --attn-cp-size 2 "
        ):
            check_parallel_layout(p, **kw)
    with pytest.raises(NotImplementedError, match="a2a-backend deepep"):
        check_parallel_layout(par(), "deepep", device="cpu")
