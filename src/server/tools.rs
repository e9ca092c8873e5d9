//! Tool calling on `/v1/chat/completions`: the request's `tools` and `tool_choice`, the
//! constraint that enforces a `required` or named choice (a JSON schema of the call, through
//! structured output, so the output always parses), and the parsers that find the calls in
//! what a model writes on its own (`auto`), chosen by `--tool-call-parser` as in vLLM.

use super::error::ApiError;
use crate::sampling::StructuredOutput;
use serde_json::{Value, json};

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    /// The JSON schema of its arguments (`{"type": "object"}` when the tool gives none).
    pub parameters: Value,
}

/// The formats a model writes its tool calls in (`--tool-call-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallParser {
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Hermes, Qwen 2.5 and 3).
    Hermes,
    /// `{"name": …, "parameters": {…}}`, several separated by `;` (Llama 3.1+).
    Llama3Json,
    /// `[TOOL_CALLS] [{"name": …, "arguments": {…}}, …]` (Mistral).
    Mistral,
}

impl ToolCallParser {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "hermes" => Ok(ToolCallParser::Hermes),
            "llama3_json" => Ok(ToolCallParser::Llama3Json),
            "mistral" => Ok(ToolCallParser::Mistral),
            other => Err(format!(
                "unknown tool call parser '{other}' (hermes, llama3_json, mistral)"
            )),
        }
    }
}

/// How a request's output is read for tool calls.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolMode {
    /// The model may call tools or answer: its output is parsed.
    Auto(ToolCallParser),
    /// The output is a JSON list of one or more calls (at most one without
    /// `parallel_tool_calls`).
    Required,
    /// The output is the arguments of this function.
    Named(String),
}

/// A call found in the output.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as a JSON text (OpenAI sends them as a string).
    pub arguments: String,
}

/// The tools of a request, checked: each `{"type": "function", "function": {"name", …}}`
/// with a unique name and, if given, an object schema of its parameters.
pub fn parse_tools(tools: &[Value]) -> Result<Vec<Tool>, ApiError> {
    let bad =
        |i: usize, what: &str| ApiError::invalid(format!("tools[{i}]: {what}"), Some("tools"));
    let mut out: Vec<Tool> = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(i, "type must be \"function\""));
        }
        let f = t
            .get("function")
            .filter(|f| f.is_object())
            .ok_or_else(|| bad(i, "function is missing"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| bad(i, "function.name must be a non-empty string"))?;
        if out.iter().any(|o| o.name == name) {
            return Err(bad(
                i,
                &format!("the name '{}' is given twice", crate::untrusted::text(name)),
            ));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p) if p.is_object() => p.clone(),
            Some(_) => return Err(bad(i, "function.parameters must be a JSON schema object")),
        };
        out.push(Tool {
            name: name.to_string(),
            parameters,
        });
    }
    Ok(out)
}

/// The tool mode of a request from its `tool_choice` (default `auto` when tools are given,
/// as OpenAI does); `None`: no tool calls are looked for.
pub fn tool_mode(
    tools: &[Tool],
    tool_choice: Option<&Value>,
    auto_parser: Option<ToolCallParser>,
) -> Result<Option<ToolMode>, ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some("tool_choice"));
    let choice =
        match tool_choice {
            None | Some(Value::Null) if tools.is_empty() => return Ok(None),
            None | Some(Value::Null) => "auto",
            Some(Value::String(s)) => s.as_str(),
            Some(Value::Object(o)) => {
                let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    bad(r#"a named tool_choice is {"type": "function", "function": {"name": …}}"#
                        .into())
                })?;
                if !tools.iter().any(|t| t.name == name) {
                    return Err(bad(format!(
                        "tool_choice names '{}', which is not among the tools",
                        crate::untrusted::text(name)
                    )));
                }
                return Ok(Some(ToolMode::Named(name.to_string())));
            }
            Some(_) => return Err(bad("tool_choice must be a string or an object".into())),
        };
    match choice {
        "none" => Ok(None),
        _ if tools.is_empty() => Err(bad(format!("tool_choice \"{choice}\" needs tools"))),
        "required" => Ok(Some(ToolMode::Required)),
        "auto" => match auto_parser {
            Some(p) => Ok(Some(ToolMode::Auto(p))),
            None => Err(bad(
                "tool_choice \"auto\" needs the server started with --enable-auto-tool-choice and --tool-call-parser (or send tool_choice \"required\", a named function, or \"none\")"
                    .into(),
            )),
        },
        other => Err(bad(format!(
            "tool_choice must be \"none\", \"auto\", \"required\" or a named function, got \"{}\"",
            crate::untrusted::text(other)
        ))),
    }
}

/// The constraint that makes the output a valid call (`required`, named); `auto` has none.
pub fn constraint(mode: &ToolMode, tools: &[Tool], parallel: bool) -> Option<StructuredOutput> {
    match mode {
        ToolMode::Auto(_) => None,
        ToolMode::Named(name) => tools
            .iter()
            .find(|t| &t.name == name)
            .map(|t| StructuredOutput::Json(t.parameters.clone())),
        ToolMode::Required => {
            let calls: Vec<Value> = tools
                .iter()
                .map(|t| {
                    json!({
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "enum": [t.name]},
                            "parameters": t.parameters,
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": false,
                    })
                })
                .collect();
            let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
            if !parallel {
                schema["maxItems"] = json!(1);
            }
            Some(StructuredOutput::Json(schema))
        }
    }
}

/// The content and calls of a finished output.
pub fn extract(mode: &ToolMode, text: &str) -> (Option<String>, Vec<ParsedCall>) {
    let calls = match mode {
        ToolMode::Named(name) => vec![ParsedCall {
            name: name.clone(),
            arguments: text.trim().to_string(),
        }],
        ToolMode::Required => serde_json::from_str::<Vec<Value>>(text.trim())
            .map(|list| list.iter().filter_map(|c| call(c, "parameters")).collect())
            .unwrap_or_default(),
        ToolMode::Auto(p) => return parse_auto(*p, text),
    };
    if calls.is_empty() {
        (Some(text.to_string()), calls)
    } else {
        (None, calls)
    }
}

/// A call from `{"name": …, args_key: {…}}`.
fn call(v: &Value, args_key: &str) -> Option<ParsedCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get(args_key).or_else(|| v.get("arguments")) {
        None | Some(Value::Null) => "{}".to_string(),
        // NOTE: some models write the arguments as a JSON string already.
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some(ParsedCall { name, arguments })
}

/// What the model wrote, read with `parser`: the text around the calls is the content; output
/// whose calls do not parse is all content (as vLLM's parsers do).
fn parse_auto(parser: ToolCallParser, text: &str) -> (Option<String>, Vec<ParsedCall>) {
    let content = |s: &str| {
        let s = s.trim();
        (!s.is_empty()).then(|| s.to_string())
    };
    let whole = || (Some(text.to_string()), Vec::new());
    match parser {
        ToolCallParser::Hermes => {
            const OPEN: &str = "<tool_call>";
            const CLOSE: &str = "</tool_call>";
            let Some(first) = text.find(OPEN) else {
                // NOTE: small models often write the call's JSON without the tags; a whole
                // output that is exactly one {"name", "arguments"} object is taken as a call.
                return match serde_json::from_str::<Value>(text.trim()) {
                    Ok(v) if v.get("name").is_some() && v.get("arguments").is_some() => {
                        match call(&v, "arguments") {
                            Some(c) => (None, vec![c]),
                            None => whole(),
                        }
                    }
                    _ => whole(),
                };
            };
            let mut calls = Vec::new();
            let mut rest = &text[first..];
            while let Some(start) = rest.find(OPEN) {
                let body = &rest[start + OPEN.len()..];
                // NOTE: a call cut off by max_tokens has no closing tag: parsed if complete.
                let (inner, after) = match body.find(CLOSE) {
                    Some(end) => (&body[..end], &body[end + CLOSE.len()..]),
                    None => (body, ""),
                };
                match serde_json::from_str::<Value>(inner.trim())
                    .ok()
                    .and_then(|v| call(&v, "arguments"))
                {
                    Some(c) => calls.push(c),
                    None => return whole(),
                }
                rest = after;
            }
            (content(&text[..first]), calls)
        }
        ToolCallParser::Llama3Json => {
            let t = text.trim().trim_start_matches("<|python_tag|>").trim();
            if !t.starts_with('{') {
                return whole();
            }
            // NOTE: calls are separated by `;`: read one JSON value at a time.
            let mut calls = Vec::new();
            let mut rest = t;
            while !rest.is_empty() {
                let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
                match values.next() {
                    Some(Ok(v)) => match call(&v, "parameters") {
                        Some(c) => calls.push(c),
                        None => return whole(),
                    },
                    _ => return whole(),
                }
                rest = rest[values.byte_offset()..].trim_start();
                rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
            }
            (None, calls)
        }
        ToolCallParser::Mistral => {
            const MARK: &str = "[TOOL_CALLS]";
            let Some(at) = text.find(MARK) else {
                return whole();
            };
            let list = text[at + MARK.len()..].trim();
            match serde_json::from_str::<Vec<Value>>(list) {
                Ok(items) => {
                    let calls: Vec<ParsedCall> =
                        items.iter().filter_map(|c| call(c, "arguments")).collect();
                    if calls.len() != items.len() {
                        return whole();
                    }
                    (content(&text[..at]), calls)
                }
                Err(_) => whole(),
            }
        }
    }
}

/// The assistant's `tool_calls` of a request's history, as chat templates read them: the
/// arguments as a JSON object (transformers' convention), not the string OpenAI sends.
pub fn history_calls(calls: &[Value]) -> Result<Vec<Value>, String> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let f = c
                .get("function")
                .ok_or_else(|| format!("tool_calls[{i}].function is missing"))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("tool_calls[{i}].function.name is missing"))?;
            let arguments = match f.get("arguments") {
                Some(Value::String(s)) => {
                    serde_json::from_str(s).unwrap_or(Value::from(s.as_str()))
                }
                Some(v) => v.clone(),
                None => json!({}),
            };
            Ok(json!({
                "id": c.get("id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Tool> {
        parse_tools(&[
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "now"}}),
        ])
        .unwrap()
    }

    #[test]
    fn tools_and_choices_are_checked() {
        let t = tools();
        assert_eq!(t[1].parameters, json!({"type": "object"}));
        for bad in [
            json!([{"type": "retrieval"}]),
            json!([{"type": "function", "function": {"name": ""}}]),
            json!([{"type": "function", "function": {"name": "a", "parameters": 5}}]),
            json!([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]),
        ] {
            assert!(parse_tools(bad.as_array().unwrap()).is_err(), "{bad}");
        }
        let h = Some(ToolCallParser::Hermes);
        assert_eq!(
            tool_mode(&t, None, h).unwrap(),
            Some(ToolMode::Auto(ToolCallParser::Hermes))
        );
        assert!(tool_mode(&t, None, None).is_err());
        assert_eq!(tool_mode(&t, Some(&json!("none")), None).unwrap(), None);
        assert_eq!(
            tool_mode(&t, Some(&json!("required")), None).unwrap(),
            Some(ToolMode::Required)
        );
        let named = json!({"type": "function", "function": {"name": "now"}});
        assert_eq!(
            tool_mode(&t, Some(&named), None).unwrap(),
            Some(ToolMode::Named("now".into()))
        );
        let unknown = json!({"type": "function", "function": {"name": "nope"}});
        assert!(tool_mode(&t, Some(&unknown), None).is_err());
        assert!(tool_mode(&[], Some(&json!("required")), None).is_err());
        assert_eq!(tool_mode(&[], None, None).unwrap(), None);
    }

    #[test]
    fn each_parser_finds_the_calls() {
        let hermes = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = extract(&ToolMode::Auto(ToolCallParser::Hermes), hermes);
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(
            serde_json::from_str::<Value>(&calls[0].arguments).unwrap(),
            json!({"city": "Paris"})
        );
        let bare = "{\"name\": \"now\", \"arguments\": {}}";
        let (content, calls) = extract(&ToolMode::Auto(ToolCallParser::Hermes), bare);
        assert_eq!((content, calls.len()), (None, 1));
        let (content, calls) = extract(&ToolMode::Auto(ToolCallParser::Hermes), "Just text.");
        assert_eq!((content.as_deref(), calls.len()), (Some("Just text."), 0));
        let broken = "<tool_call>{\"name\": \"x\", \"arguments\": {</tool_call>";
        assert_eq!(
            extract(&ToolMode::Auto(ToolCallParser::Hermes), broken)
                .1
                .len(),
            0
        );

        let llama = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}; {\"name\": \"now\", \"parameters\": {}}";
        let (content, calls) = extract(&ToolMode::Auto(ToolCallParser::Llama3Json), llama);
        assert_eq!(content, None);
        assert_eq!(
            calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
            ["get_weather", "now"]
        );
        let mistral = "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}]";
        let (_, calls) = extract(&ToolMode::Auto(ToolCallParser::Mistral), mistral);
        assert_eq!(
            calls,
            vec![ParsedCall {
                name: "now".into(),
                arguments: "{}".into()
            }]
        );

        let required = "[{\"name\": \"now\", \"parameters\": {}}]";
        let (content, calls) = extract(&ToolMode::Required, required);
        assert_eq!((content, calls.len()), (None, 1));
        let (_, calls) = extract(
            &ToolMode::Named("get_weather".into()),
            " {\"city\": \"Rome\"} ",
        );
        assert_eq!(calls[0].arguments, "{\"city\": \"Rome\"}");
    }

    #[test]
    fn the_required_schema_lists_every_tool() {
        let Some(StructuredOutput::Json(s)) = constraint(&ToolMode::Required, &tools(), false)
        else {
            panic!()
        };
        assert_eq!(s["items"]["anyOf"].as_array().unwrap().len(), 2);
        assert_eq!(s["maxItems"], 1);
        assert_eq!(
            s["items"]["anyOf"][0]["properties"]["name"]["enum"][0],
            "get_weather"
        );
    }

    #[test]
    fn history_arguments_become_objects() {
        let h = history_calls(&[json!({"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{\"tz\": \"UTC\"}"}})]).unwrap();
        assert_eq!(h[0]["function"]["arguments"], json!({"tz": "UTC"}));
        assert!(history_calls(&[json!({"id": "x"})]).is_err());
    }
}
