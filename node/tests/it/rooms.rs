//! The layout of `node`: the rooms (top-level modules) depend on each other one way only, and so
//! do the modules inside each room.
//!
//! The check reads the sources: every `crate::…`, `super::…` and `self::…` path (in `use`
//! declarations and in code, tests included; comments and string literals skipped) is an edge
//! from the module it appears in to the module it names. Edges are collapsed twice — to rooms
//! (`request`, `scheduling`, …), and within a room to its direct submodules — and each graph must
//! be acyclic. `cargo test -p node --test it -- rooms:: --nocapture` prints both listings.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

/// Module path of a source file under `src/` (`lib.rs` = the crate root).
fn module_of(rel: &Path) -> Module {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Path, // ::
    Open,
    Close,
    Comma,
    Semi,
    Other,
}

/// Tokens of the source with comments, string, byte-string, raw-string and char literals removed.
fn tokens(src: &str) -> Vec<Tok> {
    let s: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        let next = s.get(i + 1).copied();
        if c.is_whitespace() {
            i += 1;
        } else if c == '/' && next == Some('/') {
            while i < s.len() && s[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < s.len() {
                if s[i] == '/' && s.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if s[i] == '*' && s.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && {
            // raw string r"…" / r#"…"#
            let mut j = i + 1;
            while s.get(j) == Some(&'#') {
                j += 1;
            }
            s.get(j) == Some(&'"')
        } {
            let mut j = i + 1;
            let mut hashes = 0;
            while s[j] == '#' {
                hashes += 1;
                j += 1;
            }
            j += 1;
            loop {
                if j >= s.len() {
                    break;
                }
                if s[j] == '"' && (0..hashes).all(|k| s.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            i = j;
            out.push(Tok::Other);
        } else if c == '"' {
            i += 1;
            while i < s.len() && s[i] != '"' {
                if s[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push(Tok::Other);
        } else if c == '\'' {
            // a char literal ('x', '\n', '\u{..}') or a lifetime ('a)
            if next == Some('\\') {
                i += 2;
                while i < s.len() && s[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if s.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
                while i < s.len() && (s[i].is_alphanumeric() || s[i] == '_') {
                    i += 1;
                }
            }
            out.push(Tok::Other);
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < s.len() && (s[i].is_alphanumeric() || s[i] == '_') {
                i += 1;
            }
            let word: String = s[start..i].iter().collect();
            // b"…" byte strings: the literal follows as its own token
            out.push(Tok::Ident(word));
        } else if c.is_ascii_digit() {
            while i < s.len() && (s[i].is_alphanumeric() || s[i] == '_' || s[i] == '.') {
                i += 1;
            }
            out.push(Tok::Other);
        } else if c == ':' && next == Some(':') {
            out.push(Tok::Path);
            i += 2;
        } else {
            out.push(match c {
                '{' => Tok::Open,
                '}' => Tok::Close,
                ',' => Tok::Comma,
                ';' => Tok::Semi,
                _ => Tok::Other,
            });
            i += 1;
        }
    }
    out
}

/// Parse a path starting at `toks[i]` (after its first segment was pushed to `prefix`), expanding
/// `{…}` groups; every complete path goes to `out`. Returns the index after the path.
fn parse_path(toks: &[Tok], mut i: usize, prefix: Module, out: &mut Vec<Module>) -> usize {
    let mut path = prefix;
    loop {
        if toks.get(i) != Some(&Tok::Path) {
            out.push(path);
            return i;
        }
        i += 1;
        match toks.get(i) {
            Some(Tok::Ident(seg)) => {
                path.push(seg.clone());
                i += 1;
            }
            Some(Tok::Open) => {
                i += 1;
                loop {
                    match toks.get(i) {
                        Some(Tok::Ident(seg)) => {
                            let mut p = path.clone();
                            p.push(seg.clone());
                            i = parse_path(toks, i + 1, p, out);
                        }
                        Some(Tok::Comma) | Some(Tok::Other) | Some(Tok::Semi) => i += 1,
                        Some(Tok::Open) => {
                            // `{{` cannot start a path item; skip defensively
                            i += 1;
                        }
                        Some(Tok::Close) => {
                            return i + 1;
                        }
                        _ => return i,
                    }
                }
            }
            _ => {
                out.push(path);
                return i;
            }
        }
    }
}

/// Absolute paths named in one file whose module is `me`, each with whether it is the target of
/// a re-export (`pub use …`, an alias rather than a use).
fn references(src: &str, me: &Module, children: &BTreeSet<&str>) -> Vec<(Module, bool)> {
    let toks = tokens(src);
    let mut out = Vec::new();
    // Inline modules (`mod tests { … }`) shift what `super` and `self` mean.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    // Inside a `pub use …;` (until its `;`).
    let mut reexport = false;
    let mut i = 0;
    while i < toks.len() {
        match &toks[i] {
            Tok::Ident(w) if w == "use" => {
                let before = |k: usize| i.checked_sub(k).and_then(|j| toks.get(j));
                let is_pub = |t: Option<&Tok>| matches!(t, Some(Tok::Ident(p)) if p == "pub");
                // `pub use` or `pub(crate) use` / `pub(super) use`
                reexport =
                    is_pub(before(1)) || (before(1) == Some(&Tok::Other) && is_pub(before(4)));
            }
            Tok::Semi => reexport = false,
            Tok::Open => depth += 1,
            Tok::Close => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
            }
            Tok::Ident(w) if w == "mod" => {
                if let (Some(Tok::Ident(name)), Some(Tok::Open)) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    inline.push((name.clone(), depth));
                }
            }
            Tok::Ident(w)
                if (w == "crate" || w == "super" || w == "self")
                    && toks.get(i + 1) == Some(&Tok::Path)
                    && (i == 0 || toks[i - 1] != Tok::Path) =>
            {
                let mut here: Module = me.clone();
                here.extend(inline.iter().map(|(n, _)| n.clone()));
                let mut found = Vec::new();
                let end = parse_path(&toks, i + 1, Vec::new(), &mut found);
                for rel in found {
                    let mut base = match w.as_str() {
                        "crate" => Vec::new(),
                        "self" => here.clone(),
                        _ => {
                            let mut b = here.clone();
                            b.pop();
                            b
                        }
                    };
                    let mut segs = rel.into_iter().peekable();
                    while segs.peek().is_some_and(|s| s == "super") {
                        segs.next();
                        base.pop();
                    }
                    base.extend(segs);
                    out.push((base, reexport));
                }
                i = end;
                continue;
            }
            // A path through a child module of this file's module (`use registry::build;`,
            // `stream::run(…)`), outside inline modules.
            Tok::Ident(w)
                if inline.is_empty()
                    && toks.get(i + 1) == Some(&Tok::Path)
                    && (i == 0 || toks[i - 1] != Tok::Path)
                    && children.contains(w.as_str()) =>
            {
                let mut found = Vec::new();
                let end = parse_path(&toks, i + 1, vec![w.clone()], &mut found);
                for rel in found {
                    let mut p = me.clone();
                    p.extend(rel);
                    out.push((p, reexport));
                }
                i = end;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Re-exports: (module, name) → the path it stands for.
type Aliases = BTreeMap<(Module, String), Module>;

/// The file module that defines what `path` names: the longest prefix that is a file module,
/// following re-exports (`pub use child::Item` in a room's root names `child`, not the root).
fn owner<'a>(
    path: &[String],
    modules: &'a BTreeSet<Module>,
    aliases: &Aliases,
) -> Option<&'a Module> {
    let mut path = path.to_vec();
    for _ in 0..8 {
        let n = (0..=path.len())
            .rev()
            .find(|n| modules.contains(&path[..*n].to_vec()))?;
        let key = (path[..n].to_vec(), path.get(n).cloned().unwrap_or_default());
        match aliases.get(&key) {
            Some(target) if n < path.len() => {
                let mut next = target.clone();
                next.extend(path[n + 1..].iter().cloned());
                path = next;
            }
            _ => return modules.get(&path[..n].to_vec()),
        }
    }
    None
}

/// A cycle in `graph`, if any (depth-first search).
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for m in graph.get(n).into_iter().flatten() {
            match state.get(m.as_str()).copied().unwrap_or(0) {
                1 => {
                    let at = stack.iter().position(|s| s == m).unwrap_or(0);
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(m, graph, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in graph.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0
            && let Some(c) = visit(n, graph, &mut state, &mut Vec::new())
        {
            return Some(c);
        }
    }
    None
}

fn print(title: &str, graph: &BTreeMap<String, BTreeSet<String>>) {
    println!("{title}");
    for (from, to) in graph {
        let to: Vec<&str> = to.iter().map(String::as_str).collect();
        println!(
            "  {from} -> {}",
            if to.is_empty() {
                "-".to_string()
            } else {
                to.join(", ")
            }
        );
    }
}

#[test]
fn rooms_and_their_modules_depend_one_way() {
    // `NODE_SRC` checks another tree (e.g. an older checkout's `node/src`) by hand.
    let src = std::env::var_os("NODE_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    // main.rs is the binary's own crate root: `crate::` there is not the library.
    files.retain(|f| f.file_name().is_some_and(|n| n != "main.rs"));
    let modules: BTreeSet<Module> = files
        .iter()
        .map(|f| module_of(f.strip_prefix(&src).unwrap()))
        .collect();
    assert!(modules.len() > 30, "found only {} modules", modules.len());

    let mut refs: Vec<(Module, Module)> = Vec::new();
    let mut aliases = Aliases::new();
    for f in &files {
        let me = module_of(f.strip_prefix(&src).unwrap());
        let text = std::fs::read_to_string(f).unwrap();
        let children: BTreeSet<&str> = modules
            .iter()
            .filter(|m| m.len() == me.len() + 1 && m.starts_with(&me))
            .filter_map(|m| m.last().map(String::as_str))
            .collect();
        for (path, reexport) in references(&text, &me, &children) {
            match (reexport, path.last()) {
                (true, Some(name)) if name != "self" => {
                    aliases.insert((me.clone(), name.clone()), path);
                }
                _ => refs.push((me.clone(), path)),
            }
        }
    }

    let mut rooms: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut inner: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    let mut edges = 0;
    for (me, path) in &refs {
        let Some(my_room) = me.first().cloned() else {
            continue; // lib.rs declares the rooms
        };
        rooms.entry(my_room.clone()).or_default();
        {
            let Some(target) = owner(path, &modules, &aliases) else {
                continue;
            };
            let Some(room) = target.first() else {
                continue;
            };
            edges += 1;
            if *room != my_room {
                rooms.get_mut(&my_room).unwrap().insert(room.clone());
            } else {
                // Within the room: its direct submodules (the root is `<room>`).
                let name = |m: &Module| m.get(..2.min(m.len())).unwrap().join("::");
                let (a, b) = (name(me), name(target));
                let g = inner.entry(my_room.clone()).or_default();
                g.entry(a.clone()).or_default();
                if a != b {
                    g.get_mut(&a).unwrap().insert(b);
                }
            }
        }
    }
    assert!(
        edges > 200,
        "found only {edges} references: is the scanner broken?"
    );
    print("rooms:", &rooms);
    for (room, g) in &inner {
        print(&format!("inside {room}:"), g);
    }
    if let Some(c) = find_cycle(&rooms) {
        panic!("rooms import each other in a cycle: {}", c.join(" -> "));
    }
    for (room, g) in &inner {
        if let Some(c) = find_cycle(g) {
            panic!(
                "modules of `{room}` import each other in a cycle: {}",
                c.join(" -> ")
            );
        }
    }
}

#[test]
fn the_scanner_sees_groups_super_and_inline_modules() {
    let src = "use crate::a::{b, c::{d, e}};\nuse super::f;\n// crate::commented\nlet s = \"crate::quoted\";\nmod tests { use super::g; }\nfn x() { crate::h::i(); kid::j(); other::k(); }\n";
    let me: Module = vec!["r".into(), "m".into()];
    let kids = BTreeSet::from(["kid"]);
    let refs: Vec<String> = references(src, &me, &kids)
        .iter()
        .map(|(p, _)| p.join("::"))
        .collect();
    assert_eq!(
        refs,
        [
            "a::b",
            "a::c::d",
            "a::c::e",
            "r::f",
            "r::m::g",
            "h::i",
            "r::m::kid::j"
        ],
        "{refs:?}"
    );
    let mut g = BTreeMap::new();
    g.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    g.insert("b".to_string(), BTreeSet::from(["a".to_string()]));
    assert!(find_cycle(&g).is_some());
    g.get_mut("b").unwrap().clear();
    assert!(find_cycle(&g).is_none());
}
