"""Rules of the command line and of /v1/audio/speech that no other test pinned down (found
by mutation testing): boundaries, defaults, content types and exact messages."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_cli_edges import env_with_repo

from voxtral_mlx import cli
from voxtral_mlx.audio.stretch import MAX_SPEED, MIN_SPEED
from voxtral_mlx.server.errors import APIError
from voxtral_mlx.server.formats import FORMATS
from voxtral_mlx.server.request import MAX_SEED, parse_speech_request, resolve_voice, voice_aliases

VOICES = {"casual_male": 1, "neutral_female": 2}


def cli_error(argv: list[str], capsys) -> str:
    """Run the command line in-process; its one error line (status 1)."""
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, (code, err)
    assert err.startswith("voxtral-mlx: error: "), err
    return err


def speech(body: dict, max_chars: int = 4096):
    return parse_speech_request(body, VOICES, "casual_male", max_chars)


def bad_speech(body: dict, max_chars: int = 4096) -> APIError:
    with pytest.raises(APIError) as e:
        speech(body, max_chars)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


# --------------------------------------------------------------------------- serve


@pytest.mark.parametrize("flag", ["--max-queue", "--max-input-chars", "--max-frames"])
def test_serve_limits_of_zero_are_refused(tmp_path, capsys, flag):
    argv = ["serve", "-m", str(tmp_path / "none"), "--port", "0", flag, "0"]
    assert f"{flag} must be at least 1" in cli_error(argv, capsys)


def test_serve_refuses_the_first_port_past_the_tcp_range(tmp_path, capsys):
    argv = ["serve", "-m", str(tmp_path / "none"), "--port", "65536"]
    assert "--port 65536 is not a TCP port: use 1 to 65535" in cli_error(argv, capsys)


@pytest.mark.parametrize("flag", ["--body-timeout", "--send-timeout"])
def test_serve_timeouts_are_at_most_a_day(tmp_path, capsys, flag):
    argv = ["serve", "-m", str(tmp_path / "none"), "--port", "0", flag, "86401"]
    words = f"{flag} must be a number of seconds from 0 (exclusive) to 86400, got 86401"
    assert words in cli_error(argv, capsys)


def test_serve_checks_the_api_key_from_the_environment_too(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VOXTRAL_MLX_API_KEY", " key")
    argv = ["serve", "-m", str(tmp_path / "none"), "--port", "0"]
    assert "the API key starts or ends with spaces" in cli_error(argv, capsys)


def test_serve_defaults():
    args = cli.build_parser().parse_args(["serve"])
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert (args.max_batch, args.max_queue, args.max_input_chars) == (4, 32, 4096)
    assert (args.max_frames, args.log_level, args.no_warmup) == (2400, "info", False)


def test_speak_defaults():
    args = cli.build_parser().parse_args(["speak", "Hi."])
    assert (args.max_frames, args.output, args.voice, args.raw) == (2400, None, None, False)


def test_random_checkpoint_defaults():
    args = cli.build_parser().parse_args(["random-checkpoint", "out"])
    assert (args.size, args.seed, args.dtype, args.voice_format) == (
        "tiny",
        0,
        "bfloat16",
        "pt",
    )


# --------------------------------------------------------------------------- speak


def test_speak_refuses_raw_with_an_output_file(tmp_path, capsys):
    argv = ["speak", "-m", str(tmp_path / "none"), "--raw", "-o", str(tmp_path / "a.wav"), "Hi."]
    assert "--raw writes PCM to stdout; do not combine it with -o" in cli_error(argv, capsys)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- request


def test_input_of_exactly_the_limit_is_accepted_one_more_refused():
    assert speech({"input": "abcd"}, max_chars=4).input == "abcd"
    error = bad_speech({"input": "abcde"}, max_chars=4)
    assert error.message.startswith("input is too long (5 characters, this server's limit is 4)")
    assert (error.param, error.code) == ("input", "string_above_max_length")


def test_seed_range_ends_just_below_2_to_the_62():
    assert speech({"input": "Hi.", "seed": MAX_SEED - 1}).seed == MAX_SEED - 1
    assert speech({"input": "Hi.", "seed": 0}).seed == 0
    error = bad_speech({"input": "Hi.", "seed": MAX_SEED})
    assert error.message.startswith("seed must be an integer from 0 to 2**62 - 1, got ")
    assert error.param == "seed"


def test_speed_bounds_are_inclusive():
    assert speech({"input": "Hi.", "speed": MIN_SPEED}).speed == 0.25
    assert speech({"input": "Hi.", "speed": MAX_SPEED}).speed == 4.0
    assert speech({"input": "Hi.", "speed": 2}).speed == 2.0


def test_request_defaults():
    request = speech({"input": "Hi."})
    assert (request.voice, request.response_format, request.stream_format) == (
        "casual_male",
        "mp3",
        "audio",
    )
    assert (request.speed, request.seed, request.model) == (1.0, None, None)


def test_aac_is_named_as_unsupported_not_unknown():
    error = bad_speech({"input": "Hi.", "response_format": "aac"})
    assert error.message == (
        "response_format 'aac' is not supported by this server; use one of "
        "mp3, opus, wav, pcm, flac"
    )
    assert error.param == "response_format"


def test_a_voice_of_the_models_own_beats_the_openai_alias_of_the_same_name():
    voices = {**VOICES, "alloy": 3}
    assert resolve_voice("alloy", voices, "casual_male") == "alloy"
    assert resolve_voice("ALLOY", voices, "casual_male") == "alloy"  # not ambiguous
    assert "alloy" not in voice_aliases(voices) and voice_aliases(VOICES)["alloy"] == (
        "neutral_female"
    )
    assert resolve_voice("alloy", VOICES, "casual_male") == "neutral_female"


@pytest.mark.parametrize(
    ("field", "words"),
    [
        ("model", "model must be a string (a model id, or leave it out)"),
        ("instructions", "instructions must be a string (or leave it out"),
    ],
)
def test_ignored_fields_must_still_be_strings(field, words):
    error = bad_speech({"input": "Hi.", field: 5})
    assert error.message.startswith(words) and error.param == field


def test_a_boolean_input_is_named_as_a_boolean():
    error = bad_speech({"input": True})
    assert error.message == "input must be a string, got a boolean"


def test_response_content_types():
    assert {name: f.media_type for name, f in FORMATS.items()} == {
        "mp3": "audio/mpeg",
        "opus": "audio/ogg",
        "wav": "audio/wav",
        "pcm": "audio/pcm",
        "flac": "audio/flac",
    }
    assert [name for name, f in FORMATS.items() if not f.streams] == ["flac"]


def test_a_short_dashed_word_among_the_text_gets_the_dash_hint(capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["speak", "Hi.", "-wow"])
    err = capsys.readouterr().err
    assert e.value.code == 1
    assert "unrecognized arguments: -wow (text that starts with '-' goes last, after --)" in err


# --------------------------------------------------------------------------- exit codes


def test_a_reader_gone_away_mid_command_exits_141_silently(monkeypatch, capsys):
    def gone(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("voxtral_mlx.cli.parser.cmd_voices", gone)
    monkeypatch.setattr("voxtral_mlx.cli.signal.signal", lambda *a: None)  # keep pytest's
    assert cli.main(["voices"]) == 141
    assert capsys.readouterr().err == ""


def test_help_to_a_full_disk_is_one_line_and_status_1():
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "voxtral_mlx", "--help"],
            stdout=full,
            stderr=subprocess.PIPE,
            env=env_with_repo(),
            timeout=60,
        )
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert err.startswith("voxtral-mlx: error: writing to stdout failed: No space left on device")
    assert err.count("\n") == 1


def test_random_checkpoint_refuses_more_layers_than_the_limit(tmp_path, capsys):
    argv = ["random-checkpoint", str(tmp_path / "rc"), "--layers", "1025"]
    assert "--layers must be between 1 and 1024, got 1025" in cli_error(argv, capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("body", [{}, {"input": None}], ids=["missing", "null"])
def test_a_missing_or_null_input_is_required_not_mistyped(body):
    error = bad_speech(body)
    assert error.message == "input is required: the text to speak" and error.param == "input"
