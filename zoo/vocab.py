"""Tokenizers built locally with the `tokenizers` library: no download, ids always inside the table.

Both tokenizers cover every printable ASCII character on its own, so any ASCII prompt tokenizes
without falling back to <unk>, and a short list of whole words keeps common prompts compact.
"""
from __future__ import annotations

import string

from transformers import CLIPTokenizer, T5Tokenizer

# Whole words that get their own token; everything else splits into single characters.
_WORDS = (
    "a an the of in on at with and or to is are by for from red green blue white black cat dog "
    "bird tree house city river sea sky sun moon night day photo painting video astronaut horse "
    "riding running flying small large old new beautiful landscape portrait mountain forest street"
).split()
_CHARS = tuple(c for c in string.printable if not c.isspace())


def t5_tokenizer(model_max_length: int = 512) -> T5Tokenizer:
    """A T5-style Unigram tokenizer: <pad>=0, </s>=1, <unk>=2 as in the real T5/umT5 vocabularies.

    Pieces are scored so whole words beat their characters (higher log-probability wins).
    Size: 3 specials + 2 x 94 characters + the word list, about 270 ids.
    """
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + w, -1.0) for w in _WORDS]
    pieces += [("\u2581" + c, -4.0) for c in _CHARS]
    pieces += [(c, -5.0) for c in _CHARS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def clip_tokenizer(model_max_length: int = 77) -> CLIPTokenizer:
    """A CLIP-style byte-level BPE: every character and word-final character, plus merges for the words.

    CLIP marks the end of a word with "</w>"; merges build the listed words from their characters.
    """
    vocab: dict[str, int] = {}

    def add(token: str) -> None:
        vocab.setdefault(token, len(vocab))

    for special in ("<|startoftext|>", "<|endoftext|>"):
        add(special)
    for c in _CHARS:
        add(c)
        add(c + "</w>")
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        # Left-to-right merges: (c, a) -> (ca, t</w>) -> cat</w>.
        current = word[0]
        for i, c in enumerate(word[1:], start=1):
            right = c + "</w>" if i == len(word) - 1 else c
            merge = (current, right)
            if merge not in merges:
                merges.append(merge)
            current = current + right
            add(current)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
