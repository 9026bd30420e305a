//! Prefix indexes (approximate CRDT index, precise KV-event index) — not built yet (issues: scheduling parity, Active-Active prefix affinity).
