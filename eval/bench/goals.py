"""``python -m eval goals OUT [OUT ...] [bandwidth_tbs=X] [summary=PATH] [goals=false]``: which
of the GPU campaign's goals hold, from the files that the stages of
``bash eval/gpu_session.sh all`` wrote in OUT (several OUTs, e.g. two sessions' folders, are read
together). Writes ``summary.md`` (its first lines: the GPU tests and each goal, held / not held /
not measured) and ``summary.json`` in the first OUT, or at ``summary=PATH``; ``goals=false``
writes the stage table alone.

A goal is "held" only where every cell it names was measured and passes; "not held" where a
measured cell fails (a cut-short stage can already show that); "not measured" otherwise (a stage
that did not run, was cut short before the cell, or failed). The goals and what each reads:

(a) ``bench-goals.json``, ``bench-realization.json``: at every cell of 8K-128K tokens that those
    configs list (eval/configs/bench_goals_gpu.yaml, bench_goals_realization_gpu.yaml, or the
    config in the file's header where it ran with overrides), the auto cell's time / its
    flex_standard twin's <= 1.05. An auto cell that ran where its twin failed (out of memory
    building a mask per head) passes; one that failed where its twin ran fails. MoBA is chosen by
    content and has no twin (goal b). The worst ratio per variant is reported.
(b) ``bench-moba.json`` (and the other bench files of the same folder): at 16K and 64K, each pass
    and causal setting, MoBA's auto time per allowed pair / the time per pair of its twin on auto,
    block_local with the parameters the same config gives it (three blocks of 512), never another
    pattern of the folder, <= 2; a twin whose pairs are not within 2x of MoBA's compares nothing.
    The pairs are the cells' ``allowed_pairs`` (MoBA's counted on the inputs it chose on).
(c) ``bench-decode*.json``: each (variant, length) step on auto takes at most 2x
    its memory floor, the bytes of the keys and values its pattern reads / the device's bandwidth
    (a table by device name, or ``bandwidth_tbs=``), and no longer than the sdpa_dense step over
    the whole cache. Keys read: the allowed keys of the query at the middle of the timed steps
    (per key/value head: the union over the query heads sharing it), from the zoo's pattern;
    MoBA: the keys its step's choice read, the union over the query heads sharing a key/value
    head (bench-decode's ``keys_read``; in a file without it, one head's: its own block so far and
    top_k - 1 whole blocks), plus one mean key per block before it.
    The step judged is the fastest of the eager (``zoo:VARIANT``) and the compiled one
    (``zoo:VARIANT+compile``: under CUDA graphs with a static cache, as decoders are served), in
    any bench-decode*.json of the folder; the figures name it and give the other's time. A step
    that failed in every form that ran (out of memory, an error) fails, its reason in the table.
    Each step's figures also give its time over the floor plus the machine's one-kernel step
    (bench-decode's ``one_kernel_ms``), told and not judged: a window's floor (about 1.3 us) is
    below what one kernel launch costs, so no step reaches 2x of it.
(d) ``compiles.json``: at most 2 compiles for 20 distinct lengths (``bench-compiles``) through
    the flex backend (the header's ``config.backend``: another backend's count holds nothing);
    more than 2 already counted fails even where fewer lengths ran.
(e) ``bench-realization.json``: sparsity realization (the achieved TFLOP/s on the pairs the pattern
    needs / dense FlashAttention's on all pairs, the bench's ``sparsity_realization``) >= 0.6 for
    local with 1024 keys on each side at 64K, on auto, at every pass and causal setting; an auto
    cell that failed (out of memory, an error) fails, its reason in the table.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CONFIGS = Path(__file__).parents[1] / "configs"
GOAL_RUNS = {  # stage name -> its config; the stage writes bench-NAME.json
    "goals": "bench_goals_gpu.yaml",
    "realization": "bench_goals_realization_gpu.yaml",
    "moba": "bench_goals_moba_gpu.yaml",
}
ROUTED = ("moba",)  # chosen by content: no flex_standard twin
A_LENGTHS, A_RATIO = (8192, 131072), 1.05
B_LENGTHS, B_FACTOR, B_PAIRS = (16384, 65536), 2.0, 2.0
B_TWIN = "block_local"  # MoBA's fixed twin, with the parameters the moba config gives it
C_FLOOR = 2.0
D_LENGTHS, D_COMPILES, D_BACKEND = 20, 2, "flex"
E_LENGTH, E_WINDOW, E_TARGET = 65536, 1024, 0.6
# Peak memory bandwidth in TB/s by device name (the first entry whose text the name contains).
BANDWIDTH_TBS = (
    ("GH200", 4.0), ("H200", 4.8), ("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35),
    ("A100-SXM4-80GB", 2.039), ("A100 80GB PCIe", 1.935), ("A100", 1.555),
)  # fmt: skip
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# The stages whose files each goal reads (goal (c) judges decode's and decode_compiled's steps)
STAGES = {"a": ("realization", "goals"), "b": ("moba",), "c": ("decode", "decode_compiled"),
          "d": ("compiles",), "e": ("realization",)}  # fmt: skip
TITLES = {
    "a": f"auto within {A_RATIO:g}x of flex_standard at every goal cell the runs asked for, "
    "8K-128K",
    "b": f"MoBA within {B_FACTOR:g}x of {B_TWIN} of the same density, 16K and 64K",
    "c": f"every decoding step within {C_FLOOR:g}x of its memory floor and no slower than SDPA "
    "over the whole cache",
    "d": f"at most {D_COMPILES} compiles for {D_LENGTHS} distinct lengths on {D_BACKEND}",
    "e": f"realization >= {E_TARGET:g} at 64K for local with {E_WINDOW} keys on each side",
}


@dataclass
class Goal:
    key: str
    verdict: str  # held | not held | not measured
    summary: str
    details: list[str] = field(default_factory=list)

    def line(self, stages: list[dict[str, str]] = ()) -> str:
        """The goal's line; stages of it that did not end well are named at its end."""
        ended = [
            f"stage {s['stage']} {s['status']}"
            for s in stages
            if s.get("stage") in STAGES[self.key] and s.get("status") not in ("ok", None)
        ]
        note = f" [{'; '.join(ended)}]" if ended else ""
        return f"- goal ({self.key}) {TITLES[self.key]}: {self.verdict}; {self.summary}{note}"


@dataclass
class Run:
    """One stage's bench.json."""

    name: str
    folder: Path
    header: dict
    cells: list[dict]
    complete: bool

    def index(self) -> dict[tuple, dict]:
        return {cell_key(c, c["backend"]): c for c in self.cells}


def verdict(failed: int, missing: int, measured: int) -> str:
    if failed:
        return "not held"
    if missing or not measured:
        return "not measured"
    return "held"


def pkey(params: dict | None) -> str:
    return json.dumps(params or {}, sort_keys=True)


def cell_key(cell: dict, backend: str) -> tuple:
    return (cell["variant"], backend, pkey(cell["params"]), cell["n"], cell["causal"], cell["pass"])


def point(n: int, causal: bool, pass_: str) -> str:
    size = f"{n // 1024}K" if n % 1024 == 0 else str(n)
    return f"{size} {'causal' if causal else 'non-causal'} {pass_}"


def _read_json(path: Path, problems: list[str]) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        problems.append(f"{path}: unreadable ({type(error).__name__}: {error})")
        return None


def load_runs(folders: list[Path], problems: list[str]) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {name: [] for name in GOAL_RUNS}
    for folder in folders:
        for name in GOAL_RUNS:
            data = _read_json(folder / f"bench-{name}.json", problems)
            if data is not None:
                run = Run(name, folder, data.get("header", {}), data.get("cells", []),
                          bool(data.get("complete")))  # fmt: skip
                runs[name].append(run)
    return runs


def configs(name: str, runs: dict[str, list[Run]]) -> list[dict]:
    """The grids a stage's runs asked for: each file's own config, or the stage's YAML."""
    found = []
    for run in runs[name]:
        config = dict(run.header.get("config") or {})
        if run.header.get("variants"):
            config["variants"] = run.header["variants"]  # globs expanded
        if config:
            found.append(config)
    return found or [yaml.safe_load((CONFIGS / GOAL_RUNS[name]).read_text())]


def _status(cell: dict | None) -> str:
    if cell is None:
        return "not run"
    reason = f": {cell['reason'][:120]}" if cell.get("reason") else ""
    return f"{cell['status']}{reason}"


def _ok(cell: dict | None) -> bool:
    return cell is not None and cell.get("status") == "ok" and bool(cell.get("time_ms"))


def _labels(keys: Iterable[tuple]) -> dict[tuple[str, str], str]:
    """Variant labels: the name, with its parameters where one variant has several sets."""
    keys = list(keys)
    sets: dict[str, set[str]] = {}
    for variant, params, *_ in keys:
        sets.setdefault(variant, set()).add(params)
    labels = {}
    for variant, params, *_ in keys:
        shown = ", ".join(f"{k}={v}" for k, v in json.loads(params).items())
        labels[(variant, params)] = (
            f"{variant} ({shown})" if len(sets[variant]) > 1 and shown else variant
        )
    return labels


def goal_a(runs: dict[str, list[Run]]) -> Goal:
    expected: set[tuple] = set()
    for name in ("goals", "realization"):
        for config in configs(name, runs):
            if "auto" not in config["backends"] or "flex_standard" not in config["peers"]:
                continue
            params = config.get("params") or {}
            for variant in config["variants"]:
                if variant in ROUTED:
                    continue
                for n in config["lengths"]:
                    if A_LENGTHS[0] <= n <= A_LENGTHS[1]:
                        for causal in config["causal"]:
                            for pass_ in config["passes"]:
                                key = (variant, pkey(params.get(variant)), n, causal, pass_)
                                expected.add(key)
    results: dict[tuple, tuple[float, str, bool]] = {}  # key -> (ratio or inf/0, note, within)
    for run in runs["goals"] + runs["realization"]:
        index = run.index()
        for key in expected:
            variant, params, n, causal, pass_ = key
            auto = index.get((variant, "auto", params, n, causal, pass_))
            twin = index.get((variant, "flex_standard", params, n, causal, pass_))
            if _ok(auto) and _ok(twin):
                ratio = auto["time_ms"] / twin["time_ms"]
                note = f"{auto['time_ms']:.3g} ms / {twin['time_ms']:.3g} ms"
                result = (ratio, note, ratio <= A_RATIO)
            elif _ok(auto) and twin is not None and twin.get("status") in ("oom", "skipped"):
                # "skipped": not run after its series ran out of memory at a shorter length (the
                # sweep's only skip), the same failure as "oom"; it read as not measured, so a
                # goal whose twin fails from some length on could never be held
                result = (0.0, f"auto ran, flex_standard {_status(twin)}", True)
            elif _ok(twin):
                result = (math.inf, f"auto {_status(auto)}", False)
            else:
                continue  # not measured in this run: neither ran, or the twin is missing or
                # failed other than out of memory (no comparison: a cut stage, a broken peer)
            if key not in results or result[0] > results[key][0]:
                results[key] = result
    failed = [k for k, r in results.items() if not r[2]]
    labels = _labels(expected)
    worst: dict[str, tuple] = {}
    for key, (ratio, note, _) in results.items():
        label = labels[key[:2]]
        if label not in worst or ratio > worst[label][0]:
            worst[label] = (ratio, note, key)
    parts = []
    for label in sorted({labels[k[:2]] for k in expected}):
        if label in worst:
            ratio, note, key = worst[label]
            shown = "inf" if math.isinf(ratio) else "-" if ratio == 0 else f"{ratio:.3g}"
            parts.append(f"{label} {shown} at {point(*key[2:])}")
        else:
            parts.append(f"{label} not measured")
    missing = len(expected) - len(results)
    summary = (
        f"worst auto / flex_standard per variant: {'; '.join(parts) or 'none'} "
        f"({len(results)} of {len(expected)} cells measured, {len(failed)} over {A_RATIO:g})"
    )
    details = [
        "| variant | point | auto / flex_standard | times or why |",
        "|---|---|---|---|",
    ]
    for key in sorted(expected, key=lambda k: (labels[k[:2]], k[2], k[3], k[4])):
        ratio, note, _ = results.get(key, (None, "not measured", False))
        shown = (
            "-" if ratio is None or ratio == 0 else "inf" if math.isinf(ratio) else f"{ratio:.3f}"
        )
        details.append(f"| {labels[key[:2]]} | {point(*key[2:])} | {shown} | {note} |")
    return Goal("a", verdict(len(failed), missing, len(results)), summary, details)


def _same_density(moba: dict, twins: list[dict]) -> dict | None:
    """The twin cell whose allowed pairs are nearest MoBA's, within B_PAIRS x (a twin of
    another density, from a config changed since, compares nothing)."""
    best, distance = None, math.log(B_PAIRS)
    for cell in twins:
        d = abs(math.log(cell["allowed_pairs"] / moba["allowed_pairs"]))
        if d <= distance:
            best, distance = cell, d
    return best


def goal_b(runs: dict[str, list[Run]]) -> Goal:
    expected: set[tuple] = set()
    twin_params: dict[str, str] = {}  # MoBA's parameters -> its twin's, from the same config
    for config in configs("moba", runs):
        if "moba" in config["variants"] and "auto" in config["backends"]:
            params = pkey((config.get("params") or {}).get("moba"))
            twin_params[params] = pkey((config.get("params") or {}).get(B_TWIN))
            for n in B_LENGTHS:
                for causal in config["causal"]:
                    for pass_ in config["passes"]:
                        expected.add((params, n, causal, pass_))
    folders = {run.folder for name in runs for run in runs[name]}
    results: dict[tuple, tuple[float, str, bool]] = {}
    for folder in folders:
        cells = [c for name in runs for r in runs[name] if r.folder == folder for c in r.cells]
        for key in expected:
            params, n, causal, pass_ = key
            here = [
                c for c in cells
                if (c["n"], c["causal"], c["pass"], c["backend"]) == (n, causal, pass_, "auto")
            ]  # fmt: skip
            # Only the twin the config names: any fixed pattern of a similar density in the
            # folder (local with 1024 keys on each side, from the realization stage) was taken
            # where its pairs were nearer MoBA's, and the goal's ratio changed with the folder.
            fixed = [
                c for c in here
                if c["variant"] == B_TWIN and pkey(c["params"]) == twin_params[params]
                and _ok(c) and c.get("allowed_pairs")
            ]  # fmt: skip
            for moba in [c for c in here if c["variant"] == "moba" and pkey(c["params"]) == params]:
                if not _ok(moba):
                    if fixed:
                        result = (math.inf, f"MoBA {_status(moba)}", False)
                    else:
                        continue
                elif not moba.get("allowed_pairs"):
                    continue
                else:
                    twin = _same_density(moba, fixed)
                    if twin is None:
                        continue
                    per_pair = moba["time_ms"] / moba["allowed_pairs"]
                    ratio = per_pair / (twin["time_ms"] / twin["allowed_pairs"])
                    shown = ", ".join(f"{k}={v}" for k, v in (twin["params"] or {}).items())
                    note = (
                        f"MoBA {moba['time_ms']:.3g} ms on {moba['allowed_pairs']:.3g} pairs; "
                        f"{twin['variant']} ({shown}) {twin['time_ms']:.3g} ms on "
                        f"{twin['allowed_pairs']:.3g} pairs"
                    )
                    others = [
                        c for c in cells
                        if c["variant"] == "moba" and c["backend"] != "auto" and _ok(c)
                        and (c["n"], c["causal"], c["pass"]) == (n, causal, pass_)
                    ]  # fmt: skip
                    for other in others:  # named backends (blocked's runs): candidates for auto
                        note += f"; MoBA on {other['backend']} {other['time_ms']:.3g} ms"
                    result = (ratio, note, ratio <= B_FACTOR)
                if key not in results or result[0] > results[key][0]:
                    results[key] = result
    failed = [k for k, r in results.items() if not r[2]]
    worst = max(results.items(), key=lambda item: item[1][0], default=None)
    summary = (
        f"worst MoBA time per pair / its {B_TWIN} twin's: {worst[1][0]:.3g} at "
        f"{point(*worst[0][1:])}"
        if worst
        else f"no MoBA cell with its {B_TWIN} twin of the same density"
    ) + f" ({len(results)} of {len(expected)} cells measured)"
    details = ["| point | per-pair ratio | cells |", "|---|---|---|"]
    for key in sorted(expected, key=lambda k: k[1:]):
        ratio, note, _ = results.get(key, (None, "not measured", False))
        shown = "-" if ratio is None else "inf" if math.isinf(ratio) else f"{ratio:.3f}"
        details.append(f"| {point(*key[1:])} | {shown} | {note} |")
    return Goal("b", verdict(len(failed), len(expected) - len(results), len(results)), summary,
                details)  # fmt: skip


def bandwidth_tbs(device: str, override: float | None) -> float | None:
    if override:
        return override
    for name, value in BANDWIDTH_TBS:
        if name.lower() in device.lower():
            return value
    return None


def keys_read(
    variant: str, params: dict, position: int, heads: int, kv_heads: int,
    measured: float | None = None,
) -> tuple:  # fmt: skip
    """(keys and values read per key/value head, mean keys read besides) by one decoding step of
    the query at ``position`` (keys 0..position), from the zoo's pattern; for a pattern chosen
    by content, ``measured`` (bench-decode's ``keys_read``) where the file has it."""
    import torch

    import zoo
    from zoo.functional import resolve_pattern
    from zoo.layout.block_layout import specialized

    pattern = resolve_pattern(variant, True, dict(params))
    if pattern.routed:  # MoBA: what its query heads chose (else one head's), and the means
        merged = {**zoo.get_spec(variant).params, **params}
        block, top_k = merged["block_size"], merged["top_k"]
        earlier = position // block
        if measured is not None:
            return measured, earlier
        return position % block + 1 + min(top_k - 1, earlier) * block, earlier
    length = position + 1
    pattern = specialized(pattern, length, length, torch.device("cpu")).for_heads(heads)
    allowed = pattern.allowed_at(
        torch.zeros(1, 1, dtype=torch.long), torch.arange(heads)[:, None],
        torch.full((1, 1), position), torch.arange(length)[None, :],
    ).expand(heads, length)  # fmt: skip
    per_kv = allowed.reshape(kv_heads, heads // kv_heads, length).any(1).sum(-1)
    return float(per_kv.float().mean()), 0


def goal_c(folders: list[Path], bandwidth: float | None, problems: list[str]) -> Goal:
    expected: set[tuple] = set()
    results: dict[tuple, tuple] = {}  # floor ratio, sdpa ratio, note, failed, complete
    floors_unknown = []
    for folder in folders:
        # Every bench-decode*.json of the folder (the eager steps, and a second file of
        # compiled ones, say): per (variant, length) the fastest zoo step on auto, eager or
        # compiled, is the one judged; SDPA's fastest is its peer.
        steps: dict[tuple, dict[str, tuple]] = {}  # (variant, n) -> kind -> (ms, header, config)
        sdpa_ms: dict[tuple, float] = {}
        broken: dict[tuple, dict[str, str]] = {}  # (variant, n) -> kind -> why it has no time
        for path in sorted(folder.glob("bench-decode*.json")):
            data = _read_json(path, problems)
            if data is None:
                continue
            header, cells = data.get("header", {}), data.get("cells", [])
            config = header.get("config") or {}
            expected |= {
                (v, n) for v in config.get("variants", []) for n in config.get("lengths", [])
            }
            for c in cells:
                key, ms = (c["variant"], c["n"]), c.get("ms")
                kind = {f"zoo:{c['variant']}": "eager", f"zoo:{c['variant']}+compile": "compiled"}
                if not ms:
                    if c["impl"] in kind:
                        why = c.get("reason") or c.get("status") or "no time"
                        # one line: a reason's newline would break the summary's table row
                        broken.setdefault(key, {})[kind[c["impl"]]] = " ".join(str(why).split())[
                            :80
                        ]
                    continue
                if c["impl"] == "sdpa_dense":
                    sdpa_ms[key] = min(sdpa_ms.get(key, ms), ms)
                if c["impl"] in kind:
                    mine = steps.setdefault(key, {})
                    if kind[c["impl"]] not in mine or ms < mine[kind[c["impl"]]][0]:
                        mine[kind[c["impl"]]] = (ms, header, config, c.get("keys_read"))
        for (variant, n), kinds in steps.items():
            best = min(kinds, key=lambda kind: kinds[kind][0])
            step_ms, header, config, measured = kinds[best]
            sdpa = sdpa_ms.get((variant, n))
            bw = bandwidth_tbs(header.get("device", ""), bandwidth)
            launch_ms = header.get("one_kernel_ms")
            if bw is None:
                floors_unknown.append(header.get("device", "?"))
            dtype = str(header.get("shape", "")).rsplit(",", 1)[-1].strip()
            size = BYTES.get(dtype, 2)
            heads = config.get("heads", 1)
            kv_heads = config.get("kv_heads") or heads
            batch, head_dim = config.get("batch", 1), config.get("head_dim", 64)
            position_after = 1 + config.get("warmup", 0) + config.get("repeats", 0) // 2
            sdpa_ratio = step_ms / sdpa if sdpa else None
            floor_ratio, note = None, ""
            if bw is not None:
                params = (config.get("params") or {}).get(variant, {})
                try:
                    keys, means = keys_read(
                        variant, params, n + position_after, heads, kv_heads, measured
                    )
                except Exception as error:  # a variant the zoo cannot resolve here
                    note = f"keys read unknown ({type(error).__name__}: {error})"
                else:
                    nbytes = batch * kv_heads * head_dim * size * (2 * keys + means)
                    floor_ms = nbytes / (bw * 1e12) * 1e3
                    floor_ratio = step_ms / floor_ms
                    note = f"{keys:.0f} keys, floor {floor_ms * 1e3:.3g} us"
                    if launch_ms:  # told, not judged: the goal's floor is the memory's
                        with_launch = step_ms / (floor_ms + launch_ms)
                        note += (
                            f"; {with_launch:.3g}x the floor plus one kernel's step "
                            f"({launch_ms * 1e3:.3g} us)"
                        )
            others = "".join(
                f"; {kind} {kinds[kind][0]:.3g} ms" for kind in sorted(kinds) if kind != best
            )
            others += "".join(
                f"; {kind} failed: {why}"
                for kind, why in sorted(broken.get((variant, n), {}).items())
                if kind not in kinds
            )
            note = f"step {step_ms:.3g} ms ({best}{others}); {note}" + (
                f"; sdpa_dense {sdpa:.3g} ms" if sdpa_ratio is not None else ""
            )
            failed = (floor_ratio is not None and floor_ratio > C_FLOOR) or (
                sdpa_ratio is not None and sdpa_ratio > 1
            )
            complete = floor_ratio is not None and sdpa_ratio is not None
            # A failure wins over what another folder measured; a step judged in full wins over
            # one that could not be (no bandwidth known for its device), whichever came first.
            before = results.get((variant, n))
            if before is None or failed or not (before[3] or before[4]):
                results[(variant, n)] = (floor_ratio, sdpa_ratio, note, failed, complete)
        for key, whys in broken.items():
            if key in steps:
                continue  # its other form was timed and is judged above, this failure named
            # A step that ran and failed (out of memory, an error) is no step within the goal:
            # not held, as goal (a)'s failed auto cell (it read as not measured, its reason lost).
            note = "; ".join(f"{kind} failed: {why}" for kind, why in sorted(whys.items()))
            results[key] = (math.inf, math.inf, note, True, False)
    if not expected:
        return Goal("c", "not measured", "no bench-decode.json (stage decode did not run)")
    failed = [k for k, r in results.items() if r[3]]
    measured = [k for k, r in results.items() if r[4] or r[3]]
    parts = []
    for variant in sorted({v for v, _ in expected}):
        mine = [r for (v, _), r in results.items() if v == variant]
        floors = [r[0] for r in mine if r[0] is not None]
        sdpas = [r[1] for r in mine if r[1] is not None]
        if not mine:
            parts.append(f"{variant} not measured")
            continue
        lost = sorted(n for (v, n), r in results.items() if v == variant and r[0] == math.inf)
        if lost:
            parts.append(f"{variant} step failed at n = {', '.join(map(str, lost))}")
            continue
        floor = f"{max(floors):.3g}x floor" if floors else "floor unknown"
        sdpa = f"{max(sdpas):.3g}x sdpa" if sdpas else "no sdpa"
        parts.append(f"{variant} {floor}, {sdpa}")
    summary = f"worst per variant: {'; '.join(parts) or 'none'}" + (
        f" ({len(measured)} of {len(expected)} steps measured"
        + (
            f"; no bandwidth known for {', '.join(sorted(set(floors_unknown)))}: "
            "give bandwidth_tbs="
            if floors_unknown
            else ""
        )
        + ")"
    )
    details = [
        "| variant | n | step / floor | step / sdpa_dense | figures |",
        "|---|---|---|---|---|",
    ]
    for key in sorted(expected):
        floor, sdpa, note, *_ = results.get(key, (None, None, "not measured", False, False))
        f = "-" if floor is None else f"{floor:.3g}"
        s = "-" if sdpa is None else f"{sdpa:.3g}"
        details.append(f"| {key[0]} | {key[1]} | {f} | {s} | {note} |")
    missing = len(expected) - len(measured)
    return Goal("c", verdict(len(failed), missing, len(measured)), summary, details)


def goal_d(folders: list[Path], problems: list[str]) -> Goal:
    found = [d for f in folders if (d := _read_json(f / "compiles.json", problems)) is not None]
    if not found:
        return Goal("d", "not measured", "no compiles.json (stage compiles did not run)")

    def backend(data: dict) -> str:
        return str((data.get("header", {}).get("config") or {}).get("backend", "no backend named"))

    # The goal is flex's (its kernel of symbolic lengths): a count through another backend, such
    # as sdpa's no compiles at all, held it.
    counted = [d for d in found if backend(d) == D_BACKEND]
    if not counted:
        others = ", ".join(sorted({backend(d) for d in found}))
        return Goal("d", "not measured", f"compiles.json counted on {others}, not {D_BACKEND}")
    data = max(counted, key=lambda d: (d.get("compiles", 0) > D_COMPILES, d.get("measured", 0)))
    compiles, measured = data.get("compiles", 0), data.get("measured", 0)
    call = data.get("header", {}).get("call", "")
    summary = (
        f"{compiles} compiles for {measured} distinct lengths on "
        f"{data.get('header', {}).get('device', '?')} (compiled at n = "
        f"{', '.join(map(str, data.get('compiled_at', []))) or 'none'})"
    )
    failed = compiles > D_COMPILES
    missing = measured < D_LENGTHS
    details = [f"Call: {call}."] + (
        [f"{data['errors']} lengths failed: see compiles.json."] if data.get("errors") else []
    )
    return Goal("d", verdict(int(failed), int(missing), measured), summary, details)


def goal_e(runs: dict[str, list[Run]]) -> Goal:
    expected: set[tuple] = set()
    for config in configs("realization", runs):
        params = (config.get("params") or {}).get("local") or {}
        if "local" in config["variants"] and params.get("window_size") == E_WINDOW:
            for causal in config["causal"]:
                for pass_ in config["passes"]:
                    expected.add((pkey(params), causal, pass_))
    results: dict[tuple, tuple[float, str]] = {}
    for run in runs["realization"] + runs["goals"]:
        index = run.index()
        for key in expected:
            params, causal, pass_ = key
            cell = index.get(("local", "auto", params, E_LENGTH, causal, pass_))
            dense = index.get(("full", "sdpa_dense", "{}", E_LENGTH, causal, pass_))
            if cell is None:
                continue
            if not _ok(cell):
                # It ran and failed (out of memory, an error): it realizes nothing, so not held,
                # as goal (a)'s failed auto cell (it read as not measured, its reason lost).
                value, note = 0.0, f"auto {_status(cell)}"
            else:
                value = cell.get("sparsity_realization")
                if value is None and _ok(dense) and cell.get("allowed_pairs"):
                    value = (dense["time_ms"] / cell["time_ms"]) * (
                        cell["allowed_pairs"] / cell["all_pairs"]
                    )
                if value is None:
                    continue  # nothing to compute its realization from
                note = f"{cell['time_ms']:.3g} ms" + (
                    f", dense {dense['time_ms']:.3g} ms" if _ok(dense) else ""
                )
            if key not in results or value < results[key][0]:
                results[key] = (value, note)
    failed = [k for k, (value, _) in results.items() if value < E_TARGET]
    worst = min(results.items(), key=lambda item: item[1][0], default=None)
    summary = (
        f"lowest {worst[1][0]:.3g} at {point(E_LENGTH, *worst[0][1:])}"
        if worst
        else "no local (1024 each side) cell at 64K with a dense peer"
    ) + f" ({len(results)} of {len(expected)} cells measured)"
    details = ["| point | realization | times |", "|---|---|---|"]
    for key in sorted(expected, key=lambda k: k[1:]):
        value, note = results.get(key, (None, "not measured"))
        details.append(
            f"| {point(E_LENGTH, *key[1:])} | {'-' if value is None else f'{value:.3f}'} | {note} |"
        )
    missing = len(expected) - len(results)
    return Goal("e", verdict(len(failed), missing, len(results)), summary, details)


def read_stages(folders: list[Path]) -> list[dict[str, str]]:
    rows = []
    for folder in folders:
        path = folder / "stages.tsv"
        if not path.is_file():
            continue
        lines = path.read_text().splitlines()
        names = lines[0].split("\t") if lines else []
        rows += [dict(zip(names, line.split("\t"), strict=False)) for line in lines[1:] if line]
    return rows


_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def tests_line(folders: list[Path], stages: list[dict[str, str]]) -> str:
    """The GPU tests' counts from pytest's last summary line, and how the stage ended."""
    stage = next((s for s in stages if s.get("stage") == "tests"), None)
    how = f" (stage {stage['status']})" if stage else ""
    for folder in folders:
        path = folder / "gpu-tests.txt"
        if not path.is_file():
            continue
        # How this folder's tests stage ended, not another folder's: `gpu_session.sh tests`
        # writes gpu-tests.txt and no stages.tsv, while `all` in another OUT records its tests
        # stage "skipped: no time left", which was told beside the counts of tests that ran.
        own = stages if len(folders) == 1 else read_stages([folder])
        stage = next((s for s in own if s.get("stage") == "tests"), None)
        how = f" (stage {stage['status']})" if stage else ""
        text = path.read_text(errors="replace")
        failed = _failed_names(text)
        for line in reversed(text.splitlines()):
            if _COUNT.search(line) and re.search(r" in [\d.]+s", line):
                counts = ", ".join(f"{n} {what}" for n, what in _COUNT.findall(line))
                return f"- GPU tests: {counts}{how}{failed}"
        interrupted = "KeyboardInterrupt" in text or "Interrupted" in text
        ended = _per_test(text)
        seen = ""
        if ended:
            counts = ", ".join(f"{n} {what.lower()}" for what, n in ended.items())
            seen = f"; the tests that ended: {counts}"
        return (
            f"- GPU tests: no pytest summary{' (interrupted)' if interrupted else ''}{how}{seen}"
            f"{failed}"
        )
    return f"- GPU tests: not run{how}"


# A test's line under -v: "tests/a.py::t[x] PASSED [ 5%]", or with xdist
# "[gw3] [ 45%] PASSED tests/a.py::t[x]".
_ENDED = re.compile(
    r"^(?:\[gw\d+\] \[ *\d+%\] (?P<s1>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (?P<n1>\S+::\S+)"
    r"|(?P<n2>\S+::\S+) (?P<s2>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b)"
)
NAMED_FAILURES = 12


def _per_test(text: str) -> dict[str, int]:
    """Counts of the -v lines' outcomes, the last line of each test counting (an ERROR in a
    teardown follows a PASSED)."""
    outcome: dict[str, str] = {}
    for line in text.splitlines():
        if match := _ENDED.match(line.strip()):
            outcome[match["n1"] or match["n2"]] = match["s1"] or match["s2"]
    counts: dict[str, int] = {}
    for status in outcome.values():
        counts[status] = counts.get(status, 0) + 1
    return counts


def _failed_names(text: str) -> str:
    """ "; failed: a, b, ..." from the -v lines and -rfE's summary, the first NAMED_FAILURES."""
    names = []
    for line in text.splitlines():
        line = line.strip()
        match = _ENDED.match(line)
        if match and (match["s1"] or match["s2"]) in ("FAILED", "ERROR"):
            names.append(match["n1"] or match["n2"])
        elif line.startswith(("FAILED ", "ERROR ")):
            names.append(line.split()[1])
    names = list(dict.fromkeys(names))
    if not names:
        return ""
    more = f" and {len(names) - NAMED_FAILURES} more" if len(names) > NAMED_FAILURES else ""
    return "; failed: " + ", ".join(names[:NAMED_FAILURES]) + more


def twin_rows(cells: list[dict[str, Any]]) -> list[tuple[dict, dict]]:
    """(zoo cell, its flex_standard twin) for every point where both ran."""

    def key(c):
        return c["variant"], json.dumps(c["params"], sort_keys=True), c["n"], c["causal"], c["pass"]

    ok = [c for c in cells if c["status"] == "ok" and c.get("step_ms")]
    twins = {key(c): c for c in ok if c["backend"] == "flex_standard"}
    return [(c, twins[key(c)]) for c in ok if c["kind"] == "zoo" and key(c) in twins]


def profile_section(folders: list[Path], problems: list[str]) -> list[str]:
    lines = []
    for folder in folders:
        data = _read_json(folder / "profile.json", problems)
        if not data:
            continue
        rows = twin_rows(data.get("cells", []))
        ok = sum(1 for c in data.get("cells", []) if c.get("status") == "ok")
        lines += [
            f"{ok} cells profiled in {folder / 'profile.md'} ({data['header'].get('device')}). "
            "Each zoo cell beside its flex_standard twin, per step:",
            "",
            "| variant | point | impl | step / twin | kernel ms, twin's | gap ms, twin's |",
            "|---|---|---|---|---|---|",
        ]
        for c, t in rows:
            lines.append(
                f"| {c['variant']} | {point(c['n'], c['causal'], c['pass'])} | "
                f"{c['backend']}->{c['resolved']} | {c['step_ms'] / t['step_ms']:.3f} | "
                f"{c['kernel_ms']:.3g}, {t['kernel_ms']:.3g} | {c['gap_ms']:.3g}, "
                f"{t['gap_ms']:.3g} |"
            )
        lines.append("")
    return lines


def overhead_line(folders: list[Path], problems: list[str]) -> str:
    """The host time a call adds around its stubbed kernel (``bench-overhead``), its range over
    the measured cells per backend: what no GPU kernel's speed changes."""
    for folder in folders:
        data = _read_json(folder / "overhead.json", problems)
        cells = (data or {}).get("cells", [])
        if not cells:
            continue
        ranges = []
        for backend in sorted({c["backend"] for c in cells}):
            mine = [c for c in cells if c["backend"] == backend]
            # A cell that raised is recorded with its status and reason and no times: it is
            # counted as failed, not read as a time (it raised KeyError and no summary came).
            added = [c["added_us"] for c in mine if c.get("added_us") is not None]
            shown = (
                f"{backend} {min(added):.3g}-{max(added):.3g} us over {len(added)} cells"
                if added
                else f"{backend} not measured"
            )
            failed = len(mine) - len(added)
            ranges.append(shown + (f" ({failed} failed: see overhead.json)" if failed else ""))
        device = data.get("header", {}).get("device", "?")
        return f"- host time a call adds around its kernel ({device}): {'; '.join(ranges)}"
    return "- host time a call adds around its kernel: not measured"


def device_of(folders: list[Path]) -> str:
    for folder in folders:
        path = folder / "environment.txt"
        if path.is_file():
            text = path.read_text(errors="replace").strip()
            if text:
                return text.splitlines()[0]
    return "unknown"


def summarise(folders: list[Path], bandwidth: float | None = None, with_goals: bool = True):
    """(summary.md text, summary.json data) from the stages' files in ``folders``."""
    problems: list[str] = []
    stages = read_stages(folders)
    goals: list[Goal] = []
    if with_goals:
        runs = load_runs(folders, problems)
        goals = [
            goal_a(runs), goal_b(runs), goal_c(folders, bandwidth, problems),
            goal_d(folders, problems), goal_e(runs),
        ]  # fmt: skip
    held = sum(g.verdict == "held" for g in goals)
    title = "GPU campaign: which goals hold" if with_goals else "GPU session: its stages"
    lines = [f"# {title}", ""]
    if with_goals:
        lines += [tests_line(folders, stages), *[g.line(stages) for g in goals]]
        overhead = overhead_line(folders, problems)
        lines += [overhead, ""]
        lines.append(f"{held} of {len(goals)} goals held.")
    lines += [
        f"From {', '.join(map(str, folders))}; {device_of(folders)}. Made by `python -m eval "
        "goals` (eval/bench/goals.py says how each goal is computed).",
        "",
    ]
    if stages:
        lines += ["## Stages", "", "| stage | limit s | wall s | exit | status |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for s in stages:
            lines.append(
                f"| {s.get('stage')} | {s.get('limit_s')} | {s.get('wall_s')} | {s.get('exit')} | "
                f"{s.get('status')} |"
            )
        lines.append("")
    for goal in goals:
        lines += [f"## Goal ({goal.key}): {TITLES[goal.key]}", "", goal.line(stages)[2:], ""]
        lines += [*goal.details, ""] if goal.details else []
    if with_goals:
        profile = profile_section(folders, problems)
        lines += ["## Profile", "", *(profile or ["No profile.json (stage profile did not run)."])]
    if problems:
        lines += ["", "## Files that could not be read", "", *[f"- {p}" for p in problems]]
    data = {
        "goals": {g.key: {"verdict": g.verdict, "summary": g.summary} for g in goals},
        "tests": tests_line(folders, stages)[2:] if with_goals else None,
        "overhead": overhead[2:] if with_goals else None,
        "stages": stages,
        "problems": problems,
    }
    return "\n".join(lines).rstrip() + "\n", data


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m eval goals", description=__doc__.split(":")[0])
    parser.add_argument(
        "items", nargs="+", help="OUT folders, then key=value: bandwidth_tbs=3.35 "
        "summary=PATH goals=false",
    )  # fmt: skip
    items = parser.parse_args(argv).items
    options = dict(item.split("=", 1) for item in items if "=" in item)
    folders = [Path(item) for item in items if "=" not in item]
    unknown = set(options) - {"bandwidth_tbs", "summary", "goals"}
    if unknown or not folders:
        print(f"error: unknown options {sorted(unknown)} or no OUT folder", file=sys.stderr)
        return 2
    missing = [str(folder) for folder in folders if not folder.is_dir()]
    if missing:  # a misspelt folder read as one where nothing was measured
        print(f"error: no such OUT folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        bandwidth = float(options["bandwidth_tbs"]) if "bandwidth_tbs" in options else None
    except ValueError:
        print(f"error: bandwidth_tbs must be a number, got {options['bandwidth_tbs']}",
              file=sys.stderr)  # fmt: skip
        return 2
    with_goals = options.get("goals", "true").lower() not in ("false", "0", "no")
    text, data = summarise(folders, bandwidth, with_goals)
    path = Path(options.get("summary", folders[0] / "summary.md"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.with_suffix(".json").write_text(json.dumps(data, indent=1))
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
