"""The README's main job on a CPU-only machine: says so, writes the checkpoint, shows the plugin's defaults
and the reference's greedy answer (and returns 0)."""

from __future__ import annotations

from sglang_ernie55.cli.main import main


def test_demo_cpu_part(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["demo", "--cpu", "--out", str(out), "--max-tokens", "4"]) == 0
    text = capsys.readouterr().out
    assert "no server is started" in text
    assert "attention_backend='ernie55'" in text and "page_size=256" in text
    assert "swa_full_tokens_ratio=0.1" in text and "kv_cache_dtype='fp8_e4m3'" in text
    assert "reference model, greedy" in text
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
