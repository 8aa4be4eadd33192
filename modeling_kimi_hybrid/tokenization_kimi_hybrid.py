# Copyright 2026 The kimi-hybrid authors. MIT License.
"""Kimi tiktoken tokenizer for kimi-hybrid (Kimi-Linear-48B-A3B, Kimi K3 text backbone).

One slow ``transformers`` tokenizer, :class:`KimiHybridTokenizer`, on top of ``tiktoken``. It loads

* the released Kimi tokenizer (``tiktoken.model`` with 163584 BPE ranks plus the released
  ``tokenizer_config.json``), and
* our own byte-level BPE trained on the CPython stdlib (``models/kimi-hybrid-stdlib``, 8192 ranks).

Id layout (docs/checkpoint-format.md section 4, docs/k3.md section 8):

* ids ``0 .. n_ranks-1`` are BPE ranks (``n_ranks`` = number of lines of ``tiktoken.model``);
* ids ``n_ranks .. n_ranks+255`` are 256 special slots. The name of slot ``offset`` is taken from
  ``added_tokens_decoder`` when that names it, otherwise from the layout of ``chat_format``
  (``SPECIAL_LAYOUTS``), otherwise ``<|reserved_token_{id}|>``.
  For the released file (n_ranks = 163584): [BOS] 163584, [EOS] 163585, ..., [UNK] 163838, [PAD] 163839.

The released remote code builds 256 + 2 specials (two more slots past 163839). The embedding of both checkpoints
has 163840 rows, so those two ids can never reach the model; this class keeps exactly 256 slots so that
``len(tokenizer) == n_ranks + 256 == vocab_size`` of the model.

Pre-tokenizer: the Kimi / K2 ``pat_str`` (see ``KIMI_PAT_STR``).

Fast twin: :class:`KimiHybridTokenizerFast` over a Hugging Face ``tokenizers`` pipeline (``tokenizer.json``, built
from the same ranks by :func:`build_fast_backend`; ``save_pretrained`` of the slow class writes it). It gives the
same ids for every text, so serving stacks that want a fast tokenizer can use it, or load ``tokenizer.json`` with
``PreTrainedTokenizerFast`` without this file. ``AutoTokenizer`` keeps returning the slow class.

Bundle rules: this is a flat Hub-bundle file; it imports only the standard library, ``tiktoken``, ``tokenizers``
and ``transformers`` (plus the sibling ``configuration_kimi_hybrid`` inside :func:`register_tokenizer`, guarded).
"""

from __future__ import annotations

import base64
import importlib
import os
import re
import shutil
from typing import Any

from tokenizers import AddedToken as BackendAddedToken
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AddedToken, PreTrainedTokenizer, PreTrainedTokenizerFast

try:  # tiktoken is a hard requirement of this tokenizer, but fail with a clear message at use time.
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
except ImportError:  # pragma: no cover - exercised only without tiktoken
    tiktoken = None
    load_tiktoken_bpe = None

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
FAST_TOKENIZER_FILE = "tokenizer.json"

NUM_RESERVED_SPECIAL_TOKENS = 256
AUTO_MAP_CLASS = "tokenization_kimi_hybrid.KimiHybridTokenizer"

# Pre-tokenizer regex of the Kimi tiktoken tokenizer (identical to Kimi K2). Source: the `pat_str` class attribute
# of `TikTokenTokenizer` in the Kimi remote code `tokenization_kimi.py` (copy read at troy12x/quasar-kimi
# @ d47b0df2269dafc52acd984aa7c17f72aa667c3b), summarised in docs/checkpoint-format.md section 4. The regex is data:
# it must match the released tokenizer character for character. Rules in order: Han runs; case-aware letter runs
# (Han excluded) with an optional English contraction; 1-3 digits; punctuation runs with trailing newlines;
# newlines; whitespace not followed by non-space; whitespace.
KIMI_PAT_STR = "|".join(
    (
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    )
)

# tiktoken's Rust core is slow (and once panicked) on very long pieces; encode in chunks of at most this many
# characters, cut so that no run of whitespace / non-whitespace exceeds MAX_RUN_CHARS (same limits as the
# released remote code).
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

# Special slot names by offset from n_ranks. Offsets 254 / 255 are [UNK] / [PAD] in both layouts.
_COMMON_SLOTS = {0: "[BOS]", 1: "[EOS]", 254: "[UNK]", 255: "[PAD]"}
SPECIAL_LAYOUTS: dict[str, dict[int, str]] = {
    # Kimi-Linear / K2 (docs/checkpoint-format.md section 4 table).
    "kimi-linear": {
        **_COMMON_SLOTS,
        2: "<|im_end|>",
        3: "<|im_user|>",
        4: "<|im_assistant|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        9: "[EOT]",
        10: "<|im_system|>",
        11: "<|tool_calls_section_begin|>",
        12: "<|tool_calls_section_end|>",
        13: "<|tool_call_begin|>",
        14: "<|tool_call_argument_begin|>",
        15: "<|tool_call_end|>",
        17: "<|im_middle|>",
    },
    # Kimi K3 XTML (docs/k3.md section 8 table). Slots 10-17 are not named by any K3 source we read; they stay
    # reserved unless the released tokenizer_config.json names them in added_tokens_decoder.
    "kimi-k3": {
        **_COMMON_SLOTS,
        2: "<|end_of_msg|>",
        3: "<|open|>",
        4: "<|close|>",
        5: "<|sep|>",
        6: "[start_header_id]",
        7: "[end_header_id]",
        9: "[EOT]",
        18: "<|media_begin|>",
        19: "<|media_content|>",
        20: "<|media_end|>",
        21: "<|media_pad|>",
    },
}
# K3 fixtures mirroring the real tokenizer_config mark the XTML tag markers special: false (docs/k3.md section 8).
_NON_SPECIAL_NAMES = {"<|open|>", "<|close|>", "<|sep|>"}

# Markers a chat template needs as single special tokens; checked when the tokenizer is built.
_TEMPLATE_MARKERS = {
    "kimi-linear": ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"),
    "kimi-k3": ("<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"),
}

# --------------------------------------------------------------------------------------------------------------
# Chat templates. Built from single-line pieces so that no stray whitespace reaches the output.
# --------------------------------------------------------------------------------------------------------------

_CONTENT_MACRO = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}"
    "{%- if part is string -%}{{ part }}{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- elif content is not none -%}{{ content }}"
    "{%- endif -%}"
    "{%- endmacro -%}"
)

# (a) Kimi-Linear / K2: <|im_{role}|>{name or role}<|im_middle|>{content}<|im_end|> per turn.
# No default system prompt is injected: K2's template adds "You are Kimi, ..." when none is given, but whether the
# Kimi-Linear template does is unverified (docs/checkpoint-format.md section 4), so we add nothing the caller did not pass.
# Tool calls: <|tool_calls_section_begin|> then per call <|tool_call_begin|>{id}<|tool_call_argument_begin|>{args}
# <|tool_call_end|>, then <|tool_calls_section_end|>; a call without an id gets the K2 style "functions.{name}:{i}".
KIMI_LINEAR_CHAT_TEMPLATE = "".join(
    (
        _CONTENT_MACRO,
        "{%- if tools -%}",
        "<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>",
        "{%- endif -%}",
        "{%- for message in messages -%}",
        "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] -%}",
        "{{ raise_exception('kimi-linear chat format: unknown role ' ~ message.role) }}",
        "{%- endif -%}",
        "{%- if message.role == 'tool' -%}",
        "<|im_system|>tool<|im_middle|>## Return of {{ message.tool_call_id }}{{ '\\n' }}",
        "{{ render_content(message.content) }}<|im_end|>",
        "{%- else -%}",
        "<|im_{{ message.role }}|>{{ message.name or message.role }}<|im_middle|>",
        "{{ render_content(message.content) }}",
        "{%- if message.role == 'assistant' and message.tool_calls -%}",
        "<|tool_calls_section_begin|>",
        "{%- for call in message.tool_calls -%}",
        "{%- set fn = call.function if call.function is defined else call -%}",
        "<|tool_call_begin|>{{ call.id if call.id else 'functions.' ~ fn.name ~ ':' ~ loop.index0 }}",
        "<|tool_call_argument_begin|>",
        "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}<|tool_call_end|>",
        "{%- endfor -%}",
        "<|tool_calls_section_end|>",
        "{%- endif -%}",
        "<|im_end|>",
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}",
    )
)

# (b) Kimi K3 XTML (docs/k3.md section 8). Extra template variables:
#   thinking (bool, default true): think channel in assistant turns and the generation prompt;
#   thinking_effort (str, optional): "low" | "medium" | "high" | "max", emitted as a system message.
# Unverified details, chosen here and pinned by tests: the tool declaration comes first, then the thinking-effort
# message, then the conversation; the fenced block is "```json\n{compact JSON}\n```"; a tool message's index is
# its 0-based position among the tool messages following the last non-tool message; the XTML "type" of a
# non-string argument is its JSON type (string/integer/number/boolean/null/object/array) and its value compact
# JSON; string-valued `arguments` are emitted as one `json` block.
# Limitation of any text template: user text containing a literal "<|open|>" is matched as the special token when
# the rendered string is tokenized (the official renderer encodes user text with specials disallowed).
KIMI_K3_CHAT_TEMPLATE = "".join(
    (
        _CONTENT_MACRO,
        "{%- macro attr(value) -%}{{ value | string | replace('&', '&amp;') | replace('\"', '&quot;') }}"
        "{%- endmacro -%}",
        "{%- macro close_message() -%}<|close|>message<|sep|><|end_of_msg|>{%- endmacro -%}",
        "{%- set use_thinking = true if thinking is not defined or thinking is none else thinking -%}",
        "{%- if tools -%}",
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools{{ "\\n" }}'
        "Here are the available tools, described in JSONSchema.{{ '\\n' }}```json{{ '\\n' }}"
        "{{ tools | tojson(separators=(',', ':')) }}{{ '\\n' }}```{{ close_message() }}",
        "{%- endif -%}",
        "{%- if thinking_effort is defined and thinking_effort -%}",
        '<|open|>message role="system" type="thinking-effort"<|sep|>{{ thinking_effort }}{{ close_message() }}',
        "{%- endif -%}",
        "{%- set ns = namespace(tool_index=0) -%}",
        "{%- for message in messages -%}",
        "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] -%}",
        "{{ raise_exception('kimi-k3 chat format: unknown role ' ~ message.role) }}",
        "{%- endif -%}",
        "{%- if message.role == 'tool' -%}",
        '<|open|>message role="tool" tool="{{ attr(message.name or \'\') }}" index="{{ ns.tool_index }}"<|sep|>',
        "{{ render_content(message.content) }}{{ close_message() }}",
        "{%- set ns.tool_index = ns.tool_index + 1 -%}",
        "{%- else -%}",
        "{%- set ns.tool_index = 0 -%}",
        '<|open|>message role="{{ attr(message.role) }}"',
        '{%- if message.name %} name="{{ attr(message.name) }}"{% endif -%}',
        "<|sep|>",
        "{%- if message.role == 'assistant' -%}",
        "{%- if use_thinking -%}",
        "<|open|>think<|sep|>{{ message.reasoning_content or '' }}<|close|>think<|sep|>",
        "{%- endif -%}",
        "<|open|>response<|sep|>{{ render_content(message.content) }}<|close|>response<|sep|>",
        "{%- if message.tool_calls -%}",
        "<|open|>tools<|sep|>",
        "{%- for call in message.tool_calls -%}",
        "{%- set fn = call.function if call.function is defined else call -%}",
        '<|open|>call tool="{{ attr(fn.name) }}" index="{{ loop.index0 }}"<|sep|>',
        "{%- if fn.arguments is string -%}",
        "<|open|>json<|sep|>{{ fn.arguments }}<|close|>json<|sep|>",
        "{%- else -%}",
        "{%- for key, value in fn.arguments.items() -%}",
        "{%- if value is string -%}{%- set kind = 'string' -%}",
        "{%- elif value is boolean -%}{%- set kind = 'boolean' -%}",
        "{%- elif value is integer -%}{%- set kind = 'integer' -%}",
        "{%- elif value is float -%}{%- set kind = 'number' -%}",
        "{%- elif value is none -%}{%- set kind = 'null' -%}",
        "{%- elif value is mapping -%}{%- set kind = 'object' -%}",
        "{%- else -%}{%- set kind = 'array' -%}{%- endif -%}",
        '<|open|>argument key="{{ attr(key) }}" type="{{ kind }}"<|sep|>',
        "{{ value if value is string else value | tojson(separators=(',', ':')) }}<|close|>argument<|sep|>",
        "{%- endfor -%}",
        "{%- endif -%}",
        "<|close|>call<|sep|>",
        "{%- endfor -%}",
        "<|close|>tools<|sep|>",
        "{%- endif -%}",
        "{%- else -%}",
        "{{ render_content(message.content) }}",
        "{%- endif -%}",
        "{{ close_message() }}",
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}",
        '<|open|>message role="assistant"<|sep|>',
        "{%- if use_thinking -%}<|open|>think<|sep|>{%- else -%}<|open|>response<|sep|>{%- endif -%}",
        "{%- endif -%}",
    )
)

CHAT_TEMPLATES = {"kimi-linear": KIMI_LINEAR_CHAT_TEMPLATE, "kimi-k3": KIMI_K3_CHAT_TEMPLATE}
CHAT_FORMATS = tuple(CHAT_TEMPLATES)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable unicode character map (the alphabet of byte-level BPE token strings).

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to U+0100 and up, in byte order.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def deep_sort(obj: Any) -> Any:
    """Return ``obj`` with every dict's keys sorted, recursively (the Kimi tool-declaration convention)."""
    if isinstance(obj, dict):
        return {key: deep_sort(obj[key]) for key in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [deep_sort(item) for item in obj]
    return obj


def load_ranks(vocab_file: str) -> dict[bytes, int]:
    """Read a tiktoken BPE file (``base64(token bytes) rank`` per line) and validate it.

    Returns:
        ``{token_bytes: rank}`` with ranks exactly ``0 .. n-1``.

    Raises:
        FileNotFoundError: ``vocab_file`` is missing.
        ImportError: tiktoken is not installed.
        ValueError: the file is empty or malformed, ranks are not a permutation of ``0..n-1``, or some single byte
            has no rank (byte-level BPE must be able to encode any input).
    """
    if tiktoken is None:
        raise ImportError("KimiHybridTokenizer needs the `tiktoken` package: pip install tiktoken")
    if vocab_file is None or not os.path.isfile(vocab_file):
        raise FileNotFoundError(f"tiktoken BPE file not found: {vocab_file!r} (expected a `tiktoken.model`)")
    try:
        ranks = load_tiktoken_bpe(vocab_file)
    except Exception as err:  # tiktoken raises bare ValueError / binascii.Error on malformed lines
        raise ValueError(f"invalid tiktoken BPE file {vocab_file!r}: {err}") from err
    if not ranks:
        raise ValueError(f"invalid tiktoken BPE file {vocab_file!r}: no ranks")
    values = sorted(ranks.values())
    if values[0] != 0 or values[-1] != len(values) - 1 or len(set(values)) != len(values):
        raise ValueError(
            f"invalid tiktoken BPE file {vocab_file!r}: ranks must be exactly 0..{len(ranks) - 1} without gaps"
        )
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"invalid tiktoken BPE file {vocab_file!r}: {len(missing)} single bytes have no rank")
    return ranks


def write_ranks(ranks: dict[bytes, int], path: str) -> None:
    """Write ``{token_bytes: rank}`` as a tiktoken BPE file, lines sorted by rank."""
    with open(path, "w", encoding="ascii", newline="\n") as handle:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            handle.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")


def _split_long_runs(text: str, max_run: int) -> list[str]:
    """Cut ``text`` so that no piece holds more than ``max_run`` consecutive whitespace or non-whitespace chars."""
    pieces, start, run, run_is_space = [], 0, 0, None
    for i, char in enumerate(text):
        is_space = char.isspace()
        if is_space is run_is_space:
            run += 1
            if run > max_run:
                pieces.append(text[start:i])
                start, run = i, 1
        else:
            run_is_space, run = is_space, 1
    pieces.append(text[start:])
    return pieces


# --------------------------------------------------------------------------------------------------------------
# The same tokenizer as a Hugging Face `tokenizers` pipeline (tokenizer.json), for fast-tokenizer consumers.
# --------------------------------------------------------------------------------------------------------------

# Oniguruma (the regex engine of `tokenizers`) refuses a counted repeat above 100,000; longer exact counts are
# written as nested repeats.
_ONIG_MAX_REPEAT = 100_000
# The characters for which Python's ``str.isspace()`` is true: the run rule of :func:`_split_long_runs`. This is
# not the regex ``\s`` (U+001C..U+001F are spaces to Python, not to Unicode's White_Space).
_PY_SPACE_CLASS = "".join(
    "\\x{%X}" % code
    for code in (*range(0x09, 0x0E), *range(0x1C, 0x21), 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028,
                 0x2029, 0x202F, 0x205F, 0x3000)
)


def _exact_repeat(atom: str, count: int) -> str:
    """Onig pattern for exactly ``count`` copies of ``atom`` (nested when ``count`` exceeds Onig's limit)."""
    if count <= _ONIG_MAX_REPEAT:
        return f"{atom}{{{count}}}"
    if count % _ONIG_MAX_REPEAT:
        raise ValueError(f"cannot write a repeat of {count} for Oniguruma (not a multiple of {_ONIG_MAX_REPEAT})")
    return f"(?:{atom}{{{_ONIG_MAX_REPEAT}}}){{{count // _ONIG_MAX_REPEAT}}}"


def fast_pre_tokenizer() -> pre_tokenizers.Sequence:
    r"""The ``tokenizers`` pre-tokenizer equal to :class:`KimiHybridTokenizer`'s text path.

    Stages, each applied to the pieces of the previous one:

    1. cut the text every ``MAX_ENCODE_CHARS`` characters (``\G`` anchors each block at the end of the previous
       one, so the scan stays linear);
    2. cut every run of ``str.isspace()`` / non-space characters after each ``MAX_RUN_CHARS`` characters, counted
       from the start of the run inside its piece, where the run goes on (a block starts at a run start, i.e. not
       preceded by a character of its class, or right after the previous block, and must be followed by a
       character of its class: a run of exactly ``MAX_RUN_CHARS`` is not cut before the next run);
    3. ``KIMI_PAT_STR``, unchanged: Oniguruma accepts ``\p{Han}``, the ``&&`` class intersections, ``(?i:...)`` and
       ``(?!\S)``;
    4. byte-level mapping of each piece to the GPT-2 alphabet (no prefix space, no second regex).

    Stages 1-2 cut only at the end of each block (``merged_with_previous``: the text before a block stays with it),
    which is where :func:`_split_long_runs` cuts: they reproduce the chunking of
    :meth:`KimiHybridTokenizer._text_chunks`, without which a text holding a run longer than 25,000 characters, or
    longer than 400,000 characters, would be cut elsewhere and get other ids.
    """
    space, other = f"[{_PY_SPACE_CLASS}]", f"[^{_PY_SPACE_CLASS}]"
    chunks = r"\G" + _exact_repeat(r"[\s\S]", MAX_ENCODE_CHARS)
    runs = "|".join(f"(?:\\G|(?<!{cls})){_exact_repeat(cls, MAX_RUN_CHARS)}(?={cls})" for cls in (space, other))
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(chunks), behavior="merged_with_previous", invert=False),
            pre_tokenizers.Split(Regex(runs), behavior="merged_with_previous", invert=False),
            pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges, in priority order, equivalent to tiktoken's rank-driven merging.

    tiktoken merges, at each step, the adjacent pair whose concatenation has the lowest rank. A merges list gives a
    pair its priority by position, so every way of cutting a token ``t`` into two tokens ``(left, right)`` becomes a
    merge, ordered by ``rank(t)``; the cuts of one token are ordered by ``(rank(left), rank(right))``. A token with
    no such cut is never produced by merging, only as a whole piece (see ``ignore_merges`` in
    :func:`build_fast_backend`), exactly as in tiktoken.

    Args:
        ranks: ``{token_bytes: rank}`` (see :func:`load_ranks`).

    Returns:
        ``[(left_bytes, right_bytes), ...]``, highest priority first.
    """
    merges: list[tuple[bytes, bytes]] = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        cuts = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        cuts.sort(key=lambda cut: (ranks[cut[0]], ranks[cut[1]]))
        merges.extend(cuts)
    return merges


def build_fast_backend(ranks: dict[bytes, int], specials: dict[int, AddedToken]) -> Tokenizer:
    """Build the ``tokenizers.Tokenizer`` (what ``tokenizer.json`` stores) for BPE ``ranks`` and special slots.

    Args:
        ranks: ``{token_bytes: rank}``, ranks ``0 .. n_ranks-1`` (become the ids).
        specials: ``{id: AddedToken}`` for ids ``n_ranks .. n_ranks + len(specials) - 1`` without gaps; each becomes
            an added token with that id (``special`` flag kept, never normalized or stripped).

    Returns:
        A ``tokenizers.Tokenizer``: byte-level BPE with ``ignore_merges`` (a piece that is itself a token is one id,
        as in tiktoken), :func:`fast_pre_tokenizer`, the byte-level decoder, no post-processor (no BOS / EOS added).

    Raises:
        ValueError: special ids do not continue the ranks without gaps.
    """
    byte_encoder = bytes_to_unicode()

    def to_text(token: bytes) -> str:
        return "".join(byte_encoder[b] for b in token)

    vocab = {to_text(token): rank for token, rank in ranks.items()}
    merges = [(to_text(left), to_text(right)) for left, right in merges_from_ranks(ranks)]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False))
    backend.pre_tokenizer = fast_pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    ids = sorted(specials)
    if ids != list(range(len(ranks), len(ranks) + len(ids))):
        raise ValueError(f"special ids must be {len(ranks)}..{len(ranks) + len(ids) - 1} without gaps")
    for token_id in ids:  # one at a time: an added token takes the next free id
        token = specials[token_id]
        backend.add_tokens([BackendAddedToken(str(token), single_word=False, lstrip=False, rstrip=False,
                                              normalized=False, special=bool(token.special))])
        if backend.token_to_id(str(token)) != token_id:
            raise ValueError(f"special token {str(token)!r} got id {backend.token_to_id(str(token))}, not {token_id}")
    return backend


class _KimiChatTemplateMixin:
    """``apply_chat_template`` with the Kimi conventions, shared by the slow and the fast class.

    The class provides ``special_tokens`` (``{name: id}`` of the special slots) and ``chat_template``.
    """

    def apply_chat_template(self, conversation, tools=None, add_generation_prompt: bool = True, **kwargs):
        """Render (and by default not tokenize) a conversation with the chat template.

        Kimi conventions (the released tokenizer's): ``tools`` dicts are key-sorted recursively;
        ``add_generation_prompt`` defaults to True; ``tokenize`` defaults to False (a string comes back), except that
        asking for ``return_tensors`` or ``return_dict=True`` without saying ``tokenize`` tokenizes (those only exist
        for token ids; transformers' own default is ``tokenize=True``). ``chat_template`` may be a template string or
        a name ("kimi-linear", "kimi-k3") whose markers must be special tokens of this layout. K3 extras:
        ``thinking`` (bool), ``thinking_effort`` (str).

        Raises:
            ValueError: ``tokenize=False`` together with ``return_tensors`` / ``return_dict=True``, or a named
                template whose markers are not special tokens of this layout.
        """
        name = kwargs.get("chat_template")
        if isinstance(name, str) and name in CHAT_TEMPLATES:
            missing = [m for m in _TEMPLATE_MARKERS[name] if m not in self.special_tokens]
            if missing:
                raise ValueError(f"chat template {name!r} needs special tokens missing from this layout: {missing}")
            templates = self.chat_template if isinstance(self.chat_template, dict) else {}
            if name not in templates:
                kwargs["chat_template"] = CHAT_TEMPLATES[name]
        wants_ids = kwargs.get("return_tensors") is not None or bool(kwargs.get("return_dict"))
        if "tokenize" not in kwargs:
            kwargs["tokenize"] = wants_ids
        elif wants_ids and not kwargs["tokenize"]:
            raise ValueError("return_tensors / return_dict need token ids: pass tokenize=True (or drop them to get "
                             "the rendered string)")
        return super().apply_chat_template(
            conversation, tools=deep_sort(tools) if tools else None, add_generation_prompt=add_generation_prompt,
            **kwargs,
        )


class KimiHybridTokenizer(_KimiChatTemplateMixin, PreTrainedTokenizer):
    """Slow ``transformers`` tokenizer over tiktoken with the Kimi special-token layout.

    Args:
        vocab_file (`str`): path of ``tiktoken.model`` (``base64(bytes) rank`` lines, ranks ``0..n_ranks-1``).
        chat_format (`str`, *optional*): ``"kimi-linear"`` (K2 / Kimi-Linear ``<|im_*|>`` format) or
            ``"kimi-k3"`` (XTML). Selects the default special-slot names and the default chat template. When
            omitted it is inferred from ``added_tokens_decoder`` (slot 2 named ``<|end_of_msg|>`` -> kimi-k3),
            else ``"kimi-linear"``.
        added_tokens_decoder (`dict[int, AddedToken | str | dict]`, *optional*): names of special slots, as in a
            released ``tokenizer_config.json``; they win over the layout of ``chat_format``.
        bos_token / eos_token / unk_token / pad_token: default ``[BOS]`` / ``[EOS]`` / ``[UNK]`` / ``[PAD]``.
        chat_template (`str | dict`, *optional*): defaults to the template of ``chat_format``.

    Ids: ``0 .. n_ranks-1`` BPE ranks, ``n_ranks + offset`` for special slot ``offset`` in ``0..255``;
    ``len(tokenizer) == vocab_size == n_ranks + 256``.

    Raises:
        FileNotFoundError / ValueError: missing or invalid ``tiktoken.model`` (see :func:`load_ranks`).
        ValueError: unknown ``chat_format``; an ``added_tokens_decoder`` id outside the special range or whose
            name is already a BPE token string; a name used for two slots; a chat format whose markers are not
            special tokens of this layout.
    """

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]
    num_reserved_special_tokens = NUM_RESERVED_SPECIAL_TOKENS
    pat_str = KIMI_PAT_STR

    def __init__(
        self,
        vocab_file: str,
        chat_format: str | None = None,
        bos_token: str | AddedToken = "[BOS]",
        eos_token: str | AddedToken = "[EOS]",
        unk_token: str | AddedToken = "[UNK]",
        pad_token: str | AddedToken = "[PAD]",
        added_tokens_decoder: dict | None = None,
        chat_template: str | dict | None = None,
        **kwargs,
    ):
        ranks = load_ranks(vocab_file)
        self.vocab_file = vocab_file
        self.n_ranks = len(ranks)
        self._ranks = ranks

        given = self._normalise_added_tokens(added_tokens_decoder or {})
        outside = sorted(i for i in given if not self.n_ranks <= i < self.n_ranks + NUM_RESERVED_SPECIAL_TOKENS)
        if outside:
            raise ValueError(
                f"added_tokens_decoder ids {outside[:5]} are outside the special range "
                f"[{self.n_ranks}, {self.n_ranks + NUM_RESERVED_SPECIAL_TOKENS}) of this tiktoken.model"
            )
        if chat_format is None:
            offset2 = given.get(self.n_ranks + 2)
            chat_format = "kimi-k3" if offset2 is not None and offset2.content == "<|end_of_msg|>" else "kimi-linear"
        if chat_format not in SPECIAL_LAYOUTS:
            raise ValueError(f"unknown chat_format {chat_format!r}; expected one of {list(CHAT_FORMATS)}")
        self.chat_format = chat_format

        # Build all 256 special slots; names given by the caller win over the layout defaults.
        layout = SPECIAL_LAYOUTS[chat_format]
        specials: dict[int, AddedToken] = {}
        for offset in range(NUM_RESERVED_SPECIAL_TOKENS):
            token_id = self.n_ranks + offset
            if token_id in given:
                specials[token_id] = given[token_id]
            else:
                name = layout.get(offset, f"<|reserved_token_{token_id}|>")
                specials[token_id] = AddedToken(
                    name, lstrip=False, rstrip=False, normalized=False, special=name not in _NON_SPECIAL_NAMES
                )
        self.special_tokens = {token.content: token_id for token_id, token in specials.items()}
        # encode_ids(allow_special=True) cuts these names out before chunking (longest first, as the added-tokens
        # trie of `encode` does)
        names = sorted(self.special_tokens, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(re.escape(name) for name in names))
        if len(self.special_tokens) != NUM_RESERVED_SPECIAL_TOKENS:
            raise ValueError("added_tokens_decoder uses the same name for two special slots")

        self._encoding = tiktoken.Encoding(
            name=f"kimi_hybrid_{self.n_ranks}",
            pat_str=KIMI_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        byte_encoder = bytes_to_unicode()
        self._byte_decoder = {char: byte for byte, char in byte_encoder.items()}
        self._id_to_token: list[str] = [""] * self.n_ranks
        for token_bytes, rank in ranks.items():
            self._id_to_token[rank] = "".join(byte_encoder[b] for b in token_bytes)
        self._token_to_id = {token: rank for rank, token in enumerate(self._id_to_token)}
        clash = [name for name in self.special_tokens if name in self._token_to_id]
        if clash:
            raise ValueError(f"special token names collide with BPE token strings: {clash[:5]}")
        self._token_to_id.update(self.special_tokens)

        for name in (bos_token, eos_token, unk_token, pad_token):
            if name is not None and str(name) not in self.special_tokens:
                raise ValueError(f"special token {str(name)!r} is not one of the 256 special slots")

        markers = [m for m in _TEMPLATE_MARKERS[chat_format] if m not in self.special_tokens]
        if markers:
            raise ValueError(f"chat_format {chat_format!r} needs special tokens missing from this layout: {markers}")
        if chat_template is None:
            chat_template = CHAT_TEMPLATES[chat_format]
        # Saved tokenizer_config.json files point AutoTokenizer (trust_remote_code) at this file.
        kwargs.setdefault("auto_map", {"AutoTokenizer": [AUTO_MAP_CLASS, None]})

        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            added_tokens_decoder=specials,
            chat_template=chat_template,
            chat_format=chat_format,
            **kwargs,
        )

    # ---------------------------------------------------------------------------------------------------------
    @staticmethod
    def _normalise_added_tokens(decoder: dict) -> dict[int, AddedToken]:
        """Accept ``{id: AddedToken | str | {"content": ..., ...}}`` (ids may be str, as in JSON)."""
        out = {}
        for key, value in decoder.items():
            if isinstance(value, dict):
                fields = {k: v for k, v in value.items() if k != "__type"}
                value = AddedToken(**fields)
            elif isinstance(value, str):
                value = AddedToken(value, lstrip=False, rstrip=False, normalized=False, special=True)
            elif not isinstance(value, AddedToken):
                raise TypeError(f"added_tokens_decoder[{key!r}] must be AddedToken, str or dict, got {type(value)}")
            out[int(key)] = value
        return out

    @property
    def vocab_size(self) -> int:
        """``n_ranks + 256``: BPE ranks plus the special slots (the model's embedding rows)."""
        return self.n_ranks + NUM_RESERVED_SPECIAL_TOKENS

    @property
    def tiktoken_encoding(self) -> "tiktoken.Encoding":
        """The underlying ``tiktoken.Encoding`` (BPE ranks + the 256 specials)."""
        return self._encoding

    def get_vocab(self) -> dict[str, int]:
        """Byte-level token string (GPT-2 alphabet) or special name -> id, for all ``vocab_size`` ids."""
        return dict(self._token_to_id)

    def _text_chunks(self, text: str):
        for start in range(0, len(text), MAX_ENCODE_CHARS):
            yield from _split_long_runs(text[start : start + MAX_ENCODE_CHARS], MAX_RUN_CHARS)

    def encode_ids(self, text: str, allow_special: bool = True) -> list[int]:
        """Fast path: ``text`` -> ids with tiktoken directly, no BOS/EOS added.

        With ``allow_special`` every special-slot name in ``text`` becomes its id (names are cut out first, longest
        name first, then the text between them is chunked and encoded, as ``encode`` does); without it, it is
        ordinary text. Returns a ``list[int]`` of length ``num_tokens``.
        """
        if not allow_special:
            return self._encode_ordinary(text)
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            ids.extend(self._encode_ordinary(text[start : match.start()]))
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        ids.extend(self._encode_ordinary(text[start:]))
        return ids

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for chunk in self._text_chunks(text):
            ids.extend(self._encoding.encode_ordinary(chunk))
        return ids

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        # Special tokens were split off by the added-tokens trie already (or must stay text when
        # split_special_tokens=True), so the rest is ordinary BPE.
        ids = self.encode_ids(text, allow_special=False)
        return [self._id_to_token[i] for i in ids]

    def _convert_token_to_id(self, token: str) -> int:
        return self._token_to_id.get(token, self.special_tokens.get(str(self.unk_token)))

    def _convert_id_to_token(self, index: int) -> str:
        if 0 <= index < self.n_ranks:
            return self._id_to_token[index]
        token = self._added_tokens_decoder.get(index)
        if token is None:
            raise IndexError(f"token id {index} out of range [0, {self.vocab_size})")
        return token.content

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Join token strings: special names verbatim, byte-level strings back to UTF-8 (invalid -> U+FFFD)."""
        buffer = bytearray()
        for token in tokens:
            if token in self.special_tokens:
                buffer += token.encode("utf-8")
            else:
                buffer += bytes(self._byte_decoder[char] for char in token)
        return buffer.decode("utf-8", errors="replace")

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None, **kwargs):
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        ids = [int(i) for i in token_ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise IndexError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if skip_special_tokens:
            # every slot flagged special (all but <|open|>/<|close|>/<|sep|> in the K3 layout), not only bos/eos/...
            skip = set(self.all_special_ids)
            skip.update(i for i, token in self._added_tokens_decoder.items() if token.special)
            ids = [i for i in ids if i not in skip]
        return self._encoding.decode_bytes(ids).decode("utf-8", errors="replace")

    def backend_tokenizer_for_fast(self) -> Tokenizer:
        """This tokenizer as a ``tokenizers.Tokenizer`` (the content of ``tokenizer.json``).

        Same ranks, pre-tokenizer (``KIMI_PAT_STR`` plus this class's chunking) and special slots with the same ids;
        see :func:`build_fast_backend`. Ids and decoded text equal this class's ``encode`` / ``decode``.
        """
        return build_fast_backend(self._ranks, dict(self.added_tokens_decoder))

    def to_fast(self) -> "KimiHybridTokenizerFast":
        """The equivalent :class:`KimiHybridTokenizerFast`: same ids, special tokens, BOS / EOS / UNK / PAD, chat
        format and chat template, ``model_max_length``."""
        return KimiHybridTokenizerFast(
            tokenizer_object=self.backend_tokenizer_for_fast(), vocab_file=self.vocab_file,
            bos_token=self.bos_token, eos_token=self.eos_token, unk_token=self.unk_token, pad_token=self.pad_token,
            chat_format=self.chat_format, chat_template=self.chat_template, model_max_length=self.model_max_length,
            clean_up_tokenization_spaces=False, added_tokens_decoder=dict(self.added_tokens_decoder),
        )

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        """Write ``tiktoken.model`` (a copy) and ``tokenizer.json`` (the fast equivalent) into ``save_directory``.

        Raises ValueError if ``save_directory`` is not a directory.
        """
        if not os.path.isdir(save_directory):
            raise ValueError(f"save_directory {save_directory!r} is not a directory")
        prefix = filename_prefix + "-" if filename_prefix else ""
        target = os.path.join(save_directory, prefix + VOCAB_FILES_NAMES["vocab_file"])
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            shutil.copyfile(self.vocab_file, target)
        fast_file = os.path.join(save_directory, prefix + FAST_TOKENIZER_FILE)
        self.backend_tokenizer_for_fast().save(fast_file)
        return (target, fast_file)


class KimiHybridTokenizerFast(_KimiChatTemplateMixin, PreTrainedTokenizerFast):
    """Fast (``tokenizers``) twin of :class:`KimiHybridTokenizer`, loaded from ``tokenizer.json``.

    Same ids as the slow class for every text (``tests/test_tokenizer_fast.py`` compares them), same 256 special
    slots, BOS / EOS / UNK / PAD, chat format and chat template conventions (``apply_chat_template`` renders a
    string unless token ids are asked for, tool dicts are key-sorted). Build it with
    :meth:`KimiHybridTokenizer.to_fast` or ``KimiHybridTokenizerFast.from_pretrained(folder)`` on a folder holding
    ``tokenizer.json`` (written by the slow class's ``save_pretrained``). Without the package, the same folder
    loads as ``PreTrainedTokenizerFast.from_pretrained(folder)`` with the same ids and special tokens (then with
    transformers' own ``apply_chat_template`` defaults).

    Raises:
        ValueError: (from ``from_pretrained``) the folder has no ``tokenizer.json``: save it with
            ``KimiHybridTokenizer.from_pretrained(folder).save_pretrained(folder)``.
    """

    # tiktoken.model is optional here; when known it is saved too, so a saved folder also loads the slow class
    vocab_files_names = {"tokenizer_file": FAST_TOKENIZER_FILE, **VOCAB_FILES_NAMES}
    slow_tokenizer_class = KimiHybridTokenizer
    model_input_names = ["input_ids", "attention_mask"]

    @classmethod
    def convert_to_native_format(cls, trust_remote_code=False, **kwargs):
        tokenizer_file = kwargs.get("tokenizer_file")
        if tokenizer_file is None or not os.path.isfile(tokenizer_file):
            raise ValueError(
                f"{cls.__name__} needs a {FAST_TOKENIZER_FILE}; write one with "
                "KimiHybridTokenizer.from_pretrained(folder).save_pretrained(folder)"
            )
        return dict(kwargs)  # TokenizersBackend.__init__ loads the file as it is

    def _save_pretrained(self, save_directory, file_names, legacy_format=None, filename_prefix=None):
        file_names = super()._save_pretrained(save_directory, file_names, legacy_format, filename_prefix)
        vocab_file = getattr(self, "vocab_file", None)
        if vocab_file and os.path.isfile(vocab_file):
            prefix = filename_prefix + "-" if filename_prefix else ""
            target = os.path.join(str(save_directory), prefix + VOCAB_FILES_NAMES["vocab_file"])
            if os.path.abspath(vocab_file) != os.path.abspath(target):
                shutil.copyfile(vocab_file, target)
            file_names = file_names + (target,)
        return file_names

    @property
    def chat_format(self) -> str:
        """``"kimi-linear"`` or ``"kimi-k3"`` (from ``tokenizer_config.json``; ``"kimi-linear"`` when absent)."""
        return self.init_kwargs.get("chat_format") or "kimi-linear"

    @property
    def special_tokens(self) -> dict[str, int]:
        """``{name: id}`` of the special slots (all added tokens), as on the slow class."""
        return {str(token): token_id for token_id, token in self.added_tokens_decoder.items()}


def register_tokenizer() -> bool:
    """Register :class:`KimiHybridTokenizer` with ``AutoTokenizer`` for ``KimiHybridConfig``.

    The config class lives in the sibling ``configuration_kimi_hybrid.py``. When it is not importable (this file used
    alone) nothing is registered and False is returned; the package's ``__init__.py`` calls this. Returns True on
    registration.
    """
    # Imported by name rather than with a `from .configuration_kimi_hybrid import` statement: transformers' remote
    # code loader requires every statically visible relative import to exist next to this file, and a folder that
    # holds only the tokenizer (models/kimi-hybrid-stdlib + this file) has no configuration file.
    if not __package__:
        return False
    try:
        config_module = importlib.import_module(".configuration_kimi_hybrid", __package__)
        KimiHybridConfig = config_module.KimiHybridConfig
    except (ImportError, AttributeError):
        return False
    from transformers import AutoTokenizer  # noqa: PLC0415

    AutoTokenizer.register(KimiHybridConfig, slow_tokenizer_class=KimiHybridTokenizer, exist_ok=True)
    # save_pretrained of a tokenizer loaded through the installed package then copies this file next to
    # tokenizer_config.json (its auto_map points here), so the folder also loads with trust_remote_code elsewhere
    KimiHybridTokenizer.register_for_auto_class("AutoTokenizer")
    return True


__all__ = ["KimiHybridTokenizer", "KimiHybridTokenizerFast", "build_fast_backend", "register_tokenizer",
           "CHAT_TEMPLATES", "KIMI_PAT_STR", "SPECIAL_LAYOUTS"]
