"""How many frames a player-fed stream decodes at a time once playback has started.

The codec reads all its weights and launches its whole step once per decoded chunk, so
one-frame chunks (what first audio needs) cost the most per frame: on a Mac the codec is
~6-9 % of what a quantized frame reads (``benchmarks/weights_per_frame.py``), here on the
CPU ~1.5 of a tiny frame's ~7 ms. Once the player holds audio ahead of what it is playing,
chunks can grow without a gap: a chunk of ``n`` frames arrives ``n`` frame times after the
previous one, which the buffer covers with a margin.
"""

from __future__ import annotations

import math
from typing import Any

LIVE_CHUNK_FRAMES = (1, 2, 4, 8)  # few sizes: each is one more compiled codec graph
# The buffer must hold this many times a chunk's arrival time: chunks arrive in bursts
# and generation speed varies (another stream joins the batch, a long prefill).
MARGIN = 3.0


def live_chunk_frames(buffered_s: float, speed: float | None, started: bool, frame_s: float) -> int:
    """Frames per chunk for the next chunk of a stream a player is fed with.

    ``buffered_s``: audio queued in the player and not yet played; ``speed``: audio
    seconds generated per wall second (None: not measured yet); ``started``: whether the
    player is playing (before that, chunks of one frame reach its pre-roll soonest);
    ``frame_s``: audio seconds per frame.
    """
    if not started or speed is None or not speed > 0 or not math.isfinite(buffered_s):
        return 1
    wall_per_frame = frame_s / speed if math.isfinite(speed) else 0.0
    best = 1
    for n in LIVE_CHUNK_FRAMES:
        if MARGIN * (n + 1) * wall_per_frame <= buffered_s:
            best = n
    return best


def follow_player(stream: Any, player: Any, frame_s: float) -> None:
    """Size ``stream``'s next chunks (``set_chunk_frames``) by what ``player`` (an
    :class:`~voxtral_mlx.audio.player.AudioPlayer`, just fed) holds ahead. A player that
    does not say (a stand-in with ``feed`` alone) keeps one-frame chunks."""
    speed = getattr(player, "generation_speed", None)
    if not callable(speed) or not hasattr(player, "buffered_s"):
        return
    stream.set_chunk_frames(
        live_chunk_frames(
            player.buffered_s, speed(), bool(getattr(player, "started", False)), frame_s
        )
    )
