"""Request rules of ERNIE-5.5 servers, through SGLang's real OpenAI handlers (`handle_request` of
`OpenAIServingCompletion` / `OpenAIServingChat`, patched by the plugin's HookRegistry hooks) and the tokenizer
manager's hook, without a server.

The handlers are built over a stub tokenizer manager that carries what the hooks read (served name, model
architecture and vocabulary size, PD mode); the rejected requests never reach it.
tests/serving/test_bad_requests_cpu.py sends the same requests to a real server.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from sglang_ernie55.configuration import ARCH_MAIN

SERVED = "baidu/ERNIE-5.5-Flash-Base"
VOCAB = 512


@pytest.fixture(scope="module")
def handlers():
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion

    from sglang_ernie55.args.api import ensure_plugin_loaded

    ensure_plugin_loaded()  # what every SGLang process does: plugins, then HookRegistry.apply_hooks()
    return OpenAIServingCompletion, OpenAIServingChat


def _tokenizer_manager(arch: str, pd_mode: str):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return SimpleNamespace(
        served_model_name=SERVED,
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(architectures=[arch]), is_multimodal=False, vocab_size=VOCAB
        ),
        disaggregation_mode=DisaggregationMode(pd_mode),
        server_args=SimpleNamespace(disaggregation_mode=pd_mode),
    )


def _make(handlers, kind: str, arch=ARCH_MAIN, pd_mode="null"):
    completion_cls, chat_cls = handlers
    cls = completion_cls if kind == "completion" else chat_cls
    handler = cls.__new__(cls)  # __init__ wires templates and metrics a stub does not need
    handler.tokenizer_manager = _tokenizer_manager(arch, pd_mode)
    handler.is_minimax_m3 = False  # chat's own validation reads it
    return handler


def _request(kind: str, **fields):
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    if kind == "completion":
        fields.setdefault("prompt", "Question: What is 15% of 240?\nAnswer:")
        return CompletionRequest(**fields)
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def _answer(handler, request):
    response = asyncio.run(handler.handle_request(request, None))
    return response.status_code, json.loads(response.body)["message"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_wrong_model_name_is_404_up_front(handlers, kind):
    status, message = _answer(_make(handlers, kind), _request(kind, model="ERNIE-5.5-Flash"))
    assert status == 404
    assert "does not exist" in message and SERVED in message


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_pd_parallel_sampling_is_400(handlers, kind):
    for mode in ("prefill", "decode"):
        status, message = _answer(_make(handlers, kind, pd_mode=mode), _request(kind, model=SERVED, n=2))
        assert status == 400
        assert "n=2" in message and "bootstrap room" in message and mode in message


@pytest.mark.parametrize(
    "fields",
    [{"model": SERVED}, {}, {"model": f"{SERVED}:my-lora"}, {"model": SERVED, "n": 2}],
    ids=["served-name", "no-model", "lora", "n2-without-pd"],
)
def test_legal_requests_pass_validation(handlers, fields):
    handler = _make(handlers, "completion")
    assert handler._validate_request(_request("completion", **fields)) is None


def test_sglangs_own_validation_still_runs(handlers):
    from sglang.srt.entrypoints.openai.protocol import CompletionRequest

    handler = _make(handlers, "completion")
    assert handler._validate_request(CompletionRequest(prompt="", model=SERVED)) == "Prompt cannot be empty"


def test_other_architectures_are_untouched(handlers):
    handler = _make(handlers, "completion", arch="Qwen3MoeForCausalLM", pd_mode="prefill")
    assert handler._validate_request(_request("completion", model="whatever", n=4)) is None


IDS = (f"[0, {VOCAB - 1}]", f"vocab_size {VOCAB}")


@pytest.mark.parametrize(
    "kind, fields, words",
    [
        ("completion", {"prompt": [1, VOCAB]}, ("`prompt`", f"token id {VOCAB} (position 1)", *IDS)),
        ("completion", {"prompt": [1, -3, 4]}, ("`prompt`", "token id -3 (position 1)", *IDS)),
        ("completion", {"prompt": [[1, 2], [5, 10**6]]}, ("prompt 1 of the batch", "1000000", *IDS)),
        ("completion", {"prompt": [[1, 2], []]}, ("prompt 1 of the batch in `prompt` is empty",)),
        ("completion", {"logprobs": 10**6}, ("`logprobs`=1000000", f"0..{VOCAB}")),
        ("completion", {"logprobs": -1}, ("`logprobs`=-1", f"0..{VOCAB}")),
        ("completion", {"stop": ""}, ("`stop`", "empty string")),
        ("completion", {"n": 0}, ("`n`=0", "1 and above")),
    ],
    ids=[
        "id=vocab",
        "negative-id",
        "batch-id",
        "batch-empty",
        "logprobs-1e6",
        "logprobs-neg",
        "stop-empty",
        "n0",
    ],
)
def test_out_of_range_content_is_400(handlers, kind, fields, words):
    status, message = _answer(_make(handlers, kind), _request(kind, model=SERVED, **fields))
    assert status == 400, message
    assert all(w in message for w in words), message


def test_chat_content_rules(handlers):
    """Chat's own validation reads the server's runtime config, so its content rules are checked directly."""
    from sglang_ernie55.args.requests import content_error

    message = content_error(_request("chat", logprobs=True, top_logprobs=VOCAB + 1), VOCAB)
    assert f"`top_logprobs`={VOCAB + 1}" in message and f"0..{VOCAB}" in message
    assert "empty string" in content_error(_request("chat", stop=["\n", ""]), VOCAB)
    assert content_error(_request("chat", logprobs=True, top_logprobs=20, stop=["\n"]), VOCAB) is None


@pytest.mark.parametrize(
    "kind, fields",
    [
        ("completion", {"prompt": [0, VOCAB - 1]}),
        ("completion", {"prompt": [[1, 2], [3]]}),
        ("completion", {"logprobs": VOCAB}),
        ("completion", {"logprobs": 0, "stop": ["\n"]}),
    ],
    ids=["edge-ids", "batch", "logprobs=vocab", "logprobs0-stop"],
)
def test_in_range_content_passes(handlers, kind, fields):
    assert _make(handlers, kind)._validate_request(_request(kind, model=SERVED, **fields)) is None


def test_content_rules_leave_other_architectures_alone(handlers):
    handler = _make(handlers, "completion", arch="Qwen3MoeForCausalLM")
    assert (
        handler._validate_request(_request("completion", prompt=[1, 10**6], logprobs=10**6, stop="")) is None
    )


def _generate(**fields):
    from sglang.srt.managers.io_struct import GenerateReqInput

    fields.setdefault("input_ids", [1, 2, 3])
    obj = GenerateReqInput(**fields)
    obj.normalize_batch_and_arguments()
    return obj


def _tokenizer_check(obj, arch=ARCH_MAIN, input_ids=None):
    """The tokenizer manager's hook over a stub of SGLang's own check; returns (error, SGLang's check ran)."""
    from sglang_ernie55.args.requests import validate_one_request_hook

    ran = []
    manager = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch]), vocab_size=VOCAB)
    )
    try:
        ids = obj.input_ids if input_ids is None else input_ids
        validate_one_request_hook(lambda *a: ran.append(a), manager, obj, ids)
    except ValueError as e:
        return str(e), bool(ran)
    return None, bool(ran)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"input_ids": [1, VOCAB]}, ("`input_ids`", f"token id {VOCAB}", *IDS)),
        ({"input_ids": [-1]}, ("`input_ids`", "token id -1", *IDS)),
        ({"input_ids": [1]}, ("`input_ids` is empty",)),
        ({"return_logprob": True, "top_logprobs_num": 10**6}, ("`top_logprobs_num`=1000000", f"0..{VOCAB}")),
        ({"sampling_params": {"stop": [""]}}, ("`stop`", "empty string")),
        (
            {"return_logprob": True, "logprob_start_len": 4},
            ("`logprob_start_len`=4", "-1 (output tokens only)", "0..3"),
        ),
        ({"return_logprob": True, "logprob_start_len": -2}, ("`logprob_start_len`=-2", "0..3")),
    ],
    ids=[
        "id=vocab",
        "negative-id",
        "empty",
        "top-logprobs",
        "stop-empty",
        "logprob-start",
        "logprob-start-neg",
    ],
)
def test_tokenizer_manager_refuses_out_of_range_generate(fields, words):
    # one prompt of a batch reaches the check with no ids (SGLang refuses only a lone empty one)
    empty = [] if "`input_ids` is empty" in words else None
    message, ran = _tokenizer_check(_generate(**fields), input_ids=empty)
    assert ran, "SGLang's own checks run first"
    assert message and all(w in message for w in words), message


def test_tokenizer_manager_passes_legal_and_foreign_requests():
    assert _tokenizer_check(_generate(input_ids=[0, VOCAB - 1])) == (None, True)
    assert _tokenizer_check(_generate(return_logprob=True, top_logprobs_num=VOCAB)) == (None, True)
    assert _tokenizer_check(_generate(top_logprobs_num=10**6)) == (None, True)  # no logprobs asked for
    # logprobs from position 3 of a 3-token prompt: none of the prompt's, the output's
    assert _tokenizer_check(_generate(return_logprob=True, logprob_start_len=3)) == (None, True)
    assert _tokenizer_check(_generate(logprob_start_len=99)) == (None, True)  # ignored without logprobs
    assert _tokenizer_check(_generate(return_logprob=True, logprob_start_len=-1)) == (None, True)
    assert _tokenizer_check(_generate(return_logprob=True, logprob_start_len=0)) == (None, True)
    assert _tokenizer_check(_generate(input_ids=[1, 10**6]), arch="Qwen3MoeForCausalLM") == (None, True)


def test_tokenizer_manager_hook_is_applied(handlers):
    """The plugin's ledger attaches the hook to SGLang's TokenizerManager (HookRegistry wraps the method)."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from sglang_ernie55.args.requests import validate_one_request_hook

    method = TokenizerManager._validate_one_request
    closure = [c.cell_contents for c in (method.__closure__ or ())]
    assert validate_one_request_hook in closure, "HookRegistry's wrapper calls our hook"


# ============================================================================ /generate streams
def _stream_hook(monkeypatch, events, arch=ARCH_MAIN, stream=True):
    """Our hook around a stand-in for SGLang's `serve_generate_request`, whose stream yields `events`;
    returns (response, the events the stand-in's stream yielded before it was closed)."""
    from fastapi.responses import StreamingResponse
    from sglang.srt.entrypoints import http_server

    from sglang_ernie55.args.requests import serve_generate_request_hook

    state = SimpleNamespace(tokenizer_manager=_tokenizer_manager(arch, "null"))
    monkeypatch.setattr(http_server, "get_global_state", lambda: state)
    sent = []

    async def body():
        for e in events:
            sent.append(e)
            yield e

    async def original(obj, request):
        return StreamingResponse(body(), media_type="text/event-stream") if obj.stream else "answer"

    async def drain(response):
        return [e async for e in response.body_iterator] if hasattr(response, "body_iterator") else None

    obj = SimpleNamespace(stream=stream)

    async def run():
        response = await serve_generate_request_hook(original, obj, None)
        return response, await drain(response)

    response, body_events = asyncio.run(run())
    return response, body_events, sent


ERROR_EVENT = (
    b'data: {"error":{"message":"`input_ids` holds token id 512",'
    b'"type":"invalid_request_error","code":400}}\n\n'
)
OUTPUT_EVENTS = [b'data: {"text":"a","output_ids":[7]}\n\n', b'data: {"text":"ab","output_ids":[7,9]}\n\n']


def test_generate_stream_refused_before_it_starts(monkeypatch):
    """SGLang's stream answers a refusal with an error event after a 200; the hook turns it into the 400."""
    response, _, sent = _stream_hook(monkeypatch, [ERROR_EVENT, b"data: [DONE]\n\n"])
    assert response.status_code == 400 and response.media_type == "application/json"
    assert json.loads(response.body) == {"error": {"message": "`input_ids` holds token id 512"}}
    assert sent == [ERROR_EVENT], "the stream is closed after its error event"


def test_generate_stream_with_output_is_unchanged(monkeypatch):
    """The first event, held back to look at it, is sent first; the rest follow."""
    events = [*OUTPUT_EVENTS, b"data: [DONE]\n\n"]
    response, body, _ = _stream_hook(monkeypatch, events)
    assert response.status_code == 200 and response.media_type == "text/event-stream"
    assert body == events


def test_generate_stream_hook_leaves_others_alone(monkeypatch):
    events = [ERROR_EVENT, b"data: [DONE]\n\n"]
    response, body, _ = _stream_hook(monkeypatch, events, arch="Qwen3MoeForCausalLM")
    assert response.status_code == 200 and body == events  # SGLang's own answer for other models
    response, body, _ = _stream_hook(monkeypatch, events, stream=False)
    assert response == "answer" and body is None


def test_generate_stream_hook_is_applied(handlers):
    from sglang.srt.entrypoints import http_server

    from sglang_ernie55.args.requests import serve_generate_request_hook

    closure = [c.cell_contents for c in (http_server.serve_generate_request.__closure__ or ())]
    assert serve_generate_request_hook in closure, "HookRegistry's wrapper calls our hook"
