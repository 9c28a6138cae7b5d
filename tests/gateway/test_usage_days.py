"""`/admin/usage`'s `from`/`to` (coderai.gateway.admin.keys.day_range): the days asked for, or a 400 naming which
of the two is wrong."""

from __future__ import annotations

import pytest

from coderai.gateway.admin.keys import DayError, day_range


def test_a_range_is_every_day_inclusive():
    assert day_range("2026-02-27", "2026-03-01") == ["2026-02-27", "2026-02-28", "2026-03-01"]
    assert day_range("2026-05-04", None) == ["2026-05-04"]


@pytest.mark.parametrize(
    "start, end, param",
    [
        ("2026-02-30", None, "from"),
        ("2026-03-01", "March", "to"),
        ("2026-03-02", "2026-03-01", "to"),
        ("2024-01-01", "2026-01-01", "to"),
    ],
)
def test_a_bad_day_names_its_parameter(start, end, param):
    with pytest.raises(DayError) as exc:
        day_range(start, end)
    assert exc.value.param == param
