"""Bad requests against one real SGLang server on CPU (tiny checkpoint): each gets a 4xx whose message names
the field and its legal values, runs no prefill, and after each the server is healthy and still gives the same
greedy tokens for a good request. Streaming requests get the same 4xx before any stream starts. Without the
plugin's checks, out-of-range token ids and logprob counts stop the server (IndexError in the embedding,
`topk` out of range in the scheduler), a streaming /generate is answered 200 with an error event, and a
`logprob_start_len` past the prompt is refused by the scheduler after the prompt's prefill."""

from __future__ import annotations

import json

import pytest
import requests

from tests.serving import server_harness as sh

CONTEXT = 2048
# the CPU flags of the demo; everything else is SGLang's default
FLAGS = sh.cpu_flags(context_length=CONTEXT)
GOOD_PROMPT = [1, 17, 230, 45, 99, 3, 311]
GOOD_TOKENS = 8


def _cases(vocab: int, model: str) -> list[tuple[str, str, str, object, int, tuple[str, ...]]]:
    """(request, method, path, body, status, words the message must hold); a str body is sent raw."""

    def comp(**kw):
        return {"model": model, "prompt": GOOD_PROMPT, "max_tokens": 4, "temperature": 0, **kw}

    def gen(**kw):
        return {"input_ids": GOOD_PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, **kw}

    def gen_params(**kw):
        return gen(sampling_params={"max_new_tokens": 4, "temperature": 0, **kw})

    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    ids_range = (f"[0, {vocab - 1}]", f"vocab_size {vocab}")
    logprobs_range = (f"0..{vocab}",)
    c, g = "/v1/completions", "/generate"
    return [
        (
            "completions: prompt token id = vocab size",
            "POST",
            c,
            comp(prompt=[1, vocab]),
            400,
            ("`prompt`", f"token id {vocab}", *ids_range),
        ),
        (
            "completions: prompt token id 10**6",
            "POST",
            c,
            comp(prompt=[1, 10**6]),
            400,
            ("`prompt`", "10000", *ids_range),
        ),
        (
            "completions: negative prompt token id",
            "POST",
            c,
            comp(prompt=[1, -1, 5]),
            400,
            ("`prompt`", "token id -1", *ids_range),
        ),
        (
            "completions: token id >= vocab, streaming",
            "POST",
            c,
            comp(prompt=[1, vocab + 5], stream=True),
            400,
            ("`prompt`", *ids_range),
        ),
        (
            "completions: batch with a bad token id",
            "POST",
            c,
            comp(prompt=[[1, 2], [3, vocab]]),
            400,
            ("prompt 1 of the batch", *ids_range),
        ),
        (
            "completions: batch with an empty prompt",
            "POST",
            c,
            comp(prompt=[[1, 2], []]),
            400,
            ("prompt 1 of the batch", "empty"),
        ),
        (
            "generate: input_ids token id = vocab size",
            "POST",
            g,
            gen(input_ids=[1, vocab]),
            400,
            ("`input_ids`", *ids_range),
        ),
        (
            "generate: negative input_ids token id",
            "POST",
            g,
            gen(input_ids=[1, -7]),
            400,
            ("`input_ids`", "token id -7", *ids_range),
        ),
        (
            "generate: batch input_ids with an empty prompt",
            "POST",
            g,
            gen(input_ids=[[1, 2], []]),
            400,
            ("`input_ids`", "empty"),
        ),
        ('completions: empty prompt ""', "POST", c, comp(prompt=""), 400, ("Prompt cannot be empty",)),
        ("completions: empty prompt []", "POST", c, comp(prompt=[]), 400, ("Prompt cannot be empty",)),
        ("generate: empty input_ids", "POST", g, gen(input_ids=[]), 400, ("input_ids cannot be empty",)),
        (
            "completions: prompt longer than the context",
            "POST",
            c,
            comp(prompt=[1] * (CONTEXT + 100)),
            400,
            ("context length", str(CONTEXT)),
        ),
        (
            "generate: input_ids longer than the context",
            "POST",
            g,
            gen(input_ids=[1] * (CONTEXT + 100)),
            400,
            ("context length", str(CONTEXT)),
        ),
        ("completions: max_tokens 0", "POST", c, comp(max_tokens=0), 400, ("max_tokens", "must be positive")),
        (
            "completions: max_tokens -1",
            "POST",
            c,
            comp(max_tokens=-1),
            400,
            ("max_tokens", "must be positive"),
        ),
        (
            "completions: max_tokens 10**12",
            "POST",
            c,
            comp(max_tokens=10**12),
            400,
            ("maximum context length", str(CONTEXT)),
        ),
        (
            "generate: max_new_tokens -1",
            "POST",
            g,
            gen_params(max_new_tokens=-1),
            400,
            ("max_new_tokens", "at least 0"),
        ),
        ("completions: malformed JSON", "POST", c, '{"prompt": [1, 2', 400, ("JSON decode error",)),
        ("generate: malformed JSON", "POST", g, '{"input_ids": [1, 2', 400, ("JSON decode error",)),
        (
            "completions: logprobs 1,000,000",
            "POST",
            c,
            comp(logprobs=10**6),
            400,
            ("`logprobs`=1000000", *logprobs_range),
        ),
        (
            "completions: logprobs vocab + 1",
            "POST",
            c,
            comp(logprobs=vocab + 1),
            400,
            (f"`logprobs`={vocab + 1}", *logprobs_range),
        ),
        ("completions: logprobs -1", "POST", c, comp(logprobs=-1), 400, ("`logprobs`=-1", *logprobs_range)),
        (
            "generate: top_logprobs_num 1,000,000",
            "POST",
            g,
            gen(return_logprob=True, top_logprobs_num=10**6),
            400,
            ("`top_logprobs_num`=1000000", *logprobs_range),
        ),
        (
            "chat: top_logprobs 1,000,000",
            "POST",
            "/v1/chat/completions",
            {**chat, "logprobs": True, "top_logprobs": 10**6},
            400,
            ("`top_logprobs`=1000000", *logprobs_range),
        ),
        (
            "generate: logprob_start_len past the prompt",
            "POST",
            g,
            gen(return_logprob=True, logprob_start_len=99),
            400,
            ("`logprob_start_len`=99", "-1 (output tokens only)", f"0..{len(GOOD_PROMPT)}"),
        ),
        (
            "generate: logprob_start_len -5",
            "POST",
            g,
            gen(return_logprob=True, logprob_start_len=-5),
            400,
            ("`logprob_start_len`=-5", "-1 (output tokens only)", f"0..{len(GOOD_PROMPT)}"),
        ),
        (
            "completions: temperature -1",
            "POST",
            c,
            comp(temperature=-1),
            400,
            ("temperature", "non-negative"),
        ),
        (
            "generate: temperature -1",
            "POST",
            g,
            gen_params(temperature=-1),
            400,
            ("temperature", "non-negative"),
        ),
        ("completions: top_p 0", "POST", c, comp(top_p=0), 400, ("top_p", "(0, 1]")),
        (
            "completions: empty stop string",
            "POST",
            c,
            comp(stop=""),
            400,
            ("`stop`", "empty string", "non-empty"),
        ),
        (
            "completions: empty string in a stop list",
            "POST",
            c,
            comp(stop=["\n", ""]),
            400,
            ("`stop`", "empty string"),
        ),
        ("generate: empty stop string", "POST", g, gen_params(stop=[""]), 400, ("`stop`", "empty string")),
        ("completions: n 0", "POST", c, comp(n=0), 400, ("`n`=0", "1 and above")),
        (
            "completions: unknown model",
            "POST",
            c,
            comp(model="ERNIE-5.5-Flash"),
            404,
            ("does not exist", model),
        ),
        # streams: refused before the stream starts (SGLang's /generate would answer 200 and an error event)
        (
            "generate stream: input_ids token id = vocab size",
            "POST",
            g,
            gen(input_ids=[1, vocab], stream=True),
            400,
            ("`input_ids`", f"token id {vocab}", *ids_range),
        ),
        (
            "generate stream: negative input_ids token id",
            "POST",
            g,
            gen(input_ids=[1, -7], stream=True),
            400,
            ("`input_ids`", "token id -7", *ids_range),
        ),
        (
            "generate stream: batch with a bad token id",
            "POST",
            g,
            gen(input_ids=[[1, 2], [3, vocab + 5]], stream=True),
            400,
            ("`input_ids`", f"token id {vocab + 5}", *ids_range),  # checked one prompt at a time
        ),
        (
            "generate stream: input_ids longer than the context",
            "POST",
            g,
            gen(input_ids=[1] * (CONTEXT + 100), stream=True),
            400,
            ("context length", str(CONTEXT)),
        ),
        (
            "generate stream: top_logprobs_num 1,000,000",
            "POST",
            g,
            gen(return_logprob=True, top_logprobs_num=10**6, stream=True),
            400,
            ("`top_logprobs_num`=1000000", *logprobs_range),
        ),
        (
            "generate stream: logprob_start_len past the prompt",
            "POST",
            g,
            gen(return_logprob=True, logprob_start_len=99, stream=True),
            400,
            ("`logprob_start_len`=99", f"0..{len(GOOD_PROMPT)}"),
        ),
        (
            "generate stream: max_new_tokens -1",
            "POST",
            g,
            {**gen_params(max_new_tokens=-1), "stream": True},
            400,
            ("max_new_tokens", "at least 0"),
        ),
        (
            "generate stream: empty stop string",
            "POST",
            g,
            {**gen_params(stop=[""]), "stream": True},
            400,
            ("`stop`", "empty string"),
        ),
        (
            "completions stream: negative prompt token id",
            "POST",
            c,
            comp(prompt=[1, -1, 5], stream=True),
            400,
            ("`prompt`", "token id -1", *ids_range),
        ),
        (
            "completions stream: prompt longer than the context",
            "POST",
            c,
            comp(prompt=[1] * (CONTEXT + 100), stream=True),
            400,
            ("context length", str(CONTEXT)),
        ),
        (
            "completions stream: logprobs 1,000,000",
            "POST",
            c,
            comp(logprobs=10**6, stream=True),
            400,
            ("`logprobs`=1000000", *logprobs_range),
        ),
        (
            "chat stream: top_logprobs 1,000,000",
            "POST",
            "/v1/chat/completions",
            {**chat, "logprobs": True, "top_logprobs": 10**6, "stream": True},
            400,
            ("`top_logprobs`=1000000", *logprobs_range),
        ),
    ]


def _message(r: requests.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)
    return str(error)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp("bad-requests") / "bf16", dtype="bf16", seed=0)
    srv = sh.Server(path, *FLAGS, log_name="bad-requests")
    yield srv
    srv.stop()


def _good(server) -> list[int]:
    return server.complete(GOOD_PROMPT, GOOD_TOKENS)["tokens"]


def _good_stream(server) -> list[int]:
    """The greedy tokens of GOOD_PROMPT through a streaming /generate; every event holds the output ids so
    far, the first event one token (the hook holds it back and sends it first)."""
    body = {
        "input_ids": GOOD_PROMPT,
        "sampling_params": {"max_new_tokens": GOOD_TOKENS, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    r = requests.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text[:400]
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    ids = [json.loads(e)["output_ids"] for e in events[:-1]]
    assert len(ids[0]) == 1 and all(b[: len(a)] == a for a, b in zip(ids, ids[1:])), ids
    return ids[-1]


def _prefills(server) -> int:
    """Prefill batches the scheduler has run (one log line each)."""
    return server.log_path.read_text(errors="replace").count("Prefill batch")


@pytest.mark.slow
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    from sglang_ernie55.configuration import tiny_config

    vocab = tiny_config().vocab_size
    before = _good(server)
    rows, failures = [], []
    for name, method, path, body, status, words in _cases(vocab, server.model):
        kw = (
            {"data": body, "headers": {"Content-Type": "application/json"}}
            if isinstance(body, str)
            else {"json": body}
        )
        prefills = _prefills(server)
        r = requests.request(method, server.url + path, timeout=120, **kw)
        message = _message(r)
        rows.append((name, r.status_code, " ".join(message.split())[:110]))
        if r.status_code != status or not all(w in message for w in words):
            failures.append(f"{name}: {r.status_code} {message[:400]!r} (expected {status} with {words})")
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            failures.append(f"{name}: answered as a stream ({r.status_code})")
        if _prefills(server) != prefills:
            failures.append(f"{name}: the scheduler ran a prefill for it")
        alive = server.proc.poll() is None
        health = requests.get(server.url + "/health", timeout=60).status_code if alive else None
        assert alive and health == 200, (
            f"after {name}: server alive={alive}, /health {health}\n{server.tail()}"
        )
        assert _good(server) == before, f"after {name}: a good request's greedy tokens changed"
    width = max(len(n) for n, _, _ in rows)
    table = "\n".join(f"{n:{width}}  {s}  {m}" for n, s, m in rows)
    print(f"\n{'request':{width}}  code  message (start)\n{table}")
    sh.write_report("bad_requests", {"rows": rows})
    assert not failures, "\n".join(failures)
    assert _good_stream(server) == before, "a good streaming /generate lost or changed tokens"
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "Scheduler hit an exception" not in log, server.tail()
