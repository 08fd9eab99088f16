"""GPU suite for ECHO speculative decoding: real SGLang servers (`python -m sglang.launch_server`) on the tiny
BF16 checkpoint, with and without `--speculative-algorithm EAGLE` (steps 1, 2, 3; topk 1; draft tokens
steps + 1), CUDA graphs on (decode, target-verify, draft decode).

Criteria:
- greedy (temperature 0) outputs with ECHO are identical to the outputs without it, for 14 concurrent
  requests whose prompts and 48 generated tokens cross the 128-token window, the 128-token compression
  block and the 256-token page (fp32 activations, bf16 KV: the configuration of the target's exactness
  suite, tests/serving/test_server_gpu.py);
- the server's draft path (dumped by `SGLANG_ERNIE55_ECHO_DUMP_DIR`) matches the reference: the target
  streams handed to the draft equal the reference's pre-hc_head streams (bf16-KV-rounded reference;
  per-row cosine median >= 0.9999, min >= 0.99), and the
  draft logits from those streams equal the reference's `echo_forward` (cosine >= 0.9999 per row, top-1
  agreement >= 99%);
- the draft shares the target's tensors (the attach hook's log line: draft-owned bytes are exactly the
  five echo tensors);
- the mean acceptance length (`meta_info.spec_accept_length`, `avg_spec_accept_length`) and decode speed
  with and without ECHO are recorded for each step count in `$OUT/echo-results.jsonl`; on the ECHO-exact
  checkpoint (sglang_ernie55.reference.echo.make_echo_exact_) the acceptance length is steps + 1.

Run (device command, carrying [".gpu"]):  bash scripts/gpu-suite.sh tests/echo -k "random"   (then -k "exact")
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
import server_harness as sh  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import echo_checks  # noqa: E402

from sglang_ernie55.configuration import tiny_config  # noqa: E402

pytestmark = [pytest.mark.gpu]

NEW_TOKENS = 48
STEPS = (1, 2, 3)
PROMPT_LENGTHS = (1, 19, 90, 100, 120, 126, 127, 128, 129, 200, 250, 255, 256, 400)
COMMON = ("--context-length", "4096", "--max-running-requests", "32", "--chunked-prefill-size", "512",
          "--max-total-tokens", "131072", "--sampling-backend", "pytorch", "--disable-prefill-cuda-graph",
          "--mem-fraction-static", "0.4", "--dtype", "float32", "--kv-cache-dtype", "bfloat16")  # fmt: skip
OUT = Path(os.environ.get("OUT") or os.environ.get("SERVING_LOG_DIR") or "gpu-out")


def spec_flags(steps: int) -> tuple[str, ...]:
    return ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(steps),
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(steps + 1))  # fmt: skip


def record(**data) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "echo-results.jsonl", "a") as f:
        f.write(json.dumps(data) + "\n")


def generate(server: sh.Server, prompt: list[int], max_new: int) -> dict:
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True},
    }
    r = requests.post(server.url + "/generate", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"/generate {r.status_code}: {r.text[:500]}\n{server.tail()}")
    out = r.json()
    return {"tokens": out["output_ids"], "meta": out["meta_info"]}


def generate_all(server, prompts, max_new, workers=16):
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(lambda p: generate(server, p, max_new), prompts))


def decode_speed(server, bos: int, vocab: int, batch: int, max_new: int = 256) -> dict:
    """Aggregate output tokens/s for `batch` concurrent 64-token prompts (after one warm-up round)."""
    g = torch.Generator().manual_seed(batch)
    prompts = [[bos] + torch.randint(3, vocab, (63,), generator=g).tolist() for _ in range(batch)]
    generate_all(server, prompts, 16, workers=batch)
    t0 = time.perf_counter()
    outs = generate_all(server, prompts, max_new, workers=batch)
    wall = time.perf_counter() - t0
    n = sum(len(o["tokens"]) for o in outs)
    verify = sum(o["meta"].get("spec_verify_ct", 0) for o in outs)
    return {"batch": batch, "tokens": n, "wall_s": wall, "tok_per_s": n / wall,
            "ms_per_round": 1e3 * wall / (verify / batch if verify else n / batch)}  # fmt: skip


def server_accept_length(server) -> float | None:
    try:
        info = requests.get(server.url + "/get_server_info", timeout=30).json()
        return info["internal_states"][0].get("avg_spec_accept_length")
    except (requests.RequestException, KeyError, IndexError, ValueError):
        return None


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


@pytest.fixture(scope="module")
def prompts(cfg):
    g = torch.Generator().manual_seed(0)
    out = []
    for n in PROMPT_LENGTHS:
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()
        ids[0] = cfg.bos_token_id
        out.append(ids)
    return out


@pytest.fixture(scope="module")
def ckpt(request, tmp_path_factory):
    """`random`: helper-3's tiny BF16 checkpoint (seed 0); `exact`: the ECHO-exact construction."""
    root = tmp_path_factory.mktemp("echo-ckpt")
    if request.param == "random":
        from sglang_ernie55.checkpoint.tiny import make_checkpoint

        return request.param, str(make_checkpoint(root / "random", dtype="bf16", seed=0))
    from sglang_ernie55.reference.echo import write_echo_exact_checkpoint

    path, _ = write_echo_exact_checkpoint(root / "exact", seed=0)
    return request.param, str(path)


class Runs:
    """Per checkpoint: the no-ECHO baseline once, then one server per step count."""

    cache: dict = {}


def _serve(name, path, prompts, cfg, *flags, dump_dir: str | None = None):
    if dump_dir:
        os.environ["SGLANG_ERNIE55_ECHO_DUMP_DIR"] = dump_dir
    try:
        server = sh.Server(path, *COMMON, *flags, log_name=name)
    finally:
        os.environ.pop("SGLANG_ERNIE55_ECHO_DUMP_DIR", None)
    try:
        outs = generate_all(server, prompts, NEW_TOKENS)
        speed = [decode_speed(server, cfg.bos_token_id, cfg.vocab_size, b) for b in (1, 8)]
        avg_accept = server_accept_length(server)
        log = server.log_path.read_text(errors="replace")
    finally:
        server.stop()
    return {"outs": outs, "speed": speed, "avg_accept": avg_accept, "log": log, "startup_s": server.startup_s}


def _baseline(kind, path, prompts, cfg):
    key = (kind, "base")
    if key not in Runs.cache:
        Runs.cache[key] = _serve(f"echo-{kind}-base", path, prompts, cfg)
        b = Runs.cache[key]
        record(checkpoint=kind, steps=0, speed=b["speed"], startup_s=b["startup_s"])
    return Runs.cache[key]


@pytest.mark.parametrize("ckpt", ["random", "exact"], indirect=True)
@pytest.mark.parametrize("steps", STEPS)
def test_echo_greedy_identical_and_recorded(ckpt, steps, prompts, cfg, tmp_path):
    kind, path = ckpt
    base = _baseline(kind, path, prompts, cfg)
    dump = tmp_path / "dump"
    dump.mkdir()
    run = _serve(f"echo-{kind}-s{steps}", path, prompts, cfg, *spec_flags(steps), dump_dir=str(dump))
    Runs.cache[(kind, steps)] = run
    accept = [o["meta"].get("spec_accept_length") for o in run["outs"]]
    record(checkpoint=kind, steps=steps, speed=run["speed"], startup_s=run["startup_s"],
           mean_accept_length=sum(a for a in accept if a) / max(sum(1 for a in accept if a), 1),
           server_avg_accept_length=run["avg_accept"],
           speedup_bs1=run["speed"][0]["tok_per_s"] / base["speed"][0]["tok_per_s"],
           speedup_bs8=run["speed"][1]["tok_per_s"] / base["speed"][1]["tok_per_s"])  # fmt: skip
    # 1. identical greedy outputs
    diffs = []
    for p, a, b in zip(prompts, base["outs"], run["outs"]):
        if a["tokens"] != b["tokens"]:
            i = next(j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y)
            diffs.append(
                {"prompt_len": len(p), "first_diff": i, "base": a["tokens"][i], "echo": b["tokens"][i]}
            )
    assert not diffs, f"ECHO steps={steps} changed greedy outputs: {diffs}"
    # 2. the draft shares the target's tensors (hook log) and owns only the echo tensors
    m = re.search(
        r"ECHO draft attached: shared_tensors=(\d+) shared_bytes=(\d+) draft_owned_bytes=(\d+)", run["log"]
    )
    assert m, "no ECHO attach line in the server log"
    H = cfg.hidden_size
    assert int(m.group(3)) == (2 * H * H + 3 * H) * 4  # fp32 activations: the draft's own params are fp32
    assert int(m.group(1)) > 10 and int(m.group(2)) > int(m.group(3))
    # 3. acceptance: exact by construction on the ECHO-exact checkpoint; within [1, steps + 1] always
    assert all(a is None or 1.0 <= a <= steps + 1 + 1e-6 for a in accept)
    if kind == "exact":
        # every draft accepted: completion / verify rounds = steps + 1 up to the clipped last round
        assert min(a for a in accept if a) >= steps + 0.5, accept
    # 4. the server's draft path against the reference (prefill draft-extends that start at position 0)
    _check_draft_dumps(path, dump, cfg, prompts)


def _check_draft_dumps(path, dump, cfg, prompts):
    stats = echo_checks.check_draft_dumps(path, dump, cfg, "cuda", prompts, min_requests=5)
    record(check="draft_logits_vs_reference", **stats)
