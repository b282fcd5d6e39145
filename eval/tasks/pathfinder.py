"""Pathfinder, after the Long Range Arena (Tay et al. 2020) and Linsley et al. 2018: on a small
image, are the two circles joined by one dashed path?

LRA's images come from Linsley's generator (github.com/drewlinsley/pathfinder, the settings in
LRA's ``lra_benchmarks/data/pathfinder.py``): "snakes" of ``contour_length`` short line segments
("paddles", 14 in the hard split), each turned from the last by a bounded angle; two long snakes
in every image; in a positive image the two circles (markers) sit at both ends of one snake, in
a negative one at one end of each; shorter distractor snakes (``contour_length // 3`` paddles,
``20 // distractor_length`` of them at 32 x 32) fill the rest. The anti-aliased grey image is
read in row-major order, one token per pixel (256 grey levels), and one label is predicted. LRA
Table 1 (Pathfinder, 32 x 32): Transformer 71.40, Local 66.63, Sparse Transformer 71.71,
Longformer 69.71, BigBird 74.87; chance is 50.

What this generator keeps: the two long snakes in both classes (so counting paths or markers
says nothing), a marker at the ends that the label names, the paddle counts and distractor
counts above, dashed paths with bounded turns, row-major pixel tokens and a sequence head.
What it simplifies, so that a label can be checked from the tokens alone:

* Paths walk the pixel grid in 8 directions. A paddle is ``dash`` pixels in one direction; the
  next paddle turns by 0 or +-45 degrees (LRA's continuity bounds the turn in the same way);
  ``gap`` pixels are left blank between paddles. No anti-aliasing, no contrast jitter.
* Pixels are quantised to 4 tokens: 0 PAD (never emitted), 1 background, 2 path, 3 marker.
  A marker is a disc of ``marker_radius`` (dy^2 + dx^2 <= r (r + 1): radius 1 is a 3 x 3 block).
* Clearance: every cell of a snake (its blank gaps included) and of its reserved marker discs
  lies more than ``gap + 1`` cells (Chebyshev) from every other snake's. Within one snake
  consecutive drawn pixels are at most ``gap + 1`` apart. So "the circles are joined" is exactly
  "they are in one component of the foreground pixels when cells up to gap + 1 apart count as
  adjacent", which `solve` computes by breadth-first search from the tokens alone.
* The two circles are at least ``min_marker_distance`` cells apart (Euclidean), so that a
  positive label is never read off two circles that touch. (LRA's seed_distance plays a
  similar role.) A snake that cannot be drawn is drawn again; a distractor that cannot be
  placed after some tries is left out (``meta["distractors"]`` counts those drawn). Parameters
  whose two long snakes seldom fit the image (in fewer than 5 of 100 seeded tries) are refused
  when the task is built, with the smallest ``seq_len`` at which they fit.
* Labels are balanced within every batch (half positive, in a random order, one more of a
  random class when n is odd).

Parameters: the image is ``size x size`` with ``size * size == seq_len`` (1024: 32 x 32, 4096:
64 x 64); ``dash`` defaults to ``max(2, size // 16)`` (2 at 32, 4 at 64), so a path spans about
the same fraction of the image at both sizes. ``grid`` is (size, size): the harness passes it to
the 2-D variants. Slice "distance": the circles' Euclidean distance in cells, floored.

Speed: about 5 ms per 32 x 32 image and 3 ms per 64 x 64 one on a loaded CPU core (Python walks
on a NumPy canvas; the 32 x 32 image is more crowded, so more walks are drawn again).
"""

from __future__ import annotations

import copy
import math
import random
from collections import deque

import numpy as np
import torch

from .base import Batch, Task, check_int

BACKGROUND, PATH, MARKER = 1, 2, 3
DIRECTIONS = ((0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1), (-1, 0), (-1, 1))
SNAKE_TRIES, IMAGE_TRIES = 50, 1000
# Parameters whose two long snakes and circles do not fit the image would fail every cell while
# sampling, after the config checks: the constructor tries PROBE_TRIES images of a fixed seed and
# needs PROBE_PLACED of them placed, a rate of about 5%, at which an image all but never runs
# out of its IMAGE_TRIES (0.95 ** 1000 < 1e-22).
PROBE_TRIES, PROBE_PLACED = 100, 5
# How the parameters that the errors name are derived when left unset (None).
DERIVED = {"dash": "derived as max(2, size // 16)", "min_marker_distance": "derived as size // 4"}


class _Failed(Exception):
    """An image whose snakes could not all be placed: the generator starts it again."""


def disc(radius: int) -> list[tuple[int, int]]:
    """Offsets of a marker of ``radius``: dy^2 + dx^2 <= r (r + 1)."""
    span = range(-radius, radius + 1)
    return [(dy, dx) for dy in span for dx in span if dy * dy + dx * dx <= radius * (radius + 1)]


class Pathfinder(Task):
    """LRA Pathfinder: are the two circles joined by one dashed path (label 1) or not (0)?"""

    name = "pathfinder"
    head = "sequence"
    vocab_size = 4
    num_classes = 2

    def __init__(
        self,
        seq_len: int,
        contour_length: int = 14,
        distractor_length: int | None = None,
        num_distractors: int | None = None,
        dash: int | None = None,
        gap: int = 1,
        marker_radius: int = 1,
        min_marker_distance: int | None = None,
    ) -> None:
        super().__init__(seq_len)
        size = math.isqrt(seq_len)
        if size * size != seq_len:
            raise ValueError(
                f"seq_len={seq_len} is not a square image: pathfinder reads a size x size image "
                f"row by row; use seq_len = size * size (1024: 32 x 32, 4096: 64 x 64)."
            )
        given = {
            "contour_length": contour_length,
            "distractor_length": distractor_length,
            "num_distractors": num_distractors,
            "dash": dash,
            "gap": gap,
            "marker_radius": marker_radius,
            "min_marker_distance": min_marker_distance,
        }
        self._configure(size, given)
        problem = self._problem(given)
        if problem is not None:
            raise ValueError(f"{problem}{self._smallest(given)}.")
        self.grid = (size, size)

    def _configure(self, size: int, given: dict[str, int | None]) -> None:
        """The parameters of a ``size`` x ``size`` image: those ``given``, checked, and those
        given as None derived as ``DERIVED`` says."""
        self.size = size

        def value(name: str, derived: int) -> int:
            return derived if given[name] is None else given[name]

        self.contour_length = check_int("contour_length", given["contour_length"], minimum=1)
        self.distractor_length = check_int(
            "distractor_length", value("distractor_length", max(1, self.contour_length // 3))
        )
        self.num_distractors = check_int(
            "num_distractors", value("num_distractors", 20 // self.distractor_length), minimum=0
        )
        self.dash = check_int("dash", value("dash", max(2, size // 16)))
        self.gap = check_int("gap", given["gap"], minimum=0)
        self.marker_radius = check_int("marker_radius", given["marker_radius"], minimum=0)
        self.min_marker_distance = check_int(
            "min_marker_distance", value("min_marker_distance", size // 4), minimum=0
        )
        self.params = {name: getattr(self, name) for name in given}

    def _problem(self, given: dict[str, int | None]) -> str | None:
        """Why images cannot be drawn with these parameters, or None."""
        size, radius = self.size, self.marker_radius

        def named(name: str) -> str:  # a derived value says so: the user never set it
            value = f"{name}={getattr(self, name)}"
            return value if given[name] is not None else f"{value} (not set: {DERIVED[name]})"

        if self.min_marker_distance < 2 * radius + 2:
            return (
                f"{named('min_marker_distance')} lets the two circles of radius {radius} touch "
                f"on the {size} x {size} image; set min_marker_distance >= {2 * radius + 2}"
            )
        span = self.contour_length * (self.dash + self.gap)
        if span > 4 * size:
            return (
                f"contour_length={self.contour_length} paddles of {named('dash')} and "
                f"gap={self.gap} make paths of {span} cells, too long for a {size} x {size} "
                f"image (at most {4 * size}); lower contour_length or dash"
            )
        rng, placed = random.Random(0), 0
        for i in range(PROBE_TRIES):
            try:
                self._try_image(rng, i % 2)
                placed += 1
            except _Failed:
                continue
            if placed == PROBE_PLACED:
                return None
        return (
            f"two snakes of contour_length={self.contour_length} paddles, {named('dash')}, "
            f"gap={self.gap}, their circles of marker_radius={radius} at least "
            f"{named('min_marker_distance')} apart, seldom fit a {size} x {size} image: "
            f"{placed} of {PROBE_TRIES} tries placed them (at least {PROBE_PLACED} needed); "
            "lower contour_length or dash"
        )

    def _smallest(self, given: dict[str, int | None]) -> str:
        """Where these parameters work: the smallest larger image at which they do, if any."""
        larger = copy.copy(self)
        for size in range(self.size + 1, 2 * self.size + 64):
            larger._configure(size, given)
            if larger._problem(given) is None:
                return (
                    f", or use seq_len >= {size * size} ({size} x {size}), the smallest that fits"
                )
        return ""

    def sample(self, n: int, seed: int) -> Batch:
        self._check_sample_args(n, seed)
        rng = random.Random(seed)
        labels = [i % 2 for i in range(n)]
        if n % 2:
            labels[-1] = rng.randrange(2)
        rng.shuffle(labels)
        images, distances, drawn = [], [], []
        for label in labels:
            image, distance, distractors = self._image(rng, label)
            images.append(image.reshape(-1))
            distances.append(distance)
            drawn.append(distractors)
        return Batch(
            inputs=torch.from_numpy(np.stack(images)).to(torch.int64),
            targets=torch.tensor(labels, dtype=torch.int64),
            padding_mask=None,
            slices={"distance": torch.tensor(distances, dtype=torch.int64)},
            meta={"distractors": drawn},
        )

    def _image(self, rng: random.Random, label: int) -> tuple[np.ndarray, int, int]:
        for _ in range(IMAGE_TRIES):
            try:
                return self._try_image(rng, label)
            except _Failed:
                continue
        raise ValueError(
            f"pathfinder could not place two snakes of {self.contour_length} paddles apart on a "
            f"{self.size} x {self.size} image in {IMAGE_TRIES} tries; lower contour_length, dash "
            "or min_marker_distance."
        )

    def _try_image(self, rng: random.Random, label: int) -> tuple[np.ndarray, int, int]:
        image = np.full((self.size, self.size), BACKGROUND, dtype=np.int8)
        blocked = np.zeros((self.size, self.size), dtype=bool)  # within gap + 1 of a snake
        first = self._snake(rng, blocked, self.contour_length, reserve=True)
        if first is None:
            raise _Failed
        second = self._snake(rng, blocked, self.contour_length, reserve=True)
        if second is None:
            raise _Failed
        if label:
            ends = [first[0], first[-1]]
        else:
            ends = [rng.choice((first[0], first[-1])), rng.choice((second[0], second[-1]))]
        distance = math.dist(*ends)
        if distance < self.min_marker_distance:
            raise _Failed
        distractors = 0
        for _ in range(self.num_distractors):
            snake = self._snake(rng, blocked, self.distractor_length, reserve=False)
            if snake is not None:
                self._draw(image, snake)
                distractors += 1
        self._draw(image, first)
        self._draw(image, second)
        for r, c in ends:
            for dy, dx in disc(self.marker_radius):
                image[r + dy, c + dx] = MARKER
        return image, int(distance), distractors

    def _draw(self, image: np.ndarray, snake: list[tuple[int, int]]) -> None:
        """Paint the drawn cells: the first ``dash`` of every ``dash + gap`` along the walk."""
        period = self.dash + self.gap
        for i, (r, c) in enumerate(snake):
            if i % period < self.dash:
                image[r, c] = PATH

    def _snake(
        self, rng: random.Random, blocked: np.ndarray, paddles: int, reserve: bool
    ) -> list[tuple[int, int]] | None:
        """A walk of ``paddles`` paddles clear of ``blocked`` (its cells, blank gaps included);
        with ``reserve`` its end discs must fit and be clear too. On success the snake's
        surroundings (and its end discs) are added to ``blocked``; None after SNAKE_TRIES."""
        margin = self.marker_radius if reserve else 0
        lo, hi = margin, self.size - 1 - margin
        ends = disc(self.marker_radius) if reserve else [(0, 0)]

        def free(r: int, c: int, offsets) -> bool:
            return all(
                0 <= r + dy < self.size and 0 <= c + dx < self.size and not blocked[r + dy, c + dx]
                for dy, dx in offsets
            )

        for _ in range(SNAKE_TRIES):
            start = (rng.randint(lo, hi), rng.randint(lo, hi))
            if not free(*start, ends):
                continue
            walk, heading = [start], rng.randrange(8)
            for index in range(paddles):
                # the first paddle holds the start cell; later ones begin with their gap
                count = self.dash - 1 if index == 0 else self.gap + self.dash
                turns = [0] if index == 0 else rng.sample((-1, 0, 1), 3)
                for turn in turns:
                    dy, dx = DIRECTIONS[(heading + turn) % 8]
                    r, c = walk[-1]
                    cells = [(r + dy * s, c + dx * s) for s in range(1, count + 1)]
                    if all(lo <= y <= hi and lo <= x <= hi and not blocked[y, x] for y, x in cells):
                        walk += cells
                        heading = (heading + turn) % 8
                        break
                else:
                    break
            else:
                if reserve and not free(*walk[-1], ends):
                    continue
                self._block(blocked, walk, ends if reserve else [])
                return walk
        return None

    def _block(self, blocked: np.ndarray, walk: list[tuple[int, int]], ends) -> None:
        """Mark every cell within gap + 1 (Chebyshev) of the walk and its end discs."""
        reach = self.gap + 1
        cells = set(walk)
        for r, c in (walk[0], walk[-1]):
            cells.update((r + dy, c + dx) for dy, dx in ends)
        for r, c in cells:
            blocked[max(r - reach, 0) : r + reach + 1, max(c - reach, 0) : c + reach + 1] = True


def solve(row: list[int], size: int, gap: int) -> int:
    """The label recomputed from the tokens alone: 1 when the two marker blobs lie in one
    component of the non-background pixels, cells within gap + 1 (Chebyshev) being adjacent.

    Independent of the generator: it sees only the image, finds the markers as 8-connected blobs
    of MARKER tokens, and searches breadth-first from the first blob.
    """
    image = [row[i * size : (i + 1) * size] for i in range(size)]
    foreground = {(r, c) for r in range(size) for c in range(size) if image[r][c] != BACKGROUND}
    markers = {(r, c) for r, c in foreground if image[r][c] == MARKER}
    blobs = _components(markers, 1)
    if len(blobs) != 2:
        raise ValueError(f"expected two marker blobs, found {len(blobs)}")
    reached = _components(foreground, gap + 1, start=next(iter(blobs[0])))[0]
    return int(bool(blobs[1] & reached))


def _components(
    cells: set[tuple[int, int]], reach: int, start: tuple[int, int] | None = None
) -> list[set[tuple[int, int]]]:
    """Components of ``cells`` with cells up to ``reach`` apart (Chebyshev) adjacent; with
    ``start``, only the component holding it."""
    left, out = set(cells), []
    while left:
        seed = start if start is not None else next(iter(left))
        left.discard(seed)
        component, queue = {seed}, deque([seed])
        while queue:
            r, c = queue.popleft()
            for dy in range(-reach, reach + 1):
                for dx in range(-reach, reach + 1):
                    cell = (r + dy, c + dx)
                    if cell in left:
                        left.discard(cell)
                        component.add(cell)
                        queue.append(cell)
        out.append(component)
        if start is not None:
            break
    return out
