"""Text that arrives in pieces: where it is cut (no model), and the streams that speak it."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from voxtral_mlx.errors import InputError, UsageError
from voxtral_mlx.livetext import END, LiveText
from voxtral_mlx.segment import PARAGRAPH, PAUSE_AFTER, SENTENCE, split_text

VOICE = "casual_male"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def live(clock: Clock | None = None, **kwargs) -> LiveText:
    kwargs.setdefault("target_chars", 100)
    kwargs.setdefault("max_chars", 200)
    return LiveText(clock=clock or Clock(), **kwargs)


def texts(lt: LiveText) -> list[str]:
    out = []
    while (seg := lt.take(False)) not in (None, END):
        out.append(seg.text)
    return out


def test_a_sentence_is_cut_once_the_next_word_is_whole():
    lt = live()
    lt.put("Hello there.")
    assert texts(lt) == []  # "there." may be the text's end or "Mr."-like: unknown yet
    lt.put(" How")
    assert texts(lt) == []  # "How" may still grow into "However,"
    lt.put(" are you")
    seg = lt.take(False)
    assert (seg.text, seg.spoken, seg.start, seg.end) == ("Hello there.", "Hello there.", 0, 12)
    assert seg.pause_after == PAUSE_AFTER[SENTENCE]
    lt.end()
    last = lt.take(False)
    assert (last.text, last.spoken, last.pause_after) == ("How are you", "How are you.", 0.0)
    assert lt.take(False) is END


@pytest.mark.parametrize("text", ["我们到了！--然后呢？好的。", "وصلنا؟--ثم ماذا؟ حسنا."])
def test_a_cut_without_a_space_waits_for_what_a_dash_may_become(text):
    """ "！-" may yet be "！--", which ends the cut two characters further: cut at once, the
    next segment began with "--", unlike the same text given whole."""
    whole = [seg.text for seg in split_text(text, target_chars=1, max_chars=200)]
    at = text.index("--") + 1
    lt = live(target_chars=1)
    lt.put(text[:at])
    assert texts(lt) == []
    lt.put(text[at:])
    lt.end()
    assert texts(lt) == whole and whole[0].endswith("--")


def test_an_abbreviation_or_a_lowercase_word_is_no_sentence_end():
    lt = live()
    lt.put("I met Mr. Smith and Dr. Jones etc. and others here ")
    assert texts(lt) == []
    lt.put("today. Then ")
    assert texts(lt) == ["I met Mr. Smith and Dr. Jones etc. and others here today."]


def test_a_stalled_input_is_cut_after_a_sentence_end_or_a_line_break_only():
    clock = Clock()
    lt = live(clock, idle_s=0.5)
    lt.put("The answer is")
    clock.t = 10.0
    assert texts(lt) == []  # mid-sentence: an LLM thinking must not cut it
    lt.put(" forty-two.")
    clock.t = 10.4
    assert texts(lt) == []
    clock.t = 10.6
    assert texts(lt) == ["The answer is forty-two."]
    lt.put("a line typed without a stop\n")
    assert texts(lt) == []
    clock.t = 11.2
    seg = lt.take(False)
    assert seg.text == "a line typed without a stop" and seg.spoken.endswith(".")
    assert seg.pause_after == PAUSE_AFTER[SENTENCE]
    lt.put("A paragraph.\n\n")
    clock.t = 12.0
    assert lt.take(False).pause_after == PAUSE_AFTER[PARAGRAPH]


@pytest.mark.parametrize("after", [["\n"], ["\r", "\n"], [" ", "", "\n  "], ["\u2029"]])
def test_a_blank_line_completed_after_a_stall_makes_a_paragraph_pause(after):
    """Someone typing lines: "...here.\n", a stall cuts it, then "\n" and the next line.
    The blank line is the paragraph split_text sees in the whole text: its pause is the
    paragraph's (it was the sentence's, by what had come at the cut)."""
    clock = Clock()
    lt = live(clock, idle_s=0.5)
    lt.put("First paragraph ends here.\n")
    clock.t = 1.0
    seg = lt.take(False)
    assert seg.text == "First paragraph ends here."
    assert seg.pause_after == PAUSE_AFTER[SENTENCE] and lt.pause_after(0) is None
    for piece in after:
        lt.put(piece)
        lt.take(False)
    lt.put("Second one.")
    lt.end()
    assert texts(lt) == ["Second one."]
    assert lt.pause_after(0) == PAUSE_AFTER[PARAGRAPH]


def test_a_single_line_break_after_a_stall_keeps_its_pause():
    clock = Clock()
    lt = live(clock, idle_s=0.5)
    lt.put("A line.\n")
    clock.t = 1.0
    assert lt.take(False).pause_after == PAUSE_AFTER[SENTENCE]
    lt.put("Next line.\n\nMore.")  # a blank line later, after other text: not this one's
    lt.end()
    assert texts(lt) == ["Next line.", "More."]
    assert lt.pause_after(0) is None


def test_a_stream_plays_the_paragraph_pause_completed_after_its_segment_was_cut(tts):
    """Through the API: the pause played (and the segment reported) is the paragraph's, as
    for the text given whole."""

    def pieces():
        yield "First paragraph ends here.\n"
        time.sleep(1.0)  # past the 0.6 s stall: the first line is cut alone
        yield "\nSecond paragraph starts here."

    with tts.stream(pieces(), VOICE, split=True, seed=1, max_frames=8) as live_stream:
        live_audio = np.concatenate([c.audio for c in live_stream])
    whole = "First paragraph ends here.\n\nSecond paragraph starts here."
    with tts.stream(whole, VOICE, split=True, seed=1, max_frames=8) as whole_stream:
        whole_audio = np.concatenate([c.audio for c in whole_stream])
    assert (
        [s.pause_after for s in live_stream.segments]
        == [s.pause_after for s in whole_stream.segments]
        == [PAUSE_AFTER[PARAGRAPH], 0.0]
    )
    assert np.array_equal(live_audio, whole_audio)


def test_a_paragraph_completed_after_a_blank_segment_was_cut_is_played(tts):
    """Lines typed with a zero-width mark alone on one: each stall cuts a segment, the
    blank one too, and the "\n" that then completes the blank line makes the pause before
    the next words a paragraph's (it was read from the segment before the blank one only:
    a sentence's)."""

    def pieces():
        yield "First paragraph ends here.\n"
        time.sleep(1.0)  # past the 0.6 s stall: cut alone
        yield "\u200b\n"
        time.sleep(1.0)
        yield "\nSecond paragraph starts here."

    with tts.stream(pieces(), VOICE, split=True, seed=1, max_frames=2) as stream:
        chunks = list(stream)
    assert [s.text for s in stream.segments][::2] == [
        "First paragraph ends here.",
        "Second paragraph starts here.",
    ]
    silences = [len(c.audio) for c in chunks if not c.frames and len(c.audio)]
    assert silences == [round(PAUSE_AFTER[PARAGRAPH] * tts.sample_rate)]


@pytest.mark.parametrize(
    "head, tail",
    [
        ("Price is 3.", "50 dollars."),
        ("It costs $3.", "50 today."),
        ("Version 2.0.", "1 is out."),
        ("I met Dr.", " Smith."),
        ("See e.g.", " this one."),
        ("Open https://example.", "com/docs now."),
        ("Go to www.example.", "org today."),
        ("Write to bob@mail.example.", "org soon."),
        ("Write to bob@example.", "org soon."),
        ("Try http://例子.", "公司 too."),
    ],
)
def test_a_stall_after_an_abbreviation_or_a_number_is_no_sentence_end(head, tail):
    clock = Clock()
    lt = live(clock, idle_s=0.5)
    lt.put(head)
    clock.t = 5.0
    assert texts(lt) == []  # split_text would not end a sentence there either
    lt.put(tail)
    lt.end()
    assert texts(lt) == [head + tail]


def test_a_stall_after_a_sentence_ending_in_an_address_waits_for_what_follows():
    """A URL's "https://example." may go on as ".com": a stall after an address's period cuts
    nothing; the next word (or the end) decides, as split_text would."""
    clock = Clock()
    lt = live(clock, idle_s=0.5)
    lt.put("The docs are at https://example.com.")
    clock.t = 5.0
    assert texts(lt) == []
    lt.put(" See them.")
    clock.t = 10.0
    assert texts(lt) == ["The docs are at https://example.com.", "See them."]


def test_a_paragraph_is_whole_once_text_follows_its_blank_line():
    lt = live()
    lt.put("First paragraph, no stop\n\n")
    assert texts(lt) == []  # the blank line may be followed by more blank lines only
    lt.put("Second")
    seg = lt.take(False)
    assert (seg.text, seg.pause_after) == ("First paragraph, no stop", PAUSE_AFTER[PARAGRAPH])
    assert seg.spoken == "First paragraph, no stop."


def test_text_without_any_stop_is_cut_within_max_chars_once_a_window_waits():
    lt = live(target_chars=50, max_chars=100)
    words = " ".join(f"word{i}" for i in range(200))
    lt.put(words[:120])
    assert texts(lt) == []  # the cut split_text would choose may still move
    lt.put(words[120:])
    got = texts(lt)
    assert got and all(len(t) <= 100 for t in got)
    assert got[0] == split_text(words, target_chars=50, max_chars=100)[0].text


def test_a_burst_of_sentences_is_cut_near_the_target_length_as_split_text_cuts():
    lt = live(target_chars=100, max_chars=200)
    sentence = "This sentence is forty characters long. "
    lt.put(sentence * 5 + "And")  # 200 characters at once: sentence ends at 40, 80, ...
    # 119 characters: the cheapest length; then the one confirmed sentence left ("And"
    # may go on, so the fifth sentence's end is not sure yet)
    assert texts(lt) == [(sentence * 3).strip(), sentence.strip()]


@st.composite
def pieces_and_takes(draw):
    word = st.sampled_from(
        [
            "Hello",
            "world",
            "Mr.",
            "e.g.",
            "3.14",
            "etc.",
            "and",
            "It",
            "https://a.b/c.",
            "你好。",
            "Ok!",
            "—",
            "x" * 30,
            "🙂",
            "so,",
            "end.",
            "¿Qué?",
            "A.",
        ]
    )
    sep = st.sampled_from([" ", " ", " ", "\n", "\n\n", "  ", "\r\n"])
    parts = draw(st.lists(st.tuples(word, sep), min_size=1, max_size=60))
    text = "".join(w + s for w, s in parts)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    actions = draw(
        st.lists(
            st.sampled_from(["take", "idle", "none"]), min_size=len(chunks), max_size=len(chunks)
        )
    )
    return text, chunks, actions


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces_and_takes(), st.sampled_from([(20, 40), (100, 200), (8, 12)]))
def test_segments_of_text_in_any_pieces_rebuild_it(case, sizes):
    """However the text is cut into pieces and whenever segments are taken: segments in
    order, each the input at its offsets, within max_chars, and together the input minus
    whitespace."""
    text, chunks, actions = case
    target, max_chars = sizes
    clock = Clock()
    lt = live(clock, target_chars=target, max_chars=max_chars, idle_s=1.0)
    segments = []
    for chunk, action in zip(chunks, actions, strict=True):
        lt.put(chunk)
        if action == "idle":
            clock.t += 2.0
        if action != "none":
            while (seg := lt.take(False)) is not None:
                segments.append(seg)
    lt.end()
    while (seg := lt.take(False)) is not END:
        segments.append(seg)
    end = 0
    for seg in segments:
        assert seg.start >= end and text[seg.start : seg.end] == seg.text
        assert seg.text == seg.text.strip() and seg.text
        assert len(seg.text) <= max_chars
        end = seg.end
    assert re.sub(r"\s", "", "".join(s.text for s in segments)) == re.sub(r"\s", "", text)


def _given_at_once(text: str, **sizes) -> list:
    """The segments LiveText makes of ``text`` put whole, then ended."""
    lt = live(**sizes)
    lt.put(text)
    lt.end()
    got = []
    while (seg := lt.take(False)) is not END:
        got.append(seg)
    return got


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1, max_size=600))
def test_text_given_at_once_is_split_as_split_text_splits_it(text):
    got = _given_at_once(text, target_chars=60, max_chars=120)
    assert got == split_text(text, target_chars=60, max_chars=120)


def test_text_after_an_address_is_split_as_split_text_splits_it():
    """A window cut after an address no longer holds its start: the address's run must end
    where split_text's does, or the two split the text after it differently."""
    text = "请访问https://example.com了解详情—" + "谢谢你们.明天见面吧—" * 12
    got = _given_at_once(text, target_chars=6, max_chars=30)
    assert got == split_text(text, target_chars=6, max_chars=30)
    assert "谢谢你们." in [s.text for s in got]


def test_a_producer_far_ahead_waits_for_the_speech():
    lt = live(max_buffer_chars=1000)
    done = threading.Event()

    def produce():
        for _ in range(30):
            lt.put("A sentence that is spoken. " * 5)
        done.set()

    threading.Thread(target=produce, daemon=True).start()
    time.sleep(0.3)
    assert not done.is_set()  # 4,050 characters given, at most ~1,000 waiting
    assert lt._waiting <= 1000 + 135
    taken, deadline = [], time.monotonic() + 30
    while not done.is_set() and time.monotonic() < deadline:
        taken.extend(texts(lt))
        assert lt._waiting <= 1000 + 135
    lt.end()
    taken.extend(texts(lt))
    assert done.is_set() and " ".join(taken) == " ".join(["A sentence that is spoken."] * 150)


def test_a_failing_or_wrong_iterable_is_raised_after_the_text_before_it():
    def pieces():
        yield "One sentence. Two "
        raise OSError("the pipe broke")

    lt = live()
    lt.read_from(pieces()).join(5)
    assert lt.take(False).text == "One sentence. Two"  # the text's end: split_text's cut
    with pytest.raises(OSError, match="pipe broke"):
        lt.take(False)
    lt = live()
    lt.read_from(["fine. ", b"bytes"]).join(5)
    assert lt.take(False).text == "fine."
    with pytest.raises(InputError, match="text pieces must be str, got bytes"):
        lt.take(False)


# -- streams (tiny model) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tts(tiny_checkpoint_noend):
    import voxtral_mlx

    tts = voxtral_mlx.load(tiny_checkpoint_noend)
    yield tts
    tts.close()


STORY = "Hello there. How are you today? I am fine,\n\nthank you. Bye"


def gated(text: str, gate: threading.Event, at: int):
    """``text`` in 5-character pieces, waiting for ``gate`` before the piece at ``at``."""
    for i in range(0, len(text), 5):
        if i == at:
            assert gate.wait(30)
        yield text[i : i + 5]


def expected_audio(tts, segments, seed, max_frames):
    parts = []
    for i, seg in enumerate(segments):
        parts.append(tts.synthesize(seg.spoken, VOICE, seed=seed + i, max_frames=max_frames).audio)
        if i < len(segments) - 1:
            parts.append(np.zeros(round(seg.pause_after * tts.sample_rate), np.float32))
    return np.concatenate(parts)


def test_a_text_error_is_raised_once_however_long_the_audio_before_it(tts):
    """It was raised (and caught) again at every chunk of the segments in flight, its
    traceback one frame longer each time, all kept alive with the stream."""
    import traceback

    def pieces():
        yield "Hello there, this is the first sentence. And this one is the second. Third. "
        raise ValueError("the model writing the text failed")

    lengths = []
    for max_frames in (10, 120):
        with pytest.raises(ValueError) as exc:
            for _ in tts.stream(pieces(), VOICE, seed=1, max_frames=max_frames, split=True):
                pass
        lengths.append(len(list(traceback.walk_tb(exc.value.__traceback__))))
    assert lengths[0] == lengths[1] < 20, lengths


def test_live_text_is_spoken_before_it_ends_and_as_its_segments_would_be(tts):
    gate = threading.Event()
    stream = tts.stream(gated(STORY, gate, 20), VOICE, seed=7, split=True, max_frames=3)
    assert stream.live
    first = next(stream)  # the text past "How are you" has not been given yet
    assert first.segment == 0 and len(first.audio) and not gate.is_set()
    assert [s.text for s in stream.segments] == ["Hello there."]
    gate.set()
    chunks = [first, *stream]
    assert not stream.live
    # Where the rest is cut depends on how fast it comes; never across the blank line.
    assert " ".join(s.text for s in stream.segments) == " ".join(STORY.split())
    assert any(s.text.endswith("I am fine,") for s in stream.segments)
    assert [c.segment for c in chunks] == sorted(c.segment for c in chunks)
    assert chunks[-1].is_final and not any(c.is_final for c in chunks[:-1])
    # Each segment's last chunk of audio says so (a player learns that nothing more is due).
    ends = [k for k, c in enumerate(chunks) if c.ends_segment]
    assert [chunks[k].segment for k in ends] == list(range(len(stream.segments)))
    assert not [
        c for k in ends for c in chunks[k + 1 :] if c.segment == chunks[k].segment and c.frames
    ]
    got = np.concatenate([c.audio for c in chunks])
    np.testing.assert_array_equal(got, expected_audio(tts, stream.segments, 7, 3))
    whole = list(tts.stream("Hello there.", VOICE, seed=7, max_frames=3))
    assert [c.ends_segment for c in whole] == [False] * (len(whole) - 1) + [True]


def test_astream_reads_an_async_iterable_as_it_comes(tts):
    async def pieces():
        for i in range(0, len(STORY), 5):
            await asyncio.sleep(0.002)
            yield STORY[i : i + 5]

    async def collect():
        stream = tts.astream(pieces(), VOICE, seed=7, split=True, max_frames=3)
        return stream, [c async for c in stream]

    stream, chunks = asyncio.run(collect())
    assert chunks[-1].is_final and len(stream.segments) >= 3
    got = np.concatenate([c.audio for c in chunks])
    np.testing.assert_array_equal(got, expected_audio(tts, stream.segments, 7, 3))


def test_say_speaks_live_text(tts):
    class Sink:
        def __init__(self):
            self.audio, self.finished = [], False

        def feed(self, audio, **kwargs):
            self.audio.append(audio)

        def finish(self):
            self.finished = True

        def stop(self):
            pass

    sink = Sink()
    playback = tts.say(
        iter(["Short one. ", "Another one."]), VOICE, seed=1, max_frames=2, player=sink
    )
    assert playback.done and sink.finished
    segments = playback.stream.segments
    assert [s.text for s in segments] in (
        ["Short one.", "Another one."],
        ["Short one. Another one."],
    )
    np.testing.assert_array_equal(np.concatenate(sink.audio), expected_audio(tts, segments, 1, 2))


def test_cancel_while_waiting_for_text_stops_at_once(tts):
    gate = threading.Event()
    text = "One. Two three four."
    stream = tts.stream(gated(text, gate, 10), VOICE, split=True, max_frames=2)
    chunks = [next(stream)]  # "One." is spoken, then the text stalls until the gate opens
    threading.Timer(0.2, stream.cancel).start()
    t0 = time.monotonic()
    chunks += list(stream)
    assert time.monotonic() - t0 < 2
    assert {c.segment for c in chunks} == {0} and [s.text for s in stream.segments] == ["One."]
    assert sum(c.frames for c in chunks) == 2
    gate.set()


@pytest.mark.parametrize(
    "kwargs, text, match",
    [
        ({}, ["a", "b"], "pass split=True"),
        ({"split": True}, 42, "text must be a string, got int"),
        ({"split": True, "noise": np.zeros((3, 36), np.float32)}, ["a."], "cannot be split"),
        # Spoken as their keys / in an arbitrary order: no pieces of text in order.
        ({"split": True}, {"Hello there.": 1}, "got a dict, whose order is not the text's"),
        ({"split": True}, {"One.", "Two."}, "got a set, whose order"),
        ({"split": True}, frozenset({"One."}), "got a frozenset, whose order"),
        ({"split": True}, {"a.": 1}.keys(), "got a dict_keys, whose order"),
        ({}, {"One.", "Two."}, "got a set, whose order"),
    ],
)
def test_live_text_arguments_are_checked_by_the_call(tts, kwargs, text, match):
    with pytest.raises(InputError, match=match):
        tts.stream(text, VOICE, **kwargs)


def test_an_async_iterable_needs_astream_and_empty_pieces_are_empty_text(tts):
    async def nothing():
        if False:
            yield ""

    with pytest.raises(InputError, match="read it with astream"):
        tts.stream(nothing(), VOICE, split=True)
    with pytest.raises(InputError, match="text is empty"):
        list(tts.stream(iter(["  ", "\n"]), VOICE, split=True))

    async def collect():
        return [c async for c in tts.astream(nothing(), VOICE, split=True)]

    with pytest.raises(InputError, match="text is empty"):
        asyncio.run(collect())


def test_an_error_of_the_text_comes_after_the_audio_before_it(tts):
    def pieces():
        yield "First sentence here. Second one there. "
        yield "Third "
        raise OSError("the pipe broke")

    stream = tts.stream(pieces(), VOICE, seed=3, split=True, max_frames=2)
    chunks = []
    with pytest.raises(OSError, match="pipe broke"):
        for chunk in stream:
            chunks.append(chunk)
    spoken = {c.segment for c in chunks if c.frames}
    assert spoken == set(range(len(stream.segments))) and stream.segments
    assert "Third" in stream.segments[-1].text  # the text before the error is all spoken
    np.testing.assert_array_equal(
        np.concatenate([c.audio for c in chunks]), expected_audio(tts, stream.segments, 3, 2)
    )


def test_live_text_of_invisible_marks_is_empty_and_of_punctuation_is_spoken(tts):
    with pytest.raises(InputError, match="text is empty"):
        list(tts.stream(iter(["\u200b", "\u200b\ufeff"]), VOICE, split=True, max_frames=2))
    chunks = list(tts.stream(iter(["..."]), VOICE, seed=1, split=True, max_frames=2))
    assert sum(c.frames for c in chunks) == 2  # as the text "..." whole is spoken


def test_a_live_segment_too_long_for_one_utterance_names_max_chars(tts):
    def pieces():
        yield "Hi. " + "🙂" * 3000

    with pytest.raises(InputError, match=r"lower max_chars \(now 100000\)"):
        list(tts.stream(pieces(), VOICE, split=True, max_chars=100_000, max_frames=1))


def test_say_plays_out_the_audio_before_an_error_of_the_text(tts):
    events = []

    class Sink:
        def feed(self, audio, **kwargs):
            events.append("feed")

        def finish(self):
            events.append("finish")

        def stop(self):
            events.append("stop")

    def pieces():
        yield "Hello there. "
        raise ValueError("the client went away")

    with pytest.raises(ValueError, match="went away"):
        tts.say(pieces(), VOICE, seed=1, max_frames=2, player=Sink())
    assert events[-1] == "finish" and events.count("feed") >= 2 and "stop" not in events


def test_live_async_streams_waiting_for_text_leave_the_thread_pool_to_their_producers(tts):
    """Eight live astream()s whose producers each need the loop's default thread pool (a
    blocking LLM client wrapped in to_thread, a DNS lookup): a waiting stream used to hold
    a pool thread, and the pool (6 threads here) ran dry."""

    def blocking_next(it):
        time.sleep(0.05)
        return next(it, None)

    async def pieces(k):
        it = iter([f"Stream {k} says hello. ", "And then ", "more. "])
        while (piece := await asyncio.to_thread(blocking_next, it)) is not None:
            yield piece

    async def one(k):
        stream = tts.astream(pieces(k), VOICE, seed=k, split=True, max_frames=1)
        return stream, [c async for c in stream]

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(k) for k in range(8))), 120)

    for stream, chunks in asyncio.run(main()):
        assert chunks[-1].is_final and " ".join(s.text for s in stream.segments).endswith("more.")


def test_an_async_text_cancelled_by_its_own_producer_is_an_error_not_an_end(tts):
    async def pieces():
        yield "Hello there. How are "
        raise asyncio.CancelledError

    async def collect():
        return [c async for c in tts.astream(pieces(), VOICE, split=True, max_frames=1)]

    with pytest.raises(InputError, match="async iterable was cancelled before its end"):
        asyncio.run(collect())


def test_live_synthesis_reports_its_seed_and_leaves_out_time_waiting_for_text(tts):
    def pieces():
        yield "Hello there."
        time.sleep(1.0)  # the text ends after the segment's audio

    t0 = time.monotonic()
    speech = tts.synthesize(pieces(), VOICE, seed=5, split=True, max_frames=2)
    wall = time.monotonic() - t0
    plain = tts.synthesize("Hello there.", VOICE, seed=5, max_frames=2)
    assert speech.seed == 5 and np.array_equal(speech.audio, plain.audio)
    assert wall >= 1.0 and speech.timings.total_s < wall - 0.5


def test_cancelling_a_task_waiting_for_text_is_never_lost():
    """Text arriving as the waiting task is cancelled: asyncio.wait_for (before Python
    3.12) returned the text's wake-up and dropped the cancellation."""

    async def main():
        lt = live()
        task = asyncio.create_task(lt.changed(timeout=10))
        await asyncio.sleep(0)  # the task now waits
        lt.put("more text ")  # its wake-up is scheduled...
        task.cancel()  # ...and the cancellation in the same turn of the loop
        with pytest.raises(asyncio.CancelledError):
            await task
        assert lt._wakers == []

    asyncio.run(main())


def endless(stopped: threading.Event, word: str, head: str = ""):
    """``head``, then ``word`` every 20 ms until closed, which sets ``stopped``."""
    try:
        if head:
            yield head
        while True:
            time.sleep(0.02)
            yield word
    finally:
        stopped.set()


async def drain(stream) -> None:
    async for _ in stream:
        pass


def read_on_a_new_loop(tts, pieces, max_frames: int, seconds: float):
    """A live astream() of ``pieces`` read by a task on a new loop that runs ``seconds``:
    (loop, stream, task), the loop left open."""
    loop = asyncio.new_event_loop()
    stream = tts.astream(pieces, VOICE, split=True, max_frames=max_frames)
    task = loop.create_task(drain(stream))
    loop.run_until_complete(asyncio.sleep(seconds))
    return loop, stream, task


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stream_left_on_a_closed_loop_lets_its_text_reader_go(tts):
    """A live astream() waiting for text when its loop is closed (not asyncio.run, which
    cancels its tasks): once the stream is dropped, its reader stops reading the text."""
    import gc

    stopped = threading.Event()
    loop, stream, task = read_on_a_new_loop(tts, endless(stopped, "word "), 1, 0.3)
    loop.close()
    del task, stream
    gc.collect()
    assert stopped.wait(5)


def test_a_stream_whose_loop_closes_mid_segment_stops_its_text_reader(tts):
    """No collection of the stream needed: the next chunk the closed loop cannot take
    stops the stream, and with it the reading of its text."""
    stopped = threading.Event()
    # "Word" capitalised confirms the sentence end before it: "Hello there." is generated.
    pieces = endless(stopped, "Word ", head="Hello there. ")
    loop, stream, task = read_on_a_new_loop(tts, pieces, 2000, 0.5)
    assert stream.segments and not task.done()
    loop.close()
    assert stopped.wait(5) and stream._finished
    with contextlib.suppress(RuntimeError):  # its loop is gone: nothing can cancel it now
        task.get_coro().close()


def test_a_stopped_stream_closes_its_async_text_source(tts):
    async def main():
        done = asyncio.Event()

        async def book():
            try:
                while True:
                    await asyncio.sleep(0)
                    yield "word " * 1000  # fills the buffer: the reader waits for room
            finally:
                done.set()

        source = book()  # held by the caller, as an LLM client's response would be
        stream = tts.astream(source, VOICE, split=True, max_frames=1)
        task = asyncio.create_task(drain(stream))
        await asyncio.sleep(1.0)
        task.cancel()
        await asyncio.wait_for(done.wait(), 5)
        return source

    asyncio.run(main())


def test_a_chunk_already_here_is_not_handed_to_another_loop(tts):
    stream = tts.astream(iter(["Hello there. ", "Bye."]), VOICE, split=True, max_frames=1)

    async def first():
        return await stream.__anext__()

    asyncio.run(first())
    stream._ready.append(stream._ready[0] if stream._ready else object())  # held for loop 1
    with pytest.raises(UsageError, match="started on another event loop"):
        asyncio.run(first())


def test_live_invisible_paragraphs_make_one_pause_and_none_at_either_end(tts):
    """Paragraphs of zero-width marks alone in live text say nothing: one paragraph's pause
    between the sentences around them (not one per blank paragraph), labelled after them,
    and no silence before the first words or after the last."""
    pieces = ["\u200b\n\n", "Hello.\n\n", "\u200b\n\n", "\ufeff\n\n", "Again.\n\n", "\u2060"]
    chunks = list(tts.stream(iter(pieces), VOICE, seed=1, split=True, max_frames=2))
    silent = [(c.segment, len(c.audio)) for c in chunks if not c.frames and len(c.audio)]
    assert silent == [(3, round(PAUSE_AFTER[PARAGRAPH] * tts.sample_rate))]
    assert [c.segment for c in chunks] == sorted(c.segment for c in chunks)
    sounding = [c for c in chunks if len(c.audio)]
    assert sounding[0].frames and sounding[-1].frames


def test_reading_a_stream_again_after_its_error_says_so(tts):
    """A stream stopped by an error (here its text's source failing; Ctrl-C alike) is cut
    short: read again, it says so rather than ending as if its audio were whole; one the
    reader cancelled ends quietly. Both for `for` and `async for`."""

    def pieces():
        yield "First sentence here. "
        raise OSError("the pipe broke")

    stream = tts.stream(pieces(), VOICE, seed=3, split=True, max_frames=2)
    with pytest.raises(OSError, match="pipe broke"):
        list(stream)
    for _ in range(2):
        with pytest.raises(UsageError, match=r"stopped on an error \(OSError\).*new stream"):
            next(stream)

    async def main():
        async def apieces():
            yield "First sentence here. "
            raise OSError("the pipe broke")

        stream = tts.astream(apieces(), VOICE, seed=3, split=True, max_frames=2)
        with pytest.raises(OSError, match="pipe broke"):
            async for _ in stream:
                pass
        with pytest.raises(UsageError, match=r"stopped on an error \(OSError\)"):
            await stream.__anext__()

    asyncio.run(main())
    stream = tts.stream("Hello there. Again.", VOICE, seed=3, split=True, max_frames=2)
    next(stream)
    stream.cancel()
    assert list(stream) == []


def test_the_text_type_error_names_split_only_where_it_is_an_argument(tts):
    """say() always splits and has no split argument: its error told to pass split=True."""
    with pytest.raises(InputError) as said:
        tts.say(None, VOICE, wait=False)
    assert "an iterable of str pieces" in str(said.value) and "split=" not in str(said.value)
    with pytest.raises(InputError) as streamed:
        tts.stream(None, VOICE)
    assert "with split=True, an iterable of str pieces" in str(streamed.value)
    with pytest.raises(InputError) as ordered:
        tts.say({"One.", "Two."}, VOICE, wait=False)
    assert "a list or generator of str pieces" in str(ordered.value)
    assert "split=" not in str(ordered.value)
