"""TekkenTokenizer against mistral-common's Tekkenizer (the reference), its cache and its errors."""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from voxtral_mlx import tokenizer as tokenizer_mod
from voxtral_mlx.errors import InputError, TokenizerError
from voxtral_mlx.synthetic.tekken import (
    TEKKEN_PATTERN,
    build_tekken,
    mistral_common_tekken_path,
    write_tekken,
)
from voxtral_mlx.tokenizer import TekkenTokenizer, default_cache_dir

Tekkenizer = pytest.importorskip("mistral_common.tokens.tokenizers.tekken").Tekkenizer

# The 20 preset voices of Voxtral-4B-TTS-2603 and their [AUDIO] counts (tekken.json).
VOICES = json.loads((Path(__file__).with_name("data") / "reference" / "voices.json").read_text())[
    "voice_num_audio_tokens"
]

CORPUS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 5 o'clock, isn't it?",
    "english_caps": "HELLO World! McDonald's iPhone XKCD camelCaseWords and snake_case_words",
    "french": "Où est la bibliothèque ? L'été dernier, nous étions à Besançon — c'était génial !",
    "german": "Größenwahn: Die Straße ist naß, Äpfel und Übermäßigkeit. Fußgängerübergänge!",
    "spanish": "¿Dónde está el baño? ¡Mañana será otro día, señor Muñoz!",
    "italian": "Perché non è già arrivato? Più tardi, all'università.",
    "portuguese": "Não sei se você está pronto, mas ações falam mais que palavras. Coração!",
    "dutch": "Het is een prachtige dag in Amsterdam; de fietsen staan klaar bij 't IJ.",
    "arabic": "مرحبا بالعالم! كيف حالك اليوم؟ هذه جملة عربية مع تشكيل: مُحَمَّدٌ",
    "hindi": "नमस्ते दुनिया! आप कैसे हैं? यह हिन्दी का एक वाक्य है। क्षत्रिय ज्ञान",
    "chinese": "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "japanese": "こんにちは世界。カタカナとひらがな、そして漢字を混ぜた文章です。ｶﾀｶﾅ",
    "korean": "안녕하세요, 세계! 오늘은 날씨가 좋네요. 한국어 문장입니다.",
    "russian": "Съешь же ещё этих мягких французских булок, да выпей чаю. ЁЖИК!",
    "greek_hebrew_thai": "Καλημέρα κόσμε — שלום עולם — สวัสดีชาวโลก",
    "emoji": "I ❤️ it 😀😃😄 👍🏽 🎉🎊 ☕️ 🇫🇷🇩🇪🇯🇵 🏳️‍🌈",
    "emoji_zwj": "👨‍👩‍👧‍👦 family, 👩🏽‍💻 coder, 🧑‍🤝‍🧑 pair, 🏴‍☠️ pirate",
    "digits": "0 1 12 123 1234 12345 3.14159 -42 1,000,000 2024-03-26 10:45:00",
    "long_number": "31415926535897932384626433832795028841971693993751058209749445923",
    "whitespace": "a  b   c    d\te\t\tf\ng\n\nh\r\ni\r\n\r\nj \n k\t\n",
    "trailing": "trailing spaces   ",
    "leading": "   leading spaces",
    "only_spaces": "     ",
    "only_newlines": "\n\n\n",
    "crlf": "line one\r\nline two\r\n\r\nline four\r\n",
    "nbsp_and_wide": "non\u00a0breaking\u2009thin\u3000ideographic\u200bzw",
    "punctuation": "Wait... what?!? (yes) [no] {maybe} <tag> --- *** ''' \"\"\" ;;; :: ,, !!",
    "quotes": "“Curly” ‘quotes’ «guillemets» „German“ 「Japanese」",
    "url_email": "Visit https://example.com/path?q=1&b=two#frag or mail jane.doe+tts@example.org",
    "code": "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tprint(f\"{x!r}\")\n",
    "special_strings": "[AUDIO] <s> </s> [BEGIN_AUDIO][NEXT_AUDIO_TEXT] <unk> <SPECIAL_42> [INST]",
    "control_chars": "a\x00b\x01c\x7fd\x1be\x0cf\x0bg",
    "combining": "e\u0301 a\u0308 n\u0303 \u0301lonely mark Z\u0351\u0352\u0353",
    "math_symbols": "∑ x² ≤ ∞ ∂f/∂x ≈ π·r² ± √2 → ⇒ ∀ε>0 ∃δ",
    "mixed_scripts": "Hello世界Привет123مرحبا🙂नमस्ते",
    "single_char": "a",
    "single_space": " ",
    "empty": "",
}
LONG_TEXT = "".join(CORPUS.values()) * 40 + "a" * 5000 + " " * 3000 + "9" * 2000 + "\n" * 500 + "x"


@pytest.fixture(scope="session")
def tekken_file(tmp_path_factory) -> Path:
    """The TTS layout with mistral-common's BPE vocab (equal to the TTS model's) and real voices."""
    source = mistral_common_tekken_path()
    assert source is not None, "mistral-common's data/tekken_240911.json not found"
    data = build_tekken(VOICES, vocab_source=source)
    return write_tekken(tmp_path_factory.mktemp("tekken") / "tekken.json", data)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tok-cache")


@pytest.fixture(scope="session")
def ref(tekken_file):
    return Tekkenizer.from_file(tekken_file)


@pytest.fixture(scope="session")
def built_tok(tekken_file, cache_dir) -> TekkenTokenizer:
    """The first load: built from tekken.json, and written to the (empty) cache."""
    return TekkenTokenizer.from_file(tekken_file, cache_dir=cache_dir)


@pytest.fixture(scope="session", params=["built", "cached"])
def tok(request, built_tok, tekken_file, cache_dir) -> TekkenTokenizer:
    """Both forms a process meets: the first load's build, and every later load's read of the
    cache entry (which stores the model in its own, faster-to-read serialization)."""
    if request.param == "built":
        return built_tok
    build = tokenizer_mod._build
    tokenizer_mod._build = _no_build
    _unshared()
    try:
        return TekkenTokenizer.from_file(tekken_file, cache_dir=cache_dir)
    finally:
        tokenizer_mod._build = build


@pytest.fixture(scope="session")
def byte_tekken_file(tmp_path_factory) -> Path:
    data = build_tekken({"ar_male": 67, "tiny": 2}, vocab_source=None)
    return write_tekken(tmp_path_factory.mktemp("byte-tekken") / "tekken.json", data)


def ref_encode(ref, text: str) -> list[int]:
    return ref.encode(text, bos=False, eos=False)


# ---------------------------------------------------------------------- layout


def test_built_file_has_the_published_layout(tekken_file):
    data = json.loads(tekken_file.read_text(encoding="utf-8"))
    assert list(data) == ["config", "vocab", "special_tokens", "audio"]
    cfg = data["config"]
    assert cfg["pattern"] == TEKKEN_PATTERN
    assert (cfg["num_vocab_tokens"], cfg["default_vocab_size"]) == (150000, 131072)
    assert (cfg["default_num_special_tokens"], cfg["version"]) == (1000, "v7")
    specials = data["special_tokens"]
    assert [t["rank"] for t in specials] == list(range(1000))
    assert all(t["is_control"] for t in specials)
    named = {t["rank"]: t["token_str"] for t in specials}
    assert [named[i] for i in (0, 1, 2, 24, 25, 35, 36)] == [
        "<unk>",
        "<s>",
        "</s>",
        "[AUDIO]",
        "[BEGIN_AUDIO]",
        "[REPEAT_AUDIO_TEXT]",
        "[NEXT_AUDIO_TEXT]",
    ]
    assert named[999] == "<SPECIAL_999>"
    assert data["audio"]["voice_num_audio_tokens"] == VOICES
    assert data["audio"]["sampling_rate"] == 24000
    assert data["audio"]["frame_rate"] == 12.5


def test_attributes(tok, tekken_file, ref):
    assert tok.vocab_size == 131072
    assert tok.num_special_tokens == 1000
    assert tok.version == "v7"
    assert tok.path == tekken_file
    assert tok.voice_num_audio_tokens == VOICES
    assert tok.audio["sampling_rate"] == 24000
    assert tok.audio["audio_encoding_config"]["num_mel_bins"] == 128
    for name in ("<unk>", "<s>", "</s>", "[AUDIO]", "[BEGIN_AUDIO]", "[NEXT_AUDIO_TEXT]"):
        assert tok.special_id(name) == tok.special_ids[name] == ref.get_special_token(name)
    assert len(tok.special_ids) == 1000


def test_unknown_special_token_is_named(tok):
    with pytest.raises(TokenizerError, match=r"\[NOT_A_TOKEN\]"):
        tok.special_id("[NOT_A_TOKEN]")


# ---------------------------------------------------------------------- encode / decode


@pytest.mark.parametrize("name", list(CORPUS))
def test_encode_matches_mistral_common(tok, ref, name):
    text = CORPUS[name]
    assert tok.encode(text) == ref_encode(ref, text)


def test_encode_long_input(tok, ref):
    assert len(LONG_TEXT) > 50_000
    ids = tok.encode(LONG_TEXT)
    assert ids == ref_encode(ref, LONG_TEXT)
    assert tok.decode(ids) == LONG_TEXT


def test_a_long_text_lets_other_threads_run_while_it_is_tokenized(tok, ref):
    """encode() held the GIL throughout (0.3 s for 100,000 words): an app's event loop
    stalled even when the text was tokenized in another thread."""
    import threading
    import time

    text = "Hello world, and more words. " * 20_000
    ticks: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        time.sleep(0.01)
        t0 = time.perf_counter()
        ids = tok.encode(text)
        t1 = time.perf_counter()
    finally:
        stop.set()
        thread.join()
    assert ids == ref_encode(ref, text)
    assert sum(t0 < t < t1 for t in ticks) >= 10, (t1 - t0, len(ticks))
    odd = "a\ud800b \udfff " * 2000  # lone surrogates, replaced as tiktoken does
    assert tok.encode(odd) == ref_encode(ref, odd)


def test_known_ids(tok):
    assert tok.encode("Hello.") == [22177, 1046]
    assert tok.encode("") == []


def test_special_token_strings_are_plain_text(tok):
    ids = tok.encode(CORPUS["special_strings"])
    assert all(i >= tok.num_special_tokens for i in ids)
    assert tok.encode("[AUDIO]") != [tok.special_id("[AUDIO]")]


def test_lone_surrogates_are_replaced_like_tiktoken(tok, ref):
    for text in ["a\ud800b", "\udfff", "x\ud83dy", "\ud83d\ude00 pair"]:
        assert tok.encode(text) == ref_encode(ref, text)


@pytest.mark.parametrize("name", list(CORPUS))
def test_decode_roundtrip(tok, name):
    text = CORPUS[name]
    assert tok.decode(tok.encode(text)) == text


def test_decode_skips_special_ids_like_mistral_common(tok, ref):
    hello = tok.encode("Hello, world")
    ids = [1, 25, 24, *hello, 35, 2]
    assert tok.decode(ids) == "Hello, world"
    # A special id between the bytes of one character: each side decodes on its own.
    euro = tok.encode("€")
    raw = [1000 + b for b in "€".encode()]
    assert tok.decode(raw) == "€" == tok.decode(euro)
    split = [raw[0], 24, *raw[1:]]
    assert tok.decode(split) == ref.decode(split)


def test_decode_rejects_out_of_range_ids(tok):
    with pytest.raises(TokenizerError, match="131072"):
        tok.decode([1000, 131072])
    with pytest.raises(TokenizerError, match="-1"):
        tok.decode([-1])


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda t: t.decode(None), "ids must be a sequence of integers, got NoneType"),
        (lambda t: t.decode("1046"), "got str"),
        (lambda t: t.decode(["abc"]), "got 'abc' (str)"),
        (lambda t: t.decode([float("nan")]), "got nan (float)"),
        (lambda t: t.decode([1046.9]), "got 1046.9 (float)"),
        (lambda t: t.special_id(["[AUDIO]"]), "got list"),
    ],
)
def test_decode_and_special_id_refuse_what_is_no_id(tok, call, words):
    """A float was cut to an id (1046.9 decoded as '.'; mistral-common raises), other values
    raised TypeError or ValueError from inside."""
    with pytest.raises(InputError) as info:
        call(tok)
    assert words in str(info.value)


def test_decode_takes_numpy_ids(tok):
    assert tok.decode(np.array([22177, 1046], dtype=np.int32)) == "Hello."


_HYPO = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
_ANY_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=80)
# Letters of several scripts, digits, marks, whitespace and punctuation: exercises the regex.
_MIXED_TEXT = st.text(
    st.sampled_from(
        list("aAzZéÉßøñçğıİ")
        + list("абвЖЯ")
        + list("你好世界")
        + list("かカ한글")
        + list("مرحبा")
        + list("नमस्ते")
        + ["\u0301", "\u093f", "\u200d", "\ufe0f", "🏽"]
        + list("0123456789")
        + list(" \t\n\r\u00a0\u3000")
        + list(".,;:!?'\"()[]<>/\\-_*#@&%$")
        + ["😀", "👍", "🇫", "🇷", "…", "—", "’"]
    ),
    max_size=120,
)


@_HYPO
@given(text=st.one_of(_ANY_TEXT, _MIXED_TEXT))
def test_encode_matches_mistral_common_on_generated_text(tok, ref, text):
    ids = tok.encode(text)
    assert ids == ref_encode(ref, text)
    assert tok.decode(ids) == text


@settings(max_examples=150, deadline=None, database=None)
@given(ranks=st.lists(st.integers(0, 130071), min_size=1, max_size=12), strip=st.booleans())
def test_encode_matches_on_concatenated_vocab_tokens(tok, ref, ranks, strip):
    """Glued vocab tokens reach many intermediate BPE states inside one pre-token."""
    pieces = [ref.id_to_byte_piece(r + 1000) for r in ranks]
    if strip:
        pieces = [p.strip() for p in pieces]
    text = b"".join(pieces).decode("utf-8", "ignore")
    assert tok.encode(text) == ref_encode(ref, text)


@settings(max_examples=150, deadline=None, database=None)
@given(ids=st.lists(st.integers(0, 131071), max_size=16))
def test_decode_matches_mistral_common_on_any_ids(tok, ref, ids):
    assert tok.decode(ids) == ref.decode(ids)


def test_random_token_concatenations_bulk(tok, ref):
    """Wider, seeded sweep of the same idea (cheap: about a second)."""
    rng = random.Random(1234)
    texts = []
    for _ in range(3000):
        pieces = [ref.id_to_byte_piece(rng.randrange(1000, 131072)) for _ in range(8)]
        texts.append(b"".join(pieces).decode("utf-8", "ignore"))
    assert [tok.encode(t) for t in texts] == [ref_encode(ref, t) for t in texts]


def test_tokens_past_the_default_vocab_size_are_never_produced(tok, ref, tekken_file):
    """tekken.json holds 150,000 ranks, of which the model uses the first 130,072: the text
    of a later token (" ETH" is rank 130,072) is made of earlier ones, as in mistral-common."""
    data = json.loads(tekken_file.read_text(encoding="utf-8"))
    assert len(data["vocab"]) > 130072
    rng = random.Random(7)
    ranks = [130072, 130073, *rng.sample(range(130074, len(data["vocab"])), 300)]
    pieces = [base64.b64decode(data["vocab"][r]["token_bytes"]) for r in ranks]
    texts = [p.decode("utf-8", "ignore") for p in pieces]
    texts.append(b"".join(pieces[:40]).decode("utf-8", "ignore"))
    assert texts[0] == " ETH" and tok.encode(" ETH") == [1436, 12001]
    encoded = [tok.encode(t) for t in texts]
    assert encoded == [ref_encode(ref, t) for t in texts]
    assert max(max(ids) for ids in encoded if ids) < 131072


# ---------------------------------------------------------------------- other vocabs


def test_byte_vocab_tekken_agrees_with_mistral_common(byte_tekken_file, tmp_path):
    ours = TekkenTokenizer.from_file(byte_tekken_file, cache_dir=tmp_path)
    ref = Tekkenizer.from_file(byte_tekken_file)
    assert ours.vocab_size == 1256
    assert ours.voice_num_audio_tokens == {"ar_male": 67, "tiny": 2}
    for text in [*CORPUS.values(), LONG_TEXT[:5000]]:
        ids = ours.encode(text)
        assert ids == ref_encode(ref, text)
        assert ids == [1000 + b for b in text.encode("utf-8")]
        assert ours.decode(ids) == text


def test_truncated_vocab_tekken_agrees_with_mistral_common(tmp_path):
    data = build_tekken({"v": 1}, vocab_source="auto", n_vocab=3000)
    assert data["config"]["default_vocab_size"] == 4000
    assert len(data["vocab"]) == 3000
    path = write_tekken(tmp_path / "model" / "tekken.json", data)
    ours = TekkenTokenizer.from_file(path, cache_dir=tmp_path / "cache")
    ref = Tekkenizer.from_file(path)
    for text in CORPUS.values():
        assert ours.encode(text) == ref_encode(ref, text)


def test_library_never_imports_mistral_common(tmp_path):
    code = (
        "import sys\n"
        "from voxtral_mlx.synthetic.tekken import build_tekken, write_tekken\n"
        "from voxtral_mlx.tokenizer import TekkenTokenizer\n"
        f"data = build_tekken({{'v': 1}}, 'auto', n_vocab=1000)\n"
        f"p = write_tekken({str(tmp_path / 'tekken.json')!r}, data)\n"
        f"TekkenTokenizer.from_file(p, cache_dir={str(tmp_path)!r}).encode('hi')\n"
        "assert 'mistral_common' not in sys.modules, 'mistral_common was imported'\n"
        "assert 'tiktoken' not in sys.modules, 'tiktoken was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_build_tekken_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n_vocab"):
        build_tekken({"v": 1}, vocab_source=None, n_vocab=100)
    with pytest.raises(ValueError, match="negative"):
        build_tekken({"v": -1}, vocab_source=None)


# ---------------------------------------------------------------------- cache


def _cache_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "tokenizers").glob("tekken-*.json"))


def _no_build(*_args, **_kwargs):
    raise AssertionError("tokenizer was rebuilt instead of loaded from the cache")


def _forbid_build(monkeypatch):
    monkeypatch.setattr(tokenizer_mod, "_build", _no_build)


def _unshared() -> None:
    """The next load reads the cache folder, not a build in use in this process."""
    tokenizer_mod._LIVE.clear()


def test_second_load_uses_the_cache(tok, tekken_file, cache_dir, monkeypatch):
    files = _cache_files(cache_dir)
    assert len(files) == 1
    _forbid_build(monkeypatch)
    _unshared()
    again = TekkenTokenizer.from_file(tekken_file, cache_dir=cache_dir)
    assert again.encode(CORPUS["mixed_scripts"]) == tok.encode(CORPUS["mixed_scripts"])
    assert again.special_ids == tok.special_ids
    assert again.voice_num_audio_tokens == VOICES
    assert again.audio == tok.audio
    assert (again.vocab_size, again.version) == (131072, "v7")


@pytest.mark.parametrize(
    "damage",
    [
        lambda meta, body: ({**meta, "audio": []}, body),  # raised AttributeError
        lambda meta, body: ({**meta, "max_token_bytes": 10**9}, body),  # was trusted
        lambda meta, body: (meta, json.dumps({**json.loads(body), "pre_tokenizer": None})),
        lambda meta, body: (meta, body[: len(body) // 2]),
    ],
    ids=["audio-list", "edited-meta", "edited-body", "truncated"],
)
def test_a_damaged_or_edited_cache_entry_is_rebuilt(byte_tekken_file, tmp_path, damage):
    """The entry is the project's own file, but a disk, a crash or a hand can change it: a
    checksum over it makes any change a rebuild, never a wrong tokenizer or a traceback."""
    fresh = TekkenTokenizer.from_file(byte_tekken_file, cache_dir=tmp_path)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    head, _, body = entry.read_text(encoding="utf-8").partition("\n")
    meta, body = damage(json.loads(head), body)
    entry.write_text(json.dumps(meta) + "\n" + body, encoding="utf-8")
    _unshared()
    again = TekkenTokenizer.from_file(byte_tekken_file, cache_dir=tmp_path)
    text = CORPUS["mixed_scripts"]
    assert again.encode(text) == fresh.encode(text)
    assert (again.audio, again.max_token_bytes) == (fresh.audio, fresh.max_token_bytes)
    assert tokenizer_mod._read_cache(entry, json.loads(head)["sha256"]) is not None  # rewritten


def test_a_vocabulary_making_too_many_merges_is_refused(tekken_file, tmp_path, monkeypatch):
    """Every substring of one long token as a token (19 MB, 10.7 M merges) took over 8 GB to
    build; here the cap is lowered below the real vocabulary's 270,000 merges instead."""
    monkeypatch.setattr(tokenizer_mod, "MAX_MERGES", 100_000)
    with pytest.raises(TokenizerError) as exc:
        TekkenTokenizer.from_file(tekken_file, cache_dir=tmp_path)
    message = str(exc.value)
    assert "over 100,000 merges" in message and "\n" not in message


def test_cache_serialization_keeps_pairs_a_string_could_not_hold():
    from tokenizers import Tokenizer, models

    def merges(backend: Tokenizer) -> list:
        return json.loads(tokenizer_mod._serialized(backend))["model"]["merges"]

    plain = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    assert merges(plain) == ["a b"]
    spaced = Tokenizer(models.BPE(vocab={"a": 0, " ": 1, "a ": 2}, merges=[("a", " ")]))
    assert merges(spaced) == [["a", " "]]
    again = Tokenizer.from_str(tokenizer_mod._serialized(spaced))
    assert again.encode("a ", add_special_tokens=False).ids == [2]


def test_writing_an_entry_removes_older_formats_of_the_same_file(byte_tekken_file, tmp_path):
    """Each format bump left a 7 MB entry behind that nothing reads any more."""
    import hashlib

    digest = hashlib.sha256(byte_tekken_file.read_bytes()).hexdigest()
    folder = tmp_path / "tokenizers"
    folder.mkdir()
    older = [folder / f"tekken-{digest}-f{n}.json" for n in range(1, tokenizer_mod.CACHE_FORMAT)]
    newer = folder / f"tekken-{digest}-f{tokenizer_mod.CACHE_FORMAT + 1}.json"  # a later release's
    other = folder / f"tekken-{'0' * 64}-f1.json"  # another tekken.json's
    for path in [*older, newer, other]:
        path.write_text("{}")
    TekkenTokenizer.from_file(byte_tekken_file, cache_dir=tmp_path)
    current = f"tekken-{digest}-f{tokenizer_mod.CACHE_FORMAT}.json"
    assert sorted(p.name for p in folder.iterdir()) == sorted([current, newer.name, other.name])


def test_entries_of_other_files_beyond_the_limit_go_least_recently_used_first(
    tmp_path, monkeypatch
):
    """Each distinct tekken.json added a 6.6 MB entry for good."""
    import hashlib

    monkeypatch.setattr(tokenizer_mod, "MAX_CACHED_TOKENIZERS", 3)
    cache, folder = tmp_path / "cache", tmp_path / "cache" / "tokenizers"
    files = {}
    for name in "abcd":
        path = write_tekken(
            tmp_path / name / "tekken.json", build_tekken({name: 3}, vocab_source=None)
        )
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        files[name] = (path, f"tekken-{digest}-f{tokenizer_mod.CACHE_FORMAT}.json")
    for name in "abc":
        TekkenTokenizer.from_file(files[name][0], cache_dir=cache)
    (folder / "notes.txt").write_text("not an entry")
    now = time.time()
    for age, name in zip((30, 20, 10), "abc"):
        os.utime(folder / files[name][1], (now - age, now - age))
    TekkenTokenizer.from_file(files["a"][0], cache_dir=cache)  # read: now the most recent
    TekkenTokenizer.from_file(files["d"][0], cache_dir=cache)
    kept = sorted(p.name for p in folder.iterdir())
    assert kept == sorted([files[n][1] for n in "acd"] + ["notes.txt"])

    # A format change: d's entry of the older format is replaced, not counted beside it.
    older_d = folder / files["d"][1].replace(f"-f{tokenizer_mod.CACHE_FORMAT}", "-f1")
    (folder / files["d"][1]).rename(older_d)
    TekkenTokenizer.from_file(files["d"][0], cache_dir=cache)
    kept = sorted(p.name for p in folder.iterdir())
    assert kept == sorted([files[n][1] for n in "acd"] + ["notes.txt"])


def test_tokenizers_of_one_file_share_one_build_while_one_lives(
    byte_tekken_file, tmp_path, monkeypatch
):
    """A model loaded again, or another precision of it, in the same process: the real
    vocabulary's cache entry takes 0.3 to 0.9 s to read back, the build in use none."""
    import gc
    import shutil

    cache = tmp_path / "cache"
    first = TekkenTokenizer.from_file(byte_tekken_file, cache_dir=cache)
    elsewhere = tmp_path / "other-model" / "tekken.json"  # the same content, another folder
    elsewhere.parent.mkdir()
    shutil.copyfile(byte_tekken_file, elsewhere)
    reads = []
    read_cache, build = tokenizer_mod._read_cache, tokenizer_mod._build
    monkeypatch.setattr(
        tokenizer_mod, "_read_cache", lambda *args: reads.append(args) or read_cache(*args)
    )
    _forbid_build(monkeypatch)
    second = TekkenTokenizer.from_file(elsewhere, cache_dir=cache)
    assert second.backend is first.backend and reads == []
    assert (first.path, second.path) == (byte_tekken_file, elsewhere)
    assert second.encode(CORPUS["mixed_scripts"]) == first.encode(CORPUS["mixed_scripts"])
    second.audio["changed"] = True  # each instance's attributes are its own
    assert "changed" not in first.audio

    # Once none lives, the next load reads the cache entry again.
    del first, second
    gc.collect()
    third = TekkenTokenizer.from_file(byte_tekken_file, cache_dir=cache)
    assert len(reads) == 1 and third.encode("ok") == [1111, 1107]

    # Another cache folder is not one whose entry this process has seen: it gets its own.
    monkeypatch.setattr(tokenizer_mod, "_build", build)
    other = TekkenTokenizer.from_file(byte_tekken_file, cache_dir=tmp_path / "other-cache")
    assert other.backend is not third.backend
    assert len(_cache_files(tmp_path / "other-cache")) == 1


def test_unwritable_cache_dir_still_loads(byte_tekken_file, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder would go")
    model_dir = byte_tekken_file.parent
    before = sorted(p.name for p in model_dir.iterdir())
    ours = TekkenTokenizer.from_file(byte_tekken_file, cache_dir=blocker / "cache")
    assert ours.encode("ok") == [1111, 1107]
    assert sorted(p.name for p in model_dir.iterdir()) == before  # nothing next to the model


def test_read_only_cache_dir_still_loads(byte_tekken_file, tmp_path):
    ro = tmp_path / "ro"
    (ro / "tokenizers").mkdir(parents=True)
    (ro / "tokenizers").chmod(0o500)
    try:
        ours = TekkenTokenizer.from_file(byte_tekken_file, cache_dir=ro)
        assert ours.encode("ok") == [1111, 1107]
    finally:
        (ro / "tokenizers").chmod(0o700)


def test_changed_file_never_reuses_a_stale_entry(tmp_path):
    path = tmp_path / "model" / "tekken.json"
    cache = tmp_path / "cache"
    write_tekken(path, build_tekken({"a": 3}, vocab_source=None))
    first = TekkenTokenizer.from_file(path, cache_dir=cache)
    assert first.encode("ab") == [1097, 1098]

    # Same path, same size class, different content: a merge "ab" and a different voice table.
    data = build_tekken({"a": 5}, vocab_source=None)
    data["vocab"].append({"rank": 256, "token_bytes": "YWI=", "token_str": "ab"})
    data["config"]["default_vocab_size"] += 1
    data["config"]["num_vocab_tokens"] += 1
    write_tekken(path, data)
    second = TekkenTokenizer.from_file(path, cache_dir=cache)
    assert second.encode("ab") == [1256]
    assert second.voice_num_audio_tokens == {"a": 5}
    assert len(_cache_files(cache)) == 2


def test_temp_files_of_killed_cache_writers_are_removed(byte_tekken_file, tmp_path):
    """A process killed while writing the ~7 MB cache entry left its temp file for good."""
    from voxtral_mlx.fileio import TEMP_KIND

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / "tokenizers"
    folder.mkdir()
    orphan = folder / f".tekken-{'0' * 16}.json.{TEMP_KIND}-{dead.pid}-0123abcd"
    mine = folder / f".tekken-{'1' * 16}.json.{TEMP_KIND}-{os.getpid()}-89abcdef"
    theirs = folder / f".notes.txt.{TEMP_KIND}-{dead.pid}-abcdef12"  # not the cache's
    for path in (orphan, mine, theirs):
        path.write_text("half a tokenizer")
    TekkenTokenizer.from_file(byte_tekken_file, cache_dir=tmp_path)
    assert not orphan.exists() and mine.exists()  # a running writer's stays
    (entry,) = _cache_files(tmp_path)
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted([entry.name, mine.name, theirs.name])


def test_corrupt_cache_entry_is_rebuilt(byte_tekken_file, tmp_path):
    TekkenTokenizer.from_file(byte_tekken_file, cache_dir=tmp_path)
    (entry,) = _cache_files(tmp_path)
    entry.write_text('{"sha256": "x"}\nnot a tokenizer')
    ours = TekkenTokenizer.from_file(byte_tekken_file, cache_dir=tmp_path)
    assert ours.encode("ok") == [1111, 1107]
    assert entry.read_text().startswith("{")
    assert "not a tokenizer" not in entry.read_text()


def test_default_cache_dir_resolution(monkeypatch, tmp_path, byte_tekken_file):
    monkeypatch.setenv("VOXTRAL_MLX_CACHE", str(tmp_path / "vc"))
    assert default_cache_dir() == tmp_path / "vc"
    TekkenTokenizer.from_file(byte_tekken_file)
    assert len(_cache_files(tmp_path / "vc")) == 1

    monkeypatch.delenv("VOXTRAL_MLX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "voxtral_mlx"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "voxtral_mlx"


# ---------------------------------------------------------------------- errors


def _write_json(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


def _byte_tekken(**changes):
    data = build_tekken({"v": 1}, vocab_source=None)
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            data[section][field] = value
        else:
            data[section] = value
    return data


def _load_error(path: Path, tmp_path: Path) -> str:
    with pytest.raises(TokenizerError) as info:
        TekkenTokenizer.from_file(path, cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert "\n" not in message
    return message


def _data_error(data: dict, tmp_path: Path, name: str = "tekken.json") -> str:
    """:func:`_load_error` of ``data`` written as ``tmp_path / name``."""
    return _load_error(_write_json(tmp_path / name, data), tmp_path)


def test_error_missing_file(tmp_path):
    message = _load_error(tmp_path / "nope" / "tekken.json", tmp_path)
    assert "not found" in message and "tekken.json" in message


def test_error_directory(tmp_path):
    assert "directory" in _load_error(tmp_path, tmp_path)


def test_error_invalid_json(tmp_path):
    path = tmp_path / "tekken.json"
    path.write_text('{"config": {', encoding="utf-8")
    assert "not valid JSON" in _load_error(path, tmp_path)
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert "not valid JSON" in _load_error(path, tmp_path)


@pytest.mark.parametrize(
    "content",
    ["[" * 100_000 + "]" * 100_000, '{"config": {"default_vocab_size": ' + "9" * 5000 + "}}"],
    ids=["nested-100000-deep", "5000-digit-number"],
)
def test_error_pathological_json(tmp_path, content):
    """json raises RecursionError / ValueError (not JSONDecodeError) for these."""
    path = tmp_path / "tekken.json"
    path.write_text(content, encoding="utf-8")
    message = _load_error(path, tmp_path)
    assert str(path) in message and "tekken.json" in message


def test_error_legacy_bare_list(tmp_path):
    bare = build_tekken({}, vocab_source=None)["vocab"]
    path = _write_json(tmp_path / "tekken.json", bare)
    assert "legacy bare-list" in _load_error(path, tmp_path)


def test_error_not_an_object(tmp_path):
    path = _write_json(tmp_path / "tekken.json", 42)
    assert "unsupported layout" in _load_error(path, tmp_path)


@pytest.mark.parametrize("key", ["config", "vocab"])
def test_error_missing_section(tmp_path, key):
    data = _byte_tekken()
    del data[key]
    path = _write_json(tmp_path / "tekken.json", data)
    assert f"missing the '{key}' section" in _load_error(path, tmp_path)


def test_error_vocab_too_short(tmp_path):
    data = _byte_tekken(config__default_vocab_size=1300)
    message = _data_error(data, tmp_path)
    assert "256 entries" in message and "300" in message


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"config__pattern": None}, "config.pattern"),
        ({"config__pattern": "(unclosed"}, "regex"),
        ({"config__default_num_special_tokens": "1000"}, "default_num_special_tokens"),
        ({"config__default_vocab_size": 1100}, "at least the 256 byte tokens"),
        ({"special_tokens": [{"rank": i, "token_str": "<s>"} for i in (0, 1)]}, "more than once"),
        ({"special_tokens": [{"rank": 5, "token_str": "<s>"}]}, "rank 5"),
        ({"audio__voice_num_audio_tokens": {"v": "many"}}, "voice_num_audio_tokens"),
    ],
)
def test_error_malformed_fields(tmp_path, changes, needle):
    path = _write_json(tmp_path / "tekken.json", _byte_tekken(**changes))
    message = _load_error(path, tmp_path)
    assert needle in message
    # every one names the fix (the byte-token one did not: its ";" passed for a fix)
    assert message.endswith(
        ("restore tekken.json from the model's download", "re-download tekken.json")
    )


def test_error_bad_vocab_entries(tmp_path):
    data = _byte_tekken()
    data["vocab"][3]["rank"] = 7
    assert "vocab[3] has rank 7" in _data_error(data, tmp_path, "a.json")
    data = _byte_tekken()
    data["vocab"][65]["token_bytes"] = "Qg=="  # b"B" where b"A" belongs
    assert "single byte 65" in _data_error(data, tmp_path, "b.json")
    data = _byte_tekken()
    data["vocab"].append({"rank": 256, "token_bytes": "QQ==", "token_str": "A"})
    data["config"]["default_vocab_size"] += 1
    assert "repeats" in _data_error(data, tmp_path, "c.json")
    for b64, words in [("@@@", "token_bytes '@@@' that are not base64"), ("", "empty")]:
        data = _byte_tekken()
        data["vocab"].append({"rank": 256, "token_bytes": b64, "token_str": "?"})
        data["config"]["default_vocab_size"] += 1
        message = _data_error(data, tmp_path, "d.json")
        assert f"vocab[256] has {words}" in message and "re-download" in message


def test_a_tekken_json_too_big_to_build_quickly_is_refused(tmp_path):
    # A token of megabytes (building merges costs its length squared: hours) or a billion
    # special token names would hang or exhaust memory: refused at once, in one line.
    data = _byte_tekken()
    token = base64.b64encode(b"ab" * 600).decode()
    data["vocab"].append({"rank": 256, "token_bytes": token, "token_str": "?"})
    data["config"]["default_vocab_size"] += 1
    message = _data_error(data, tmp_path, "a.json")
    assert "vocab[256] is 1200 bytes long" in message and "re-download" in message
    data = _byte_tekken(config__default_num_special_tokens=10**9)
    data["config"]["default_vocab_size"] += 10**9
    message = _data_error(data, tmp_path, "b.json")
    assert "default_num_special_tokens is 1000000000" in message


def test_legacy_file_without_special_tokens_gets_mistral_common_defaults(tmp_path):
    data = _byte_tekken()
    del data["special_tokens"]
    data["config"]["version"] = "v3"
    path = _write_json(tmp_path / "tekken.json", data)
    ours = TekkenTokenizer.from_file(path, cache_dir=tmp_path / "cache")
    ref = Tekkenizer.from_file(path)
    for name in ("<unk>", "<s>", "</s>", "[INST]", "<pad>", "[TOOL_CONTENT]", "<SPECIAL_20>"):
        assert ours.special_id(name) == ref.get_special_token(name)
    with pytest.raises(TokenizerError, match=r"\[AUDIO\]"):
        ours.special_id("[AUDIO]")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_tekken_json_that_is_no_regular_file_or_too_big_is_one_line(tmp_path):
    """A FIFO hung the loader and /dev/zero was read until memory ran out."""
    fifo = tmp_path / "fifo" / "tekken.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    assert "not a regular file (a pipe or a device?)" in _load_error(fifo, tmp_path)
    zero = tmp_path / "zero" / "tekken.json"
    zero.parent.mkdir()
    zero.symlink_to("/dev/zero")
    assert "not a regular file" in _load_error(zero, tmp_path)
    huge = tmp_path / "huge" / "tekken.json"
    huge.parent.mkdir()
    with huge.open("wb") as f:
        f.truncate(tokenizer_mod.MAX_TEKKEN_BYTES + 1)  # sparse: no disk used
    message = _load_error(huge, tmp_path)
    assert "larger than 256 MiB" in message and "restore it from the model's download" in message


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_cache_entry_that_is_no_regular_file_is_rebuilt(tmp_path):
    path = _write_json(tmp_path / "tekken.json", _byte_tekken())
    cache = tmp_path / "cache"
    first = TekkenTokenizer.from_file(path, cache_dir=cache)
    (entry,) = (cache / "tokenizers").glob("tekken-*.json")
    entry.unlink()
    os.mkfifo(entry)  # hung every later load
    _unshared()
    again = TekkenTokenizer.from_file(path, cache_dir=cache)
    assert again.encode("Hello there") == first.encode("Hello there")
    assert entry.is_file()  # replaced by a good entry


def test_a_pattern_that_backtracks_without_end_fails_in_one_line(tmp_path):
    """A Rust panic (not even an Exception) came out of encode() as pyo3's PanicException."""
    data = _byte_tekken()
    data["config"]["pattern"] = "(a+)+$"
    tok = TekkenTokenizer.from_file(_write_json(tmp_path / "tekken.json", data), tmp_path / "c")
    with pytest.raises(TokenizerError) as info:
        tok.encode("a" * 40 + "!")
    message = str(info.value)
    assert "\n" not in message and "the tokenizer failed on this text" in message
    assert "restore tekken.json from the model's download" in message


def test_a_run_too_long_for_tekkens_own_pattern_is_named(built_tok):
    """Tekken's pattern backtracks past Oniguruma's bound on ~10 M spaces (mistral-common
    refuses 1 M): the file is intact, and the message said to restore it."""
    with pytest.raises(TokenizerError) as info:
        built_tok.encode(" " * 10_200_000)
    message = str(info.value)
    assert "\n" not in message and "holds a run too long to tokenize" in message
    assert "10,200,000 characters" in message and "restore" not in message


@pytest.mark.parametrize(
    "damage",
    [
        lambda t: t["special_tokens"][5].update(rank="x" * 100_000),
        lambda t: t["special_tokens"][5].update(token_str="y" * 100_000, rank=9),
        lambda t: [t["special_tokens"][i].update(token_str="d" * 100_000) for i in (5, 6)],
        lambda t: t["vocab"][100].update(rank="z" * 100_000),
    ],
    ids=["rank", "token_str", "duplicate", "vocab-rank"],
)
def test_a_damaged_tekken_value_is_shown_cut_short(byte_tekken_file, tmp_path, damage):
    """A 1 MB value in tekken.json made a 1 MB error line."""
    data = json.loads(byte_tekken_file.read_text())
    damage(data)
    path = tmp_path / "tekken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TokenizerError) as exc:
        TekkenTokenizer.from_file(path, cache_dir=tmp_path / "cache")
    assert len(str(exc.value)) < 400 and "\n" not in str(exc.value)


def test_a_voice_row_count_past_any_voice_is_a_damaged_tekken(byte_tekken_file, tmp_path):
    """casual_male given 10**9 rows blamed the intact voice file ("re-download it")."""
    data = json.loads(byte_tekken_file.read_text())
    data["audio"]["voice_num_audio_tokens"]["ar_male"] = 10**9
    path = tmp_path / "tekken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TokenizerError) as exc:
        TekkenTokenizer.from_file(path, cache_dir=tmp_path / "cache")
    message = str(exc.value)
    assert message.startswith(str(path)) and "ar_male 1,000,000,000 rows" in message
    assert "re-download tekken.json" in message
