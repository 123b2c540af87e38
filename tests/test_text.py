"""`clip`: a value quoted in an error keeps its start and says its length; a field with a maximum size keeps it."""

from factory.text import clip


def test_short_values_are_quoted_whole_a_str_as_is_anything_else_as_its_repr():
    assert clip("abc") == "abc" and clip(5) == "5" and clip(None) == "None" and clip("x" * 100) == "x" * 100


def test_a_long_value_keeps_its_start_and_says_its_length():
    long = clip("z" * 1000)
    assert long == "z" * 100 + "... (1000 characters)"
    assert clip(list(range(100)), 10) == "[0, 1, 2, ... (390 characters)"
    assert clip(repr("a" * 200), 100, mark="…", unit="chars", size=200) == "'" + "a" * 99 + "… (200 chars)"


def test_without_a_unit_the_result_fits_the_limit():
    assert clip("y" * 1000, 300, unit=None) == "y" * 297 + "..."
    assert clip("y" * 61, 60, mark="…", unit=None) == "y" * 59 + "…"
    assert clip("y" * 60, 60, mark="…", unit=None) == "y" * 60
    assert len(clip("y" * 10_000, 6000, unit=None)) == 6000
