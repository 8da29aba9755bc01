"""Hypothesis strategies for arbitrary JSON values, shared by the fuzz tests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def json_values(
    *,
    finite: bool = False,
    max_int: int = 2**80,
    max_text: int = 12,
    max_items: int = 5,
    max_leaves: int = 20,
) -> st.SearchStrategy[Any]:
    """Nested lists/objects of JSON scalars. `finite=False` includes NaN and ±inf, which
    Python's json module reads and writes."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-max_int, max_value=max_int),
        st.floats(allow_nan=not finite, allow_infinity=not finite),
        st.text(max_size=max_text),
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=max_items)
            | st.dictionaries(st.text(max_size=max_text), inner, max_size=max_items)
        ),
        max_leaves=max_leaves,
    )
