//! GBNF, llama.cpp's grammar format (which vLLM's and llama.cpp's users send as `grammar`),
//! read into llguidance's Lark dialect, which it is close to:
//!
//! ```text
//!   GBNF                               Lark (llguidance)
//!   root ::= item ("," item)*          start: g-root
//!                                      g-root: g-item ("," g-item)*
//!   "a\x41\u00e9"                      "aA\u00e9"          (strings are JSON strings)
//!   [a-z\n] [^"\\]  .                  /[\x{61}-\x{7a}\x{a}]/  /[^\x{22}\x{5c}]/  /(?s:.)/
//!   x* x+ x? x{2} x{2,} x{2,5} ( | )   the same
//!   # comment                          (dropped)
//! ```
//!
//! Rule names get a `g-` prefix: GBNF's may start with a digit or a capital (a terminal in
//! Lark) or be `start`.

use std::collections::HashMap;

/// Whether `grammar` is GBNF rather than Lark: its rules are defined with `::=`, which Lark
/// does not use.
pub fn is_gbnf(grammar: &str) -> bool {
    grammar.contains("::=")
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Name(String),
    Define,
    Literal(String),
    /// A character class: negated, and its ranges.
    Class(bool, Vec<(char, char)>),
    Any,
    /// `(`, `)`, `|`, `*`, `+`, `?`, or a `{m,n}` repetition, passed through.
    Op(String),
}

/// The Lark grammar for a GBNF one, or what is wrong with it (with its line).
pub fn to_lark(gbnf: &str) -> Result<String, String> {
    let toks = lex(gbnf)?;
    // Rules: a name followed by `::=` starts one, which runs to the next such pair.
    let mut rules: Vec<(String, Vec<(Tok, usize)>)> = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        match (&toks[i], toks.get(i + 1)) {
            ((Tok::Name(n), _), Some((Tok::Define, _))) => {
                rules.push((n.clone(), Vec::new()));
                i += 2;
            }
            ((t, line), _) => match rules.last_mut() {
                Some((_, body)) => {
                    body.push((t.clone(), *line));
                    i += 1;
                }
                None => return Err(format!("line {line}: expected a rule (name ::= ...)")),
            },
        }
    }
    let mut names: HashMap<&str, String> = HashMap::new();
    for (n, _) in &rules {
        if names.contains_key(n.as_str()) {
            return Err(format!("the rule '{n}' is defined twice"));
        }
        // NOTE: `Ab` and `ab` are two GBNF rules, one name in lowercase: the second gets a
        // number.
        let base = format!("g-{}", n.to_lowercase());
        let mut lark = base.clone();
        let mut k = 1;
        while names.values().any(|v| *v == lark) {
            lark = format!("{base}-{k}");
            k += 1;
        }
        names.insert(n, lark);
    }
    let root = names
        .get("root")
        .ok_or("the grammar has no 'root' rule (where generation starts)")?;
    let mut out = format!("start: {root}\n");
    for (n, body) in &rules {
        out.push_str(&names[n.as_str()]);
        out.push(':');
        // An empty alternative matches nothing: an empty string in Lark.
        let mut empty = true;
        for (t, line) in body {
            let postfix = matches!(t, Tok::Op(op) if op != "(" && op != "|");
            if !postfix {
                out.push(' ');
            }
            match t {
                Tok::Name(r) => match names.get(r.as_str()) {
                    Some(l) => out.push_str(l),
                    None => return Err(format!("line {line}: the rule '{r}' is not defined")),
                },
                Tok::Literal(s) => out.push_str(&serde_json::Value::from(s.as_str()).to_string()),
                Tok::Class(negated, ranges) => out.push_str(&class_regex(*negated, ranges)),
                Tok::Any => out.push_str("/(?s:.)/"),
                Tok::Op(op) if op == "|" && empty => out.push_str("\"\" |"),
                Tok::Op(op) => out.push_str(op),
                Tok::Define => return Err(format!("line {line}: '::=' after no rule name")),
            }
            empty = matches!(t, Tok::Op(op) if op == "|" || op == "(");
        }
        if empty {
            out.push_str(" \"\"");
        }
        out.push('\n');
    }
    Ok(out)
}

fn class_regex(negated: bool, ranges: &[(char, char)]) -> String {
    let mut r = String::from("/[");
    if negated {
        r.push('^');
    }
    for &(a, b) in ranges {
        r.push_str(&format!("\\x{{{:x}}}", a as u32));
        if a != b {
            r.push_str(&format!("-\\x{{{:x}}}", b as u32));
        }
    }
    r.push_str("]/");
    r
}

fn lex(src: &str) -> Result<Vec<(Tok, usize)>, String> {
    let mut out = Vec::new();
    let mut cs = src.chars().peekable();
    let mut line = 1;
    while let Some(c) = cs.next() {
        let at = line;
        match c {
            '\n' => line += 1,
            c if c.is_whitespace() => {}
            '#' => {
                for c in cs.by_ref() {
                    if c == '\n' {
                        line += 1;
                        break;
                    }
                }
            }
            ':' => {
                if cs.next() != Some(':') || cs.next() != Some('=') {
                    return Err(format!("line {at}: expected '::='"));
                }
                out.push((Tok::Define, at));
            }
            '"' => {
                let mut s = String::new();
                loop {
                    match cs.next() {
                        None | Some('\n') => {
                            return Err(format!("line {at}: a string is not closed"));
                        }
                        Some('"') => break,
                        Some('\\') => s.push(escape(&mut cs, at)?),
                        Some(c) => s.push(c),
                    }
                }
                out.push((Tok::Literal(s), at));
            }
            '[' => {
                let negated = cs.next_if_eq(&'^').is_some();
                let mut ranges = Vec::new();
                loop {
                    let a = match cs.next() {
                        None => return Err(format!("line {at}: a character class is not closed")),
                        Some(']') => break,
                        Some('\\') => escape(&mut cs, at)?,
                        Some(c) => c,
                    };
                    let b = if cs.peek() == Some(&'-') {
                        cs.next();
                        match cs.next() {
                            // A '-' before the closing bracket is itself.
                            Some(']') => {
                                ranges.push((a, a));
                                ranges.push(('-', '-'));
                                break;
                            }
                            Some('\\') => escape(&mut cs, at)?,
                            Some(c) => c,
                            None => {
                                return Err(format!("line {at}: a character class is not closed"));
                            }
                        }
                    } else {
                        a
                    };
                    if b < a {
                        return Err(format!("line {at}: the range {a:?}-{b:?} is backwards"));
                    }
                    ranges.push((a, b));
                }
                if ranges.is_empty() {
                    return Err(format!("line {at}: an empty character class"));
                }
                out.push((Tok::Class(negated, ranges), at));
            }
            '.' => out.push((Tok::Any, at)),
            '(' | ')' | '|' | '*' | '+' | '?' => out.push((Tok::Op(c.to_string()), at)),
            '{' => {
                let mut body = String::new();
                for c in cs.by_ref() {
                    if c == '}' {
                        break;
                    }
                    body.push(c);
                }
                let parts: Vec<&str> = body.split(',').map(str::trim).collect();
                let num = |s: &str| s.is_empty() || s.parse::<u32>().is_ok();
                let ok = match parts.as_slice() {
                    [m] => !m.is_empty() && num(m),
                    [m, n] => !m.is_empty() && num(m) && num(n),
                    _ => false,
                };
                if !ok {
                    return Err(format!(
                        "line {at}: a repetition must be {{m}}, {{m,}} or {{m,n}}, got {{{body}}}"
                    ));
                }
                out.push((Tok::Op(format!("{{{}}}", parts.join(","))), at));
            }
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let mut name = c.to_string();
                while let Some(c) =
                    cs.next_if(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                {
                    name.push(c);
                }
                out.push((Tok::Name(name), at));
            }
            c => return Err(format!("line {at}: unexpected character {c:?}")),
        }
    }
    Ok(out)
}

/// The character after a backslash (in a string or a class).
fn escape(cs: &mut std::iter::Peekable<std::str::Chars>, line: usize) -> Result<char, String> {
    let hex = |cs: &mut std::iter::Peekable<std::str::Chars>, n: usize| {
        let h: String = (0..n).filter_map(|_| cs.next()).collect();
        u32::from_str_radix(&h, 16)
            .ok()
            .filter(|_| h.len() == n)
            .and_then(char::from_u32)
            .ok_or_else(|| format!("line {line}: a bad escape with {n} hex digits: {h:?}"))
    };
    match cs.next() {
        Some('n') => Ok('\n'),
        Some('r') => Ok('\r'),
        Some('t') => Ok('\t'),
        Some('x') => hex(cs, 2),
        Some('u') => hex(cs, 4),
        Some('U') => hex(cs, 8),
        Some(c @ ('\\' | '"' | '[' | ']' | '-' | '^')) => Ok(c),
        other => Err(format!(
            "line {line}: unknown escape \\{}",
            other.map_or(String::new(), String::from)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_strings_classes_and_repetitions() {
        let g = r#"
# a list of numbers
root   ::= "[" num ("," ws num){0,3} "]"   # trailing comment
num    ::= [1-9] [0-9]* | "0"
ws     ::= [ \t\n]?
Upper-Case ::= "\x41\u00e9\"" [^"\\] . | 
"#;
        assert!(is_gbnf(g));
        let lark = to_lark(g).unwrap();
        let want = "start: g-root\n\
g-root: \"[\" g-num ( \",\" g-ws g-num){0,3} \"]\"\n\
g-num: /[\\x{31}-\\x{39}]/ /[\\x{30}-\\x{39}]/* | \"0\"\n\
g-ws: /[\\x{20}\\x{9}\\x{a}]/?\n\
g-upper-case: \"A\u{e9}\\\"\" /[^\\x{22}\\x{5c}]/ /(?s:.)/ | \"\"\n";
        assert_eq!(lark, want);
    }

    #[test]
    fn mistakes_are_named() {
        for (g, what) in [
            ("a ::= \"x\"", "no 'root'"),
            ("root ::= b", "'b' is not defined"),
            ("root ::= \"x", "not closed"),
            ("root ::= [z-a]", "backwards"),
            ("root ::= x{a}", "repetition"),
            ("\"x\" root ::= \"y\"", "expected a rule"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::= \"a\"\nroot ::= \"b\"", "defined twice"),
            ("root ::= <tok>", "unexpected character"),
        ] {
            let e = to_lark(g).unwrap_err();
            assert!(e.contains(what), "{g}: {e}");
        }
        assert!(!is_gbnf("start: \"a\""));
    }
}
