"""Request-time rules of ERNIE-5.5 servers (other architectures fall through): the OpenAI endpoints answer a
wrong `model` with a 404 and `n > 1` under PD with a 400; every generate request gets a 400 for token ids
outside the vocabulary, a logprobs count outside 0..vocab_size, a logprob start outside the prompt or an empty
stop string (the OpenAI endpoints also for `n` < 1), before the scheduler sees it: a token id outside the
vocabulary must never reach the embedding. A stream is refused before it starts: SGLang's OpenAI handlers
await its first event before answering, and the `/generate` hook here does the same."""

from __future__ import annotations

from typing import Any

from ..arch import is_ernie55


def _pd_mode(tokenizer_manager: Any) -> str:
    mode = getattr(tokenizer_manager, "disaggregation_mode", None)
    mode = getattr(mode, "value", mode)
    if mode is None:
        mode = getattr(getattr(tokenizer_manager, "server_args", None), "disaggregation_mode", "null")
    return str(mode)


def pd_parallel_sampling_error(n: int | None, pd_mode: str) -> str | None:
    """The 400 message for n > 1 under PD disaggregation, else None."""
    if not n or n <= 1 or pd_mode in ("null", "none", ""):
        return None
    return (
        f"n={n} is not supported by this ERNIE-5.5 server: it runs with PD disaggregation "
        f"(--disaggregation-mode {pd_mode}), where the {n} samples of one request would share a single "
        "KV-transfer bootstrap room and the request would hang. Send n=1 and repeat the request "
        "(with a different seed) for several samples."
    )


def model_name_error(handler: Any, request: Any) -> str | None:
    """The 404 message when the request names a model this server does not serve (neither the served name
    nor `<served name>:<LoRA adapter>`), else None. A request without `model` is served."""
    if "model" not in getattr(request, "model_fields_set", {"model"}):
        return None
    served = handler.tokenizer_manager.served_model_name
    base, _adapter = handler._parse_model_parameter(request.model)
    if request.model == served or base == served:
        return None
    return (
        f"The model '{request.model}' does not exist: this server serves '{served}' (send that as "
        "`model`; a BF16 deployment serves the -BF16 name). Checked up front because under PD "
        "disaggregation a mismatch would fail mid-stream."
    )


def token_ids_error(ids: Any, vocab_size: int, field: str) -> str | None:
    """The 400 message when `ids` (one prompt of token ids, or a batch of them) holds an empty prompt or an
    id outside [0, vocab_size), else None. Other prompt forms (text) pass."""
    if not isinstance(ids, list | tuple) or not ids:
        return None
    batch = ids if all(isinstance(p, list | tuple) for p in ids) else [ids]
    for b, prompt in enumerate(batch):
        where = f"prompt {b} of the batch in `{field}`" if len(batch) > 1 else f"`{field}`"
        if not prompt:
            return f"{where} is empty: every prompt needs at least one token id."
        try:
            low, high = min(prompt), max(prompt)
        except TypeError:  # mixed types: SGLang's schema answers those
            continue
        if not (isinstance(low, int) and isinstance(high, int)):
            continue  # text prompts are tokenized into legal ids
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            return (
                f"{where} holds token id {bad} (position {list(prompt).index(bad)}), outside this model's "
                f"vocabulary: token ids must be in [0, {vocab_size - 1}] (vocab_size {vocab_size})."
            )
    return None


def top_logprobs_error(k: Any, vocab_size: int, field: str) -> str | None:
    """The 400 message when the number of top logprobs per token is outside [0, vocab_size], else None."""
    if k is None or isinstance(k, bool) or not isinstance(k, int) or 0 <= k <= vocab_size:
        return None
    return (
        f"`{field}`={k} is out of range: it is the number of most likely tokens returned per position, "
        f"legal values 0..{vocab_size} (vocab_size of this model)."
    )


def stop_error(stop: Any, field: str) -> str | None:
    """The 400 message when the stop strings hold an empty one (it matches at once: every answer would be
    empty), else None."""
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if any(s == "" for s in stops):
        return (
            f"`{field}` holds an empty string, which matches before the first token and ends every answer "
            "at once: send non-empty stop strings, or leave the field out."
        )
    return None


def sample_count_error(n: Any) -> str | None:
    """The 400 message for `n` < 1 (SGLang answers n=0 with a Python error and n<0 with zero-token
    answers), else None."""
    if isinstance(n, int) and not isinstance(n, bool) and n < 1:
        return f"`n`={n} is out of range: it is the number of answers per prompt, legal values 1 and above."
    return None


def content_error(request: Any, vocab_size: int | None) -> str | None:
    """The 400 message of an OpenAI completion or chat request whose `n`, stop strings, prompt token ids or
    logprobs count are out of range, else None."""
    message = sample_count_error(getattr(request, "n", 1)) or stop_error(
        getattr(request, "stop", None), "stop"
    )
    if message or not vocab_size:
        return message
    logprobs = getattr(request, "logprobs", None)
    if isinstance(logprobs, bool):  # chat: a switch; the count is `top_logprobs`
        field, k = "top_logprobs", getattr(request, "top_logprobs", None)
    else:
        field, k = "logprobs", logprobs
    return token_ids_error(getattr(request, "prompt", None), vocab_size, "prompt") or top_logprobs_error(
        k, vocab_size, field
    )


def logprob_start_error(start: Any, prompt_len: int) -> str | None:
    """The 400 message when the first prompt position of the returned logprobs is neither -1 nor inside the
    prompt, else None. SGLang's scheduler refuses a start past the prompt too, but only after running the
    prompt's prefill, and silently reads one below -1 as "from the first uncached position"."""
    if not isinstance(start, int) or isinstance(start, bool) or -1 <= start <= prompt_len:
        return None
    return (
        f"`logprob_start_len`={start} is out of range: it is the first prompt position whose logprob is "
        f"returned, legal values -1 (output tokens only) and 0..{prompt_len} (this prompt has {prompt_len} "
        "tokens)."
    )


def generate_error(obj: Any, input_ids: Any, vocab_size: int) -> str | None:
    """The 400 message of one tokenized generate request (`GenerateReqInput`) whose input ids, logprob
    options or stop strings are out of range, else None. Multimodal requests carry placeholder ids beyond
    the vocabulary and pass."""
    if any(getattr(obj, f, None) is not None for f in ("image_data", "video_data", "audio_data")):
        return None
    message = None
    if input_ids is not None:
        message = token_ids_error(list(input_ids) or [[]], vocab_size, "input_ids")
    if not message and getattr(obj, "return_logprob", False):
        k = getattr(obj, "top_logprobs_num", None)
        for one in k if isinstance(k, list) else [k]:
            message = message or top_logprobs_error(one, vocab_size, "top_logprobs_num")
        if not message and input_ids is not None:
            message = logprob_start_error(getattr(obj, "logprob_start_len", None), len(input_ids))
    params = getattr(obj, "sampling_params", None)
    if not message and isinstance(params, dict):
        message = stop_error(params.get("stop"), "stop")
    return message


def _vocab_size(tokenizer_manager: Any) -> int | None:
    return getattr(getattr(tokenizer_manager, "model_config", None), "vocab_size", None)


def validate_request_hook(original, self, request, *args, **kwargs):
    """AROUND hook on `<OpenAI handler>._validate_request`: for ERNIE-5.5 servers the served-name and PD
    checks first (they do not depend on the request's content), then SGLang's own validation, then the
    content rules (the tokenizer manager checks them too, but its message names `input_ids` and
    `top_logprobs_num` where the client sent `prompt` and `logprobs`)."""
    if not is_ernie55(getattr(getattr(self.tokenizer_manager, "model_config", None), "hf_config", None)):
        return original(self, request, *args, **kwargs)
    message = model_name_error(self, request)
    if message:
        from fastapi import HTTPException

        raise HTTPException(status_code=404, detail=message)  # handle_request answers it as a 404
    message = pd_parallel_sampling_error(getattr(request, "n", 1), _pd_mode(self.tokenizer_manager))
    if message:
        return message  # handle_request answers it as a 400
    return original(self, request, *args, **kwargs) or content_error(
        request, _vocab_size(self.tokenizer_manager)
    )


def validate_one_request_hook(original, self, obj, input_ids, *args, **kwargs):
    """AROUND hook on `TokenizerManager._validate_one_request`: SGLang's checks (context length, ...), then
    for ERNIE-5.5 the content rules; the ValueError is answered as a 400 by every endpoint."""
    result = original(self, obj, input_ids, *args, **kwargs)
    config = getattr(self, "model_config", None)
    if is_ernie55(getattr(config, "hf_config", None)):
        message = generate_error(obj, input_ids, config.vocab_size)
        if message:
            raise ValueError(message)
    return result


def _stream_error(event: bytes) -> dict | None:
    """The `error` object of a `/generate` stream event that carries only an error (SGLang's answer to a
    ValueError inside the stream), else None."""
    import orjson

    if not event.startswith(b"data: {"):
        return None
    try:
        body = orjson.loads(event[len(b"data: ") :])
    except orjson.JSONDecodeError:
        return None
    if isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict):
        return body["error"]
    return None


async def _prepend(first: bytes, events):
    yield first
    async for event in events:
        yield event


async def serve_generate_request_hook(original, obj, request, *args, **kwargs):
    """AROUND hook on `http_server.serve_generate_request`: for a streaming request to an ERNIE-5.5 server,
    the stream's first event is awaited before the response starts, as SGLang's OpenAI handlers do. Every
    rule that refuses a request (ours in the tokenizer manager, SGLang's context length, sampling parameters,
    ...) raises before the first output, which SGLang's `/generate` stream would send as an error event after
    a 200; here it becomes that status (400 unless the error names another) with the message as JSON, and
    the request never reached the scheduler. A first event that is output starts the stream unchanged."""
    from fastapi.responses import ORJSONResponse, StreamingResponse
    from sglang.srt.entrypoints.http_server import get_global_state

    response = await original(obj, request, *args, **kwargs)
    state = get_global_state()
    tokenizer_manager = getattr(state, "tokenizer_manager", None)
    config = getattr(getattr(tokenizer_manager, "model_config", None), "hf_config", None)
    if not (getattr(obj, "stream", False) and isinstance(response, StreamingResponse) and is_ernie55(config)):
        return response
    events = response.body_iterator
    try:
        first = await events.__anext__()
    except StopAsyncIteration:  # the client left before the first output: SGLang's empty stream
        return response
    error = _stream_error(first)
    if error is None:
        response.body_iterator = _prepend(first, events)
        return response
    await events.aclose()
    status = error.get("code")
    status = status if isinstance(status, int) and 400 <= status < 600 else 400
    return ORJSONResponse({"error": {"message": error.get("message", "")}}, status_code=status)
