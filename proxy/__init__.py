"""Headroom: an admission-control gateway for streaming speech models."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
