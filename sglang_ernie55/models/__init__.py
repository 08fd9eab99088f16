"""Only classes SGLang looks up by architecture name (each module defines `EntryClass`)."""
