"""Views of the registry: tables, pictures, path lengths and comparisons."""
