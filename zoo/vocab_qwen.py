"""A Qwen2-style byte-level BPE tokenizer built locally (no download), with Qwen's chat template.

Qwen-Image, HunyuanVideo 1.5 (Qwen2.5-VL) and Z-Image (Qwen3) tokenize through a chat template
(``<|im_start|>role\\n...<|im_end|>``). This tokenizer has the 256 byte symbols GPT-2/Qwen map bytes
to, so any text (any UTF-8) tokenizes without <unk>; merges for a short word list keep prompts
compact; the chat markers are special tokens, as in the real vocabulary.
"""
from __future__ import annotations

from transformers import ByT5Tokenizer, Qwen2Tokenizer

from zoo.vocab import _WORDS

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen3's template, shortened to what the pipelines use: system/user turns, the assistant prompt,
# and Qwen3's empty think block when enable_thinking is False (Z-Image passes True: no block).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte (``bytes_to_unicode``), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def _bpe(parts: list[str], merges: list[tuple[str, str]]) -> list[str]:
    """What byte-level BPE makes of ``parts`` with ``merges`` (lowest rank first), as the tokenizer will."""
    rank = {pair: i for i, pair in enumerate(merges)}
    while True:
        pairs = [(rank[p], i) for i, p in enumerate(zip(parts, parts[1:])) if p in rank]
        if not pairs:
            return parts
        _, i = min(pairs)
        parts = [*parts[:i], parts[i] + parts[i + 1], *parts[i + 2:]]


def qwen_tokenizer(model_max_length: int = 131072) -> Qwen2Tokenizer:
    """Byte symbols + merged words (with and without the leading-space symbol ``Ġ``) + chat specials.

    Size: 256 bytes + about 2 x 90 words' merge chains + 3 specials, about 900 ids.
    """
    vocab: dict[str, int] = {}

    def add(token: str) -> None:
        vocab.setdefault(token, len(vocab))

    for symbol in _byte_symbols():
        add(symbol)
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        for piece in (word, "\u0120" + word):  # Ġ marks a leading space in byte-level BPE
            parts = _bpe(list(piece), merges)
            while len(parts) > 1:  # join what the earlier merges left, left to right, into one token
                merges.append((parts[0], parts[1]))
                parts = [parts[0] + parts[1], *parts[2:]]
                add(parts[0])
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIALS[1:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def qwen_vl_tokenizer() -> Qwen2Tokenizer:
    """:func:`qwen_tokenizer` with Qwen2.5-VL's vision markers as special tokens (the image edit pipelines'
    prompts hold ``<|vision_start|><|image_pad|><|vision_end|>``, which the processor expands to one
    ``<|image_pad|>`` per merged patch). Its own function: the other tiny models' ids stay as they are."""
    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [*SPECIALS[1:], *VISION_SPECIALS]})
    return tokenizer


def byt5_tokenizer() -> ByT5Tokenizer:
    """ByT5 needs no vocabulary file: ids are bytes + 3, after <pad>, </s>, <unk> (HunyuanVideo 1.5's glyph
    encoder). 125 extra ids as the real google/byt5-small: 384 ids in all."""
    return ByT5Tokenizer(extra_ids=125)
