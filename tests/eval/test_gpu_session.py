"""``bash eval/gpu_session.sh all LIMIT`` on a CPU with its stages faked (ZOO_GPU_SESSION_FAKE=1,
STAGE_CMD_<stage>): each stage stopped at its limit, the whole within LIMIT, the summary written
at the end and after a signal, its first lines right for the stubs' data."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "eval" / "gpu_session.sh"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash, timeout"
)


def environment(out: Path, **stages: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STAGE_CMD_", "ARGS_"))}
    env.update(OUT=str(out), ZOO_GPU_SESSION_FAKE="1", PYTHON=sys.executable, TAIL_LINES="2")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update({f"STAGE_CMD_{name}": command for name, command in stages.items()})
    return env


def stages(out: Path) -> dict[str, dict[str, str]]:
    lines = (out / "stages.tsv").read_text().splitlines()
    names = lines[0].split("\t")
    return {
        row["stage"]: row
        for row in (dict(zip(names, ln.split("\t"), strict=False)) for ln in lines[1:])
    }


def first_lines(out: Path) -> tuple[str, dict[str, str]]:
    text = (out / "summary.md").read_text()
    lines = text.splitlines()[:8]
    found = {}
    for line in lines:
        if match := re.match(r"- goal \((\w)\) [^:]*: (held|not held|not measured);", line):
            found[match[1]] = match[2]
    return "\n".join(lines), found


def stub_data(tmp_path: Path) -> tuple[Path, Path]:
    """A realization run (0.5 < 0.6: goal e not held) and a compile count (1 for 20: d held)."""
    cells = [
        {"variant": "full", "backend": "sdpa_dense", "n": 65536, "causal": False, "pass": "fwd",
         "params": {}, "status": "ok", "time_ms": 100.0},
        {"variant": "local", "backend": "auto", "n": 65536, "causal": False, "pass": "fwd",
         "params": {"window_size": 1024}, "status": "ok", "time_ms": 1.0,
         "sparsity_realization": 0.5, "allowed_pairs": 1, "all_pairs": 1},
    ]  # fmt: skip
    config = {"variants": ["local"], "backends": ["auto"], "peers": ["sdpa_dense"],
              "lengths": [65536], "passes": ["fwd"], "causal": [False],
              "params": {"local": {"window_size": 1024}}}  # fmt: skip
    bench = tmp_path / "realization.json"
    bench.write_text(json.dumps({"header": {"config": config}, "cells": cells}))
    compiles = tmp_path / "compiles.json"
    header = {"device": "stub", "config": {"backend": "flex"}}
    compiles.write_text(json.dumps({"header": header, "compiles": 1, "measured": 20,
                                    "compiled_at": [1000]}))  # fmt: skip
    return bench, compiles


def test_all_stops_each_stage_at_its_limit_and_summarises(tmp_path):
    out = tmp_path / "out"
    bench, compiles = stub_data(tmp_path)
    env = environment(
        out,
        tests='echo "....F"; echo "1 failed, 4 passed, 2 skipped in 0.10s"',
        realization=f'mkdir -p "$WORK/bench-realization" && '
        f'cp {bench} "$WORK/bench-realization/bench.json"',
        goals="sleep 100",  # past its limit
        moba="echo boom; exit 3",  # fails
        compiles=f'cp {compiles} "$OUT/compiles.json"',
    )
    start = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT), "all", "20"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    wall = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    assert wall < 20 + 5, wall
    rows = stages(out)
    assert list(rows) == [
        "env", "tests", "realization", "goals", "moba", "divisible", "overhead", "profile",
        "profile_moba", "decode", "decode_compiled", "compiles",
    ]  # fmt: skip
    goal = rows["goals"]
    assert goal["status"] == "stopped at its limit" and goal["exit"] == "124"
    assert float(goal["limit_s"]) == pytest.approx(20 * 0.15)  # its share of LIMIT
    assert float(goal["limit_s"]) <= float(goal["wall_s"]) < float(goal["limit_s"]) + 1.5
    assert rows["moba"]["status"] == "failed" and rows["moba"]["exit"] == "3"
    assert rows["profile"]["status"] == "faked" and rows["tests"]["status"] == "ok"
    assert sum(float(r["limit_s"]) for r in rows.values()) <= 20
    text, found = first_lines(out)
    assert "- GPU tests: 1 failed, 4 passed, 2 skipped (stage ok)" in text
    assert found == {"a": "not measured", "b": "not measured", "c": "not measured",
                     "d": "held", "e": "not held"}, text  # fmt: skip
    assert (out / "bench-realization.json").is_file() and (out / "compiles.json").is_file()


def test_a_signal_still_writes_the_summary(tmp_path):
    out = tmp_path / "out"
    env = environment(out, tests="sleep 100")
    command = ["bash", str(SCRIPT), "all", "60"]
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 20  # until the stage has started (its log is open)
        while not (out / "gpu-tests.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        assert time.monotonic() - start < 10  # not at the stage's limit (10 s) or later
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143
    assert stages(out)["tests"]["status"] == "interrupted"
    _, found = first_lines(out)
    assert set(found.values()) == {"not measured"} and len(found) == 5


def run_all(env: dict[str, str], limit: int, cwd: Path = ROOT, *args: str) -> None:
    """``bash eval/gpu_session.sh all LIMIT`` (or another stage: ``args``), which must succeed."""
    command = ["bash", str(SCRIPT), *(args or ("all", str(limit)))]
    run = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stdout


def test_shares_can_be_replaced_and_an_unnamed_stage_gets_none(tmp_path):
    out = tmp_path / "out"
    env = environment(out)
    env["ZOO_GPU_SESSION_SHARES"] = "env:10 tests:50"
    run_all(env, 20)
    rows = stages(out)
    assert float(rows["env"]["limit_s"]) == pytest.approx(2.0)
    assert float(rows["tests"]["limit_s"]) == pytest.approx(10.0)
    assert rows["goals"]["status"] == "skipped: no time left"


def test_bundle_packs_every_file_but_the_summary_and_the_stages(tmp_path):
    import tarfile

    out = tmp_path / "out"
    env = environment(out, goals='echo cells > "$OUT/bench-goals.log"')
    env["ZOO_GPU_SESSION_BUNDLE"] = "1"
    run_all(env, 20)
    assert sorted(p.name for p in out.iterdir()) == ["campaign.tar.gz", "stages.tsv", "summary.md"]
    with tarfile.open(out / "campaign.tar.gz") as archive:
        names = {Path(name).name for name in archive.getnames()}
        assert archive.extractfile("./bench-goals.log").read() == b"cells\n"
    assert {"environment.txt", "gpu-tests.txt", "goals.log"} <= names


@pytest.mark.parametrize("stage", ["all", "tests"])
def test_the_tests_stage_names_each_test_as_it_ends(tmp_path, stage):
    """pytest with -v (a line per test as it ends, also under xdist: a run stopped at its limit
    still names what passed and failed), -rfE and xdist's workers, in `all` and in `tests`; the
    other stages stubbed, python itself a stub for pytest and xdist's import."""
    out = tmp_path / "out"
    stub = tmp_path / "python"
    stub.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = pytest ]; then\n'
        '  printf "%s\\n" "$@" > "$OUT/args.txt"; exit 0\n'
        'fi\n'
        'if [ "$1" = -c ] && [ "$2" = "import xdist" ]; then exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )  # fmt: skip
    stub.chmod(0o755)
    stubbed = ["env", "realization", "goals", "moba", "overhead", "profile", "profile_moba",
               "decode", "compiles"]  # fmt: skip
    env = environment(out, **{name: "true" for name in stubbed})
    env.update(PYTHON=str(stub), ZOO_GPU_SESSION_FAKE="0", LIMIT="60")
    run_all({**env, "PYTHONPATH": str(ROOT)}, 60, tmp_path, *([] if stage == "all" else [stage]))
    args = (out / "args.txt").read_text().split()
    assert args[:4] == ["-m", "pytest", "-m", "gpu"], args
    assert {"-v", "-rfE"} <= set(args) and args[args.index("-n") + 1] == "12", args


def _cache_parts(folder: Path) -> list[Path]:
    return sorted(folder.glob("compile-cache.tar.gz.*"))


def _unpacked(parts: list[Path]) -> dict[str, bytes]:
    import io
    import tarfile

    data = b"".join(p.read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}


def _cache_env(tmp_path: Path, stage_command: str, **extra: str) -> dict[str, str]:
    env = environment(tmp_path / "out", tests=stage_command)
    env.update(ZOO_GPU_SESSION_CACHE=str(tmp_path / "kept"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), **extra)  # fmt: skip
    return env


def _kept_parts(tmp_path: Path, files: dict[str, bytes]) -> None:
    """A cache carried from an earlier session: ``files`` packed as its parts."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_000_000_000  # older than any command
            archive.addfile(info, io.BytesIO(data))
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "compile-cache.tar.gz.00").write_bytes(buffer.getvalue())


def test_the_compile_cache_is_restored_before_the_stages_and_packed_after(tmp_path):
    """The carried parts are unpacked into TORCHINDUCTOR_CACHE_DIR before the tests stage (which
    fails if it finds no earlier entry) and the cache, old entries and the stage's new ones, is
    packed into $OUT's parts at the end; what is not FX or AOTAutograd graphs stays behind."""
    _kept_parts(tmp_path, {"fxgraph/a/old": b"old"})
    stage = (
        'test -f "$TORCHINDUCTOR_CACHE_DIR/fxgraph/a/old" && mkdir -p '
        '"$TORCHINDUCTOR_CACHE_DIR/aotautograd/b" "$TORCHINDUCTOR_CACHE_DIR/triton" && '
        'echo new > "$TORCHINDUCTOR_CACHE_DIR/aotautograd/b/new" && '
        'echo t > "$TORCHINDUCTOR_CACHE_DIR/triton/t"'
    )
    run_all(_cache_env(tmp_path, stage), 20)
    assert stages(tmp_path / "out")["tests"]["status"] == "ok"
    parts = _cache_parts(tmp_path / "out")
    assert [p.name for p in parts] == ["compile-cache.tar.gz.00"]
    assert _unpacked(parts) == {"fxgraph/a/old": b"old", "aotautograd/b/new": b"new\n"}


def test_a_cache_over_its_parts_keeps_what_this_machine_compiled(tmp_path):
    """Parts of 4 KiB, at most 2: the carried 20 KiB of random bytes and the new entries are too
    many, so only what this machine compiled is packed, in both commands of a session on it (the
    second's parts hold the first's entry too); with no room even for that, no part is."""
    _kept_parts(tmp_path, {"fxgraph/a/old": os.urandom(20_000)})
    env = _cache_env(tmp_path, "", ZOO_GPU_SESSION_CACHE_PART_BYTES="4096",
                     ZOO_GPU_SESSION_CACHE_PARTS="2")  # fmt: skip
    for name in ("first", "second"):  # two commands on one machine: one cache folder
        env["OUT"] = str(tmp_path / name)
        env["STAGE_CMD_tests"] = (
            f'mkdir -p "$TORCHINDUCTOR_CACHE_DIR/fxgraph/{name}" && '
            f'echo {name} > "$TORCHINDUCTOR_CACHE_DIR/fxgraph/{name}/entry"'
        )
        run_all(env, 20)
    assert _unpacked(_cache_parts(tmp_path / "first")) == {"fxgraph/first/entry": b"first\n"}
    assert _unpacked(_cache_parts(tmp_path / "second")) == {
        "fxgraph/first/entry": b"first\n", "fxgraph/second/entry": b"second\n"
    }  # fmt: skip
    env.update(OUT=str(tmp_path / "none"), ZOO_GPU_SESSION_CACHE_PARTS="0")
    run_all(env, 20)
    assert _cache_parts(tmp_path / "none") == []


def test_a_failed_pack_leaves_no_part(tmp_path):
    """A gzip that fails half-way (a full disk, a signal) writes some bytes: no part is kept, so
    no truncated archive replaces the carried cache."""
    _kept_parts(tmp_path, {"fxgraph/a/old": b"old"})
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "gzip").write_text("#!/bin/sh\nhead -c 100\nexit 1\n")
    (fake / "gzip").chmod(0o755)
    env = _cache_env(tmp_path, "true")
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    run_all(env, 20)
    assert _cache_parts(tmp_path / "out") == []
    assert [p.name for p in _cache_parts(tmp_path / "kept")] == ["compile-cache.tar.gz.00"]


def test_without_a_carried_folder_nothing_is_packed(tmp_path):
    env = environment(tmp_path / "out", tests='mkdir -p "$TORCHINDUCTOR_CACHE_DIR/fxgraph"')
    env.pop("ZOO_GPU_SESSION_CACHE", None)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    run_all(env, 20)
    assert _cache_parts(tmp_path / "out") == []


@pytest.mark.parametrize(
    "shares, named",
    [
        ("env:4 decode-compiled:40 goals:20", ["'decode-compiled:40'", "decode_compiled"]),
        ("env:4 goals:12.5", ["'goals:12.5'", "whole number"]),
        ("env:4 goals", ["'goals'", "STAGE:PERCENT"]),
    ],
)
def test_shares_are_checked_before_any_stage(tmp_path, shares, named):
    """A misspelt stage got no time silently ("skipped: no time left") and a share of 12.5
    stopped the list there with an arithmetic error ("unknown stage all"): each is an error that
    names the word and what is expected, before any stage runs (exit 2)."""
    out = tmp_path / "out"
    env = {**environment(out), "ZOO_GPU_SESSION_SHARES": shares}
    done = subprocess.run(["bash", str(SCRIPT), "all", "20"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    for text in named:
        assert text in done.stderr
    assert not (out / "stages.tsv").exists()


@pytest.mark.parametrize(
    "piece, written, shipped",
    [
        ("bench", "bench-x/bench.json", "bench-x.json"),
        ("decode", "decode-x/bench-decode.json", "bench-decode.json"),
        ("standard", "standard-x/results.jsonl", "standard-x.jsonl"),
    ],
)
def test_a_piece_ships_only_the_file_this_command_wrote(tmp_path, piece, written, shipped):
    """On a warm machine an earlier command's file is still in the piece's folder: a command that
    fails before writing its own shipped that one as its result, exit 0. Now it ships nothing and
    exits 1; a command that writes its file ships it."""
    out, pieces = tmp_path / "out", tmp_path / "pieces"
    earlier = pieces / written
    earlier.parent.mkdir(parents=True)
    earlier.write_text("earlier command's\n")
    os.utime(earlier, (time.time() - 60, time.time() - 60))
    stub = tmp_path / "python"  # the environment's probe prints; the piece's command fails, or
    stub.write_text(  # with WRITE=1 writes its file into its out= folder
        "#!/bin/sh\n"
        'if [ "$1" = -c ]; then echo "torch stub"; exit 0; fi\n'
        'for a in "$@"; do case $a in out=*) dir=${a#out=} ;; esac; done\n'
        '[ "$WRITE" = 1 ] || { echo "RuntimeError: no kernel image" >&2; exit 1; }\n'
        f'mkdir -p "$dir" && echo "this command\'s" > "$dir/{Path(written).name}"\n'
    )  # fmt: skip
    stub.chmod(0o755)
    env = {**environment(out), "PYTHON": str(stub), "TMPDIR": str(pieces), "LIMIT": "20"}
    command = ["bash", str(SCRIPT), piece, "x"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "nothing shipped" in done.stderr and not (out / shipped).exists()
    done = subprocess.run(command, cwd=ROOT, env={**env, "WRITE": "1"}, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / shipped).read_text() == "this command's\n"
