"""Overload runs against a real SGLang server (tests/serving/test_overload_{cpu,gpu}.py): greedy streaming
/v1/completions requests, some closed mid-stream, every other one compared with the same request served
alone; the pool's used tokens before and after, the scheduler log's queue and retraction counts."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import requests
import torch

ERROR_LINE = re.compile(r"Traceback|\bERROR\b|leak detected|Error:|Scheduler hit an exception")
# SGLang's start-up notice that an optional endpoint is off because its package is not installed (the OpenAI
# Responses API without openai_harmony, which the staged GPU runtime lacks): the environment, not a server error
OPTIONAL_FEATURE_OFF = re.compile(
    r"disabled: \w+ init failed \(ModuleNotFoundError: No module named '[\w.]+'\)"
)


def make_prompts(vocab: int, bos: int, lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[bos] + torch.randint(3, vocab, (n - 1,), generator=g).tolist() for n in lengths]


def stream(url: str, model: str, prompt: list[int], max_tokens: int, close_after: int | None = None) -> dict:
    """One streaming greedy /v1/completions request; `close_after` chunks closes the connection there.
    Returns {"tokens", "finish", "chunks", "closed", "error"}."""
    body = dict(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        stream=True,
        return_token_ids=True,
    )
    out = {"tokens": [], "finish": None, "chunks": 0, "closed": False, "error": None}
    with requests.Session() as session:
        try:
            r = session.post(url + "/v1/completions", json=body, stream=True, timeout=1800)
            if r.status_code != 200:
                out["error"] = f"{r.status_code}: {r.text[:300]}"
                return out
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = str(chunk["error"])[:300]
                    break
                choice = chunk["choices"][0]
                out["tokens"] += choice.get("token_ids") or []
                out["finish"] = choice.get("finish_reason") or out["finish"]
                out["chunks"] += 1
                if close_after is not None and out["chunks"] >= close_after:
                    out["closed"] = True
                    r.close()  # the client goes away mid-stream
                    break
        except requests.RequestException as e:
            out["error"] = repr(e)[:300]
    return out


def wait_idle(url: str, timeout: float = 300) -> dict:
    """SGLang's load report (/v1/loads) once nothing runs or waits."""
    t0 = time.time()
    while True:
        load = requests.get(url + "/v1/loads", timeout=60).json()["loads"][0]
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
            return load
        if time.time() - t0 > timeout:
            raise TimeoutError(f"server not idle after {timeout}s: {load}")
        time.sleep(1)


def idle_usage(server) -> dict:
    """The pool at rest: SGLang's used full-pool tokens (/v1/loads: neither free nor evictable cache), and the
    full / SWA usage the scheduler logs for the 1-token prefill of a /health probe."""
    used = wait_idle(server.url)["num_used_tokens"]
    assert requests.get(server.url + "/health", timeout=120).status_code == 200
    text = server.log_path.read_text(errors="replace")
    usage = re.findall(r"Prefill batch.*?full token usage: ([\d.]+), swa token usage: ([\d.]+)", text)
    return {"used_tokens": used, "probe_full_usage": usage[-1][0], "probe_swa_usage": usage[-1][1]}


def run_overload(server, prompts, max_tokens, aborted: set[int], abort_after: int = 2) -> dict:
    """Serve every request not in `aborted` alone, then all of them at once (the `aborted` ones closed after
    `abort_after` chunks) while polling /health; returns the outcome and the pool before / after."""
    before = idle_usage(server)
    alone = {
        i: stream(server.url, server.model, p, max_tokens[i])
        for i, p in enumerate(prompts)
        if i not in aborted
    }
    t0 = time.time()
    health = []
    with ThreadPoolExecutor(len(prompts)) as ex:
        futures = [
            ex.submit(
                stream, server.url, server.model, p, max_tokens[i], abort_after if i in aborted else None
            )
            for i, p in enumerate(prompts)
        ]
        while not all(f.done() for f in futures):
            health.append(requests.get(server.url + "/health", timeout=300).status_code)
            time.sleep(2)
        loaded = [f.result() for f in futures]
    load_s = time.time() - t0
    wait_idle(server.url)
    drain_s = time.time() - t0 - load_s  # short when the server aborted the closed requests
    after = idle_usage(server)
    completed = [
        i for i, r in enumerate(loaded) if i not in aborted and not r["error"] and r["finish"] == "length"
    ]
    failed = {
        i: r["error"] or f"finish {r['finish']}"
        for i, r in enumerate(loaded)
        if i not in aborted and i not in completed
    }
    closed = [i for i in sorted(aborted) if loaded[i]["closed"] and len(loaded[i]["tokens"]) < max_tokens[i]]
    differ = [i for i in completed if loaded[i]["tokens"] != alone[i]["tokens"]]
    log = server.log_path.read_text(errors="replace")
    queued = [int(q) for q in re.findall(r"#queue-req: (\d+)", log)]
    return {
        "sent": len(prompts),
        "completed": len(completed),
        "aborted": len(closed),
        "failed": len(failed),
        "failures": failed,
        "differ_from_alone": differ,
        "health_not_ok": [h for h in health if h != 200],
        "pool_before": before,
        "pool_after": after,
        "load_s": round(load_s, 1),
        "drain_s": round(drain_s, 1),
        # requests retracted by a full pool or by SGLang's SGLANG_TEST_RETRACT switch
        "retractions": sum(int(n) for n in re.findall(r"#retracted_reqs: (\d+)", log)),
        "max_queue": max(queued, default=0),
        "log_errors": [
            line[:300]
            for line in log.splitlines()
            if ERROR_LINE.search(line) and not OPTIONAL_FEATURE_OFF.search(line)
        ][:10],
    }


def check(result: dict, aborted: set[int]) -> None:
    """What every overload run must show."""
    assert result["failed"] == 0, result["failures"]
    assert result["aborted"] == len(aborted), result
    assert result["completed"] == result["sent"] - len(aborted), result
    assert not result["differ_from_alone"], f"greedy tokens under load differ from alone: {result}"
    assert result["pool_after"] == result["pool_before"], result
    assert not result["health_not_ok"], result
    assert result["max_queue"] > 0, f"the pool was meant to be too small for every request at once: {result}"
    assert not result["log_errors"], result["log_errors"]
