"""The one way a client keyword's old spelling is taken for one release: warned, and refused when it
disagrees with the new spelling."""

from __future__ import annotations

import warnings

__all__ = ["renamed_keyword"]


def renamed_keyword(owner: str, old: str, old_value: str | None, new: str, new_value: str | None, *,
                    stacklevel: int = 2) -> str | None:
    """``new_value``, or ``old_value`` when the caller used the old spelling ``old`` (with a
    DeprecationWarning naming ``owner(old=...)``; ``stacklevel`` as seen from this function's caller).

    Raises:
        ValueError: both spellings are given and disagree.
    """
    if old_value is None:
        return new_value
    warnings.warn(f"{owner}({old}=...) is deprecated and will be removed in the next release: use "
                  f"{new}=...", DeprecationWarning, stacklevel=stacklevel + 1)
    if new_value is not None and new_value != old_value:
        raise ValueError(f"{owner}: {new}={new_value!r} and its deprecated spelling {old}={old_value!r} "
                         f"disagree; pass {new} only.")
    return old_value
