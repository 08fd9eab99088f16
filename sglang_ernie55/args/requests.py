"""Request-time rules of the OpenAI endpoints, for ERNIE-5.5 servers only.

An AROUND hook on the endpoint's `_validate_request` answers a `model` that is not the served name with a
404 (SGLang serves any name) and `n > 1` under PD disaggregation with a 400 (the samples would share one
bootstrap room and hang); other architectures fall through unchanged.
"""

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


def validate_request_hook(original, self, request, *args, **kwargs):
    """AROUND hook on `<OpenAI handler>._validate_request`: for ERNIE-5.5 servers the served-name and PD
    checks first (they do not depend on the request's content), then SGLang's own validation."""
    if is_ernie55(getattr(getattr(self.tokenizer_manager, "model_config", None), "hf_config", None)):
        message = model_name_error(self, request)
        if message:
            from fastapi import HTTPException

            raise HTTPException(status_code=404, detail=message)  # handle_request answers it as a 404
        message = pd_parallel_sampling_error(getattr(request, "n", 1), _pd_mode(self.tokenizer_manager))
        if message:
            return message  # handle_request answers it as a 400
    return original(self, request, *args, **kwargs)
