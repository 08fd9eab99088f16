"""The SGLang plugin: entry point `sglang.srt.plugins` -> `ernie55` -> `register()`.

SGLang calls `register()` in every process it starts, before it parses arguments: it checks the SGLang
version and every symbol the patch ledger names (`compat`), then applies the ledger (`patches`), once.
"""

from __future__ import annotations

import logging

from . import compat, patches

logger = logging.getLogger(__name__)


def register() -> None:
    """Entry point called by SGLang's plugin loader; safe to call any number of times."""
    if patches.applied():
        return
    compat.check()  # before anything is patched: a wrong SGLang fails here, naming both versions
    patches.register()
    logger.info("sglang-ernie55 plugin registered")
