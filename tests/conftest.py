"""Shared pytest setup: the tests import the installed package ``kimi_hybrid`` (``pip install -e .`` in
development), whose import registers the classes with the transformers Auto classes."""

from __future__ import annotations

import kimi_hybrid  # noqa: F401  (registers the classes with the Auto classes)
