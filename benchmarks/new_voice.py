"""A voice not used before: its prompt prefix prefilled in parts vs in one pass.

A voice's prefix (``[BOS, BEGIN_AUDIO, voice rows..., NEXT_AUDIO_TEXT]``, 70 to 221
positions for the released voices) is prefilled once and cached; the first request with a
voice pays for it. The engine runs it in parts of ``PREFIX_PART_TOKENS`` (64), one per
frame step, so that the streams already running keep getting frames and ``cancel()`` lands
within a part. Measured on the same model in one run, parts against one pass:

* time to first audio of a short request with the new voice on an idle engine;
* the longest wait between two chunks of a stream already running (another voice) while
  the new voice's request starts (the stall a listener would hear without pre-roll);
* how long ``cancel()`` takes to end that request when it comes during the prefix.

    python benchmarks/new_voice.py [--configs tiny,wide,CHECKPOINT_DIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import (
    TINY_AND_WIDE,
    at_least_one,
    cancel_latency,
    command_line,
    config_list,
    label,
    longest_gap,
    pick_voice,
    record,
    resolve,
    run_script,
    show_row,
    suppress_end,
)

CONFIGS = TINY_AND_WIDE
ONE_PASS = 10**9
SHORT = "A new voice."


def forget(tts, voice: str) -> None:
    """Drop ``voice``'s cached prefix (the model is loaded without a disk cache)."""
    prefixes = tts.engine._prefixes
    tts.call(lambda: [prefixes.pop(k) for k in list(prefixes) if k[0] == voice])


def ttfa(tts, voice: str) -> float:
    forget(tts, voice)
    t0 = time.perf_counter()
    with tts.stream(SHORT, voice, seed=0, max_frames=1) as stream:
        next(stream)
        return time.perf_counter() - t0


def stall(tts, voice: str, other: str) -> float:
    """The longest gap between chunks of a running stream (``other``) while ``voice``
    starts."""
    forget(tts, voice)
    return longest_gap(tts, other, lambda: tts.synthesize(SHORT, voice, seed=0, max_frames=1))


def cancel(tts, voice: str, delay_s: float) -> float:
    """From cancel() (sent ``delay_s`` after the request) to the stream's end."""
    forget(tts, voice)
    return cancel_latency(tts.stream(SHORT, voice, seed=0, max_frames=1), delay_s)


def measure(name: str, repeats: int) -> dict[str, float]:
    import voxtral_mlx
    import voxtral_mlx.engine as engine

    path = resolve(name, CONFIGS)
    other = pick_voice(path)
    tts = voxtral_mlx.load(path, prefix_cache_dir=None)
    voice = max(tts.voices, key=lambda v: len(tts.prompt_ids("", v)))  # the longest prefix
    suppress_end(tts)
    tts.synthesize("Warm up.", other, seed=0, max_frames=2)
    tts.synthesize("Warm up.", voice, seed=0, max_frames=2)
    out: dict[str, float] = {"positions": len(tts.prompt_ids("", voice)) - 2}
    default = engine.PREFIX_PART_TOKENS
    for key, part in (("parts", default), ("one", ONE_PASS)):
        engine.PREFIX_PART_TOKENS = part
        out[f"ttfa_{key}"] = statistics.median(ttfa(tts, voice) for _ in range(repeats))
        out[f"stall_{key}"] = statistics.median(stall(tts, voice, other) for _ in range(repeats))
        third = out[f"ttfa_{key}"] / 3
        out[f"cancel_{key}"] = statistics.median(cancel(tts, voice, third) for _ in range(repeats))
    engine.PREFIX_PART_TOKENS = default
    tts.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny")
    parser.add_argument("--repeats", type=at_least_one, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    header = ["config", "prefix positions"]
    keys = []
    for what, key in (
        ("first audio", "ttfa"),
        ("running stream's longest gap", "stall"),
        ("cancel during the prefix", "cancel"),
    ):
        for mode, how in (("parts", "64-position parts"), ("one", "one pass")):
            header.append(f"{what}, {how}")
            keys.append(f"{key}_{mode}")
    rows = [tuple(header)]
    for name in config_list(args.configs):
        m = measure(name, args.repeats)
        rows.append(
            (label(name), str(int(m["positions"])), *(f"{1000 * m[k]:.0f} ms" for k in keys))
        )
        show_row(rows)
    if not args.no_record:
        print(
            record(
                "A new voice: its prefix prefilled in parts vs one pass",
                command_line(__file__, argv or sys.argv[1:]),
                rows,
                "Medians. A short request with the voice of the longest prefix, its cached "
                "prefix dropped before each run (no disk cache). The running stream (another "
                "voice) is timed between its chunks while that request starts; cancel is "
                "sent a third of the way into its first audio and timed until it ends.",
                runs=args.repeats,
            )
        )
    return 0


if __name__ == "__main__":
    run_script(main)
