"""Parity at the edges: prompts for adversarial text against mistral-common's
encode_speech_request, and streaming against one-shot synthesis, bit for bit."""

from __future__ import annotations

import json
import random
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

import voxtral_mlx
from voxtral_mlx import generate
from voxtral_mlx.errors import InputError, TokenizerError
from voxtral_mlx.synthetic.tekken import build_tekken, mistral_common_tekken_path, write_tekken
from voxtral_mlx.tokenizer import TekkenTokenizer, speech_prompt_ids
from voxtral_mlx.tts import MAX_TEXT_TOKENS

MistralTokenizer = pytest.importorskip("mistral_common.tokens.tokenizers.mistral").MistralTokenizer
Tekkenizer = pytest.importorskip("mistral_common.tokens.tokenizers.tekken").Tekkenizer
SpeechRequest = pytest.importorskip("mistral_common.protocol.speech.request").SpeechRequest

VOICES = json.loads((Path(__file__).with_name("data") / "reference" / "voices.json").read_text())[
    "voice_num_audio_tokens"
]

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


@pytest.fixture(scope="module")
def tekken_file(tmp_path_factory) -> Path:
    source = mistral_common_tekken_path()
    assert source is not None, "mistral-common's data/tekken_240911.json not found"
    data = build_tekken(VOICES, vocab_source=source)
    return write_tekken(tmp_path_factory.mktemp("edge-tekken") / "tekken.json", data)


@pytest.fixture(scope="module")
def tok(tekken_file, tmp_path_factory) -> TekkenTokenizer:
    return TekkenTokenizer.from_file(tekken_file, cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def ref(tekken_file):
    return MistralTokenizer.from_file(str(tekken_file)).instruct_tokenizer


def ref_prompt(ref, text: str, voice: str) -> list[int]:
    return ref.encode_speech_request(SpeechRequest(input=text, voice=voice)).tokens


# ---------------------------------------------------------------------- prompts


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
    prefix = e._prefix_ids[:s] + [e._prefix_ids[s]] * job.voice_rows.shape[0]
    return prefix + e._prefix_ids[s + 1 :] + list(job.text_ids)


def test_engine_runs_the_reference_prompt(tts_end, tiny_checkpoint):
    ref = MistralTokenizer.from_file(str(tiny_checkpoint / "tekken.json")).instruct_tokenizer
    assert tts_end.tokenizer.vocab_size == 131072  # the real BPE vocabulary, not bytes
    for text in ADVERSARIAL.values():
        for voice in ("ar_male", "neutral_female"):
            expected = ref_prompt(ref, text, voice)
            assert tts_end.prompt_ids(text, voice) == expected
            assert fed_prompt(tts_end, text, voice) == expected


@pytest.mark.parametrize("text", [" ", "\t\r\n", "\x0c\x1c\x85\u2028"])
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


# ---------------------------------------------------------------------- streaming


@pytest.fixture(scope="module")
def tts(tiny_checkpoint_noend):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None, max_batch=4)
    yield model
    model.close()


def joined(chunks) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([c.audio for c in chunks]), np.concatenate([c.codes for c in chunks])


def assert_same(chunks, speech) -> None:
    audio, codes = joined(chunks)
    assert audio.shape == speech.audio.shape
    assert np.array_equal(audio, speech.audio)
    assert np.array_equal(codes, speech.codes)


CFG = [0, 1, 1.2, 3]


@pytest.mark.parametrize("max_frames", [0, 1, 2, 25])
@pytest.mark.parametrize("chunk_frames", [1, 2, 3, 7, 64])
def test_stream_is_bit_identical_to_synthesize(tts, chunk_frames, max_frames):
    alpha = CFG[(chunk_frames + max_frames) % 4]
    seed = chunk_frames * 31 + max_frames
    kw = dict(seed=seed, max_frames=max_frames, cfg_alpha=alpha)
    one = tts.synthesize("Streaming test sentence.", "ar_male", **kw)
    assert len(one.codes) == max_frames
    chunks = list(
        tts.stream("Streaming test sentence.", "ar_male", chunk_frames=chunk_frames, **kw)
    )
    assert_same(chunks, one)


@pytest.mark.parametrize("max_batch", [1, 2, 4])
def test_split_stream_is_bit_identical_to_synthesize(tiny_checkpoint_noend, max_batch):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None, max_batch=max_batch)
    try:
        text = "First sentence here. Second one, a bit longer! Third? A fourth without a period"
        for chunk_frames, max_frames, alpha, seed in [(1, 3, 1.2, 0), (3, 7, 3, 11), (64, 2, 0, 4)]:
            kw = dict(seed=seed, max_frames=max_frames, cfg_alpha=alpha, split=True, max_chars=40)
            one = model.synthesize(text, "ar_male", **kw)
            chunks = list(model.stream(text, "ar_male", chunk_frames=chunk_frames, **kw))
            assert len({c.segment for c in chunks}) == 3
            assert_same(chunks, one)
    finally:
        model.close()


def test_unseeded_speech_reports_the_seed_that_reproduces_it(tts):
    text = "One. Two three. Four."
    for split in (False, True):
        kw = dict(max_frames=3, split=split, max_chars=8)
        first = tts.synthesize(text, "ar_male", **kw)
        again = tts.synthesize(text, "ar_male", seed=first.seed, **kw)
        assert np.array_equal(first.audio, again.audio)
        assert np.array_equal(first.codes, again.codes)


REQUESTS = [  # text, voice, seed, max_frames, cfg_alpha, chunk_frames
    ("Short one.", "ar_male", 3, 5, 1.2, 1),
    ("A somewhat longer sentence here.", "fr_female", 11, 25, 3, 2),
    ("Third.", "casual_female", 7, 2, 0, 3),
    ("Fourth request text!", "ar_male", 9, 70, 1, 64),
    ("Fifth, zero frames.", "de_male", 1, 0, 1.2, 7),
]


@pytest.fixture(scope="module")
def alone(tiny_checkpoint_noend):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None, max_batch=1)
    try:
        return [
            model.synthesize(t, v, seed=s, max_frames=m, cfg_alpha=a)
            for t, v, s, m, a, _ in REQUESTS
        ]
    finally:
        model.close()


@pytest.mark.parametrize("max_batch", [1, 2, 3, 4])
def test_concurrent_streams_equal_each_alone(tiny_checkpoint_noend, alone, max_batch, monkeypatch):
    sizes: set[int] = set()
    advance = generate.FrameBatch.advance

    def counting(self):
        sizes.add(len(self))
        return advance(self)

    monkeypatch.setattr(generate.FrameBatch, "advance", counting)
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None, max_batch=max_batch)
    try:
        order = [0, 1, 2, 3, 4] if max_batch % 2 else [4, 3, 1, 0, 2]
        streams = {}
        for i in order:
            t, v, s, m, a, c = REQUESTS[i]
            streams[i] = model.stream(t, v, seed=s, max_frames=m, cfg_alpha=a, chunk_frames=c)
        out: dict[int, list] = {}

        def consume(i: int) -> None:
            out[i] = list(streams[i])

        threads = [threading.Thread(target=consume, args=(i,)) for i in order]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for i in order:
            assert_same(out[i], alone[i])
    finally:
        model.close()
    assert max(sizes) == 1 if max_batch == 1 else max(sizes) > 1


def test_stream_is_exact_when_the_first_chunk_needs_several_frames(tmp_path):
    """A codec whose output conv reaches back more than one frame (kernel 17 > 8 steps)."""
    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint, make_params

    params = make_params("tiny")
    params["multimodal"]["audio_tokenizer_args"]["patch_proj_kernel_size"] = 17
    path = build_random_checkpoint(
        tmp_path / "k17", params, seed=5, dtype="float32", suppress_end=True, voices={"v": 3},
        vocab_source=None,
    )  # fmt: skip
    model = voxtral_mlx.load(path, prefix_cache_dir=None)
    try:
        assert model.config.codec.first_chunk_frames == 3
        for max_frames in (1, 2, 3, 5):
            one = model.synthesize("Hi there.", "v", seed=1, max_frames=max_frames)
            for chunk_frames in (1, 2, 7):
                chunks = model.stream(
                    "Hi there.", "v", seed=1, max_frames=max_frames, chunk_frames=chunk_frames
                )
                assert_same(list(chunks), one)
    finally:
        model.close()
