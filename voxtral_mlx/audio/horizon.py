"""How long the player's pre-roll should plan for: the ``expected_total_s`` it is fed with
each chunk of a (possibly split) text, guessed from the text and refined as audio arrives."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine import AudioChunk
    from ..textstream import TextStream
    from ..tts import VoxtralTTS

SECONDS_PER_TEXT_TOKEN = 0.3  # rough speaking rate, only a hint for the player's pre-roll
# Segments tokenized up front; the rest are guessed from their length in characters at the
# tokens per character of these, and tokenized when they start playing (a book's 100,000
# words took 0.26 s to tokenize before its first chunk could play).
TOKENIZED_AHEAD = 32


def plays(chunk: AudioChunk) -> bool:
    """Whether a chunk goes to a player fed with the horizon: audio, or a segment's end even
    when empty (END had a frame of its own), which tells live text's horizon that nothing
    more is on its way yet."""
    return bool(len(chunk.audio)) or chunk.ends_segment


class PlaybackHorizon:
    """The length the player's pre-roll plans for (its ``expected_total_s``), per chunk.

    Lengths are guessed from the text (``SECONDS_PER_TEXT_TOKEN``, at most ``max_frames``
    per segment). One utterance: its expected length. A split text whose later segments
    are generated beside the one being heard, faster than real time overall: only that
    segment's own arrival rate can starve playback (the ones after it arrive in a burst
    when it ends), so the horizon is the audio fed so far plus what that segment still has
    to come. Planning for the whole text at the first segment's rate kept a chapter silent
    until nearly all of it was generated.
    """

    def __init__(
        self,
        tts: VoxtralTTS,
        stream: TextStream,
        max_frames: int,
        pause: float | None,
        started: float,
    ):
        self.tts, self.stream, self.started = tts, stream, started
        self._cap = max_frames * tts.samples_per_frame / tts.sample_rate
        self._segment = -1
        self._segment_fed = 0.0
        self._fed = 0.0
        self._pause = pause
        # Text still arriving (``stream.live``): nothing is known beyond the segment playing,
        # so the horizon is the audio fed plus what that segment still has to come (once it
        # has ended: the next segment, if one was cut already).
        self.live = bool(getattr(stream, "live", False))
        self.segment_s: list[float] = []
        self.total_s: float | None = None
        # The latest chunk's: False where live text has no more audio on its way yet (its
        # segment ended and none is cut after it): a gap then is the text waiting, not slow
        # generation (AudioPlayer.feed's ``more_coming``).
        self.more_coming = True
        if self.live:
            return
        segments, head = stream.segments, stream.segments[:TOKENIZED_AHEAD]
        tokens = [len(tts.tokenizer.encode(seg.spoken)) for seg in head]
        per_char = sum(tokens) / max(1, sum(len(seg.spoken) for seg in head))
        self.segment_s = [self._seconds(n) for n in tokens] + [
            self._seconds(len(seg.spoken) * per_char) for seg in segments[TOKENIZED_AHEAD:]
        ]
        from ..textstream import planned_pauses

        pauses = planned_pauses(segments, pause)
        self.total_s = max(1.0, sum(self.segment_s) + sum(p or 0.0 for p in pauses))

    def _seconds(self, tokens: float) -> float:
        return min(self._cap, tokens * SECONDS_PER_TEXT_TOKEN)

    def _guess_up_to(self, segment: int) -> None:
        """Guess the lengths of live text's segments up to ``segment`` (cut as it came)."""
        while len(self.segment_s) <= segment:
            spoken = self.stream.segments[len(self.segment_s)].spoken
            self.segment_s.append(self._seconds(len(self.tts.tokenizer.encode(spoken))))

    def __call__(self, chunk: AudioChunk, now: float | None = None) -> float:
        seconds = len(chunk.audio) / self.tts.sample_rate
        self._fed += seconds
        if chunk.segment != self._segment:
            self._segment, self._segment_fed = chunk.segment, 0.0
            self._guess_up_to(chunk.segment)
            if chunk.segment >= TOKENIZED_AHEAD and not self.live:  # a guess until now
                spoken = self.stream.segments[chunk.segment].spoken
                self.segment_s[chunk.segment] = self._seconds(
                    len(self.tts.tokenizer.encode(spoken))
                )
        self._segment_fed += seconds
        self.more_coming = True
        if self.live and chunk.ends_segment:
            # Its segment is over, before its guess or not: what follows is the next segment
            # if it was cut already, else nothing yet, and what came must play meanwhile.
            nxt = chunk.segment + 1
            if nxt >= len(self.stream.segments):
                self.more_coming = False
                return self._fed
            self._guess_up_to(nxt)
            pause = self.stream.segments[chunk.segment].pause_after
            return self._fed + (pause if self._pause is None else self._pause) + self.segment_s[nxt]
        elapsed = (time.monotonic() if now is None else now) - self.started
        generated = self.stream.timings.audio_s + self.stream.ahead_s
        if self.total_s is not None and (
            len(self.segment_s) == 1 or elapsed <= 0 or generated < elapsed
        ):
            return self.total_s
        return self._fed + max(0.0, self.segment_s[self._segment] - self._segment_fed)
