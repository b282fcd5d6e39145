"""Checks that hold a pattern's three views to each other (``zoo check``): ``pattern_views``,
and ``routed_views`` for a pattern chosen by content."""
