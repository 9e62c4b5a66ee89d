"""A long prompt sent without ``split=True``: prefilled in parts vs in one pass.

The engine prefills a prompt's text in parts, one per frame step, each sized to take about
as long as a frame (16 to ``PREFILL_PART_TOKENS`` tokens), so that ``cancel()`` lands
within one part and the streams already running get a frame between parts. This measures
what that costs and what it buys, on the same model in one run (``--fixed N`` adds parts
of a fixed N tokens, as before the sizing):

* time to first audio of the long request alone (parts vs one pass);
* the longest wait between two chunks of a stream that is already running while the long
  request is prefilled (the stall a listener would hear without pre-roll);
* how long ``cancel()`` takes to end the long request when it comes during its prefill;
* the first audio of a short request made during the long prefill: it goes first
  (``MAX_OVERTAKES``), against waiting its turn (overtaking off) and against one pass.

    python benchmarks/long_prompt.py [--configs tiny,CHECKPOINT_DIR] [--tokens 1000,2000]
                                     [--fixed 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
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


def long_text(tts, tokens: int) -> str:
    """A text of about ``tokens`` text tokens."""
    words, text = 0, ""
    while len(tts.tokenizer.encode(text)) < tokens:
        words += 20
        text = " ".join(f"word{i % 97}," if i % 9 else f"Sentence {i}." for i in range(words))
    return text


def ttfa(tts, text: str, voice: str) -> float:
    t0 = time.perf_counter()
    stream = tts.stream(text, voice, seed=0, max_frames=1)
    next(stream)
    dt = time.perf_counter() - t0
    stream.close()
    return dt


def stall(tts, text: str, voice: str) -> float:
    """The longest gap between chunks of a running stream while ``text`` is prefilled."""
    return longest_gap(tts, voice, lambda: tts.synthesize(text, voice, seed=0, max_frames=1))


def short_first_audio(tts, text: str, voice: str, part_s: float) -> float:
    """First audio of a short request made a third of the way into the long prefill."""
    long = tts.stream(text, voice, seed=0, max_frames=1)
    consumer = threading.Thread(target=lambda: list(long))
    consumer.start()
    time.sleep(part_s)
    dt = ttfa(tts, "Speak now.", voice)
    consumer.join()
    return dt


def set_parts(engine, mode: str, defaults: tuple[int, int]) -> None:
    """Sized parts ("parts", the engine's way), one pass ("one"), or fixed N-token parts."""
    sizes = {"parts": defaults, "one": (ONE_PASS, ONE_PASS)}
    low, high = sizes[mode] if mode in sizes else (int(mode), int(mode))
    engine.MIN_PREFILL_PART_TOKENS, engine.PREFILL_PART_TOKENS = low, high


def measure(name: str, tokens: int, repeats: int, fixed: int | None) -> dict[str, float]:
    import voxtral_mlx
    import voxtral_mlx.engine as engine

    path = resolve(name, CONFIGS)
    voice = pick_voice(path)
    tts = voxtral_mlx.load(path)
    suppress_end(tts)
    text = long_text(tts, tokens)
    tts.synthesize("Warm up.", voice, seed=0, max_frames=2)
    out: dict[str, float] = {"tokens": len(tts.tokenizer.encode(text))}
    defaults = engine.MIN_PREFILL_PART_TOKENS, engine.PREFILL_PART_TOKENS
    modes = ["parts", "one"] + ([] if fixed is None else [str(fixed)])
    for key in modes:
        set_parts(engine, key, defaults)
        out[f"ttfa_{key}"] = statistics.median(ttfa(tts, text, voice) for _ in range(repeats))
        out[f"stall_{key}"] = statistics.median(stall(tts, text, voice) for _ in range(repeats))
        third = out[f"ttfa_{key}"] / 3
        out[f"cancel_{key}"] = statistics.median(  # sent a third of the way in
            cancel_latency(tts.stream(text, voice, seed=0, max_frames=1), third)
            for _ in range(repeats)
        )
        out[f"short_{key}"] = statistics.median(
            short_first_audio(tts, text, voice, third) for _ in range(repeats)
        )
    engine.MIN_PREFILL_PART_TOKENS, engine.PREFILL_PART_TOKENS = defaults
    overtakes, engine.MAX_OVERTAKES = engine.MAX_OVERTAKES, 0
    third = out["ttfa_parts"] / 3
    out["short_waits"] = statistics.median(
        short_first_audio(tts, text, voice, third) for _ in range(repeats)
    )
    engine.MAX_OVERTAKES = overtakes
    tts.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny")
    parser.add_argument("--tokens", default="1000,2000", help="text tokens of the long prompt")
    parser.add_argument("--repeats", type=at_least_one, default=5)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--fixed", type=at_least_one, help="also measure fixed parts of N tokens")
    args = parser.parse_args(argv)
    fixed = [] if args.fixed is None else [str(args.fixed)]
    header = ["config", "text tokens"]
    keys = []
    for what, key in (
        ("first audio", "ttfa"),
        ("running stream's longest gap", "stall"),
        ("cancel during prefill", "cancel"),
        ("short request during it: first audio", "short"),
    ):
        for mode in ["parts", "one", *fixed]:
            how = {"parts": "sized parts", "one": "one pass"}.get(mode, f"{mode}-token parts")
            header.append(f"{what}, {how}")
            keys.append(f"{key}_{mode}")
        if key == "short":
            header.append(f"{what}, waiting its turn")
            keys.append("short_waits")
    rows = [tuple(header)]
    for name in config_list(args.configs):
        for tokens in (int(t) for t in args.tokens.split(",")):
            m = measure(name, tokens, args.repeats, args.fixed)
            rows.append(
                (label(name), str(int(m["tokens"])), *(f"{1000 * m[k]:.0f} ms" for k in keys))
            )
            show_row(rows)
    if not args.no_record:
        print(
            record(
                "Long prompt without split: prefill in parts vs one pass",
                command_line(__file__, argv or sys.argv[1:]),
                rows,
                "Medians. The running stream's gap is the longest time between two of its "
                "chunks while the long request is prefilled; cancel is sent a third of the "
                "way into the prefill and timed until the stream ends; the short request "
                "too is made a third of the way in ('waiting its turn': with overtaking "
                "off, as before it existed).",
                runs=args.repeats,
            )
        )
    return 0


if __name__ == "__main__":
    run_script(main)
