"""An answer still being written (an LLM's tokens): first audio with live text vs after it all.

An answer of a few sentences is given a token (~4 characters) at a time at ``--rate`` tokens
per second, as an LLM client's stream would. Live (``stream(pieces, split=True)``, what
``speak --follow`` does): the first sentence is spoken once the word after it arrives.
Waiting for the whole answer, then ``stream(text, split=True)`` (what ``speak`` does with a
pipe without ``--follow``): the first audio follows the answer's end. Also shown: the time
from the moment the first sentence is sure (its next word given) to its first audio.

    python benchmarks/live_text.py [--configs tiny,CHECKPOINT_DIR] [--repeats 5] [--rate 30]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time

from common import (
    TINY_AND_WIDE,
    at_least_one,
    command_line,
    config_list,
    label,
    pick_voice,
    record,
    resolve,
    run_script,
    show_row,
    suppress_end,
)

CONFIGS = TINY_AND_WIDE
ANSWER = (
    "Sure, here is a short answer. The weather tomorrow looks mild, with a light breeze "
    "from the west and a few clouds in the afternoon. Temperatures should stay between "
    "twelve and eighteen degrees. If you plan to walk, take a light jacket for the evening. "
    "Rain is unlikely before the weekend, when a colder front arrives from the north."
)
TOKENS = re.findall(r"\S{1,4}|\s+\S{0,3}", ANSWER)  # ~4 characters each, spaces kept
FIRST_SURE = ANSWER.index("The weather") + len("The ")  # the first sentence's next word


def tokens_at(rate: float, marks: dict[str, float]):
    """The answer's tokens at ``rate`` per second; ``marks`` gets when it began, when the
    first sentence became sure and when it ended."""
    given = 0
    marks["start"] = time.perf_counter()
    for i, token in enumerate(TOKENS):
        time.sleep(max(0.0, marks["start"] + i / rate - time.perf_counter()))
        yield token
        given += len(token)
        if given >= FIRST_SURE and "sure" not in marks:
            marks["sure"] = time.perf_counter()
    marks["end"] = time.perf_counter()


def live_run(tts, voice: str, seed: int, rate: float, max_frames: int) -> dict[str, float]:
    marks: dict[str, float] = {}
    with tts.stream(
        tokens_at(rate, marks), voice, seed=seed, split=True, max_frames=max_frames
    ) as stream:
        next(stream)
        first = time.perf_counter()
    return {"live": first - marks["start"], "after_sure": first - marks["sure"]}


def whole_run(tts, voice: str, seed: int, rate: float, max_frames: int) -> float:
    marks: dict[str, float] = {}
    text = "".join(tokens_at(rate, marks))
    with tts.stream(text, voice, seed=seed, split=True, max_frames=max_frames) as stream:
        next(stream)
        return time.perf_counter() - marks["start"]


def measure(name: str, repeats: int, rate: float) -> dict[str, float]:
    import voxtral_mlx

    path = resolve(name, CONFIGS)
    voice = pick_voice(path)
    tts = voxtral_mlx.load(path)
    suppress_end(tts)
    tts.warmup(voice)
    live, sure, whole = [], [], []
    for seed in range(repeats):  # interleaved: the machine's drift hits both alike
        m = live_run(tts, voice, seed, rate, max_frames=4)
        live.append(m["live"])
        sure.append(m["after_sure"])
        whole.append(whole_run(tts, voice, seed, rate, max_frames=4))
    tts.close()
    return {
        "answer": len(TOKENS) / rate,
        "live": statistics.median(live),
        "sure": statistics.median(sure),
        "whole": statistics.median(whole),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny")
    parser.add_argument("--repeats", type=at_least_one, default=5)
    parser.add_argument("--rate", type=float, default=30.0, help="tokens per second")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    rows = [
        (
            "config",
            f"answer written in ({len(TOKENS)} tokens at {args.rate:g}/s)",
            "first audio, live text",
            "of it, after the first sentence is sure",
            "first audio after the whole answer",
            "live / whole",
        )
    ]
    for name in config_list(args.configs):
        m = measure(name, args.repeats, args.rate)
        rows.append(
            (
                label(name),
                f"{m['answer']:.2f} s",
                f"{1000 * m['live']:.0f} ms",
                f"{1000 * m['sure']:.0f} ms",
                f"{1000 * m['whole']:.0f} ms",
                f"{m['live'] / m['whole']:.3f}",
            )
        )
        show_row(rows)
    if not args.no_record:
        command = command_line(__file__, argv or sys.argv[1:])
        print(
            record("First audio of an answer still being written", command, rows, runs=args.repeats)
        )
    return 0


if __name__ == "__main__":
    run_script(main)
