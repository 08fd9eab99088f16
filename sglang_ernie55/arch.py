"""Which model an HF config describes: the one test every patch uses before it acts or falls through.

SGLang serves `architectures[0]` (its ModelConfig and draft-arch logic read that entry), so that entry
alone decides: ERNIE-5.5 is `Ernie5_5_MoeForCausalLM` (target) or `Ernie5_5MoeMTPModel` (the ECHO
draft, named so by the `_config_draft_model` patch). Any config-like object works; None is no model.
"""

from __future__ import annotations

from typing import Any

from .configuration import ARCH_ECHO, ARCHITECTURES


def architecture(hf_config: Any) -> str | None:
    """The ERNIE-5.5 architecture `hf_config` names first, or None for any other model."""
    archs = getattr(hf_config, "architectures", None) or []
    return archs[0] if archs and archs[0] in ARCHITECTURES else None


def is_ernie55(hf_config: Any) -> bool:
    """ERNIE-5.5, target or ECHO draft."""
    return architecture(hf_config) is not None


def is_echo_draft(hf_config: Any) -> bool:
    """The ECHO draft model (`Ernie5_5MoeMTPModel`)."""
    return architecture(hf_config) == ARCH_ECHO
