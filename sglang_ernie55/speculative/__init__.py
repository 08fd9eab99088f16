"""ECHO speculative decoding through SGLang's EAGLE/NEXTN path: draft wiring, weight sharing, hooks."""
