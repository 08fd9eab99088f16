"""The tiny checkpoints' byte-level BPE tokenizer: BOS exactly once, through transformers and through SGLang."""

from __future__ import annotations

import json

import pytest

from sglang_ernie55.checkpoint.tokenizer import build_tokenizer, write_tokenizer

PROMPT = "Question: What is 15% of 240?\nAnswer:"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    ids = write_tokenizer(d, 512)
    assert ids == {"bos": 1, "eos": 2, "unk": 0, "pad": 3}
    return d


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.fixture(scope="module")
def sglang_tok(tok_dir):
    from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

    return get_tokenizer(str(tok_dir))


def test_files_and_special_ids(tok_dir, hf_tok):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<s>" and cfg["eos_token"] == "</s>" and cfg["add_bos_token"] is True
    assert cfg["model_max_length"] == 1048576
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.unk_token_id, hf_tok.pad_token_id) == (
        1,
        2,
        0,
        3,
    )
    assert len(hf_tok) <= 512


def test_build_is_deterministic():
    assert build_tokenizer(512).to_str() == build_tokenizer(512).to_str()
    with pytest.raises(ValueError, match="too small"):
        build_tokenizer(100)


def test_prompt_tokenizes_sensibly(hf_tok):
    ids = hf_tok(PROMPT)["input_ids"]
    pieces = hf_tok.convert_ids_to_tokens(ids)
    assert ids[0] == 1 and ids.count(1) == 1 and 2 not in ids  # BOS once, no EOS
    assert "Question" in pieces and "ĠWhat" in pieces and "Ġ240" in pieces  # words and numbers merge
    assert len(ids) <= len(PROMPT) // 2
    assert hf_tok.decode(ids, skip_special_tokens=True) == PROMPT
    assert hf_tok.decode(ids) == "<s>" + PROMPT


@pytest.mark.parametrize("text", ["", "x", "héllo wörld ✓ 漢字", " 36", "\n\n", PROMPT * 3])
def test_bos_once_and_byte_round_trip(hf_tok, text):
    ids = hf_tok.encode(text)
    assert ids[:1] == [1] and ids.count(1) == 1 and 0 not in ids  # byte-level: never <unk>
    assert hf_tok.decode(ids[1:]) == text
    assert hf_tok.encode(text, add_special_tokens=False) == ids[1:]


def test_users_bos_text_is_not_a_second_bos(hf_tok):
    for text in ("<s>" + PROMPT, "<s><s>" + PROMPT, "a </s> b <unk>"):
        ids = hf_tok(text)["input_ids"]
        assert ids[0] == 1 and ids.count(1) == 1 and 2 not in ids and 0 not in ids
        assert hf_tok.decode(ids[1:]) == text


def test_sglang_encodes_bos_once(sglang_tok):
    """SGLang's TokenizerManager calls `tokenizer(texts)` on the tokenizer from its `get_tokenizer`."""
    batch = sglang_tok([PROMPT, "<s>" + PROMPT, "<s>"])["input_ids"]
    plain = batch[0]
    assert plain[0] == 1 and plain.count(1) == 1
    for ids in batch[1:]:
        assert ids[0] == 1 and ids.count(1) == 1
    assert batch[1][-len(plain) + 1 :] == plain[1:]
    assert sglang_tok.encode(PROMPT) == plain
