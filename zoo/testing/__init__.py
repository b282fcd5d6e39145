"""Checks that hold a pattern's three views to each other (``zoo check``)."""
