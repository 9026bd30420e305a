//! Flow-control semantics (bands, fairness, ordering, saturation, in-flight ledger) as a pure state machine — not built yet (issue: flow control).
