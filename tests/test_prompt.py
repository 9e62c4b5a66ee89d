"""speech_prompt_ids against mistral-common's encode_speech_request, for every preset voice
and for adversarial text (strings like control tokens, control characters, lone surrogates,
very long words, the token limit), both as built and as the engine runs it."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest

import voxtral_mlx
from voxtral_mlx.errors import InputError, TokenizerError
from voxtral_mlx.segment import is_blank
from voxtral_mlx.synthetic.tekken import build_tekken, mistral_common_tekken_path, write_tekken
from voxtral_mlx.tokenizer import TekkenTokenizer, speech_prompt_ids
from voxtral_mlx.tts import MAX_TEXT_TOKENS

MistralTokenizer = pytest.importorskip("mistral_common.tokens.tokenizers.mistral").MistralTokenizer
SpeechRequest = pytest.importorskip("mistral_common.protocol.speech.request").SpeechRequest
Tekkenizer = pytest.importorskip("mistral_common.tokens.tokenizers.tekken").Tekkenizer

# The 20 preset voices of Voxtral-4B-TTS-2603 and their [AUDIO] counts (tekken.json).
VOICES = json.loads((Path(__file__).with_name("data") / "reference" / "voices.json").read_text())[
    "voice_num_audio_tokens"
]

TEXTS = [
    "Hello.",
    "Paris is the capital of France, isn't it?",
    "Bonjour, je m'appelle Marie et j'habite à Montréal.",
    "Guten Tag! Wie geht's?",
    "नमस्ते, आप कैसे हैं?",
    "مرحبا بكم في برنامجنا",
    "  leading and trailing spaces  ",
    "Line one.\nLine two.\r\n",
    "Raw [AUDIO] and <s> stay text.",
    "",
]


@pytest.fixture(scope="session")
def tekken_file(tmp_path_factory) -> Path:
    source = mistral_common_tekken_path()
    assert source is not None, "mistral-common's data/tekken_240911.json not found"
    data = build_tekken(VOICES, vocab_source=source)
    return write_tekken(tmp_path_factory.mktemp("prompt-tekken") / "tekken.json", data)


@pytest.fixture(scope="session")
def tok(tekken_file, tmp_path_factory) -> TekkenTokenizer:
    return TekkenTokenizer.from_file(tekken_file, cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def ref(tekken_file):
    return MistralTokenizer.from_file(str(tekken_file)).instruct_tokenizer


def ref_prompt(ref, text: str, voice: str) -> list[int]:
    return ref.encode_speech_request(SpeechRequest(input=text, voice=voice)).tokens


def test_hello_ar_male_exact_ids(tok):
    ids = speech_prompt_ids(tok, "Hello.", tok.voice_num_audio_tokens["ar_male"])
    assert ids == [1, 25] + [24] * 67 + [36, 22177, 1046, 35, 25]
    assert len(ids) == 74


def test_special_ids_of_the_tts_layout(tok):
    names = ["<s>", "[BEGIN_AUDIO]", "[AUDIO]", "[NEXT_AUDIO_TEXT]", "[REPEAT_AUDIO_TEXT]"]
    assert [tok.special_id(n) for n in names] == [1, 25, 24, 36, 35]


@pytest.mark.parametrize("voice", list(VOICES))
def test_matches_mistral_common_for_every_voice(tok, ref, voice):
    assert tok.voice_num_audio_tokens[voice] == VOICES[voice]
    for text in TEXTS:
        ours = speech_prompt_ids(tok, text, tok.voice_num_audio_tokens[voice])
        assert ours == ref_prompt(ref, text, voice), (voice, text)


def test_layout(tok, tmp_path):
    """Voices of 3 and of 0 rows, against mistral-common on a tekken.json that has them."""
    voices = {"three": 3, "none": 0}
    source = mistral_common_tekken_path()
    path = write_tekken(tmp_path / "tekken.json", build_tekken(voices, vocab_source=source))
    ref = MistralTokenizer.from_file(str(path)).instruct_tokenizer
    text = "Bonjour."
    body = Tekkenizer.from_file(path).encode(text, bos=False, eos=False)
    assert len(body) > 1
    ids = speech_prompt_ids(tok, text, 3)
    assert ids == ref_prompt(ref, text, "three")
    assert ids[:6] == [1, 25, 24, 24, 24, 36]
    assert ids[6:-2] == body
    assert ids[-2:] == [35, 25]
    none = speech_prompt_ids(tok, text, 0)
    assert none == ref_prompt(ref, text, "none") == [1, 25, 36, *body, 35, 25]


def test_byte_vocab_prompt_matches_mistral_common(tmp_path):
    path = write_tekken(tmp_path / "tekken.json", build_tekken({"x": 4}, vocab_source=None))
    ours = TekkenTokenizer.from_file(path, cache_dir=tmp_path / "cache")
    ref = MistralTokenizer.from_file(str(path)).instruct_tokenizer
    for text in TEXTS:
        assert speech_prompt_ids(ours, text, 4) == ref_prompt(ref, text, "x")


def test_bad_voice_count_is_rejected(tok):
    with pytest.raises(InputError, match=">= 0"):
        speech_prompt_ids(tok, "Hi.", -1)
    with pytest.raises(InputError, match="int"):
        speech_prompt_ids(tok, "Hi.", 2.0)


def test_missing_special_token_is_named(tmp_path):
    data = build_tekken({"x": 1}, vocab_source=None)
    data["special_tokens"][36]["token_str"] = "<SPECIAL_36>"
    path = write_tekken(tmp_path / "tekken.json", data)
    ours = TekkenTokenizer.from_file(path, cache_dir=tmp_path / "cache")
    with pytest.raises(TokenizerError, match=r"\[NEXT_AUDIO_TEXT\]"):
        speech_prompt_ids(ours, "Hi.", 1)


def test_random_checkpoints_carry_the_real_voices():
    from voxtral_mlx.synthetic.checkpoint import REAL_VOICES

    assert REAL_VOICES == VOICES


# ---------------------------------------------------------------------- adversarial text

ADVERSARIAL = {
    "bos": "<s>",
    "eos": "</s>",
    "inst": "[INST]",
    "audio": "[AUDIO]",
    "begin_audio": "[BEGIN_AUDIO]",
    "unk": "<unk>",
    "next_audio_text": "[NEXT_AUDIO_TEXT]",
    "special_12": "<SPECIAL_12>",
    "glued_specials": "<s>[INST]hi[/INST]</s>[AUDIO][REPEAT_AUDIO_TEXT][BEGIN_AUDIO]",
    "leading": "   hi",
    "trailing": "hi   ",
    "multiple": "a     b  c",
    "tabs": "\ta\t\tb\t",
    "crlf": "a\r\nb\r\n\r\n",
    "form_feed": "a\x0cb\x0c",
    "nul": "a\x00b\x00",
    "c0_c1_controls": "".join(map(chr, range(32))) + "\x7f\x85\u2028\u2029",
    "vertical_tab": "\x0b\x0b x",
    "lone_high": "a\ud800b",
    "lone_low": "\udc00",
    "lone_at_end": "abc\ud83d",
    "split_pair": "\ud83d\ude00 ok",
    "combining": "a\u0301\u0301\u0301 \u0301\u0302 x",
    "zwj": "👨‍👩‍👧‍👦🏳️‍🌈👩🏽‍💻",
    "rtl": "\u202eabc\u202c مرحبا עברית \u200f",
    "digit_run": "1" * 3000,
    "digit_groups": "12345678901234567890 " * 50,
    "word_5000": "a" * 5000,
    "word_5000_accented": "é" * 5000,
    "word_5000_mixed": "abcXYZ" * 834,
    "bom": "\ufeffhi",
    "noncharacters": "\uffff\ufffe\U0010ffff",
    "private_use": "\ue000\U000f0000",
    "nbsp": "\u00a0\u00a0x",
    "newline_runs": "\n\n \n\t\n x \n",
    "zero_width_only": "\u200b",
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_prompt_matches_mistral_common(tok, ref, name):
    text = ADVERSARIAL[name]
    for voice in ("ar_male", "casual_female"):
        ours = speech_prompt_ids(tok, text, tok.voice_num_audio_tokens[voice])
        assert ours == ref_prompt(ref, text, voice)


def test_random_code_points_with_surrogates_match_mistral_common(tok, ref):
    rng = random.Random(7)
    pools = [
        lambda: chr(rng.randrange(0x110000)),
        lambda: chr(rng.randrange(0xD800, 0xE000)),
        lambda: rng.choice(" \t\r\n\x0b\x0c\x00\x85\u2028\u00a0\u200d\u0301\ufe0f"),
        lambda: chr(rng.randrange(0x80)),
        lambda: rng.choice(["<s>", "</s>", "[INST]", "[AUDIO]", "<SPECIAL_12>", "9999"]),
    ]
    for _ in range(500):
        text = "".join(rng.choice(pools)() for _ in range(rng.randrange(40)))
        assert speech_prompt_ids(tok, text, 67) == ref_prompt(ref, text, "ar_male"), repr(text)


def test_sampled_code_points_in_context_match_tiktoken(tok, tekken_file):
    """The pre-tokenizer regex classifies every character like tiktoken's (HF's Onig vs
    fancy-regex Unicode tables)."""
    rng = random.Random(11)
    chars = [chr(c) for c in rng.sample(range(0x110000), 6000) if not 0xD800 <= c < 0xE000]
    tiktoken = Tekkenizer.from_file(tekken_file)._model
    for wrap in (lambda c: c, lambda c: "a" + c + "b", lambda c: " " + c + " x", lambda c: "1" + c):
        texts = [wrap(c) for c in chars]
        ours = [e.ids for e in tok.backend.encode_batch(texts, add_special_tokens=False)]
        theirs = [[i + 1000 for i in ids] for ids in tiktoken.encode_ordinary_batch(texts)]
        assert ours == theirs


@pytest.fixture(scope="module")
def tts_end(tiny_checkpoint):
    model = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=None)
    yield model
    model.close()


def fed_prompt(tts, text: str, voice: str) -> list[int]:
    """The ids the engine really runs for a request: voice prefix, then the job's text."""
    job = tts.job(text, voice, seed=0, max_frames=0)
    e = tts.engine
    s = e._voice_start
    prefix = e._prefix_ids[:s] + [e._prefix_ids[s]] * tts._rows(job.voice).shape[0]
    return prefix + e._prefix_ids[s + 1 :] + list(job.text_ids)


def test_engine_runs_the_reference_prompt(tts_end, tiny_checkpoint):
    ref = MistralTokenizer.from_file(str(tiny_checkpoint / "tekken.json")).instruct_tokenizer
    assert tts_end.tokenizer.vocab_size == 131072  # the real BPE vocabulary, not bytes
    for text in ADVERSARIAL.values():
        for voice in ("ar_male", "neutral_female"):
            expected = ref_prompt(ref, text, voice)
            assert tts_end.prompt_ids(text, voice) == expected
            if is_blank(text):  # nothing visible: refused below
                continue
            assert fed_prompt(tts_end, text, voice) == expected


def test_the_blank_adversarial_texts_are_the_invisible_ones():
    blank = {name for name, text in ADVERSARIAL.items() if is_blank(text)}
    assert blank == {"c0_c1_controls", "zero_width_only"}


@pytest.mark.parametrize(
    "text",
    [
        " ",
        "\t\r\n",
        "\x0c\x1c\x85\u2028",
        ADVERSARIAL["zero_width_only"],
        "\x00\u200e\ufeff",
        "\u0301\u0301\u0301",  # combining accents on nothing
        "\ufe0f\ufe0f",  # variation selectors alone
    ],
)
def test_whitespace_only_text_is_refused_though_the_reference_encodes_it(tts_end, text):
    with pytest.raises(InputError, match="empty"):
        tts_end.job(text, "ar_male")


def test_token_limit_boundary(tts_end, tiny_checkpoint):
    ref = MistralTokenizer.from_file(str(tiny_checkpoint / "tekken.json")).instruct_tokenizer
    at_limit = "1" * MAX_TEXT_TOKENS
    assert fed_prompt(tts_end, at_limit, "ar_male") == ref_prompt(ref, at_limit, "ar_male")
    for over in ("1" * (MAX_TEXT_TOKENS + 1), "x " + "9" * (MAX_TEXT_TOKENS - 1)):
        with pytest.raises(InputError, match=f"{MAX_TEXT_TOKENS + 1} tokens"):
            tts_end.job(over, "ar_male")
    # Each lone surrogate becomes U+FFFD; pairs of those are one token.
    surrogates = "\ud800" * (MAX_TEXT_TOKENS + 1)
    assert fed_prompt(tts_end, surrogates, "ar_male") == ref_prompt(ref, surrogates, "ar_male")


def test_non_tts_tekken_is_refused_like_mistral_common(tmp_path, tiny_checkpoint):
    """mistral-common's own tekken_240911.json (v3, no audio tokens): same text ids, and
    both sides refuse a speech prompt."""
    source = mistral_common_tekken_path()
    ours = TekkenTokenizer.from_file(source, cache_dir=tmp_path / "cache")
    theirs = Tekkenizer.from_file(source)
    for text in ADVERSARIAL.values():
        assert ours.encode(text) == theirs.encode(text, bos=False, eos=False)
    with pytest.raises(TokenizerError, match=r"\[BEGIN_AUDIO\]"):
        speech_prompt_ids(ours, "Hi.", 2)
    with pytest.raises(Exception, match="not available"):
        MistralTokenizer.from_file(str(source)).instruct_tokenizer.encode_speech_request(
            SpeechRequest(input="Hi.", voice="x")
        )
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    shutil.copy(source, model / "tekken.json")
    with pytest.raises(TokenizerError, match=r"\[AUDIO\]"):
        voxtral_mlx.load(model, prefix_cache_dir=None)


@pytest.mark.parametrize("token", ["[NEXT_AUDIO_TEXT]", "[REPEAT_AUDIO_TEXT]"])
def test_a_tekken_without_a_prompt_token_is_refused_by_load_and_convert(
    tmp_path, tiny_checkpoint, token
):
    """Without [AUDIO] or [BEGIN_AUDIO] both refused the model; without these two, convert
    wrote a model that every request then failed on."""
    from voxtral_mlx.convert import convert_model

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    data = json.loads((model / "tekken.json").read_text())
    for entry in data["special_tokens"]:
        if entry["token_str"] == token:
            entry["token_str"] = f"<SPECIAL_{entry['rank']}>"
    (model / "tekken.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match=re.escape(token)):
        voxtral_mlx.load(model, prefix_cache_dir=None)
    with pytest.raises(TokenizerError, match=re.escape(token)):
        convert_model(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
