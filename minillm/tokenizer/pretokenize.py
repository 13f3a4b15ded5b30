"""BPE pre-tokenization: split text into words with the regexes llama.cpp uses.

Python's `re` has no `\\p{L}`. llama.cpp's generic path (`unicode_regex_split` in unicode.cpp) has
the same problem with std::regex and solves it by "collapsing" the text: every codepoint becomes
one character, ASCII stays as it is, non-ASCII whitespace becomes \\x0B and every other non-ASCII
codepoint becomes a stand-in for its Unicode category (\\xD1 number, \\xD2 letter, \\xD3
punctuation, \\xD4 mark, \\xD5 symbol, \\xD0 anything else). In the regex, `\\p{N}` becomes
`[\\xD10-9]` and so on. Running the regex on the collapsed text gives the same split positions,
which are then applied to the real text. We do exactly that with `re` (ASCII mode, so `\\s` is
the C locale's [ \\t\\n\\v\\f\\r]). A regex without `\\p{..}` runs on the real text, with
non-ASCII whitespace turned into \\x0B, as llama.cpp's std::wregex path does. llama.cpp
hand-codes the gpt2 and llama3 regexes; those scanners split exactly like the regexes (the tests
compare them with a port of the scanners on random text), so one path serves all.

Each regex splits every piece left by the previous one; text between matches stays a piece.
Unicode categories follow llama.cpp's tables (Unicode 15.1), not only Python's unicodedata.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from ..errors import MinillmError

# Unicode White_Space (llama.cpp unicode-data.cpp); not str.isspace(), which adds \x1c-\x1f.
WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                        0x2028, 0x2029, 0x202F, 0x205F, 0x3000])

_CATEGORY_STAND_IN = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_OTHER_STAND_IN = "\xd0"
_SPACE_STAND_IN = "\x0b"

# What each \p{..} becomes inside a character class: the stand-in plus the ASCII members
# llama.cpp lists (k_ucat_map; note that ASCII '~' is in no class there).
_CLASS_BODY = {
    "N": "\xd1" + "0-9",
    "L": "\xd2" + "A-Za-z",
    "P": "\xd3" + r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    "M": "\xd4",
    "S": "\xd5" + r"\$\+<->\^`\|",
}
_PROPERTY_CLASS = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S",
                   "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L", "Lo": "L"}
_PROPERTY_RE = re.compile(r"\\p\{(\w{1,8})\}")


# llama.cpp's category tables follow Unicode 15.1; Python 3.11's unicodedata is Unicode 14.0.
# The codepoints whose stand-in differs (characters new in 15.0/15.1), as "first[-last]:class";
# computed by comparing unicodedata with the unicodedata2 15.1.0 package.
_UNICODE_15_1_CHANGES = """
0CF3:M 0ECE:M 2FFC-2FFF:S 31EF:S 10EFD-10EFF:M 1123F-11240:L 11241:M 11B00-11B09:P 11F00-11F01:M
11F02:L 11F03:M 11F04-11F10:L 11F12-11F33:L 11F34-11F3A:M 11F3E-11F42:M 11F43-11F4F:P
11F50-11F59:N 1342F:L 13440:M 13441-13446:L 13447-13455:M 1B132:L 1B155:L 1D2C0-1D2D3:N
1DF25-1DF2A:L 1E030-1E06D:L 1E08F:M 1E4D0-1E4EB:L 1E4EC-1E4EF:M 1E4F0-1E4F9:N 1F6DC:S
1F774-1F776:S 1F77B-1F77F:S 1F7D9:S 1FA75-1FA77:S 1FA87-1FA88:S 1FAAD-1FAAF:S 1FABB-1FABD:S
1FABF:S 1FACE-1FACF:S 1FADA-1FADB:S 1FAE8:S 1FAF7-1FAF8:S 2B739:L 2EBF0-2EE5D:L 31350-323AF:L
"""


def _parse_changes(table: str) -> list[tuple[int, int, str]]:
    changes = []
    for item in table.split():
        span, _, category = item.partition(":")
        first, _, last = span.partition("-")
        changes.append((int(first, 16), int(last or first, 16), category))
    return changes


_CHANGES = _parse_changes(_UNICODE_15_1_CHANGES)


class _CollapseTable(dict):
    """codepoint -> one-character stand-in, filled on first use (for str.translate)."""

    def __missing__(self, codepoint: int) -> str:
        stand_in = _stand_in(codepoint)
        self[codepoint] = stand_in
        return stand_in


def _stand_in(codepoint: int) -> str:
    if codepoint < 128:
        return chr(codepoint)
    if codepoint in WHITESPACE:
        return _SPACE_STAND_IN
    category = unicodedata.category(chr(codepoint))[0]
    for first, last, changed in _CHANGES:
        if first <= codepoint <= last:
            category = changed
    return _CATEGORY_STAND_IN.get(category, _OTHER_STAND_IN)


_COLLAPSE = _CollapseTable()
_WIDE_SPACES = {cp: _SPACE_STAND_IN for cp in WHITESPACE if cp > 127}


def collapse(text: str) -> str:
    """The collapsed form of `text`: same length, one stand-in character per codepoint."""
    return text if text.isascii() else text.translate(_COLLAPSE)


def collapse_regex(expr: str) -> str:
    """Rewrite a llama.cpp regex that uses \\p{..} so that it runs on collapsed text."""
    out: list[str] = []
    inside_class = False
    i = 0
    while i < len(expr):
        ch = expr[i]
        if ch == "[" and (i == 0 or expr[i - 1] != "\\"):
            inside_class = True
        elif ch == "]" and inside_class and expr[i - 1] != "\\":
            inside_class = False
        match = _PROPERTY_RE.match(expr, i) if ch == "\\" else None
        if match and match.group(1) in _PROPERTY_CLASS:
            body = _CLASS_BODY[_PROPERTY_CLASS[match.group(1)]]
            out.append(body if inside_class else f"[{body}]")
            i = match.end()
            continue
        out.append(ch)
        i += 1
    return "".join(out)


@dataclass(frozen=True)
class _CompiledSplit:
    regex: re.Pattern
    on_collapsed: bool  # True: run on collapsed text; False: on text with wide spaces as \x0B


def _compile(expr: str) -> _CompiledSplit:
    uses_properties = bool(_PROPERTY_RE.search(expr))
    if uses_properties and not expr.isascii():
        raise MinillmError(f"pre-tokenizer regex mixes \\p{{..}} and non-ASCII text: {expr!r}")
    source = collapse_regex(expr) if uses_properties else expr
    if source.endswith("$") and not source.endswith("\\$"):
        source = source[:-1] + r"\Z"  # ECMAScript '$' never matches before a final newline
    return _CompiledSplit(re.compile(source, re.ASCII), uses_properties)


class PreTokenizer:
    """Splits text into words with a list of regexes applied one after the other."""

    def __init__(self, regexes: list[str]):
        self.regexes = list(regexes)
        self._splits = [_compile(expr) for expr in regexes]

    def split(self, text: str) -> list[str]:
        """The words of `text`, in order; their concatenation is `text`."""
        if not text:
            return []
        collapsed = collapse(text) if any(s.on_collapsed for s in self._splits) else text
        spaced = None
        spans = [(0, len(text))]
        for split in self._splits:
            if split.on_collapsed:
                subject = collapsed
            else:
                spaced = spaced if spaced is not None else text.translate(_WIDE_SPACES)
                subject = spaced
            spans = _split_spans(split.regex, subject, spans)
        return [text[start:end] for start, end in spans]


def _split_spans(regex: re.Pattern, subject: str, spans: list[tuple[int, int]]):
    """Split each (start, end) span into regex matches and the gaps between them."""
    result: list[tuple[int, int]] = []
    append = result.append
    for start, end in spans:
        pos = start
        for match in regex.finditer(subject, start, end):
            m_start, m_end = match.span()
            if m_start > pos:
                append((pos, m_start))
            if m_end > m_start:
                append((m_start, m_end))
            pos = m_end
        if pos < end:
            append((pos, end))
    return result
