//! Estimate tokens and chained block hashes, as llm-d's approximate prefix producer computes them.
//!
//! Estimate tokens: the serialized prompt's bytes packed as little-endian `u32` pseudo-tokens, four
//! bytes each, the tail zero-padded. Chain: `seed = xxh64(model [+ cache_salt])`; the tokens are cut
//! into blocks of `block_size` (a trailing partial block included); per block
//! `id = xxh64(raw LE bytes of its tokens)` and `hash = xxh64(LE(id) ‖ LE(prev))`, `prev = hash`,
//! starting from the seed; at most `max_blocks` blocks.
//!
//! For text the raw bytes of the pseudo-tokens *are* the text bytes (plus zero padding), so
//! [`block_hashes_of_text`] hashes the text in place without materialising tokens.

use xxhash_rust::xxh64::xxh64;

/// Largest block size honoured, in tokens: a block size comes from configuration or from what an
/// engine reports, and must neither overflow `block_size × 4` bytes nor size a huge buffer.
pub const MAX_BLOCK_SIZE: usize = 1 << 16;

/// Seed and chunking for one request's hash chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    pub seed: u64,
    /// Tokens per block, in `1..=MAX_BLOCK_SIZE`.
    pub block_size: usize,
    /// 0 = unlimited.
    pub max_blocks: usize,
}

impl BlockHasher {
    pub fn new(
        model: &str,
        cache_salt: Option<&str>,
        block_size: usize,
        max_blocks: usize,
    ) -> Self {
        let seed = match cache_salt {
            Some(salt) if !salt.is_empty() => {
                let mut buf = Vec::with_capacity(model.len() + salt.len());
                buf.extend_from_slice(model.as_bytes());
                buf.extend_from_slice(salt.as_bytes());
                xxh64(&buf, 0)
            }
            _ => xxh64(model.as_bytes(), 0),
        };
        BlockHasher {
            seed,
            block_size: block_size.clamp(1, MAX_BLOCK_SIZE),
            max_blocks,
        }
    }

    /// The block size in use (the field is public: clamped here too).
    fn size(&self) -> usize {
        self.block_size.clamp(1, MAX_BLOCK_SIZE)
    }

    fn limit(&self, blocks: usize) -> usize {
        if self.max_blocks == 0 {
            blocks
        } else {
            blocks.min(self.max_blocks)
        }
    }
}

#[inline]
fn chain(prev: u64, block_id: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&block_id.to_le_bytes());
    buf[8..].copy_from_slice(&prev.to_le_bytes());
    xxh64(&buf, 0)
}

/// Number of estimate tokens of a text of `len` bytes.
pub fn estimate_token_count(len: usize) -> usize {
    len.div_ceil(4)
}

/// Hash chain of a text's estimate tokens, computed over the bytes directly.
pub fn block_hashes_of_text(h: &BlockHasher, text: &[u8]) -> Vec<u64> {
    let block_bytes = h.size() * 4;
    let blocks = h.limit(text.len().div_ceil(block_bytes));
    let mut out = Vec::with_capacity(blocks);
    let mut prev = h.seed;
    for (i, chunk) in text.chunks(block_bytes).take(blocks).enumerate() {
        let id = if chunk.len() % 4 == 0 {
            xxh64(chunk, 0)
        } else {
            // The last pseudo-token is zero-padded to four bytes.
            debug_assert_eq!(i + 1, text.len().div_ceil(block_bytes));
            let mut padded = chunk.to_vec();
            padded.resize(chunk.len().div_ceil(4) * 4, 0);
            xxh64(&padded, 0)
        };
        prev = chain(prev, id);
        out.push(prev);
    }
    out
}

/// Hash chain of explicit token ids (pre-tokenized prompts).
pub fn block_hashes_of_tokens(h: &BlockHasher, tokens: &[u32]) -> Vec<u64> {
    let size = h.size();
    let blocks = h.limit(tokens.len().div_ceil(size));
    let mut out = Vec::with_capacity(blocks);
    let mut prev = h.seed;
    let mut buf = Vec::with_capacity(size * 4);
    for chunk in tokens.chunks(size).take(blocks) {
        buf.clear();
        for t in chunk {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        prev = chain(prev, xxh64(&buf, 0));
        out.push(prev);
    }
    out
}

/// The estimate tokens of a text (for callers that need the tokens themselves).
pub fn estimate_tokens(text: &[u8]) -> Vec<u32> {
    text.chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_block_sizes_neither_wrap_nor_allocate() {
        // 2^62 × 4 wraps to 0 (a zero-sized chunk panics); 2^40 × 4 bytes is a 4 TiB buffer.
        for size in [1usize << 62, 1 << 40, usize::MAX] {
            let h = BlockHasher::new("m", None, size, 0);
            assert_eq!(h.block_size, MAX_BLOCK_SIZE);
            let text = vec![7u8; 1000];
            assert_eq!(block_hashes_of_text(&h, &text).len(), 1);
            assert_eq!(block_hashes_of_tokens(&h, &[1, 2, 3]).len(), 1);
            // built by hand, past the constructor's clamp
            let raw = BlockHasher {
                block_size: size,
                ..h
            };
            assert_eq!(
                block_hashes_of_text(&raw, &text),
                block_hashes_of_text(&h, &text)
            );
            assert_eq!(block_hashes_of_tokens(&raw, &[1, 2]).len(), 1);
        }
    }

    #[test]
    fn text_and_token_paths_agree() {
        let h = BlockHasher::new("m", None, 4, 0);
        for len in [0usize, 1, 3, 4, 15, 16, 17, 33, 64, 65, 100] {
            let text: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            assert_eq!(
                block_hashes_of_text(&h, &text),
                block_hashes_of_tokens(&h, &estimate_tokens(&text)),
                "len {len}"
            );
        }
    }

    #[test]
    fn chain_is_prefix_stable_and_seeded() {
        let h = BlockHasher::new("model-a", None, 2, 0);
        let a = block_hashes_of_text(&h, b"0123456789abcdefXYZ");
        let b = block_hashes_of_text(&h, b"0123456789abcdefQQQQQQQQ");
        assert_eq!(a.len(), 3); // 19 bytes = 5 tokens = 3 blocks of 2 (last partial)
        assert_eq!(a[..2], b[..2]); // first 16 bytes shared
        assert_ne!(a[2], b[2]);
        let other = BlockHasher::new("model-b", None, 2, 0);
        assert_ne!(block_hashes_of_text(&other, b"01234567")[0], a[0]);
        let salted = BlockHasher::new("model-a", Some("salt"), 2, 0);
        assert_ne!(block_hashes_of_text(&salted, b"01234567")[0], a[0]);
    }

    #[test]
    fn max_blocks_caps() {
        let h = BlockHasher::new("m", None, 1, 3);
        assert_eq!(block_hashes_of_text(&h, &[1u8; 40]).len(), 3);
        assert_eq!(block_hashes_of_tokens(&h, &[1u32; 10]).len(), 3);
    }

    #[test]
    fn hand_computed_first_block() {
        // One block of one token "abcd": id = xxh64("abcd"), hash = xxh64(LE(id) ‖ LE(seed)).
        let h = BlockHasher::new("m", None, 1, 0);
        let id = xxh64(b"abcd", 0);
        let mut buf = id.to_le_bytes().to_vec();
        buf.extend_from_slice(&xxh64(b"m", 0).to_le_bytes());
        assert_eq!(block_hashes_of_text(&h, b"abcd"), vec![xxh64(&buf, 0)]);
    }
}
