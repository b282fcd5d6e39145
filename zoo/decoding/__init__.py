"""Generation: the key-value cache, attention against it, block sums, the step."""
