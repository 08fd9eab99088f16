"""HiCache over the ERNIE-5.5 pools on a CUDA GPU: the scenario of tests/serving/hicache_harness.py on real
servers whose host copies go through SGLang's own transfer kernels (docs/kv-layout.md, "HiCache").

The CPU suite (tests/serving/test_hicache_cpu.py) runs the same scenario with torch copies, since sgl-kernel's
transfer ops need the CUDA driver. Here each case serves the tiny BF16 checkpoint at fp32 activations (the
exactness setting of tests/serving/test_server_gpu.py, whose oracle rounds only the KV) with decode CUDA
graphs on, and checks that A's pages loaded back from the host give the device hit's tokens and logprobs:

| case | KV | io backend / host layout | pool |
| --- | --- | --- | --- |
| bf16_kernel | bfloat16 | `kernel` / `page_first` (SGLang's default) | hybrid SWA |
| fp8_kernel | fp8_e4m3 | `kernel` / `page_first` | hybrid SWA |
| fp8_direct | fp8_e4m3 | `direct` / `page_first_direct` | hybrid SWA |
| bf16_full_slots | bfloat16 | `direct` / `layer_first` | `--disable-hybrid-swa-memory` |
| bf16_echo | bfloat16 | `kernel` / `page_first` | hybrid SWA, ECHO (`--speculative-algorithm EAGLE`, 2 steps): the draft's rows mirrored too |

Against the reference: bf16 KV every greedy token the oracle's top-1 up to a near-tie of 0.01 nats; fp8 KV
the criteria of test_server_gpu.py's fp8-KV row (every first token, top-1 >= 95%). Results:
$SERVING_LOG_DIR/serving-results.jsonl (`hicache_gpu_<case>`).
"""

from __future__ import annotations

import pytest

from tests.echo import echo_checks
from tests.serving import hicache_harness as hh
from tests.serving import server_harness as sh

pytestmark = [pytest.mark.gpu]

REGIONS = "kv+swa+deepseek_v4_c128+deepseek_v4_c1+indexer"
CASES = {
    # name: (KV dtype, extra flags, the host pools the server must log)
    "bf16_kernel": (
        "bfloat16",
        ("--hicache-io-backend", "kernel", "--hicache-mem-layout", "page_first"),
        REGIONS,
    ),
    "fp8_kernel": (
        "fp8_e4m3",
        ("--hicache-io-backend", "kernel", "--hicache-mem-layout", "page_first"),
        REGIONS,
    ),
    "fp8_direct": (
        "fp8_e4m3",
        ("--hicache-io-backend", "direct", "--hicache-mem-layout", "page_first_direct"),
        REGIONS,
    ),
    "bf16_full_slots": (
        "bfloat16",
        (
            "--hicache-io-backend",
            "direct",
            "--hicache-mem-layout",
            "layer_first",
            "--disable-hybrid-swa-memory",
        ),
        "kv+deepseek_v4_c2+deepseek_v4_c128+deepseek_v4_c1+indexer",
    ),
    "bf16_echo": (
        "bfloat16",
        echo_checks.spec_flags(2),
        REGIONS + "+draft_swa",
    ),
}
TIE_NATS = 0.01


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "bf16", dtype="bf16", seed=0))


def _flags(kv: str, extra: tuple[str, ...]) -> list[str]:
    out = ["--dtype", "float32", "--kv-cache-dtype", kv, "--max-running-requests", "4"]
    out += ["--disable-prefill-cuda-graph", "--mem-fraction-static", sh.mem_fraction("0.3")]
    if "--disable-hybrid-swa-memory" not in extra:
        out += ["--swa-full-tokens-ratio", str(hh.SWA_RATIO)]
    for name, value in hh.FLAGS.items():
        out += ["--" + name.replace("_", "-")] + ([] if value is True else [str(value)])
    return out + list(extra)


@pytest.mark.parametrize("case", list(CASES))
def test_gpu_server_host_hit_equals_device_hit(ckpt, case):
    from sglang_ernie55.configuration import tiny_config

    kv, extra, regions = CASES[case]
    cfg = tiny_config()
    server = sh.Server(ckpt, *_flags(kv, extra), log_name=f"hicache-gpu-{case}")
    try:
        result = hh.run(server, cfg)
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    reported = hh.hits(result)
    _, ref = sh.load_reference(ckpt, "cpu")
    with sh.kv_rounded_reference(kv, cfg):
        s = sh.score(ref, result["prompts"], result["outs"], "cpu")
    print(f"\n[{case}] {reported}; vs the reference: {s.summary()}")
    sh.write_report(
        f"hicache_gpu_{case}", {"hits": reported, "summary": s.summary(), "mismatches": s.mismatches}
    )
    hh.check_host_hit(result, log, regions + ":")
    assert "io=torch" not in log, "a CUDA server must copy through SGLang's kernels"
    if kv == "bfloat16":
        far = [m for m in s.mismatches if m["gap"] > TIE_NATS]
        assert not far, (s.summary(), far)
    else:
        firsts = [m for m in s.mismatches if m["pos"] == 0 and m["gap"] > 0.05]
        assert not firsts and s.top1 >= 0.95 * s.positions, (s.summary(), firsts)
