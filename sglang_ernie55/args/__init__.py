"""Server-argument defaults and validation for the ERNIE-5.5 architectures (issue: server arguments)."""


def register() -> None:
    """Register model overrides and resolution hooks with SGLang (filled in by the server-args work)."""
