"""The `ernie55` attention backend (docs/serving-design.md): its name and the factory SGLang's attention
registry calls (registered by patches.py; the CLI choice is a row there too). The backend module is
imported when SGLang builds a backend, not when the plugin loads.
"""

from __future__ import annotations

BACKEND_NAME = "ernie55"


def create_ernie55_backend(model_runner):
    from .backend import Ernie55AttnBackend

    return Ernie55AttnBackend(model_runner)
