"""sgl_jax_lora/managers/stop_strings.py: StopStrings finds a stop string in the growing output text, also one that
straddles two pieces, searches only the new part (plus the overlap), and the stop string that starts first wins."""

from __future__ import annotations

from sgl_jax_lora.managers.stop_strings import StopStrings


def test_a_stop_string_straddling_two_pieces_is_found_at_its_position():
    stops = StopStrings(["END"])
    assert stops.find("The E") is None
    assert stops.find("The EN") is None
    assert stops.find("The END of") == ("END", 4)


def test_only_the_new_text_and_the_overlap_are_searched():
    stops = StopStrings(["ab"])
    assert stops.find("xx") is None
    # text already searched is not searched again: an "ab" that (impossibly) appears in the old part is not seen
    assert stops.find("abx") is None
    assert stops.find("abxab") == ("ab", 3)


def test_the_stop_string_that_starts_first_wins_and_no_stop_strings_is_false():
    assert StopStrings(["world", "hello"]).find("hello world") == ("hello", 0)
    assert StopStrings(["lo", "hel"]).find("hello") == ("hel", 0)  # completed by one piece: cut where "hel" starts
    assert StopStrings(["e", "Th"]).find("Arr! The") == ("Th", 5)
    assert StopStrings(["ab", "a"]).find("xab") == ("ab", 1)  # one position: the first listed
    assert not StopStrings([]) and StopStrings(["x"])
    assert StopStrings([]).find("anything") is None
