//! The direction test (issue 43), in the manner of rust-analyzer's tidy tests: data flows
//! `main → cli | server → config → engine → load → models → mlx`, with `plugins` and
//! `structured` beside the engine. It reads the sources, resolves every `crate::`,
//! `super::` and `self::` path to the file it names, and fails when
//!
//! - a folder imports what it must not ([`RULES`]), or
//! - files import each other in a circle (in `host/src`, `models/src` and `host/mlx/src`),
//!
//! unless the edge or the circle is one of today's, listed in [`KNOWN_EDGES`] and
//! [`KNOWN_CIRCLES`] with the step that removes it. A listed one that is gone fails too, so
//! the lists only shrink. Inline `#[cfg(test)] mod tests` blocks are not read.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// For each folder (or top-level file) of `host/src`, what it must never import: modules of
/// this crate, or external crates written `<name>`.
const RULES: &[(&str, &[&str])] = &[
    ("engine", &["server", "cli", "config", "plugins", "structured", "<axum>", "<wasmtime>"]),
    ("load", &["engine", "server", "cli", "config", "plugins", "structured", "<axum>", "<wasmtime>"]),
    ("config", &["server", "cli"]),
    ("plugins", &["server", "cli", "config", "<axum>"]),
    ("structured", &["server", "cli", "config", "<axum>", "<wasmtime>"]),
    ("server", &["cli"]),
];

/// Imports against [`RULES`] that are still there, each with the step that removes it.
const KNOWN_EDGES: &[(&str, &str)] = &[
    // None: the engine sees its plugins through `engine/hooks.rs` (session 31). Keep it so.
];

/// Import circles still there, each with the step that removes it (none: keep it so).
const KNOWN_CIRCLES: &[&[&str]] = &[];

#[test]
fn imports_run_one_way() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let host = read_tree(&root.join("src"));
    let mut problems = rule_breaks(&host);
    let mut circles = Vec::new();
    for (name, tree) in [
        ("host", &host),
        ("models", &read_tree(&root.join("../models/src"))),
        ("mlx", &read_tree(&root.join("mlx/src"))),
    ] {
        circles.extend(cycles(tree).into_iter().map(|c| (name, c)));
    }
    for (crate_name, circle) in &circles {
        let listed = *crate_name == "host"
            && KNOWN_CIRCLES.iter().any(|k| k.iter().copied().eq(circle.iter().map(String::as_str)));
        if !listed {
            problems.push(format!("{crate_name}: files import each other in a circle: {}", circle.join(" → ")));
        }
    }
    for known in KNOWN_CIRCLES {
        if !circles.iter().any(|(c, found)| *c == "host" && known.iter().copied().eq(found.iter().map(String::as_str)))
        {
            problems.push(format!("the circle {known:?} is gone: take it off KNOWN_CIRCLES in tidy.rs"));
        }
    }
    assert!(problems.is_empty(), "the one-way order is broken:\n{}", problems.join("\n"));
}

/// A new `use crate::server` under `engine/` fails the test; so do a new circle and a listed
/// edge that is gone.
#[test]
fn the_direction_test_catches_a_new_upward_import() {
    let mut tree = read_tree(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let worker = tree.get_mut(&vec!["engine".to_string(), "worker".to_string()]).expect("engine/worker.rs");
    worker.insert_str(0, "use crate::server::AppState;\n");
    let problems = rule_breaks(&tree);
    assert!(problems.iter().any(|p| p.contains("engine/worker imports server")), "{problems:?}");

    let files = |pairs: &[(&str, &str)]| -> Tree {
        pairs.iter().map(|(path, src)| (path.split('/').map(str::to_string).collect(), src.to_string())).collect()
    };
    let circle = files(&[
        ("a", "use super::b::X; // \"use crate::c\" in a comment"),
        ("b", "fn f() { crate::a::g() }"),
        ("c", ""),
    ]);
    assert_eq!(cycles(&circle), vec![vec!["a".to_string(), "b".to_string()]]);
    let quiet = files(&[
        ("a", r#"const S: &str = "crate::b::x"; /* crate::b */ fn f<'a>(x: &'a u8) -> char { '"' }"#),
        ("b", "use crate::a;"),
    ]);
    assert!(cycles(&quiet).is_empty(), "paths in strings and comments are not imports");
}

/// Module path (`["engine", "worker"]`; a `mod.rs` is its folder's) → source.
type Tree = BTreeMap<Vec<String>, String>;

fn read_tree(dir: &Path) -> Tree {
    let mut tree = Tree::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|x| x == "rs") && path.file_name().is_some_and(|n| n != "main.rs") {
                let rel = path.strip_prefix(dir).unwrap().with_extension("");
                let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
                if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                    parts.pop();
                }
                tree.insert(parts, std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    tree
}

/// The code of a file without comments, string and char literals, and its inline tests.
fn code_only(src: &str) -> String {
    let src = match src.find("#[cfg(test)]\nmod tests") {
        Some(at) => &src[..at],
        None => src,
    };
    let b = src.as_bytes();
    let (mut out, mut i) = (String::with_capacity(src.len()), 0);
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                while i < b.len() {
                    if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                        depth += 1;
                        i += 2;
                    } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
            }
            b'r' if (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                let close: Vec<u8> = std::iter::once(b'"').chain(std::iter::repeat_n(b'#', hashes)).collect();
                i += 2 + hashes;
                while i < b.len() && !b[i..].starts_with(&close) {
                    i += 1;
                }
                i += close.len();
                out.push_str("\"\"");
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            // A char literal ('x', '\n', '"'); a lifetime ('a) is kept.
            b'\'' if b.get(i + 2) == Some(&b'\'') || b.get(i + 1) == Some(&b'\\') => {
                i += 1;
                while i < b.len() && b[i] != b'\'' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    out
}

/// Every path a `use` tree names (`a::{b, c::{d}}` → `a::b`, `a::c::d`), white space removed.
fn use_paths(tree: &str) -> Vec<String> {
    // White space out, renames (`X as Y`) too.
    let words: Vec<&str> = tree.split_whitespace().collect();
    let (mut tree, mut i) = (String::new(), 0);
    while i < words.len() {
        if words[i] == "as" && i + 1 < words.len() {
            tree.push_str(words[i + 1].trim_start_matches(|c: char| c.is_alphanumeric() || c == '_'));
            i += 2;
        } else {
            tree.push_str(words[i]);
            i += 1;
        }
    }
    let mut out = Vec::new();
    fn walk(prefix: &str, items: &str, out: &mut Vec<String>) {
        let (mut depth, mut start) = (0, 0);
        let bytes = items.as_bytes();
        for i in 0..=bytes.len() {
            let end = i == bytes.len();
            match bytes.get(i) {
                Some(b'{') => depth += 1,
                Some(b'}') => depth -= 1,
                _ => {}
            }
            if end || (bytes[i] == b',' && depth == 0) {
                let item = &items[start..i];
                start = i + 1;
                match item.split_once('{') {
                    Some((head, rest)) => walk(&format!("{prefix}{head}"), rest.strip_suffix('}').unwrap_or(rest), out),
                    None if !item.is_empty() => out.push(format!("{prefix}{item}")),
                    None => {}
                }
            }
        }
    }
    walk("", &tree, &mut out);
    out
}

/// The file a `crate::`/`super::`/`self::` path in module `at` names: its longest prefix
/// that is a file of the tree.
fn resolve(tree: &Tree, at: &[String], path: &str) -> Option<Vec<String>> {
    let mut segs = path.split("::").filter(|s| !s.is_empty()).peekable();
    let mut base: Vec<String> = match segs.peek().copied() {
        Some("crate") => Vec::new(),
        Some("super") | Some("self") => at.to_vec(),
        _ => return None,
    };
    if segs.peek() == Some(&"crate") {
        segs.next();
    }
    while let Some(&s) = segs.peek() {
        match s {
            "super" => {
                base.pop();
            }
            "self" => {}
            _ => break,
        }
        segs.next();
    }
    base.extend(segs.map(str::to_string));
    (0..=base.len()).rev().map(|k| base[..k].to_vec()).find(|p| tree.contains_key(p))
}

/// Each file's imports: the files of the tree it names, and `<axum>`/`<wasmtime>`.
fn imports(tree: &Tree) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mut all = BTreeMap::new();
    for (at, src) in tree {
        let code = code_only(src);
        let mut paths: Vec<String> = Vec::new();
        let mut rest = code.as_str();
        while let Some(i) = rest.find("use ") {
            let boundary = i == 0 || !rest.as_bytes()[i - 1].is_ascii_alphanumeric() && rest.as_bytes()[i - 1] != b'_';
            let tail = &rest[i + 4..];
            let end = tail.find(';').unwrap_or(tail.len());
            if boundary {
                paths.extend(use_paths(&tail[..end]));
            }
            rest = &tail[if boundary { end } else { 0 }..];
        }
        // Paths written inline: `crate::a::b`, `super::x`.
        let b = code.as_bytes();
        for start in ["crate::", "super::", "self::"] {
            let mut from = 0;
            while let Some(i) = code[from..].find(start).map(|i| i + from) {
                from = i + start.len();
                if i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_' || b[i - 1] == b':') {
                    continue;
                }
                let end = code[i..]
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                    .map_or(code.len(), |e| i + e);
                paths.push(code[i..end].to_string());
            }
        }
        let mut found: BTreeSet<Vec<String>> =
            paths.iter().filter_map(|p| resolve(tree, at, p)).filter(|p| p != at).collect();
        for external in ["axum", "wasmtime"] {
            if paths.iter().any(|p| p == external || p.starts_with(&format!("{external}::")))
                || code.contains(&format!("{external}::"))
            {
                found.insert(vec![format!("<{external}>")]);
            }
        }
        all.insert(at.clone(), found);
    }
    all
}

/// The imports that break [`RULES`] and are not in [`KNOWN_EDGES`], and the known ones gone.
fn rule_breaks(tree: &Tree) -> Vec<String> {
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for (at, targets) in imports(tree) {
        let Some(top) = at.first() else { continue };
        let Some((_, banned)) = RULES.iter().find(|(folder, _)| folder == top) else { continue };
        for target in targets {
            if !banned.contains(&target[0].as_str()) {
                continue;
            }
            let (from, to) = (at.join("/"), target.join("/"));
            if KNOWN_EDGES.contains(&(from.as_str(), to.as_str())) {
                seen.insert((from, to));
            } else {
                problems.push(format!("{from} imports {to}: {top}/ must not import {}", target[0]));
            }
        }
    }
    for (from, to) in KNOWN_EDGES {
        if !seen.contains(&(from.to_string(), to.to_string())) {
            problems.push(format!("{from} no longer imports {to}: take it off KNOWN_EDGES in tidy.rs"));
        }
    }
    problems
}

/// The circles of files importing each other (strongly connected parts of more than one
/// file), each sorted, as `a/b` paths.
fn cycles(tree: &Tree) -> Vec<Vec<String>> {
    let graph = imports(tree);
    let nodes: Vec<&Vec<String>> = graph.keys().collect();
    let index: BTreeMap<&Vec<String>, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let edges: Vec<Vec<usize>> =
        nodes.iter().map(|n| graph[*n].iter().filter_map(|t| index.get(t).copied()).collect()).collect();
    // Tarjan's algorithm.
    struct State {
        next: usize,
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        stack: Vec<usize>,
        on: Vec<bool>,
        out: Vec<Vec<usize>>,
    }
    fn visit(v: usize, edges: &[Vec<usize>], s: &mut State) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on[v] = true;
        for &w in &edges[v] {
            match s.index[w] {
                None => {
                    visit(w, edges, s);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on[w] => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut part = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on[w] = false;
                part.push(w);
                if w == v {
                    break;
                }
            }
            if part.len() > 1 {
                s.out.push(part);
            }
        }
    }
    let n = nodes.len();
    let mut s =
        State { next: 0, index: vec![None; n], low: vec![0; n], stack: vec![], on: vec![false; n], out: vec![] };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(v, &edges, &mut s);
        }
    }
    let mut out: Vec<Vec<String>> = s
        .out
        .into_iter()
        .map(|part| part.into_iter().map(|i| nodes[i].join("/")).collect::<BTreeSet<_>>().into_iter().collect())
        .collect();
    out.sort();
    out
}
