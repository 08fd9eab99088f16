"""HiCache over the ERNIE-5.5 pools on CPU (docs/kv-layout.md, "HiCache").

- Every buffer of `PoolLayout` but the open-block state (and the ECHO draft's rows) is mirrored, once, and
  pages round-trip device -> host -> other device pages bit for bit: bf16, fp8 and dense KV, three geometries
  (ratio 128 and 32, an MLA-DSA last layer for the draft), hybrid SWA and full-slot windows, the three host
  layouts. The copies are `Ernie55PagedHostPool`'s torch path, which a CPU server runs: SGLang's own transfer
  ops (sgl-kernel `kvcacheio`) need the CUDA driver to load; the GPU suite runs those
  (tests/serving/test_hicache_gpu.py).
- The ledger's strategy is the one SGLang picks for our pool, and only for it.
- A real `--device cpu` server with `--enable-hierarchical-cache --hicache-ratio 2` (slow; the scenario of
  tests/serving/hicache_harness.py): a prefix evicted from the device pool and loaded back from the host gives
  the same greedy tokens and logprobs as the device hit, and the reference's tokens; bf16 and fp8 KV, hybrid
  SWA and full-slot windows, ECHO, with the host-hit counts reported. `hicache_host_shim/` lets SGLang size
  host pools on a runner with less than 10 GiB free.
- The device bytes the pool sizing plans for SGLang's write-back staging (CUDA, `page_first`) are what the host
  pools allocate there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_ernie55.mem_cache.draft_pool import EchoDraftKVPool
from sglang_ernie55.mem_cache.host_pool import (
    Ernie55HiCacheStrategy,
    Ernie55PagedHostPool,
    host_page_counts,
    mirrored_regions,
)
from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool
from tests.echo import echo_checks
from tests.serving import hicache_harness as hh
from tests.serving import server_harness as sh
from tests.serving.geometries import VARIANTS
from tests.shim_lib.ernie55_shim_lib import shim_pythonpath

PAGE = 256
FULL_PAGES, SWA_PAGES = 6, 3
DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "float32": torch.float32}
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
GEOMETRIES = ("tiny", "w128_c32_r3_mla_first", "mla_last_no_shared")
SHIM = Path(__file__).parent / "hicache_host_shim"


def _config(name: str):
    return next(v for v in VARIANTS if v.name == name).config()


def _pools(geometry: str, kv: str, hybrid: bool):
    cfg = _config(geometry)
    swa = SWA_PAGES * PAGE if hybrid else None
    pool = Ernie55TokenToKVPool(
        FULL_PAGES * PAGE, PAGE, DTYPES[kv], cfg, num_req_slots=3, device="cpu", swa_size=swa
    )
    draft = EchoDraftKVPool(FULL_PAGES * PAGE, PAGE, DTYPES[kv], cfg, device="cpu", swa_size=swa)
    return cfg, pool, draft


def _slots(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * PAGE + torch.arange(PAGE)).flatten()


@pytest.mark.parametrize("hybrid", [True, False], ids=["swa", "full_slots"])
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3", "float32"])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_every_pool_buffer_but_the_state_is_mirrored_once(geometry, kv, hybrid):
    """The regions are exactly PoolLayout's buffers without the open-block state, plus the draft's rows; the
    window rows (and the draft's) follow SWA slots in hybrid mode, everything else full slots; a region's page
    p is the device tensor's page p (the compressed pool's page of full page p holds that page's blocks)."""
    cfg, pool, draft = _pools(geometry, kv, hybrid)
    regions = mirrored_regions(pool, draft)
    mirrored = [(r.name, lid) for r in regions for lid in r.layers]
    want = [
        (b.name, b.layer)
        for b in pool.layout.buffers(pool.size, pool.swa_size if hybrid else None, 3)
        if b.name != "state"
    ]
    assert sorted(mirrored) == sorted(want + [("draft", cfg.num_hidden_layers - 1)])
    window = "swa" if hybrid else "full"
    for r in regions:
        assert r.addressing == (window if r.name in ("window", "draft") else "full"), r.name
        for t in r.pages:
            assert t.dtype == torch.uint8 and t.dim() == 2 and t.is_contiguous()
            assert t.shape[1] == r.page_bytes
            # device pages cover the slot space: SWA (or full) pages + the padding page, and the compressed
            # pool's scratch entry page past them
            rows = {"swa": pool.swa_size, "full": pool.size}[r.addressing] // PAGE + 1
            assert t.shape[0] == rows + (r.name == "compressed"), (r.name, t.shape)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hybrid", [True, False], ids=["swa", "full_slots"])
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3", "float32"])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_pages_round_trip_device_host_device_bit_exactly(geometry, kv, hybrid, layout):
    """Random bytes in every mirrored buffer; pages 1, 3, 2 (any order) backed up to host pages 4, 0, 2, the
    device poisoned, then loaded layer by layer into device pages 2, 1, 3: each lands byte for byte, and no
    other device page is written."""
    _, pool, draft = _pools(geometry, kv, hybrid)
    g = torch.Generator().manual_seed(7)
    src, host_pages, dst = [1, 3, 2], [4, 0, 2], [2, 1, 3]
    for region in mirrored_regions(pool, draft):
        before = []
        for t in region.pages:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
            before.append(t.clone())
        host = Ernie55PagedHostPool(
            region, num_host_pages=5, slot_page_size=PAGE, layout=layout, allocator_type="default"
        )
        assert host.torch_io and host.page_aligned_only
        host.backup_from_device_all_layer(pool, _slots(host_pages), _slots(src), "kernel")
        for t in region.pages:
            t.fill_(0xA5)
        for layer in range(len(region.layers)):
            host.load_to_device_per_layer(pool, _slots(host_pages), _slots(dst), layer, "kernel")
        for t, old in zip(region.pages, before):
            assert torch.equal(t[dst], old[src]), (region.name, layout)
            rest = [p for p in range(t.shape[0]) if p not in dst]
            assert bool((t[rest] == 0xA5).all()), region.name


def test_decoded_rows_survive_the_round_trip():
    """Through the pool's own codec: rows written at one page read back identical at the page they were loaded
    into (fp8 window and compressed entries, latent + rope, indexer keys)."""
    cfg, pool, _ = _pools("tiny", "fp8_e4m3", hybrid=False)
    g = torch.Generator().manual_seed(1)
    loc, new = _slots([2]), _slots([4])
    stores = {"window": pool.win, "latent": pool.latent, "index": pool.index_k}
    for store in stores.values():
        for rows in store.values():
            rows.write(loc, torch.randn(PAGE, rows.width, generator=g))
    cmp_loc = loc[:: cfg.compress_ratio] // cfg.compress_ratio
    for rows in pool.cmp.values():
        rows.write(cmp_loc, torch.randn(len(cmp_loc), rows.width, generator=g))
    want = {n: {lid: r.read(loc) for lid, r in s.items()} for n, s in stores.items()}
    want_cmp = {lid: r.read(cmp_loc) for lid, r in pool.cmp.items()}
    for region in mirrored_regions(pool):
        host = Ernie55PagedHostPool(region, 2, PAGE, "page_first", "default")
        host.backup_from_device_all_layer(pool, _slots([1]), loc, "kernel")
        for layer in range(len(region.layers)):
            host.load_to_device_per_layer(pool, _slots([1]), new, layer, "kernel")
    for n, s in stores.items():
        for lid, r in s.items():
            assert torch.equal(r.read(new), want[n][lid]), (n, lid)
    new_cmp = new[:: cfg.compress_ratio] // cfg.compress_ratio
    for lid, r in pool.cmp.items():
        assert torch.equal(r.read(new_cmp), want_cmp[lid]), lid


def test_partial_or_scattered_pages_are_refused():
    _, pool, _ = _pools("tiny", "bfloat16", hybrid=False)
    region = mirrored_regions(pool)[0]
    host = Ernie55PagedHostPool(region, 3, PAGE, "layer_first", "default")
    with pytest.raises(ValueError, match="page-aligned"):
        host.backup_from_device_all_layer(pool, torch.arange(100), torch.arange(100), "kernel")
    shuffled = _slots([1]).flip(0)
    with pytest.raises(ValueError, match="not whole pages"):
        host.backup_from_device_all_layer(pool, _slots([0]), shuffled, "kernel")


def test_host_pages_follow_the_ratio():
    _, pool, _ = _pools("tiny", "bfloat16", hybrid=True)
    assert host_page_counts(pool, 2) == (2 * FULL_PAGES, 2 * SWA_PAGES)
    _, plain, _ = _pools("tiny", "bfloat16", hybrid=False)
    assert host_page_counts(plain, 1.5) == (9, 9)
    with pytest.raises(ValueError, match="--hicache-ratio"):
        host_page_counts(pool, 0.1)


@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("hybrid", [True, False], ids=["swa", "full_slots"])
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_planned_staging_is_what_the_host_pools_stage(monkeypatch, kv, hybrid, echo):
    """On a platform with SGLang's device HiCache kernels (CUDA), a `page_first` host pool allocates a
    write-back staging buffer beside the device pool after the KV pool was sized; `PoolLayout.
    hicache_staging_bytes`, which the pool sizing charges, equals the staging SGLang allocates for our host
    pools (here on CPU tensors, with the platform flag set), at small and large host page counts."""
    from types import SimpleNamespace

    import sglang.srt.mem_cache.memory_pool_host as host_module

    monkeypatch.setattr(
        host_module,
        "current_platform",
        SimpleNamespace(capabilities=SimpleNamespace(hicache_device_kernels=True)),
    )
    cfg, pool, draft = _pools("tiny", kv, hybrid)
    for ratio in (2, 30):
        full_pages, swa_pages = host_page_counts(pool, ratio)
        staged = 0
        for r in mirrored_regions(pool, draft if echo else None):
            pages = swa_pages if r.addressing == "swa" else full_pages
            host = Ernie55PagedHostPool(r, pages, PAGE, "page_first", "default")
            staged += host.staging_buffer.nbytes
        layout = type(pool.layout)(cfg, kv, echo=echo)
        assert layout.hicache_staging_bytes(pool.size, pool.swa_size if hybrid else None, ratio) == staged


def test_sglang_picks_our_strategy_for_our_pool_only():
    """The ledger registers the strategy ahead of SGLang's; it takes our pool with the tree components SGLang
    builds for it (FULL + SWA in hybrid mode, FULL without an SWA pool) and nothing else."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _select_strategy
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType as C

    from sglang_ernie55 import plugin

    plugin.register()
    _, hybrid, _ = _pools("tiny", "bfloat16", hybrid=True)
    _, plain, _ = _pools("tiny", "bfloat16", hybrid=False)
    assert isinstance(_select_strategy(hybrid, {C.FULL, C.SWA}), Ernie55HiCacheStrategy)
    assert isinstance(_select_strategy(plain, {C.FULL}), Ernie55HiCacheStrategy)
    s = Ernie55HiCacheStrategy()
    assert not s.matches(hybrid, {C.FULL}) and not s.matches(plain, {C.FULL, C.SWA})
    assert not s.matches(object(), {C.FULL})
    plugin.register()  # a second registration adds no second strategy
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _STRATEGIES

    assert sum(isinstance(x, Ernie55HiCacheStrategy) for x in _STRATEGIES) == 1


# ------------------------------------------------------------------ server arguments
@pytest.fixture(scope="module")
def ernie_config(tmp_path_factory) -> str:
    import json

    from sglang_ernie55.configuration import tiny_config

    path = tmp_path_factory.mktemp("ernie55")
    (path / "config.json").write_text(json.dumps(tiny_config().to_config_json()))
    return str(path)


def _resolve(model: str, *flags: str):
    from sglang_ernie55.args import resolve_server_args

    return resolve_server_args(["--model-path", model, *flags], device="cpu")


def test_hicache_flags_resolve_and_untried_tiers_are_refused(ernie_config):
    """`--enable-hierarchical-cache --hicache-ratio 2` resolves as given; an L3 storage backend and the
    buffer-only host mode are refused by name (they have not run on these pools); without HiCache they are
    not our concern (SGLang ignores them)."""
    from sglang_ernie55.args import Ernie55ArgumentError

    d = _resolve(ernie_config, "--enable-hierarchical-cache", "--hicache-ratio", "2").resolved_dict()
    assert d["enable_hierarchical_cache"] and d["hicache_ratio"] == 2
    with pytest.raises(Ernie55ArgumentError) as e:
        _resolve(ernie_config, "--enable-hierarchical-cache", "--hicache-storage-backend", "file")
    assert e.value.flag == "--hicache-storage-backend" and "host memory" in str(e.value)
    with pytest.raises(Ernie55ArgumentError) as e:
        _resolve(ernie_config, "--enable-hierarchical-cache", "--hicache-host-memory-mode", "buffer_only")
    assert e.value.flag == "--hicache-host-memory-mode" and e.value.legal == "cache"
    _resolve(ernie_config, "--hicache-storage-backend", "file")


# ------------------------------------------------------------------ the real CPU server
REGIONS = "kv+swa+deepseek_v4_c128+deepseek_v4_c1+indexer"
SERVER_CASES = {
    # name: (KV dtype, hybrid SWA, ECHO, the host pools the server must log)
    "bf16_swa": ("bfloat16", True, False, REGIONS),
    "fp8_swa": ("fp8_e4m3", True, False, REGIONS),
    "bf16_full_slots": (
        "bfloat16",
        False,
        False,
        "kv+deepseek_v4_c2+deepseek_v4_c128+deepseek_v4_c1+indexer",
    ),
    "bf16_echo": ("bfloat16", True, True, REGIONS + "+draft_swa"),
}
ECHO_SHIM = Path(__file__).parent / "hicache_echo_shim"
ECHO = echo_checks.spec_flags(2)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SERVER_CASES))
def test_cpu_server_host_hit_equals_device_hit(tmp_path, case):
    """hicache_harness's scenario on a `--device cpu` server (fp32 activations): A's pages loaded back from the
    host give the device hit's tokens and logprobs; every answer is the reference's (cached tensors rounded as
    the pool stores them). Hybrid SWA (window rows through SGLang's SWA component) in bf16 and fp8 KV, the
    full-slot window (`--disable-hybrid-swa-memory`), and ECHO (2 steps), whose draft rows get a host pool of
    their own (SGLang's EAGLE tree helpers through Triton's interpreter, as tests/echo/test_echo_server_cpu.py)."""
    from sglang_ernie55.checkpoint.tiny import make_checkpoint
    from sglang_ernie55.configuration import tiny_config

    kv, hybrid, echo, regions = SERVER_CASES[case]
    cfg = tiny_config()
    path = make_checkpoint(tmp_path / "bf16", dtype="bf16", seed=0)
    window = dict(swa_full_tokens_ratio=hh.SWA_RATIO) if hybrid else dict(disable_hybrid_swa_memory=True)
    shim = ECHO_SHIM if echo else SHIM
    env = {"PYTHONPATH": shim_pythonpath(shim)}
    if echo:
        env["TRITON_INTERPRET"] = "1"
    server = sh.Server(
        path,
        *sh.cpu_flags(kv_cache_dtype=kv, disable_cuda_graph=True, **window, **hh.FLAGS),
        *(ECHO if echo else ()),
        log_name=f"hicache-cpu-{case}",
        env=env,
        timeout=900,
    )
    try:
        result = hh.run(server, cfg)
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert f"hybrid_swa={hybrid}" in log
    reported = hh.hits(result)
    _, ref = sh.load_reference(path, "cpu")
    with sh.kv_rounded_reference(kv, cfg):
        s = sh.score(ref, result["prompts"], result["outs"], "cpu")
    print(f"\n[{case}] {reported}; vs the reference: {s.summary()}")
    sh.write_report(f"hicache_cpu_{case}", {"hits": reported, "summary": s.summary()})
    hh.check_host_hit(result, log, regions + ":")
    assert "io=torch" in log
    assert s.top1 == s.positions, (s.summary(), s.mismatches)
    assert s.max_lp_err <= 0.02, s.summary()
