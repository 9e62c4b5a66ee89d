"""speech_prompt_ids against mistral-common's encode_speech_request, for every preset voice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from voxtral_mlx.errors import InputError, TokenizerError
from voxtral_mlx.synthetic.tekken import build_tekken, mistral_common_tekken_path, write_tekken
from voxtral_mlx.tokenizer import TekkenTokenizer, speech_prompt_ids

MistralTokenizer = pytest.importorskip("mistral_common.tokens.tokenizers.mistral").MistralTokenizer
SpeechRequest = pytest.importorskip("mistral_common.protocol.speech.request").SpeechRequest

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


def test_layout(tok):
    text = "Bonjour."
    ids = speech_prompt_ids(tok, text, 3)
    body = tok.encode(text)
    assert ids[:6] == [1, 25, 24, 24, 24, 36]
    assert ids[6:-2] == body
    assert ids[-2:] == [35, 25]
    assert speech_prompt_ids(tok, text, 0) == [1, 25, 36, *body, 35, 25]


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
