"""The fast tokenizer (``tokenizer.json``, Hugging Face ``tokenizers``) against the tiktoken one, id for id.

Reference: ``KimiHybridTokenizer`` (tiktoken ranks + the Kimi pre-tokenizer regex + its chunking of long runs and
long texts). Candidate: the shipped ``models/kimi-hybrid-stdlib/tokenizer.json`` loaded as
``KimiHybridTokenizerFast`` and as transformers' plain ``PreTrainedTokenizerFast``.

Strings compared in ``test_fast_ids_equal_tiktoken`` (full id sequences and the decode round trip), 49,449 in all
(``test_corpus_size`` pins each group):

* 3,455 regex edge cases: 1,606 hand-written (contractions 's 't 're 've 'm 'll 'd in every case mix, digit runs of
  1-7 digits in several scripts, mixed letters and digits, whitespace runs, trailing spaces, \\r\\n, tabs, Python-only
  spaces U+001C-U+001F, punctuation runs, Han / kana / Hangul, emoji and other non-BMP text, combining marks, odd code
  points such as U+FEFF, U+FFFE, U+10FFFF, NUL) and all 1,849 ordered pairs of 43 short atoms;
* 17,376 strings that hold every Unicode scalar value (U+0000..U+10FFFF without surrogates), 64 consecutive code
  points each;
* 1,065 BPE tie cases from the shipped ranks: for each token ``t`` with a border ``y`` (``t = x + y = y + z``, all
  three tokens), the text ``x + y + z`` where it is valid UTF-8;
* 20,000 random Unicode strings (seed 0, lengths 1-40, ASCII / whitespace / BMP / astral mix);
* 7,000 random byte strings (seed 1, lengths 1-60) decoded as UTF-8 with ``errors="replace"``;
* 400 Python files of this interpreter's standard library (sorted paths, the first 400 that are UTF-8);
* 153 long texts around the chunking limits (runs of 24,999-60,000 spaces / letters / U+001C, a 450,000-character
  text).

Special tokens inside text are compared separately (allowed, split as text, skipped in decode; both layouts). The
one difference: with ``split_special_tokens=True`` the K3 layout's three ``special: false`` markers (``<|open|>``,
``<|close|>``, ``<|sep|>``) stay single ids in the fast class and become text in the slow one (``test_k3_layout``).
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from kimi_hybrid.tokenization_kimi_hybrid import (
    MAX_ENCODE_CHARS,
    MAX_RUN_CHARS,
    KimiHybridTokenizer,
    KimiHybridTokenizerFast,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "kimi-hybrid-stdlib"

N_STDLIB_FILES = 400
N_RANDOM_UNICODE = 20_000
N_RANDOM_BYTES = 7_000


# ----------------------------------------------------------------------------------------------------------------
# the corpus
# ----------------------------------------------------------------------------------------------------------------
CONTRACTIONS = ("s", "t", "re", "ve", "m", "ll", "d")


def _case_variants(suffix: str) -> list[str]:
    """Every upper / lower mix of ``suffix`` ('re' -> re, rE, Re, RE)."""
    out = [""]
    for char in suffix:
        out = [head + c for head in out for c in (char.lower(), char.upper())]
    return out


def _hand_written() -> list[str]:
    out = []
    for suffix in CONTRACTIONS:
        for variant in _case_variants(suffix):
            for word in ("it", "IT", "It", "iT", "中", "x1", "é", ""):
                for prefix in ("", " ", "\n", "'"):
                    out.append(f"{prefix}{word}'{variant}")
                out.append(f"{word}'{variant} x")
                out.append(f"{word}'{variant}'{variant}")
                out.append(f"{word}\u2019{variant}")  # typographic apostrophe: not a contraction
    out += ["it'ſ", "IT'\u017f", "'", "''", "'s", " 's", "don't", "DON'T", "we've", "I'M", "you'LL", "he'd"]
    digit_scripts = ("1234567", "9876543", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666",
                     "\uff11\uff12\uff13\uff14\uff15\uff16\uff17", "\u0967\u0968\u0969\u096a\u096b\u096c\u096d")
    for digits in digit_scripts:
        for n in range(1, 8):
            d = digits[:n]
            out += [d, f"a{d}", f"{d}a", f" {d} ", f"x{d}y{d}", f"{d}.{d}", f"-{d}", f"{d}\n"]
    out += ["\u00b2\u00b3", "\u216b", "\u00bd", "abc123def", "x86_64", "0x1F", "3.14159", "1e-10", "v2.0.1",
            "ABC123abc", "a1b2c3", "HTTPServer2", "utf8Decoder", "__init__", "CamelCaseWord", "lowerUPPER"]
    for k in range(1, 10):
        out += [" " * k, "a" + " " * k, " " * k + "a", "a" + " " * k + "\n", "\n" * k, "\t" * k, "x" + "\t" * k,
                " " * k + "\n" + " " * k + "b", "\r\n" * k, "a" + " " * k + "b"]
    out += ["a \n", "a  \n\n  b", "\n\r", " \t\n", "x   ", "x\t", "x \r\n y", "\u00a0", "a\u00a0b", "\u3000x",
            "\x0b\x0c", "\x1c\x1d\x1e\x1f", "a\x1cb", "\x85", "\u2028\u2029", " \u200b ", "\u2003x"]
    out += ["!!!", "...", "?!?!\n\n", " ---", "==>", "'''", '"""', "#!/usr/bin/env python\n", "a,b;c:d", "(){}[]<>",
            "@#$%^&*", "~`|\\", " ...\r\n", "--\n\n\n", "»«", "¡¿", "。、！", "x!!!", "!!!x"]
    out += ["中文字符", "中文，标点。", "ひらがなカタカナ", "\uff76\uff80\uff76\uff85", "한국어 텍스트", "日本語のテキスト",
            "\U00020000\U00020001", "\u3007", "漢字kanji混ぜ", "中a中", "Ａｂｃ全角"]
    out += ["\U0001f642", "\U0001f469\U0001f3fd\u200d\U0001f4bb", "\U0001f3f3\ufe0f\u200d\U0001f308",
            "\U0001f1eb\U0001f1f7", "\U0001d518\U0001d52b\U0001d526", "\U00013000", "\U0010ffff", "\U000e0001",
            "a\U0001f642b", " \U0001f642 "]
    out += ["e\u0301", "a\u0308\u0301", "\u0301", " \u0301", "x\u20dd", "नमस्ते", "สวัสดี", "السلام", "שלום",
            "\u0915\u094d\u0937", "Ω\u0342"]
    out += ["\x00", "a\x00b", "\x7f", "\ufeff", "\ufeffx", "\ufffd", "\ufffe", "\uffff", "\ue000", "\U000f0000",
            "\u200b\u200c\u200d", "\u0130 \u0131", "\u01c5\u01c8", "\u02b0\u02b2", "\u212a", "ß ẞ", "ﬁ", "ς σ Σ",
            "\u1e9e's", "\u00c5ngstr\u00f6m"]
    return out


ATOMS = ("a", "A", "z9", "'s", "'LL", " ", "  ", "\t", "\n", "\r\n", "1", "1234", "12345678", ".", "!?", " (",
         "中", "文字", "か", "カ", "한", "\U0001f642", "\U00020000", "\u0301", "e\u0301", "\u00a0", "\u3000", "\x1c",
         "\ufeff", "ſ", "Σ", "ǅ", "ʰ", "٣", "½", "_", "-", "'", "\"", "#", "\\", "/", "\x00")


def _edge_cases() -> list[str]:
    return _hand_written() + [a + b for a in ATOMS for b in ATOMS if a + b]


def _every_code_point() -> list[str]:
    scalars = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    return ["".join(map(chr, scalars[i:i + 64])) for i in range(0, len(scalars), 64)]


def _tie_cases(ranks: dict[bytes, int]) -> list[str]:
    """Texts x+y+z for tokens t = x+y = y+z: the two cuts of t compete where tiktoken takes the leftmost."""
    out = []
    for token in sorted(ranks, key=ranks.get):
        for k in range(1, len(token)):
            border = token[:k]
            if token.endswith(border) and token[:-k] in ranks and border in ranks and token[k:] in ranks:
                try:
                    out.append((token[:-k] + border + token[k:]).decode("utf-8"))
                except UnicodeDecodeError:
                    pass
    return out


def _random_unicode(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    spaces = (9, 10, 13, 32, 32, 32, 0x1C, 0x85, 0xA0, 0x3000, 0x2028)
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 40)):
            kind = rng.random()
            if kind < 0.4:
                code = rng.randint(0x20, 0x7E)
            elif kind < 0.5:
                code = rng.choice(spaces)
            elif kind < 0.8:
                code = rng.randint(0x80, 0xFFFF)
            else:
                code = rng.randint(0x10000, 0x10FFFF)
            chars.append(chr(0x41 if 0xD800 <= code < 0xE000 else code))
        out.append("".join(chars))
    return out


def _random_bytes(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [bytes(rng.randrange(256) for _ in range(rng.randint(1, 60))).decode("utf-8", errors="replace")
            for _ in range(n)]


def _stdlib_texts(n: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            out.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if len(out) == n:
            return out
    pytest.fail(f"only {len(out)} UTF-8 stdlib files under {root}, the test needs {n}")


def _long_texts() -> list[str]:
    out = []
    for char in (" ", "x", "\x1c", "é", "\n", "中"):
        for length in (MAX_RUN_CHARS - 1, MAX_RUN_CHARS, MAX_RUN_CHARS + 1, 2 * MAX_RUN_CHARS + 7, 60_000):
            for before, after in (("", ""), ("a", ""), ("", "b"), ("ab ", " cd"), (" ", "x")):
                out.append(before + char * length + after)
    out += [" " * 30_000 + "x" * 30_000 + "\n" * 3, "x" * 30_000 + " " * 30_000 + "y"]
    out.append("def f(x):\n    return x  # ok\n" * (MAX_ENCODE_CHARS // 31 + 2000))  # crosses a 400k chunk cut
    return out


@pytest.fixture(scope="module")
def slow():
    return KimiHybridTokenizer.from_pretrained(str(SHIPPED))


@pytest.fixture(scope="module")
def fast():
    return KimiHybridTokenizerFast.from_pretrained(str(SHIPPED))


@pytest.fixture(scope="module")
def corpus(slow):
    return {
        "edge": _edge_cases(),
        "code_points": _every_code_point(),
        "ties": _tie_cases(slow._ranks),
        "random_unicode": _random_unicode(N_RANDOM_UNICODE, seed=0),
        "random_bytes": _random_bytes(N_RANDOM_BYTES, seed=1),
        "stdlib": _stdlib_texts(N_STDLIB_FILES),
        "long": _long_texts(),
    }


# ----------------------------------------------------------------------------------------------------------------
# ids and decode: tiktoken == tokenizer.json
# ----------------------------------------------------------------------------------------------------------------
def test_corpus_size(corpus):
    sizes = {name: len(texts) for name, texts in corpus.items()}
    assert sizes == {"edge": 3455, "code_points": 17376, "ties": 1065, "random_unicode": 20000,
                     "random_bytes": 7000, "stdlib": 400, "long": 153}
    assert sum(sizes.values()) == 49449
    assert len(_hand_written()) == 1606 and len(ATOMS) == 43
    covered = {ord(c) for text in corpus["code_points"] for c in text}
    assert len(covered) == 0x110000 - 2048


@pytest.mark.parametrize("group", ["edge", "code_points", "ties", "random_unicode", "random_bytes", "stdlib", "long"])
def test_fast_ids_equal_tiktoken(slow, fast, corpus, group):
    texts = corpus[group]
    expected = [slow.encode_ids(text, allow_special=False) for text in texts]
    backend = fast.backend_tokenizer
    got = [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]
    bad = [i for i, (a, b) in enumerate(zip(expected, got)) if a != b]
    assert not bad, f"{len(bad)} of {len(texts)} differ, first: {texts[bad[0]][:80]!r}"
    decoded = backend.decode_batch(got, skip_special_tokens=False)
    bad = [i for i, (text, back) in enumerate(zip(texts, decoded)) if text != back]
    assert not bad, f"{len(bad)} of {len(texts)} do not round-trip, first: {texts[bad[0]][:80]!r}"


def test_transformers_paths_agree(slow, fast, corpus):
    # The transformers wrappers (slow: added-token trie + tiktoken; fast: tokenizers) on a sample of each group.
    for texts in corpus.values():
        for text in [t for t in texts if len(t) <= 30_000][:: max(1, len(texts) // 40)]:
            ids = slow.encode(text)
            assert fast.encode(text) == ids
            assert fast(text)["input_ids"] == ids
            assert fast.decode(ids) == slow.decode(ids) == text


# ----------------------------------------------------------------------------------------------------------------
# special tokens
# ----------------------------------------------------------------------------------------------------------------
SPECIAL_TEXTS = [
    "a<|im_end|>b[EOS]",
    "[BOS]x[EOS]",
    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "x<|im_end|",
    "<|im_end|><|im_end|>  <|im_end|>\n",
    " <|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
    "<|reserved_token_8300|>[PAD][UNK]",
    "[EOS[EOS]]",
    "中<|im_end|>中 's<|im_end|>'s",
    "<|open|>message<|sep|>x<|close|>",
]


@pytest.mark.parametrize("text", SPECIAL_TEXTS)
def test_special_tokens_in_text(slow, fast, text):
    ids = slow.encode(text)
    assert fast.encode(text) == ids
    assert fast.decode(ids) == slow.decode(ids) == text
    assert fast.decode(ids, skip_special_tokens=True) == slow.decode(ids, skip_special_tokens=True)
    # Special names as plain text (the tiktoken tokenizer's disallowed / ordinary handling).
    plain = slow.encode(text, split_special_tokens=True)
    assert plain == slow.encode_ids(text, allow_special=False)
    assert fast.encode(text, split_special_tokens=True) == plain
    assert max(plain) < 8192


def test_special_ids_and_names(slow, fast):
    assert len(fast) == len(slow) == 8448
    assert fast.get_vocab() == slow.get_vocab()
    assert fast.added_tokens_decoder.keys() == slow.added_tokens_decoder.keys()
    assert all(str(fast.added_tokens_decoder[i]) == str(t) for i, t in slow.added_tokens_decoder.items())
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(fast, f"{name}_token") == getattr(slow, f"{name}_token")
        assert getattr(fast, f"{name}_token_id") == getattr(slow, f"{name}_token_id")
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (8192, 8193, 8447)
    assert sorted(fast.all_special_ids) == sorted(slow.all_special_ids)
    assert fast.convert_ids_to_tokens(list(range(8448))) == slow.convert_ids_to_tokens(list(range(8448)))


def test_k3_layout(slow):
    # The XTML markers are added tokens with special=False: matched in text, kept by skip_special_tokens.
    k3 = KimiHybridTokenizer(str(SHIPPED / "tiktoken.model"), chat_format="kimi-k3")
    k3_fast = k3.to_fast()
    assert k3_fast.chat_format == "kimi-k3" and k3_fast.chat_template == k3.chat_template
    text = '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>[EOS]'
    ids = k3.encode(text)
    assert k3_fast.encode(text) == ids and ids[0] == 8195
    assert k3_fast.decode(ids, skip_special_tokens=True) == k3.decode(ids, skip_special_tokens=True)
    # split_special_tokens=True: equal for the special=True names; the three special=False XTML markers stay ids in
    # the fast class (transformers' tokenizers backend splits special tokens only) and become text in the slow class
    # (transformers' Python backend splits every added token). The one documented difference.
    plain_slow = k3.encode(text, split_special_tokens=True)
    assert plain_slow == k3.encode_ids(text, allow_special=False)
    pieces = text.replace("<|open|>", "\0<|open|>\0").replace("<|sep|>", "\0<|sep|>\0")
    pieces = pieces.replace("<|close|>", "\0<|close|>\0").split("\0")
    markers = {"<|open|>": 8195, "<|close|>": 8196, "<|sep|>": 8197}
    expected = [i for piece in pieces if piece
                for i in ([markers[piece]] if piece in markers else k3.encode_ids(piece, allow_special=False))]
    assert k3_fast.encode(text, split_special_tokens=True) == expected
    assert 8194 not in expected and 8193 not in expected
    conv = [{"role": "user", "content": "hi"}]
    assert k3_fast.apply_chat_template(conv) == k3.apply_chat_template(conv)
    assert k3_fast.apply_chat_template(conv, tokenize=True, return_dict=False) == k3.apply_chat_template(
        conv, tokenize=True, return_dict=False)


# ----------------------------------------------------------------------------------------------------------------
# the file, loading and saving
# ----------------------------------------------------------------------------------------------------------------
def test_shipped_tokenizer_json_is_current(slow):
    shipped = json.loads((SHIPPED / "tokenizer.json").read_text(encoding="utf-8"))
    assert shipped == json.loads(slow.backend_tokenizer_for_fast().to_str())
    model = shipped["model"]
    assert model["type"] == "BPE" and model["ignore_merges"] is True and len(model["vocab"]) == 8192
    assert [t["id"] for t in shipped["added_tokens"]] == list(range(8192, 8448))
    split = shipped["pre_tokenizer"]["pretokenizers"][2]
    assert split["type"] == "Split" and split["pattern"]["Regex"] == slow.pat_str  # the Kimi regex, unchanged


def test_plain_transformers_loading(slow):
    # No Kimi code involved: what a serving stack gets from tokenizer.json + tokenizer_config.json.
    plain = PreTrainedTokenizerFast.from_pretrained(str(SHIPPED))
    text = "<|im_user|>user<|im_middle|>def f(x):\n    return x's 1234567 中文 🙂<|im_end|>"
    assert plain.encode(text) == slow.encode(text)
    assert (plain.bos_token_id, plain.eos_token_id, plain.pad_token_id, plain.unk_token_id) == (8192, 8193, 8447,
                                                                                                 8446)
    assert plain.chat_template == slow.chat_template
    conv = [{"role": "user", "content": "hi"}]
    assert plain.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) == slow.apply_chat_template(
        conv)
    by_file = PreTrainedTokenizerFast(tokenizer_file=str(SHIPPED / "tokenizer.json"), bos_token="[BOS]",
                                      eos_token="[EOS]", pad_token="[PAD]")
    assert by_file.encode(text) == slow.encode(text) and by_file.pad_token_id == 8447


def test_chat_template_conventions(slow, fast):
    conv = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    assert fast.chat_format == "kimi-linear" and fast.chat_template == slow.chat_template
    assert fast.apply_chat_template(conv, tools=tools) == slow.apply_chat_template(conv, tools=tools)
    assert fast.apply_chat_template(conv, tokenize=True, return_dict=False) == slow.apply_chat_template(
        conv, tokenize=True, return_dict=False)
    with pytest.raises(ValueError, match="tokenize=True"):
        fast.apply_chat_template(conv, tokenize=False, return_tensors="pt")


def test_save_pretrained_writes_tokenizer_json(slow, tmp_path):
    slow.save_pretrained(str(tmp_path / "slow"))
    assert (tmp_path / "slow" / "tokenizer.json").read_text(encoding="utf-8") == slow.backend_tokenizer_for_fast(
    ).to_str(pretty=True)
    again = KimiHybridTokenizer.from_pretrained(str(tmp_path / "slow"))  # the slow class ignores tokenizer.json
    assert type(again) is KimiHybridTokenizer and again.get_vocab() == slow.get_vocab()
    fast = KimiHybridTokenizerFast.from_pretrained(str(tmp_path / "slow"))
    text = "x = 1<|im_end|>\n  中's 12345"
    assert fast.encode(text) == slow.encode(text)
    fast.save_pretrained(str(tmp_path / "fast"))
    fast2 = KimiHybridTokenizerFast.from_pretrained(str(tmp_path / "fast"))
    assert fast2.encode(text) == slow.encode(text) and fast2.chat_template == slow.chat_template
    assert fast2.chat_format == "kimi-linear" and fast2.pad_token_id == 8447
    # the fast class saves tiktoken.model too: the folder still loads the (default) slow class
    from transformers import AutoTokenizer

    assert (tmp_path / "fast" / "tiktoken.model").read_bytes() == (SHIPPED / "tiktoken.model").read_bytes()
    auto = AutoTokenizer.from_pretrained(str(tmp_path / "fast"))
    # (by name: until the package has one import name, the Auto mapping may hold the other copy of the class)
    assert type(auto).__name__ == "KimiHybridTokenizer" and not auto.is_fast and auto.encode(text) == slow.encode(text)


def test_fast_needs_tokenizer_json(tmp_path):
    (tmp_path / "tiktoken.model").write_bytes((SHIPPED / "tiktoken.model").read_bytes())
    (tmp_path / "tokenizer_config.json").write_bytes((SHIPPED / "tokenizer_config.json").read_bytes())
    with pytest.raises(ValueError, match="needs a tokenizer.json"):
        KimiHybridTokenizerFast.from_pretrained(str(tmp_path))


def test_released_size_vocab_builds(tmp_path):
    # A tiktoken.model with the released rank count: ids of the fast tokenizer equal tiktoken's there too.
    import base64

    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    words = [f"{w}{i}".encode() for i in range(163_584 // 3 + 1) for w in (" w", "v", "_x")][: 163_584 - 256]
    lines += [f"{base64.b64encode(w).decode()} {256 + i}" for i, w in enumerate(words)]
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    big = KimiHybridTokenizer(str(tmp_path / "tiktoken.model"))
    big_fast = big.to_fast()
    assert len(big_fast) == 163_840 and big_fast.eos_token_id == 163_585 and big_fast.pad_token_id == 163_839
    text = "v12 w7 _x99<|im_end|> w163000 v5 中 🙂 it's"
    assert big_fast.encode(text) == big.encode(text)


def test_special_token_inside_a_long_run(slow, fast):
    # A name that a 25,000-character run cut would split is still one special id (both paths of both classes).
    text = "x" * (MAX_RUN_CHARS - 10) + "[EOS]" + "x" * 100 + " " * (MAX_RUN_CHARS - 2) + "<|im_end|>  y"
    ids = slow.encode(text)
    assert ids.count(8193) == 1 and ids.count(8194) == 1
    assert slow.encode_ids(text) == ids and fast.encode(text) == ids
    assert fast.decode(ids) == text
