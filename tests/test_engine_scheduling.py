"""The engine's scheduling, driven pump by pump on the model's worker thread (no timing):
free slots are used, no segment is set aside for nothing, ended jobs let go of their KV
rows, and no failure leaves a consumer waiting."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

import voxtral_mlx
import voxtral_mlx.engine as engine_mod
from voxtral_mlx.config import END_AUDIO
from voxtral_mlx.prefix_store import PrefixCacheWarning

VOICE = "casual_male"


@pytest.fixture(scope="module")
def tts(tiny_checkpoint_noend):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None, max_batch=2)
    yield model
    model.close()


def job(tts, text: str, segment: int, ahead: bool, **kwargs):
    """A job as a split text makes it (``segment``, generated ``ahead`` of its listener)."""
    made = tts.job(text, VOICE, **kwargs)
    made.segment, made.ahead = segment, ahead
    made.claim()
    return made


def pump_while(e, condition, limit: int = 2000) -> int:
    """Pump ``e`` while ``condition()`` holds; the pumps it took. A scenario that stops
    going as planned fails here instead of pumping for ever."""
    pumps = 0
    while condition():
        assert pumps < limit, f"still pumping after {limit} pumps"
        e.pump()
        pumps += 1
    return pumps


def codes(made) -> np.ndarray:
    items = []
    while not made.output.empty():
        items.append(made.output.get())
    chunks = [i for i in items if isinstance(i, engine_mod.AudioChunk)]
    assert items[-1] is engine_mod.DONE, items[-1]
    return np.concatenate([c.codes for c in chunks])


def solo(tts, text: str, **kwargs) -> np.ndarray:
    return tts.synthesize(text, VOICE, **kwargs).codes


def test_a_set_aside_segment_rejoins_while_another_prompt_is_prefilled(tts, monkeypatch):
    """A set-aside segment needs no prefill: it waited for every part of another job's
    long prompt, with a slot free all along and nothing generating. It takes only the
    free slots: the batch never runs more than ``max_batch`` rows."""
    most = []
    add = engine_mod.FrameBatch.add

    def counted_add(batch, seq):
        add(batch, seq)
        most.append(batch.live())

    monkeypatch.setattr(engine_mod.FrameBatch, "add", counted_add)
    monkeypatch.setattr(engine_mod, "PREFILL_PART_TOKENS", 16)
    monkeypatch.setattr(engine_mod, "MIN_PREFILL_PART_TOKENS", 16)
    long_text = " ".join(f"Sentence number {i} goes on a little." for i in range(30))
    jobs = {}

    def scenario() -> int:
        e = tts.engine
        e._part_tokens = 16
        jobs["a0"] = a0 = job(tts, "Text A first segment.", 0, False, seed=1, max_frames=12)
        jobs["a1"] = a1 = job(tts, "Text A second segment.", 1, True, seed=2, max_frames=40)
        for j in (a0, a1):
            e.submit(j)
        for _ in range(6):
            e.pump()
        jobs["b0"] = b0 = job(tts, "Quick one.", 0, False, seed=3, max_frames=3)
        e.submit(b0)
        pump_while(e, lambda: not e._parked)
        jobs["c0"] = c0 = job(tts, long_text, 0, False, seed=4, max_frames=3)
        e.submit(c0)
        pump_while(e, lambda: e._prefilling is None)
        pump_while(e, lambda: not a0.seq.finished)
        a1.needed()  # A's listener has reached its second segment
        pumps = pump_while(e, lambda: a1 in e._parked)
        parts_left = e._prefilling is not None
        pump_while(e, lambda: e.busy)
        return pumps, parts_left

    pumps, parts_left = tts.call(scenario)
    assert pumps <= 2 and parts_left  # back at once, while the long prompt was prefilling
    assert max(most) == tts.engine.max_batch, most
    for name, text, seed, frames in (
        ("a0", "Text A first segment.", 1, 12),
        ("a1", "Text A second segment.", 2, 40),
        ("b0", "Quick one.", 3, 3),
        ("c0", long_text, 4, 3),
    ):
        np.testing.assert_array_equal(
            codes(jobs[name]), solo(tts, text, seed=seed, max_frames=frames), err_msg=name
        )


def test_short_requests_keep_going_first_while_a_long_prompt_is_prefilled(tts, monkeypatch):
    """A long prompt let 8 short requests go first in all: the ninth waited for its whole
    prefill (seconds). Now each waits a part at most, and the long prompt keeps going."""
    monkeypatch.setattr(engine_mod, "PREFILL_PART_TOKENS", 16)
    monkeypatch.setattr(engine_mod, "MIN_PREFILL_PART_TOKENS", 16)
    long_text = " ".join(f"Sentence number {i} goes on a little." for i in range(40))
    solo(tts, "Quick one.", seed=1, max_frames=1)  # the voice's prefix cached
    made = {}

    def scenario() -> tuple[list[int], list[int]]:
        e = tts.engine
        e._part_tokens = 16
        made["long"] = long = job(tts, long_text, 0, False, seed=4, max_frames=2)
        e.submit(long)
        pump_while(e, lambda: e._prefilling is None)
        waits, left = [], []
        for i in range(12):
            made[i] = short = job(tts, "Quick one.", 0, False, seed=10 + i, max_frames=1)
            e.submit(short)
            waits.append(pump_while(e, lambda short=short: short in e._waiting))
            p = long._suspended or e._prefilling
            left.append(p.text.shape[1] if p is not None and p.job is long else 0)
        pump_while(e, lambda: e.busy)
        return waits, left

    waits, left = tts.call(scenario)
    assert max(waits) <= 2, waits
    assert left[-1] > 0 and left == sorted(left, reverse=True) and left[-1] < left[0], left
    np.testing.assert_array_equal(codes(made["long"]), solo(tts, long_text, seed=4, max_frames=2))
    for i in (0, 8, 11):
        np.testing.assert_array_equal(
            codes(made[i]), solo(tts, "Quick one.", seed=10 + i, max_frames=1), err_msg=str(i)
        )


def test_a_row_ending_at_this_frame_frees_its_slot_for_a_newcomer(tts):
    """A segment generated ahead was set aside for a newcomer although the row ending at
    that frame freed the slot it needed (a copy of its KV rows and a frame lost)."""

    def scenario() -> tuple[bool, bool]:
        e = tts.engine
        a0 = job(tts, "Text A first segment.", 0, False, seed=1, max_frames=10)
        a1 = job(tts, "Text A second segment.", 1, True, seed=2, max_frames=20)
        for j in (a0, a1):
            e.submit(j)
        pump_while(e, lambda: a0.seq.frames < 9)
        e.submit(job(tts, "Quick one.", 0, False, seed=3, max_frames=3))
        e.pump()  # a0's last frame, and the newcomer's prefill
        ended, parked = a0.seq.finished, a1 in e._parked
        pump_while(e, lambda: e.busy)
        return ended, parked

    ended, parked = tts.call(scenario)
    assert ended and not parked


def test_jobs_that_end_without_a_frame_let_go_of_their_kv_rows(tts, monkeypatch):
    """max_frames=0 (a pause-only segment, warmup's other voices) and a job cancelled as
    its prefill ended kept the whole prompt's KV cache for as long as the Job lived."""

    def scenario():
        e = tts.engine
        zero = job(tts, "A pause.", 0, False, seed=1, max_frames=0)
        e.submit(zero)
        pump_while(e, lambda: e.busy)
        cancelled = job(tts, "Cancelled as it joins.", 0, False, seed=2, max_frames=50)
        prefill = engine_mod.prefill

        def prefill_then_cancel(*args):
            prefill(*args)
            cancelled.cancel()

        monkeypatch.setattr(engine_mod, "prefill", prefill_then_cancel)
        e.submit(cancelled)
        pump_while(e, lambda: e.busy)
        return zero, cancelled

    for ended in tts.call(scenario):
        assert ended.done and ended.seq._cache is None and ended.seq._h is None


def test_jobs_that_ran_frames_let_go_of_their_kv_rows_and_codec_state(tts):
    """A job kept its codec stream state (conv tails, attention windows: MBs on the real
    codec) after its last chunk, for as long as the caller held the Job."""

    def scenario():
        e = tts.engine
        ended = job(tts, "Runs to its limit.", 0, False, seed=1, max_frames=3)
        cancelled = job(tts, "Cancelled after a frame.", 0, False, seed=2, max_frames=50)
        failed = job(tts, "Ended by a failure.", 0, False, seed=3, max_frames=50)
        for made in (ended, cancelled, failed):
            e.submit(made)
        pump_while(e, lambda: cancelled.seq.frames < 2 or failed.seq.frames < 2)
        assert cancelled._codec_state is not None  # the premise: it was decoding
        cancelled.cancel()
        pump_while(e, lambda: not (ended.done and cancelled.done))
        e.fail_all(RuntimeError("a failed frame"))
        return ended, cancelled, failed

    for made in tts.call(scenario):
        assert made.done
        assert made._codec_state is None and made.seq._cache is None and made.seq._h is None


def test_a_failure_as_a_prefilled_job_joins_reaches_its_consumer(tts, monkeypatch):
    """Between leaving the prefill and entering the engine's books a job was in no list:
    an error there (e.g. out of memory) left its consumer waiting for ever."""
    codec = tts.model.audio_tokenizer

    def out_of_memory(*_args, **_kwargs):
        raise MemoryError("out of memory (injected)")

    def scenario():
        e = tts.engine
        made = job(tts, "Some words.", 0, False, seed=1, max_frames=5)
        monkeypatch.setattr(codec, "new_state", out_of_memory)
        e.submit(made)
        e.pump()
        monkeypatch.undo()
        pump_while(e, lambda: e.busy)
        return made

    made = tts.call(scenario)
    assert made.done and isinstance(made.output.get_nowait(), MemoryError)


def test_warnings_as_errors_and_a_cache_that_cannot_be_written_fail_no_request(
    tiny_checkpoint_noend, tmp_path
):
    """Under ``-W error`` the prefix cache's warning was raised inside the frame, and every
    running request failed with it: a lost cache must cost only the cache."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    tts = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=blocker / "prefixes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            running = tts.stream("A long running request.", VOICE, seed=2, max_frames=30)
            first = next(running)
            other = tts.synthesize("A new voice.", "fr_female", seed=3, max_frames=5)
            rest = list(running)
        assert len(other.codes) == 5 and first.frames + sum(c.frames for c in rest) == 30
    finally:
        tts.close()
    with warnings.catch_warnings(record=True) as caught:  # otherwise it is still said
        warnings.simplefilter("always")
        tts = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=blocker / "prefixes")
        try:
            tts.synthesize("Hi.", VOICE, seed=1, max_frames=2)
        finally:
            tts.close()
    assert any(issubclass(w.category, PrefixCacheWarning) for w in caught)


def test_set_aside_jobs_rejoin_only_ahead_of_every_waiting_job():
    """A free slot during a prefill goes to a set-aside job only if no waiting job comes
    before it: otherwise that job would find the batch full when the prefill ends."""
    from types import SimpleNamespace

    class Batch:
        def __init__(self):
            self.added = []

        def live(self):
            return len(self.added)

        def add(self, seq):
            self.added.append(seq)

    def fake(name, segment, ahead=True, since=0.0):
        return SimpleNamespace(seq=name, segment=segment, ahead=ahead, waited_since=since)

    engine = engine_mod.Engine.__new__(engine_mod.Engine)
    engine._max_batch = 4
    engine._batch = Batch()
    engine._parked = [fake("later", 6), fake("needed", 9, ahead=False, since=1.0)]
    engine._waiting = [fake("earlier", 2)]
    engine._rejoin_parked(reserve=1)
    assert engine._batch.added == ["needed"]  # "later" would take the slot "earlier" needs
    assert [j.seq for j in engine._parked] == ["later"]
    engine._waiting = []
    engine._rejoin_parked(reserve=1)
    assert engine._batch.added == ["needed", "later"]


def test_grown_chunks_start_with_the_first_chunk_and_flush_when_the_job_is_needed(tts):
    """A job whose later chunks are 8 frames still sends its first chunk at its own size,
    and when its reader reaches it (needed()), what it generated ahead goes out at the
    next frame instead of waiting for the eighth."""

    def scenario():
        e = tts.engine
        ahead = job(tts, "Generated ahead of its reader.", 1, True, seed=1, max_frames=30)
        ahead.later_chunk_frames = 8
        e.submit(ahead)
        sizes = []

        def delivered() -> None:
            while not ahead.output.empty():
                item = ahead.output.get()
                if isinstance(item, engine_mod.AudioChunk) and item.frames:
                    sizes.append(item.frames)

        pump_while(e, lambda: ahead.seq.frames < 4)
        delivered()
        assert sizes == [1]  # the first chunk, then 3 frames held for the eighth
        ahead.needed()
        e.pump()
        delivered()
        pump_while(e, lambda: e.busy)
        delivered()
        return sizes

    # 1, then frames 2-4 and the one made as it was needed, then 8s, then the rest.
    assert tts.call(scenario) == [1, 4, 8, 8, 8, 1]


class _EndOnRows:
    """``model.frame`` whose semantic code is END, from the call after ``rows`` is set, for
    the rows in ``rows`` (indices into the batch): the others run on."""

    def __init__(self, model):
        self.original, self.rows = model.frame, None

    def __call__(self, h, noise, cfg):
        sem, all_codes = self.original(h, noise, cfg)
        if self.rows is not None:
            ends = mx.array([i in self.rows for i in range(h.shape[0])])
            sem = mx.where(ends, END_AUDIO, sem)
            all_codes = mx.concatenate([sem[:, None], all_codes[:, 1:]], axis=-1)
        return sem, all_codes


@pytest.mark.parametrize("ending_rows", [{0}, {1}, {0, 1}])
def test_end_stops_exactly_the_rows_that_say_it(tts, monkeypatch, ending_rows):
    """END is checked for every row of the batch, not only the first; a row that ends
    leaves the others running."""
    frame = _EndOnRows(tts.model)
    monkeypatch.setattr(tts.model, "frame", frame)

    def scenario():
        e = tts.engine
        jobs = [tts.job("Text number one.", VOICE, seed=s, max_frames=30) for s in (1, 2)]
        for j in jobs:
            j.claim()
            e.submit(j)
        pump_while(e, lambda: len(e._batch.rows) < 2)
        order = list(e._batch.rows)
        frame.rows = ending_rows
        e.pump()  # queues the frame that says END for those rows
        frame.rows = None
        pump_while(e, lambda: e.busy)
        return [next(j for j in jobs if j.seq is s) for s in order]

    for i, made in enumerate(tts.call(scenario)):
        assert made.done
        if i in ending_rows:
            assert made.seq.stop_reason == "end" and made.seq.frames < 30, (i, made.seq)
        else:
            assert made.seq.stop_reason == "max_frames" and made.seq.frames == 30, (i, made.seq)


def test_max_frames_0_makes_no_frame_when_the_voice_prefix_is_not_in_memory(tts):
    """A zero-frame job whose voice prefix must still be computed joins no batch either
    (warmup's zero-frame jobs rely on it)."""
    tts.clear_prefix_cache()
    speech = tts.synthesize("Text number one.", VOICE, seed=1, max_frames=0)
    assert len(speech.codes) == 0 and len(speech.audio) == 0
    tts.clear_prefix_cache()
    speech = tts.synthesize("Text number one.", VOICE, noise=np.zeros((0, 36), np.float32))
    assert len(speech.codes) == 0 and len(speech.audio) == 0


def test_one_frame_is_one_frame_when_the_voice_prefix_is_cached(tts):
    tts.synthesize("Hi.", VOICE, seed=1, max_frames=1)  # the voice's prefix cached
    speech = tts.synthesize("Hi.", VOICE, seed=2, max_frames=1)
    assert len(speech.codes) == 1 and speech.timings.prefix_cached


def fill_then_a_waited_job(tts, *parts: tuple[str, int, bool]) -> list:
    """Jobs of ``parts`` ((text, segment, ahead), seeds 1, 2, ...) fill the batch; then a
    short job someone waits for is submitted. Returns the filling jobs. On the worker."""
    e = tts.engine
    made = [
        job(tts, text, segment, ahead, seed=i + 1, max_frames=40)
        for i, (text, segment, ahead) in enumerate(parts)
    ]
    for j in made:
        e.submit(j)
    pump_while(e, lambda: len(e._batch.rows) < len(made))
    e.submit(job(tts, "Quick one.", 0, False, seed=len(made) + 1, max_frames=40))
    return made


def test_a_cancelled_set_aside_segment_ends_while_the_batch_is_full(tts):
    """A segment set aside for a newcomer and then cancelled ends at once, not when a slot
    frees for it to rejoin."""

    def scenario():
        e = tts.engine
        a0, a1 = fill_then_a_waited_job(
            tts, ("Text A first segment.", 0, False), ("Text A second segment.", 1, True)
        )
        pump_while(e, lambda: a1 not in e._parked)
        a1.cancel()
        pumps = pump_while(e, lambda: not a1.done)
        still_running = not a0.done
        pump_while(e, lambda: e.busy)
        return pumps, still_running, a1.seq.stop_reason

    pumps, still_running, reason = tts.call(scenario)
    assert pumps <= 2 and still_running and reason == "cancelled"


def test_a_cancel_stops_a_long_prefill_at_its_next_part(tts, monkeypatch):
    monkeypatch.setattr(engine_mod, "PREFILL_PART_TOKENS", 16)
    monkeypatch.setattr(engine_mod, "MIN_PREFILL_PART_TOKENS", 16)
    long_text = " ".join(f"Sentence number {i} goes on a little." for i in range(30))
    tts.synthesize("Quick one.", VOICE, seed=1, max_frames=1)  # the voice's prefix cached

    def scenario():
        e = tts.engine
        e._part_tokens = 16
        long = job(tts, long_text, 0, False, seed=4, max_frames=5)
        e.submit(long)
        pump_while(e, lambda: e._prefilling is None)
        long.cancel()
        pumps = pump_while(e, lambda: not long.done)
        pump_while(e, lambda: e.busy)
        return pumps, long.seq.frames

    assert tts.call(scenario) == (1, 0)


def test_the_segment_furthest_ahead_makes_room_for_a_waited_job(tts):
    def scenario():
        e = tts.engine
        _, a2 = fill_then_a_waited_job(
            tts, ("Text A second segment.", 1, True), ("Text A third segment.", 2, True)
        )
        pump_while(e, lambda: not e._parked)
        parked = list(e._parked)
        pump_while(e, lambda: e.busy)
        return parked, a2

    parked, a2 = tts.call(scenario)
    assert parked == [a2]


def test_the_prefix_cache_keeps_the_most_recently_used_voices(tts, monkeypatch):
    monkeypatch.setattr(tts.engine, "prefix_cache_voices", 2)
    tts.clear_prefix_cache()

    def hit(voice):
        return tts.synthesize("Hi.", voice, seed=1, max_frames=1).timings.prefix_cached

    assert [hit(v) for v in ("casual_male", "neutral_female", "casual_male")] == [
        False,
        False,
        True,
    ]
    assert not hit("cheerful_female")  # neutral_female, used least recently, goes
    assert hit("casual_male") and hit("cheerful_female")
    assert not hit("neutral_female")


def test_a_prefix_computed_across_a_clear_is_not_kept(tts):
    tts.clear_prefix_cache()

    def scenario():
        e = tts.engine
        made = job(tts, "Hi.", 0, False, seed=1, max_frames=2)
        e.submit(made)
        e.pump()  # the first of the prefix's parts
        assert e._prefilling is not None and e._prefilling.prefix is not None
        e.clear_prefix_cache()
        pump_while(e, lambda: e.busy)
        return made

    made = tts.call(scenario)
    assert made.done and not made.timings.prefix_cached
    assert not tts.synthesize("Hi.", VOICE, seed=1, max_frames=1).timings.prefix_cached


@pytest.mark.parametrize("voices_kept", [8, 0])
def test_a_waited_job_goes_on_with_a_prefix_a_set_aside_prefill_began(
    tts, monkeypatch, voices_kept
):
    """A segment generated ahead is computing its voice's prefix (several parts) when a job
    someone waits for, with the same voice, arrives: the newcomer takes the half-computed
    prefix over rather than start it again, and the other, resuming, starts from the
    finished one (kept in memory, or computed once more when none are kept): neither hears
    the other's prompt."""
    monkeypatch.setattr(tts.engine, "prefix_cache_voices", voices_kept)
    tts.clear_prefix_cache()

    def scenario():
        e = tts.engine
        a = job(tts, "Text A second segment.", 1, True, seed=2, max_frames=4)
        e.submit(a)
        e.pump()  # the first part of the voice's prefix
        begun = e._prefilling.prefix
        assert begun is not None and begun.embeds.shape[1] > 0  # parts to go
        b = job(tts, "Quick one.", 0, False, seed=3, max_frames=4)
        e.submit(b)
        e.pump()  # a's prefill is set aside for b
        taken = e._prefilling.job is b and e._prefilling.prefix is begun
        left_with_a = a._suspended.prefix
        pump_while(e, lambda: e.busy)
        return a, b, taken, left_with_a

    a, b, taken, left_with_a = tts.call(scenario)
    assert taken and left_with_a is None
    assert a.timings.prefix_cached == (voices_kept > 0)
    monkeypatch.setattr(tts.engine, "prefix_cache_voices", 8)
    for made, text, seed in ((a, "Text A second segment.", 2), (b, "Quick one.", 3)):
        np.testing.assert_array_equal(
            codes(made), solo(tts, text, seed=seed, max_frames=4), err_msg=text
        )


def test_a_job_whose_last_chunk_is_being_decoded_hears_of_a_failure(tts):
    """A job that has left the batch, its last chunk still decoding beside the next frame,
    gets the error of a failure then (or the model's closing) instead of waiting for ever."""

    def scenario():
        e = tts.engine
        short = job(tts, "Quick one.", 0, False, seed=1, max_frames=3)
        other = job(tts, "Text A first segment.", 0, False, seed=2, max_frames=40)
        for j in (short, other):
            e.submit(j)
        pump_while(e, lambda: not any(r[0] is short and r[3] for r in e._inflight))
        assert not short.done
        e.fail_all(RuntimeError("the frame failed"))
        return short, other

    for made in tts.call(scenario):
        items = []
        while not made.output.empty():
            items.append(made.output.get())
        assert made.done and isinstance(items[-1], RuntimeError), items[-1:]
        assert str(items[-1]) == "the frame failed"


def test_a_reply_that_ends_at_once_reports_no_first_audio(tts, monkeypatch):
    """END as the first frame: no audio, so no time to first audio (0), not the time of
    the empty last chunk."""
    frame = _EndOnRows(tts.model)
    frame.rows = {0}
    monkeypatch.setattr(tts.model, "frame", frame)
    speech = tts.synthesize("Hi.", VOICE, seed=1, max_frames=10)
    assert len(speech.codes) == 0 and len(speech.audio) == 0
    assert speech.timings.first_audio_s == 0.0 and speech.timings.total_s > 0
