"""A small byte-level BPE tokenizer for tiny checkpoints, built offline with `tokenizers` from the built-in
corpus below (prose, arithmetic Q/A, digits, punctuation); deterministic, and every string encodes.
Special tokens (ids as in `tiny_config()`): 0 `<unk>`, 1 `<s>` (BOS), 2 `</s>` (EOS), 3 `<pad>`; BOS is added
once per encoded sequence, no EOS, and a `<s>` typed in a prompt stays text (`split_special_tokens`).
"""

from __future__ import annotations

import json
from pathlib import Path

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)  # ids 0, 1, 2, 3
MODEL_MAX_LENGTH = 1048576

_PROSE = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Question: What is the capital of France?
Answer: Paris
Question: How many days are there in a week?
Answer: There are 7 days in a week.
The model reads the text one token at a time and predicts what comes next. When the answer is a
number, it writes the digits; when it is a word, it writes the word. Every prompt starts with the
beginning-of-sequence token, exactly once.
Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.
How many clips did Natalia sell altogether in April and May? She sold 48 / 2 = 24 clips in May,
so 48 + 24 = 72 clips in total. The answer is 72.
Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.
How much did she earn? 12 / 60 = 0.2 per minute; 0.2 * 50 = 10. The answer is 10.
In the beginning there was the word, and the word was written down, and people read it again
and again. Science, history, language, music and mathematics are all part of what we learn.
"It is 3:45 pm," she said; "the train leaves at 4:10 (platform #2)!" [Note: tickets cost 15% more.]
Email: someone@example.com, web: https://example.com/path?x=1&y=2 - 100% <ok> {a: b} | c ~ d ^ e
def add(a, b):
    return a + b
for i in range(10):
    print(i, i * i)
"""


def _arithmetic() -> str:
    lines = []
    for a, b in [(15, 240), (20, 50), (7, 8), (12, 12), (3, 99), (25, 400), (10, 1000), (50, 64)]:
        lines.append(f"Question: What is {a}% of {b}?\nAnswer: {a * b / 100:g}")
        lines.append(f"Question: What is {a} + {b}?\nAnswer: {a + b}")
        lines.append(f"Question: What is {a} * {b}?\nAnswer: {a * b}")
        lines.append(f"Question: What is {b} - {a}?\nAnswer: {b - a}")
    lines.append(" ".join(str(i) for i in range(200)))
    lines.append("0123456789 +-*/=%.,;:!?'\"()[]{}<>@#$&_^~`|\\")
    return "\n".join(lines)


def corpus() -> list[str]:
    """The built-in training text, a few times over so frequent pieces merge first."""
    text = _PROSE + "\n" + _arithmetic()
    return [line for line in text.splitlines() if line.strip()] * 4


def build_tokenizer(vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` with at most `vocab_size` tokens (specials included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(SPECIAL_TOKENS) + len(alphabet):
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level tokenizer "
            f"(needs >= {len(SPECIAL_TOKENS) + len(alphabet)})"
        )
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 $B:1",
        special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))],
    )
    return tok


def tokenizer_config(model_max_length: int = MODEL_MAX_LENGTH) -> dict:
    """tokenizer_config.json: special tokens, BOS added once (by the post-processor), no EOS."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        # "<s>" typed by a user is text, not the BOS token: BOS comes only from the post-processor. The flag
        # lives here because `tokenizers`' own `encode_special_tokens` is not serialized in tokenizer.json.
        "split_special_tokens": True,
        "padding_side": "left",
    }


def write_tokenizer(out_dir: str | Path, vocab_size: int, model_max_length: int = MODEL_MAX_LENGTH) -> dict:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json. Returns the special ids."""
    out = Path(out_dir)
    tok = build_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2) + "\n"
    )
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return {
        name: SPECIAL_TOKENS.index(t) for name, t in (("bos", BOS), ("eos", EOS), ("unk", UNK), ("pad", PAD))
    }
