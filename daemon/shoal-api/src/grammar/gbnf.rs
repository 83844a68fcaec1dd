//! A recognizer for the GBNF these grammars are written in (literals, character
//! classes, rules, groups, alternatives, `?` `*` `+` `{m,n}`), so tests can check that a
//! grammar accepts the answers it promises and refuses others without a model.
//!
//! Its own file so that the routes' tests (another crate) can include it too.

use std::collections::HashMap;

#[derive(Debug)]
enum G {
    Lit(Vec<char>),
    /// Negated, ranges.
    Class(bool, Vec<(char, char)>),
    Rule(String),
    Seq(Vec<G>),
    Alt(Vec<G>),
    Rep(Box<G>, usize, Option<usize>),
}

struct Parser {
    s: Vec<char>,
    i: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.s.get(self.i).copied()
    }
    fn skip(&mut self) {
        while self.peek().is_some_and(|c| c == ' ' || c == '\t') {
            self.i += 1;
        }
    }
    fn char(&mut self) -> char {
        let c = self.s[self.i];
        self.i += 1;
        if c != '\\' {
            return c;
        }
        let e = self.s[self.i];
        self.i += 1;
        match e {
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'x' => {
                let hex: String = self.s[self.i..self.i + 2].iter().collect();
                self.i += 2;
                char::from_u32(u32::from_str_radix(&hex, 16).unwrap()).unwrap()
            }
            other => other,
        }
    }
    fn alt(&mut self) -> G {
        let mut alts = vec![self.seq()];
        while self.peek() == Some('|') {
            self.i += 1;
            alts.push(self.seq());
        }
        G::Alt(alts)
    }
    fn seq(&mut self) -> G {
        let mut items = Vec::new();
        loop {
            self.skip();
            let item = match self.peek() {
                None | Some('|') | Some(')') => break,
                Some('"') => {
                    self.i += 1;
                    let mut lit = Vec::new();
                    while self.peek() != Some('"') {
                        lit.push(self.char());
                    }
                    self.i += 1;
                    G::Lit(lit)
                }
                Some('[') => {
                    self.i += 1;
                    let negated = self.peek() == Some('^');
                    if negated {
                        self.i += 1;
                    }
                    let mut ranges = Vec::new();
                    while self.peek() != Some(']') {
                        let lo = self.char();
                        let hi = if self.peek() == Some('-') && self.s.get(self.i + 1) != Some(&']') {
                            self.i += 1;
                            self.char()
                        } else {
                            lo
                        };
                        ranges.push((lo, hi));
                    }
                    self.i += 1;
                    G::Class(negated, ranges)
                }
                Some('(') => {
                    self.i += 1;
                    let g = self.alt();
                    assert_eq!(self.peek(), Some(')'), "unclosed group");
                    self.i += 1;
                    g
                }
                Some(c) if c.is_ascii_alphanumeric() || c == '-' => {
                    let start = self.i;
                    while self.peek().is_some_and(|c| c.is_ascii_alphanumeric() || c == '-') {
                        self.i += 1;
                    }
                    G::Rule(self.s[start..self.i].iter().collect())
                }
                Some(c) => panic!("unexpected {c:?} in the grammar"),
            };
            let rep = match self.peek() {
                Some('?') => Some((0, Some(1))),
                Some('*') => Some((0, None)),
                Some('+') => Some((1, None)),
                Some('{') => {
                    let end = self.i + self.s[self.i..].iter().position(|&c| c == '}').unwrap();
                    let inner: String = self.s[self.i + 1..end].iter().collect();
                    self.i = end;
                    let (lo, hi) = match inner.split_once(',') {
                        None => (inner.parse().unwrap(), Some(inner.parse().unwrap())),
                        Some((lo, "")) => (lo.parse().unwrap(), None),
                        Some((lo, hi)) => (lo.parse().unwrap(), Some(hi.parse().unwrap())),
                    };
                    Some((lo, hi))
                }
                _ => None,
            };
            items.push(match rep {
                Some((lo, hi)) => {
                    self.i += 1;
                    G::Rep(Box::new(item), lo, hi)
                }
                None => item,
            });
        }
        G::Seq(items)
    }
}

/// Whether `grammar` matches the whole of `text` from its `root`.
pub(crate) fn accepts(grammar: &str, text: &str) -> bool {
    let mut rules = HashMap::new();
    for line in grammar.lines().filter(|l| !l.trim().is_empty()) {
        let (name, body) = line.split_once(" ::= ").expect("a rule per line");
        let mut p = Parser { s: body.chars().collect(), i: 0 };
        let g = p.alt();
        assert_eq!(p.i, p.s.len(), "rule {name} not read to its end");
        rules.insert(name.trim().to_string(), g);
    }
    let text: Vec<char> = text.chars().collect();
    let m = Matcher { rules: &rules, text: &text };
    m.ends(&G::Rule("root".into()), 0).contains(&text.len())
}

struct Matcher<'a> {
    rules: &'a HashMap<String, G>,
    text: &'a [char],
}

impl Matcher<'_> {
    /// Every position where `g` can end when it starts at `at`.
    fn ends(&self, g: &G, at: usize) -> Vec<usize> {
        let mut out = match g {
            G::Lit(l) => {
                if self.text.get(at..at + l.len()) == Some(&l[..]) {
                    vec![at + l.len()]
                } else {
                    vec![]
                }
            }
            G::Class(negated, ranges) => match self.text.get(at) {
                Some(c) if ranges.iter().any(|(lo, hi)| lo <= c && c <= hi) != *negated => vec![at + 1],
                _ => vec![],
            },
            G::Rule(name) => self.ends(self.rules.get(name).unwrap_or_else(|| panic!("no rule {name}")), at),
            G::Seq(items) => items
                .iter()
                .fold(vec![at], |from, item| from.iter().flat_map(|&p| self.ends(item, p)).collect::<Vec<_>>()),
            G::Alt(alts) => alts.iter().flat_map(|a| self.ends(a, at)).collect(),
            G::Rep(item, lo, hi) => {
                let mut out = if *lo == 0 { vec![at] } else { vec![] };
                let mut from = vec![at];
                for n in 1..=hi.unwrap_or(self.text.len() + 1) {
                    let mut next: Vec<usize> = from.iter().flat_map(|&p| self.ends(item, p)).collect();
                    next.sort_unstable();
                    next.dedup();
                    if next.is_empty() || next == from {
                        break;
                    }
                    if n >= *lo {
                        out.extend(&next);
                    }
                    from = next;
                }
                out
            }
        };
        out.sort_unstable();
        out.dedup();
        out
    }
}
