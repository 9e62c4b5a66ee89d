"""Chunks that grow once a player is ahead: one-frame chunks for first audio, then fewer,
larger codec steps (the codec's weights read once per chunk) without changing the audio."""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest

import voxtral_mlx
from voxtral_mlx.audio.chunking import MARGIN, live_chunk_frames
from voxtral_mlx.errors import InputError

VOICE = "neutral_male"
TEXT = "The keeper climbed the stairs before dawn. The lamp was still warm, the sea calm."
FRAME_S = 0.08


@pytest.fixture(scope="module")
def tts(tiny_checkpoint_noend):
    """Float32 tiny model whose END never fires, so every segment runs ``max_frames``."""
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    yield model
    model.close()


def _frames(chunks) -> list[int]:
    """Frames per chunk of generated audio (a pause between segments has none)."""
    return [c.frames for c in chunks if c.frames]


@pytest.mark.parametrize(
    ("buffered_s", "speed", "started", "frames"),
    [
        (30.0, 10.0, False, 1),  # not playing yet: the pre-roll is reached soonest
        (30.0, None, True, 1),  # speed not measured yet
        (30.0, 0.0, True, 1),
        (30.0, float("nan"), True, 1),
        (0.0, 10.0, True, 1),
        (30.0, 10.0, True, 8),
        (30.0, float("inf"), True, 8),
        # speed 1 (a frame per 80 ms): n frames need MARGIN * (n + 1) * 0.08 s buffered
        (MARGIN * 3 * FRAME_S, 1.0, True, 2),
        (MARGIN * 3 * FRAME_S - 0.01, 1.0, True, 1),
        (MARGIN * 5 * FRAME_S, 1.0, True, 4),
        (MARGIN * 9 * FRAME_S, 1.0, True, 8),
        (MARGIN * 5 * 2 * FRAME_S, 0.5, True, 4),  # half real time: a frame takes 0.16 s
    ],
)
def test_chunks_grow_only_as_far_as_the_buffer_covers_them(buffered_s, speed, started, frames):
    assert live_chunk_frames(buffered_s, speed, started, FRAME_S) == frames


@pytest.mark.parametrize("split", [False, True])
def test_set_chunk_frames_changes_later_chunks_and_not_the_audio(tts, split):
    options = {"max_chars": 60} if split else {}
    expected = tts.synthesize(TEXT, VOICE, seed=5, max_frames=20, split=split, **options)
    stream = tts.stream(TEXT, VOICE, seed=5, max_frames=20, split=split, **options)
    chunks = [next(stream)]
    stream.set_chunk_frames(4)
    chunks += list(stream)
    frames = _frames(chunks)
    assert frames[0] == 1 and 4 in frames and max(frames) <= 4
    if split:
        assert {c.segment for c in chunks} == {0, 1}  # the second segment's chunks too
    audio = np.concatenate([c.audio for c in chunks])
    np.testing.assert_allclose(audio, expected.audio, atol=1e-5)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", True, None])
def test_set_chunk_frames_takes_a_whole_number_of_frames(tts, bad):
    stream = tts.stream(TEXT, VOICE, max_frames=2)
    try:
        with pytest.raises(InputError, match="frames must be a whole number >= 1"):
            stream.set_chunk_frames(bad)
    finally:
        stream.close()


class AheadPlayer:
    """An AudioPlayer's measurements for a machine generating 10x real time and playing
    with seconds buffered (after its first chunk); records what it is fed."""

    instances: ClassVar[list[AheadPlayer]] = []
    sample_rate = 24000

    def __init__(self, *args, **kwargs):
        self.fed: list[np.ndarray] = []
        self.finished = self.stopped = False
        AheadPlayer.instances.append(self)

    def feed(self, audio, expected_total_s=None, more_coming=False):
        self.fed.append(np.array(audio))

    @property
    def started(self) -> bool:
        return len(self.fed) > 1

    @property
    def buffered_s(self) -> float:
        return 5.0

    def generation_speed(self):
        return 10.0

    def finish(self):
        self.finished = True

    def stop(self):
        self.stopped = True


def test_say_decodes_larger_chunks_once_its_player_is_ahead(tts, monkeypatch):
    import voxtral_mlx.audio.player as player_mod

    monkeypatch.setattr(player_mod, "AudioPlayer", AheadPlayer)
    AheadPlayer.instances.clear()
    tts.say(TEXT, VOICE, seed=7, max_frames=30)
    (player,) = AheadPlayer.instances
    assert player.finished and not player.stopped
    frames = [len(a) // tts.samples_per_frame for a in player.fed if len(a)]
    assert frames[:2] == [1, 1] and max(frames) == 8  # 1 until playing, then 8
    played = np.concatenate(player.fed)
    expected = tts.synthesize(TEXT, VOICE, seed=7, max_frames=30, split=True)
    np.testing.assert_allclose(played, expected.audio, atol=1e-5)


def test_speak_decodes_larger_chunks_once_its_player_is_ahead(
    tiny_checkpoint_noend, tmp_path, monkeypatch, capsys
):
    import voxtral_mlx.audio.player as player_mod
    from voxtral_mlx import cli

    monkeypatch.setattr(player_mod, "AudioPlayer", AheadPlayer)
    monkeypatch.setenv("VOXTRAL_MLX_CACHE", str(tmp_path / "cache"))
    AheadPlayer.instances.clear()
    out = tmp_path / "out.wav"
    args = ["-m", str(tiny_checkpoint_noend), "--max-frames", "30", "--seed", "7", TEXT]
    assert cli.main(["speak", "--play", "-o", str(out), *args]) == 0, capsys.readouterr().err
    (player,) = AheadPlayer.instances
    frames = [len(a) // 1920 for a in player.fed if len(a)]
    assert frames[:2] == [1, 1] and max(frames) == 8
    import soundfile as sf

    written, _ = sf.read(out, dtype="float32")  # 16-bit, clipped
    played = np.clip(np.concatenate(player.fed), -1.0, 1.0)
    np.testing.assert_allclose(played, written, atol=1.0 / 32768)


@pytest.mark.parametrize("speed", [1.05, 1.5, 3.0, 10.0])
def test_growing_chunks_play_without_a_gap(speed):
    """A player fed by a generator at ``speed`` x real time whose chunk size follows the
    player (as speak and say() do): once playing, no gap, and the chunks grow where the
    generator is ahead."""
    from test_player import FRAME, FRAME_S, FakeClock, frame, make_player

    from voxtral_mlx.audio.chunking import PlayerPace

    frames_total = 150
    clock = FakeClock(0.0)
    player, sd = make_player(clock)
    device = sd.streams[0]
    stream = _ChunkSink()
    pace = PlayerPace(stream, player, FRAME_S)
    step_s = FRAME_S / speed
    generated = delivered = played = 0
    sizes = []
    next_step, next_block = step_s, FRAME_S
    for _ in range(100_000):  # bounded: a bug here must fail, not hang
        t = min(next_step, next_block)
        clock.advance(t - clock.t)
        if t == next_step:
            next_step += step_s
            if generated < frames_total:
                generated += 1
                pending = generated - delivered
                if pending >= stream.frames or generated == frames_total:
                    audio = np.concatenate([frame(i) for i in range(delivered, generated)])
                    sizes.append(pending)
                    delivered = generated
                    player.feed(audio, expected_total_s=frames_total * FRAME_S)
                    timings = SimpleNamespace(ms_per_frame=1000 * step_s)
                    pace.fed(SimpleNamespace(frames=pending, timings=timings))
                    if delivered == frames_total:
                        player._start(t)  # as finish() does, without its blocking drain
        if t == next_block:
            next_block += FRAME_S
            if device.active:
                device.pump()
                played += 1
                if played >= frames_total:
                    break
    else:
        pytest.fail("the simulation did not play everything")
    assert player.stats.underruns == 0 and player.stats.underrun_s == 0
    audio = np.concatenate(device.blocks)
    expected = np.concatenate([frame(i) for i in range(frames_total)])
    assert np.array_equal(audio[: len(expected)], expected)
    assert sizes[0] == 1
    if speed >= 1.5:
        assert max(sizes) == 8, sizes
    assert sum(sizes) == frames_total and len(device.blocks) * FRAME >= len(expected)


class _ChunkSink:
    """What PlayerPace needs of a stream: the chunk size it sets."""

    frames = 1

    def set_chunk_frames(self, frames: int) -> None:
        self.frames = frames


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _client_sizes(speed: float, rate: float, chunks: int) -> list[int]:
    """Chunk sizes a ClientBuffer asks for when one frame, then four-frame chunks, are
    generated at ``speed`` x real time and sent at once."""
    from voxtral_mlx.audio.chunking import ClientBuffer

    clock = _Clock()
    client = ClientBuffer(rate, clock)
    got = [client.sent(FRAME_S, 1)]  # the first chunk starts the client's clock
    for _ in range(chunks):
        clock.t += 4 * FRAME_S / speed
        got.append(client.sent(4 * FRAME_S, 4))
    return got


def test_a_client_buffer_grows_chunks_as_far_as_a_real_time_listener_is_ahead():
    # 1.25x real time: a frame takes 64 ms, so after k chunks the client is
    # 0.08 + 0.064 k s ahead; n frames need MARGIN * (n + 1) * 64 ms of it.
    sizes = _client_sizes(1.25, 1.0, 30)
    assert sizes[:8] == [1] * 8
    assert (sizes.index(2), sizes.index(4), sizes.index(8)) == (8, 14, 26)
    assert sizes == sorted(sizes)
    # 10x real time: 0.37 s ahead after the first chunk of four.
    assert _client_sizes(10.0, 1.0, 3) == [1, 8, 8, 8]
    # The same at speed 2 (the client plays it twice as fast): 0.17 s ahead, then 0.30.
    assert _client_sizes(10.0, 0.5, 3) == [1, 4, 8, 8]
    # Slower than real time: the client is never ahead.
    assert _client_sizes(0.9, 1.0, 30) == [1] * 31


def test_a_client_buffer_counts_pauses_as_audio_sent():
    from voxtral_mlx.audio.chunking import ClientBuffer

    clock = _Clock()
    client = ClientBuffer(1.0, clock)
    client.sent(FRAME_S, 1)
    clock.t = FRAME_S  # one frame in real time: nothing ahead
    assert client.sent(FRAME_S, 1) == 1
    assert client.sent(2.0, 0) == 4  # a 2 s pause: 2.08 s ahead, 8 frames need 2.16


def test_a_segment_queued_behind_a_full_batch_starts_with_one_frame(tiny_checkpoint_noend):
    """A later segment that could not join the batch took the grown size for its first
    chunk: its reader waited ~8 frames for its first audio once the segment before ended."""
    tts = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None, max_batch=2)
    try:
        other = tts.stream("Another listener, for a long while.", VOICE, seed=1, max_frames=150)
        next(other)  # it holds one of the two slots
        options = {"seed": 5, "max_frames": 30, "split": True, "max_chars": 60}
        stream = tts.stream(TEXT, VOICE, lookahead=2, **options)
        chunks = [next(stream)]
        stream.set_chunk_frames(8)
        chunks += list(stream)
        other.close()
        later = [c.frames for c in chunks if c.segment == 1 and c.frames]
        assert later[0] == 1 and 8 in later, later
        audio = np.concatenate([c.audio for c in chunks])
        expected = tts.synthesize(TEXT, VOICE, **options)
        np.testing.assert_allclose(audio, expected.audio, atol=1e-5)
    finally:
        tts.close()


class _MeasuredPlayer:
    """An AudioPlayer's measurements: playing, ``buffered_s`` ahead, audio arriving at
    ``speed`` x real time."""

    def __init__(self, buffered_s: float, speed: float):
        self.buffered_s, self._speed, self.started = buffered_s, speed, True

    def generation_speed(self) -> float:
        return self._speed


def test_the_segment_heard_sets_the_pace_not_bursts_of_segments_made_beside_it():
    """Four segments generated side by side reach the player at 4x the pace of the one
    being heard (the others arrive in bursts when it ends): its chunks must be sized by
    its own frames' pace, 60 ms here, or a chunk of 8 (480 ms) could outlast 1 s of audio
    ahead."""
    from voxtral_mlx.audio.chunking import PlayerPace

    stream = _ChunkSink()
    pace = PlayerPace(stream, _MeasuredPlayer(buffered_s=1.0, speed=4 * FRAME_S / 0.06), FRAME_S)
    pace.fed(SimpleNamespace(frames=1, timings=SimpleNamespace(ms_per_frame=60.0)))
    assert stream.frames == 4  # MARGIN * (4 + 1) * 60 ms <= 1 s < MARGIN * (8 + 1) * 60 ms
    pace.fed(SimpleNamespace(frames=0, timings=None))  # a pause keeps the pace it knows
    assert stream.frames == 4
    unpaced = PlayerPace(stream, _MeasuredPlayer(buffered_s=1.0, speed=5.3), FRAME_S)
    unpaced.fed(SimpleNamespace(frames=0, timings=None))
    assert stream.frames == 8  # what audio arriving at 5.3x real time alone would allow


def test_a_client_buffer_takes_the_segment_pace_too():
    """Audio sent at 20x real time on average (segments made side by side arrive in
    bursts) while the segment heard makes a frame every 60 ms."""
    from voxtral_mlx.audio.chunking import ClientBuffer

    slow = SimpleNamespace(frames=4, timings=SimpleNamespace(ms_per_frame=60.0))
    sizes = []
    for chunk in (slow, None):
        clock = _Clock()
        client = ClientBuffer(1.0, clock)
        client.sent(FRAME_S, 1)
        clock.t = 0.1
        assert client.sent(3.84, 48) == 8  # 3.82 s ahead
        clock.t = 2.5  # 1.42 s ahead; 52 ms per frame on average
        sizes.append(client.sent(0.0, 0, chunk))
    # MARGIN * (8 + 1) * 60 ms > 1.42 s >= MARGIN * (4 + 1) * 60 ms; at 52 ms, 8 fits.
    assert sizes == [4, 8]
