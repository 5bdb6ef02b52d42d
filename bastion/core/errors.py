"""The root of every exception bastion raises on purpose.

Catching `BastionError` catches every refusal and failure bastion itself
decided, and nothing that is a bug (a `TypeError`, an `AssertionError`) or the
system's own (an `OSError` that no bastion code wrapped). The tree of its
subclasses is drawn in the docstring of `BastionError`, and
`tests/unit/test_errors.py` keeps the drawing true.
"""

from __future__ import annotations


class BastionError(Exception):
    """Something bastion refused or could not do, told in words a person can act on."""
