"""Only classes SGLang looks up by architecture name (each module defines `EntryClass`)."""

# The backend and pool these models need. SGLang imports this package (ModelRegistry.register) in every
# process that loads the plugin, before HookRegistry.apply_hooks() runs; both calls are idempotent.
# TODO(plugin): move these two calls into plugin.register() and drop them here.
from .. import attention as _attention  # noqa: E402
from .. import layers as _layers  # noqa: E402
from .. import mem_cache as _mem_cache  # noqa: E402

_attention.register()
_layers.register()
_mem_cache.register()
