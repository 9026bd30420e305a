//! The step model of an engine: continuous batching as vLLM's scheduler does it, in virtual time
//! (pure, no IO — the async driver sleeps each [`Step::duration`] and hands out its events).
//!
//! Every step has a token budget (`max_num_batched_tokens`) and a sequence limit
//! (`max_num_seqs`). Running sequences are scheduled first, oldest first: one token each while
//! decoding, the next chunk of their prompt while still prefilling (chunked prefill). What is
//! left of the budget admits waiting sequences, first come first served, while their KV blocks
//! can be allocated — a sequence that cannot get its blocks waits, and so does everything behind
//! it. A running sequence that cannot get the block for its next token preempts the most
//! recently admitted running one (itself, if it is that one): its blocks are freed and it goes
//! back to the front of the queue, to recompute its prompt and what it had generated (vLLM's
//! preemption by recompute).
//!
//! A step lasts `base + prefill_tokens·per_prefill_token + decode_seqs·per_decode_seq +
//! context_tokens·per_context_token`, where `context_tokens` is the KV the step's sequences
//! attend over. A sequence's first token comes at the end of the step that prefills its last
//! prompt chunk; each later token at the end of one step of its own, so a long prefill in the
//! same step stretches every running decode's inter-token gap by its cost.
//!
//! KV accounting: a sequence holds the blocks of its own tokens beyond its prefix-cache hit; the
//! hit's blocks are shared and owned by the prefix cache ([`crate::cache`]), which has its own
//! share of the capacity.

use std::collections::VecDeque;
use std::time::Duration;

/// The engine's limits and step-time coefficients (from [`crate::PodKnobs::step_config`]).
#[derive(Clone, Debug, PartialEq)]
pub struct StepConfig {
    /// Tokens one step may process (prefill chunks + one per decoding sequence).
    pub max_num_batched_tokens: usize,
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks for the sequences' own tokens.
    pub kv_blocks: usize,
    /// Fixed cost of a step, in ms.
    pub base_ms: f64,
    /// Cost per prefilled token, in µs.
    pub us_per_prefill_token: f64,
    /// Cost per decoding sequence, in µs.
    pub us_per_decode_seq: f64,
    /// Cost per token of context attended over, in ns.
    pub ns_per_context_token: f64,
}

impl StepConfig {
    /// How long a step of this composition takes.
    pub fn step_time(&self, prefill_tokens: usize, decode_seqs: usize, context: usize) -> Duration {
        let us = self.base_ms * 1000.0
            + prefill_tokens as f64 * self.us_per_prefill_token
            + decode_seqs as f64 * self.us_per_decode_seq
            + context as f64 * self.ns_per_context_token / 1000.0;
        Duration::from_nanos((us.max(0.0) * 1000.0) as u64)
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size.max(1))
    }

    /// Blocks a request needs at most (its prompt and all its output, beyond its cache hit).
    fn blocks_alone(&self, spec: &SeqSpec) -> usize {
        self.blocks_for(spec.prompt_tokens + spec.max_tokens as usize - spec.cached_tokens)
    }

    fn fits_alone(&self, spec: &SeqSpec) -> bool {
        self.blocks_alone(spec) <= self.kv_blocks
    }
}

/// A request as the engine sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpec {
    pub id: u64,
    pub prompt_tokens: usize,
    /// Prompt tokens found in the prefix cache (not prefilled, not held by the sequence).
    pub cached_tokens: usize,
    /// Output tokens to generate (at least one).
    pub max_tokens: u32,
}

/// A request that cannot fit in the KV cache even alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the request needs {blocks} KV blocks, the engine has {capacity}")]
pub struct TooLong {
    pub blocks: usize,
    pub capacity: usize,
}

/// What a step did to one sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Admitted into the batch for the first time: its wait in the queue ended.
    Scheduled(u64),
    /// The first output token (the prefill is complete).
    FirstToken(u64),
    /// A later output token.
    Token(u64),
    /// The last output token was the previous event: the sequence is gone, its blocks free.
    Finished(u64),
    /// Preempted by recompute: back in the queue, its blocks freed.
    Preempted(u64),
}

/// One step: how long it took, what it held, and what it produced (in order).
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub duration: Duration,
    pub prefill_tokens: usize,
    pub decode_seqs: usize,
    pub context_tokens: usize,
    pub events: Vec<Event>,
}

#[derive(Clone, Debug)]
struct Seq {
    spec: SeqSpec,
    /// Tokens to compute before the next output: the prompt, plus — after a preemption — the
    /// output generated so far.
    target: usize,
    /// Tokens whose KV exists (the cache hit included).
    computed: usize,
    generated: u32,
    /// Blocks this sequence holds.
    blocks: usize,
    /// Admitted into the batch once (a preempted one waits again, but its queue time is over).
    scheduled: bool,
}

impl Seq {
    fn prefilling(&self) -> bool {
        self.computed < self.target
    }

    /// KV tokens of its own once `tokens` more are computed.
    fn own_after(&self, tokens: usize) -> usize {
        (self.computed + tokens).saturating_sub(self.spec.cached_tokens)
    }
}

/// The scheduler's state: the waiting queue, the running batch, the free blocks.
#[derive(Debug)]
pub struct StepEngine {
    cfg: StepConfig,
    waiting: VecDeque<Seq>,
    /// In admission order (the last one is preempted first).
    running: Vec<Seq>,
    /// Blocks the running sequences hold.
    used: usize,
    preemptions: u64,
}

impl StepEngine {
    pub fn new(cfg: StepConfig) -> StepEngine {
        StepEngine {
            used: 0,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions: 0,
        }
    }

    pub fn config(&self) -> &StepConfig {
        &self.cfg
    }

    /// New limits and coefficients for the next steps: the held blocks counted in the new block
    /// size (a smaller cache than what is held shows as no free block until enough sequences
    /// finish or are preempted); the requests that could no longer run even alone leave — their
    /// ids are returned.
    pub fn reconfigure(&mut self, cfg: StepConfig) -> Vec<u64> {
        self.cfg = cfg;
        let mut gone = Vec::new();
        let cfg = &self.cfg;
        let mut keep = |s: &Seq| {
            let fits = cfg.fits_alone(&s.spec);
            if !fits {
                gone.push(s.spec.id);
            }
            fits
        };
        self.running.retain(&mut keep);
        self.waiting.retain(&mut keep);
        for s in &mut self.running {
            s.blocks = cfg.blocks_for(s.own_after(0));
        }
        self.used = self.running.iter().map(|s| s.blocks).sum();
        gone
    }

    /// Blocks held by sequences.
    pub fn used_blocks(&self) -> usize {
        self.used
    }

    fn free(&self) -> usize {
        self.cfg.kv_blocks.saturating_sub(self.used)
    }

    /// Queues a request; refused when it could not run even alone (its prompt and output need
    /// more blocks than the engine has — vLLM refuses such a prompt too). A hit of the whole
    /// prompt still computes its last token (the engine needs its logits), as vLLM does.
    pub fn submit(&mut self, spec: SeqSpec) -> Result<(), TooLong> {
        let spec = SeqSpec {
            prompt_tokens: spec.prompt_tokens.max(1),
            cached_tokens: spec.cached_tokens.min(spec.prompt_tokens.saturating_sub(1)),
            max_tokens: spec.max_tokens.max(1),
            ..spec
        };
        if !self.cfg.fits_alone(&spec) {
            return Err(TooLong {
                blocks: self.cfg.blocks_alone(&spec),
                capacity: self.cfg.kv_blocks,
            });
        }
        self.waiting.push_back(Seq {
            spec,
            target: spec.prompt_tokens,
            computed: spec.cached_tokens,
            generated: 0,
            blocks: 0,
            scheduled: false,
        });
        Ok(())
    }

    /// Drops every waiting request (the engine is closing); their ids.
    pub fn drain_waiting(&mut self) -> Vec<u64> {
        self.waiting.drain(..).map(|s| s.spec.id).collect()
    }

    /// Drops a request wherever it is (the client went away); `false` if it is not here.
    pub fn cancel(&mut self, id: u64) -> bool {
        if let Some(i) = self.running.iter().position(|s| s.spec.id == id) {
            let s = self.running.remove(i);
            self.used -= s.blocks;
            return true;
        }
        if let Some(i) = self.waiting.iter().position(|s| s.spec.id == id) {
            self.waiting.remove(i);
            return true;
        }
        false
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Blocks held by sequences / capacity.
    pub fn kv_usage(&self) -> f64 {
        self.used_blocks() as f64 / self.cfg.kv_blocks.max(1) as f64
    }

    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Grows running sequence `i` to hold `tokens` more, preempting from the back of the batch
    /// while blocks are short; `false` if `i` itself was preempted.
    fn grow(&mut self, i: usize, tokens: usize, events: &mut Vec<Event>) -> bool {
        loop {
            let need = self
                .cfg
                .blocks_for(self.running[i].own_after(tokens))
                .saturating_sub(self.running[i].blocks);
            if need <= self.free() {
                self.used += need;
                self.running[i].blocks += need;
                return true;
            }
            let last = self.running.len() - 1;
            self.preempt(last, events);
            if last == i {
                return false;
            }
        }
    }

    fn preempt(&mut self, i: usize, events: &mut Vec<Event>) {
        let mut s = self.running.remove(i);
        self.used -= s.blocks;
        s.blocks = 0;
        s.target = s.spec.prompt_tokens + s.generated as usize;
        s.computed = s.spec.cached_tokens;
        self.preemptions += 1;
        events.push(Event::Preempted(s.spec.id));
        self.waiting.push_front(s);
    }

    /// Runs one step; `None` when there is nothing to do.
    pub fn step(&mut self) -> Option<Step> {
        if self.is_idle() {
            return None;
        }
        let mut events = Vec::new();
        let mut budget = self.cfg.max_num_batched_tokens.max(1);
        // (sequence, tokens computed for it this step)
        let mut scheduled: Vec<(u64, usize)> = Vec::new();

        // Running sequences first, oldest first. `grow` preempts from the back only, so what
        // is scheduled stays.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            let tokens = if s.prefilling() {
                (s.target - s.computed).min(budget)
            } else {
                1
            };
            if !self.grow(i, tokens, &mut events) {
                break; // it was the last one: preempted itself
            }
            scheduled.push((self.running[i].spec.id, tokens));
            budget -= tokens;
            i += 1;
        }

        // Then the queue, first come first served, while the limits and blocks allow — but not
        // in a step that had to preempt.
        let preempted = events.iter().any(|e| matches!(e, Event::Preempted(_)));
        while !preempted && budget > 0 && self.running.len() < self.cfg.max_num_seqs.max(1) {
            let Some(front) = self.waiting.front() else {
                break;
            };
            let tokens = (front.target - front.computed).min(budget);
            let need = self.cfg.blocks_for(front.own_after(tokens));
            if need > self.free() {
                break;
            }
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            self.used += need;
            s.blocks = need;
            if !s.scheduled {
                s.scheduled = true;
                events.push(Event::Scheduled(s.spec.id));
            }
            scheduled.push((s.spec.id, tokens));
            budget -= tokens;
            self.running.push(s);
        }

        if scheduled.is_empty() && events.is_empty() {
            return None; // nothing can run until something changes (a submit, a cancel)
        }

        // The step's composition and cost, then its outcome.
        let (mut prefill_tokens, mut decode_seqs, mut context_tokens) = (0, 0, 0);
        for (s, &(_, tokens)) in self.scheduled(&scheduled) {
            if s.prefilling() {
                prefill_tokens += tokens;
            } else {
                decode_seqs += 1;
            }
            context_tokens += s.computed + tokens;
        }
        let duration = self
            .cfg
            .step_time(prefill_tokens, decode_seqs, context_tokens);
        let mut finished = Vec::new();
        for &(id, tokens) in &scheduled {
            let Some(s) = self.running.iter_mut().find(|s| s.spec.id == id) else {
                continue;
            };
            s.computed += tokens;
            if s.computed < s.target {
                continue; // a chunk of a longer prompt
            }
            // The prompt (or, after a preemption, the prompt and the output so far) is computed,
            // or a decode step ran: the next output token is sampled.
            s.target = s.computed;
            s.generated += 1;
            events.push(if s.generated == 1 {
                Event::FirstToken(id)
            } else {
                Event::Token(id)
            });
            if s.generated >= s.spec.max_tokens {
                events.push(Event::Finished(id));
                finished.push(id);
            }
        }
        for id in finished {
            if let Some(i) = self.running.iter().position(|s| s.spec.id == id) {
                let s = self.running.remove(i);
                self.used -= s.blocks;
            }
        }
        Some(Step {
            duration,
            prefill_tokens,
            decode_seqs,
            context_tokens,
            events,
        })
    }

    fn scheduled<'a>(
        &'a self,
        scheduled: &'a [(u64, usize)],
    ) -> impl Iterator<Item = (&'a Seq, &'a (u64, usize))> + 'a {
        scheduled.iter().filter_map(move |e| {
            self.running
                .iter()
                .find(|s| s.spec.id == e.0)
                .map(|s| (s, e))
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// Easy arithmetic: 5 ms a step, 50 µs a prefill token, 100 µs a decoding sequence.
    fn cfg(budget: usize, kv_blocks: usize) -> StepConfig {
        StepConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: 8,
            block_size: 16,
            kv_blocks,
            base_ms: 5.0,
            us_per_prefill_token: 50.0,
            us_per_decode_seq: 100.0,
            ns_per_context_token: 0.0,
        }
    }

    fn seq(id: u64, prompt: usize, max_tokens: u32) -> SeqSpec {
        SeqSpec {
            id,
            prompt_tokens: prompt,
            cached_tokens: 0,
            max_tokens,
        }
    }

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1000.0
    }

    fn tokens_of(step: &Step, id: u64) -> usize {
        step.events
            .iter()
            .filter(|e| matches!(e, Event::FirstToken(i) | Event::Token(i) if *i == id))
            .count()
    }

    #[test]
    fn a_long_prefill_stretches_the_running_decodes_by_its_cost() {
        let mut e = StepEngine::new(cfg(8192, 4096));
        e.submit(seq(1, 100, 50)).unwrap();
        let first = e.step().unwrap();
        assert_eq!(
            first.events,
            vec![Event::Scheduled(1), Event::FirstToken(1)]
        );
        assert!((ms(first.duration) - (5.0 + 100.0 * 0.05)).abs() < 1e-6);
        let decode = e.step().unwrap();
        assert_eq!(decode.events, vec![Event::Token(1)]);
        assert!((ms(decode.duration) - 5.1).abs() < 1e-6, "{decode:?}");

        // A 4000-token prompt arrives: the next step holds 1's decode and the whole prefill, so
        // 1's next token comes 200 ms later than it would have.
        e.submit(seq(2, 4000, 10)).unwrap();
        let shared = e.step().unwrap();
        assert_eq!(tokens_of(&shared, 1), 1);
        assert_eq!(shared.events.last(), Some(&Event::FirstToken(2)));
        assert_eq!((shared.prefill_tokens, shared.decode_seqs), (4000, 1));
        assert!((ms(shared.duration) - (5.0 + 4000.0 * 0.05 + 0.1)).abs() < 1e-6);
        // Then both decode: 5 ms + 2 × 100 µs.
        let both = e.step().unwrap();
        assert_eq!((tokens_of(&both, 1), tokens_of(&both, 2)), (1, 1));
        assert!((ms(both.duration) - 5.2).abs() < 1e-6);
    }

    #[test]
    fn chunked_prefill_bounds_the_stall() {
        let mut e = StepEngine::new(cfg(512, 4096));
        e.submit(seq(1, 100, 100)).unwrap();
        e.step().unwrap();
        e.submit(seq(2, 4000, 10)).unwrap();
        let mut steps = 0;
        loop {
            let s = e.step().unwrap();
            steps += 1;
            // 1 decodes in every step; 2's chunk takes the rest of the budget.
            assert_eq!(tokens_of(&s, 1), 1, "step {steps}: {s:?}");
            assert!(s.prefill_tokens + s.decode_seqs <= 512);
            assert!(ms(s.duration) <= 5.0 + 511.0 * 0.05 + 0.1 + 1e-6, "{s:?}");
            if s.events.contains(&Event::FirstToken(2)) {
                break;
            }
        }
        assert_eq!(steps, 4000usize.div_ceil(511));
    }

    #[test]
    fn kv_exhaustion_makes_requests_wait_then_preempts() {
        // 20 blocks of 16 tokens; three 96-token prompts take 6 blocks each.
        let mut e = StepEngine::new(cfg(8192, 20));
        for id in 1..=3 {
            e.submit(seq(id, 96, 100)).unwrap();
        }
        e.submit(seq(4, 96, 100)).unwrap();
        let s = e.step().unwrap();
        assert_eq!(s.prefill_tokens, 3 * 96, "{s:?}");
        assert_eq!(
            (e.running(), e.waiting()),
            (3, 1),
            "the 4th waits for blocks"
        );
        assert!(e.kv_usage() > 0.85);

        // Decoding grows the three until a block is short: the newest is preempted.
        let mut preempted = Vec::new();
        let mut got: HashMap<u64, u32> = HashMap::new();
        let mut finished = Vec::new();
        let mut n = 0;
        while let Some(s) = e.step() {
            n += 1;
            assert!(n < 10_000, "no progress");
            for ev in s.events {
                match ev {
                    Event::Preempted(id) => preempted.push(id),
                    Event::FirstToken(id) | Event::Token(id) => *got.entry(id).or_default() += 1,
                    Event::Finished(id) => finished.push(id),
                    Event::Scheduled(_) => {}
                }
            }
        }
        assert_eq!(
            preempted.first(),
            Some(&3),
            "the most recently admitted goes first"
        );
        assert_eq!(e.preemptions(), preempted.len() as u64);
        finished.sort();
        assert_eq!(finished, vec![1, 2, 3, 4]);
        // The first step's tokens (3) plus the rest: 100 each, none lost or repeated.
        for id in 1..=3 {
            assert_eq!(got[&id] + 1, 100, "{id}");
        }
        assert_eq!(got[&4], 100);
        assert_eq!(e.kv_usage(), 0.0);
    }

    #[test]
    fn a_request_that_cannot_fit_is_refused_and_cancel_frees_blocks() {
        let mut e = StepEngine::new(cfg(8192, 10));
        let err = e.submit(seq(1, 150, 20)).unwrap_err();
        assert_eq!(err.blocks, 11);
        // A cache hit needs fewer own blocks.
        e.submit(SeqSpec {
            cached_tokens: 64,
            ..seq(2, 150, 20)
        })
        .unwrap();
        e.step().unwrap();
        assert!(e.kv_usage() > 0.0);
        assert!(e.cancel(2));
        assert!(!e.cancel(2));
        assert_eq!(e.kv_usage(), 0.0);
        assert!(e.is_idle());
    }

    #[test]
    fn a_smaller_cache_keeps_the_books_and_sends_away_what_no_longer_fits() {
        let mut e = StepEngine::new(cfg(8192, 100));
        e.submit(seq(1, 800, 10)).unwrap(); // 51 blocks at most
        e.submit(seq(2, 300, 10)).unwrap(); // 20 blocks at most
        e.step().unwrap();
        assert_eq!(e.used_blocks(), 50 + 19);
        // Down to 30 blocks: 1 could never run again; 2 keeps its 19.
        let gone = e.reconfigure(StepConfig {
            kv_blocks: 30,
            ..e.config().clone()
        });
        assert_eq!(gone, vec![1]);
        assert_eq!(e.used_blocks(), 19);
        while e.step().is_some() {}
        assert_eq!(e.used_blocks(), 0);
        // The capacity is what was configured, not what was once free.
        e.submit(seq(3, 400, 10)).unwrap(); // 26 blocks ≤ 30
        assert!(e.submit(seq(4, 500, 10)).is_err()); // 32 > 30
        while e.step().is_some() {}
        assert!(e.is_idle());
    }

    /// Whatever the mix, every request gets exactly its tokens, the first before the others,
    /// in steps within the budget and the sequence limit, and every block comes back.
    #[test]
    fn every_request_gets_exactly_its_tokens() {
        use rand::{Rng, SeedableRng};
        let mut preemptions = 0;
        for seed in 0..40 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let cfg = StepConfig {
                max_num_seqs: rng.random_range(1..6),
                kv_blocks: rng.random_range(16..64),
                ..cfg(rng.random_range(16..600), 0)
            };
            let mut e = StepEngine::new(cfg.clone());
            let mut want = HashMap::new();
            let mut next = 0u64;
            let mut got: HashMap<u64, (u32, bool)> = HashMap::new();
            let mut scheduled = std::collections::HashSet::new();
            for round in 0..200_000 {
                if round >= 300 && e.is_idle() {
                    break;
                }
                if round < 300 && rng.random_bool(0.3) {
                    next += 1;
                    let s = SeqSpec {
                        id: next,
                        prompt_tokens: rng.random_range(1..300),
                        cached_tokens: rng.random_range(0..100),
                        max_tokens: rng.random_range(1..40),
                    };
                    if e.submit(s).is_ok() {
                        want.insert(next, s.max_tokens);
                    }
                }
                let Some(s) = e.step() else { continue };
                assert!(s.prefill_tokens + s.decode_seqs <= cfg.max_num_batched_tokens);
                assert!(e.running() <= cfg.max_num_seqs);
                for ev in s.events {
                    match ev {
                        Event::Scheduled(id) => {
                            assert!(scheduled.insert(id), "seed {seed}: {id} scheduled twice");
                        }
                        Event::FirstToken(id) => {
                            assert!(scheduled.contains(&id), "a first token before scheduling");
                            let g = got.entry(id).or_default();
                            assert_eq!(g.0, 0, "seed {seed}: a second first token for {id}");
                            g.0 = 1;
                        }
                        Event::Token(id) => {
                            let g = got.get_mut(&id).expect("a token before the first");
                            g.0 += 1;
                        }
                        Event::Finished(id) => {
                            let g = got.get_mut(&id).expect("finished before a token");
                            assert!(!g.1);
                            g.1 = true;
                        }
                        Event::Preempted(_) => {}
                    }
                }
            }
            assert!(e.is_idle(), "seed {seed}: still busy");
            assert_eq!(got.len(), want.len(), "seed {seed}");
            for (id, max) in &want {
                assert_eq!(got[id], (*max, true), "seed {seed}: request {id}");
            }
            assert_eq!(e.kv_usage(), 0.0, "seed {seed}");
            preemptions += e.preemptions();
        }
        assert!(preemptions > 0, "the mixes never ran out of blocks");
    }
}
