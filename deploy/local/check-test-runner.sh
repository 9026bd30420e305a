#!/usr/bin/env bash
# Checks that deploy/local/run-tests.py fails what it must: a test that panics, one that leaves a
# process behind, one that hangs past the timeout; that it runs the one that passes and not the
# ignored one; and that it kills what the leaking and the hanging tests left. Compiles a small
# crate with one test of each kind (deploy/local/test.sh runs this before the tests).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d)"
trap 'pkill -f "sleep 86398" || true; rm -rf "$work"' EXIT
mkdir -p "$work/src"
printf '[package]\nname = "runner-check"\nversion = "0.0.0"\nedition = "2024"\n\n[workspace]\n' \
  > "$work/Cargo.toml"
cat > "$work/src/lib.rs" <<'EOF'
#[cfg(test)]
mod tests {
    #[test]
    fn passes() {}

    #[test]
    fn panics() {
        panic!("as it should");
    }

    #[test]
    fn leaves_a_process() {
        std::process::Command::new("sleep").arg("86398").spawn().map(drop).ok();
    }

    #[test]
    fn hangs() {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }

    #[test]
    #[ignore = "must not run"]
    fn ignored() {
        panic!("an ignored test ran");
    }
}
EOF
cat > "$work/groups.toml" <<'EOF'
threads = 2
timeout = 3
slow = 60
EOF
cargo test --quiet --offline --no-run --manifest-path "$work/Cargo.toml" \
  --target-dir "$work/target" --message-format=json > "$work/artifacts.json"
status=0
"$root/deploy/local/run-tests.py" --groups "$work/groups.toml" --out "$work/out" \
  "$work/artifacts.json" > "$work/report" 2>&1 || status=$?
fail() {
  echo "check-test-runner: $1; its report:" >&2
  cat "$work/report" >&2
  exit 1
}
[ "$status" = 1 ] || fail "exit status $status, not 1"
[ "$(tail -n 1 "$work/report")" = 'tests: 1 passed, 3 failed, 1 skipped' ] ||
  fail "its last line is not 'tests: 1 passed, 3 failed, 1 skipped'"
grep -q '^  FAIL runner-check tests::panics$' "$work/report" || fail "the panic not reported"
grep -q '^  LEAK runner-check tests::leaves_a_process$' "$work/report" || fail "the leak not reported"
grep -q '^  TIMEOUT runner-check tests::hangs$' "$work/report" || fail "the hang not reported"
! grep -q 'an ignored test ran' "$work/report" || fail "the ignored test ran"
! pgrep -f 'sleep 86398' > /dev/null || fail "the leaked process is still running"
