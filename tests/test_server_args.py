"""ERNIE-5.5 server-argument rules, each through SGLang's real resolution (`prepare_server_args(argv)` then
`resolve_once()`, via `sglang_ernie55.args.resolve_server_args`) on CPU, with config-only checkpoints.

Resolution needs only config.json (no tokenizer, no weights). SGLang's import costs ~15 s once per
session; each resolution then takes ~50 ms. Every rule has a case that passes only with the rule in
place (the bad value resolves silently without it), and a control architecture (Qwen3-MoE) shows that
none of the rules fire for other models.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from sglang_ernie55.args import (
    Ernie55ArgumentError,
    flag_rules_markdown,
    resolve_server_args,
    write_config_checkpoint,
)
from sglang_ernie55.configuration import ARCH_MAIN, tiny_config

REPO = Path(__file__).resolve().parents[1]

QWEN3_MOE_TINY = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 1048576,
    "torch_dtype": "bfloat16",
}


def _write_checkpoint(path: Path, config: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return str(path)


@pytest.fixture(scope="module")
def ernie(tmp_path_factory) -> str:
    """A config-only tiny ERNIE-5.5 checkpoint (what SGLang's argument resolution reads)."""
    return _write_checkpoint(tmp_path_factory.mktemp("ernie55"), tiny_config().to_config_json())


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> str:
    """The control: a config-only tiny Qwen3-MoE checkpoint."""
    return _write_checkpoint(tmp_path_factory.mktemp("qwen3moe"), QWEN3_MOE_TINY)


def resolve(model: str, *flags: str):
    return resolve_server_args(["--model-path", model, *flags], device="cpu")


def resolved(model: str, *flags: str) -> dict:
    return resolve(model, *flags).resolved_dict()


def rejects(model: str, *flags: str) -> Ernie55ArgumentError:
    with pytest.raises(Ernie55ArgumentError) as info:
        resolve(model, *flags)
    return info.value


# ============================================================================================ defaults
def test_defaults_when_not_given(ernie):
    sa = resolve(ernie)
    d = sa.resolved_dict()
    assert (d["attention_backend"], d["page_size"], d["swa_full_tokens_ratio"], d["kv_cache_dtype"]) == (
        "ernie55",
        256,
        0.1,
        "fp8_e4m3",
    )
    # the raw fields keep what the user typed (nothing)
    assert (sa.attention_backend, sa.page_size, sa.swa_full_tokens_ratio, sa.kv_cache_dtype) == (
        None,
        None,
        None,
        "auto",
    )


def test_defaults_through_the_engine_path(ernie):
    """`sglang.Engine(**kwargs)` builds ServerArgs without argparse; the same overrides apply."""
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=ernie, device="cpu")
    sa.resolve_once()
    d = sa.resolved_dict()
    assert (d["attention_backend"], d["page_size"], d["kv_cache_dtype"]) == ("ernie55", 256, "fp8_e4m3")


def test_resolve_server_args_accepts_a_whole_command(ernie):
    d = resolve_server_args(["sglang", "serve", "--model-path", ernie, "--device", "cpu"]).resolved_dict()
    assert d["attention_backend"] == "ernie55"


def test_user_swa_ratio_is_kept(ernie):
    assert resolved(ernie, "--swa-full-tokens-ratio", "0.2")["swa_full_tokens_ratio"] == 0.2


@pytest.mark.parametrize("flags", [["--page-size", "256"], ["--attention-backend", "ernie55"]])
def test_the_models_own_values_are_accepted(ernie, flags):
    d = resolved(ernie, *flags)
    assert (d["attention_backend"], d["page_size"]) == ("ernie55", 256)


@pytest.mark.parametrize("page", ["1", "64", "128", "512"])
def test_other_page_size_is_an_error(ernie, page):
    e = rejects(ernie, "--page-size", page)
    assert "--page-size" in str(e) and page in str(e) and "256" in str(e) and "compressed HCA" in str(e)


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--attention-backend", "triton"),
        ("--attention-backend", "flashinfer"),
        ("--attention-backend", "dsv4"),
        ("--prefill-attention-backend", "fa3"),
        ("--decode-attention-backend", "triton"),
        ("--speculative-draft-attention-backend", "triton"),
    ],
)
def test_other_attention_backend_is_an_error(ernie, flag, value):
    extra = ["--speculative-algorithm", "EAGLE"] if flag.startswith("--speculative") else []
    e = rejects(ernie, *extra, flag, value)
    assert e.flag == flag and e.value == value and "ernie55" in str(e) and "HCA" in str(e)


# ============================================================================================ KV dtype
@pytest.mark.parametrize(
    "given,want,note",
    [
        (None, "fp8_e4m3", None),
        ("fp8_e4m3", "fp8_e4m3", None),
        ("bfloat16", "bfloat16", None),
        ("bf16", "bfloat16", "bf16 -> bfloat16"),
        ("auto", "fp8_e4m3", "vLLM's `auto` means BF16"),
    ],
)
def test_kv_cache_dtype_mapping(ernie, caplog, given, want, note):
    flags = [] if given is None else ["--kv-cache-dtype", given]
    with caplog.at_level(logging.INFO, logger="sglang_ernie55"):
        assert resolved(ernie, *flags)["kv_cache_dtype"] == want
    if note:
        assert note in caplog.text


@pytest.mark.parametrize("dtype", ["fp8_e5m2", "mxfp8", "nvfp4", "fp4_mx_block16"])
def test_other_kv_cache_dtype_is_an_error(ernie, dtype):
    e = rejects(ernie, "--kv-cache-dtype", dtype)
    assert e.flag == "--kv-cache-dtype" and e.value == dtype and e.legal == "fp8_e4m3, bfloat16"


def test_vllm_fp8_is_an_error_naming_the_legal_values(ernie):
    """`fp8` is not in SGLang's CLI choices (argparse exits); through Engine kwargs it reaches resolution."""
    from sglang.srt.server_args import ServerArgs

    with pytest.raises(SystemExit):
        resolve(ernie, "--kv-cache-dtype", "fp8")
    sa = ServerArgs(model_path=ernie, device="cpu", kv_cache_dtype="fp8")
    with pytest.raises(Ernie55ArgumentError) as info:
        sa.resolve_once()
    msg = str(info.value)
    assert "vLLM" in msg and "fp8_e4m3, bfloat16" in msg and "--kv-cache-dtype fp8_e4m3" in msg


def test_draft_kv_cache_dtype_follows_the_same_rule(ernie):
    spec = ["--speculative-algorithm", "EAGLE"]
    d = resolved(ernie, *spec, "--speculative-draft-kv-cache-dtype", "bf16")
    assert d["speculative_draft_kv_cache_dtype"] == "bfloat16"
    e = rejects(ernie, *spec, "--speculative-draft-kv-cache-dtype", "fp8_e5m2")
    assert e.flag == "--speculative-draft-kv-cache-dtype"


# ============================================================================================ attention TP
@pytest.mark.parametrize(
    "flags,attn_tp",
    [
        ([], 1),
        (["--tp", "8"], 8),
        (["--tp", "4", "--attn-dp-size", "4"], 1),
        (["--tp", "8", "--attn-dp-size", "2"], 4),
        (["--tp", "16", "--attn-dp-size", "2"], 8),  # BF16 on 2x8 H100
        (["--tp", "16", "--attn-cp-size", "2", "--enable-prefill-cp", "--cp-strategy", "interleave"], 8),
    ],
)
def test_legal_attention_tp(ernie, flags, attn_tp):
    d = resolved(ernie, *flags)
    assert d["tp_size"] // d["attn_dp_size"] // d["attn_cp_size"] == attn_tp


@pytest.mark.parametrize(
    "flags,computed,suggestion",
    [
        (["--tp", "16"], "= 16)", "--tp 16 --attn-dp-size 2 (attention TP 8)"),
        (["--tp", "6"], "= 6)", "--tp 8 (attention TP 8)"),
        (["--tp", "8", "--attn-dp-size", "3"], "= 2.66667)", "--tp 8 --attn-dp-size 2 (attention TP 4)"),
        (["--tp", "12", "--attn-cp-size", "2"], "= 6)", "--tp 16 --attn-cp-size 2 (attention TP 8)"),
        (["--tp", "32", "--attn-dp-size", "2"], "= 16)", "--tp 32 --attn-dp-size 4 (attention TP 8)"),
    ],
)
def test_attention_tp_must_divide_8(ernie, flags, computed, suggestion):
    msg = str(rejects(ernie, *flags))
    assert "attention TP" in msg and computed in msg and suggestion in msg and "8 groups" in msg


# ============================================================================================ attention CP
@pytest.mark.parametrize(
    "flags,flag,fix",
    [
        (
            ["--tp", "2", "--attn-cp-size", "2"],
            "--attn-cp-size",
            "Add --enable-prefill-cp --cp-strategy interleave",
        ),
        (
            ["--tp", "2", "--attn-cp-size", "2", "--enable-prefill-cp", "--cp-strategy", "zigzag"],
            "--cp-strategy",
            "Pass --cp-strategy interleave",
        ),
    ],
)
def test_attention_cp_needs_the_interleave_prefill_split(ernie, flags, flag, fix):
    """Without --enable-prefill-cp SGLang would run every CP rank's attention over every token (no split);
    with zigzag, a split this project has not run. The interleave split resolves."""
    e = rejects(ernie, *flags)
    assert e.flag == flag and fix in str(e)
    d = resolved(
        ernie, "--tp", "2", "--attn-cp-size", "2", "--enable-prefill-cp", "--cp-strategy", "interleave"
    )
    assert (d["attn_cp_size"], d["enable_prefill_cp"], d["cp_strategy"]) == (2, True, "interleave")


# ============================================================================================ MoE a2a
def test_deepep_needs_ep_4(ernie):
    e = rejects(ernie, "--tp", "2", "--moe-a2a-backend", "deepep")
    msg = str(e)
    assert "--ep >= 4" in msg and "per-rank expert limit" in msg and "256 of 512" in msg


def test_deepep_refuses_a_given_ep_below_4(ernie):
    """SGLang would silently run EP = --tp; the user asked for a layout this model cannot run."""
    e = rejects(ernie, "--tp", "8", "--ep", "2", "--moe-a2a-backend", "deepep")
    assert e.value == 2 and "SGLang would run EP = --tp = 8" in str(e)


@pytest.mark.parametrize(
    "flags,ep", [(["--tp", "4"], 4), (["--tp", "8"], 8), (["--tp", "8", "--ep", "4"], 8)]
)
def test_deepep_with_ep_4_or_more(ernie, flags, ep):
    d = resolved(ernie, *flags, "--moe-a2a-backend", "deepep")
    assert (d["moe_a2a_backend"], d["ep_size"]) == ("deepep", ep)


def test_a2a_backend_must_be_none_under_pp(ernie):
    e = rejects(ernie, "--tp", "4", "--pp-size", "2", "--moe-a2a-backend", "deepep")
    assert e.flag == "--moe-a2a-backend" and "none" in e.legal and "pipeline" in str(e)
    assert resolved(ernie, "--pp-size", "2")["moe_a2a_backend"] == "none"


# ============================================================================================ ECHO
def test_echo_defaults(ernie):
    d = resolved(ernie, "--speculative-algorithm", "EAGLE")
    assert (
        d["speculative_algorithm"],
        d["speculative_num_steps"],
        d["speculative_eagle_topk"],
        d["speculative_num_draft_tokens"],
    ) == ("EAGLE", 2, 1, 3)
    assert d["speculative_draft_model_path"] == ernie  # ECHO ships in the checkpoint


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("algo", ["EAGLE", "NEXTN", "nextn"])
def test_echo_steps_and_draft_tokens(ernie, algo, steps):
    d = resolved(ernie, "--speculative-algorithm", algo, "--speculative-num-steps", str(steps))
    assert (d["speculative_algorithm"], d["speculative_num_draft_tokens"], d["speculative_eagle_topk"]) == (
        "EAGLE",
        steps + 1,
        1,
    )


def test_echo_vendor_command_is_legal(ernie):
    d = resolved(
        ernie,
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        "2",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "3",
    )
    assert (d["speculative_num_steps"], d["speculative_num_draft_tokens"]) == (2, 3)


@pytest.mark.parametrize("topk", ["2", "4"])
def test_echo_topk_must_be_1(ernie, topk):
    e = rejects(
        ernie,
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        "2",
        "--speculative-eagle-topk",
        topk,
    )
    assert e.flag == "--speculative-eagle-topk" and "chain" in str(e)


@pytest.mark.parametrize("steps", ["4", "5"])
def test_echo_steps_1_to_3(ernie, steps):
    e = rejects(ernie, "--speculative-algorithm", "EAGLE", "--speculative-num-steps", steps)
    assert e.flag == "--speculative-num-steps" and e.legal == "1, 2, 3"


@pytest.mark.parametrize("steps,draft", [("2", "2"), ("2", "5"), ("3", "3"), (None, "2")])
def test_echo_draft_tokens_must_be_steps_plus_1(ernie, steps, draft):
    """SGLang alone silently resets draft tokens to steps + 1 (one token less than a vLLM user meant)."""
    flags = [
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        draft,
    ]
    if steps:
        flags += ["--speculative-num-steps", steps]
    e = rejects(ernie, *flags)
    assert e.flag == "--speculative-num-draft-tokens" and "num_speculative_tokens" in str(e)


def test_dspark_on_base_is_an_error(ernie):
    e = rejects(ernie, "--speculative-algorithm", "DSPARK", "--enable-dp-lm-head")
    assert e.value == "DSPARK" and "post-trained" in str(e) and "Base" in str(e)


@pytest.mark.parametrize("algo", ["NGRAM", "EAGLE3", "STANDALONE"])
def test_other_speculative_algorithms_are_errors(ernie, algo):
    assert rejects(ernie, "--speculative-algorithm", algo).legal == "EAGLE, NEXTN"


# ============================================================================================ parsers / hicache / context
@pytest.mark.parametrize(
    "flag,value", [("--reasoning-parser", "deepseek-r1"), ("--tool-call-parser", "qwen")]
)
def test_parsers_refused_on_base(ernie, monkeypatch, caplog, flag, value):
    monkeypatch.delenv("SGLANG_ERNIE55_ALLOW_PARSERS", raising=False)
    e = rejects(ernie, flag, value)
    assert e.flag == flag and "Base" in str(e) and "SGLANG_ERNIE55_ALLOW_PARSERS" in str(e)
    monkeypatch.setenv("SGLANG_ERNIE55_ALLOW_PARSERS", "1")
    with caplog.at_level(logging.WARNING, logger="sglang_ernie55"):
        resolve(ernie, flag, value)
    assert f"{flag} {value}" in caplog.text


def test_hicache_size_points_to_hicache_ratio(ernie):
    e = rejects(ernie, "--enable-hierarchical-cache", "--hicache-size", "100")
    assert e.flag == "--hicache-size" and "--hicache-ratio" in str(e)
    d = resolved(ernie, "--enable-hierarchical-cache", "--hicache-ratio", "2")
    assert d["hicache_ratio"] == 2


def test_long_context_warns_what_else_to_change(ernie, caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_ernie55"):
        resolve(ernie, "--context-length", "131072")
    assert "--context-length" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="sglang_ernie55"):
        d = resolved(ernie, "--context-length", "1048576")
    assert d["context_length"] == 1048576
    assert "--max-running-requests" in caplog.text and "--cuda-graph-max-bs-decode" in caplog.text


# ============================================================================================ vendor recipes
VENDOR_COMMANDS = {
    "4-GPU FP8 high throughput": "--tp 4 --attn-dp-size 4 --context-length 131072 --max-running-requests 256",
    "4-GPU FP8 low latency (ECHO, 2 steps)": "--tp 4 --context-length 131072 --max-running-requests 256 "
    "--speculative-algorithm EAGLE --speculative-num-steps 2 --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens 3",
    "B300 FP8": "--tp 2",
    "H100 FP8": "--tp 8",
    "H100 BF16 2x8": "--tp 16 --attn-dp-size 2 --kv-cache-dtype bfloat16",
    "DeepEP": "--tp 8 --ep 8 --moe-a2a-backend deepep",
    "HiCache": "--tp 4 --enable-hierarchical-cache --hicache-ratio 2",
}


@pytest.fixture(scope="module")
def ernie_full(tmp_path_factory) -> str:
    """The full-size ERNIE-5.5-Flash config.json (512 experts), as `write_config_checkpoint` writes it."""
    return write_config_checkpoint(tmp_path_factory.mktemp("ernie55-full"))


@pytest.mark.parametrize("command", VENDOR_COMMANDS.values(), ids=VENDOR_COMMANDS.keys())
def test_deployment_guide_commands_are_legal(ernie_full, command):
    d = resolve_server_args(
        ["sglang", "serve", "--model-path", ernie_full, *command.split()], device="cpu"
    ).resolved_dict()
    assert (d["attention_backend"], d["page_size"]) == ("ernie55", 256)
    assert d["kv_cache_dtype"] == ("bfloat16" if "bfloat16" in command else "fp8_e4m3")


def test_full_model_deepep_message(ernie_full):
    msg = str(rejects(ernie_full, "--tp", "2", "--moe-a2a-backend", "deepep"))
    assert "holds 256 of the 512 routed experts," in msg


@pytest.mark.parametrize("extra", [[], ["--speculative-algorithm", "EAGLE"]], ids=["plain", "echo"])
def test_deterministic_inference_keeps_ernie55_and_the_radix_cache(ernie, extra):
    """SGLang refuses --enable-deterministic-inference for backends outside its lists; ernie55 is batch
    invariant (fixed key splits) and prefix hits recompute nothing, so it joins both lists."""
    d = resolved(ernie, "--enable-deterministic-inference", *extra)
    assert d["enable_deterministic_inference"] and d["attention_backend"] == "ernie55"
    assert d["disable_radix_cache"] is False and d["sampling_backend"] == "pytorch"


# ============================================================================================ other architectures
def test_control_architecture_keeps_sglangs_defaults(qwen):
    d = resolved(qwen)
    assert (d["attention_backend"], d["page_size"], d["kv_cache_dtype"]) == ("torch_native", 1, "auto")


CONTROL_CASES = [
    ["--page-size", "64"],
    ["--attention-backend", "triton"],
    ["--kv-cache-dtype", "fp8_e5m2"],
    ["--kv-cache-dtype", "bf16"],
    ["--tp", "16"],
    ["--tp", "2", "--attn-cp-size", "2"],
    ["--tp", "2", "--moe-a2a-backend", "deepep"],
    ["--tp", "4", "--pp-size", "2", "--moe-a2a-backend", "deepep"],
    [
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        "2",
        "--speculative-eagle-topk",
        "4",
        "--speculative-num-draft-tokens",
        "8",
    ],
    [
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        "5",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "6",
    ],
    ["--speculative-algorithm", "NGRAM"],
    ["--speculative-algorithm", "DSPARK"],  # SGLang's own CPU error, not ours
    ["--reasoning-parser", "deepseek-r1"],
    ["--tool-call-parser", "qwen"],
    ["--enable-hierarchical-cache", "--hicache-size", "100"],
    ["--context-length", "1048576"],
]


@pytest.mark.parametrize("flags", CONTROL_CASES, ids=lambda f: " ".join(f))
def test_no_rule_fires_for_other_architectures(qwen, caplog, flags):
    with caplog.at_level(logging.INFO, logger="sglang_ernie55"):
        try:
            resolve(qwen, *flags)
        except Ernie55ArgumentError:
            pytest.fail(f"ERNIE-5.5 rule fired for Qwen3-MoE: {flags}")
        except (ValueError, AssertionError) as e:  # SGLang's own verdict on this model
            assert "ERNIE" not in str(e)
    assert "ERNIE" not in caplog.text


# ============================================================================================ plumbing
def test_registration_is_idempotent():
    from sglang.srt.arg_groups import model_override_base
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS, _OVERRIDABLE_HOOKS

    from sglang_ernie55 import patches, plugin
    from sglang_ernie55.args.overrides import ernie55_overrides

    plugin.register()
    plugin.register()
    patches.register()
    assert ATTENTION_BACKEND_CHOICES.count("ernie55") == 1
    assert model_override_base._MODEL_OVERRIDE_FNS[ARCH_MAIN].count(ernie55_overrides) == 1
    for row in patches.rows(patches.Kind.RESOLUTION):
        assert row.attr in _OVERRIDABLE_HOOKS
        assert _HOOKS[row.attr].count(row.function()) == 1


def test_compat_lists_every_hooked_symbol():
    from sglang_ernie55 import compat, patches

    compat.check_symbols()
    listed_paths = {(m, a) for m, a, _ in compat.REQUIRED_SYMBOLS}
    for row in patches.rows(patches.Kind.RESOLUTION, patches.Kind.AROUND):
        assert (row.module, row.attr) in listed_paths


def test_docs_table_matches_the_rules():
    doc = (REPO / "docs" / "server-args.md").read_text()
    assert flag_rules_markdown() in doc


def test_error_names_flag_value_legal_and_why_and_pickles(ernie):
    import pickle

    e = rejects(ernie, "--page-size", "64")
    assert isinstance(e, ValueError)
    assert str(e).startswith("ERNIE-5.5: --page-size 64: legal: 256. ERNIE-5.5's KV pools")
    assert str(pickle.loads(pickle.dumps(e))) == str(e)


# ============================================================================================ CUDA graphs
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_prefill_cuda_graph_off_by_default(ernie, qwen, device, caplog):
    """The ernie55 backend's prefill reads host-side lengths: SGLang's prefill CUDA graph is turned off for the
    model (decode graphs stay); other models keep SGLang's choice."""
    caplog.set_level(logging.INFO)
    graphs = resolve_server_args(["--model-path", ernie], device=device).resolved_dict()["cuda_graph_config"]
    assert graphs["prefill"]["backend"] == "disabled"
    assert graphs["decode"]["backend"] != "disabled"
    theirs = resolve_server_args(
        ["--model-path", qwen, "--cuda-graph-backend-prefill", "breakable"], device=device
    )
    assert theirs.resolved_dict()["cuda_graph_config"]["prefill"]["backend"] == "breakable"


def test_prefill_cuda_graph_asked_by_name_is_refused(ernie):
    e = rejects(ernie, "--cuda-graph-backend-prefill", "breakable")
    assert e.flag == "--cuda-graph-backend-prefill" and "disabled" in e.legal
    assert "--disable-prefill-cuda-graph" in str(e)
    # the legacy off switch is fine
    assert (
        resolved(ernie, "--disable-prefill-cuda-graph")["cuda_graph_config"]["prefill"]["backend"]
        == "disabled"
    )


def test_readme_flag_table_is_the_rules_table():
    assert flag_rules_markdown() in (REPO / "README.md").read_text()
