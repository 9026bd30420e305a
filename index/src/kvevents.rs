//! Engine KV-cache events as vLLM and SGLang publish them over ZMQ: the frames, the msgpack batch
//! inside them, and the per-publisher sequence — decoded tolerantly, because every shape is in use.
//!
//! - Live messages are three frames `[topic, seq (u64 big-endian), payload]` ([`parse_live`]);
//!   replay replies have the topic frame (vLLM ≥ 0.26) or not (older vLLM, SGLang), and end with a
//!   seq of eight `0xff` bytes and an empty payload ([`parse_replay`]).
//! - Topics are `kv@<pod>@<model>` ([`parse_topic`]; the model is everything after the second `@`).
//! - A payload is the batch `[ts, events, dp_rank?]` ([`decode_batch`]); each event is either the
//!   legacy positional array (tag first, then the fields in declaration order, shorter or longer
//!   than ours) or the map of vLLM ≥ 0.26 (tag under `"type"`, fields by name, defaults omitted).
//!   Fields we do not know are skipped; an event type we do not know is skipped and counted.
//! - Block hashes arrive as unsigned 64-bit ints (vLLM's default), as signed ints (SGLang, old vLLM
//!   hash functions) or as bytes (full digests, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`); all are
//!   normalised to the u64 vLLM's int form would carry: the last 8 bytes big-endian, or the int's
//!   two's-complement bits.
//! - [`SeqTracker`] classifies each live sequence number: in order, a gap to replay, or a publisher
//!   that restarted (its sequence went backwards).
//!
//! Nothing here allocates in proportion to what a message *claims*: lengths are checked against
//! the bytes present, nesting is bounded, and every malformed input is an [`Error`], never a panic.

use std::fmt;

/// How deep [`Reader::skip`] follows nested arrays and maps before calling the input garbage.
const MAX_DEPTH: usize = 32;

/// A message that is not a KV-event message, or a payload that is not a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(String);

impl Error {
    fn new(what: impl Into<String>) -> Self {
        Self(what.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

/// One decoded `BlockStored`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// The engine's hashes of the newly cached blocks, in prompt order.
    pub block_hashes: Vec<u64>,
    /// The engine hash of the block before the first one (`None`: the run starts at token 0).
    pub parent_block_hash: Option<u64>,
    /// The tokens of those blocks (`block_size` per block; empty for hash-only offload events).
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    /// `"GPU"`, `"CPU"`, `"STORAGE"`, ... (`None` from producers that do not say).
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// The KV-cache group of hybrid models.
    pub group_idx: Option<u32>,
    /// `"full_attention"`, sliding-window or mamba kinds (hybrid models only).
    pub kv_cache_spec_kind: Option<String>,
    /// The request's `cache_salt`: SGLang's `cache_salt` field, or in vLLM's `extra_keys` of the
    /// first block the last string that is not the LoRA name (vLLM appends the salt after the
    /// adapter's name and multimodal identifiers, and only to a prompt's first block, so only a run
    /// starting at token 0 carries it). `None`: not salted.
    pub cache_salt: Option<String>,
}

/// One decoded event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
        group_idx: Option<u32>,
    },
    AllBlocksCleared,
}

/// One engine step's events.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Seconds since the UNIX epoch on the engine's clock.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// The data-parallel rank that published it (absent from old producers).
    pub dp_rank: Option<i64>,
    /// Events of a type this decoder does not know (skipped).
    pub unknown_events: usize,
}

/// A live message, or one replayed batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message<'a> {
    /// Empty in replay replies of producers that omit it.
    pub topic: &'a [u8],
    pub seq: u64,
    pub payload: &'a [u8],
}

/// One reply of a replay ROUTER.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replay<'a> {
    Batch(Message<'a>),
    /// The end marker: no more batches for this request.
    End,
}

/// `kv@<pod>@<model>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topic<'a> {
    pub pod: &'a str,
    pub model: &'a str,
}

const END_SEQ: [u8; 8] = [0xff; 8];

fn seq_of(frame: &[u8]) -> Result<[u8; 8], Error> {
    frame.try_into().map_err(|_| {
        Error::new(format!(
            "the sequence frame has {} bytes, not 8",
            frame.len()
        ))
    })
}

/// A live PUB message: exactly `[topic, seq, payload]`.
pub fn parse_live<F: AsRef<[u8]>>(frames: &[F]) -> Result<Message<'_>, Error> {
    match frames {
        [topic, seq, payload] => Ok(Message {
            topic: topic.as_ref(),
            seq: u64::from_be_bytes(seq_of(seq.as_ref())?),
            payload: payload.as_ref(),
        }),
        _ => Err(Error::new(format!(
            "a live message has {} frames, not 3",
            frames.len()
        ))),
    }
}

/// A replay reply as a DEALER receives it (after the empty delimiter, if the socket kept it):
/// `[topic, seq, payload]` or `[seq, payload]`; a seq of eight `0xff` bytes is the end marker.
pub fn parse_replay<F: AsRef<[u8]>>(frames: &[F]) -> Result<Replay<'_>, Error> {
    let frames = match frames {
        [empty, rest @ ..] if empty.as_ref().is_empty() && rest.len() >= 2 => rest,
        _ => frames,
    };
    let (topic, seq, payload) = match frames {
        [topic, seq, payload] => (topic.as_ref(), seq.as_ref(), payload.as_ref()),
        [seq, payload] => (&[][..], seq.as_ref(), payload.as_ref()),
        _ => {
            return Err(Error::new(format!(
                "a replay reply has {} frames, not 2 or 3",
                frames.len()
            )));
        }
    };
    let seq = seq_of(seq)?;
    if seq == END_SEQ {
        return Ok(Replay::End);
    }
    Ok(Replay::Batch(Message {
        topic,
        seq: u64::from_be_bytes(seq),
        payload,
    }))
}

/// `kv@<pod>@<model>` → pod and model (the model may itself contain `@`).
pub fn parse_topic(topic: &[u8]) -> Option<Topic<'_>> {
    let rest = std::str::from_utf8(topic).ok()?.strip_prefix("kv@")?;
    let (pod, model) = rest.split_once('@')?;
    (!pod.is_empty()).then_some(Topic { pod, model })
}

/// Decodes one payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, Error> {
    let mut r = Reader::new(payload);
    let batch = match r.peek()? {
        m if is_array(m) => {
            let n = r.array_len()?;
            if n < 2 {
                return Err(Error::new(format!(
                    "a batch has {n} elements, not [ts, events, dp_rank]"
                )));
            }
            let ts = r.float()?;
            let (events, unknown_events) = events(&mut r)?;
            let dp_rank = if n >= 3 { r.opt_int()? } else { None };
            for _ in 3..n {
                r.skip(0)?;
            }
            EventBatch {
                ts,
                events,
                dp_rank,
                unknown_events,
            }
        }
        m if is_map(m) => {
            let n = r.map_len()?;
            let (mut ts, mut evs, mut dp_rank) = (0.0, None, None);
            for _ in 0..n {
                match r.str()? {
                    "ts" => ts = r.float()?,
                    "events" => evs = Some(events(&mut r)?),
                    "data_parallel_rank" => dp_rank = r.opt_int()?,
                    _ => r.skip(0)?,
                }
            }
            let (events, unknown_events) =
                evs.ok_or_else(|| Error::new("a batch map without \"events\""))?;
            EventBatch {
                ts,
                events,
                dp_rank,
                unknown_events,
            }
        }
        m => {
            return Err(Error::new(format!(
                "a batch is an array or a map, not marker {m:#04x}"
            )));
        }
    };
    if r.pos != payload.len() {
        return Err(Error::new(format!(
            "{} bytes after the batch",
            payload.len() - r.pos
        )));
    }
    Ok(batch)
}

fn events(r: &mut Reader<'_>) -> Result<(Vec<KvEvent>, usize), Error> {
    let n = r.array_len()?;
    let mut out = Vec::with_capacity(n.min(1024));
    let mut unknown = 0;
    for i in 0..n {
        match event(r).map_err(|e| Error::new(format!("event {i}: {e}")))? {
            Some(e) => out.push(e),
            None => unknown += 1,
        }
    }
    Ok((out, unknown))
}

/// The fields of any event, by name.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<u64>>,
    stored: BlockStored,
    /// The bare strings of vLLM's `extra_keys` for the first block.
    first_extra: Vec<String>,
}

impl Fields {
    fn set(&mut self, name: &str, r: &mut Reader<'_>) -> Result<(), Error> {
        let f = &mut self.stored;
        match name {
            "block_hashes" => self.block_hashes = Some(r.hashes()?),
            "parent_block_hash" => f.parent_block_hash = r.opt_hash()?,
            "token_ids" => f.token_ids = r.tokens()?,
            "block_size" => f.block_size = r.opt_u32()?.unwrap_or(0),
            "lora_id" => f.lora_id = r.opt_int()?,
            "medium" => f.medium = r.opt_string()?,
            "lora_name" => f.lora_name = r.opt_string()?,
            "group_idx" => f.group_idx = r.opt_u32()?,
            "kv_cache_spec_kind" => f.kv_cache_spec_kind = r.opt_string()?,
            // SGLang names it.
            "cache_salt" => f.cache_salt = r.opt_string()?,
            "extra_keys" => self.first_extra = r.first_extra_strings()?,
            _ => r.skip(0)?,
        }
        Ok(())
    }

    fn into_event(self, tag: &str) -> Result<Option<KvEvent>, Error> {
        let Fields {
            block_hashes,
            mut stored,
            first_extra,
        } = self;
        if stored.cache_salt.is_none() {
            stored.cache_salt = first_extra
                .into_iter()
                .rfind(|s| Some(s) != stored.lora_name.as_ref());
        }
        stored.cache_salt = stored.cache_salt.filter(|s| !s.is_empty());
        let hashes =
            || block_hashes.ok_or_else(|| Error::new(format!("{tag} without block_hashes")));
        Ok(Some(match tag {
            "BlockStored" => KvEvent::BlockStored(BlockStored {
                block_hashes: hashes()?,
                ..stored
            }),
            "BlockRemoved" => KvEvent::BlockRemoved {
                block_hashes: hashes()?,
                medium: stored.medium,
                group_idx: stored.group_idx,
            },
            "AllBlocksCleared" => KvEvent::AllBlocksCleared,
            _ => return Ok(None),
        }))
    }
}

/// Field names of the legacy positional form, after the tag.
const STORED_FIELDS: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
];
const REMOVED_FIELDS: &[&str] = &["block_hashes", "medium", "group_idx"];
const KNOWN: &[&str] = &["BlockStored", "BlockRemoved", "AllBlocksCleared"];

/// One event; `None` for a type this decoder does not know.
fn event(r: &mut Reader<'_>) -> Result<Option<KvEvent>, Error> {
    let mut fields = Fields::default();
    match r.peek()? {
        m if is_array(m) => {
            let n = r.array_len()?;
            if n == 0 {
                return Err(Error::new("an empty event array"));
            }
            let tag = r.str()?;
            let names: &[&str] = match tag {
                "BlockStored" => STORED_FIELDS,
                "BlockRemoved" => REMOVED_FIELDS,
                _ => &[],
            };
            for i in 1..n {
                match names.get(i - 1) {
                    Some(name) => fields.set(name, r)?,
                    None => r.skip(0)?,
                }
            }
            fields.into_event(tag)
        }
        m if is_map(m) => {
            let n = r.map_len()?;
            let mut tag = None;
            for _ in 0..n {
                match r.str()? {
                    "type" => tag = Some(r.str()?),
                    // An event we do not know may use a known name for something else.
                    _ if tag.is_some_and(|t| !KNOWN.contains(&t)) => r.skip(0)?,
                    name => fields.set(name, r)?,
                }
            }
            let tag = tag.ok_or_else(|| Error::new("an event map without \"type\""))?;
            fields.into_event(tag)
        }
        m => Err(Error::new(format!(
            "an event is an array or a map, not marker {m:#04x}"
        ))),
    }
}

fn is_array(m: u8) -> bool {
    matches!(m, 0x90..=0x9f | 0xdc | 0xdd)
}

fn is_map(m: u8) -> bool {
    matches!(m, 0x80..=0x8f | 0xde | 0xdf)
}

/// A msgpack integer, whichever width and sign it was sent with.
#[derive(Clone, Copy)]
enum Int {
    U(u64),
    I(i64),
}

/// A bounds-checked msgpack reader over one payload.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    fn peek(&self) -> Result<u8, Error> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or_else(|| Error::new("truncated"))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|end| *end <= self.buf.len())
            .ok_or_else(|| Error::new("truncated"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn byte(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }

    fn be(&mut self, n: usize) -> Result<u64, Error> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// A length that claims more elements than bytes remain is garbage.
    fn len(&mut self, n: u64) -> Result<usize, Error> {
        usize::try_from(n)
            .ok()
            .filter(|n| *n <= self.remaining())
            .ok_or_else(|| {
                Error::new(format!(
                    "a length of {n} with {} bytes left",
                    self.remaining()
                ))
            })
    }

    fn array_len(&mut self) -> Result<usize, Error> {
        let n = match self.byte()? {
            m @ 0x90..=0x9f => u64::from(m & 0x0f),
            0xdc => self.be(2)?,
            0xdd => self.be(4)?,
            m => {
                return Err(Error::new(format!(
                    "expected an array, found marker {m:#04x}"
                )));
            }
        };
        self.len(n)
    }

    fn map_len(&mut self) -> Result<usize, Error> {
        let n = match self.byte()? {
            m @ 0x80..=0x8f => u64::from(m & 0x0f),
            0xde => self.be(2)?,
            0xdf => self.be(4)?,
            m => return Err(Error::new(format!("expected a map, found marker {m:#04x}"))),
        };
        // Each entry is at least two bytes.
        self.len(n.saturating_mul(2)).map(|n| n / 2)
    }

    fn str(&mut self) -> Result<&'a str, Error> {
        let n = match self.byte()? {
            m @ 0xa0..=0xbf => u64::from(m & 0x1f),
            0xd9 => self.be(1)?,
            0xda => self.be(2)?,
            0xdb => self.be(4)?,
            m => {
                return Err(Error::new(format!(
                    "expected a string, found marker {m:#04x}"
                )));
            }
        };
        let n = self.len(n)?;
        std::str::from_utf8(self.take(n)?).map_err(|_| Error::new("a string that is not UTF-8"))
    }

    fn nil(&mut self) -> Result<bool, Error> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    fn int(&mut self) -> Result<Int, Error> {
        Ok(match self.byte()? {
            m @ 0x00..=0x7f => Int::U(u64::from(m)),
            m @ 0xe0..=0xff => Int::I(i64::from(m as i8)),
            0xcc => Int::U(self.be(1)?),
            0xcd => Int::U(self.be(2)?),
            0xce => Int::U(self.be(4)?),
            0xcf => Int::U(self.be(8)?),
            0xd0 => Int::I(i64::from(self.be(1)? as u8 as i8)),
            0xd1 => Int::I(i64::from(self.be(2)? as u16 as i16)),
            0xd2 => Int::I(i64::from(self.be(4)? as u32 as i32)),
            0xd3 => Int::I(self.be(8)? as i64),
            m => {
                return Err(Error::new(format!(
                    "expected an integer, found marker {m:#04x}"
                )));
            }
        })
    }

    fn opt_int(&mut self) -> Result<Option<i64>, Error> {
        if self.nil()? {
            return Ok(None);
        }
        match self.int()? {
            Int::I(i) => Ok(Some(i)),
            Int::U(u) => i64::try_from(u)
                .map(Some)
                .map_err(|_| Error::new(format!("{u} does not fit a signed 64-bit int"))),
        }
    }

    fn opt_u32(&mut self) -> Result<Option<u32>, Error> {
        match self.opt_int()? {
            None => Ok(None),
            Some(i) => u32::try_from(i)
                .map(Some)
                .map_err(|_| Error::new(format!("{i} is not a small unsigned int"))),
        }
    }

    fn float(&mut self) -> Result<f64, Error> {
        match self.peek()? {
            0xca => {
                self.pos += 1;
                Ok(f64::from(f32::from_bits(self.be(4)? as u32)))
            }
            0xcb => {
                self.pos += 1;
                Ok(f64::from_bits(self.be(8)?))
            }
            _ => match self.int()? {
                Int::U(u) => Ok(u as f64),
                Int::I(i) => Ok(i as f64),
            },
        }
    }

    /// vLLM's `extra_keys` (`nil`, or per block `nil` or a tuple): the strings directly in the first
    /// block's tuple, in order (multimodal `[identifier, offset]` pairs — nested, or flat: a string
    /// then an integer — and bytes are skipped; another shape is skipped whole).
    fn first_extra_strings(&mut self) -> Result<Vec<String>, Error> {
        let mut out = Vec::new();
        if !is_array(self.peek()?) {
            // nil, or a shape this decoder does not know: no salt.
            self.skip(1)?;
            return Ok(out);
        }
        let blocks = self.array_len()?;
        for b in 0..blocks {
            if b > 0 || !is_array(self.peek()?) {
                self.skip(1)?;
                continue;
            }
            // A string followed by an integer is a multimodal (identifier, offset) written flat.
            let mut last: Option<String> = None;
            for _ in 0..self.array_len()? {
                let m = self.peek()?;
                if matches!(m, 0xa0..=0xbf | 0xd9..=0xdb) {
                    out.extend(last.replace(self.str()?.to_owned()));
                } else {
                    let int = matches!(m, 0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3);
                    if !int {
                        out.extend(last.take());
                    } else {
                        last = None;
                    }
                    self.skip(2)?;
                }
            }
            out.extend(last);
        }
        Ok(out)
    }

    fn opt_string(&mut self) -> Result<Option<String>, Error> {
        if self.nil()? {
            return Ok(None);
        }
        Ok(Some(self.str()?.to_owned()))
    }

    /// An engine block hash as vLLM's int form would carry it.
    fn hash(&mut self) -> Result<u64, Error> {
        let n = match self.peek()? {
            0xc4 => {
                self.pos += 1;
                self.be(1)?
            }
            0xc5 => {
                self.pos += 1;
                self.be(2)?
            }
            0xc6 => {
                self.pos += 1;
                self.be(4)?
            }
            _ => {
                return Ok(match self.int()? {
                    Int::U(u) => u,
                    Int::I(i) => i as u64,
                });
            }
        };
        let n = self.len(n)?;
        let bytes = self.take(n)?;
        // The last 8 bytes, big-endian (shorter digests are zero-extended).
        let tail = &bytes[bytes.len().saturating_sub(8)..];
        Ok(tail.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    fn opt_hash(&mut self) -> Result<Option<u64>, Error> {
        if self.nil()? {
            return Ok(None);
        }
        self.hash().map(Some)
    }

    fn hashes(&mut self) -> Result<Vec<u64>, Error> {
        if self.nil()? {
            return Ok(Vec::new());
        }
        let n = self.array_len()?;
        (0..n).map(|_| self.hash()).collect()
    }

    fn tokens(&mut self) -> Result<Vec<u32>, Error> {
        if self.nil()? {
            return Ok(Vec::new());
        }
        let n = self.array_len()?;
        (0..n)
            .map(|_| match self.int()? {
                Int::U(u) => u32::try_from(u).map_err(|_| Error::new(format!("token id {u}"))),
                Int::I(i) => Err(Error::new(format!("token id {i}"))),
            })
            .collect()
    }

    /// Skips one value of any type.
    fn skip(&mut self, depth: usize) -> Result<(), Error> {
        if depth > MAX_DEPTH {
            return Err(Error::new("nested deeper than 32"));
        }
        let m = self.byte()?;
        let skip_bytes = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => Some(0),
            0xcc | 0xd0 => Some(1),
            0xcd | 0xd1 | 0xd4 => Some(2),
            0xd5 => Some(3),
            0xca | 0xce | 0xd2 => Some(4),
            0xd6 => Some(5),
            0xcb | 0xcf | 0xd3 => Some(8),
            0xd7 => Some(9),
            0xd8 => Some(17),
            0xa0..=0xbf => Some(u64::from(m & 0x1f)),
            0xc4 | 0xd9 => Some(self.be(1)?),
            0xc5 | 0xda => Some(self.be(2)?),
            0xc6 | 0xdb => Some(self.be(4)?),
            0xc7 => Some(self.be(1)? + 1),
            0xc8 => Some(self.be(2)? + 1),
            0xc9 => Some(self.be(4)? + 1),
            _ => None,
        };
        if let Some(n) = skip_bytes {
            let n = self.len(n)?;
            self.take(n)?;
            return Ok(());
        }
        let items = match m {
            0x90..=0x9f => u64::from(m & 0x0f),
            0x80..=0x8f => 2 * u64::from(m & 0x0f),
            0xdc => self.be(2)?,
            0xdd => self.be(4)?,
            0xde => 2 * self.be(2)?,
            0xdf => 2 * self.be(4)?,
            _ => return Err(Error::new(format!("marker {m:#04x} is not msgpack"))),
        };
        for _ in 0..self.len(items)? {
            self.skip(depth + 1)?;
        }
        Ok(())
    }
}

/// What a live sequence number means for the subscriber.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqVerdict {
    /// The next batch (or the publisher's first): apply it.
    InOrder,
    /// Batches `from..to` were missed (ZMQ drops the first messages after a connect, and any
    /// beyond the high-water mark): replay them, else resync the pod; then apply this one.
    Gap { from: u64, to: u64 },
    /// The sequence went backwards: the publisher restarted and its cache is empty. Forget the
    /// pod's blocks (and replay from 0 up to this one if it is not 0).
    Restarted,
}

/// The last sequence number seen from one publisher.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SeqTracker {
    last: Option<u64>,
}

impl SeqTracker {
    /// The last sequence number observed.
    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Classifies a live message's seq and remembers it.
    pub fn observe(&mut self, seq: u64) -> SeqVerdict {
        let expected = self.last.map_or(0, |l| l.saturating_add(1));
        let verdict = match self.last {
            Some(last) if seq <= last => SeqVerdict::Restarted,
            _ if seq == expected => SeqVerdict::InOrder,
            _ => SeqVerdict::Gap {
                from: expected,
                to: seq,
            },
        };
        self.last = Some(seq);
        verdict
    }

    /// After a replay brought the subscriber up to `seq` (a replayed batch, applied).
    pub fn caught_up_to(&mut self, seq: u64) {
        if self.last.is_none_or(|l| seq > l) {
            self.last = Some(seq);
        }
    }
}
