"""Split long text into segments that one generation handles well.

Each segment is synthesized on its own and the audio joined with ``pause_after`` seconds of
silence. Split points, best first:

* paragraph: a blank line (or form feed / U+2029) - always a split;
* sentence (HARD): ``. ! ? …`` ``。！？`` ``؟ ۔`` ``। ॥`` (and a few other scripts' stops);
* clause (MID): ``, ; :`` ``，；：、`` ``، ؛``, dashes (em/en, spaced hyphen, ``--``), a single
  line break;
* word (WEAK): any other space;
* cut: no usable split within ``max_chars``; cut at ``max_chars``, outside grapheme clusters and
  protected spans when possible.

No split ever falls inside a number (up to eight digit groups one space apart read as one:
"1 000 000", "+1 (555) 123-4567", "3 1/2"), URL or e-mail address, between a title-like
abbreviation ("Mr.", "e.g.", "z.B."), an initial or a line-start list marker ("1.") and the
next word, inside a spaced ellipsis (". . ."), or after an ellipsis followed by a lowercase
word. Any other period ends a sentence only when the next word is not lowercase: "etc. and"
continues, "Apple Inc. The" ends; after a number of up to three digits it may be an ordinal
("am 3. Mai") and counts as a word split. A "!" or "?" before a lowercase word is a word
split too ('"Why?" she asked').
"""

from __future__ import annotations

import heapq
import numbers
import re
import unicodedata
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .errors import InputError
from .fileio import one_line

PARAGRAPH, SENTENCE, CLAUSE, WORD, CUT = "paragraph", "sentence", "clause", "word", "cut"

# Seconds of silence natural after a segment, by how it ended (the last segment gets 0.0).
PAUSE_AFTER: dict[str, float] = {
    PARAGRAPH: 0.75,
    SENTENCE: 0.4,
    CLAUSE: 0.2,
    WORD: 0.1,
    CUT: 0.0,
}

TERMINALS = frozenset(".!?…‼⁇⁈⁉‽。！？｡．؟۔।॥։።፧။។៕།\u037e")  # U+037E: Greek question mark
# Sentence ends of cased scripts other than the period (which has rules of its own).
_CASED_TERMINALS = frozenset("!?‼⁇⁈⁉‽")
# Sentence ends that end a sentence with no space after them (CJK, Burmese and Khmer put
# none; Arabic and Devanagari text usually does, but "؟" and "।" are unambiguous when it
# does not).
_NO_SPACE_HARD = frozenset("。！？｡．؟۔।॥။។៕")
_MID = frozenset(",;:，；：、､،؛")
_DASHES = frozenset("—–―")
_CLOSERS = frozenset("\"'”’»›)]}」』）】〕〉》〗〙〛＂＇")
_OPENERS = frozenset("\"'“‘„«‹([{「『（【〔〈《〖〘〚¿¡")
# Openers elsewhere, closers in German and Danish quoting („so.“ ‚so.‘ »so.«): counted as
# closers only after the end of a token (never in CJK text, where “ opens a quote).
_LOW_CLOSERS = _CLOSERS | frozenset("“‘«")
_INNER_SPACES = frozenset(" \xa0\u202f\u2009")
_LINE_ENDS = frozenset("\n\r\x0b\x0c\x85\u2028\u2029")
_ATTACHED = TERMINALS | _MID | _CLOSERS  # belong to the word before them
_MARKS = _ATTACHED | _OPENERS | _DASHES | frozenset("-")

# A period after these never ends a sentence: they precede what they qualify.
# Missing a sentence end costs little (the model reads it within the segment); splitting
# inside a phrase costs a pause in the middle of it: the lists err on the side of words.
_TITLES_BY_LANGUAGE = {
    "en": "mr mrs ms mx dr prof st mt rev fr sr jr vs e.g i.e cf approx fig vol ch pp ca "
    "gen col capt lt sgt cpl pvt maj cmdr adm gov sen rep pres supt insp det hon atty msgr messrs "
    "dept univ",
    "fr": "mme mlle mgr ste p.ex c.-à-d mm av apr éd",
    "de": "z.b bzw d.h vgl ggf sog inkl evtl bspw hr hrn abs bd u.a z.t v.a i.d.r u.u o.g geb "
    "verh med dipl dipl.-ing fa zzgl mio mrd",
    "es": "sra srta dra excmo excma mtro mtra ud uds vd dña p.ej pág ee lic arq gral sta sto "
    "avda cía",
    "it": "sig sigg dott ing avv p.es spett gent egr geom rag",
    "pt": "exmo exma profa eng séc exa srs",
    "nl": "dhr mevr mw bijv d.w.z m.b.t t.a.v o.a drs ir i.v.m i.p.v m.a.w t.o.v n.a.v incl "
    "excl evt resp zgn",
    "ar": "أ.د",
    "hi": "डॉ प्रो रु ई.पू कि.मी नं सं पृ",
}
_TITLES = frozenset(w + "." for words in _TITLES_BY_LANGUAGE.values() for w in words.split())
# ... only when a number follows ("No. 5", "Jan. 3"; but "No. Thanks." ends a sentence).
_BEFORE_NUMBERS = (
    "no nos nr núm art sec para eq eqs jan feb mar apr jun jul aug sep sept oct nov dec ext "
    "tel págs pag blz kap abb tab chap env aprox janv févr avr juil déc okt dez mrz febr ene abr "
    "ago dic ott febbr giu lug sett fev set out mrt"
)
_NUMBER_ABBREVIATIONS = frozenset(w + "." for w in _BEFORE_NUMBERS.split())

_WS = re.compile(r"\s+")
_SHORT_ABBREVIATION = re.compile(r"[^\W\d_]{1,2}\.(?!\S)")
# Letters each with a period ("U.S.", "a.m."): before a name they usually qualify it ("the
# U.S. Army", "5 p.m. Eastern"), before one of these words they end a sentence ("in the
# U.S. The"). Such initialisms are mostly English.
_INITIALISM = re.compile(r"(?:[^\W\d_]\.){2,}")
_STARTERS = (
    "the a an this that these those it its he she we they i you there then but and so yet "
    "or if when while after before as in on at for from by with to his her our their my "
    "your what who how why where however still now later today please is are was were do "
    "does did can could will would should let here yes no one maybe many most some all "
    "every each both nobody everyone everybody nothing everything last next first"
)
_SENTENCE_STARTERS = frozenset(_STARTERS.split())
_LINE_BREAK = re.compile(r"\r\n|[\n\r\x0b\x85\u2028]")
_PARAGRAPH_SEPARATORS = frozenset("\x0c\x1c\x1d\x1e\u2029")
_NO_BREAK_SPACES = "\xa0\u2007\u202f"
# What a URL runs on through: not CJK text or full-width punctuation, which follow a URL
# with no space between ("请访问https://example.com了解详情。"), nor a danda or Arabic
# punctuation, which no URL holds unescaped.
_URL_BODY = (
    r"[^\s<>\"।॥؟،۔\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af"
    r"\uf900-\ufaff\ufe30-\ufe4f\uff00-\uffef]+"
)
# A URL whose host is written in CJK ("http://例子.公司/页面"): it runs on through CJK text,
# up to a space or full-width punctuation.
_IDN_URL_BODY = (
    r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]"
    r"[^\s<>\"।॥؟،۔\u3000-\u303f\ufe30-\ufe4f\uff00-\uffef]*"
)
# What joins the digits of one number: "3.14", "2024-01-05", "10:30", "1/2", "10--20"; full-width
# separators too: "1，000", "3：30".
_DIGIT_JOINER = r"(?:--|[.,:/\-–—―٫٬，．：])"
_SEPARATED_DIGITS = r"\d+(?:" + _DIGIT_JOINER + r"\d+)+"
_DIGIT_GROUP = r"(?:\(\d+\)|\d+(?:" + _DIGIT_JOINER + r"\d+)*)"
# A number beside a currency or percent sign, its thousands perhaps grouped with spaces.
_SIGNED_NUMBER = r"(?:\d{1,3}(?: \d{3})+(?!\d)|\d+)(?:[.,]\d+)*"
# Digit groups one space apart, read as one number: thousands ("1 000 000"), a phone or card
# number ("+1 (555) 123-4567", "4111 1111 1111 1111"), a mixed fraction ("3 1/2"); at most
# eight groups, so that a long list of numbers still has places to split.
_SPACED_NUMBER = r"(?<![\w.,+])\+?" + _DIGIT_GROUP + r"(?: " + _DIGIT_GROUP + r"){1,7}"
# The lookbehinds make each pattern start only at the beginning of a run: linear time on long
# unbroken input. The first alternative matching at a place wins.
_PROTECTED = re.compile(
    "|".join(
        [
            # A URL (a scheme, or "www." alone) and its body; a host written in CJK may
            # follow "www." too ("https://www.例子.中国"). `re` compiles a class code point
            # by code point, and these span tens of thousands: one body serves both starts,
            # and letters are spelled in both cases rather than under IGNORECASE, which
            # case-folds each code point (importing this module took twice as long).
            r"(?:(?<![a-zA-Z0-9+.\-])[a-zA-Z][a-zA-Z0-9+.\-]*://(?:[wW]{3}\.)?"
            r"|(?<![\w.])[wW]{3}\.)"
            r"(?:" + _IDN_URL_BODY + "|" + _URL_BODY + ")",
            r"(?<![\w.+\-])[\w.+\-]+@[\w\-]+(?:\.[\w\-]+)+",
            # a number and its percent or currency sign, spaced as French and German write
            # them: "3,5 %", "5 €", "€ 5", "R$ 1.500,00", "1 000 €"
            r"(?<![\d.,])" + _SIGNED_NUMBER + r" [%‰€$£¥₹](?!\w)",
            r"(?<![€$£¥₹])[€$£¥₹] " + _SIGNED_NUMBER,
            _SPACED_NUMBER,
            r"(?<!\d)" + _SEPARATED_DIGITS,
            r"(?<![\d.,])\d{1,2}, (?:1\d|20)\d\d(?!\d)",  # a day and its year: "May 3, 2024"
        ]
    )
)
# Whitespace no protected span holds (a space before a digit or a parenthesis may be inside
# "1 000 000" or "+1 (555) 123-4567", one before a percent or currency sign inside "5 %"):
# the text is scanned in pieces ending there, as one scan of a long text in one C call
# holds the GIL (160 ms for 100,000 words) and with it an event loop or a UI thread.
_SCAN_BREAK = re.compile(r"[^\S ]| (?![\d(%‰€$£¥₹])")
_SCAN_CHARS = 4096
_STOP_EVERY = 4096  # units of work (about one per word) between two calls of ``stop``
_TRAILING_PUNCT = ".,;:!?'\")]}»”’"
_CJK = r"\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
# ... and "." "!" "?" typed between two CJK characters ("晴れです.明日は"): a sentence end
# (not "...": a pause inside one).
_CJK_CHAR = re.compile(f"[{_CJK}]")
_NO_SPACE_BREAK = re.compile(
    r"(?:[。！？｡．؟۔।॥။។៕，；：、､—―]|--)+" rf"|(?<=[{_CJK}])(?:[!?]+|\.)(?=[{_CJK}])"
)

# Appended period by the script of the last letter; default ".". Arabic-script text uses the
# Latin "." in Arabic and Persian, and U+06D4 in Urdu (detected by Urdu-only letters).
_PERIOD_BY_SCRIPT = {
    "CJK": "。",
    "IDEOGRAPHIC": "。",  # 々 〆
    "HIRAGANA": "。",
    "KATAKANA": "。",
    "KATAKANA-HIRAGANA": "。",  # ー
    "TIBETAN": "།",
    "DEVANAGARI": "।",
    "BENGALI": "।",
    "GURMUKHI": "।",
    "ARMENIAN": "։",
    "ETHIOPIC": "።",
    "MYANMAR": "။",
    "KHMER": "។",
}
_URDU_LETTERS = frozenset("ٹڈڑںےۓ")

_LEVEL_COST = {SENTENCE: 0.0, CLAUSE: 1.0, WORD: 2.0}
_KINDS = (SENTENCE, CLAUSE, WORD)
_KIND_CODES = {kind: i for i, kind in enumerate(_KINDS)}
_SHORT_TAIL_COST = 0.5


@dataclass(frozen=True)
class Segment:
    """One piece of the input: ``input[start:end] == text``.

    ``spoken`` is what to send to the model; ``pause_after`` the seconds of silence natural
    before the next segment (``PAUSE_AFTER`` by how this one ended; 0.0 after the last).
    """

    text: str
    start: int
    end: int
    pause_after: float
    spoken: str


# What the speaking calls say of text that is_blank: it may hold characters, none of them seen.
EMPTY_TEXT = (
    "text is empty (nothing but spaces, invisible or control characters, or accents with "
    "no letter): give some words to speak"
)
_HANGUL_FILLERS = frozenset("\u115f\u1160\u3164\uffa0")  # Unicode's default-ignorable letters


def is_blank(text: str) -> bool:
    """Whether ``text`` has nothing to speak: only spaces, control and format characters
    (zero-width spaces and joiners, byte order marks, direction marks) and marks with no
    character to go on (combining accents, variation selectors)."""
    return not any(_visible(ch) for ch in text)


def is_silent(text: str) -> bool:
    """Whether ``text`` has nothing to speak even though it is not blank: sentence punctuation
    alone (".", "!?", "»", "—"). A segment can be that when an unbreakable run of
    ``max_chars`` characters (a URL) ends just before its period; sent to the model it
    would babble, so it is kept as a pause."""
    return all(ch in _MARKS or not _visible(ch) for ch in text)


def _visible(ch: str) -> bool:
    """Not a space, a control or format character, nor a mark (a combining accent or a
    variation selector shows nothing without a character before it), nor a Hangul filler
    (letters by their category, yet blank)."""
    if ch.isspace() or ch in _HANGUL_FILLERS:
        return False
    category = unicodedata.category(ch)
    return category[0] != "Z" and category not in ("Cc", "Cf", "Mn", "Me")


class SplitStopped(Exception):
    """:func:`split_text` was told to stop (its ``stop`` returned True) before it finished."""


def split_text(
    text: str,
    *,
    target_chars: int | None = None,
    max_chars: int = 400,
    add_period: bool = True,
    stop: Callable[[], bool] | None = None,
) -> list[Segment]:
    """Split ``text`` into segments of about ``target_chars`` (default: half of
    ``max_chars``, as the speaking calls split) and at most ``max_chars``.

    Segments are stripped, non-empty, in order and non-overlapping; only whitespace between
    them is dropped. A segment may still have nothing to speak (:func:`is_blank`: zero-width
    or control characters alone; :func:`is_silent`: punctuation alone): the speaking calls
    speak nothing for it (a whole text of punctuation alone is spoken); a blank one adds
    no pause of its own either (see :func:`voxtral_mlx.textstream.planned_pauses`).
    ``spoken`` is the segment with a script-appropriate period when it lacks
    terminal punctuation and ``add_period`` (a trailing comma/colon/dash becomes the period).
    ``stop`` is called every few thousand words: when it returns True, :class:`SplitStopped`
    is raised (a book's split takes about a second, which a Stop button should not wait for).
    """
    if not isinstance(text, str):
        raise InputError(f"text must be a str, got {type(text).__name__}: pass the text itself")
    for name, value in (("target_chars", target_chars), ("max_chars", max_chars)):
        if value is None and name == "target_chars":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            shown = one_line(repr(value), 60)
            raise InputError(f"{name} must be a whole number of characters, got {shown}")
    max_chars = int(max_chars)
    if max_chars < 1:
        raise InputError(f"max_chars must be at least 1, got {max_chars}")
    target_chars = max(1, max_chars // 2) if target_chars is None else int(target_chars)
    if not 1 <= target_chars <= max_chars:
        raise InputError(
            f"need 1 <= target_chars <= max_chars, got {target_chars} and {max_chars}: fix them"
        )
    if not text or text.isspace():
        return []
    check = _stop_check(stop)
    paragraphs, cands, forbid = _find_splits(text, check)
    pieces: list[tuple[int, int, str]] = []  # (start, end, how it ended)
    for p0, p1 in paragraphs:
        cur = p0
        while p1 - cur > target_chars:
            check(64)  # a segment's choice weighs its window's candidates
            e, s, kind = _best_split(text, cur, p1, cands, forbid, target_chars, max_chars)
            if e == p1:
                break
            pieces.append((cur, e, kind))
            cur = s
        pieces.append((cur, p1, PARAGRAPH))

    segments = []
    for i, (a, b, kind) in enumerate(pieces):
        pause = 0.0 if i == len(pieces) - 1 else PAUSE_AFTER[kind]
        segments.append(Segment(text[a:b], a, b, pause, _spoken(text[a:b], add_period)))
    return segments


def _stop_check(stop: Callable[[], bool] | None) -> Callable[[int], None]:
    """A function to call with each piece of work done (1 per candidate split, more for a
    scanned piece of text): every ``_STOP_EVERY`` units it asks ``stop`` and raises
    :class:`SplitStopped` if it says so."""
    if stop is None:
        return lambda units=1: None
    count = 0

    def check(units: int = 1) -> None:
        nonlocal count
        count += units
        if count >= _STOP_EVERY:
            count = 0
            if stop():
                raise SplitStopped

    return check


def _scan(
    pattern: re.Pattern[str],
    text: str,
    chunk: int = _SCAN_CHARS,
    check: Callable[[int], None] = lambda units: None,
) -> Iterator[re.Match]:
    """``pattern.finditer(text)`` in pieces of about ``chunk`` characters, for patterns
    whose matches hold no whitespace but a space before a digit or "(" (the same matches: the
    lookbehinds still see the text before each piece). ``check`` is told of each piece.

    Pieces end at whitespace; a run of ``chunk`` characters without any (a CJK paragraph
    written without spaces, a pasted blob) is cut between two letters or symbols, which no
    match of :data:`_NO_SPACE_BREAK` holds, nor one of :data:`_PROTECTED` in a run without
    ``@``, ``://`` or ``www.`` (one scan of 5 MB of such a run held the GIL for a second)."""
    n, pos = len(text), 0
    run_end, cuttable = -1, False  # the first break at or after pos + chunk, once searched
    while pos < n:
        check(chunk // 8)  # a piece scanned costs about what an eighth of its words do
        end = n
        if pos + chunk < n:
            if run_end < pos + chunk:
                brk = _SCAN_BREAK.search(text, pos + chunk)
                run_end = brk.start() if brk else n
                cuttable = pattern is not _PROTECTED or not _spans_letters(text, pos, run_end)
            end = run_end
            if cuttable and end - pos > 2 * chunk:
                end = _letter_cut(text, pos + chunk, end, chunk)
        yield from pattern.finditer(text, pos, end)
        pos = end


_LETTER_SPANNING = re.compile(r"www\.", re.IGNORECASE)


def _spans_letters(text: str, start: int, end: int) -> bool:
    """Whether ``text[start:end]`` may hold a URL or e-mail address (a match of
    :data:`_PROTECTED` that runs through letters)."""
    return (
        text.find("@", start, end) >= 0
        or text.find("://", start, end) >= 0
        or (
            text.find(".", start, end) >= 0
            and _LETTER_SPANNING.search(text, start, end) is not None
        )
    )


def _letter_cut(text: str, at: int, end: int, within: int) -> int:
    """The first place from ``at`` (up to ``within`` further) between two letters or symbols
    (no number, punctuation or sign on either side); ``end`` if there is none."""
    plain = False
    for p in range(at - 1, min(end, at + within)):
        ch = text[p]
        now = ch.isalpha() or unicodedata.category(ch) == "So"
        if now and plain:
            return p
        plain = now
    return end


class _Splits:
    """Allowed splits in text order: where a segment may end, where the next one then
    starts, and the kind of the pause. Flat arrays: a tuple per word of a 40 MB text took
    over a gigabyte."""

    def __init__(self) -> None:
        self.ends = array("q")
        self.starts = array("q")
        self.kinds = bytearray()

    def add(self, end: int, start: int, kind: str) -> None:
        self.ends.append(end)
        self.starts.append(start)
        self.kinds.append(_KIND_CODES[kind])

    def __iter__(self) -> Iterator[tuple[int, int, str]]:
        for e, s, k in zip(self.ends, self.starts, self.kinds, strict=True):
            yield e, s, _KINDS[k]


def _find_splits(
    text: str, check: Callable[[int], None]
) -> tuple[list[tuple[int, int]], _Splits, bytearray]:
    """Paragraph spans, allowed splits in order, and the forbid mask (``check`` is called
    per candidate: see :func:`_stop_check`)."""
    n = len(text)
    forbid = bytearray(n + 1)  # forbid[e]: no segment may end at e
    for m in _scan(_PROTECTED, text, check=check):
        check()
        a, b = m.start(), m.start() + len(m.group().rstrip(_TRAILING_PUNCT))
        forbid[a + 1 : b] = b"\x01" * max(b - a - 1, 0)

    paragraphs: list[tuple[int, int]] = []
    cands = _Splits()  # at whitespace, in order
    start = word = 0  # the paragraph's start, the word's
    last = (0, 0)  # the last word before e that is not emoji alone
    for m in _WS.finditer(text):
        check()
        e, s = m.span()
        if e == 0:
            start = word = s
            continue
        if s == n:
            break
        run = m.group()
        if run == " ":  # most runs: a plain space, no line break
            breaks = 0
        elif not run.strip(_NO_BREAK_SPACES):
            continue
        else:
            breaks = _line_breaks(run)
        if not _symbols_only(text, word):
            last = (word, e)
        word = s
        if breaks > 1:
            paragraphs.append((start, e))
            start, last = s, (s, s)
            continue
        kind = _classify(text, e, s, forbid, last, breaks > 0)
        if breaks:  # an emoji starting a line belongs to that line ("🛒 Buy milk.")
            last = (s, s)
        if kind == WORD and breaks:
            kind = CLAUSE
        if kind:
            cands.add(e, s, kind)
    paragraphs.append((start, len(text.rstrip())))

    glued = _Splits()  # CJK punctuation, dashes: no space needed
    for m in _scan(_NO_SPACE_BREAK, text, check=check):
        check()
        a, q = m.span()
        if a == 0 or text[a - 1].isspace():
            continue
        while q < n and (text[q] in _CLOSERS or _is_symbol(text[q])):
            q += 1  # "太好了！😀明天见": the emoji stays with the sentence it follows
        if q < n and not text[q].isspace():
            hard = any(ch in _NO_SPACE_HARD or ch in ".!?" for ch in m.group())
            glued.add(q, q, SENTENCE if hard else CLAUSE)

    allowed = _Splits()  # never at the same place: a glued split is before a non-space
    for e, s, kind in heapq.merge(cands, glued):
        check()
        if not forbid[e] and _cuttable(text, s):
            allowed.add(e, s, kind)
    return paragraphs, allowed, forbid


def _line_breaks(run: str) -> int:
    """0, 1, or 2 meaning 'a paragraph break' for a whitespace run."""
    if any(ch in _PARAGRAPH_SEPARATORS for ch in run):
        return 2
    return min(len(_LINE_BREAK.findall(run)), 2)


def _classify(
    text: str, e: int, s: int, forbid: bytearray, last: tuple[int, int], line_break: bool
) -> str | None:
    """Kind of split at the whitespace ``text[e:s]``; None, with ``forbid`` marked, if
    protected. ``last``: the span of the last word before ``e`` that is not emoji alone;
    ``line_break``: the whitespace holds one."""
    if _punctuation_only(text, s):  # "Oui ! » Puis", ". . .": they end the word before
        forbid[e] = 1
        return None
    j = _before_closers(text, e)
    emoji_after = not line_break and _symbols_only(text, s)
    if emoji_after or (j and _is_symbol(text[j - 1])):
        a, b = last
        if _ends_terminal(text[max(a, b - 64) : b]):  # a sentence ends before the emoji
            if emoji_after:
                forbid[e] = 1  # "Great! 😀 Next": the emoji stays with its sentence
                return None
            return SENTENCE  # "Great! 😀 | Next"
    c = text[j - 1] if j else ""
    if c == ";" and _greek_before(text, j - 1):
        return SENTENCE  # Greek's question mark ("Τι κάνεις;"), typed as ASCII ";"
    if c in _MID or (
        (c in _DASHES or (c == "-" and (j < 2 or text[j - 2].isspace() or text[j - 2] == "-")))
        and not _price_dash(text, j)
    ):
        return CLAUSE  # a dash: a spaced hyphen, or "--", a plain-text book's dash
    if c not in TERMINALS:
        return WORD
    nxt = _next_char(text, s)
    if c not in ".…":
        # '"Why?" she asked', 'Oh! what a day': a lowercase word continues the sentence.
        return WORD if c in _CASED_TERMINALS and nxt.islower() else SENTENCE
    t0 = _word_start(text, j - 1)
    protected = _protected_period(text, t0, j, s, nxt)
    if protected is not None:
        forbid[protected + 1 : s + 1] = b"\x01" * (s - protected)
        return None
    if nxt.islower() or nxt.isdigit() or (nxt.isupper() and _maybe_ordinal(text, t0, j)):
        return WORD  # "etc. and"; "ext. 1234", "Hauptstr. 5", "3 déc. 2024"
    if _initialism_before_name(text, t0, j, s):
        return WORD  # "the U.S. Army": allowed, as at a space, never preferred
    return SENTENCE


def _initialism_before_name(text: str, t0: int, j: int, s: int) -> bool:
    """``text[t0:j]`` is a dotted initialism ("U.S.") and the next word is a name it may
    qualify, not a word that starts a sentence."""
    k = _after_openers(text, t0, j)
    if not _INITIALISM.fullmatch(text, k, j):
        return False
    nxt = _next_word(text, s)
    return nxt[:1].isupper() and nxt.lower() not in _SENTENCE_STARTERS


def _price_dash(text: str, j: int) -> bool:
    """The dash ending ``text[:j]`` writes no cents ("5,-", "20,–"): no pause, kept."""
    return j >= 3 and text[j - 2] in ",." and text[j - 3].isdigit()


def _maybe_ordinal(text: str, t0: int, j: int) -> bool:
    """A period after a number of one to three digits, before a capital, may end a sentence
    ("He scored 3. Then") or write an ordinal ("am 3. Mai", "der 1. Weltkrieg"): splitting
    there is allowed, as at a space, but never preferred to a real sentence end or a comma."""
    return j - t0 <= 4 and text[t0 : j - 1].isdigit()


def _protected_period(text: str, t0: int, j: int, s: int, nxt: str) -> int | None:
    """Where the protected end of the token ``text[t0:j]`` starts when the period ending it
    must stay with the next word, else None."""
    k = _after_openers(text, t0, j)
    word = text[k:j].lower()
    # The last piece glued on without a space ("opened—Dr.", "见到了Mr.", "でも…"): only
    # it is kept whole, not the sentence ends glued before it.
    g = _glued_start(text, k, j)
    if word.endswith(("..", "…")) or (word == "." and _after_dot(text, k)):  # ". . ."
        return g if nxt.islower() else None
    if word in _TITLES or _second_part(text, k, word):
        return t0
    piece = text[g:j].lower()
    if g > k and piece in _TITLES:
        return g
    return t0 if _protected_word(text, t0, k, s, word, nxt) else None


def _glued_start(text: str, k: int, j: int) -> int:
    """Start of the last piece of ``text[k:j]`` (which ends in punctuation) that follows
    a dash, comma, colon, slash or CJK character with no space between."""
    i = j - 1
    while i > k:
        ch = text[i - 1]
        if not (ch.isalnum() or ch in ".'’") or _CJK_CHAR.match(ch):
            break
        i -= 1
    return i


def _protected_word(text: str, t0: int, k: int, s: int, word: str, nxt: str) -> bool:
    """The period ending ``word`` (the token from ``t0``, ``k`` after its openers,
    lowercased) stays with the next word: a number's abbreviation, an initial, a numbered
    item's number."""
    if word in _NUMBER_ABBREVIATIONS:
        return nxt.isdigit()
    if _INITIALISM.fullmatch(word):
        return nxt.isdigit()  # "the U.N. 2030 agenda"; before a name: see _classify
    if len(word) == 2 and word[0].isalpha():  # an initial: "J. R. R. Tolkien", "z. B."
        if not (text[k].isupper() or text[k].islower()):  # no case: Arabic "د. محمد"
            return nxt.isalpha()
        if word[0] in "ia" and text[k].isupper():  # "So did I. Then" but "I. M. Pei"
            return nxt.isupper() and text[s + 1 : s + 2] == "."
        # the first of two ("p. ex.", "d. h."), before a name or a number, or the last of
        # several initials ("e. e. cummings")
        return (
            bool(_SHORT_ABBREVIATION.match(text, s))
            or nxt.isupper()
            or nxt.isdigit()
            or (nxt.isalpha() and _after_initial(text, k))
        )
    if word[:-1].isdigit():  # "1. First item" at the start of a line
        b = t0
        while b > 0 and text[b - 1] in " \t":
            b -= 1
        return b == 0 or text[b - 1] in _LINE_ENDS
    return False


def _after_initial(text: str, k: int) -> bool:
    """The token before the one starting at ``text[k]`` is a single letter and a period."""
    i = k
    while i > 0 and text[i - 1] == " ":
        i -= 1
    return (
        2 <= i < k
        and text[i - 1] == "."
        and text[i - 2].isalpha()
        and (i == 2 or not text[i - 3].isalnum())
    )


def _punctuation_only(text: str, i: int) -> bool:
    """The token at ``text[i]`` is punctuation that belongs to the word before it, set off by
    a space (French "Oui !", "« Oui. »"; a spaced ellipsis)."""
    if text[i : i + 1] not in _ATTACHED:
        return False
    j = i
    while j < len(text) and not text[j].isspace():
        if text[j].isalnum():
            return False
        j += 1
    return True


def _after_dot(text: str, k: int) -> bool:
    """The token before the one starting at ``text[k]`` ends with a period."""
    i = k
    while i > 0 and text[i - 1].isspace():
        i -= 1
    return i < k and text[i - 1 : i] == "."


def _second_part(text: str, k: int, word: str) -> bool:
    """``word`` completes a listed abbreviation written with a space: "p. ex.", "d. h."."""
    if len(word) > 3 or k < 3 or text[k - 1] != " " or text[k - 2] != ".":
        return False
    return text[_word_start(text, k - 2) : k - 1].lower() + word in _TITLES


def _word_start(text: str, i: int) -> int:
    """Start of the run of non-space characters that ``text[i]`` belongs to."""
    while i > 0 and not text[i - 1].isspace():
        i -= 1
    return i


def _after_openers(text: str, i: int, end: int | None = None) -> int:
    """Where the opening quotes and brackets starting at ``text[i]`` (before ``end``) end."""
    end = len(text) if end is None else end
    while i < end and text[i] in _OPENERS:
        i += 1
    return i


def _next_word(text: str, s: int) -> str:
    """The run of letters starting at ``text[s]`` (after any opening quotes)."""
    s = e = _after_openers(text, s)
    while e < len(text) and text[e].isalpha():
        e += 1
    return text[s:e]


def _next_char(text: str, s: int) -> str:
    s = _after_openers(text, s)
    return text[s] if s < len(text) else ""


def _best_split(
    text: str,
    cur: int,
    p1: int,
    cands: _Splits,
    forbid: bytearray,
    target: int,
    max_chars: int,
) -> tuple[int, int, str]:
    """Cheapest split of ``text[cur:p1]`` within ``max_chars``: (end, next start, kind)."""
    limit = cur + max_chars
    best, best_cost = None, float("inf")
    if p1 <= limit:
        best, best_cost = (p1, p1, PARAGRAPH), _length_cost(p1 - cur, target, max_chars)
    ends = cands.ends
    for i in range(bisect_right(ends, cur), bisect_right(ends, min(limit, p1))):
        e, s, kind = ends[i], cands.starts[i], _KINDS[cands.kinds[i]]
        cost = _LEVEL_COST[kind] + _length_cost(e - cur, target, max_chars)
        if p1 - s < target / 4:
            cost += _SHORT_TAIL_COST
        if cost < best_cost:
            best, best_cost = (e, s, kind), cost
    return best or _hard_cut(text, cur, limit, forbid)


def _length_cost(length: int, target: int, max_chars: int) -> float:
    if length <= target:
        return 1.5 * (target - length) / target
    return (length - target) / max(max_chars - target, 1)


def _hard_cut(text: str, cur: int, limit: int, forbid: bytearray) -> tuple[int, int, str]:
    """Cut near ``limit``; prefer outside grapheme clusters, then outside protected spans,
    then not before punctuation that belongs to the word before it (a lone "." next), then
    at a no-break space in the window's second half rather than inside a word."""
    # Other whitespace there would have been a split, or is protected.
    half = limit - (limit - cur) // 2
    spaced = any(ch in text[half:limit] for ch in _NO_BREAK_SPACES)
    good = (True, True, True, True) if spaced else (True, True, True)
    best, best_rank = None, (-1,)
    run = [0, 0]  # the flag run last measured: see _cuttable
    i = limit
    while i > cur:
        e, s = i, i
        while text[e - 1].isspace():
            e -= 1
        while text[s].isspace():
            s += 1
        rank = (
            _cuttable(text, e, cur, run) and _cuttable(text, s, cur, run),
            not forbid[e],
            text[s] not in _ATTACHED,
            e != s,
        )
        if rank > best_rank:
            best, best_rank = (e, s, CUT), rank
            if rank[: len(good)] == good:
                break
        if spaced and i <= half and best_rank[:3] == (True, True, True):
            break  # no no-break space close enough: the best cut inside a word
        i = min(i, e) - 1  # every cut inside one run of whitespace is the same cut
    assert best is not None
    return best


def _cuttable(text: str, i: int, start: int = 0, run: list[int] | None = None) -> bool:
    """False when a cut before ``text[i]`` would split a grapheme cluster (simplified UAX #29).

    Regional-indicator flags pair up from the start of their run, or from ``start`` (where
    the segment begins) if that is later: linear time on a long run of them. ``run`` keeps
    the run last measured (``[run start, a position in it]``) for calls with the same
    ``start``, so that trying every position of a run does not walk it every time.
    """
    if i <= 0 or i >= len(text):
        return True
    p, c = text[i - 1], text[i]
    if c < "\u0300" and p < "\u0300" and p != "\r":  # nothing below U+0300 joins but CR LF
        return True
    op, oc = ord(p), ord(c)
    # Between two ZWJs nothing is joined (no emoji sequence has them): a long run of them
    # may be cut rather than a word beside it.
    if (c == "\u200d") != (p == "\u200d") or (p == "\r" and c == "\n"):
        return False
    # Variation selectors, skin-tone modifiers, tag characters, Hangul medial/final jamo, and
    # what UAX #29 joins to the character before beyond the marks: ZWNJ, the half-width
    # (semi-)voiced sound marks, Thai and Lao "am".
    if (
        0xFE00 <= oc <= 0xFE0F
        or 0x1F3FB <= oc <= 0x1F3FF
        or 0xE0020 <= oc <= 0xE01EF
        or 0x1160 <= oc <= 0x11FF
        or 0xD7B0 <= oc <= 0xD7FF
        or oc in _EXTEND_OTHER
    ):
        return False
    if op in _PREPEND or (_is_leading_jamo(op) and (_is_leading_jamo(oc) or _is_syllable(oc))):
        return False
    if 0xD800 <= op <= 0xDBFF and 0xDC00 <= oc <= 0xDFFF:
        return False
    if unicodedata.category(c) in ("Mn", "Mc", "Me"):
        return False
    if unicodedata.combining(p) == 9 and c.isalpha():  # virama + consonant: Indic conjunct
        return False
    if _is_regional(c) and _is_regional(p):
        if run is not None and run[0] < i <= run[1]:
            k = run[0]
        else:
            k = i - 1
            while k > start and _is_regional(text[k - 1]):
                k -= 1
            if run is not None:
                run[:] = [k, i]
        return (i - k) % 2 == 0  # flags pair up from the start of the run
    return True


# Grapheme_Cluster_Break Extend / SpacingMark code points outside the Mn, Mc, Me categories
# (besides the ranges _cuttable tests), and Prepend: what joins the character after it.
_EXTEND_OTHER = frozenset((0x200C, 0xFF9E, 0xFF9F, 0x0E33, 0x0EB3))
_PREPEND = frozenset(
    (*range(0x0600, 0x0606), 0x06DD, 0x070F, 0x0890, 0x0891, 0x08E2, 0x0D4E, 0x110BD, 0x110CD)
)


def _is_leading_jamo(o: int) -> bool:
    return 0x1100 <= o <= 0x115F or 0xA960 <= o <= 0xA97C


def _is_syllable(o: int) -> bool:
    return 0xAC00 <= o <= 0xD7A3


def _is_regional(ch: str) -> bool:
    return 0x1F1E6 <= ord(ch) <= 0x1F1FF


def _before_closers(text: str, j: int) -> int:
    """Where the closing quotes and brackets ending ``text[:j]`` begin; invisible format
    characters among them count too (a right-to-left mark after a Hebrew period), and so
    does a space before a closer (French "« Oui. »")."""
    end = j
    while j > 0:
        ch = text[j - 1]
        # only before a mark that closes in every language: "« Non" opens after its space
        spaced = ch in _INNER_SPACES and 1 < j < end and text[j] in _CLOSERS
        if not (spaced or ch in _LOW_CLOSERS or unicodedata.category(ch) == "Cf"):
            break
        j -= 1
    return j


def _ends_terminal(text: str) -> bool:
    """``text`` ends a sentence: terminal punctuation, then perhaps closing quotes and, set
    off by a space or not, emoji ("Great! 😀")."""
    j = _before_closers(text, len(text))
    if j and _is_symbol(text[j - 1]):
        j = _before_closers(text, _before_symbols(text, j))
    return j > 0 and (
        text[j - 1] in TERMINALS or (text[j - 1] == ";" and _greek_before(text, j - 1))
    )


# Emoji and their joiners, variation selectors, skin tones and tags (So, Sk, Cf, Mn, Me).
_SYMBOL_CATEGORIES = frozenset(("So", "Sk", "Cf", "Mn", "Me"))


def _is_symbol(ch: str) -> bool:
    """An emoji or a part of one (a joiner, a variation selector, a skin tone): not the
    symbols of running text below the arrows block ("©", "™", "№") nor CJK ones ("〒", "㈱")."""
    o = ord(ch)
    if o == 0x200D:
        return True
    cjk = 0x3000 <= o <= 0x33FF
    return o >= 0x2190 and not cjk and unicodedata.category(ch) in _SYMBOL_CATEGORIES


def _symbols_only(text: str, i: int) -> bool:
    """The token at ``text[i]`` is emoji (or other symbols) alone: "😀", "👍🏽", "❤️"."""
    j = i
    while j < len(text) and not text[j].isspace():
        if not _is_symbol(text[j]):
            return False
        j += 1
    return j > i


def _before_symbols(text: str, j: int) -> int:
    """Where the symbols (and whitespace among and before them) ending ``text[:j]`` begin,
    within 32 characters: a longer run is no emoji after a sentence."""
    k = j
    while k > 0 and j - k < 32 and (_is_symbol(text[k - 1]) or text[k - 1].isspace()):
        k -= 1
    return k


def _greek_before(text: str, i: int) -> bool:
    """The sentence before ``text[i]`` (up to 80 characters) has a Greek word, two Greek
    letters in a row: Greek's question mark is the semicolon (Greek keyboards type U+003B,
    and NFC makes U+037E one). "Θα έρθεις στις 10:30;", "Χρησιμοποιείς το Microsoft
    Windows;", but not "The frequency is ν;"."""
    run = 0
    for ch in reversed(text[max(0, i - 80) : i]):
        if ch in TERMINALS or ch == ";":
            break
        greek = ch.isalpha() and unicodedata.name(ch, "").startswith("GREEK")
        run = run + 1 if greek else 0
        if run == 2:
            return True
    return False


def with_period(text: str) -> str:
    """``text`` as a segment of it is sent to the model: ending with a period (in its
    script) if it lacks final punctuation; a trailing comma, colon or dash becomes it."""
    return _spoken(text, True)


def _spoken(seg: str, add_period: bool) -> str:
    if not add_period or _ends_terminal(seg):
        return seg
    j = len(seg)
    while j > 0 and unicodedata.category(seg[j - 1]) == "Cf":
        j -= 1
    if j and (seg[j - 1] in _MID or seg[j - 1] in _DASHES or seg[j - 1] == "-"):
        head = seg[: j - 1]
        if seg[j - 1] not in _MID:
            if _price_dash(seg, j):  # "5,-": the dash is read, the period added
                return seg + _period_for(seg)
            head = head.rstrip("-" + "".join(_DASHES))  # "--" too
        head = head.rstrip()
        if head:  # "Note:" -> "Note."; "Really?! —" -> "Really?!"
            return head if _ends_terminal(head) else head + _period_for(head)
    return seg + _period_for(seg)


def _period_for(seg: str) -> str:
    for ch in reversed(seg):
        if ch.isalpha():
            name = unicodedata.name(ch, "")
            if name.startswith("HALFWIDTH KATAKANA"):
                return "｡"
            script = name.split(" ", 1)[0]
            if script == "ARABIC":
                return "۔" if any(c in _URDU_LETTERS for c in seg) else "."
            return _PERIOD_BY_SCRIPT.get(script, ".")
    return "."
