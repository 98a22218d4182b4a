//! The tool-call syntaxes of the model families the built-in adapters cover.

use super::{function, Call, Format};
use serde_json::{Map, Value};

/// Every JSON value in `text`, allowing whitespace, `;` or `,` between them.
fn json_values(text: &str) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        match stream.next() {
            Some(Ok(v)) => out.push(v),
            Some(Err(e)) => return Err(e.to_string()),
            None => break,
        }
        rest = rest[stream.byte_offset()..].trim_start_matches(|c: char| c.is_whitespace() || c == ';' || c == ',');
    }
    Ok(out)
}

/// `{"name": .., "arguments" | "parameters": ..}` as a call.
fn named_call(v: &Value) -> Result<Call, String> {
    let name = v.get("name").and_then(Value::as_str).ok_or("a tool call needs a string `name`")?;
    let args = v.get("arguments").or_else(|| v.get("parameters")).unwrap_or(&Value::Null);
    Ok(Call::new(name, args))
}

/// The grammar (Lark, llguidance's dialect) of the rest of a forced call in a JSON format:
/// the arguments as JSON held to the tool's `parameters` schema (written as [`spaced`]
/// writes JSON), then `close`, then the end of the reply. A call to `name` starts at its
/// arguments; a call to any function starts inside the name's quotes (the opener ended with
/// the opening one): the model picks one of the tools' names, then writes `mid` and the
/// arguments. `None` when `name` is not among the tools.
fn json_rest(name: Option<&str>, tools: &[Value], mid: &str, close: &str) -> Option<String> {
    let lit = |s: &str| Value::String(s.to_string()).to_string();
    let tools: Vec<(&str, Value)> = tools
        .iter()
        .filter_map(|t| {
            let f = function(t);
            Some((f.get("name")?.as_str()?, args_schema(f.get("parameters"))))
        })
        .collect();
    let mut out = String::new();
    match name {
        Some(name) => {
            let (_, schema) = tools.iter().find(|(n, _)| *n == name)?;
            out.push_str(&format!("start: args {}\nargs: %json {schema}\n", lit(close)));
        }
        None if tools.is_empty() => return None,
        None => {
            let calls: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
            out.push_str(&format!("start: {}\n", calls.join(" | ")));
            for (i, (name, schema)) in tools.iter().enumerate() {
                out.push_str(&format!("call_{i}: {} args_{i} {}\n", lit(&format!("{name}{mid}")), lit(close)));
                out.push_str(&format!("args_{i}: %json {schema}\n"));
            }
        }
    }
    Some(out)
}

/// The grammar of the rest of a forced call in a keyword format (Gemma's Python calls): the tool's properties in its schema's order, each required
/// one always and each optional one at most once, as `item(key, rule)` writes one (`rule`
/// names the value's rule, made by `value(property schema)`), separated by `sep`, then
/// `close` (a grammar fragment: a quoted literal, or special tokens as `<name>`) and the end
/// of the reply. A call to `name` starts at its first argument; a call to
/// any function starts where `any_head(name)` (the name as the format writes it) does.
/// `None` when `name` is not among the tools.
fn keyword_rest(
    name: Option<&str>,
    tools: &[Value],
    any_head: impl Fn(&str) -> String,
    item: impl Fn(&str, &str) -> String,
    value: impl Fn(&Value) -> String,
    sep: &str,
    close: &str,
) -> Option<String> {
    let lit = |s: &str| Value::String(s.to_string()).to_string();
    let tools: Vec<(&str, &Value)> =
        tools.iter().filter_map(|t| Some((function(t).get("name")?.as_str()?, function(t)))).collect();
    let chosen: Vec<(usize, &str, &Value)> = match name {
        Some(n) => {
            let (i, (_, f)) = tools.iter().enumerate().find(|(_, (t, _))| *t == n)?;
            vec![(i, n, *f)]
        }
        None if tools.is_empty() => return None,
        None => tools.iter().enumerate().map(|(i, (n, f))| (i, *n, *f)).collect(),
    };
    let mut out = String::new();
    let starts: Vec<String> = chosen.iter().map(|(i, _, _)| format!("call_{i}")).collect();
    out.push_str(&format!("start: {}\n", starts.join(" | ")));
    for (i, tool, f) in chosen {
        let schema = f.get("parameters");
        let props: Vec<(&String, &Value)> = schema
            .and_then(|s| s.get("properties"))
            .and_then(Value::as_object)
            .map(|p| p.iter().collect())
            .unwrap_or_default();
        let required: Vec<&str> = schema
            .and_then(|s| s.get("required"))
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let head = if name.is_some() { String::new() } else { format!("{} ", lit(&any_head(tool))) };
        out.push_str(&format!("call_{i}: {head}first_{i}_0 {close}\n"));
        let n = props.len();
        // first_{i}_k: nothing written yet from property k on; rest_{i}_k: something was.
        for (k, (key, prop)) in props.iter().enumerate() {
            out.push_str(&format!("v_{i}_{k}: {}\n", value(prop)));
            let it = item(key, &format!("v_{i}_{k}"));
            if required.contains(&key.as_str()) {
                out.push_str(&format!("first_{i}_{k}: {it} rest_{i}_{}\n", k + 1));
                out.push_str(&format!("rest_{i}_{k}: {} {it} rest_{i}_{}\n", lit(sep), k + 1));
            } else {
                out.push_str(&format!("first_{i}_{k}: {it} rest_{i}_{} | first_{i}_{}\n", k + 1, k + 1));
                out.push_str(&format!("rest_{i}_{k}: {} {it} rest_{i}_{} | rest_{i}_{}\n", lit(sep), k + 1, k + 1));
            }
        }
        out.push_str(&format!("first_{i}_{n}: \"\"\nrest_{i}_{n}: \"\"\n"));
    }
    Some(out)
}

/// A property's value as JSON held to its schema (compact), for the keyword formats.
fn json_value(prop: &Value) -> String {
    let schema = match prop {
        Value::Object(p) if !p.is_empty() => {
            let mut p = p.clone();
            p.entry("x-guidance").or_insert(serde_json::json!({
                "whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "
            }));
            Value::Object(p)
        }
        _ => serde_json::json!({}),
    };
    format!("%json {schema}")
}

/// A tool's `parameters` as the schema its arguments are held to: an object (any object when
/// the tool gives none), written as the JSON formats write arguments (a space after `:` and
/// `,`, no other whitespace) unless the schema sets llguidance's options itself.
fn args_schema(parameters: Option<&Value>) -> Value {
    let mut schema = match parameters {
        Some(Value::Object(p)) if !p.is_empty() => Value::Object(p.clone()),
        _ => serde_json::json!({"type": "object"}),
    };
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert(serde_json::json!({
            "whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "
        }));
    }
    schema
}

/// `head`, then the quoted name and `tail` (a call to `name`), or just the opening quote of
/// the name (a call to any function: the model writes the name).
fn json_opener(head: &str, name: Option<&str>, tail: &str) -> String {
    match name {
        Some(name) => format!("{head}{}{tail}", Value::String(name.to_string())),
        None => format!("{head}\""),
    }
}

/// A call as a JSON object `{"name": .., KEY: arguments}`, as the JSON formats write it.
fn json_call(call: &Call, key: &str) -> String {
    let arguments = serde_json::from_str::<Value>(&call.arguments).unwrap_or(Value::Null);
    format!("{{\"name\": {}, \"{key}\": {}}}", Value::String(call.name.clone()), spaced(&arguments))
}

/// JSON with a space after `:` and `,`, as chat templates' `tojson` (Python's `json.dumps`)
/// writes it and models learn to.
fn spaced(v: &Value) -> String {
    match v {
        Value::Array(items) => format!("[{}]", items.iter().map(spaced).collect::<Vec<_>>().join(", ")),
        Value::Object(map) => {
            let items: Vec<String> =
                map.iter().map(|(k, v)| format!("{}: {}", Value::String(k.clone()), spaced(v))).collect();
            format!("{{{}}}", items.join(", "))
        }
        v => v.to_string(),
    }
}

/// Hermes / Qwen2.5: `<tool_call>\n{"name": "f", "arguments": {..}}\n</tool_call>`.
#[derive(Default)]
pub struct Hermes;

impl Format for Hermes {
    fn streams_json(&self) -> bool {
        true
    }
    fn force(&self, name: Option<&str>) -> Option<String> {
        Some(json_opener("<tool_call>\n{\"name\": ", name, ", \"arguments\": "))
    }
    fn grammar(&self, name: Option<&str>, tools: &[Value]) -> Option<String> {
        json_rest(name, tools, "\", \"arguments\": ", "}\n</tool_call>")
    }
    fn trigger(&self) -> Option<&'static str> {
        Some("<tool_call>")
    }
    fn open(&self) -> &'static [(&'static str, bool)] {
        &[("<tool_call>", false)]
    }
    fn close(&self) -> Option<&'static str> {
        Some("</tool_call>")
    }
    fn parse(&self, region: &str, _tools: &[Value]) -> Result<Vec<Call>, String> {
        json_values(region)?.iter().map(named_call).collect()
    }
    fn write(&self, calls: &[Call]) -> Option<String> {
        let calls: Vec<String> =
            calls.iter().map(|c| format!("<tool_call>\n{}\n</tool_call>", json_call(c, "arguments"))).collect();
        Some(calls.join("\n"))
    }
    fn render(&self, tools: &[Value]) -> Option<String> {
        let list: Vec<String> = tools.iter().map(|t| function(t).to_string()).collect();
        Some(format!(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>",
            list.join("\n")
        ))
    }
}

/// Qwen3-Coder XML: `<tool_call>\n<function=f>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>`.
/// Parameter values are text; they become JSON per the tool's schema (strings stay strings,
/// numbers, booleans, objects and arrays are parsed), or by their look when no schema says.
#[derive(Default)]
pub struct Qwen3Coder;

/// What ends a qwen3-coder argument's value.
const QWEN_CLOSE: &str = "\n</parameter>\n";

/// Text with a line that opens or closes a tag of the format (a model that lost its place
/// writes the next `<parameter=` as the value, or inside it): no raw value holds one.
const QWEN_LOST: &str = r"((?s:.)*\n)?<\/?(parameter|function|tool_call)[=>](?s:.)*";

/// An XML format's argument value and its closer `close` (Lark): a string property's raw
/// text (one of its enum, a match of its pattern, or any text within its length bounds: a
/// `text_MIN_MAX` rule, recorded in `texts`, that the first closer ends), else JSON.
fn tag_value(prop: &Value, close: &str, texts: &mut std::collections::BTreeSet<(u64, Option<u64>)>) -> String {
    let close = Value::String(close.to_string());
    let kind = prop.get("type").and_then(Value::as_str);
    let strings: Option<Vec<String>> = prop
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|e| e.iter().map(|v| v.as_str().map(|s| Value::String(s.to_string()).to_string())).collect());
    if let Some(options) = strings.filter(|o| !o.is_empty() && matches!(kind, None | Some("string"))) {
        return format!("({}) {close}", options.join(" | "));
    }
    if kind.is_some() && kind != Some("string") {
        return format!("{} {close}", json_value(prop));
    }
    if let Some(pattern) = prop.get("pattern").and_then(Value::as_str) {
        let inner = pattern.strip_prefix('^').unwrap_or(pattern);
        let inner = inner.strip_suffix('$').filter(|i| !i.ends_with('\\')).unwrap_or(inner);
        return format!("/{}/ {close}", inner.replace('/', "\\/"));
    }
    let min = prop.get("minLength").and_then(Value::as_u64).unwrap_or(0);
    let max = prop.get("maxLength").and_then(Value::as_u64);
    texts.insert((min, max));
    format!("text_{min}_{}", max.map(|m| m.to_string()).unwrap_or_default())
}

/// An XML-tagged format's arguments (Qwen3-Coder's, MiniCPM 5's): each opened by `open(key)`,
/// its value raw text or JSON (`tag_value`) ended by `close`, raw text never holding what
/// matches `lost` (a tag of the format).
struct XmlTags<F: Fn(&str) -> String> {
    open: F,
    close: &'static str,
    lost: &'static str,
}

impl<F: Fn(&str) -> String> XmlTags<F> {
    /// `keyword_rest`'s grammar of a call in this format (`any_head`: a named function's
    /// opening; `end`: the call's closer), with the raw-text rules its values use.
    fn grammar(
        &self,
        name: Option<&str>,
        tools: &[Value],
        any_head: impl Fn(&str) -> String,
        end: &str,
    ) -> Option<String> {
        let texts = std::cell::RefCell::new(std::collections::BTreeSet::new());
        let item = |key: &str, rule: &str| format!("{} {rule}", Value::String((self.open)(key)));
        let value = |prop: &Value| tag_value(prop, self.close, &mut texts.borrow_mut());
        let mut out = keyword_rest(name, tools, any_head, item, value, "", &Value::String(end.into()).to_string())?;
        let (close, lost) = (self.close, self.lost);
        for (min, max) in texts.into_inner() {
            let max = max.map(|m| m.to_string()).unwrap_or_default();
            out.push_str(&format!("text_{min}_{max}[suffix={close:?}]: /(?s:.){{{min},{max}}}/ & ~/{lost}/\n"));
        }
        Some(out)
    }
}

/// A call's arguments as an XML format writes them: (key, text), a string as it is, any other
/// value as JSON.
fn raw_arguments(call: &Call) -> Vec<(String, String)> {
    match serde_json::from_str::<Value>(&call.arguments) {
        Ok(Value::Object(args)) => args
            .into_iter()
            .map(|(k, v)| match v {
                Value::String(s) => (k, s),
                v => (k, v.to_string()),
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The schema type of `param` of function `name` among `tools`.
fn param_type<'a>(tools: &'a [Value], name: &str, param: &str) -> Option<&'a str> {
    tools.iter().map(function).find(|f| f["name"] == name)?["parameters"]["properties"][param]["type"].as_str()
}

fn typed(value: &str, kind: Option<&str>) -> Value {
    match kind {
        Some("string") => Value::String(value.to_string()),
        _ => match serde_json::from_str::<Value>(value) {
            Ok(v) if kind.is_some() || !v.is_string() => v,
            _ => Value::String(value.to_string()),
        },
    }
}

/// The text between `<tag=NAME>` and `</tag>`, for each occurrence: (NAME, body).
fn tagged<'a>(text: &'a str, tag: &str) -> Result<Vec<(&'a str, &'a str)>, String> {
    let (open, close) = (format!("<{tag}="), format!("</{tag}>"));
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(&open) {
        let after = &rest[at + open.len()..];
        let gt = after.find('>').ok_or_else(|| format!("unterminated <{tag}=...>"))?;
        let body = &after[gt + 1..];
        let end = body.find(&close).unwrap_or(body.len());
        out.push((after[..gt].trim(), &body[..end]));
        rest = &body[(end + close.len()).min(body.len())..];
    }
    Ok(out)
}

impl Format for Qwen3Coder {
    fn force(&self, name: Option<&str>) -> Option<String> {
        Some(match name {
            Some(name) => format!("<tool_call>\n<function={name}>\n"),
            None => "<tool_call>\n<function=".into(),
        })
    }
    /// `<parameter=KEY>\nVALUE\n</parameter>\n` per argument (the tool's properties in its
    /// schema's order), then `</function>\n</tool_call>`. A value is raw text where the
    /// property is a string (held to its enum or pattern, or its length bounds, and ended by
    /// the first `\n</parameter>\n`), JSON held to its schema otherwise ([`Qwen3Coder::parse`]
    /// types values the same way).
    fn grammar(&self, name: Option<&str>, tools: &[Value]) -> Option<String> {
        let tags = XmlTags { open: |key| format!("<parameter={key}>\n"), close: QWEN_CLOSE, lost: QWEN_LOST };
        tags.grammar(name, tools, |n| format!("{n}>\n"), "</function>\n</tool_call>")
    }
    fn trigger(&self) -> Option<&'static str> {
        Some("<tool_call>")
    }
    fn write(&self, calls: &[Call]) -> Option<String> {
        let mut out = Vec::new();
        for c in calls {
            let mut text = format!("<tool_call>\n<function={}>\n", c.name);
            for (k, v) in raw_arguments(c) {
                text.push_str(&format!("<parameter={k}>\n{v}\n</parameter>\n"));
            }
            out.push(text + "</function>\n</tool_call>");
        }
        Some(out.join("\n"))
    }
    fn open(&self) -> &'static [(&'static str, bool)] {
        &[("<tool_call>", false)]
    }
    fn close(&self) -> Option<&'static str> {
        Some("</tool_call>")
    }
    fn parse(&self, region: &str, tools: &[Value]) -> Result<Vec<Call>, String> {
        let functions = tagged(region, "function")?;
        if functions.is_empty() {
            return Err("no <function=...> in the tool call".into());
        }
        functions
            .into_iter()
            .map(|(name, body)| {
                let mut args = Map::new();
                for (param, value) in tagged(body, "parameter")? {
                    let value = value.strip_prefix('\n').unwrap_or(value);
                    let value = value.strip_suffix('\n').unwrap_or(value);
                    args.insert(param.to_string(), typed(value, param_type(tools, name, param)));
                }
                Ok(Call::new(name, &Value::Object(args)))
            })
            .collect()
    }
}

/// MiniCPM 5's XML: `<function name="f"><param name="city">Paris</param></function>`, a value
/// with markup or line breaks wrapped as `<![CDATA[...]]>`; single or double quotes, and
/// other attributes after the name, as the model may write them (SGLang's `MiniCPM5Detector`
/// and mlx-lm's `minicpm5` parser read the same). Values are typed as Qwen3-Coder's; a
/// `<param>` without a name spoils the call (given back as written).
#[derive(Default)]
pub struct MiniCpm5;

/// What ends a MiniCPM 5 argument's value.
const MINICPM_CLOSE: &str = "</param>";

/// Raw value text that holds a tag of the format: a model that lost its place.
const MINICPM_LOST: &str = r"(?s:.)*<\/?(param|function)[\s>](?s:.)*";

/// The value of attribute `name` in a tag's text (`name="x"` or `name='x'`).
fn attribute<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let mut rest = tag;
    while let Some(at) = rest.find(name) {
        let before = rest[..at].chars().last();
        let after = rest[at + name.len()..].trim_start();
        rest = &rest[at + name.len()..];
        if !before.is_some_and(char::is_whitespace) {
            continue;
        }
        let Some(after) = after.strip_prefix('=') else { continue };
        let after = after.trim_start();
        let quote = after.chars().next().filter(|c| *c == '"' || *c == '\'')?;
        let body = &after[1..];
        return body.find(quote).map(|end| &body[..end]);
    }
    None
}

/// A value as written: CDATA's contents as they are, else the text trimmed.
fn cdata(value: &str) -> &str {
    let v = value.trim();
    v.strip_prefix("<![CDATA[").and_then(|v| v.strip_suffix("]]>")).unwrap_or(v)
}

impl Format for MiniCpm5 {
    fn force(&self, name: Option<&str>) -> Option<String> {
        Some(match name {
            Some(name) => format!("<function name=\"{name}\">"),
            None => "<function name=\"".into(),
        })
    }
    /// `<param name="KEY">VALUE</param>` per argument (the tool's properties in its schema's
    /// order), then `</function>`: raw text for a string property (held to its enum, pattern
    /// or length bounds, ended by the first `</param>`), JSON held to its schema otherwise.
    fn grammar(&self, name: Option<&str>, tools: &[Value]) -> Option<String> {
        let tags = XmlTags { open: |key| format!("<param name=\"{key}\">"), close: MINICPM_CLOSE, lost: MINICPM_LOST };
        tags.grammar(name, tools, |n| format!("{n}\">"), "</function>")
    }
    fn trigger(&self) -> Option<&'static str> {
        Some("<function name=\"")
    }
    fn write(&self, calls: &[Call]) -> Option<String> {
        let mut out = Vec::new();
        for c in calls {
            let mut text = format!("<function name=\"{}\">", c.name);
            for (k, v) in raw_arguments(c) {
                let plain = !v.contains(['<', '>', '&', '\n']) && v.trim() == v;
                let v = if plain { v } else { format!("<![CDATA[{v}]]>") };
                text.push_str(&format!("<param name=\"{k}\">{v}</param>"));
            }
            out.push(text + "</function>");
        }
        Some(out.join("\n"))
    }
    fn open(&self) -> &'static [(&'static str, bool)] {
        &[("<function", true)]
    }
    fn close(&self) -> Option<&'static str> {
        Some("</function>")
    }
    fn parse(&self, region: &str, tools: &[Value]) -> Result<Vec<Call>, String> {
        let rest = region.strip_prefix("<function").ok_or("no <function> tag")?;
        if !rest.starts_with(char::is_whitespace) {
            return Err("not a <function name=...> tag".into());
        }
        let gt = rest.find('>').ok_or("unterminated <function ...> tag")?;
        let name = attribute(&rest[..gt], "name").ok_or("a <function> tag without a name")?.trim();
        if name.is_empty() {
            return Err("a <function> tag with an empty name".into());
        }
        let mut body = &rest[gt + 1..];
        body = body.strip_suffix("</function>").unwrap_or(body);
        let mut args = Map::new();
        while let Some(at) = body.find("<param") {
            let after = &body[at + "<param".len()..];
            let gt = after.find('>').ok_or("unterminated <param ...> tag")?;
            let key = attribute(&after[..gt], "name").ok_or("a <param> tag without a name")?;
            let value = &after[gt + 1..];
            // CDATA may hold `</param>`: a value that opens one ends after it closes.
            let end = match value.trim_start().starts_with("<![CDATA[") {
                true => value.find("]]>").map(|e| e + 3 + value[e + 3..].find(MINICPM_CLOSE).unwrap_or(0)),
                false => value.find(MINICPM_CLOSE),
            }
            .ok_or_else(|| format!("<param name=\"{key}\"> is not closed"))?;
            args.insert(key.to_string(), typed(cdata(&value[..end]), param_type(tools, name, key)));
            body = &value[end + MINICPM_CLOSE.len()..];
        }
        Ok(vec![Call::new(name, &Value::Object(args))])
    }
    fn render(&self, tools: &[Value]) -> Option<String> {
        let list: Vec<String> = tools.iter().map(|t| function(t).to_string()).collect();
        Some(format!(
            "You have access to functions. To call one, write <function name=\"NAME\"><param name=\"ARG\">VALUE</param></function>, one <param> per argument; wrap a value that has markup or line breaks in <![CDATA[...]]>.\nThe functions, as JSON schemas:\n{}",
            list.join("\n")
        ))
    }
}

/// Llama 3.x: the whole reply is `{"name": "f", "parameters": {..}}` (several separated by
/// `;`), optionally after `<|python_tag|>`. Prose that merely contains JSON is not a call.
#[derive(Default)]
pub struct Llama3Json;

impl Format for Llama3Json {
    fn streams_json(&self) -> bool {
        true
    }
    fn force(&self, name: Option<&str>) -> Option<String> {
        Some(json_opener("{\"name\": ", name, ", \"parameters\": "))
    }
    fn grammar(&self, name: Option<&str>, tools: &[Value]) -> Option<String> {
        json_rest(name, tools, "\", \"parameters\": ", "}")
    }
    /// The whole opener: a call is a JSON object that starts as `{"name": "`.
    fn trigger(&self) -> Option<&'static str> {
        Some("{\"name\": \"")
    }
    fn write(&self, calls: &[Call]) -> Option<String> {
        Some(calls.iter().map(|c| json_call(c, "parameters")).collect::<Vec<_>>().join("; "))
    }
    fn open(&self) -> &'static [(&'static str, bool)] {
        &[("<|python_tag|>", false), ("{", true)]
    }
    fn close(&self) -> Option<&'static str> {
        None
    }
    fn anchored(&self) -> bool {
        true
    }
    fn parse(&self, region: &str, _tools: &[Value]) -> Result<Vec<Call>, String> {
        let region = region.trim().trim_end_matches("<|eom_id|>").trim_end_matches("<|eot_id|>");
        json_values(region)?.iter().map(named_call).collect()
    }
}

/// Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {..}}]` (v3 tokenizers) or
/// `[TOOL_CALLS]f[ARGS]{..}` repeated (v11+), to the end of the reply.
#[derive(Default)]
pub struct Mistral;

impl Format for Mistral {
    fn streams_json(&self) -> bool {
        true
    }
    fn force(&self, name: Option<&str>) -> Option<String> {
        Some(json_opener("[TOOL_CALLS][{\"name\": ", name, ", \"arguments\": "))
    }
    fn grammar(&self, name: Option<&str>, tools: &[Value]) -> Option<String> {
        json_rest(name, tools, "\", \"arguments\": ", "}]")
    }
    fn trigger(&self) -> Option<&'static str> {
        Some("[TOOL_CALLS]")
    }
    fn write(&self, calls: &[Call]) -> Option<String> {
        Some(format!(
            "[TOOL_CALLS][{}]",
            calls.iter().map(|c| json_call(c, "arguments")).collect::<Vec<_>>().join(", ")
        ))
    }
    fn open(&self) -> &'static [(&'static str, bool)] {
        &[("[TOOL_CALLS]", false)]
    }
    fn close(&self) -> Option<&'static str> {
        None
    }
    fn parse(&self, region: &str, _tools: &[Value]) -> Result<Vec<Call>, String> {
        let region = region.trim().trim_end_matches("</s>").trim();
        if region.starts_with('[') || region.starts_with('{') {
            let mut calls = Vec::new();
            for v in json_values(region)? {
                match v {
                    Value::Array(items) => calls.extend(items.iter().map(named_call).collect::<Result<Vec<_>, _>>()?),
                    v => calls.push(named_call(&v)?),
                }
            }
            return Ok(calls);
        }
        region
            .split("[TOOL_CALLS]")
            .filter(|s| !s.trim().is_empty())
            .map(|segment| {
                let (name, args) = segment.split_once("[ARGS]").ok_or("expected NAME[ARGS]{...}")?;
                let name = name.split("[CALL_ID]").next().unwrap_or(name).trim();
                let args: Value = serde_json::from_str(args.trim()).map_err(|e| e.to_string())?;
                Ok(Call::new(name, &args))
            })
            .collect()
    }
}

/// Gemma: Python calls in a fenced block, `` ```tool_code\nf(city="Paris", days=3)\n``` ``.
#[derive(Default)]
pub struct Gemma;

impl Format for Gemma {
    fn force(&self, name: Option<&str>) -> Option<String> {
        Some(format!("```tool_code\n{}", name.map(|n| format!("{n}(")).unwrap_or_default()))
    }
    /// Keyword arguments with JSON values (Python reads them; `Py` reads `true`/`null` too).
    fn grammar(&self, name: Option<&str>, tools: &[Value]) -> Option<String> {
        let item = |key: &str, rule: &str| format!("{} {rule}", Value::String(format!("{key}=")));
        keyword_rest(name, tools, |n| format!("{n}("), item, json_value, ", ", r#"")\n```""#)
    }
    fn trigger(&self) -> Option<&'static str> {
        Some("```tool_code")
    }
    fn write(&self, calls: &[Call]) -> Option<String> {
        let mut lines = Vec::new();
        for c in calls {
            let args = match serde_json::from_str::<Value>(&c.arguments) {
                Ok(Value::Object(args)) => args.iter().map(|(k, v)| format!("{k}={}", python(v))).collect(),
                _ => vec![],
            };
            lines.push(format!("{}({})", c.name, args.join(", ")));
        }
        Some(format!("```tool_code\n{}\n```", lines.join("\n")))
    }
    fn open(&self) -> &'static [(&'static str, bool)] {
        &[("```tool_code", false)]
    }
    fn close(&self) -> Option<&'static str> {
        Some("```")
    }
    fn parse(&self, region: &str, _tools: &[Value]) -> Result<Vec<Call>, String> {
        let mut calls = Vec::new();
        let mut p = Py { s: region.as_bytes(), at: 0 };
        loop {
            p.space();
            if p.at >= p.s.len() {
                break;
            }
            let name = p.dotted()?;
            p.expect(b'(')?;
            let mut args = Map::new();
            loop {
                p.space();
                if p.eat(b')') {
                    break;
                }
                let key = p.ident()?;
                p.space();
                p.expect(b'=')?;
                args.insert(key, p.value()?);
                p.space();
                if !p.eat(b',') {
                    p.space();
                    p.expect(b')')?;
                    break;
                }
            }
            calls.push(Call::new(&name, &Value::Object(args)));
        }
        Ok(calls)
    }
    fn render(&self, tools: &[Value]) -> Option<String> {
        let list: Vec<String> = tools.iter().map(|t| function(t).to_string()).collect();
        Some(format!(
            "You have access to functions. If you decide to invoke any of the function(s), put it in a fenced block tagged tool_code, as Python calls with keyword arguments:\n```tool_code\nfunction_name(parameter=value)\n```\nYou SHOULD NOT include any other text in the response if you call a function.\nThe functions, as JSON schemas:\n{}",
            list.join("\n")
        ))
    }
}

/// Gemma 4: `<|tool_call>call:f{city:<|"|>Paris<|"|>,days:3}<tool_call|>`, the markers and
/// the string quote `<|"|>` special tokens (the host's detokenizer keeps them as text). Keys
/// bare, strings between quote tokens as written (no escapes), numbers, booleans, `null`,
/// and nested `{k:v}` / `[..]` as the template's `format_argument` writes them.
#[derive(Default)]
pub struct Gemma4;

const GEMMA4_QUOTE: &str = "<|\"|>";

impl Format for Gemma4 {
    fn force(&self, name: Option<&str>) -> Option<String> {
        Some(format!("<|tool_call>call:{}", name.map(|n| format!("{n}{{")).unwrap_or_default()))
    }
    /// `key:value` in the schema's order, values as [`gemma4_value`] holds them; the quote
    /// and the closing marker are special tokens, written as llguidance's `<name>`, so only
    /// those tokens (never their text spelled out) match them.
    fn grammar(&self, name: Option<&str>, tools: &[Value]) -> Option<String> {
        let item = |key: &str, rule: &str| format!("{} {rule}", Value::String(format!("{key}:")));
        let close = format!("\"}}\" {GEMMA4_CLOSE}");
        let mut out = keyword_rest(name, tools, |n| format!("{n}{{"), item, gemma4_value, ",", &close)?;
        out.push_str(&gemma4_rules());
        Some(out)
    }
    fn trigger(&self) -> Option<&'static str> {
        Some("<|tool_call>")
    }
    fn write(&self, calls: &[Call]) -> Option<String> {
        let calls: Vec<String> = calls
            .iter()
            .map(|c| {
                let args = serde_json::from_str::<Value>(&c.arguments).unwrap_or(Value::Object(Map::new()));
                let body = match gemma4_arg(&args) {
                    b if b.starts_with('{') => b,
                    _ => "{}".into(),
                };
                format!("<|tool_call>call:{}{body}<tool_call|>", c.name)
            })
            .collect();
        Some(calls.concat())
    }
    fn open(&self) -> &'static [(&'static str, bool)] {
        &[("<|tool_call>", false)]
    }
    fn close(&self) -> Option<&'static str> {
        Some("<tool_call|>")
    }
    fn parse(&self, region: &str, _tools: &[Value]) -> Result<Vec<Call>, String> {
        let mut p = G4 { s: region, at: 0 };
        let mut calls = Vec::new();
        loop {
            p.space();
            if p.at >= p.s.len() {
                break;
            }
            if !p.s[p.at..].starts_with("call:") {
                return Err(format!("expected `call:` at byte {}", p.at));
            }
            p.at += "call:".len();
            let name = p.word();
            if name.is_empty() {
                return Err("a call without a function name".into());
            }
            p.space();
            let args = match p.s[p.at..].starts_with('{') {
                true => p.value()?,
                false => Value::Object(Map::new()),
            };
            calls.push(Call::new(&name, &args));
        }
        if calls.is_empty() {
            return Err("an empty tool call".into());
        }
        Ok(calls)
    }
}

const GEMMA4_CLOSE: &str = "<tool_call|>";

/// A property's value as Gemma 4 writes it, held to the property's schema where the syntax
/// lets a grammar say it: strings (an `enum`'s as alternatives) between quote tokens,
/// integers, numbers, booleans, `null`, arrays of their `items`; an object, or a property
/// without a type, takes any value.
fn gemma4_value(prop: &Value) -> String {
    let lit = |s: &str| Value::String(s.to_string()).to_string();
    if let Some(options) = prop.get("enum").and_then(Value::as_array) {
        let alts: Vec<String> = options
            .iter()
            .map(|v| match v {
                Value::String(s) => format!("{GEMMA4_QUOTE} {} {GEMMA4_QUOTE}", lit(s)),
                other => lit(&other.to_string()),
            })
            .collect();
        if !alts.is_empty() {
            return format!("({})", alts.join(" | "));
        }
    }
    let one = |t: &str| match t {
        "string" => "g4_string".to_string(),
        "integer" => "g4_integer".to_string(),
        "number" => "g4_number".to_string(),
        "boolean" => r#"("true" | "false")"#.to_string(),
        "null" => r#""null""#.to_string(),
        "array" => {
            let item = prop.get("items").map(gemma4_value).unwrap_or_else(|| "g4_any".into());
            format!(r#"("[" ({item} ("," {item})*)? "]")"#)
        }
        "object" => "g4_object".to_string(),
        _ => "g4_any".to_string(),
    };
    match prop.get("type") {
        Some(Value::String(t)) => one(t),
        Some(Value::Array(types)) if !types.is_empty() => {
            format!("({})", types.iter().filter_map(Value::as_str).map(one).collect::<Vec<_>>().join(" | "))
        }
        _ => "g4_any".into(),
    }
}

/// The rules [`gemma4_value`] names: a string is any text between two quote tokens (the quote
/// is a token of its own, so text cannot end it), keys are bare words.
fn gemma4_rules() -> String {
    let q = GEMMA4_QUOTE;
    format!(
        "g4_string: {q} G4_TEXT {q}\n\
         G4_TEXT: /(?s:.)*/\n\
         g4_integer: /-?(0|[1-9][0-9]*)/\n\
         g4_number: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][-+]?[0-9]+)?/\n\
         g4_any: g4_string | g4_number | \"true\" | \"false\" | \"null\" | \"[\" (g4_any (\",\" g4_any)*)? \"]\" | g4_object\n\
         g4_object: \"{{\" (g4_key \":\" g4_any (\",\" g4_key \":\" g4_any)*)? \"}}\"\n\
         g4_key: /[A-Za-z_][A-Za-z0-9_]*/\n"
    )
}

/// A value as Gemma 4's template writes an argument (`format_argument`).
fn gemma4_arg(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{GEMMA4_QUOTE}{s}{GEMMA4_QUOTE}"),
        Value::Array(items) => format!("[{}]", items.iter().map(gemma4_arg).collect::<Vec<_>>().join(",")),
        Value::Object(map) => {
            format!("{{{}}}", map.iter().map(|(k, v)| format!("{k}:{}", gemma4_arg(v))).collect::<Vec<_>>().join(","))
        }
        other => other.to_string(),
    }
}

/// Gemma 4's argument syntax.
struct G4<'a> {
    s: &'a str,
    at: usize,
}

impl G4<'_> {
    fn space(&mut self) {
        while self.s[self.at..].starts_with(|c: char| c.is_whitespace()) {
            self.at += 1;
        }
    }
    fn eat(&mut self, c: char) -> bool {
        self.space();
        let ok = self.s[self.at..].starts_with(c);
        self.at += usize::from(ok);
        ok
    }
    /// A bare word: letters, digits, `_`, `-`, `.`, `+`.
    fn word(&mut self) -> String {
        self.space();
        let rest = &self.s[self.at..];
        let n = rest.find(|c: char| !(c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '+'))).unwrap_or(rest.len());
        self.at += n;
        rest[..n].to_string()
    }
    fn value(&mut self) -> Result<Value, String> {
        self.space();
        let rest = &self.s[self.at..];
        if let Some(body) = rest.strip_prefix(GEMMA4_QUOTE) {
            let end = body.find(GEMMA4_QUOTE).ok_or("an unterminated <|\"|> string")?;
            self.at += GEMMA4_QUOTE.len() * 2 + end;
            return Ok(Value::String(body[..end].to_string()));
        }
        if rest.starts_with('"') {
            let mut de = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
            let v = de.next().ok_or("a bad string")?.map_err(|e| e.to_string())?;
            self.at += de.byte_offset();
            return Ok(v);
        }
        if self.eat('[') {
            let mut items = Vec::new();
            loop {
                if self.eat(']') {
                    return Ok(Value::Array(items));
                }
                items.push(self.value()?);
                if !self.eat(',') && !self.s[self.at..].trim_start().starts_with(']') {
                    return Err(format!("expected `,` or `]` at byte {}", self.at));
                }
            }
        }
        if self.eat('{') {
            let mut map = Map::new();
            loop {
                if self.eat('}') {
                    return Ok(Value::Object(map));
                }
                let key = match self.value()? {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                if !self.eat(':') {
                    return Err(format!("expected `:` after the key {key:?} at byte {}", self.at));
                }
                map.insert(key, self.value()?);
                if !self.eat(',') && !self.s[self.at..].trim_start().starts_with('}') {
                    return Err(format!("expected `,` or `}}` at byte {}", self.at));
                }
            }
        }
        let word = self.word();
        Ok(match word.as_str() {
            "" => return Err(format!("expected a value at byte {}", self.at)),
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            "null" | "None" => Value::Null,
            w => match serde_json::from_str::<serde_json::Number>(w) {
                Ok(n) => Value::Number(n),
                // A bare key, or a bare string the model wrote unquoted.
                Err(_) => Value::String(w.to_string()),
            },
        })
    }
}

/// OpenAI's harmony (GPT-OSS): a message addressed to a function,
/// `<|channel|>commentary to=functions.f <|constrain|>json<|message|>{..}<|call|>`, or with the
/// recipient in the role part, `<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{..}<|call|>`
/// (as the template writes earlier calls). `<|call|>` ends generation, so a region usually
/// runs to the end of the output. The `harmony-channels` reasoning parser ahead of the adapter
/// takes the other messages' headers off (analysis as reasoning, final and preambles as
/// content), so every region that reaches the adapter is one message to a recipient; one
/// addressed to anything but `functions.*` (a built-in browser or python tool) is given back
/// as written.
#[derive(Default)]
pub struct Harmony;

impl Format for Harmony {
    fn force(&self, name: Option<&str>) -> Option<String> {
        Some(match name {
            Some(name) => format!("<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"),
            None => "<|channel|>commentary to=functions.".into(),
        })
    }
    /// The arguments, then the end of the reply: the model's end-of-sequence tokens include
    /// `<|call|>` (GPT-OSS), and a call without it parses as well.
    fn grammar(&self, name: Option<&str>, tools: &[Value]) -> Option<String> {
        json_rest(name, tools, " <|constrain|>json<|message|>", "")
    }
    fn trigger(&self) -> Option<&'static str> {
        Some(" to=functions.")
    }
    fn write(&self, calls: &[Call]) -> Option<String> {
        let one = |c: &Call| {
            format!("<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>", c.name, c.arguments)
        };
        Some(calls.iter().map(one).collect())
    }
    fn open(&self) -> &'static [(&'static str, bool)] {
        &[("<|start|>", true), ("<|channel|>", true), (" to=functions.", true)]
    }
    fn close(&self) -> Option<&'static str> {
        Some("<|call|>")
    }
    fn parse(&self, region: &str, _tools: &[Value]) -> Result<Vec<Call>, String> {
        let (header, body) = region.split_once("<|message|>").ok_or("a harmony message needs <|message|>")?;
        let to = header.split_once("to=").ok_or("the message is not addressed to a tool")?.1;
        let recipient = to.split(|c: char| c.is_whitespace() || c == '<').next().unwrap_or_default();
        let name = recipient
            .strip_prefix("functions.")
            .filter(|n| !n.is_empty())
            .ok_or_else(|| format!("`{recipient}` is not a function"))?;
        let args: Value = serde_json::from_str(body.trim()).map_err(|e| e.to_string())?;
        if !args.is_object() {
            return Err("the arguments are not a JSON object".into());
        }
        Ok(vec![Call::new(name, &args)])
    }
    fn render(&self, tools: &[Value]) -> Option<String> {
        let mut out = String::from("# Tools\n\n## functions\n\nnamespace functions {\n\n");
        for tool in tools {
            let f = function(tool);
            let Some(name) = f.get("name").and_then(Value::as_str) else { continue };
            if let Some(d) = f.get("description").and_then(Value::as_str) {
                out.push_str(&format!("// {d}\n"));
            }
            let params = f.get("parameters").unwrap_or(&Value::Null);
            match params.get("properties").and_then(Value::as_object).filter(|p| !p.is_empty()) {
                None => out.push_str(&format!("type {name} = () => any;\n\n")),
                Some(props) => {
                    let required: Vec<&str> = params
                        .get("required")
                        .and_then(Value::as_array)
                        .map(|r| r.iter().filter_map(Value::as_str).collect())
                        .unwrap_or_default();
                    out.push_str(&format!("type {name} = (_: {{\n"));
                    for (key, spec) in props {
                        if let Some(d) = spec.get("description").and_then(Value::as_str) {
                            out.push_str(&format!("// {d}\n"));
                        }
                        let optional = if required.contains(&key.as_str()) { "" } else { "?" };
                        out.push_str(&format!("{key}{optional}: {},\n", typescript(spec)));
                    }
                    out.push_str("}) => any;\n\n");
                }
            }
        }
        out.push_str("} // namespace functions");
        Some(out)
    }
}

/// A JSON schema as the TypeScript type harmony describes parameters with.
fn typescript(spec: &Value) -> String {
    if let Some(values) = spec.get("enum").and_then(Value::as_array) {
        return values.iter().map(Value::to_string).collect::<Vec<_>>().join(" | ");
    }
    match spec.get("type").and_then(Value::as_str) {
        Some("string") => "string".into(),
        Some("number" | "integer") => "number".into(),
        Some("boolean") => "boolean".into(),
        Some("array") => format!("{}[]", spec.get("items").map(typescript).unwrap_or_else(|| "any".into())),
        Some("object") => "object".into(),
        _ => "any".into(),
    }
}

/// A JSON value as a Python literal (what `Py` reads back).
fn python(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => {
            let mut out = String::from('"');
            for c in s.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '"' => out.push_str("\\\""),
                    '\n' => out.push_str("\\n"),
                    '\t' => out.push_str("\\t"),
                    '\r' => out.push_str("\\r"),
                    c => out.push(c),
                }
            }
            out + "\""
        }
        Value::Array(items) => format!("[{}]", items.iter().map(python).collect::<Vec<_>>().join(", ")),
        Value::Object(map) => {
            let items: Vec<String> =
                map.iter().map(|(k, v)| format!("{}: {}", python(&Value::String(k.clone())), python(v))).collect();
            format!("{{{}}}", items.join(", "))
        }
    }
}

/// A small parser of Python call syntax and literals.
struct Py<'a> {
    s: &'a [u8],
    at: usize,
}

impl Py<'_> {
    fn space(&mut self) {
        while self.at < self.s.len() && self.s[self.at].is_ascii_whitespace() {
            self.at += 1;
        }
    }
    fn eat(&mut self, c: u8) -> bool {
        let ok = self.s.get(self.at) == Some(&c);
        self.at += usize::from(ok);
        ok
    }
    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("expected {:?} at byte {}", c as char, self.at))
        }
    }
    fn ident(&mut self) -> Result<String, String> {
        let start = self.at;
        while self.at < self.s.len() && (self.s[self.at].is_ascii_alphanumeric() || self.s[self.at] == b'_') {
            self.at += 1;
        }
        if start == self.at {
            return Err(format!("expected a name at byte {start}"));
        }
        Ok(String::from_utf8_lossy(&self.s[start..self.at]).into_owned())
    }
    fn dotted(&mut self) -> Result<String, String> {
        let mut name = self.ident()?;
        while self.eat(b'.') {
            name.push('.');
            name.push_str(&self.ident()?);
        }
        Ok(name)
    }
    fn value(&mut self) -> Result<Value, String> {
        self.space();
        let Some(&c) = self.s.get(self.at) else { return Err("expected a value".into()) };
        match c {
            b'"' | b'\'' => self.string(c),
            b'[' | b'(' => {
                self.at += 1;
                let close = if c == b'[' { b']' } else { b')' };
                let mut items = Vec::new();
                loop {
                    self.space();
                    if self.eat(close) {
                        return Ok(Value::Array(items));
                    }
                    items.push(self.value()?);
                    self.space();
                    if !self.eat(b',') {
                        self.space();
                        self.expect(close)?;
                        return Ok(Value::Array(items));
                    }
                }
            }
            b'{' => {
                self.at += 1;
                let mut map = Map::new();
                loop {
                    self.space();
                    if self.eat(b'}') {
                        return Ok(Value::Object(map));
                    }
                    let key = match self.value()? {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    self.space();
                    self.expect(b':')?;
                    map.insert(key, self.value()?);
                    self.space();
                    if !self.eat(b',') {
                        self.space();
                        self.expect(b'}')?;
                        return Ok(Value::Object(map));
                    }
                }
            }
            _ => {
                let start = self.at;
                while self.at < self.s.len()
                    && !matches!(self.s[self.at], b',' | b')' | b']' | b'}' | b':')
                    && !self.s[self.at].is_ascii_whitespace()
                {
                    self.at += 1;
                }
                let word = std::str::from_utf8(&self.s[start..self.at]).map_err(|e| e.to_string())?;
                match word {
                    "True" | "true" => Ok(Value::Bool(true)),
                    "False" | "false" => Ok(Value::Bool(false)),
                    "None" | "null" => Ok(Value::Null),
                    _ => serde_json::from_str::<serde_json::Number>(word)
                        .map(Value::Number)
                        .map_err(|_| format!("unsupported value {word:?}")),
                }
            }
        }
    }
    fn string(&mut self, quote: u8) -> Result<Value, String> {
        self.at += 1;
        let mut out = Vec::new();
        while let Some(&c) = self.s.get(self.at) {
            self.at += 1;
            match c {
                b'\\' => {
                    let e = *self.s.get(self.at).ok_or("unterminated string")?;
                    self.at += 1;
                    out.push(match e {
                        b'n' => b'\n',
                        b't' => b'\t',
                        b'r' => b'\r',
                        other => other,
                    });
                }
                c if c == quote => return Ok(Value::String(String::from_utf8_lossy(&out).into_owned())),
                c => out.push(c),
            }
        }
        Err("unterminated string".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{chunks, run};
    use serde_json::json;

    /// Runs `text` whole and in 1- and 3-character pieces; all must agree. Arguments come
    /// back parsed (streamed ones keep the model's spacing).
    fn check<F: Format>(text: &str, tools: &[Value]) -> (String, Vec<(String, Value)>) {
        let whole = run::<F>(&[text], tools);
        for n in [1, 3] {
            let pieces = chunks(text, n);
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            assert_eq!(run::<F>(&refs, tools), whole, "pieces of {n}");
        }
        let calls =
            whole.1.into_iter().map(|(n, a)| (n, serde_json::from_str(&a).unwrap_or(Value::String(a)))).collect();
        (whole.0, calls)
    }

    fn call(name: &str, args: Value) -> (String, Value) {
        (name.to_string(), args)
    }

    /// The JSON formats' grammars for the rest of a forced call: a named call starts at its
    /// arguments (held to that tool's schema, written compactly) and ends with the format's
    /// closer; a call to any function picks among the tools' names; an unknown name has none.
    #[test]
    fn forced_call_grammars_hold_the_arguments_to_the_tools_schema() {
        let tools = [
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}}, "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "get_time"}}),
        ];
        let named = Hermes.grammar(Some("get_weather"), &tools).unwrap();
        let mut lines = named.lines();
        assert_eq!(lines.next(), Some(r#"start: args "}\n</tool_call>""#));
        let schema: Value = serde_json::from_str(lines.next().unwrap().strip_prefix("args: %json ").unwrap()).unwrap();
        assert_eq!(schema["required"], json!(["city"]));
        assert_eq!(schema["x-guidance"]["key_separator"], ": ");
        let any = Mistral.grammar(None, &tools).unwrap();
        assert!(any.starts_with("start: call_0 | call_1\n"), "{any}");
        assert!(any.contains(r#"call_1: "get_time\", \"arguments\": " args_1 "}]""#), "{any}");
        assert!(any.contains(r#"args_1: %json {"type":"object","x-guidance""#), "any object without parameters: {any}");
        assert!(Llama3Json.grammar(Some("get_weather"), &tools).unwrap().starts_with(r#"start: args "}""#));
        assert!(Harmony.grammar(Some("get_weather"), &tools).unwrap().starts_with(r#"start: args """#));
        assert_eq!(Hermes.grammar(Some("nope"), &tools), None);
        assert_eq!(Hermes.grammar(None, &[]), None);
    }

    /// A call the model starts on its own: the grammar runs from just after the format's
    /// trigger (found in its opener for any function) through the rest of that opener to the
    /// call's end, as a forced call to any tool does; formats without a grammar have none.
    #[test]
    fn lazy_grammars_start_after_the_trigger_with_the_rest_of_the_opener() {
        use crate::Adapter;
        let tools = [json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})];
        let hermes = Adapter::<Hermes>::default().lazy_grammar(&tools).unwrap();
        assert!(hermes.starts_with(r#"start: "\n{\"name\": \"" (call_0)"#), "{hermes}");
        assert_eq!(
            hermes.split_once('\n').unwrap().1,
            Hermes.grammar(None, &tools).unwrap().split_once('\n').unwrap().1
        );
        let mistral = Adapter::<Mistral>::default().lazy_grammar(&tools).unwrap();
        assert!(mistral.starts_with(r#"start: "[{\"name\": \"" (call_0)"#), "{mistral}");
        // The trigger is the whole opener: the grammar is the forced one's.
        assert_eq!(Adapter::<Llama3Json>::default().lazy_grammar(&tools), Llama3Json.grammar(None, &tools));
        assert_eq!(Adapter::<Harmony>::default().lazy_grammar(&tools), Harmony.grammar(None, &tools));
        assert!(Adapter::<Gemma>::default().lazy_grammar(&tools).unwrap().starts_with(r#"start: "\n" ("#));
        let qwen = Adapter::<Qwen3Coder>::default().lazy_grammar(&tools).unwrap();
        assert!(qwen.starts_with(r#"start: "\n<function=" (call_0)"#), "{qwen}");
        for (trigger, opener) in [
            (Hermes.trigger(), Hermes.force(None)),
            (Llama3Json.trigger(), Llama3Json.force(None)),
            (Mistral.trigger(), Mistral.force(None)),
            (Gemma.trigger(), Gemma.force(None)),
            (Harmony.trigger(), Harmony.force(None)),
            (Qwen3Coder.trigger(), Qwen3Coder.force(None)),
        ] {
            assert!(opener.unwrap().contains(trigger.unwrap()));
        }
    }

    /// Gemma's grammar: properties in the schema's order, required ones always, optional ones
    /// skippable.
    #[test]
    fn gemma_grammars_take_required_properties_always_and_optional_ones_at_most_once() {
        let tools = [json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object",
            "properties": {"a": {"type": "string"}, "b": {"enum": ["x", "y"]}}, "required": ["b"]}}})];
        let g = Gemma.grammar(Some("f"), &tools).unwrap();
        assert!(g.contains("call_0: first_0_0 \")\\n```\""), "{g}");
        assert!(g.contains("first_0_0: \"a=\" v_0_0 rest_0_1 | first_0_1"), "a is optional: {g}");
        assert!(g.contains("first_0_1: \"b=\" v_0_1 rest_0_2\n"), "b is required: {g}");
        assert!(g.contains("rest_0_1: \", \" \"b=\" v_0_1 rest_0_2\n"), "{g}");
        assert!(g.contains("v_0_1: %json {\"enum\":[\"x\",\"y\"]"), "{g}");
        assert_eq!(Gemma.grammar(Some("g"), &tools), None);
    }

    /// Calls written by `write` (the assistant's earlier calls in the prompt) read back as the
    /// same calls, with nothing but line breaks between them, in every format, whatever the
    /// argument values hold.
    #[test]
    fn written_calls_parse_back_as_the_same_calls() {
        let tools = [
            json!({"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "text": {"type": "string"}, "n": {"type": "integer"}, "opts": {"type": "object"}}}}}),
        ];
        let args =
            json!({"path": "a \"b\".rs", "text": "line 1\n\tline 2 \\ é", "n": 3, "opts": {"deep": [1, true, null]}});
        let calls = [Call::new("edit", &args), Call::new("edit", &json!({"n": 4}))];
        let want = vec![call("edit", args.clone()), call("edit", json!({"n": 4}))];
        fn back<F: Format>(calls: &[Call], tools: &[Value]) -> (String, Vec<(String, Value)>) {
            let text = F::default().write(calls).expect("every built-in format writes calls");
            let (content, calls) = check::<F>(&text, tools);
            (content.trim().to_string(), calls) // the line breaks between calls
        }
        assert_eq!(back::<Hermes>(&calls, &tools), (String::new(), want.clone()), "hermes");
        assert_eq!(back::<Qwen3Coder>(&calls, &tools), (String::new(), want.clone()), "qwen3-coder");
        assert_eq!(back::<Llama3Json>(&calls, &tools), (String::new(), want.clone()), "llama3-json");
        assert_eq!(back::<Mistral>(&calls, &tools), (String::new(), want.clone()), "mistral");
        assert_eq!(back::<Gemma>(&calls, &tools), (String::new(), want.clone()), "gemma");
        assert_eq!(back::<Harmony>(&calls, &tools), (String::new(), want.clone()), "harmony");
        assert_eq!(back::<MiniCpm5>(&calls, &tools), (String::new(), want.clone()), "minicpm5");
        assert_eq!(back::<Gemma4>(&calls, &tools), (String::new(), want), "gemma4");
    }

    /// A forced call: the opener the host puts at the start of the reply, then what a model
    /// writes after it, parse as one call to the named function (or to the function the model
    /// names when any will do), with nothing left over as content.
    #[test]
    fn a_forced_opener_and_the_rest_of_the_call_parse_as_that_call() {
        let tools = [
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}),
        ];
        /// The reply text and the calls (name, parsed arguments), as `check` returns them.
        type Parsed = (String, Vec<(String, Value)>);
        fn forced<F: Format>(name: Option<&str>, rest: &str, tools: &[Value]) -> Parsed {
            let opener = F::default().force(name).expect("every built-in format can force a call");
            check::<F>(&format!("{opener}{rest}"), tools)
        }
        let want = vec![call("get_weather", json!({"city": "Paris"}))];
        let cases: [(&str, Parsed, Parsed); 8] = [
            (
                "hermes",
                forced::<Hermes>(Some("get_weather"), "{\"city\": \"Paris\"}}\n</tool_call>", &tools),
                forced::<Hermes>(None, "get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", &tools),
            ),
            (
                "qwen3-coder",
                forced::<Qwen3Coder>(
                    Some("get_weather"),
                    "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
                    &tools,
                ),
                forced::<Qwen3Coder>(
                    None,
                    "get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
                    &tools,
                ),
            ),
            (
                "llama3-json",
                forced::<Llama3Json>(Some("get_weather"), "{\"city\": \"Paris\"}}", &tools),
                forced::<Llama3Json>(None, "get_weather\", \"parameters\": {\"city\": \"Paris\"}}", &tools),
            ),
            (
                "mistral",
                forced::<Mistral>(Some("get_weather"), "{\"city\": \"Paris\"}}]", &tools),
                forced::<Mistral>(None, "get_weather\", \"arguments\": {\"city\": \"Paris\"}}]", &tools),
            ),
            (
                "gemma",
                forced::<Gemma>(Some("get_weather"), "city=\"Paris\")\n```", &tools),
                forced::<Gemma>(None, "get_weather(city=\"Paris\")\n```", &tools),
            ),
            (
                "harmony",
                forced::<Harmony>(Some("get_weather"), "{\"city\": \"Paris\"}", &tools),
                forced::<Harmony>(
                    None,
                    "get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
                    &tools,
                ),
            ),
            (
                "gemma4",
                forced::<Gemma4>(Some("get_weather"), "city:<|\"|>Paris<|\"|>}<tool_call|>", &tools),
                forced::<Gemma4>(None, "get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>", &tools),
            ),
            (
                "minicpm5",
                forced::<MiniCpm5>(Some("get_weather"), "<param name=\"city\">Paris</param></function>", &tools),
                forced::<MiniCpm5>(None, "get_weather\"><param name=\"city\">Paris</param></function>", &tools),
            ),
        ];
        for (format, named, any) in cases {
            assert_eq!(named, (String::new(), want.clone()), "{format}, named");
            assert_eq!(any, (String::new(), want.clone()), "{format}, any");
        }
        // A name that needs escaping stays one JSON string.
        assert_eq!(Hermes.force(Some("a\"b")).unwrap(), "<tool_call>\n{\"name\": \"a\\\"b\", \"arguments\": ");
    }

    /// MiniCPM 5's calls as the model writes them: after prose, several in a row, single
    /// quotes and extra attributes, a CDATA value holding markup and line breaks, values
    /// typed by the schema; a `<param>` without a name, or prose mentioning `<function`,
    /// stays content.
    #[test]
    fn minicpm5_calls_between_content() {
        let tools = [json!({"type": "function", "function": {"name": "write", "parameters": {"type": "object",
            "properties": {"path": {"type": "string"}, "n": {"type": "integer"}, "text": {"type": "string"}}}}})];
        let text =
            "Writing it.\n<function name=\"write\"><param name=\"path\">a.txt</param><param name=\"n\">3</param>\
                    <param name=\"text\"><![CDATA[<b>x</b>\n  & </param> y]]></param></function>\
                    <function name='write' id=\"2\">\n<param name='n'> 7 </param>\n</function>";
        let (content, calls) = check::<MiniCpm5>(text, &tools);
        assert_eq!(content, "Writing it.\n");
        assert_eq!(
            calls,
            vec![
                call("write", json!({"path": "a.txt", "n": 3, "text": "<b>x</b>\n  & </param> y"})),
                call("write", json!({"n": 7})),
            ]
        );
        let spoiled = "<function name=\"write\"><param>3</param></function>";
        assert_eq!(check::<MiniCpm5>(spoiled, &tools), (spoiled.to_string(), vec![]));
        let prose = "The <functional> view.";
        assert_eq!(check::<MiniCpm5>(prose, &tools), (prose.to_string(), vec![]));
    }

    /// Gemma 4's calls as its template writes them: after prose, strings between quote
    /// tokens (holding quotes, commas and braces), nested objects and arrays with bare keys,
    /// two calls in a row; a broken call stays content.
    #[test]
    fn gemma4_calls_between_content() {
        let text = "Checking.<|tool_call>call:edit{path:<|\"|>a \"b\", {c}.rs<|\"|>,n:3,ok:true,opts:{deep:[1,<|\"|>x<|\"|>,null]}}<tool_call|>\
                    <|tool_call>call:time{}<tool_call|>";
        let (content, calls) = check::<Gemma4>(text, &[]);
        assert_eq!(content, "Checking.");
        assert_eq!(
            calls,
            vec![
                call("edit", json!({"path": "a \"b\", {c}.rs", "n": 3, "ok": true, "opts": {"deep": [1, "x", null]}})),
                call("time", json!({})),
            ]
        );
        let broken = "<|tool_call>call:f{a:<|\"|>x}<tool_call|>";
        assert_eq!(check::<Gemma4>(broken, &[]), (broken.to_string(), vec![]));
    }

    #[test]
    fn hermes_calls_between_content() {
        let text = "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"time\", \"arguments\": {}}</tool_call>";
        let (content, calls) = check::<Hermes>(text, &[]);
        assert_eq!(content, "Let me check.\n");
        assert_eq!(calls, vec![call("get_weather", json!({"city": "Paris"})), call("time", json!({}))]);
        // Broken JSON is given back as written; a lone "<" is content.
        let (content, calls) = check::<Hermes>("a < b <tool_call>{oops}</tool_call>", &[]);
        assert_eq!((content.as_str(), calls.len()), ("a < b <tool_call>{oops}</tool_call>", 0));
        // An unclosed call at the end of the output still parses.
        let (_, calls) = check::<Hermes>("<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}", &[]);
        assert_eq!(calls, vec![call("f", json!({"x": 1}))]);
    }

    #[test]
    fn json_calls_stream_their_arguments_while_they_are_written() {
        use plugin_sdk::ToolAdapter;
        let text = "<tool_call>\n{\"name\": \"write_file\", \"arguments\": {\"path\": \"a.txt\", \"text\": \"line one\\nline two\"}}\n</tool_call>";
        let mut adapter = crate::Adapter::<Hermes>::default();
        adapter.begin(r#"{"tools": []}"#, 3).unwrap();
        let mut per_piece = Vec::new();
        for piece in chunks(text, 4) {
            let mut events = Vec::new();
            adapter.feed(&piece, &mut events);
            per_piece.push(events);
        }
        let mut tail = Vec::new();
        adapter.finish(&mut tail);
        let args: Vec<(usize, String)> = per_piece
            .iter()
            .enumerate()
            .flat_map(|(i, e)| {
                e.iter().filter_map(move |e| match e {
                    plugin_sdk::ToolEvent::Args { delta, .. } => Some((i, delta.clone())),
                    _ => None,
                })
            })
            .collect();
        // The arguments arrive in many deltas, before the call is closed, and concatenate
        // to the arguments as written.
        assert!(args.len() > 5, "{args:?}");
        assert!(args.last().unwrap().0 < per_piece.len() - 2);
        let joined: String = args.iter().map(|(_, d)| d.as_str()).collect();
        assert_eq!(
            serde_json::from_str::<Value>(&joined).unwrap(),
            json!({"path": "a.txt", "text": "line one\nline two"})
        );
        let (_, calls) = check::<Hermes>(text, &[]);
        assert_eq!(calls.len(), 1);
        // Without arguments, an empty object.
        let (_, calls) = check::<Hermes>("<tool_call>{\"name\": \"now\"}</tool_call>", &[]);
        assert_eq!(calls, vec![call("now", json!({}))]);
    }

    #[test]
    fn qwen3_coder_xml_with_schema_types() {
        let tools = [
            json!({"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "nights": {"type": "integer"}, "zip": {"type": "string"}, "opts": {"type": "object"}}}}}),
        ];
        let text = "Booking.\n<tool_call>\n<function=book>\n<parameter=city>\nNew York\n</parameter>\n<parameter=nights>\n3\n</parameter>\n<parameter=zip>\n10001\n</parameter>\n<parameter=opts>\n{\"view\": true}\n</parameter>\n</function>\n</tool_call>";
        let (content, calls) = check::<Qwen3Coder>(text, &tools);
        assert_eq!(content, "Booking.\n");
        assert_eq!(
            calls,
            vec![call("book", json!({"city": "New York", "nights": 3, "zip": "10001", "opts": {"view": true}}))]
        );
        // Without a schema, values that look like numbers become numbers.
        let (_, calls) = check::<Qwen3Coder>(
            "<tool_call><function=f><parameter=n>7</parameter><parameter=s>hi</parameter></function></tool_call>",
            &[],
        );
        assert_eq!(calls, vec![call("f", json!({"n": 7, "s": "hi"}))]);
    }

    #[test]
    fn llama3_json_only_at_the_start() {
        let (content, calls) =
            check::<Llama3Json>("  {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", &[]);
        assert_eq!((content.as_str(), calls), ("", vec![call("get_weather", json!({"city": "Paris"}))]));
        let (_, calls) =
            check::<Llama3Json>("<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": [1]}}<|eom_id|>", &[]);
        assert_eq!(calls, vec![call("a", json!({})), call("b", json!({"x": [1]}))]);
        let (content, calls) = check::<Llama3Json>("Use {\"name\": \"x\"} like this.", &[]);
        assert_eq!((content.as_str(), calls.len()), ("Use {\"name\": \"x\"} like this.", 0));
        let (content, calls) = check::<Llama3Json>("{not json at all", &[]);
        assert_eq!((content.as_str(), calls.len()), ("{not json at all", 0));
    }

    #[test]
    fn mistral_both_generations() {
        let (content, calls) = check::<Mistral>(
            "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", \"arguments\": {}}]</s>",
            &[],
        );
        assert_eq!((content.as_str(), calls), ("", vec![call("f", json!({"a": 1})), call("g", json!({}))]));
        let (content, calls) =
            check::<Mistral>("Sure.[TOOL_CALLS]f[ARGS]{\"a\": 1}[TOOL_CALLS]g[CALL_ID]abc123456[ARGS]{}", &[]);
        assert_eq!((content.as_str(), calls), ("Sure.", vec![call("f", json!({"a": 1})), call("g", json!({}))]));
    }

    #[test]
    fn gemma_python_calls() {
        let text = "Checking.\n```tool_code\nget_weather(city=\"Paris\", days=3, units='metric', alerts=True, tags=[\"a\", 2], extra={\"k\": None})\n```\nDone.";
        let (content, calls) = check::<Gemma>(text, &[]);
        assert_eq!(content, "Checking.\n\nDone.");
        assert_eq!(
            calls,
            vec![call(
                "get_weather",
                json!({"city": "Paris", "days": 3, "units": "metric", "alerts": true, "tags": ["a", 2], "extra": {"k": null}})
            )]
        );
        let (content, calls) = check::<Gemma>("```python\nprint(1)\n```", &[]);
        assert_eq!((content.as_str(), calls.len()), ("```python\nprint(1)\n```", 0));
        let (content, calls) = check::<Gemma>("```tool_code\nf(x=)\n```", &[]);
        assert_eq!((content.as_str(), calls.len()), ("```tool_code\nf(x=)\n```", 0));
    }

    #[test]
    fn harmony_calls_in_both_header_orders_and_other_recipients_as_written() {
        let want = vec![call("get_weather", json!({"city": "Paris", "days": 3}))];
        let model = "Checking. <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\",\"days\":3}";
        assert_eq!(check::<Harmony>(model, &[]), ("Checking. ".into(), want.clone()));
        let closed = format!("{model}<|call|>");
        assert_eq!(check::<Harmony>(&closed, &[]), ("Checking. ".into(), want.clone()));
        let template = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\", \"days\": 3}<|call|>";
        assert_eq!(check::<Harmony>(template, &[]), (String::new(), want.clone()));
        // The recipient right after the prompt's `<|start|>assistant`.
        let first = " to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\", \"days\": 3}";
        assert_eq!(check::<Harmony>(first, &[]), (String::new(), want));
        // A built-in tool's recipient, broken arguments, and a message to no one stay text.
        for text in [
            "<|channel|>commentary to=browser.search <|constrain|>json<|message|>{\"q\": \"x\"}",
            "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"q\": ",
            "<|channel|>final<|message|>Hello",
            "a to b, <|chan",
        ] {
            assert_eq!(check::<Harmony>(text, &[]), (text.to_string(), vec![]), "{text}");
        }
    }

    #[test]
    fn harmony_describes_tools_as_a_typescript_namespace() {
        let tools = [
            json!({"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                "parameters": {"type": "object", "required": ["city"], "properties": {
                    // In name order: the host's own build of serde_json keeps declaration order
                    // (llguidance asks for it), the plugins' wasm build sorts.
                    "city": {"type": "string", "description": "The city"}, "days": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "string"}}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}),
            json!({"type": "function", "function": {"name": "now"}}),
        ];
        assert_eq!(
            Harmony.render(&tools).unwrap(),
            "# Tools\n\n## functions\n\nnamespace functions {\n\n// Weather for a city\ntype get_weather = (_: {\n\
             // The city\ncity: string,\ndays?: number,\ntags?: string[],\nunit?: \"c\" | \"f\",\n}) => any;\n\n\
             type now = () => any;\n\n} // namespace functions"
        );
    }

    #[test]
    fn renders_for_templates_without_tools() {
        let tools = [json!({"type": "function", "function": {"name": "f", "parameters": {}}})];
        assert!(Hermes.render(&tools).unwrap().contains("<tools>\n{\"name\":\"f\",\"parameters\":{}}\n</tools>"));
        assert!(Gemma.render(&tools).unwrap().contains("```tool_code"));
        assert!(Mistral.render(&tools).is_none());
    }

    /// llguidance over a byte-level vocabulary (token `b` is byte `b`, 256 is the end).
    fn byte_matcher(grammar: &str) -> llguidance::Matcher {
        use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
        struct Bytes(TokTrie);
        impl TokenizerEnv for Bytes {
            fn tok_trie(&self) -> &TokTrie {
                &self.0
            }
            fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
                s.iter().map(|&b| b as u32).collect()
            }
        }
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        words.push(b"\xff<end>".to_vec());
        // Gemma 4's special tokens (257...).
        words.extend(GEMMA4_SPECIAL.iter().map(|t| [b"\xff".as_slice(), t.as_bytes()].concat()));
        let n = words.len() as u32;
        let env: TokEnv = std::sync::Arc::new(Bytes(TokTrie::from(&TokRxInfo::new(n, 256), &words)));
        let mut factory = llguidance::ParserFactory::new_simple(&env).unwrap();
        factory.quiet();
        let g = llguidance::api::TopLevelGrammar::from_lark(grammar.to_string());
        llguidance::Matcher::new(factory.create_parser(g))
    }

    const GEMMA4_SPECIAL: [&str; 3] = ["<|\"|>", "<|tool_call>", "<tool_call|>"];

    /// `text` as the byte vocabulary's tokens, Gemma 4's special tokens as their own ids.
    fn byte_tokens(text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = text;
        'outer: while !rest.is_empty() {
            for (i, t) in GEMMA4_SPECIAL.iter().enumerate() {
                if let Some(after) = rest.strip_prefix(t) {
                    out.push(257 + i as u32);
                    rest = after;
                    continue 'outer;
                }
            }
            let c = rest.chars().next().unwrap();
            out.extend(rest[..c.len_utf8()].bytes().map(u32::from));
            rest = &rest[c.len_utf8()..];
        }
        out
    }

    /// Whether the grammar takes `text` whole and then allows the end.
    fn takes(grammar: &str, text: &str) -> bool {
        let mut m = byte_matcher(grammar);
        for (i, t) in byte_tokens(text).into_iter().enumerate() {
            let allowed = m.compute_mask().map(|mask| mask.is_allowed(t));
            if !matches!(allowed, Ok(true)) || m.consume_token(t).is_err() {
                eprintln!("refused at token {i} of {text:?}: {allowed:?}");
                return false;
            }
        }
        m.is_stopped() || m.compute_mask().is_ok_and(|mask| mask.is_allowed(256))
    }

    /// Gemma 4's forced calls: arguments in the schema's order as its template writes them,
    /// strings only between quote *tokens* (the quote's text spelled out is refused), the
    /// closing marker a token too; a call to any tool starts at its name.
    #[test]
    fn gemma4_calls_hold_to_the_tools_schema_with_its_special_tokens() {
        let tools = [
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]},
                           "tags": {"type": "array", "items": {"type": "string"}}, "extra": {"type": "object"}},
            "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}),
        ];
        let named = Gemma4.grammar(Some("get_weather"), &tools).unwrap();
        let q = GEMMA4_QUOTE;
        let call = format!("city:{q}Paris, {{France}}{q},days:3,unit:{q}c{q},tags:[{q}a{q},{q}b{q}],extra:{{k:[1,{q}x{q}]}}}}<tool_call|>");
        assert!(takes(&named, &call), "{named}");
        assert!(takes(&named, &format!("city:{q}Oslo{q}}}<tool_call|>")));
        assert!(!takes(&named, "days:3}<tool_call|>"), "the required city is missing");
        assert!(!takes(&named, &format!("city:{q}Oslo{q},days:3.5}}<tool_call|>")), "days is an integer");
        assert!(!takes(&named, &format!("city:{q}Oslo{q},unit:{q}k{q}}}<tool_call|>")), "unit is c or f");
        // The quote's text spelled out in bytes is not the quote token.
        let mut m = byte_matcher(&named);
        for t in byte_tokens("city:") {
            m.consume_token(t).unwrap();
        }
        assert!(!m.compute_mask().unwrap().is_allowed(u32::from(b'<')), "a quote as text");
        assert!(!takes(&named, &format!("city:{q}Oslo{q}}}")), "the call must close");
        let any = Gemma4.grammar(None, &tools).unwrap();
        assert!(takes(&any, "now{}<tool_call|>"), "{any}");
        assert!(takes(&any, &format!("get_weather{{city:{q}Rome{q}}}<tool_call|>")));
        assert!(!takes(&any, "later{}<tool_call|>"));
        assert_eq!(Gemma4.grammar(Some("nope"), &tools), None);
        // The lazy grammar (a call the model starts itself) begins after the opening token.
        let lazy = crate::Adapter::<Gemma4>::default().lazy_grammar(&tools).unwrap();
        assert!(takes(&lazy, "call:now{}<tool_call|>"), "{lazy}");
    }

    #[test]
    fn qwen3_coder_calls_hold_to_the_tools_schema_in_raw_text_and_json() {
        let tools = [
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
                           "zone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14}, "note": {"type": "string"}},
            "required": ["city", "unit"]}}}),
            json!({"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}),
        ];
        let f = Qwen3Coder;
        let named = f.grammar(Some("get_weather"), &tools).unwrap();
        let p = |k: &str, v: &str| format!("<parameter={k}>\n{v}\n</parameter>\n");
        let end = "</function>\n</tool_call>";
        let call = format!(
            "{}{}{}{}{end}",
            p("city", "New York"),
            p("unit", "celsius"),
            p("days", "3"),
            p("note", "a < b\n</param")
        );
        assert!(takes(&named, &call), "{named}\n{call}");
        // Parsed back, the arguments are what the schema asked for.
        let text = format!("{}{call}", f.force(Some("get_weather")).unwrap());
        let (_, calls) = check::<Qwen3Coder>(&text, &tools);
        assert_eq!(
            calls,
            vec![(
                "get_weather".into(),
                json!({"city": "New York", "unit": "celsius", "days": 3, "note": "a < b\n</param"})
            )]
        );
        for bad in [
            format!("{}{end}", p("unit", "celsius")), // a required argument missing
            format!("{}{}{end}", p("city", "Paris"), p("unit", "kelvin")), // not in the enum
            format!("{}{}{end}", p("city", "A very long city"), p("unit", "celsius")), // past maxLength
            format!("{}{}{}{end}", p("city", "Paris"), p("unit", "celsius"), p("days", "15")), // past maximum
            format!("{}{}{}{end}", p("city", "Paris"), p("unit", "celsius"), p("zone", "europe/paris")), // pattern
            format!("{}{}{}{end}", p("unit", "celsius"), p("city", "Paris"), p("days", "2")), // out of order
            format!("{}{}{}{end}", p("city", "Lima"), p("unit", "celsius"), p("note", "x\n<parameter=days>\n3")), // a tag in a value
            format!("{}{}{end}", p("city", "<parameter=unit>"), p("unit", "celsius")), // a tag as a value
        ] {
            assert!(!takes(&named, &bad), "{bad}");
        }
        assert!(takes(
            &named,
            &format!("{}{}{}{end}", p("city", "Paris"), p("unit", "celsius"), p("zone", "Europe/Paris"))
        ));
        // Any function: the name is chosen among the tools; the lazy grammar starts after `<tool_call>`.
        let any = f.grammar(None, &tools).unwrap();
        assert!(takes(&any, &format!("ping>\n{end}")));
        assert!(!takes(&any, &format!("pong>\n{end}")));
        let lazy = crate::Adapter::<Qwen3Coder>::default().lazy_grammar(&tools).unwrap();
        assert!(takes(&lazy, &format!("\n<function=get_weather>\n{}{}{end}", p("city", "Oslo"), p("unit", "celsius"))));
        assert_eq!(f.trigger(), Some("<tool_call>"));
    }
}
