#!/usr/bin/env python3
"""Runs the workspace's tests, each in a process of its own, a few side by side.

    cargo test --workspace --no-run --message-format=json-render-diagnostics > ARTIFACTS
    deploy/local/run-tests.py ARTIFACTS [-j N] [PATTERN...]

The test binaries are those `cargo test --workspace` runs (libraries, binaries, integration tests,
in the test profile), read from cargo's JSON artifact messages. Each binary lists its tests
(`--list`); each test runs as `<binary> <test> --exact --nocapture` in its package's directory,
the way `cargo test` runs it, but alone in its process and in a process group of its own.
deploy/local/test-groups.toml says how many run at once, which may not overlap and which start
first. A PATTERN (a Python regular expression) selects the tests whose name
(`<package>[::<target>] <test path>`, e.g. `chaos::it e2e_prefix::conversations_stick…`)
it matches; without one, every test runs. Ignored tests are not run, as with `cargo test`.

A test fails when it exits non-zero, runs past the timeout (its process group is killed), or
leaves processes behind in its group (they are killed). The output of a failing test is printed
and kept in target/testrun/logs/; every test's start, duration and result are written to
target/testrun/timings.tsv. Exit status 0 only if every selected test passed.

(Why not cargo-nextest, which does this and more: it is not packaged anywhere this project may
install from except as source, and compiling it costs a fresh machine 5–8 minutes of its two
cores, more than it saves.)
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Test:
    def __init__(self, binary, name):
        self.binary = binary
        self.name = name
        self.id = f"{binary['id']} {name}"
        self.groups = []
        self.order = 0
        self.proc = None
        self.log = None
        self.start = 0.0
        self.duration = 0.0
        self.status = None


def package_name(manifest):
    with open(manifest, "rb") as f:
        return tomllib.load(f)["package"]["name"]


def binaries(artifacts):
    """The test binaries `cargo test --workspace` runs, in build order."""
    found, names = [], {}
    with open(artifacts, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
                continue
            if not msg["profile"]["test"]:
                continue
            kinds, target = msg["target"]["kind"], msg["target"]["name"]
            manifest = msg["manifest_path"]
            if manifest not in names:
                names[manifest] = package_name(manifest)
            pkg = names[manifest]
            if "lib" in kinds or "rlib" in kinds:
                bid = pkg
            elif "bin" in kinds:
                bid = f"{pkg}::bin/{target}"
            elif "test" in kinds:
                bid = f"{pkg}::{target}"
            else:
                continue  # benches and examples: built and linted, not run (as `cargo test`)
            found.append(
                {
                    "id": bid,
                    "package": pkg,
                    "exe": msg["executable"],
                    "cwd": str(Path(manifest).parent),
                }
            )
    return found


def env_for(binary):
    env = dict(os.environ)
    env["CARGO_MANIFEST_DIR"] = binary["cwd"]
    env["CARGO_PKG_NAME"] = binary["package"]
    return env


def list_tests(binary):
    def names(*extra):
        out = subprocess.run(
            [binary["exe"], "--list", "--format", "terse", *extra],
            cwd=binary["cwd"],
            env=env_for(binary),
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            sys.exit(f"run-tests: listing {binary['exe']} failed:\n{out.stderr}")
        return [l[: -len(": test")] for l in out.stdout.splitlines() if l.endswith(": test")]

    ignored = set(names("--ignored"))
    return [Test(binary, n) for n in names() if n not in ignored]


def group_members(pgid):
    """The live processes of process group `pgid`, with their command lines (from /proc). A zombie
    (a process that has exited, waiting for its parent or init to reap it) is not one."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            # pid (comm) state ppid pgrp …: comm may hold spaces and parentheses.
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] == "Z" or int(fields[2]) != pgid:
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{d.name}: {cmd.strip()}")
        except (OSError, ValueError, IndexError):
            continue
    return found


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_all(pending, running, threads, groups, in_group, start, finish, timeout):
    """Starts the pending tests in order as slots and their groups allow, until all are done."""
    while pending or running:
        started = True
        while started and len(running) < threads:
            started = False
            for t in pending:
                if all(in_group[g] < groups[g]["max"] for g in t.groups):
                    pending.remove(t)
                    start(t)
                    started = True
                    break
        time.sleep(0.02)
        now = time.monotonic()
        for t in list(running):
            code = t.proc.poll()
            if code is not None:
                finish(t, "PASS" if code == 0 else "FAIL")
            elif now - t.start > timeout:
                kill_group(t.proc.pid)
                t.proc.wait()
                finish(t, "TIMEOUT")


def check_keys(table, known, what):
    unknown = set(table) - known
    if unknown:
        sys.exit(f"run-tests: test-groups.toml: unknown keys in {what}: {sorted(unknown)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", help="cargo's JSON messages from `cargo test --no-run`")
    ap.add_argument("-j", "--threads", type=int, help="tests at once (test-groups.toml's default)")
    ap.add_argument("patterns", nargs="*", help="run only the tests whose name matches one")
    args = ap.parse_args()

    with open(ROOT / "deploy/local/test-groups.toml", "rb") as f:
        cfg = tomllib.load(f)
    check_keys(cfg, {"threads", "timeout", "slow", "first", "group"}, "the file")
    for g in cfg.get("group", []):
        check_keys(g, {"name", "max", "tests"}, f"group {g.get('name')!r}")
    threads = args.threads or cfg["threads"]
    timeout, slow = cfg["timeout"], cfg["slow"]
    groups = {g["name"]: g for g in cfg.get("group", [])}
    first = [re.compile(p) for p in cfg.get("first", [])]

    tests = []
    for b in binaries(args.artifacts):
        tests.extend(list_tests(b))
    if args.patterns:
        pats = [re.compile(p) for p in args.patterns]
        tests = [t for t in tests if any(p.search(t.id) for p in pats)]
        if not tests:
            sys.exit(f"run-tests: no test matches {' or '.join(args.patterns)}")
    for i, t in enumerate(tests):
        t.groups = [n for n, g in groups.items() if any(re.search(p, t.id) for p in g["tests"])]
        rank = next((k for k, p in enumerate(first) if p.search(t.id)), len(first))
        t.order = (rank, i)
    pending = sorted(tests, key=lambda t: t.order)

    out_dir = ROOT / "target/testrun"
    logs = out_dir / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    binaries_count = len({t.binary["exe"] for t in tests})
    print(f"run-tests: {len(tests)} tests from {binaries_count} binaries, {threads} at a time")

    running, done = [], []
    in_group = {n: 0 for n in groups}
    t0 = time.monotonic()

    def stop_all(signum, _frame):
        for t in running:
            kill_group(t.proc.pid)
        sys.exit(128 + signum)

    signal.signal(signal.SIGINT, stop_all)
    signal.signal(signal.SIGTERM, stop_all)

    def start(t):
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", t.id)[:200]
        t.log = logs / f"{safe}.log"
        fh = open(t.log, "wb")
        t.proc = subprocess.Popen(
            [t.binary["exe"], t.name, "--exact", "--nocapture"],
            cwd=t.binary["cwd"],
            env=env_for(t.binary),
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        fh.close()
        t.start = time.monotonic()
        for g in t.groups:
            in_group[g] += 1
        running.append(t)

    def finish(t, status):
        t.duration = time.monotonic() - t.start
        pgid = t.proc.pid
        # Processes the test started and left behind: given half a second to go.
        deadline = time.monotonic() + 0.5
        while (left := group_members(pgid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            kill_group(pgid)
            if status == "PASS":
                status = "LEAK"
        t.status = status
        for g in t.groups:
            in_group[g] -= 1
        running.remove(t)
        done.append(t)
        n = f"({len(done)}/{len(tests)})"
        if status != "PASS" or t.duration > slow:
            print(f"{status:>7} [{t.duration:7.1f}s] {n} {t.id}", flush=True)
        if status != "PASS":
            try:
                text = t.log.read_text(errors="replace").splitlines()
            except OSError as e:
                text = [f"(its output is lost: {e})"]
            shown = text[-300:]
            if len(text) > len(shown):
                print(f"    … {len(text) - len(shown)} earlier lines in {t.log}")
            for line in shown:
                print(f"    {line}")
            if left:
                print("    the test left processes running (killed):")
                for p in left:
                    print(f"      {p}")
            if status == "TIMEOUT":
                print(f"    killed after {timeout} s")

    try:
        run_all(pending, running, threads, groups, in_group, start, finish, timeout)
    finally:
        for t in running:
            kill_group(t.proc.pid)

    wall = time.monotonic() - t0
    with open(out_dir / "timings.tsv", "w", encoding="utf-8") as f:
        f.write("start_s\tduration_s\tstatus\ttest\n")
        for t in sorted(done, key=lambda t: t.start):
            f.write(f"{t.start - t0:.1f}\t{t.duration:.2f}\t{t.status}\t{t.id}\n")
    failed = [t for t in done if t.status != "PASS"]
    per_pkg = {}
    for t in done:
        p = per_pkg.setdefault(t.binary["package"], [0, 0])
        p[0 if t.status == "PASS" else 1] += 1
    counts = ", ".join(f"{k} {v[0]}" + (f" ({v[1]} failed)" if v[1] else "") for k, v in per_pkg.items())
    print(f"run-tests: {len(done) - len(failed)} passed, {len(failed)} failed in {wall:.0f} s — {counts}")
    for t in failed:
        print(f"  {t.status} {t.id}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
