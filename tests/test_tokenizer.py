"""Tests of KimiHybridTokenizer (modeling_kimi_hybrid/tokenization_kimi_hybrid.py) and the shipped stdlib tokenizer.

CPU only, no network. The released Kimi `tiktoken.model` cannot be downloaded here, so a synthetic file with the
released rank count (163584) stands in for it: the ids of the specials depend only on that count and on the names
in tokenizer_config.json, and they are checked against the table of docs/checkpoint-format.md section 4 and
docs/k3.md section 8.
"""

from __future__ import annotations

import base64
import importlib
import json
from pathlib import Path

import pytest
from jinja2.exceptions import TemplateError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "kimi-hybrid-stdlib"


import kimi_hybrid.tokenization_kimi_hybrid as tk  # noqa: E402
import prepare_stdlib_corpus as corpus  # noqa: E402  (examples/ is on the test path: pyproject's pytest pythonpath)

KimiHybridTokenizer = tk.KimiHybridTokenizer

RELEASED_RANKS = 163584
# docs/checkpoint-format.md section 4 (Kimi-Linear / K2).
RELEASED_K2_IDS = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|start_header_id|>": 163590,
    "<|end_header_id|>": 163591,
    "[EOT]": 163593,
    "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601,
    "[UNK]": 163838,
    "[PAD]": 163839,
}
# docs/k3.md section 8 (K3 XTML).
RELEASED_K3_IDS = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|end_of_msg|>": 163586,
    "<|open|>": 163587,
    "<|close|>": 163588,
    "<|sep|>": 163589,
    "[start_header_id]": 163590,
    "[end_header_id]": 163591,
    "[EOT]": 163593,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "[UNK]": 163838,
    "[PAD]": 163839,
}


# ----------------------------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return KimiHybridTokenizer.from_pretrained(str(SHIPPED))


@pytest.fixture(scope="module")
def tok_k3():
    return KimiHybridTokenizer(str(SHIPPED / "tiktoken.model"), chat_format="kimi-k3")


def _write_synthetic_ranks(path: Path, n_ranks: int) -> None:
    """256 single bytes (rank = byte) plus generated multi-byte tokens up to `n_ranks` ranks."""
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    lines += [f"{base64.b64encode(f'tok{i}'.encode()).decode()} {256 + i}" for i in range(n_ranks - 256)]
    path.write_text("\n".join(lines) + "\n")


def _released_config(names: dict[str, int]) -> dict:
    by_id = {v: k for k, v in names.items()}
    decoder = {}
    for token_id in range(RELEASED_RANKS, RELEASED_RANKS + 256):
        name = by_id.get(token_id, f"<|reserved_token_{token_id}|>")
        decoder[str(token_id)] = {
            "content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": name not in ("<|open|>", "<|close|>", "<|sep|>"),
        }
    return {
        "tokenizer_class": "TikTokenTokenizer",  # the released class name; we load with our class explicitly
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "model_max_length": 1048576, "added_tokens_decoder": decoder,
    }


@pytest.fixture(scope="module")
def released_dirs(tmp_path_factory):
    """Two released-like tokenizer folders (K2/Kimi-Linear names and K3 names) over a 163584-rank file."""
    base = tmp_path_factory.mktemp("released")
    out = {}
    for kind, names in (("kimi-linear", RELEASED_K2_IDS), ("kimi-k3", RELEASED_K3_IDS)):
        folder = base / kind
        folder.mkdir()
        if not out:
            _write_synthetic_ranks(folder / "tiktoken.model", RELEASED_RANKS)
        else:
            (folder / "tiktoken.model").write_bytes((base / "kimi-linear" / "tiktoken.model").read_bytes())
        (folder / "tokenizer_config.json").write_text(json.dumps(_released_config(names)))
        out[kind] = folder
    return out


# ----------------------------------------------------------------------------------------------------------------
# special-token layout
# ----------------------------------------------------------------------------------------------------------------
def test_shipped_layout_exact_ids(tok):
    assert tok.n_ranks == 8192
    assert tok.vocab_size == len(tok) == 8448
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (8192, 8193, 8446, 8447)
    expected = {name: i - RELEASED_RANKS + 8192 for name, i in RELEASED_K2_IDS.items()}
    assert tok.convert_tokens_to_ids(list(expected)) == list(expected.values())
    assert tok.convert_ids_to_tokens([8197, 8200, 8208, 8210, 8445]) == [
        "<|reserved_token_8197|>", "<|reserved_token_8200|>", "<|reserved_token_8208|>",
        "<|reserved_token_8210|>", "<|reserved_token_8445|>",
    ]
    assert sorted(tok.added_tokens_decoder) == list(range(8192, 8448))
    assert tok.chat_format == "kimi-linear"


def test_released_k2_layout_exact_ids(released_dirs):
    t = KimiHybridTokenizer.from_pretrained(str(released_dirs["kimi-linear"]))
    assert t.n_ranks == RELEASED_RANKS and len(t) == t.vocab_size == 163840
    assert t.chat_format == "kimi-linear"
    for name, token_id in RELEASED_K2_IDS.items():
        assert t.convert_tokens_to_ids(name) == token_id, name
        assert t.convert_ids_to_tokens(token_id) == name
    assert (t.bos_token_id, t.eos_token_id, t.unk_token_id, t.pad_token_id) == (163584, 163585, 163838, 163839)
    assert t.convert_ids_to_tokens(163592) == "<|reserved_token_163592|>"
    # The class layout alone (no tokenizer_config) gives the same table.
    bare = KimiHybridTokenizer(str(released_dirs["kimi-linear"] / "tiktoken.model"))
    assert {n: bare.convert_tokens_to_ids(n) for n in RELEASED_K2_IDS} == RELEASED_K2_IDS
    ids = t.encode("<|im_user|>user<|im_middle|>hi<|im_end|>")
    assert ids[0] == 163587 and ids[-1] == 163586 and 163601 in ids


def test_released_k3_layout_exact_ids(released_dirs):
    t = KimiHybridTokenizer.from_pretrained(str(released_dirs["kimi-k3"]))
    assert t.chat_format == "kimi-k3"  # inferred from slot 2 = <|end_of_msg|>
    assert {n: t.convert_tokens_to_ids(n) for n in RELEASED_K3_IDS} == RELEASED_K3_IDS
    assert t.added_tokens_decoder[163587].special is False  # <|open|> / <|close|> / <|sep|> are special: false
    assert t.added_tokens_decoder[163586].special is True
    bare = KimiHybridTokenizer(str(released_dirs["kimi-k3"] / "tiktoken.model"), chat_format="kimi-k3")
    assert {n: bare.convert_tokens_to_ids(n) for n in RELEASED_K3_IDS} == RELEASED_K3_IDS
    prompt = t.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, return_dict=False)
    think = t.encode_ids("think", allow_special=False)  # bytes only in the synthetic file: 5 ids
    assert prompt[:1] == [163587] and prompt[-(len(think) + 3):] == [163589, 163587] + think + [163589]
    assert t.decode(prompt).endswith('<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>think<|sep|>')


def test_shipped_k3_layout(tok_k3):
    assert tok_k3.convert_tokens_to_ids(["<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "<|media_pad|>"]) == [
        8194, 8195, 8196, 8197, 8213,
    ]
    assert tok_k3.convert_ids_to_tokens(8202) == "<|reserved_token_8202|>"


# ----------------------------------------------------------------------------------------------------------------
# the shipped BPE file and round trips
# ----------------------------------------------------------------------------------------------------------------
def test_shipped_tiktoken_file():
    lines = (SHIPPED / "tiktoken.model").read_text().splitlines()
    assert len(lines) == 8192
    ranks = {base64.b64decode(tokb): int(rank) for tokb, rank in (line.split() for line in lines)}
    assert sorted(ranks.values()) == list(range(8192))
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert ranks[b"  "] == 256  # the most frequent pair in Python source: two spaces of indentation


UNICODE_SAMPLES = [
    "",
    "hello world",
    "def f(x):\n\treturn x ** 2  # square\r\n",
    "héllo wörld ÅÄÖ ﬁ ß İ",
    "中文字符和日本語のテキスト、한국어 텍스트",
    "emoji 🙂👩🏽‍💻🏳️‍🌈 and ZWJ",
    "e\u0301 combining a\u0308 and \u200b zero width \ufeff bom",
    "עברית العربية mixed RTL",
    "\x00\x01\x1f control \x7f bytes",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 astral 𓀀",
    " " * 30_000 + "x" * 30_000 + "\n" * 3,  # longer than the 25k run limit: exercises chunking
    "don't I'LL we've 123456789 3.14159",
]


@pytest.mark.parametrize("text", UNICODE_SAMPLES, ids=range(len(UNICODE_SAMPLES)))
def test_unicode_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < 8192 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode_ids(text) == ids  # fast tiktoken path == slow transformers path


def _heldout_files():
    manifest = json.loads((SHIPPED / "corpus_manifest.json").read_text())
    modules = set(manifest["splits"]["heldout"]["modules"])
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    return [(rel, root / rel) for rel in corpus.list_stdlib_files(root) if corpus.module_of(rel) in modules]


def test_heldout_stdlib_round_trip(tok):
    files = _heldout_files()
    assert len(files) >= 5
    n_bytes = n_tokens = 0
    for rel, path in files:
        text = path.read_text(encoding="utf-8")
        ids = tok.encode_ids(text, allow_special=False)
        assert tok.decode(ids) == text, rel
        n_bytes += len(text.encode("utf-8"))
        n_tokens += len(ids)
    # Trained on ~11 MB of stdlib code; held-out compression measured at about 4.06 bytes/token (python 3.11).
    assert 3.5 < n_bytes / n_tokens < 4.6


def test_heldout_slow_path_matches_fast_path(tok):
    rel, path = _heldout_files()[0]
    text = path.read_text(encoding="utf-8")[:20_000]
    assert tok.encode(text, split_special_tokens=True) == tok.encode_ids(text, allow_special=False)


def test_split_assignment_is_by_module_and_deterministic():
    assert corpus.module_of("json/decoder.py") == "json"
    assert corpus.module_of("os.py") == "os"
    manifest = json.loads((SHIPPED / "corpus_manifest.json").read_text())
    for split, info in manifest["splits"].items():
        for module in info["modules"]:
            assert corpus.is_heldout(module, manifest["seed"], manifest["heldout_frac"]) == (split == "heldout")
    assert not set(manifest["splits"]["train"]["modules"]) & set(manifest["splits"]["heldout"]["modules"])


# ----------------------------------------------------------------------------------------------------------------
# special tokens, token <-> id conversions
# ----------------------------------------------------------------------------------------------------------------
def test_special_tokens_not_split_when_allowed(tok):
    text = "a<|im_end|>b[EOS]"
    ids = tok.encode(text)
    assert ids.count(8194) == 1 and ids[-1] == 8193
    assert tok.encode_ids(text) == ids
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "ab"
    plain = tok.encode(text, split_special_tokens=True)
    assert max(plain) < 8192 and tok.decode(plain) == text
    assert tok.encode_ids(text, allow_special=False) == plain
    assert tok.tokenize("x<|im_middle|>y") == ["x", "<|im_middle|>", "y"]


def test_convert_tokens_to_ids(tok):
    ids = tok.encode("    return self.value  # ok")
    tokens = tok.convert_ids_to_tokens(ids)
    assert tokens[0] == "ĠĠĠ" or tokens[0].startswith("Ġ")  # GPT-2 alphabet: space -> Ġ
    assert tok.convert_tokens_to_ids(tokens) == ids
    assert tok.convert_tokens_to_string(tokens) == "    return self.value  # ok"
    assert tok.convert_tokens_to_ids("definitely-not-a-token") == tok.unk_token_id == 8446
    assert tok.get_vocab()["<|im_end|>"] == 8194 and len(tok.get_vocab()) == 8448


def test_no_bos_added_by_default(tok):
    assert tok("x")["input_ids"] == tok.encode_ids("x")


def test_save_load_round_trip(tok, tok_k3, tmp_path):
    for t, sub in ((tok, "a"), (tok_k3, "b")):
        t.save_pretrained(str(tmp_path / sub))
        again = KimiHybridTokenizer.from_pretrained(str(tmp_path / sub))
        assert again.chat_format == t.chat_format
        assert again.get_vocab() == t.get_vocab()
        assert again.all_special_ids == t.all_special_ids
        assert again.chat_template == t.chat_template
        sample = "x = 1<|end_of_msg|><|im_end|>\n"
        assert again.encode(sample) == t.encode(sample)
        config = json.loads((tmp_path / sub / "tokenizer_config.json").read_text())
        assert config["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi_hybrid.KimiHybridTokenizer"
        assert config["chat_format"] == t.chat_format


def test_shipped_config_files():
    config = json.loads((SHIPPED / "tokenizer_config.json").read_text())
    # no code in the shipped folder, so no auto_map (save_pretrained writes both into folders that leave the repo)
    assert "auto_map" not in config and config["tokenizer_class"] == "KimiHybridTokenizer"
    assert len(config["added_tokens_decoder"]) == 256
    assert config["added_tokens_decoder"]["8194"]["content"] == "<|im_end|>"
    assert config["chat_template"] == tk.KIMI_LINEAR_CHAT_TEMPLATE
    assert config["model_max_length"] == 8192
    special_map = json.loads((SHIPPED / "special_tokens_map.json").read_text())
    assert (special_map["bos_token"], special_map["eos_token"], special_map["pad_token"]) == ("[BOS]", "[EOS]", "[PAD]")


# ----------------------------------------------------------------------------------------------------------------
# chat templates
# ----------------------------------------------------------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "description": "Weather of a city"}},
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.",
     "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "18C, sunny"},
    {"role": "assistant", "content": "18C and sunny."},
    {"role": "user", "content": "Thanks", "name": "Ann \"A&B\""},
]
TOOLS_JSON = (
    '[{"function":{"description":"Weather of a city","name":"get_weather","parameters":{"properties":'
    '{"city":{"type":"string"}},"required":["city"],"type":"object"}},"type":"function"}]'
)


def test_kimi_linear_template_exact(tok):
    rendered = tok.apply_chat_template(CONVERSATION, tools=TOOLS)
    expected = (
        "<|im_system|>tool_declare<|im_middle|>" + TOOLS_JSON + "<|im_end|>"
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Checking."
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18C, sunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>18C and sunny.<|im_end|>"
        '<|im_user|>Ann "A&B"<|im_middle|>Thanks<|im_end|>'
        "<|im_assistant|>assistant<|im_middle|>"
    )
    assert rendered == expected
    no_prompt = tok.apply_chat_template(CONVERSATION[:2], add_generation_prompt=False)
    assert no_prompt == (
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
    )
    ids = tok.apply_chat_template(CONVERSATION[:2], tokenize=True, return_dict=False)
    assert ids[:3] == tok.encode("<|im_system|>system<|im_middle|>")
    assert ids[0] == 8202 and ids[-1] == 8209 and ids.count(8194) == 2


def test_chat_template_tensor_requests_tokenize(tok):
    """The Kimi default returns a string, but asking for tensors / a dict without ``tokenize`` tokenizes (the
    standard transformers recipe), and contradicting options are refused instead of silently ignored."""
    msgs = CONVERSATION[:2]
    want = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    enc = tok.apply_chat_template(msgs, return_tensors="pt", return_dict=True)
    assert enc["input_ids"].shape == (1, len(want)) and enc["input_ids"][0].tolist() == want
    assert enc["attention_mask"].sum().item() == len(want)
    assert tok.apply_chat_template(msgs, return_dict=True)["input_ids"] == want
    with pytest.raises(ValueError, match="tokenize=True"):
        tok.apply_chat_template(msgs, tokenize=False, return_tensors="pt")


def test_kimi_linear_template_defaults(tok):
    # No default system prompt is injected, content parts are concatenated, tool call ids are synthesised.
    rendered = tok.apply_chat_template([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "f", "arguments": "{\"x\":1}"}}]},
    ])
    assert rendered == (
        "<|im_user|>user<|im_middle|>ab<|im_end|><|im_assistant|>assistant<|im_middle|>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"x\":1}"
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|><|im_assistant|>assistant<|im_middle|>"
    )


K3_HEAD = (
    '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, described in '
    "JSONSchema.\n```json\n" + TOOLS_JSON + "\n```<|close|>message<|sep|><|end_of_msg|>"
)


def _k3_body(thinking: bool) -> str:
    think1 = "<|open|>think<|sep|>Need the tool.<|close|>think<|sep|>" if thinking else ""
    think2 = "<|open|>think<|sep|><|close|>think<|sep|>" if thinking else ""
    return (
        '<|open|>message role="system"<|sep|>You are terse.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>Weather in Paris?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|>' + think1 + "<|open|>response<|sep|>Checking.<|close|>response<|sep|>"
        '<|open|>tools<|sep|><|open|>call tool="get_weather" index="0"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="integer"<|sep|>2<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="tool" tool="get_weather" index="0"<|sep|>18C, sunny<|close|>message<|sep|>'
        "<|end_of_msg|>"
        '<|open|>message role="assistant"<|sep|>' + think2 + "<|open|>response<|sep|>18C and sunny."
        "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="user" name="Ann &quot;A&amp;B&quot;"<|sep|>Thanks<|close|>message<|sep|>'
        "<|end_of_msg|>"
    )


def test_k3_template_exact_thinking(tok_k3):
    rendered = tok_k3.apply_chat_template(CONVERSATION, tools=TOOLS)
    assert rendered == K3_HEAD + _k3_body(True) + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'


def test_k3_template_exact_no_thinking_with_effort(tok_k3):
    rendered = tok_k3.apply_chat_template(CONVERSATION, tools=TOOLS, thinking=False, thinking_effort="high")
    effort = '<|open|>message role="system" type="thinking-effort"<|sep|>high<|close|>message<|sep|><|end_of_msg|>'
    assert rendered == (
        K3_HEAD + effort + _k3_body(False) + '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    )


def test_k3_markers_tokenize_to_single_ids(tok_k3):
    ids = tok_k3.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, return_dict=False)
    text_ids = tok_k3.encode_ids('message role="user"', allow_special=False)
    assert ids[:1 + len(text_ids) + 1] == [8195] + text_ids + [8197]
    assert ids.count(8194) == 1  # <|end_of_msg|> once
    assert tok_k3.decode(ids) == (
        '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )


def test_template_selection(tok, tok_k3):
    conv = [{"role": "user", "content": "hi"}]
    assert tok_k3.apply_chat_template(conv, chat_template="kimi-k3") == tok_k3.apply_chat_template(conv)
    with pytest.raises(ValueError, match="needs special tokens"):
        tok.apply_chat_template(conv, chat_template="kimi-k3")
    with pytest.raises(TemplateError, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


# ----------------------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------------------
def test_missing_vocab_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tiktoken"):
        KimiHybridTokenizer(str(tmp_path / "nope" / "tiktoken.model"))


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "no ranks"),
        ("this is not base64!! x\n", "invalid tiktoken"),
        ("\n".join(f"{base64.b64encode(bytes([b])).decode()} {b + (b > 100)}" for b in range(256)), "without gaps"),
        ("\n".join(f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(255)), "single bytes"),
    ],
    ids=["empty", "garbage", "gap", "missing-byte"],
)
def test_invalid_vocab_file(tmp_path, content, message):
    path = tmp_path / "tiktoken.model"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        KimiHybridTokenizer(str(path))


def test_unknown_chat_format():
    with pytest.raises(ValueError, match="unknown chat_format"):
        KimiHybridTokenizer(str(SHIPPED / "tiktoken.model"), chat_format="chatml")


def test_chat_format_conflicting_with_names(tmp_path):
    # Slot names fixed by a K2 tokenizer_config cannot serve the K3 template.
    with pytest.raises(ValueError, match="needs special tokens"):
        KimiHybridTokenizer.from_pretrained(str(SHIPPED), chat_format="kimi-k3")


def test_added_token_outside_special_range():
    with pytest.raises(ValueError, match="outside the special range"):
        KimiHybridTokenizer(str(SHIPPED / "tiktoken.model"), added_tokens_decoder={8448: "<|extra|>"})
    with pytest.raises(ValueError, match="collide with BPE"):
        KimiHybridTokenizer(str(SHIPPED / "tiktoken.model"), added_tokens_decoder={8197: "self"})


def test_decode_out_of_range(tok):
    with pytest.raises(IndexError):
        tok.decode([8448])


def test_register_tokenizer_with_installed_package():
    # the installed package registers the tokenizer for our config: AutoTokenizer needs no trust_remote_code
    import kimi_hybrid  # noqa: F401
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(SHIPPED))
    assert type(t).__name__ == "KimiHybridTokenizer"
    assert len(t) == 8448 and t.bos_token_id == 8192 and t.eos_token_id == 8193 and t.pad_token_id == 8447


def test_document_encoding_with_eos_fits_uint16(tok):
    """The training arrays are uint16 ids with EOS after each document (examples/tokenize_corpus.py)."""
    import numpy as np

    text = _heldout_files()[0][1].read_text(encoding="utf-8")
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    arr = np.asarray(ids, dtype=np.uint16)
    assert arr.astype(np.int64).tolist() == ids  # every id < 65536
    assert tok.decode(arr[:-1].tolist()) == text


def test_autotokenizer_remote_code(tmp_path):
    # A Hub-style folder: the shipped files plus this flat tokenizer file (auto_map points at it).
    import shutil

    from transformers import AutoTokenizer

    for path in SHIPPED.iterdir():
        shutil.copy(path, tmp_path / path.name)
    shutil.copy(ROOT / "modeling_kimi_hybrid" / "tokenization_kimi_hybrid.py", tmp_path)
    t = AutoTokenizer.from_pretrained(str(tmp_path), trust_remote_code=True)
    assert type(t).__name__ == "KimiHybridTokenizer"
    assert t.encode("x<|im_end|>")[-1] == 8194 and t.eos_token_id == 8193


def test_register_tokenizer_with_config_package(tmp_path, monkeypatch):
    # Simulate a bundle folder: a package with a configuration_kimi_hybrid.KimiHybridConfig beside the tokenizer.
    import shutil

    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    package = tmp_path / "fake_kimi_bundle"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "configuration_kimi_hybrid.py").write_text(
        "from transformers import PretrainedConfig\n\n"
        "class KimiHybridConfig(PretrainedConfig):\n    model_type = 'kimi_hybrid_tokenizer_test'\n"
    )
    shutil.copy(ROOT / "modeling_kimi_hybrid" / "tokenization_kimi_hybrid.py", package)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("fake_kimi_bundle.tokenization_kimi_hybrid")
    config_cls = importlib.import_module("fake_kimi_bundle.configuration_kimi_hybrid").KimiHybridConfig
    assert module.register_tokenizer() is True
    assert TOKENIZER_MAPPING[config_cls] is module.KimiHybridTokenizer
