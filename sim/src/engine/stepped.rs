//! The step model in a pod: submitting a request to the scheduler, waiting for its tokens,
//! and the driver task that runs the steps.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::Notify;

use super::*;
use crate::step::{Event, SeqSpec};

impl Pod {
    /// Makes sure the step model's driver runs, and wakes it.
    fn kick(self: &Arc<Self>) {
        self.driver.call_once(|| {
            tokio::spawn(drive(Arc::downgrade(self), Arc::clone(&self.work)));
        });
        self.work.notify_one();
    }
}

impl Running {
    /// Computes the prompt: the modelled prefill elapses (simple model), or the request joins the
    /// engine's batches until they produce its first token (step model). `kv_transferred`: a
    /// P/D decode leg, whose prompt KV came from the prefill pod — only the last token is
    /// computed here.
    pub async fn compute_prompt(
        &mut self,
        knobs: &PodKnobs,
        kv_transferred: bool,
    ) -> Result<(), EngineClosed> {
        let uncached = if kv_transferred {
            0
        } else {
            self.uncached_tokens()
        };
        // Before the prefill: the adapter's swap-in, and copying back the blocks found in the
        // CPU offload tier (not for a decode leg: its KV came from the prefill pod).
        let mut before = if self.lora_swapped {
            lora_load(knobs)
        } else {
            Duration::ZERO
        };
        if !kv_transferred {
            let load_ms = self.loaded_tokens() as f64 * knobs.cpu_load_us_per_token / 1000.0;
            before += ms(load_ms * knobs.time_scale);
        }
        if !self.stepped {
            pause(ttft(knobs, uncached) + before).await;
            self.pod.unstalled().await;
            self.first_token();
            return Ok(());
        }
        pause(ms(knobs.extra_latency_ms * knobs.time_scale) + before).await;
        let id = self.pod.next_seq.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let spec = SeqSpec {
            id,
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.prompt_tokens - uncached,
            max_tokens: self.output_tokens,
        };
        let submitted = self.pod.step(|st| {
            let r = st.steps.submit(spec);
            if r.is_ok() {
                st.tickets.insert(id, tx);
            }
            r
        });
        if let Err(e) = submitted {
            tracing::warn!(pod = %self.pod.name, error = %e, "request refused");
            return Err(EngineClosed);
        }
        self.seq = Some((id, rx));
        self.pod.kick();
        self.next_event().await?;
        self.first_token();
        Ok(())
    }

    fn first_token(&mut self) {
        self.last_token = tokio::time::Instant::now();
        let ttft = self.arrived.elapsed().as_secs_f64();
        self.pod.lock().latencies.ttft.observe(ttft);
    }

    /// Records `n` inter-token gaps spanning the time since the last token.
    fn tokens_came(&mut self, n: u32) {
        if n == 0 {
            return;
        }
        let now = tokio::time::Instant::now();
        let gap = (now - self.last_token).as_secs_f64() / f64::from(n);
        self.last_token = now;
        let mut st = self.pod.lock();
        for _ in 0..n {
            st.latencies.itl.observe(gap);
        }
    }

    /// Waits for the next output token: until `due` (simple model), or the engine's next step
    /// for this request (step model).
    pub async fn token(&mut self, due: tokio::time::Instant) -> Result<(), EngineClosed> {
        if self.stepped {
            self.next_event().await?;
        } else {
            pause_until(due).await;
            self.pod.unstalled().await;
        }
        self.tokens_came(1);
        Ok(())
    }

    /// Waits for the output tokens after the first, all at once (a non-streaming answer).
    pub async fn decode_rest(&mut self, knobs: &PodKnobs) -> Result<(), EngineClosed> {
        let rest = self.output_tokens.saturating_sub(1);
        if !self.stepped {
            pause(inter_token(knobs) * rest).await;
            self.pod.unstalled().await;
            self.tokens_came(rest);
            return Ok(());
        }
        for _ in 0..rest {
            self.next_event().await?;
            self.tokens_came(1);
        }
        Ok(())
    }

    /// The step model's next output token for this request (recording its queue time when the
    /// scheduler admits it).
    async fn next_event(&mut self) -> Result<(), EngineClosed> {
        let (_, rx) = self.seq.as_mut().ok_or(EngineClosed)?;
        loop {
            match rx.recv().await {
                Some(Event::FirstToken(_) | Event::Token(_)) => return Ok(()),
                Some(Event::Scheduled(_)) => {
                    let waited = self.arrived.elapsed().as_secs_f64();
                    self.pod.lock().latencies.queue.observe(waited);
                }
                Some(_) => {}
                None => return Err(EngineClosed),
            }
        }
    }
}

/// The step model's driver: runs the pod's engine step after step while it has work — each step
/// lasts its modelled time (× `time_scale`), then its tokens go to their requests — and sleeps
/// while idle or stalled. Ends with the pod.
async fn drive(pod: Weak<Pod>, work: Arc<Notify>) {
    loop {
        let Some(p) = pod.upgrade() else { return };
        p.unstalled().await;
        let next = {
            let mut st = p.lock();
            let scale = st.knobs.time_scale;
            st.steps.step().map(|s| (s, scale))
        };
        let Some((step, scale)) = next else {
            drop(p);
            work.notified().await;
            continue;
        };
        let (now, later): (Vec<Event>, Vec<Event>) = step
            .events
            .into_iter()
            .partition(|e| matches!(e, Event::Scheduled(_)));
        {
            let st = p.lock();
            for ev in now {
                if let Event::Scheduled(id) = ev
                    && let Some(tx) = st.tickets.get(&id)
                {
                    let _ = tx.send(ev);
                }
            }
        }
        let d = Duration::try_from_secs_f64(step.duration.as_secs_f64() * scale)
            .unwrap_or(Duration::from_secs(3600));
        if d.is_zero() {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(d).await;
        }
        p.step(|st| {
            for ev in later {
                match ev {
                    Event::FirstToken(id) | Event::Token(id) => {
                        if let Some(tx) = st.tickets.get(&id) {
                            let _ = tx.send(ev);
                        }
                    }
                    Event::Finished(id) => {
                        st.tickets.remove(&id);
                    }
                    Event::Preempted(_) | Event::Scheduled(_) => {}
                }
            }
            st.evict();
        });
    }
}
