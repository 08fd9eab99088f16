"""The ECHO wiring through SGLang's real code on CPU: server-argument resolution -> draft ModelConfig ->
draft architecture, the n*H speculative hidden width, the draft attention backends and KV pool chosen for
the ECHO draft, the weight sharing done by the `EagleDraftWorker.init_lm_head` hook, and the invalid
ECHO flag combinations. Every hook is shown to fall through for another architecture."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_ernie55.configuration import ARCH_ECHO, ARCH_MAIN, tiny_config

LLAMA_TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


POOL_HOOKS = "sglang_ernie55.mem_cache"
POOL_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool"


def _write(path: Path, config: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return str(path)


def _unpatch(target: str) -> None:
    """Restore a target HookRegistry already patched (in this test process, before the ECHO hooks were
    registered) to SGLang's original, so that apply_hooks() re-applies all of its hooks, ours included. In a
    server every hook is registered before the one apply_hooks() of plugin loading."""
    import pkgutil

    from sglang.srt.plugins import hook_registry
    from sglang.srt.plugins.hook_registry import HookRegistry

    if target not in HookRegistry._patched:
        return
    obj_path, attr = target.rsplit(".", 1)
    obj = pkgutil.resolve_name(obj_path)
    fn = obj.__dict__[attr] if isinstance(obj, type) else getattr(obj, attr)
    raw = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
    # peel HookRegistry's wrappers only: SGLang's own decorators (functools.lru_cache) also set __wrapped__
    while getattr(getattr(raw, "__code__", None), "co_filename", None) == hook_registry.__file__:
        raw = raw.__wrapped__
    setattr(obj, attr, type(fn)(raw) if isinstance(fn, (classmethod, staticmethod)) else raw)
    HookRegistry._patched.discard(target)


@pytest.fixture(scope="module")
def hooks():
    """The plugin as SGLang loads it (the whole patch ledger), applied to SGLang (process-wide). Returns the
    module of the ECHO hooks; the pool hook is `sglang_ernie55.mem_cache`'s."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_ernie55 import patches, plugin, speculative

    plugin.register()
    for row in patches.rows(patches.Kind.AROUND, patches.Kind.AFTER):
        _unpatch(row.dotted)
    HookRegistry.apply_hooks()
    return speculative


@pytest.fixture(scope="module")
def ernie(tmp_path_factory) -> str:
    return _write(tmp_path_factory.mktemp("ernie55"), tiny_config().to_config_json())


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return _write(tmp_path_factory.mktemp("llama"), LLAMA_TINY)


def _model_config(path: str, draft: bool, algo: str | None = "EAGLE"):
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(model_path=path, is_draft_model=draft, speculative_algorithm=algo)


def test_hooks_are_in_the_patch_ledger_and_compat(hooks):
    """Every ECHO hook (and the two pool hooks, which size and build the draft's pool too) is a ledger row:
    checked by compat at plugin load and documented in docs/hooks.md."""
    from sglang_ernie55 import compat, patches

    ledger = (Path(__file__).resolve().parents[2] / "docs" / "hooks.md").read_text()
    rows = [row for row in patches.LEDGER if row.ours_module() in ("sglang_ernie55.speculative", POOL_HOOKS)]
    assert len(rows) == 9
    required = {(m, a) for m, a, _ in compat.REQUIRED_SYMBOLS}
    for row in rows:
        assert (row.module, row.attr) in required, f"{row.target} missing from compat.REQUIRED_SYMBOLS"
        assert f"### `{row.target}`" in ledger, f"{row.target} not in docs/hooks.md"
        assert row.function().__module__ == row.ours_module()
    compat.check_symbols([(row.module, row.attr, row.params) for row in rows])


def test_draft_arch_and_spec_hidden_size_through_model_config(hooks, ernie):
    cfg = tiny_config()
    target = _model_config(ernie, draft=False)
    draft = _model_config(ernie, draft=True)
    assert target.hf_config.architectures == [ARCH_MAIN]
    assert draft.hf_config.architectures == [ARCH_ECHO]
    nh = cfg.hc_mult * cfg.hidden_size
    assert target.spec_hidden_size == draft.spec_hidden_size == nh
    assert draft.hc_hidden_size is None  # PP width untouched (PP is refused for this model)
    assert _model_config(ernie, draft=True, algo="DSPARK").hf_config.architectures == [ARCH_MAIN]


def test_hooks_fall_through_for_other_models(hooks, llama):
    d = _model_config(llama, draft=True)
    assert d.hf_config.architectures == ["LlamaForCausalLM"]
    assert d.spec_hidden_size == LLAMA_TINY["hidden_size"]
    stub = SimpleNamespace(
        draft_model_runner=SimpleNamespace(model_config=d), speculative_num_steps=3, topk=1
    )
    assert hooks.around_create_decode_backend(lambda self: "sglang's", stub) == "sglang's"
    assert hooks.around_create_draft_extend_backend(lambda self: "sglang's", stub) == "sglang's"


def test_one_pool_hook_for_target_and_draft(hooks):
    """`_build_token_to_kv_pool` carries one hook (no nesting, no "Multiple AROUND hooks" warning): it answers
    the ECHO draft worker and the ERNIE-5.5 target (test_draft_pool_hook_builds_the_echo_pool,
    test_target_pool_and_sizing_under_speculation), refuses an ERNIE-5.5 draft that is not ECHO, and hands
    every other model, target or draft, to SGLang."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_ernie55.mem_cache import around_build_token_to_kv_pool

    (only,) = HookRegistry._hooks[POOL_TARGET]
    assert only[1] is around_build_token_to_kv_pool

    def sglang(self, *, sizes, req_to_token_pool):
        return "sglang's"

    llama = SimpleNamespace(hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]))
    for draft in (True, False):
        kvc = SimpleNamespace(is_draft_worker=draft, model_config=llama)
        assert around_build_token_to_kv_pool(sglang, kvc, sizes=None, req_to_token_pool=None) == "sglang's"
    kvc = SimpleNamespace(is_draft_worker=True, model_config=SimpleNamespace(hf_config=tiny_config()))
    with pytest.raises(NotImplementedError, match=ARCH_MAIN):
        around_build_token_to_kv_pool(sglang, kvc, sizes=None, req_to_token_pool=None)


def test_server_args_to_draft_model_config(hooks, ernie):
    """`--speculative-algorithm NEXTN` (SGLang's alias) with no draft path: resolution defaults the draft
    path to the model path, and SGLang's draft ModelConfig built from the resolved args is ECHO."""
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_ernie55.args import resolve_server_args

    sa = resolve_server_args(
        ["--model-path", ernie, "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3"],
        device="cpu",
    )
    d = sa.resolved_dict()
    assert d["speculative_draft_model_path"] == ernie
    assert (d["speculative_num_steps"], d["speculative_eagle_topk"], d["speculative_num_draft_tokens"]) == (
        3,
        1,
        4,
    )
    mc = ModelConfig.from_server_args(sa, model_path=d["speculative_draft_model_path"], is_draft_model=True)
    assert mc.hf_config.architectures == [ARCH_ECHO]


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "2"], "topk"),
        (
            [
                "--speculative-algorithm",
                "EAGLE",
                "--speculative-num-steps",
                "2",
                "--speculative-num-draft-tokens",
                "2",
            ],
            "draft-tokens",
        ),
        (["--speculative-algorithm", "DSPARK"], "DSpark|DSPARK"),
        (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "4"], "num-steps"),
    ],
)
def test_invalid_echo_flags_fail(hooks, ernie, flags, match):
    from sglang_ernie55.args import Ernie55ArgumentError, resolve_server_args

    with pytest.raises(Ernie55ArgumentError, match=match):
        resolve_server_args(["--model-path", ernie, *flags], device="cpu")


def _draft_runner(cfg, pool):
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=cfg),
        token_to_kv_pool=pool,
        draft_attention_backend=None,
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(4, 512, dtype=torch.int32)),
    )


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_draft_backend_factory_gives_echo_backends(hooks, steps):
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    from sglang_ernie55.attention.draft_backend import EchoDraftAttnBackend, EchoMultiStepDraftBackend
    from sglang_ernie55.mem_cache.draft_pool import EchoDraftKVPool

    cfg = tiny_config(architectures=[ARCH_ECHO])
    runner = _draft_runner(cfg, EchoDraftKVPool(1024, 256, torch.bfloat16, cfg, device="cpu"))
    f = DraftBackendFactory(runner, 1, steps)
    dec = f.create_decode_backend()
    if steps == 1:
        assert dec is None
    else:
        assert isinstance(dec, EchoMultiStepDraftBackend) and len(dec.attn_backends) == steps - 1
        assert all(isinstance(b, EchoDraftAttnBackend) for b in dec.attn_backends)
    assert isinstance(f.create_draft_extend_backend(), EchoDraftAttnBackend)
    with pytest.raises(ValueError, match="topk"):
        DraftBackendFactory(runner, 2, 3).create_decode_backend()


def test_draft_pool_hook_builds_the_echo_pool(hooks, monkeypatch):
    """The patched `KVCacheConfigurator._build_token_to_kv_pool` answers the ECHO draft worker with the
    window-only pool (one layer: the target's last, sized by the shared slot space)."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    from sglang_ernie55.mem_cache.draft_pool import EchoDraftKVPool, echo_bytes_per_token

    monkeypatch.setattr(
        "sglang.srt.runtime_context.get_exec",
        lambda: SimpleNamespace(features=SimpleNamespace(enable_memory_saver=False)),
    )
    cfg = tiny_config(architectures=[ARCH_ECHO])
    for hybrid, rows in ((False, 2048 + 256), (True, 512 + 256)):  # hybrid SWA: rows at the SWA pool's size
        kvc = SimpleNamespace(
            is_draft_worker=True,
            model_config=SimpleNamespace(hf_config=cfg),
            pool_page_size=256,
            kv_cache_dtype=torch.bfloat16,
            device="cpu",
            is_hybrid_swa=hybrid,
        )
        sizes = SimpleNamespace(max_total_num_tokens=2048, swa_max_total_num_tokens=512 if hybrid else None)
        pool = KVCacheConfigurator._build_token_to_kv_pool(
            kvc, sizes=sizes, is_dsa_model=False, is_dsv4_model=False, req_to_token_pool=None
        )
        assert isinstance(pool, EchoDraftKVPool) and pool.is_hybrid_swa == hybrid
        assert pool.layer_id == cfg.num_hidden_layers - 1 and pool.token_rows == rows
        assert pool.get_kv_size_bytes() == rows * echo_bytes_per_token(cfg, torch.bfloat16)


def test_init_lm_head_hook_shares_the_targets_modules(hooks):
    """SGLang's own `EagleDraftWorker.init_lm_head` (patched) on a draft and a target built from SGLang
    layers: afterwards the draft runs the target's last layer, hc_head, embedding and lm_head."""
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_ernie55.models.ernie55_echo import Ernie5_5MoeMTPModel
    from tests.serving import twin_harness as th

    cfg = tiny_config()
    target = th.build_model(cfg)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        draft = Ernie5_5MoeMTPModel(cfg)
    finally:
        torch.set_default_dtype(prev)
    stub = SimpleNamespace(
        speculative_algorithm=SpeculativeAlgorithm.EAGLE,
        hot_token_id=None,
        draft_runner=SimpleNamespace(model=draft),
        target_worker=SimpleNamespace(
            model_runner=SimpleNamespace(
                model=target,
                model_config=SimpleNamespace(model_path="unused", revision=None),
                load_config=None,
            )
        ),
    )
    stub._resolve_shared_embed_and_head = lambda: EagleDraftWorker._resolve_shared_embed_and_head(stub)
    assert not draft.attached
    EagleDraftWorker.init_lm_head(stub)
    assert draft.attached and draft.decoder_layer is target.model.layers[-1]
    assert draft.hc_head is target.model.hc_head and draft.lm_head is target.lm_head
    e, h = draft.get_embed_and_head()
    assert e.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert h.data_ptr() == target.lm_head.weight.data_ptr()


def test_draft_runner_backend_is_the_echo_backend(hooks):
    """The draft ModelRunner's own backend (built from the name `ernie55`) is the ECHO draft backend;
    a target runner falls through."""
    from sglang.srt.model_executor.model_runner_components import attention_backend_setup as abs_

    from sglang_ernie55.attention.draft_backend import EchoDraftAttnBackend
    from sglang_ernie55.mem_cache.draft_pool import EchoDraftKVPool

    cfg = tiny_config(architectures=[ARCH_ECHO])
    runner = _draft_runner(cfg, EchoDraftKVPool(1024, 256, torch.bfloat16, cfg, device="cpu"))
    runner.is_draft_worker = True
    assert isinstance(
        abs_._build_resolved_backend(model_runner=runner, resolved=None, init_new_workspace=False),
        EchoDraftAttnBackend,
    )
    target = SimpleNamespace(is_draft_worker=False, model_config=SimpleNamespace(hf_config=tiny_config()))
    got = hooks.around_build_resolved_backend(
        lambda **kw: "sglang's", model_runner=target, resolved=None, init_new_workspace=False
    )
    assert got == "sglang's"


@pytest.mark.parametrize("algo", ["NONE", "EAGLE"])
def test_target_pool_and_sizing_under_speculation(hooks, monkeypatch, algo):
    """The patched configurator factory and target-pool builder (SGLang's own entry points) for an ERNIE-5.5
    target (hybrid SWA): with EAGLE the budget reserves the ECHO draft's row per SWA token and the pool keeps the
    two-block open-block state ring (rejected drafts); without speculation neither."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor import pool_configurator as pc
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_ernie55.mem_cache.draft_pool import echo_bytes_per_token
    from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool

    monkeypatch.setattr(
        "sglang.srt.runtime_context.get_exec",
        lambda: SimpleNamespace(features=SimpleNamespace(enable_memory_saver=False)),
    )
    monkeypatch.setattr(
        "sglang.srt.runtime_context.get_schedule",
        lambda: SimpleNamespace(max_running_requests=4, swa_full_tokens_ratio=0.5),
    )
    monkeypatch.setattr(
        "sglang.srt.runtime_context.get_disagg",
        lambda: SimpleNamespace(disaggregation_mode="null", disaggregation_decode_extra_slots=0),
    )
    monkeypatch.setattr(
        "sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len", lambda: 8
    )
    cfg = tiny_config()
    spec = SpeculativeAlgorithm.from_string(algo)
    kvc = SimpleNamespace(
        is_draft_worker=False,
        model_config=SimpleNamespace(hf_config=cfg, context_len=2048),
        resolve_max_num_reqs=lambda n: 4,
        pool_page_size=256,
        kv_cache_dtype=torch.bfloat16,
        kv_cache_dtype_str="bfloat16",
        device="cpu",
        spec_algorithm=spec,
        is_hybrid_swa=True,
        sliding_window_size=cfg.window_size,
    )
    conf = pc.create_memory_pool_configurator(kvc)
    assert type(conf).__name__ == "Ernie55PoolConfigurator"
    speculating = algo == "EAGLE"
    assert conf.layout.draft_row == (echo_bytes_per_token(cfg, torch.bfloat16) if speculating else 0)
    blocks = 2 if speculating else 1
    assert (
        conf.layout.state_per_slot == 3 * blocks * cfg.compress_ratio * 2 * cfg.head_dim * 4
    )  # 3 HCA layers
    sizes = SimpleNamespace(
        max_total_num_tokens=1024, full_max_total_num_tokens=1024, swa_max_total_num_tokens=512
    )
    pool = KVCacheConfigurator._build_token_to_kv_pool(
        kvc,
        sizes=sizes,
        is_dsa_model=False,
        is_dsv4_model=False,
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(4, 1024, dtype=torch.int32)),
    )
    assert isinstance(pool, Ernie55TokenToKVPool) and pool.state_ring == blocks * cfg.compress_ratio
    assert pool.is_hybrid_swa and pool.window_rows == 512 + 256


# ------------------------------------------------------------------ draft-extend CUDA graph (the capture hook)
class _RunnerStub:
    """Stands in for `EAGLEDraftExtendCudaGraphRunner` (whose construction is the capture)."""

    made: list = []

    def __init__(self, eagle_worker, **kwargs):
        self.eagle_worker = eagle_worker
        _RunnerStub.made.append(eagle_worker)


@pytest.fixture
def capture_env(hooks, monkeypatch):
    """SGLang's real, hooked `EagleDraftWorker._capture_cuda_graphs` made to run its CUDA branch on this CPU
    host: `_is_cuda` on, graph config / batch sizes / memory probes / rank-0 logging answered, the runner class a recording
    stub, and the two CUDA-only attention modules its allow-list imports (flash-attn, FlashMLA: their
    libraries need a GPU) stand-in modules. Returns a factory of stand-in draft workers."""
    import types

    from sglang.srt.speculative import eagle_worker_v2 as ew2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_ernie55.attention.draft_backend import EchoDraftAttnBackend
    from sglang_ernie55.mem_cache.draft_pool import EchoDraftKVPool

    for name, cls in (
        ("flashattention_backend", "FlashAttentionBackend"),
        ("flashmla_backend", "FlashMLABackend"),
    ):
        mod = types.ModuleType(f"sglang.srt.layers.attention.{name}")
        setattr(mod, cls, type(cls, (), {}))
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(ew2, "_is_cpu", False)
    monkeypatch.setattr(ew2, "_is_cuda", True)
    monkeypatch.setattr(ew2, "_is_hip", False)
    monkeypatch.setattr(ew2, "check_cuda_graph_backend", lambda phase, backend: False)
    monkeypatch.setattr(ew2, "get_model", lambda: SimpleNamespace(model_impl="auto"))
    monkeypatch.setattr(
        ew2,
        "get_exec",
        lambda: SimpleNamespace(
            graph=SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend="full")))
        ),
    )
    monkeypatch.setattr(ew2, "get_batch_sizes_to_capture", lambda runner, *a, **k: ([1, 2, 4], []))
    monkeypatch.setattr(ew2, "get_available_gpu_memory", lambda *a, **k: 10.0)
    # SGLang logs these on TP rank 0 of an initialized group only; this process has none
    monkeypatch.setattr(ew2, "log_info_on_rank0", lambda logger, msg: logger.info(msg))
    monkeypatch.setattr(ew2, "EAGLEDraftExtendCudaGraphRunner", _RunnerStub)
    monkeypatch.delenv("SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH", raising=False)
    _RunnerStub.made = []

    def worker(arch: str, backend: str = "echo", device: str = "cuda"):
        if arch == "echo":
            cfg = tiny_config(architectures=[ARCH_ECHO])
        else:
            cfg = SimpleNamespace(architectures=["LlamaForCausalLM"])
        pool = EchoDraftKVPool(1024, 256, torch.bfloat16, tiny_config(), device="cpu")
        runner = _draft_runner(cfg, pool)
        if backend == "echo":  # built over an ECHO runner (also when handed to another draft, as a control)
            be = EchoDraftAttnBackend(_draft_runner(tiny_config(architectures=[ARCH_ECHO]), pool))
        elif backend == "triton":  # in SGLang's allow-list
            from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

            be = object.__new__(TritonAttnBackend)
        else:
            be = object()  # a backend SGLang does not capture the draft extend for
        return SimpleNamespace(
            draft_runner=runner,
            draft_extend_attn_backend=be,
            draft_attn_backend=None,
            speculative_num_steps=1,
            speculative_num_draft_tokens=2,
            topk=1,
            speculative_algorithm=SpeculativeAlgorithm.EAGLE,
            target_worker=SimpleNamespace(device=device),
            device=device,
            gpu_id=0,
            _specialized_graph_memory_usage={},
            _specialized_graph_time_usage={},
        )

    return worker


def test_capture_hook_adds_the_draft_extend_graph_for_echo_only(capture_env, caplog):
    """Through SGLang's own (hooked) `_capture_cuda_graphs`: SGLang leaves the ECHO draft without a draft-extend
    runner (its backend is not in the isinstance allow-list) and the hook builds SGLang's runner for it, with
    SGLang's log lines and accounting; a Llama draft on an allow-listed backend gets SGLang's runner from SGLang
    itself (built once, the hook adds nothing); a Llama draft on another backend gets none."""
    import logging

    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    caplog.set_level(logging.INFO)
    echo = capture_env("echo")
    EagleDraftWorker._capture_cuda_graphs(echo)
    assert _RunnerStub.made == [echo] and isinstance(echo.cuda_graph_runner_for_draft_extend, _RunnerStub)
    assert echo.cuda_graph_runner is None  # one step: no draft-decode graph (SGLang's rule, untouched)
    assert (
        "draft_extend" in echo._specialized_graph_memory_usage
        and "draft_extend" in echo._specialized_graph_time_usage
    )
    text = caplog.text
    assert "Capture draft extend CUDA graph begin. backend=full, num_tokens_per_req=2, bs=[1, 2, 4]" in text
    assert (
        "Capture draft extend CUDA graph end." in text
        and "ECHO draft: draft-extend CUDA graph captured" in text
    )

    caplog.clear()
    _RunnerStub.made = []
    llama = capture_env("llama", backend="triton")
    EagleDraftWorker._capture_cuda_graphs(llama)
    assert _RunnerStub.made == [llama]  # SGLang's own choice, exactly once
    assert "ECHO draft" not in caplog.text and caplog.text.count("Capture draft extend CUDA graph begin") == 1

    _RunnerStub.made = []
    for w in (capture_env("llama", backend="other"), capture_env("llama", backend="echo")):
        EagleDraftWorker._capture_cuda_graphs(w)
        assert w.cuda_graph_runner_for_draft_extend is None
    assert _RunnerStub.made == []


@pytest.mark.parametrize(
    "why", ["graphs-off", "env-off", "cpu", "mindspore", "not-cuda", "other-backend", "oot"]
)
def test_capture_hook_follows_sglangs_conditions(capture_env, monkeypatch, why):
    """No draft-extend graph for ECHO wherever SGLang captures none for its listed backends either (CUDA
    graphs off, SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH, CPU, MindSpore, a non-CUDA device), nor for a draft
    runner whose draft-extend backend is not the ECHO one, nor on an out-of-tree platform (which picks its
    runner through `get_speculative_graph_runner_cls`)."""
    from sglang.srt.speculative import eagle_worker_v2 as ew2

    from sglang_ernie55 import speculative

    w = capture_env(
        "echo",
        backend="other" if why == "other-backend" else "echo",
        device="xpu" if why == "not-cuda" else "cuda",
    )
    assert speculative.echo_draft_extend_graph_wanted(capture_env("echo"))
    if why == "graphs-off":
        monkeypatch.setattr(ew2, "check_cuda_graph_backend", lambda phase, backend: True)
    elif why == "env-off":
        monkeypatch.setenv("SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH", "1")
    elif why == "cpu":
        monkeypatch.setattr(ew2, "_is_cpu", True)
    elif why == "mindspore":
        monkeypatch.setattr(ew2, "get_model", lambda: SimpleNamespace(model_impl="mindspore"))
    assert not speculative.echo_draft_extend_graph_wanted(w) or why == "oot"
    if why == "oot":  # only the hook's decision: SGLang's body asks the platform for its runner then
        monkeypatch.setattr(ew2.current_platform, "is_out_of_tree", lambda: True)
        assert not speculative.echo_draft_extend_graph_wanted(w)
        return
    ew2.EagleDraftWorker._capture_cuda_graphs(w)
    assert w.cuda_graph_runner_for_draft_extend is None and _RunnerStub.made == []


def test_capture_hook_keeps_a_runner_sglang_chose(hooks):
    """When SGLang's capture already produced a draft-extend runner (e.g. an out-of-tree platform's), the hook
    keeps it: it only fills SGLang's None."""
    theirs = object()

    def original(self):
        self.cuda_graph_runner_for_draft_extend = theirs
        return "done"

    w = SimpleNamespace(
        draft_runner=SimpleNamespace(
            model_config=SimpleNamespace(hf_config=tiny_config(architectures=[ARCH_ECHO]))
        )
    )
    assert hooks.around_capture_cuda_graphs(original, w) == "done"
    assert w.cuda_graph_runner_for_draft_extend is theirs
