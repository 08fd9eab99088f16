"""Only classes SGLang looks up by architecture name (each module defines `EntryClass`).

The backend, pools and hooks these models need are registered by `sglang_ernie55.plugin.register()`.
"""
