"""Request rules of ERNIE-5.5 servers, through SGLang's real OpenAI handlers (`handle_request` of
`OpenAIServingCompletion` / `OpenAIServingChat`, patched by the plugin's HookRegistry hooks) on CPU.

A live server needs a GPU; the handlers are built here over a stub tokenizer manager that carries what
the hook reads (served name, model architecture, PD mode). The rejected requests never reach it.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from sglang_ernie55.configuration import ARCH_MAIN

SERVED = "baidu/ERNIE-5.5-Flash-Base"


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
        model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch]), is_multimodal=False),
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
        return CompletionRequest(prompt="Question: What is 15% of 240?\nAnswer:", **fields)
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
