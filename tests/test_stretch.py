"""Speech played faster or slower for `speak --speed` and `say(speed=...)`: a text stream's
segments each time-stretched on their own, whatever the chunking. (The stretch itself, WSOLA,
is tested with the server's `speed` in test_server.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from voxtral_mlx.audio.stretch import SegmentStretcher, check_speed, time_stretch
from voxtral_mlx.errors import InputError

SR = 24000


def _chunks(units: list[np.ndarray], rng: np.random.Generator) -> list[SimpleNamespace]:
    """Chunks as a split text's stream hands them out: each unit (a pause, then a segment's
    audio; the first without a pause) cut at random, its last chunk ending the segment,
    and sometimes an empty chunk marking the end (END after the last frame was sent)."""
    chunks = []
    for u, unit in enumerate(units):
        cuts = np.sort(rng.choice(np.arange(1, len(unit)), size=3, replace=False))
        pieces = np.split(unit, cuts)
        if rng.random() < 0.5:
            pieces.append(np.zeros(0, np.float32))
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            chunks.append(
                SimpleNamespace(
                    audio=piece,
                    segment=u,
                    ends_segment=last,
                    is_final=last and u == len(units) - 1,
                )
            )
    return chunks


@pytest.mark.parametrize("speed", [0.5, 0.8, 1.5, 3.0])
def test_each_segment_is_stretched_on_its_own_in_any_chunking(speed):
    rng = np.random.default_rng(int(speed * 10))
    units = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (9000, 15000, 4100)]
    stretch = SegmentStretcher(speed, SR)
    out, positions = [], []
    for chunk in _chunks(units, rng):
        if not positions or positions[-1][0] != chunk.segment:
            positions.append((chunk.segment, stretch.position))
        out.append(stretch(chunk))
    expected = [time_stretch(u, speed, SR) for u in units]
    np.testing.assert_array_equal(np.concatenate(out), np.concatenate(expected))
    # Where each segment's audio begins among the samples returned: after the ones before.
    starts = np.cumsum([0] + [len(e) for e in expected[:-1]])
    assert [p for _, p in positions] == list(starts)


def test_nothing_of_a_segment_waits_for_the_next():
    """Text still being written may have no next segment yet: a segment's end returns all
    of it."""
    stretch = SegmentStretcher(1.5, SR)
    unit = np.sin(np.arange(20000) / 7.0).astype(np.float32) * 0.3
    got = stretch(SimpleNamespace(audio=unit[:12000], ends_segment=False, is_final=False))
    assert len(got) < round(12000 / 1.5)  # the stretch holds some back meanwhile
    got = np.concatenate(
        [got, stretch(SimpleNamespace(audio=unit[12000:], ends_segment=True, is_final=False))]
    )
    np.testing.assert_array_equal(got, time_stretch(unit, 1.5, SR))


@pytest.mark.parametrize("bad", [0, 0.2, 4.5, float("nan"), float("inf"), True, "2", None, 10**400])
def test_a_speed_out_of_range_is_one_line_naming_the_range(bad):
    with pytest.raises(InputError, match=r"^speed must be a number from 0\.25 to 4\.0 .*got "):
        check_speed(bad)
    with pytest.raises(InputError):
        SegmentStretcher(bad, SR)  # type: ignore[arg-type]


def test_speeds_in_range_are_taken_as_floats():
    assert [check_speed(v) for v in (0.25, 1, 4, np.float32(1.5))] == [0.25, 1.0, 4.0, 1.5]


def test_at_speed_1_the_audio_passes_through_and_is_counted():
    stretch = SegmentStretcher(1, SR)
    rng = np.random.default_rng(1)
    units = [rng.standard_normal(n).astype(np.float32) for n in (5000, 7000)]
    out, starts = [], []
    for chunk in _chunks(units, rng):
        starts.append(stretch.position)
        out.append(stretch(chunk))
    np.testing.assert_array_equal(np.concatenate(out), np.concatenate(units))
    assert starts[-1] + len(out[-1]) == 12000 and stretch.position == 12000
