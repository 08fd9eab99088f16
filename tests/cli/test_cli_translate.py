"""`sglang-ernie55 translate`: every row of SERVING.md's "Flags that do not carry over" table, errors for
what has no equivalent, and every successful translation checked by SGLang's strict parser and by the
full resolution with this plugin's rules."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest

from sglang_ernie55.cli.translate import TranslateError, translate

BASE = "baidu/ERNIE-5.5-Flash-Base"
POST = "baidu/ERNIE-5.5-Flash"  # the (unreleased) post-trained model's name


def tr(cmd: str):
    return translate(shlex.split(cmd))


def flags(t) -> dict[str, str | None]:
    out, i = {}, 0
    while i < len(t.argv):
        if i + 1 < len(t.argv) and not t.argv[i + 1].startswith("--"):
            out[t.argv[i]] = t.argv[i + 1]
            i += 2
        else:
            out[t.argv[i]] = None
            i += 1
    return out


def notes(t) -> str:
    return "\n".join(t.notes)


@pytest.fixture(scope="module")
def strict_parser():
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    ServerArgs.add_cli_args(p)
    return p


# ------------------------------------------------------------------------------------------ table rows
def test_row_launch():
    t = tr(f"vllm serve {BASE}")
    assert t.argv[:2] == ["--model-path", BASE] and t.command.startswith(f"sglang serve --model-path {BASE}")
    assert tr(f"python -m vllm.entrypoints.openai.api_server --model {BASE}").argv[:2] == [
        "--model-path",
        BASE,
    ]
    assert tr(f'"vllm serve {BASE} -tp 4"').argv[:2] == ["--model-path", BASE]  # one quoted string


def test_row_port():
    t = tr(f"vllm serve {BASE}")
    assert "--port" not in t.argv and "8000" in notes(t) and "30000" in notes(t)
    assert flags(tr(f"vllm serve {BASE} --port 8000"))["--port"] == "8000"


def test_row_context_and_concurrency():
    f = flags(tr(f"vllm serve {BASE} --max-model-len 262144 --max-num-seqs 64"))
    assert f["--context-length"] == "262144" and f["--max-running-requests"] == "64"
    assert "--max-model-len" not in f and "--max-num-seqs" not in f
    assert (
        flags(tr(f"vllm serve {BASE} --max_model_len=4096"))["--context-length"] == "4096"
    )  # vLLM's spellings


def test_row_parsers():
    t = tr(f"vllm serve {BASE} --reasoning-parser ernie5 --tool-call-parser ernie5 --enable-auto-tool-choice")
    assert "--reasoning-parser" not in t.argv and "--tool-call-parser" not in t.argv and not t.errors
    assert "Base" in notes(t) and "SGLANG_ERNIE55_ALLOW_PARSERS" in notes(t)
    post = flags(tr(f"vllm serve {POST} --reasoning-parser ernie5 --tool-call-parser ernie5"))
    assert post["--reasoning-parser"] == "ernie55" and post["--tool-call-parser"] == "ernie55"
    assert tr(f"vllm serve {POST} --reasoning-parser qwen3").errors


@pytest.mark.parametrize("k", [1, 2, 3])
def test_row_speculative(k):
    t = tr(f"""vllm serve {BASE} --speculative-config '{{"method":"mtp","num_speculative_tokens":{k}}}'""")
    f = flags(t)
    assert (
        f["--speculative-algorithm"],
        f["--speculative-num-steps"],
        f["--speculative-eagle-topk"],
        f["--speculative-num-draft-tokens"],
    ) == ("EAGLE", str(k), "1", str(k + 1))
    assert "one token less" in notes(t)


@pytest.mark.parametrize(
    "config, match",
    [
        ('{"method":"mtp","num_speculative_tokens":4}', "1, 2 or 3"),
        ('{"method":"dspark","num_speculative_tokens":2}', "post-trained"),
        ('{"method":"ngram","num_speculative_tokens":2}', "no SGLang equivalent"),
        ("{method: mtp}", "not JSON"),
    ],
)
def test_row_speculative_errors(config, match):
    t = translate(["vllm", "serve", BASE, "--speculative-config", config])
    assert any(match in e for e in t.errors)


def test_row_kv_dtype():
    assert flags(tr(f"vllm serve {BASE} --kv-cache-dtype fp8"))["--kv-cache-dtype"] == "fp8_e4m3"
    auto = tr(f"vllm serve {BASE} --kv-cache-dtype auto")
    assert flags(auto)["--kv-cache-dtype"] == "bfloat16" and "illegal" in notes(auto)
    none = tr(f"vllm serve {BASE}")
    assert "--kv-cache-dtype" not in none.argv and "fp8_e4m3" in notes(none) and "BF16" in notes(none)
    assert tr(f"vllm serve {BASE} --kv-cache-dtype fp8_e5m2").errors


def test_row_kv_offload():
    cfg = '{"kv_connector":"SimpleCPUOffloadConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":100000000000}}'
    t = translate(["vllm", "serve", BASE, "--kv-transfer-config", cfg])
    f = flags(t)
    assert "--enable-hierarchical-cache" in f and f["--hicache-ratio"] == "2" and "--hicache-size" not in f
    assert "100000000000" in notes(t) and "ratio" in notes(t)


@pytest.mark.parametrize("role, mode", [("kv_producer", "prefill"), ("kv_consumer", "decode")])
def test_row_pd(role, mode):
    cfg = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role})
    t = translate(["vllm", "serve", BASE, "--kv-transfer-config", cfg])
    f = flags(t)
    assert f["--disaggregation-mode"] == mode and f["--disaggregation-transfer-backend"] == "mooncake"
    assert "n > 1" in notes(t) and "sglang_router" in notes(t)
    assert translate(["vllm", "serve", BASE, "--kv-transfer-config", cfg.replace(role, "kv_both")]).errors


def test_row_pd_router():
    t = tr("vllm-router --pd-disaggregation --prefill http://p:8000 --decode http://d:8000")
    assert t.command.startswith("python -m sglang_router.launch_router --pd-disaggregation --prefill")
    assert "30000" in notes(t)


def test_row_parallel():
    t = tr(f"vllm serve {BASE} -tp 4 -dp 2 --enable-expert-parallel")
    f = flags(t)
    assert (f["--tp-size"], f["--attn-dp-size"], f["--ep-size"]) == ("8", "2", "8")
    assert "--data-parallel-size" not in t.argv and "attention TP 4" in notes(t)
    # attention DP at attention TP 4 with EP: translated as vLLM meant it, refused as this version refuses it
    assert any("refuses when it loads the model" in e and "attention TP 4" in e for e in t.errors)
    t = tr(f"vllm serve {BASE} -tp 1 -dp 4")
    assert not t.errors and flags(t)["--attn-dp-size"] == "4"  # attention DP at attention TP 1 runs
    t = tr(f"vllm serve {BASE} -tp 4 --enable-expert-parallel --all2all-backend deepep_low_latency")
    assert flags(t)["--moe-a2a-backend"] == "deepep" and any(
        "--moe-a2a-backend deepep" in e for e in t.errors
    )
    assert "does not run DeepEP yet" in notes(t)
    assert flags(tr(f"vllm serve {BASE} --tensor-parallel-size 8"))["--tp-size"] == "8"
    bad = tr(f"vllm serve {BASE} --tensor-parallel-size 16")
    assert any("divide 8" in e for e in bad.errors)
    pp = flags(tr(f"vllm serve {BASE} -tp 4 --pipeline-parallel-size 2"))
    assert pp["--pp-size"] == "2" and pp["--moe-a2a-backend"] == "none"


def test_row_vllm_only():
    t = translate(
        [
            "VLLM_PLUGINS=ernie",
            "VLLM_USE_MODELSCOPE=1",
            "vllm",
            "serve",
            BASE,
            "--moe-backend",
            "humming",
            "--gpu-memory-utilization",
            "0.93",
        ]
    )
    assert not t.errors
    assert "humming" not in t.command and "gpu-memory-utilization" not in t.command
    assert t.env == {"SGLANG_USE_MODELSCOPE": "1"}
    assert "VLLM_PLUGINS" not in t.command and "SGLANG_PLUGINS" in notes(t)
    assert "--quantization humming" in notes(t)  # warned off the look-alike SGLang flag
    assert "--mem-fraction-static" in notes(t)
    assert translate(["VLLM_ATTENTION_BACKEND=FLASHMLA", "vllm", "serve", BASE]).errors


@pytest.mark.parametrize(
    "flag",
    [
        "--attn-dp-size 2",
        "--page-size 256",
        "--hicache-ratio 2",
        "--enable-dp-lm-head",
        "--moe-a2a-backend deepep",
    ],
)
def test_row_sglang_only_flags_are_not_vllm_input(flag):
    assert any("SGLang flag" in e for e in tr(f"vllm serve {BASE} {flag}").errors)


# ------------------------------------------------------------------------------------------ errors
def test_unknown_flag_is_an_error(cli):
    rc, out, err = cli("translate", "--", "vllm", "serve", BASE, "--hf-overrides", "{}")
    assert rc == 2 and out == "" and "no SGLang equivalent" in err


def test_not_a_vllm_command():
    with pytest.raises(TranslateError):
        tr(f"sglang serve --model-path {BASE}")
    with pytest.raises(TranslateError):
        tr(f"docker run {BASE}")


def test_multinode_vllm_is_an_error():
    assert tr(
        f"vllm serve {BASE} -dp 16 --data-parallel-size-local 8 --data-parallel-address 10.0.0.1"
    ).errors


# ------------------------------------------------------------------------------------------ the output is legal
FULL_EXAMPLE = (
    f"vllm serve {BASE} --tensor-parallel-size 4 --max-model-len 131072 --max-num-seqs 256 "
    """--kv-cache-dtype fp8 --speculative-config '{"method":"mtp","num_speculative_tokens":2}' """
    "--gpu-memory-utilization 0.93 --moe-backend humming --reasoning-parser ernie5 --port 8000 --trust-remote-code"
)
LEGAL = [
    FULL_EXAMPLE,
    f"vllm serve {BASE} -tp 1 -dp 8 --max-model-len 131072",
    f"vllm serve {BASE} -tp 8 --kv-cache-dtype auto --enforce-eager --no-enable-prefix-caching",
    f"""vllm serve {BASE} -tp 4 --kv-transfer-config '{{"kv_connector":"SimpleCPUOffloadConnector","kv_role":"kv_both"}}'""",
    f"""vllm serve {BASE} -tp 4 --kv-transfer-config '{{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}}'""",
    f"vllm serve {BASE} -tp 8 --enable-expert-parallel",
]
LEGAL_IDS = ["cookbook-low-latency", "dp", "auto-eager", "cpu-offload", "pd-prefill", "ep"]


@pytest.mark.parametrize("cmd", LEGAL, ids=LEGAL_IDS)
def test_translation_parses_strictly(strict_parser, cmd):
    t = tr(cmd)
    assert not t.errors, t.errors
    ns, unknown = strict_parser.parse_known_args(t.argv)
    assert not unknown


@pytest.mark.parametrize("cmd", LEGAL[:4], ids=LEGAL_IDS[:4])
def test_translation_resolves_with_the_plugin_rules(tiny_ckpt, cmd):
    from sglang_ernie55.args import resolve_server_args

    t = tr(cmd)
    argv = list(t.argv)
    argv[1] = tiny_ckpt
    d = resolve_server_args(argv, device="cpu").resolved_dict()
    assert d["attention_backend"] == "ernie55" and d["kv_cache_dtype"] in ("fp8_e4m3", "bfloat16")


def test_cli_prints_command_then_notes(cli):
    rc, out, err = cli("translate", "--", *shlex.split(FULL_EXAMPLE))
    assert rc == 0, err
    first, *rest = out.splitlines()
    assert first.startswith("sglang serve --model-path baidu/ERNIE-5.5-Flash-Base --tp-size 4")
    assert "--speculative-num-draft-tokens 3" in first and "--kv-cache-dtype fp8_e4m3" in first
    assert rest and all(ln.startswith("# ") for ln in rest)
    rc, out, _ = cli("translate", "--json", "--", *shlex.split(FULL_EXAMPLE))
    assert rc == 0 and json.loads(out)["command"] == first
    rc, _, err = cli("translate")
    assert rc == 2 and "after --" in err


def test_help_of_every_subcommand(cli):
    rc, out, _ = cli("--help")
    assert rc == 0
    for sub in ("cmd", "plan", "preflight", "translate"):
        assert sub in out
        rc, text, _ = cli(sub, "--help")
        assert rc == 0 and "Examples:" in text, sub
    rc, text, _ = cli("translate", "--help")
    assert "ECHO steps vs draft tokens" in " ".join(text.split())
