"""split_text and with_period: the single rules of the splitter, one input each (the
character classes, word lists, limits and costs that the property tests of test_segment.py
leave free to change)."""

from __future__ import annotations

import pytest

from voxtral_mlx.segment import PAUSE_AFTER, split_text, with_period


def texts(segs):
    return [s.text for s in segs]


def test_double_exclamation_before_lowercase_is_no_sentence_end():
    segs = split_text("Wow‼ what a day. Then rain.", target_chars=1, max_chars=60)
    assert texts(segs) == ["Wow‼ what a day.", "Then rain."]


def test_trailing_ideographic_comma_becomes_the_period():
    assert with_period("東京、") == "東京。"


def test_horizontal_bar_is_a_dash():
    assert with_period("Wait ―") == "Wait."
    segs = split_text(
        "alpha beta gamma ― delta epsilon zeta eta theta", target_chars=20, max_chars=40
    )
    assert segs[0].text == "alpha beta gamma ―" and segs[0].pause_after == PAUSE_AFTER["clause"]


def test_inverted_question_mark_is_an_opener():
    segs = split_text("Vale. ¿y tú? Bien.", target_chars=1, max_chars=60)
    assert texts(segs) == ["Vale. ¿y tú?", "Bien."]


def test_tel_stays_with_its_number_when_forced():
    segs = split_text("Call Tel. 5551234 now", target_chars=1, max_chars=14)
    assert "Tel. 5551234" in texts(segs)


def test_an_initial_before_a_longer_word_is_no_abbreviation_pair():
    segs = split_text("Take plan b. now.", target_chars=1, max_chars=6)
    assert texts(segs) == ["Take", "plan", "b.", "now."]


def test_eight_digit_groups_are_one_number_a_ninth_is_a_word_split():
    segs = split_text("11 22 33 44 55 66 77 88 99", max_chars=24)
    assert [(s.text, s.pause_after) for s in segs] == [
        ("11 22 33 44 55 66 77 88", PAUSE_AFTER["word"]),
        ("99", 0.0),
    ]


@pytest.mark.parametrize("after", [")", "."])
def test_a_max_length_url_keeps_whole_before_its_trailing_punctuation(after):
    url = "https://example.com/" + "a" * 380
    segs = split_text(url + after, max_chars=400)
    assert texts(segs) == [url, after]


def test_a_short_tail_is_kept_with_its_sentence():
    text = "This first sentence is a bit longer than forty. Yes."
    assert texts(split_text(text, target_chars=40, max_chars=80)) == [text]


def test_a_tail_over_a_quarter_of_target_is_split_off():
    text = "This first sentence is a bit longer than forty. Yes, it is."
    assert texts(split_text(text, target_chars=40, max_chars=80)) == [
        "This first sentence is a bit longer than forty.",
        "Yes, it is.",
    ]


def test_form_feed_is_a_paragraph_break():
    segs = split_text("One\x0ctwo")
    assert texts(segs) == ["One", "two"]
    assert segs[0].pause_after == PAUSE_AFTER["paragraph"]


def test_cjk_full_stop_before_a_lowercase_word_still_ends_the_sentence():
    segs = split_text("これは本です。 iPhoneが好き。", target_chars=1, max_chars=60)
    assert texts(segs) == ["これは本です。", "iPhoneが好き。"]


def test_a_swiss_price_dash_after_a_period_is_kept():
    assert with_period("Das kostet 5.-") == "Das kostet 5.-."


def test_three_digit_ordinal_is_no_sentence_end():
    segs = split_text("Er feiert den 100. Geburtstag heute.", target_chars=1, max_chars=60)
    assert texts(segs) == ["Er feiert den 100. Geburtstag heute."]


def test_typographic_apostrophe_acts_as_ascii_one_before_an_abbreviation():
    for apostrophe in ("'", "’"):
        text = f"Parlai dell{apostrophe}ing. e poi andai."
        segs = split_text(text, target_chars=1, max_chars=10)
        assert texts(segs) == ["Parlai", f"dell{apostrophe}ing.", "e", "poi andai."]


def test_caseless_initial_before_a_digit_is_a_word_split():
    segs = split_text("قال ص. 12 إن", target_chars=1, max_chars=6)
    assert texts(segs) == ["قال", "ص.", "12 إن"]


@pytest.mark.parametrize("lead", ["Steps:\u20281. Open it.", "Steps:\n\t1. Open it."])
def test_list_marker_after_any_line_end_or_tab_indent_stays_with_its_word(lead):
    assert texts(split_text(lead, target_chars=1, max_chars=9)) == ["Steps:", "1. Open", "it."]


def test_a_longer_abbreviation_before_a_letter_is_no_initial():
    segs = split_text("See fig. a. it is there.", target_chars=1, max_chars=10)
    assert texts(segs) == ["See", "fig. a.", "it", "is there."]


def test_three_char_second_part_of_a_spaced_abbreviation():
    segs = split_text("On cite p. ex. Paris et Lyon.", target_chars=1, max_chars=60)
    assert texts(segs) == ["On cite p. ex. Paris et Lyon."]


def test_up_to_32_emoji_after_a_sentence_need_no_period():
    assert with_period("Great! " + "😀" * 10) == "Great! " + "😀" * 10


def test_greek_question_mark_far_from_or_with_only_short_greek_words():
    assert with_period("Χρησιμοποιείς ακόμα το Microsoft Windows Server 2019;").endswith(";")
    assert with_period("Με το iPhone;") == "Με το iPhone;"


def test_invisible_marks_after_a_trailing_colon():
    assert with_period("Note:\u200f") == "Note."


def test_letterlike_symbols_are_no_emoji():
    segs = split_text("Thanks for reading. № 5 is next.", target_chars=1, max_chars=30)
    assert texts(segs) == ["Thanks for reading.", "№ 5 is next."]


def test_however_after_an_initialism_starts_a_sentence():
    segs = split_text("He lived in the U.S. However, it ended.", target_chars=1, max_chars=60)
    assert texts(segs) == ["He lived in the U.S.", "However, it ended."]


def test_leading_cjk_full_stop_is_no_split():
    assert texts(split_text("。你好世界", target_chars=1, max_chars=10)) == ["。你好世界"]
