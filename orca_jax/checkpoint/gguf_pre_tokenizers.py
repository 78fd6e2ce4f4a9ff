"""How a GGUF's byte-level BPE vocabulary cuts text before merging: its pre-tokenizer.

A GGUF records only the pre-tokenizer's name (`tokenizer.ggml.pre`, llama.cpp's names); the patterns
live in code, in llama.cpp and here. Each name maps to the regexes the model's own tokenizer.json
splits by, applied in turn: every match, and every stretch of text between two matches, becomes a
piece of its own (an "isolated" Split), and byte-level BPE then merges within each piece. Where
llama.cpp spells a pattern out for its regex engine (contractions in any case written as character
classes), the model's original is kept: `tokenizers` runs it as it is.

tests/checkpoint/test_llama_cpp_vocab_vectors.py holds every name here that llama.cpp ships a
vocabulary for to that model's ids on llama.cpp's test texts.
"""

from __future__ import annotations

# GPT-2's: contractions, then letters, digits or other symbols each with at most one space before
# them, then whitespace (a run before a word leaves its last space to the word).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _tiktoken_style(numbers: str, letters: str = r"\p{L}", others: str = r"\s\p{L}\p{N}") -> str:
    """Llama 3's and Qwen's: contractions in any case, a word may take one non-letter before it, line
    breaks stay with the symbols or whitespace before them; `numbers` says how digits group."""
    return (rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{{L}}\p{{N}}]?{letters}+|{numbers}"
            rf"| ?[^{others}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# DeepSeek's letters: the cased letters of its tokenizer.json's class (not every \p{L}; CJK is a
# piece pattern of its own).
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # CJK ideographs and Hangul syllables, in runs

# name -> the regexes, in order.
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (GPT2,),
    "gpt2": (GPT2,),
    "gpt-2": (GPT2,),  # llama.cpp's spelling
    "mpt": (GPT2,),  # GPT-NeoX's tokenizer
    # every digit alone first (a Digits step), then GPT-2's
    "smollm": (r"\p{N}", GPT2),
    "starcoder": (r"\p{N}", GPT2),
    "refact": (r"\p{N}", GPT2),
    "command-r": (r"\p{N}", GPT2),
    # runs of punctuation (Unicode's, and ASCII's symbols) first, then GPT-2's, then digits in threes
    "falcon": (r"[\p{P}$+<=>^~|`]+", GPT2, r"[0-9][0-9][0-9]"),
    "llama-bpe": (_tiktoken_style(r"\p{N}{1,3}"),),  # Llama 3
    "qwen2": (_tiktoken_style(r"\p{N}"),),
    "qwen35": (_tiktoken_style(r"\p{N}", letters=r"[\p{L}\p{M}]", others=r"\s\p{L}\p{M}\p{N}"),),
    # line breaks alone; letters, then ASCII and full-width punctuation, each with at most one space
    # before them; trailing whitespace; CJK and Hangul runs; digits
    "deepseek-llm": ("[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+",
                     "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK_HANGUL,
                     r"\p{N}+"),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
}

# Vocabularies whose tokenizer.json says `ignore_merges`: a piece that is a token of the vocabulary
# is that token, even where the merges would not reach it (Llama 3's " Việt").
IGNORE_MERGES = frozenset({"llama-bpe"})
