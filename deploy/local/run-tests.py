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
    def __init__(self, binary, name, ignored):
        self.binary = binary
        self.name = name
        self.ignored = ignored
        self.id = f"{binary['id']} {name}"
        self.groups = []
        self.alone = False
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
    return [Test(binary, n, n in ignored) for n in names()]


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


def check_keys(table, known, what):
    unknown = set(table) - known
    if unknown:
        sys.exit(f"run-tests: test-groups: unknown keys in {what}: {sorted(unknown)}")


class Run:
    """One run: the pending tests in order, those running, those done."""

    def __init__(self, cfg, tests, threads, out_dir):
        self.skipped = sum(t.ignored for t in tests)
        tests = [t for t in tests if not t.ignored]
        self.threads, self.timeout, self.slow = threads, cfg["timeout"], cfg["slow"]
        self.groups = {g["name"]: g for g in cfg.get("group", [])}
        first = [re.compile(p) for p in cfg.get("first", [])]
        for i, t in enumerate(tests):
            t.groups = [
                n for n, g in self.groups.items() if any(re.search(p, t.id) for p in g["tests"])
            ]
            t.alone = any(re.search(p, t.id) for p in cfg.get("alone", []))
            rank = next((k for k, p in enumerate(first) if p.search(t.id)), len(first))
            t.order = (not t.alone, rank, i)
        self.total = len(tests)
        self.pending = sorted(tests, key=lambda t: t.order)
        self.running, self.done = [], []
        self.in_group = {n: 0 for n in self.groups}
        self.out_dir = out_dir
        self.logs = out_dir / "logs"
        shutil.rmtree(self.logs, ignore_errors=True)
        self.logs.mkdir(parents=True)

    def run(self):
        """Starts the pending tests in order as slots and their groups allow, until all are done."""
        self.t0 = time.monotonic()
        try:
            while self.pending or self.running:
                while len(self.running) < self.threads and (t := self.next_ready()):
                    self.start(t)
                time.sleep(0.02)
                now = time.monotonic()
                for t in list(self.running):
                    code = t.proc.poll()
                    if code is not None:
                        self.finish(t, "PASS" if code == 0 else "FAIL")
                    elif now - t.start > self.timeout:
                        kill_group(t.proc.pid)
                        t.proc.wait()
                        self.finish(t, "TIMEOUT")
        finally:
            for t in self.running:
                kill_group(t.proc.pid)
        return time.monotonic() - self.t0

    def stop(self, signum, _frame):
        for t in self.running:
            kill_group(t.proc.pid)
        sys.exit(128 + signum)

    def next_ready(self):
        """The first pending test that may start now. A test that runs alone (they come first)
        waits for the running ones to finish, and nothing starts beside it."""
        if any(t.alone for t in self.running):
            return None
        for t in self.pending:
            if t.alone:
                if self.running:
                    return None
                self.pending.remove(t)
                return t
            if all(self.in_group[g] < self.groups[g]["max"] for g in t.groups):
                self.pending.remove(t)
                return t
        return None

    def start(self, t):
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", t.id)[:200]
        t.log = self.logs / f"{safe}.log"
        with open(t.log, "wb") as fh:
            t.proc = subprocess.Popen(
                [t.binary["exe"], t.name, "--exact", "--nocapture"],
                cwd=t.binary["cwd"],
                env=env_for(t.binary),
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        t.start = time.monotonic()
        for g in t.groups:
            self.in_group[g] += 1
        self.running.append(t)

    def finish(self, t, status):
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
            self.in_group[g] -= 1
        self.running.remove(t)
        self.done.append(t)
        if status != "PASS" or t.duration > self.slow:
            n = f"({len(self.done)}/{self.total})"
            print(f"{status:>7} [{t.duration:7.1f}s] {n} {t.id}", flush=True)
        if status == "PASS":
            return
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
            print(f"    killed after {self.timeout} s")

    def report(self, wall):
        """Writes timings.tsv, prints the summary; the failed tests."""
        with open(self.out_dir / "timings.tsv", "w", encoding="utf-8") as f:
            f.write("start_s\tduration_s\tstatus\ttest\n")
            for t in sorted(self.done, key=lambda t: t.start):
                f.write(f"{t.start - self.t0:.1f}\t{t.duration:.2f}\t{t.status}\t{t.id}\n")
        failed = [t for t in self.done if t.status != "PASS"]
        per_pkg = {}
        for t in self.done:
            p = per_pkg.setdefault(t.binary["package"], [0, 0])
            p[0 if t.status == "PASS" else 1] += 1
        counts = ", ".join(
            f"{k} {v[0]}" + (f" ({v[1]} failed)" if v[1] else "") for k, v in per_pkg.items()
        )
        passed = len(self.done) - len(failed)
        print(f"run-tests: {len(self.done)} run in {wall:.0f} s — {counts}")
        for t in failed:
            print(f"  {t.status} {t.id}")
        # The closing line, alone on its line as CI's reader of test output expects it: the counts,
        # with at most one plain word and a colon before them (no hyphen: "run-tests:" was not read
        # as one). Also in a file, for test.sh to repeat as its own last line.
        closing = f"tests: {passed} passed, {len(failed)} failed"
        if self.skipped:
            closing += f", {self.skipped} skipped"
        (self.out_dir / "result").write_text(closing + "\n", encoding="utf-8")
        print(closing)
        return failed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", help="cargo's JSON messages from `cargo test --no-run`")
    ap.add_argument("-j", "--threads", type=int, help="tests at once (the groups file's default)")
    ap.add_argument(
        "--groups",
        default=ROOT / "deploy/local/test-groups.toml",
        help="the groups file (deploy/local/test-groups.toml)",
    )
    ap.add_argument("--out", default=ROOT / "target/testrun", help="where logs and timings go")
    ap.add_argument("patterns", nargs="*", help="run only the tests whose name matches one")
    args = ap.parse_args()

    with open(args.groups, "rb") as f:
        cfg = tomllib.load(f)
    check_keys(cfg, {"threads", "timeout", "slow", "first", "alone", "group"}, "the file")
    for g in cfg.get("group", []):
        check_keys(g, {"name", "max", "tests"}, f"group {g.get('name')!r}")

    tests = []
    for b in binaries(args.artifacts):
        tests.extend(list_tests(b))
    if args.patterns:
        pats = [re.compile(p) for p in args.patterns]
        tests = [t for t in tests if any(p.search(t.id) for p in pats)]
        if not tests:
            sys.exit(f"run-tests: no test matches {' or '.join(args.patterns)}")
    threads = args.threads or cfg["threads"]
    run = Run(cfg, tests, threads, Path(args.out))
    n_bins = len({t.binary["exe"] for t in tests})
    print(f"run-tests: {run.total} tests from {n_bins} binaries, {threads} at a time")
    signal.signal(signal.SIGINT, run.stop)
    signal.signal(signal.SIGTERM, run.stop)
    failed = run.report(run.run())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
