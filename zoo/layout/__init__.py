"""Token orders (frames, 2-D tiles) and block layouts (EMPTY / PARTIAL / FULL per block pair).

``zoo.layout`` was the block layouts' module before this package: its names still resolve here
(lazily, so that importing ``zoo.layout.tiles`` does not import the layouts)."""


def __getattr__(name: str):
    from . import block_layout

    try:
        return getattr(block_layout, name)
    except AttributeError:
        raise AttributeError(f"module 'zoo.layout' has no attribute {name!r}") from None
