"""Tokenizers: ids equal llama.cpp's on the golden corpus, text round-trips, streaming is safe.

The golden files in tests/data are llama.cpp's output (see /work/shared/golden/README.md):
tok_*: add_special=false, parse_special=false; tokspecial_*: the model's BOS, special parsed.
"""
import json
import random
import time
import unicodedata

import numpy as np
import pytest

from conftest import DATA, MODELS, REPORT
from minillm.errors import MinillmError
from minillm.tokenizer import Tokenizer, load_vocab
from minillm.tokenizer.pre_types import GPT2, LLAMA3
from minillm.tokenizer.pretokenize import WHITESPACE, PreTokenizer

MODEL_NAMES = ("smollm2", "gemma3")
_tokenizers: dict[str, Tokenizer] = {}


def real_tokenizer(name: str) -> Tokenizer:
    path = MODELS[name]
    if not path.exists():
        pytest.skip(f"{path.name} is absent (run `make models`)")
    if name not in _tokenizers:
        from minillm.gguf_file import GGUFFile

        _tokenizers[name] = Tokenizer.from_gguf(GGUFFile(path))
    return _tokenizers[name]


def golden(kind: str, name: str) -> list[dict]:
    with open(DATA / f"{kind}_{name}_dev.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# --- agreement with llama.cpp ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("kind", ["tok", "tokspecial"])
def test_ids_equal_llama_cpp(name, kind):
    tok = real_tokenizer(name)
    options = dict(add_bos=False, special=False) if kind == "tok" else dict(special=True)
    rows = golden(kind, name)
    wrong = [r for r in rows if tok.tokenize(r["text"], **options) != r["ids"]]
    detail = [(r["text"][:60], tok.tokenize(r["text"], **options)[:12], r["ids"][:12])
              for r in wrong[:3]]
    assert not wrong, f"{len(wrong)} of {len(rows)} texts differ from llama.cpp: {detail}"


@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_detokenize_round_trips_every_line(name):
    tok = real_tokenizer(name)
    for row in golden("tok", name):
        assert tok.detokenize(tok.tokenize(row["text"], add_bos=False)) == row["text"]
        assert tok.detokenize(tok.tokenize(row["text"])) == row["text"]  # BOS renders empty
        with_special = tok.tokenize(row["text"], add_bos=False, special=True)
        assert tok.detokenize(with_special, render_special=True) == row["text"]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_streaming_never_splits_a_character(name):
    tok = real_tokenizer(name)
    for row in golden("tok", name):
        text = row["text"]
        decoder = tok.stream_decoder()
        pieces = [decoder.feed(i) for i in tok.tokenize(text)] + [decoder.flush()]
        assert "".join(pieces) == text
        for piece in pieces:
            piece.encode("utf-8")  # no lone surrogates
            assert "\ufffd" not in piece or "\ufffd" in text


# --- special tokens, BOS, end of generation ---------------------------------------------------
@pytest.mark.slow
def test_smollm2_special_tokens_and_defaults():
    tok = real_tokenizer("smollm2")
    assert tok.n_vocab == 49152 and tok.add_bos is False
    assert tok.tokenize("<|im_start|>user", special=True)[0] == 1
    assert 1 not in tok.tokenize("<|im_start|>user")  # plain text unless special=True
    assert {0, 2} <= tok.eog_ids and tok.eos_id == 2 and tok.is_eog(2)
    assert tok.token_text(1) == "<|im_start|>"


@pytest.mark.slow
def test_gemma3_bos_and_eog():
    tok = real_tokenizer("gemma3")
    assert tok.add_bos and tok.bos_id == 2 and tok.tokenize("hi")[0] == 2
    assert tok.tokenize("hi", add_bos=False)[0] != 2
    assert {1, 106} <= tok.eog_ids  # <eos>, <end_of_turn>
    assert tok.detokenize([2, 106]) == "" and tok.detokenize([106], render_special=True) == "<end_of_turn>"


# --- bad ids and bytes ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_ids_outside_vocab_raise(name):
    tok = real_tokenizer(name)
    for bad in (tok.n_vocab, -1, 10**12, 1.5, "3"):
        with pytest.raises(MinillmError):
            tok.detokenize([bad])
        with pytest.raises(MinillmError):
            tok.stream_decoder().feed(bad)
    with pytest.raises(MinillmError):
        tok.token_text(tok.n_vocab)


@pytest.mark.slow
def test_gemma3_byte_tokens_stream_and_invalid_utf8():
    tok = real_tokenizer("gemma3")
    byte = {b: tok.vocab.token_to_id[f"<0x{b:02X}>"] for b in (0xE4, 0xBD, 0xA0, 0xFF, 0x41)}
    decoder = tok.stream_decoder()
    assert [decoder.feed(byte[b]) for b in (0xE4, 0xBD, 0xA0)] == ["", "", "你"]
    assert tok.detokenize([byte[0xFF], byte[0x41]]) == "\ufffdA"
    decoder = tok.stream_decoder()
    assert decoder.feed(byte[0xE4]) == "" and decoder.flush() == "\ufffd"


@pytest.mark.slow
def test_smollm2_emoji_split_across_tokens():
    tok = real_tokenizer("smollm2")
    ids = tok.tokenize(" 🦙", add_bos=False)
    assert len(ids) > 1  # the llama is not one token: its bytes span several
    decoder = tok.stream_decoder()
    pieces = [decoder.feed(i) for i in ids]
    assert pieces[0] == " " and "".join(pieces) == " 🦙" and decoder.flush() == ""


# --- speed (reported, not asserted) -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_report_speed(name):
    from minillm.gguf_file import GGUFFile

    real_tokenizer(name)  # skips when absent
    start = time.perf_counter()
    tok = Tokenizer.from_gguf(GGUFFile(MODELS[name]))
    load_s = time.perf_counter() - start
    base = (DATA / "ppl_text_dev.txt").read_text(encoding="utf-8")
    text = (base + "\n") * (1_000_000 // len(base) + 1)
    start = time.perf_counter()
    ids = tok.tokenize(text)
    tokenize_s = time.perf_counter() - start
    start = time.perf_counter()
    assert tok.detokenize(ids) == text
    detokenize_s = time.perf_counter() - start
    line = (f"tokenizer {name}: GGUF open + vocab load {load_s:.3f} s; tokenize "
            f"{len(text.encode()) / 1e6:.2f} MB ({len(ids)} tokens) {tokenize_s:.2f} s; "
            f"detokenize {detokenize_s:.2f} s")
    REPORT.append(line)
    print(line)


# --- small synthetic vocabularies (no model files needed) ---------------------------------------
def spm_tokenizer(**overrides) -> Tokenizer:
    pieces = {"<unk>": 0.0, "<s>": 0.0, "</s>": 0.0, "▁": -1.0, "H": -2.0, "e": -2.0, "l": -2.0,
              "o": -2.0, "He": -3.0, "ll": -1.5, "llo": -1.2, "Hello": -0.5, "▁Hello": -0.1}
    texts = list(pieces) + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [1] * (len(pieces) - 3) + [6] * 256
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": texts,
                "tokenizer.ggml.scores": list(pieces.values()) + [0.0] * 256,
                "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
                "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    metadata.update(overrides)
    return Tokenizer(load_vocab(metadata))


def test_spm_space_prefix_merges_and_byte_fallback():
    tok = spm_tokenizer()
    ids = tok.tokenize("Hello é")
    assert [tok.token_text(i) for i in ids] == ["<s>", "▁Hello", "▁", "<0xC3>", "<0xA9>"]
    assert tok.detokenize(ids) == "Hello é"  # the added space is removed again
    no_prefix = spm_tokenizer(**{"tokenizer.ggml.add_space_prefix": False})
    assert [no_prefix.token_text(i) for i in no_prefix.tokenize("Hello", add_bos=False)] == ["Hello"]


def test_spm_special_tokens_only_when_asked():
    tok = spm_tokenizer()
    assert tok.tokenize("</s>", add_bos=False, special=True) == [2]
    assert 2 not in tok.tokenize("</s>", add_bos=False)
    assert tok.detokenize([2]) == "" and tok.detokenize([2], render_special=True) == "</s>"


def test_eos_added_only_with_the_model_defaults():
    tok = spm_tokenizer(**{"tokenizer.ggml.add_eos_token": True})
    assert tok.tokenize("Hello")[-1] == 2 and tok.tokenize("Hello")[0] == 1
    assert 2 not in tok.tokenize("Hello", add_bos=False)
    assert tok.tokenize("Hello", add_bos=False, add_eos=True)[-1] == 2


def test_vocab_texts_and_index_from_raw_bytes():
    """Token texts kept as the file's bytes: lookups by text give the last id of a repeated text,
    llama.cpp's name for an empty text, and non-UTF-8 tokens under their surrogateescape text."""
    import zlib

    from minillm.gguf_file import StringArray
    from minillm.kernels.cpu.text import CRC32_TABLE, crc32
    from minillm.tokenizer.texts import TextIndex, TokenIndex, VocabTexts

    raw = [b"a", b"ab", b"", "\u2581x".encode(), b"\xff\xfe", b"ab", b"abc", b"\xe9"]
    ends = np.cumsum([len(r) for r in raw])
    texts = VocabTexts(StringArray(b"".join(raw), ends - [len(r) for r in raw], ends))
    index = TokenIndex(texts)
    assert texts[2] == "[EMPTY_2]" and texts[3] == "\u2581x" and texts[4] == "\udcff\udcfe"
    assert [index.get(texts[i]) for i in range(len(raw))] == [0, 5, 2, 3, 4, 5, 6, 7]
    assert index.get("abcd") is None and "b" not in index and index.get("[EMPTY_1]") is None
    assert TextIndex(texts.strings, keep_first=True)["ab"] == 1  # as BPE merge ranks count
    with pytest.raises(KeyError):
        index["\ud800"]  # a lone surrogate no token can hold
    assert texts.chars_before("x") >= {"\u2581"}
    data = np.frombuffer(bytes(range(256)) * 3, np.uint8)
    for start, end in ((0, 0), (0, 1), (5, 300), (0, 768)):
        assert crc32(data, start, end, CRC32_TABLE) == zlib.crc32(data[start:end].tobytes())


def bpe_tokenizer(pre: str = "gpt-2", extra_tokens=()) -> Tokenizer:
    from minillm.tokenizer.bpe import BYTE_TO_CHAR

    texts = list(BYTE_TO_CHAR) + ["th", "the", "Ġth", "Ġthe", *extra_tokens]
    merges = ["t h", "th e", "Ġ th", "Ġth e"]
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                "tokenizer.ggml.tokens": texts, "tokenizer.ggml.merges": merges}
    return Tokenizer(load_vocab(metadata))


def test_bpe_merges_lowest_rank_first():
    tok = bpe_tokenizer()
    # "Ġthe": (t,h) rank 0 first; then (th,e) rank 1 beats (Ġ,th) rank 2, leaving Ġ + the.
    assert [tok.token_text(i) for i in tok.tokenize("the the")] == ["the", "Ġ", "the"]
    assert tok.detokenize(tok.tokenize("the the")) == "the the"


def test_bpe_llama3_keeps_whole_word_tokens_and_adds_bos():
    tok = bpe_tokenizer(pre="llama3")  # ignore_merges: a word that is a token stays whole
    assert tok.add_bos and tok.tokenize("the the") == [tok.bos_id] + [
        tok.vocab.token_to_id[t] for t in ("the", "Ġthe")]


def test_bpe_end_of_turn_found_by_text_is_control_and_eog():
    tok = bpe_tokenizer(extra_tokens=["<|im_end|>"])
    end = tok.vocab.token_to_id["<|im_end|>"]
    assert end in tok.eog_ids
    assert tok.tokenize("<|im_end|>", special=True) == [end]
    assert end not in tok.tokenize("<|im_end|>")


def test_unknown_pre_tokenizer_and_model_are_named():
    with pytest.raises(MinillmError, match="no-such-pre"):
        bpe_tokenizer(pre="no-such-pre")
    with pytest.raises(MinillmError, match="bert"):
        load_vocab({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


# --- the collapsed-regex pre-tokenizer equals llama.cpp's hand-written scanners ------------------
def _flags(text: str, i: int):
    """(whitespace, letter, number, in range) of text[i], as llama.cpp's unicode_cpt_flags."""
    if not 0 <= i < len(text):
        return (False, False, False, False)
    category = unicodedata.category(text[i])[0]
    return (ord(text[i]) in WHITESPACE, category == "L", category == "N", True)


def _scan(text: str, llama3: bool) -> list[str]:
    """A direct port of unicode_regex_split_custom_gpt2 / _llama3 (unicode.cpp)."""
    words, start, pos, n = [], 0, 0, len(text)

    def cut(end):
        nonlocal start
        if end > start:
            words.append(text[start:end])
        start = end

    while pos < n:
        ch, (ws, letter, number, _) = text[pos], _flags(text, pos)
        if ch == "'" and pos + 1 < n:
            pair = text[pos + 1:pos + 3].lower() if llama3 else text[pos + 1:pos + 3]
            if pair[:1] in ("s", "t", "m", "d"):
                pos += 2; cut(pos); continue
            if pos + 2 < n and pair in ("re", "ve", "ll"):
                pos += 3; cut(pos); continue
        if llama3 and ch not in "\r\n" and not number and (letter or _flags(text, pos + 1)[1]):
            pos += 1
            while _flags(text, pos)[1]:
                pos += 1
            cut(pos); continue
        if llama3 and number:
            while _flags(text, pos)[2] and pos - start < 3:
                pos += 1
            cut(pos); continue
        nxt = _flags(text, pos + 1) if ch == " " else (ws, letter, number, True)
        if not llama3 and (nxt[1] or nxt[2]):
            kind = 1 if nxt[1] else 2
            pos += ch == " "
            while _flags(text, pos)[kind]:
                pos += 1
            cut(pos); continue
        if not (nxt[0] or nxt[1] or nxt[2]) and (nxt[3] or (llama3 and ch == " ")):
            pos += ch == " "
            while not any(_flags(text, pos)[:3]) and _flags(text, pos)[3]:
                pos += 1
            while llama3 and pos < n and text[pos] in "\r\n":
                pos += 1
            cut(pos); continue
        spaces = 0
        while _flags(text, pos + spaces)[0]:
            spaces += 1
        newline_end = max((pos + k + 1 for k in range(spaces) if text[pos + k] in "\r\n"), default=0)
        if llama3 and newline_end:
            pos = newline_end
        elif spaces > 1 and pos + spaces < n:
            pos += spaces - 1
        else:
            pos += max(spaces, 1)
        cut(pos)
    return words


_POOL = list("aZé中ß3٣½ \t\n\r\xa0\u3000'stmdrevlST.,!$~_\x00\x1c\u0301🦙-") + ["'s", "'LL", "  "]


@pytest.mark.parametrize("regex,llama3", [(GPT2, False), (LLAMA3, True)])
def test_regex_split_matches_llama_cpp_scanner(regex, llama3):
    rng = random.Random(1234)
    splitter = PreTokenizer([regex])
    for _ in range(3000):
        text = "".join(rng.choice(_POOL) for _ in range(rng.randint(0, 14)))
        assert splitter.split(text) == _scan(text, llama3), repr(text)


# --- the `tokenize` command -----------------------------------------------------------------------
def cli_app():
    import typer

    from minillm.cli.tokenize import register

    app = typer.Typer()

    @app.callback()
    def main():
        """Test app."""

    register(app)
    return app


@pytest.mark.slow
def test_cli_tokenize_ids_and_human_output():
    from typer.testing import CliRunner

    tok = real_tokenizer("smollm2")
    path = str(MODELS["smollm2"])
    runner = CliRunner()
    result = runner.invoke(cli_app(), ["tokenize", path, "-p", "<|im_start|>hi 🦙", "--ids", "--special"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == tok.tokenize("<|im_start|>hi 🦙", special=True)
    result = runner.invoke(cli_app(), ["tokenize", path], input="Hello world")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == len(tok.tokenize("Hello world"))
    assert lines[1].split(None, 1) == [str(tok.tokenize("Hello world")[1]), "' world'"]


@pytest.mark.slow
def test_cli_tokenize_no_bos():
    from typer.testing import CliRunner

    tok = real_tokenizer("gemma3")
    args = ["tokenize", str(MODELS["gemma3"]), "-p", "hi", "--ids"]
    with_bos = json.loads(CliRunner().invoke(cli_app(), args).stdout)
    without = json.loads(CliRunner().invoke(cli_app(), args + ["--no-bos"]).stdout)
    assert with_bos == [tok.bos_id] + without == tok.tokenize("hi")


def test_cli_tokenize_bad_model_path(tmp_path):
    from typer.testing import CliRunner

    for bad in (tmp_path / "missing.gguf", tmp_path):
        result = CliRunner().invoke(cli_app(), ["tokenize", str(bad), "-p", "x"])
        assert result.exit_code == 1
        assert result.stderr.startswith("error: ") and result.stdout == ""


def test_every_known_pre_tokenizer_compiles_and_keeps_all_text():
    from minillm.tokenizer.pre_types import PRE_TYPES

    text = "Hello World! 12345 你好世界 Ωmega\r\n\n  x\u3000'LL don't é\u0301 🦙"
    for name, pre in PRE_TYPES.items():
        words = PreTokenizer(list(pre.regexes)).split(text)
        assert "".join(words) == text and all(words), name


def test_categories_follow_llama_cpp_unicode_15_1_tables():
    # U+31350 (CJK Extension H, Unicode 15.0) is a letter for llama.cpp, so it joins the word.
    assert PreTokenizer([GPT2]).split("a\U00031350 x") == ["a\U00031350", " x"]


def _fixup_rows() -> list[dict]:
    with open(DATA / "tokfixups.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_tokens_retyped_by_text_as_llama_cpp(name):
    """llama.cpp re-types some tokens by their text whatever the file says (Gemma 3's "</s>",
    USER_DEFINED in the file, becomes CONTROL and ends generation): the same types, the same
    end-of-generation set, and the same ids for texts that hold such tokens, plain or special."""
    from minillm.gguf_file import GGUFFile

    tok = real_tokenizer(name)
    rows = [r for r in _fixup_rows() if r["model"] == name]
    summary = next(r for r in rows if "retyped" in r)
    file_types = list(GGUFFile(MODELS[name]).metadata["tokenizer.ggml.token_type"])
    changed = [[i, int(tok.token_type(i))] for i, t in enumerate(file_types)
               if int(tok.token_type(i)) != t and not (t == 5 and tok.token_type(i) == 3)]
    assert changed == summary["retyped"]
    assert sorted(tok.eog_ids) == summary["eog"]
    for r in rows:
        if "text" in r:
            options = dict(add_bos=False, special=False) if r["kind"] == "tok" else dict(special=True)
            assert tok.tokenize(r["text"], **options) == r["ids"], (r["kind"], r["text"])


VOCAB_DIR = DATA.parent.parent / "models" / "vocab"
VOCAB_IDS = np.load(DATA / "tok_vocabs.npz")
VOCAB_NAMES = sorted({key.split("/")[0] for key in VOCAB_IDS.files})


@pytest.mark.slow
@pytest.mark.parametrize("vocab", VOCAB_NAMES)
def test_pre_tokenizers_equal_llama_cpp(vocab):
    """Each kind of vocabulary and pre-tokenizer (llama.cpp's vocabulary-only test files:
    llama-bpe, qwen2, refact, Phi-3's SentencePiece, ...) on the 190 reference texts: the ids
    llama.cpp b11434 gives (tests/llama_ref/record_tok_vocabs.py)."""
    from minillm.gguf_file import GGUFFile

    path = VOCAB_DIR / f"ggml-vocab-{vocab}.gguf"
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make models` (make test does it)")
    tok = Tokenizer.from_gguf(GGUFFile(path))
    ids, offsets = VOCAB_IDS[f"{vocab}/ids"], VOCAB_IDS[f"{vocab}/offsets"]
    rows = golden("tok", "smollm2")
    wrong = [r["text"][:40] for i, r in enumerate(rows)
             if tok.tokenize(r["text"], add_bos=False, special=False) != ids[offsets[i]:offsets[i + 1]].tolist()]
    assert not wrong, f"{len(wrong)} of {len(rows)} texts differ from llama.cpp: {wrong[:3]}"
