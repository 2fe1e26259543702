"""Tokenizers for the data tests: the project's tiny word-level tokenizer (one token per whitespace-separated word,
so prompt lengths are hand-countable), with or without a small hand-written chat template."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from megarl.data.tokenizer import BOS, EOS, PAD, build_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def word_tokenizer(chat: bool) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), bos_token=BOS, eos_token=EOS,
                                        pad_token=PAD, unk_token=PAD)
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
