"""The checked call: arguments, scores, the call a backend receives, per-shape caches."""
