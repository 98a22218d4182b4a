//! Reads JSON call objects (`{"name": "f", "arguments": {...}}`, one after another or in an
//! array) out of text that may stop anywhere, so calls can be streamed while the model is
//! still writing them. Only what is certain is reported: a call once its name string is
//! complete, and as much of its arguments value as has been written (for an object, the
//! raw text; a string value — arguments as a JSON string — only once it is complete).

/// A call seen so far.
#[derive(Debug, PartialEq, Eq)]
pub struct Partial<'a> {
    pub name: String,
    pub arguments: Arguments<'a>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Arguments<'a> {
    /// The raw text of an object (or other non-string) value, possibly unfinished.
    Raw(&'a str),
    /// A string value: its decoded content once complete.
    Text { value: Option<String> },
    /// No arguments key seen yet.
    Missing,
}

struct Scan<'a> {
    s: &'a str,
    at: usize,
}

impl<'a> Scan<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.at).copied()
    }
    fn skip(&mut self, chars: &[u8]) {
        while self.peek().is_some_and(|c| c.is_ascii_whitespace() || chars.contains(&c)) {
            self.at += 1;
        }
    }
    /// A complete JSON string at the cursor (which is on its opening quote), decoded.
    fn string(&mut self) -> Option<String> {
        let start = self.at;
        let mut stream = serde_json::Deserializer::from_str(&self.s[start..]).into_iter::<String>();
        match stream.next() {
            Some(Ok(v)) => {
                self.at = start + stream.byte_offset();
                Some(v)
            }
            _ => None,
        }
    }
    /// Skips one value (tracking nesting and strings); `false` if the text ends inside it.
    fn value(&mut self) -> bool {
        let bytes = self.s.as_bytes();
        let (mut depth, mut in_string, mut escape) = (0usize, false, false);
        while self.at < bytes.len() {
            let c = bytes[self.at];
            self.at += 1;
            if in_string {
                match (escape, c) {
                    (true, _) => escape = false,
                    (false, b'\\') => escape = true,
                    (false, b'"') => {
                        in_string = false;
                        if depth == 0 {
                            return true;
                        }
                    }
                    _ => {}
                }
                continue;
            }
            match c {
                b'"' => in_string = true,
                b'{' | b'[' => depth += 1,
                b'}' | b']' => {
                    if depth == 0 {
                        self.at -= 1;
                        return true;
                    }
                    depth -= 1;
                    if depth == 0 {
                        return true;
                    }
                }
                b',' if depth == 0 => {
                    self.at -= 1;
                    return true;
                }
                _ => {}
            }
        }
        false
    }
}

/// The calls in `text` so far; stops at the first thing that is not a call object.
pub fn calls(text: &str) -> Vec<Partial<'_>> {
    let mut out = Vec::new();
    let mut p = Scan { s: text, at: 0 };
    loop {
        p.skip(b"[;,");
        if p.peek() != Some(b'{') {
            return out;
        }
        p.at += 1;
        let (mut name, mut arguments) = (None, Arguments::Missing);
        loop {
            p.skip(b",");
            match p.peek() {
                Some(b'}') => {
                    p.at += 1;
                    break;
                }
                Some(b'"') => {}
                _ => {
                    // Ended (or malformed) inside the object: report what is certain.
                    if let Some(name) = name {
                        out.push(Partial { name, arguments });
                    }
                    return out;
                }
            }
            let Some(key) = p.string() else {
                if let Some(name) = name {
                    out.push(Partial { name, arguments });
                }
                return out;
            };
            p.skip(b"");
            if p.peek() != Some(b':') {
                if let Some(name) = name {
                    out.push(Partial { name, arguments });
                }
                return out;
            }
            p.at += 1;
            p.skip(b"");
            let start = p.at;
            match key.as_str() {
                "name" => match p.string() {
                    Some(n) => name = Some(n),
                    None => return out,
                },
                "arguments" | "parameters" if p.peek() == Some(b'"') => {
                    arguments = Arguments::Text { value: p.string() };
                    if matches!(arguments, Arguments::Text { value: None }) {
                        if let Some(name) = name {
                            out.push(Partial { name, arguments });
                        }
                        return out;
                    }
                }
                "arguments" | "parameters" => {
                    let complete = p.value();
                    arguments = Arguments::Raw(&text[start..p.at]);
                    if !complete {
                        if let Some(name) = name {
                            out.push(Partial { name, arguments });
                        }
                        return out;
                    }
                }
                _ => {
                    if !p.value() {
                        if let Some(name) = name {
                            out.push(Partial { name, arguments });
                        }
                        return out;
                    }
                }
            }
        }
        match name {
            Some(name) => out.push(Partial { name, arguments }),
            None => return out,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_only_what_is_certain() {
        assert!(calls(r#"{"name": "get_wea"#).is_empty());
        assert_eq!(calls(r#"{"name": "f", "argu"#), vec![Partial { name: "f".into(), arguments: Arguments::Missing }]);
        assert_eq!(
            calls(r#"{"name": "f", "arguments": {"city": "Pa"#),
            vec![Partial { name: "f".into(), arguments: Arguments::Raw(r#"{"city": "Pa"#) }]
        );
        // A brace inside a string does not end the arguments.
        let done = r#"{"name": "f", "arguments": {"s": "}{", "n": [1, {"a": 2}]}}"#;
        assert_eq!(
            calls(done),
            vec![Partial { name: "f".into(), arguments: Arguments::Raw(r#"{"s": "}{", "n": [1, {"a": 2}]}"#) }]
        );
        let two = r#"[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"x": 1}}]"#;
        let got = calls(two);
        assert_eq!(got.len(), 2);
        assert_eq!(got[1], Partial { name: "b".into(), arguments: Arguments::Raw(r#"{"x": 1}"#) });
        assert_eq!(
            calls(r#"{"name": "f", "arguments": "{\"a\": 1}"}"#),
            vec![Partial { name: "f".into(), arguments: Arguments::Text { value: Some("{\"a\": 1}".into()) } }]
        );
        assert!(calls("not json").is_empty());
    }
}
