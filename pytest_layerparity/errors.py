"""Errors every floor of the package raises or catches, kept at the bottom so that none is
imported upward."""

from __future__ import annotations


class ModelError(Exception):
    """The model folder cannot be used as given; the message says what to fix."""
