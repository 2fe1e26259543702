"""A tiny word-level tokenizer in Hugging Face `tokenizers` format.

The arithmetic task needs only numbers, `+` and `=`; a word-level vocabulary keeps every answer a
single token, so the untrained model's chance of an exact answer is about 1/vocab (near 0) and RL
can raise it within a short CPU run. The files written here (`tokenizer.json`,
`tokenizer_config.json`, `special_tokens_map.json`) are what `AutoTokenizer.from_pretrained` and
vLLM load, so the data path and the rollout engine use the tokenizer the normal way.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
MAX_NUMBER = 19


def vocabulary() -> list[str]:
    """Token strings in id order: the specials (ids 0, 1, 2), the numbers 0..MAX_NUMBER, `+`, `=`."""
    return [*SPECIAL_TOKENS, *(str(i) for i in range(MAX_NUMBER + 1)), "+", "="]


def build_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(out_dir: Path, model_max_length: int) -> None:
    """Write the tokenizer files next to a model checkpoint."""
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": PAD,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": PAD}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def token_id(token: str) -> int:
    return vocabulary().index(token)
