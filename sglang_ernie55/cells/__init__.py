"""Hardware cells (one TOML file per cell under `cells/`), shipped as package data `sglang_ernie55.cells`."""
