"""Stand-ins for the audio player that ``say()`` drives (the tests have no sound card)."""

from __future__ import annotations


class NullPlayer:
    """Takes every chunk and drops it; finishes at once."""

    def feed(self, audio, **_) -> None:
        pass

    def finish(self) -> None:
        pass

    def stop(self) -> None:
        pass
