#!/usr/bin/env bash
# Heap bytes per entry of the approximate prefix index, counted by a global allocator — the
# current `index` crate and, given a git revision, the crate as it was then (for before/after
# comparisons). The counting allocator needs `unsafe`, which the workspace forbids, so the program
# is built as a scratch crate outside it.
#   bash index/bench/memory.sh [REV]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
rev="${1:-}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/src"
old_dep=""
old_run=""
if [ -n "$rev" ]; then
  git -C "$root" archive "$rev" index | tar -x -C "$dir"
  mv "$dir/index" "$dir/index-old"
  cat > "$dir/index-old/Cargo.toml" <<EOF
[package]
name = "index_old"
edition = "2024"
version = "0.0.0"
[dependencies]
EOF
  # The revision's dependencies, as its workspace pinned them.
  for dep in $(git -C "$root" show "$rev:index/Cargo.toml" \
      | sed -n '/^\[dependencies\]/,/^\[/p' | sed -n 's/^\([a-z0-9_-]*\)\.workspace = true/\1/p'); do
    git -C "$root" show "$rev:Cargo.toml" | grep "^$dep = " >> "$dir/index-old/Cargo.toml"
  done
  old_dep='index_old = { path = "index-old" }'
  old_run='measure!(index_old, format!("{rev}"));'
fi
cat > "$dir/Cargo.toml" <<EOF
[package]
name = "index-memory"
edition = "2024"
version = "0.0.0"
[dependencies]
index = { path = "$root/index" }
$old_dep
[workspace]
EOF
cat > "$dir/src/main.rs" <<EOF
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        LIVE.fetch_add(n, Ordering::Relaxed);
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        unsafe { System.realloc(p, l, n) }
    }
}
#[global_allocator]
static A: Counting = Counting;

fn text(n: usize, seed: u32) -> Vec<u8> {
    (0..n).map(|i| b'a' + (((i as u32).wrapping_mul(31) ^ seed.wrapping_mul(2654435761)) % 26) as u8).collect()
}

// Fill an index with 16k-token prompts (250 blocks, all hashes distinct) and count its heap; the
// middle case is llm-d's default capacity (31,250 entries per pod) filled on 100 pods.
macro_rules! measure {
    (\$krate:ident, \$label:expr) => {
        for (pods, prompts, cap) in [(100u32, 20u32, 1usize << 20), (100, 125, 31_250), (200, 60, 1 << 20)] {
            let h = index::BlockHasher::new("model", None, 64, 2048);
            let hashes: Vec<Vec<Vec<u64>>> = (0..pods)
                .map(|p| (0..prompts).map(|k| index::block_hashes_of_text(&h, &text(65_536, p * 1000 + k))).collect())
                .collect();
            let base = LIVE.load(Ordering::Relaxed);
            let mut ix = \$krate::ApproxIndex::new(cap);
            for (p, ps) in hashes.iter().enumerate() {
                let pod = ix.pod(&format!("pod-{p}"));
                for (k, hs) in ps.iter().enumerate() { ix.insert(pod, hs, k as u64); }
            }
            let bytes = LIVE.load(Ordering::Relaxed) - base;
            println!("{}: {pods} pods x {prompts} prompts, {} entries: {:.1} B/entry",
                \$label, ix.len(), bytes as f64 / ix.len() as f64);
        }
    };
}

fn main() {
    let rev = "${rev}";
    let _ = rev;
    measure!(index, "current");
    $old_run
}
EOF
cargo run --release -q --manifest-path "$dir/Cargo.toml" --target-dir "$root/target/index-memory"
