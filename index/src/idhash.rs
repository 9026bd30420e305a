//! A pass-through hasher for keys that already are well-mixed 64-bit hashes.

use std::hash::{BuildHasherDefault, Hasher};

#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only used with u64/u32 keys; fold anything else in case.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn write_u32(&mut self, n: u32) {
        // Pod ids are small integers: spread them.
        self.0 = u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

pub type IdBuild = BuildHasherDefault<IdHasher>;
pub type IdMap<K, V> = std::collections::HashMap<K, V, IdBuild>;
