//! Model-based properties of the quota book: whatever the order of admissions, settlements,
//! releases and repeats, concurrency never goes negative nor past its limit, nothing is charged
//! twice, and (time standing still) the token balance is exactly the limit minus the open
//! pre-debits minus the settled usage, which the ledger sums to the same totals.

use std::collections::BTreeMap;

use flowctl::quota::{Ask, Limits, QuotaBook, Spent};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Admit {
        key: u8,
        input: u16,
        max: Option<u16>,
    },
    Settle {
        key: u8,
        input: u16,
        output: u16,
        cut: bool,
    },
    Release {
        key: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..24, 0u16..400, proptest::option::of(0u16..600))
            .prop_map(|(key, input, max)| Op::Admit { key, input, max }),
        (0u8..24, 0u16..400, 0u16..600, any::<bool>()).prop_map(|(key, input, output, cut)| {
            Op::Settle {
                key,
                input,
                output,
                cut,
            }
        }),
        (0u8..24).prop_map(|key| Op::Release { key }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn balances_equal_the_settled_usage(ops in proptest::collection::vec(op(), 1..120)) {
        let l = Limits {
            requests_per_minute: Some(1_000),
            tokens_per_minute: Some(20_000),
            concurrency: Some(5),
            default_max_tokens: Some(64),
            max_tokens_cap: Some(256),
        };
        let mut q = QuotaBook::new();
        let mut open: BTreeMap<String, u64> = BTreeMap::new();
        let (mut charged, mut input, mut output, mut settled, mut cut) = (0u64, 0, 0, 0, 0);
        for op in ops {
            match op {
                Op::Admit { key, input: i, max } => {
                    let key = key.to_string();
                    let a = Ask {
                        key: &key, tenant: "t", limit_key: "*", model: "m", limits: &l,
                        input_tokens: u64::from(i), max_output: max.map(u64::from),
                    };
                    let was_open = open.contains_key(&key);
                    if let Ok(g) = q.admit(0, a) {
                        prop_assert!(!was_open, "a held key admitted twice");
                        prop_assert_eq!(g.debit, u64::from(i) + l.output_budget(max.map(u64::from)).unwrap());
                        open.insert(key, g.debit);
                    }
                }
                Op::Settle { key, input: i, output: o, cut: c } => {
                    let key = key.to_string();
                    let s = Spent { input: u64::from(i), output: u64::from(o), cached: 0, disconnected: c };
                    let r = q.settle(0, &key, s, &l);
                    prop_assert_eq!(r.is_some(), open.remove(&key).is_some(), "settled once, only if held");
                    if r.is_some() {
                        charged += u64::from(i) + u64::from(o);
                        input += u64::from(i);
                        output += u64::from(o);
                        settled += 1;
                        cut += u64::from(c);
                    }
                }
                Op::Release { key } => {
                    let key = key.to_string();
                    prop_assert_eq!(q.release(0, &key, &l).is_some(), open.remove(&key).is_some());
                }
            }
            let in_flight = q.in_flight("t", "*");
            prop_assert_eq!(in_flight as usize, open.len());
            prop_assert!(in_flight <= 5);
            let debits: u64 = open.values().sum();
            let expected = 20_000i64 - debits as i64 - charged as i64;
            prop_assert_eq!(q.tokens_left("t", "*").unwrap_or(20_000), expected);
        }
        let rows: Vec<_> = q.usage().collect();
        let sum = |f: &dyn Fn(&flowctl::quota::UsageRow) -> u64| rows.iter().map(|(_, r)| f(r)).sum::<u64>();
        prop_assert_eq!(sum(&|r| r.requests), settled);
        prop_assert_eq!(sum(&|r| r.input), input);
        prop_assert_eq!(sum(&|r| r.output), output);
        prop_assert_eq!(sum(&|r| r.disconnects), cut);
    }
}
