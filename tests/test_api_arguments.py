"""Arguments an app may pass wrongly or unusually to the less-used public functions: each
is either taken as meant or refused with a one-line error from voxtral_mlx.errors."""

from __future__ import annotations

import json
import threading
from decimal import Decimal
from fractions import Fraction

import mlx.core as mx
import numpy as np
import pytest
import torch
from mistral_common.protocol.speech.request import SpeechRequest
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

import voxtral_mlx
from tests.players import NullPlayer
from tests.spec_reference import SpecReference
from voxtral_mlx.convert import convert_model
from voxtral_mlx.errors import InputError, ModelNotFoundError, VoiceError, VoxtralError
from voxtral_mlx.segment import split_text
from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint
from voxtral_mlx.voices import convert_voice_files

VOICE = "neutral_male"


@pytest.fixture(scope="module")
def tts(tiny_checkpoint_noend):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    yield model
    model.close()


@pytest.mark.parametrize(
    "alpha", [np.float64(1.5), np.float32(1.5), Fraction(3, 2), Decimal("1.5")]
)
def test_cfg_alpha_of_any_real_type_is_taken_as_its_value(tts, alpha):
    """A numpy scalar passed the check, then failed the whole batch inside MLX."""
    want = tts.synthesize("Hi there.", VOICE, seed=1, max_frames=3, cfg_alpha=1.5).codes
    got = tts.synthesize("Hi there.", VOICE, seed=1, max_frames=3, cfg_alpha=alpha).codes
    assert np.array_equal(got, want)


@pytest.mark.parametrize(
    "alpha",
    [10**400, Fraction(10**400), float("nan"), "1.5", True, None, 1e308, -100.5, Decimal("sNaN")],
)
def test_cfg_alpha_that_is_no_finite_number_is_refused(tts, alpha):
    """1e308 is finite, but its guidance overflowed the ODE: the request then failed as if
    the weights were damaged."""
    with pytest.raises(InputError, match="cfg_alpha must be a finite number from -100 to 100"):
        tts.synthesize("Hi.", VOICE, max_frames=1, cfg_alpha=alpha)


@pytest.mark.parametrize("alpha", [-100, 100])
def test_cfg_alpha_at_the_limit_is_taken(tts, tiny_checkpoint_noend, alpha):
    """The limits are accepted and used as given: the codes are SPEC's (tests/spec_reference,
    float64 torch) at that alpha, not those of the default alpha or of a clamped one (with
    these noise rows, ±99.5 already give other codes than ±100)."""
    noise = np.random.default_rng(12).standard_normal((3, 36)).astype(np.float32)
    got = tts.synthesize("Hi.", VOICE, noise=noise, max_frames=3, cfg_alpha=alpha).codes
    rows = torch.load(tiny_checkpoint_noend / "voice_embedding" / f"{VOICE}.pt", weights_only=True)
    ids = MistralTokenizer.from_file(str(tiny_checkpoint_noend / "tekken.json"))
    ids = ids.instruct_tokenizer.encode_speech_request(SpeechRequest(input="Hi.", voice=VOICE))
    spec = SpecReference(tiny_checkpoint_noend)
    want = spec.generate(ids.tokens, rows, noise, 3, alpha=float(alpha)).numpy()
    assert want.shape == (3, 37)
    np.testing.assert_array_equal(got, want)
    default = tts.synthesize("Hi.", VOICE, noise=noise, max_frames=3).codes
    assert not np.array_equal(got, default)


@pytest.mark.parametrize("voice", [["ar_male"], {"ar_male"}, {"ar_male": 1}, 3, b"ar_male"])
def test_a_voice_is_one_name(tts, voice):
    with pytest.raises(VoiceError, match="a voice is one name"):
        tts.synthesize("Hi.", voice, max_frames=1)
    with pytest.raises(VoiceError, match="a voice is one name"):
        tts.prompt_ids("Hi.", voice)


def test_wrong_objects_for_warmup_and_submit(tts):
    with pytest.raises(InputError, match="voices must be a voice name or several, got bytes"):
        tts.warmup(b"ar_male")
    for job in (None, "Hi."):
        with pytest.raises(InputError, match=r"submit\(\) takes a Job made by tts\.job"):
            tts.submit(job)


def test_codes_and_noise_numpy_cannot_hold_as_given(tts):
    with pytest.raises(InputError, match="codes must be a rectangular array"):
        tts.decode([[2] * 37, [2] * 36])
    # The dtype given, not the one it was converted to; no "object []" for None.
    with pytest.raises(InputError, match=r"shape \[frames, 37\], got mlx.core.bfloat16 \[2, 37\]"):
        tts.decode(mx.full((2, 37), 2).astype(mx.bfloat16))
    with pytest.raises(InputError, match=r"integer array of shape .*, got NoneType$"):
        tts.decode(None)
    with pytest.raises(InputError, match="noise must be a rectangular array"):
        tts.synthesize("Hi.", VOICE, noise=[[0.0] * 36, [0.0] * 35])
    noise = mx.random.normal((3, 36), key=mx.random.key(0)).astype(mx.bfloat16)
    got = tts.synthesize("Hi.", VOICE, noise=noise).codes
    want = tts.synthesize("Hi.", VOICE, noise=np.array(noise.astype(mx.float32))).codes
    assert np.array_equal(got, want)


def test_split_options_are_checked_even_without_split_and_zero_frames_make_no_pauses(tts):
    text = "First sentence here. Second one follows. And a third."
    for split in (False, True):
        with pytest.raises(InputError, match="max_chars"):
            tts.synthesize(text, VOICE, seed=1, split=split, max_chars=0)
    speech = tts.synthesize(text, VOICE, seed=1, split=True, max_chars=24, max_frames=0)
    assert len(speech.audio) == 0 and len(speech.codes) == 0
    spoken = tts.synthesize(text, VOICE, seed=1, split=True, max_chars=24, max_frames=2)
    assert len(spoken.audio) > 6 * tts.samples_per_frame  # 3 segments and the pauses between
    # Without split there are no segments for it: refused, as pause= and lookahead= are.
    with pytest.raises(InputError, match="max_chars= applies to the segments of a split text"):
        tts.synthesize(text, VOICE, seed=1, max_chars=24, max_frames=2)


def test_unevaluated_mlx_array_from_another_thread(tts):
    """MLX evaluates an array only on the thread that built it: a one-line error, and the
    same array works once evaluated there."""
    noise = mx.random.normal((3, 36), key=mx.random.key(1))
    codes = mx.full((2, 37), 2, dtype=mx.int32) + 0
    errors = []

    def app_thread():
        for call in (lambda: tts.synthesize("Hi.", VOICE, noise=noise), lambda: tts.decode(codes)):
            with pytest.raises(InputError, match="built on another thread and not evaluated") as e:
                call()
            errors.append(str(e.value))

    thread = threading.Thread(target=app_thread)
    thread.start()
    thread.join()
    assert [e.split(" ")[0] for e in errors] == ["noise", "codes"]
    mx.eval(noise, codes)
    assert len(tts.synthesize("Hi.", VOICE, noise=noise).codes) > 0
    assert len(tts.decode(codes)) == 2 * tts.samples_per_frame


def test_say_checks_its_player_before_anything_runs(tts):
    for player in (object(), "default"):
        with pytest.raises(InputError, match="player must have feed"):
            tts.say("Hi.", VOICE, player=player, wait=False)
    assert tts.engine.stats()["waiting"] == 0 and not tts.engine.busy


def test_load_arguments(tiny_checkpoint_noend, tmp_path, monkeypatch):
    for path in (b"/some/dir", 5):
        with pytest.raises(ModelNotFoundError, match="directory path or a Hugging Face repo id"):
            voxtral_mlx.load(path)
    monkeypatch.chdir(tmp_path)
    for here in ("", ".", "./", ".//", "sub/.."):  # "./" wrote the files into the folder
        with pytest.raises(InputError, match="prefix_cache_dir is an empty path"):
            voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=here)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", ["int8", mx.float64, 16])
def test_an_unsupported_dtype_is_refused_before_the_model_is_fetched(dtype, monkeypatch):
    """Not after a download of 8 GB."""
    import voxtral_mlx.hub

    def no_fetch(*_):
        raise AssertionError("the model was looked for")

    monkeypatch.setattr(voxtral_mlx.hub, "resolve_model_dir", no_fetch)
    with pytest.raises(InputError, match=r"unsupported dtype .*: use bfloat16, float16 or float32"):
        voxtral_mlx.load("mistralai/Voxtral-4B-TTS-2603", dtype=dtype)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"q_bits": 4.0}, r"--q-bits \(q_bits=\) 4.0 is not supported"),
        ({"q_bits": np.array([4, 6])}, "is not supported"),
        (
            {"q_bits": 8, "q_group_size": 64.0},
            r"--q-group-size \(q_group_size=\) 64.0 is not supported",
        ),
        ({"chunk_bytes": 0}, "chunk_bytes must be a whole number >= 1"),
        ({"max_shard_bytes": 0}, "max_shard_bytes must be a whole number >= 1"),
        ({"progress": 5}, "progress must be a function"),
    ],
)
def test_convert_model_refuses_odd_numbers_at_once(tiny_checkpoint, tmp_path, kwargs, words):
    with pytest.raises(InputError, match=words):
        convert_model(tiny_checkpoint, tmp_path / "out", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_convert_model_takes_numpy_integers(tiny_checkpoint, tmp_path):
    out = convert_model(tiny_checkpoint, tmp_path / "out", q_bits=np.int64(4)).path
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    assert quantization["bits"] == 4 and type(quantization["bits"]) is int


def test_convert_voice_files_takes_one_path_or_a_list(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint / "voice_embedding"
    assert len(convert_voice_files(str(folder), tmp_path / "a")) == 20
    assert len(convert_voice_files(folder, tmp_path / "b")) == 20
    for sources, words in [([], "no voice sources given"), ([None], "a voice source is a path")]:
        with pytest.raises(VoiceError, match=words):
            convert_voice_files(sources, tmp_path / "c")
    with pytest.raises(VoiceError, match="out_dir must be a directory path"):
        convert_voice_files(folder, None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(VoiceError, match=r"holds no \.pt voice files: pass the model.s voice_emb"):
        convert_voice_files(tmp_path / "empty", tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "empty"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_chars": None},
        {"target_chars": "10"},
        {"target_chars": 2.5, "max_chars": 5.5},
        {"target_chars": True, "max_chars": True},
    ],
)
def test_split_text_sizes_are_whole_numbers(kwargs):
    with pytest.raises(InputError, match="must be a whole number of characters"):
        split_text("Hi there. Yes, indeed.", **kwargs)
    assert len(split_text("Hi there. Yes, indeed.", target_chars=np.int32(5), max_chars=10)) > 1


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"voices": {"../../escaped": 3}}, "cannot be a file name"),
        ({"voices": {"": 3}}, "cannot be a file name"),
        ({"voices": {}}, "voices must map voice names to row counts"),
        ({"voices": {"a": 0}}, "needs 1 to 4096 rows"),
        ({"voices": {"a": 10**12}}, "needs 1 to 4096 rows"),
        ({"params": "huge"}, "unknown size 'huge'"),
        ({"params": None}, "params must be a size name or a params.json dict"),
        ({"dtype": ["bfloat16"]}, "unsupported dtype"),
        ({"vocab_source": 5}, "vocab_source must be a tekken.json path"),
    ],
)
def test_build_random_checkpoint_checks_its_arguments(tmp_path, kwargs, words):
    with pytest.raises(VoxtralError, match=words):
        build_random_checkpoint(tmp_path / "m" / "out", **kwargs)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == []


def test_build_random_checkpoint_needs_a_path():
    for out in (None, b"/tmp/x", ""):
        with pytest.raises(InputError, match="out_dir must be a directory path"):
            build_random_checkpoint(out)


LONG = "x" * 300  # more than the 255 bytes a file name can have
DEEP = "/".join(["d" * 200] * 30)  # each name fits, the whole path (6 kB) does not


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (
            lambda d, t: voxtral_mlx.load("~nosuchuser_vx/model"),
            ModelNotFoundError,
            "names no user",
        ),
        (lambda d, t: voxtral_mlx.load(t / LONG), ModelNotFoundError, "too long (300 bytes"),
        (lambda d, t: voxtral_mlx.load(f"{t}/a\0b"), ModelNotFoundError, "NUL character"),
        (lambda d, t: convert_model(d, t / LONG), InputError, "too long (300 bytes"),
        (lambda d, t: convert_model(d, f"{t}/o\0ut"), InputError, "NUL character"),
        (lambda d, t: convert_model(d, "~nosuchuser_vx/o"), InputError, "names no user"),
        (lambda d, t: convert_voice_files(t / LONG, t / "v"), VoiceError, "too long"),
        (lambda d, t: convert_voice_files(d / "voice_embedding", f"{t}/\0"), VoiceError, "NUL"),
        (lambda d, t: voxtral_mlx.load(d, prefix_cache_dir="~nosuchuser_vx/p"), InputError, "user"),
        (lambda d, t: voxtral_mlx.load(t / DEEP), ModelNotFoundError, "the system takes paths"),
        (lambda d, t: convert_model(d, t / DEEP), InputError, "the system takes paths"),
        (lambda d, t: convert_voice_files(d / "voice_embedding", t / DEEP), VoiceError, "paths"),
        (lambda d, t: voxtral_mlx.load(d, prefix_cache_dir=t / DEEP), InputError, "paths"),
    ],
)
def test_paths_no_file_can_have_are_one_line_errors(tiny_checkpoint, tmp_path, call, error, words):
    """The OS said "File name too long", "embedded null byte" or "Could not determine home
    directory" as a raw OSError, ValueError or RuntimeError (a whole path too long: from
    deep inside whatever used it)."""
    with pytest.raises(error) as info:
        call(tiny_checkpoint, tmp_path)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("force", [False, True])
def test_a_folder_holding_only_the_finders_ds_store_counts_as_empty(tmp_path, force):
    """An empty folder opened in the Finder holds a .DS_Store: it was 'not empty' (and with
    --force 'holds files that are not a model'), so no model could be written into it."""
    out = tmp_path / "model"
    out.mkdir()
    (out / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    build_random_checkpoint(out, "tiny", force=force)
    assert (out / "params.json").is_file() and not (out / ".DS_Store").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_library_errors_are_one_line_whatever_a_path_holds(tmp_path):
    """Messages that quote a path or name raw spanned two lines (a newline in a folder
    name) or carried a terminal escape."""
    assert str(VoxtralError("a\nb\x1b[2J\tc")) == "a\\nb\\x1b[2J\\tc"
    assert str(VoxtralError("plain … text, 日本語")) == "plain … text, 日本語"
    folder = tmp_path / "two\nlines"
    with pytest.raises(ModelNotFoundError) as exc:
        voxtral_mlx.load(folder)
    assert "\n" not in str(exc.value) and "two\\nlines" in str(exc.value)
    folder.mkdir()
    (folder / "params.json").write_text("{not json")
    with pytest.raises(VoxtralError) as exc:
        voxtral_mlx.load(folder)
    assert "\n" not in str(exc.value) and "params.json" in str(exc.value)


def test_destructive_flags_take_only_booleans(tmp_path):
    """overwrite="no" overwrote and force="no" replaced an existing output."""
    with pytest.raises(InputError, match="overwrite must be True or False"):
        convert_voice_files(tmp_path / "none.pt", tmp_path / "out", overwrite="no")
    with pytest.raises(InputError, match="force must be True or False"):
        convert_model(tmp_path / "none", tmp_path / "out", force="no")
    assert not (tmp_path / "out").exists()


def test_a_text_far_too_long_is_refused_before_it_is_tokenized(tts, monkeypatch):
    """A run of ten million letters made the tokenizer's regex give up (a Rust panic
    printed on stderr, and an error blaming tekken.json); the text's length alone shows
    it cannot fit, so it never reaches the tokenizer."""
    seen: list[int] = []
    encode = tts.tokenizer.encode
    monkeypatch.setattr(tts.tokenizer, "encode", lambda t: seen.append(len(t)) or encode(t))
    huge = "A" * 12_000_000
    with pytest.raises(InputError, match=r"too long for one utterance \(at least \d+ tokens"):
        tts.synthesize(huge, VOICE)
    with pytest.raises(InputError, match=r"a segment of the text is too long .*lower max_chars"):
        tts.synthesize(huge, VOICE, split=True, max_chars=len(huge))
    assert seen == []
    fits = "A" * (8192 * tts.tokenizer.max_token_bytes // 2)  # long, but may fit: tokenized
    with pytest.raises(InputError, match=r"too long for one utterance \(\d+ tokens"):
        tts.synthesize(fits, VOICE, max_frames=1)
    assert seen == [len(fits)]


def test_warmup_wait_takes_only_a_boolean(tts):
    """warmup(wait="no") used to block (a truthy string), wait=[] to run in the background."""
    for wait in ("no", [], 1, None):
        with pytest.raises(InputError, match="wait must be True or False"):
            tts.warmup(VOICE, wait=wait)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"noise": np.zeros((3, 35), np.float32)},
        {"noise": np.full((3, 36), np.nan, np.float32)},
        {"noise": np.zeros((3, 36), np.float32), "seed": 1},
    ],
)
@pytest.mark.parametrize("words", [2, 500], ids=["short", "long"])
def test_astream_refuses_bad_noise_at_the_call_whatever_the_text_length(tts, kwargs, words):
    """A text that may not fit one utterance is tokenized in a thread at the first item;
    its noise used to be checked only then, unlike a short text's."""
    with pytest.raises(InputError, match="noise"):
        tts.astream("word " * words, VOICE, split=False, **kwargs)


def test_a_bad_value_is_shown_shortly_in_its_error(tts):
    for call in (
        lambda: tts.synthesize("Hi.", VOICE, max_frames="x" * 5000),
        lambda: tts.synthesize("Hi.", VOICE, seed="x" * 5000),
        lambda: tts.stream("Hi.", VOICE, pause="x" * 5000),
    ):
        with pytest.raises(InputError) as exc:
            call()
        assert len(str(exc.value)) < 200 and "\n" not in str(exc.value)


def test_misuses_an_app_may_make_are_one_line_errors(tts, tiny_checkpoint_noend):
    """Each of these ended in a raw TypeError/ValueError/UnicodeEncodeError from inside, an
    error blaming the checkpoint, or files written where the app happened to run."""
    import asyncio
    import pathlib

    from voxtral_mlx.errors import UsageError

    with pytest.raises(InputError, match="current directory"):
        voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=pathlib.Path(""))
    with pytest.raises(ModelNotFoundError, match="lone surrogate"):
        voxtral_mlx.load("\ud800")
    with pytest.raises(InputError, match="standard normal"):  # was "re-download the model"
        tts.synthesize("Hi.", VOICE, noise=np.full((4, 36), 3e38, np.float32))
    for text in (np.array(3), np.array(["a", "b"])):
        with pytest.raises(InputError, match="text must be a string, got ndarray"):
            tts.synthesize(text, VOICE, split=True)
    with pytest.raises(InputError, match="call\\(\\) takes a function"):
        tts.call(None)
    with pytest.raises(InputError, match="got the class NullPlayer"):
        tts.say("Hi.", VOICE, player=NullPlayer)
    playback = tts.say("Hi.", VOICE, player=NullPlayer(), wait=False, max_frames=2)
    for timeout in ("x", float("nan"), -1):
        with pytest.raises(InputError, match="timeout must be a number of seconds"):
            playback.wait(timeout)
    assert playback.wait(30)
    with pytest.raises(UsageError, match="make it with stream\\(\\)"):
        list(tts.astream("Hi.", VOICE, max_frames=2))
    with pytest.raises(UsageError, match="async with"), tts.astream("Hi.", VOICE, max_frames=2):
        pass

    async def async_for_over_stream() -> None:
        async for _ in tts.stream("Hi.", VOICE, max_frames=2):
            pass

    with pytest.raises(UsageError, match="make it with astream\\(\\)"):
        asyncio.run(async_for_over_stream())
    assert len(tts.synthesize("Hi.", VOICE, seed=1, max_frames=3).codes) == 3


def test_lookahead_is_bounded_and_a_voice_object_is_told_to_pass_its_name(tts):
    """A lookahead of 10**30 put a chapter's every segment in flight at once."""
    with pytest.raises(InputError, match="lookahead must be at most 64"):
        tts.stream("One. Two.", VOICE, split=True, lookahead=10**30)
    with pytest.raises(VoiceError, match=f"pass its .name, '{VOICE}'"):
        tts.synthesize("Hi.", tts.voices[VOICE], max_frames=2)


def test_a_closed_model_makes_no_jobs(tiny_checkpoint_noend):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    model.close()
    with pytest.raises(VoxtralError, match="closed"):
        model.job("Hi.", VOICE)
