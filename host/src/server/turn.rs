//! One request whatever API it came through. Each API's handler translates its wire
//! request into a [`Turn`] (messages in the chat template's shape, or a completion's raw
//! prompt; tools in OpenAI's function shape, sampling, stops, plugins, speculation,
//! template switches such as thinking) and renders the engine's one [`Event`] stream back
//! into its own shapes; the prompt, the tool adapter, admission, constraints and submission
//! live here, so a feature lands once and chat completions, completions, Anthropic messages
//! and Responses all get it.

use super::error::ApiError;
use super::openai::{self, ToolChoice};
use super::state::AppState;
use crate::engine::handle::Engine;
use crate::engine::hooks::RequestHooks;
use crate::engine::job::{Event, JobRequest, SubmitError};
use crate::engine::{SamplingParams, SpecConfig};
use crate::plugins::abi_v1::Kind;
use crate::plugins::adapters::PluginHooks;
use crate::plugins::request::PluginsField;
use crate::plugins::runtime::{Instance, PluginRefused, Quarantined};
use crate::plugins::{Selected, Selection};
use crate::structured::{CompileError, Structure};
use axum::http::StatusCode;
use serde_json::{json, Value};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;

/// What the model continues.
#[derive(Debug, Clone)]
pub enum Input {
    /// A conversation, written out by the chat template: `{"role", "content"}` messages,
    /// assistant `tool_calls` with object arguments, tool results as `{"role": "tool",
    /// "tool_call_id", "content"}`. Its reply goes through the tool adapter and the
    /// reasoning parser.
    Messages(Vec<Value>),
    /// A raw prompt as tokens (`/v1/completions`): no template, tools or reasoning parser;
    /// the reply is the model's text as written.
    Tokens(Vec<u32>),
}

impl Default for Input {
    fn default() -> Self {
        Input::Messages(Vec::new())
    }
}

/// A protocol-neutral request.
#[derive(Debug, Clone, Default)]
pub struct Turn {
    pub input: Input,
    /// Function tools in OpenAI's chat shape, checked (`openai::check_tools`) by the API that
    /// made the turn, before any plugin is chosen for them: an error names the field as that
    /// API spells it.
    pub tools: Option<Vec<Value>>,
    pub tool_choice: ToolChoice,
    /// At most one tool call in the reply.
    pub one_tool_call: bool,
    pub sampling: SamplingParams,
    /// `None`: the server's default, within the memory budget.
    pub max_tokens: Option<usize>,
    /// `max_tokens` is an upper bound the client sends whatever the model (Anthropic's
    /// required field): past what fits in the memory budget it is lowered, not refused.
    pub max_tokens_is_ceiling: bool,
    /// The request's own name for `max_tokens` (`max_completion_tokens`,
    /// `max_output_tokens`), which errors name; empty: `max_tokens`.
    pub max_tokens_param: &'static str,
    /// The request's field the prompt comes from (`input`, `prompt`), which a prompt too
    /// long by itself is named by; empty: `messages`.
    pub prompt_param: &'static str,
    pub stop: Vec<String>,
    pub top_logprobs: Option<usize>,
    /// The `plugins` extension field (`None`: the server's defaults).
    pub plugins: Option<PluginsField>,
    pub speculative: Option<Value>,
    /// What the output is held to (`response_format`, `grammar`, `regex`, `text.format`).
    pub structure: Option<Structure>,
    pub priority: i64,
    pub client: Option<String>,
    /// Extra chat-template variables (`chat_template_kwargs`, `enable_thinking`).
    pub template_kwargs: Option<serde_json::Map<String, Value>>,
    /// The API the request came through: its name in the log, its service's wording of a
    /// context overflow. (The error's shape is the path's, chosen at the edge.)
    pub api: Api,
    /// The model the client asked for (any name is served by the loaded model; logged).
    pub model: Option<String>,
}

impl Turn {
    /// The tools the model sees and the adapter parses (none under `tool_choice: none`).
    pub fn shown_tools(&self) -> Option<&Vec<Value>> {
        self.tools.as_ref().filter(|_| self.tool_choice != ToolChoice::None)
    }

    /// Sets a chat-template variable (a request's own `chat_template_kwargs` win).
    pub fn template_default(&mut self, key: &str, value: Value) {
        self.template_kwargs.get_or_insert_with(Default::default).entry(key).or_insert(value);
    }
}

/// A turn on its way: the engine's events and what the request log and usage report.
pub struct Begun {
    pub events: UnboundedReceiver<Event>,
    pub prompt_tokens: usize,
}

impl AppState {
    /// Builds the prompt, admits and submits a turn.
    pub async fn begin(&self, mut turn: Turn, stream: bool) -> Result<Begun, ApiError> {
        self.check_sampling(&turn.sampling)?;
        let chat = matches!(turn.input, Input::Messages(_));
        let mut plugins = self.plugins(turn.plugins.take(), turn.shown_tools(), chat)?;
        plugins.one_tool_call = turn.one_tool_call;
        let messages = match &turn.input {
            Input::Messages(m) => m.len(),
            Input::Tokens(_) => 0,
        };
        let tool_count = turn.shown_tools().map_or(0, Vec::len);
        let prompt = self.turn_prompt(&mut turn, &mut plugins).await?;
        let fit = self.max_sequence_tokens.saturating_sub(prompt.len());
        let requested = match turn.max_tokens {
            Some(n) if turn.max_tokens_is_ceiling && n > fit && fit > 0 => Some(fit),
            n => n,
        };
        let max_tokens = self.admit(prompt.len(), requested, turn.max_tokens_param, turn.prompt_param, turn.api)?;
        let speculative = self.speculative(turn.speculative)?;
        let constraint = match (plugins.reply_grammar.take(), plugins.call_grammar.take()) {
            // A forced call's arguments held to the tool's schema, unless the request brings a
            // constraint plugin of its own (`response_format` is for content, and a forced
            // call has none).
            (Some(grammar), _) if plugins.constraint.is_none() => self.call_constraint(None, grammar).await,
            // Calls the model starts, unless the request holds its output to something else.
            (None, Some((trigger, grammar))) if plugins.constraint.is_none() && turn.structure.is_none() => {
                self.call_constraint(Some(trigger), grammar).await
            }
            _ => self.constraint(turn.structure.take(), plugins.constraint.take()).await?,
        };
        let prompt_tokens = prompt.len();
        let model = turn.model.as_deref().unwrap_or("");
        let what = if chat { "chat turn" } else { "completion" };
        tracing::info!(
            api = turn.api.name(),
            model,
            stream,
            messages,
            tools = tool_count,
            prompt = prompt_tokens,
            max_tokens,
            "{what}"
        );
        let job = JobRequest {
            prompt,
            sampling: turn.sampling,
            max_tokens,
            stop: turn.stop,
            top_logprobs: turn.top_logprobs,
            reply_prefix: plugins.reply_prefix.take(),
            one_tool_call: plugins.one_tool_call,
            hooks: self.hooks(plugins),
            speculative,
            constraint,
            priority: turn.priority,
            client: turn.client,
        };
        let events = self.submit(job)?;
        Ok(Begun { events, prompt_tokens })
    }

    /// A tool adapter's grammar as the request's constraint: a forced call's (`trigger`
    /// `None`), or the lazy one that holds the calls the model starts after `trigger`. One
    /// that does not compile is the adapter's fault, not the client's: the calls go
    /// unconstrained (as before grammars), with a warning.
    async fn call_constraint(&self, trigger: Option<String>, grammar: String) -> Option<crate::engine::ConstraintSpec> {
        let grammars = self.grammars.clone();
        let lazy = trigger.is_some();
        let compiled = tokio::task::spawn_blocking(move || match trigger {
            None => grammars.compile(&Structure::ToolCall(grammar)),
            Some(trigger) => grammars.compile_lazy(&trigger, &grammar),
        });
        let why = match compiled.await {
            Ok(Ok(spec)) => return Some(spec),
            Ok(Err(CompileError::Invalid(why))) => why,
            Ok(Err(CompileError::Internal(e))) => format!("{e:#}"),
            Err(e) => e.to_string(),
        };
        let calls = if lazy { "the tool calls the model starts go" } else { "a forced tool call goes" };
        tracing::warn!("{calls} unconstrained: the tool adapter's grammar does not compile: {why}");
        None
    }

    /// Compiles a request's structure into the constraint the engine applies (off the async
    /// runtime: the first one builds the token trie, a large schema takes a while), or
    /// makes its constraint plugin's. A structure llguidance refuses is a 400 that says why.
    pub async fn constraint(
        &self,
        structure: Option<Structure>,
        plugin: Option<crate::plugins::Selected>,
    ) -> Result<Option<crate::engine::ConstraintSpec>, ApiError> {
        if let Some(selected) = plugin {
            if let Some(s) = &structure {
                let why = format!("a request takes one constraint: `plugins.constraint` or `{}`, not both", s.param());
                return Err(ApiError::invalid(s.param(), why));
            }
            let registry = self.plugins.clone().expect("a selected plugin comes from the registry");
            let grammars = self.grammars.clone();
            // The plugin's instance and its vocabulary tables are made here, not on the
            // engine thread every running request waits on.
            let spec = tokio::task::spawn_blocking(move || {
                let spec = crate::plugins::adapters::constraint_spec(registry, selected, grammars.plugin_vocab()?);
                spec.prepare();
                anyhow::Ok(spec)
            });
            let spec = spec.await.map_err(ApiError::internal)?.map_err(|e| ApiError::internal(format!("{e:#}")))?;
            return Ok(Some(spec));
        }
        let Some(structure) = structure else { return Ok(None) };
        let grammars = self.grammars.clone();
        let param = structure.param();
        let compiled =
            tokio::task::spawn_blocking(move || grammars.compile(&structure)).await.map_err(ApiError::internal)?;
        match compiled {
            Ok(spec) => Ok(Some(spec)),
            Err(CompileError::Invalid(why)) => Err(ApiError::invalid(param, why)),
            Err(CompileError::Internal(e)) => Err(ApiError::internal(format!("{e:#}"))),
        }
    }

    /// The prompt a turn would have, in tokens (Anthropic `count_tokens`; the server's tool
    /// adapter describes the tools, as for the request itself without a `plugins` field).
    pub async fn count(&self, turn: Turn) -> Result<usize, ApiError> {
        Ok(self.prompt(turn).await?.len())
    }

    /// The prompt a turn would have, as tokens (`/tokenize` with `messages`).
    pub async fn prompt(&self, mut turn: Turn) -> Result<Vec<u32>, ApiError> {
        let mut plugins = self.plugins(None, turn.shown_tools(), true)?;
        self.turn_prompt(&mut turn, &mut plugins).await
    }

    /// A turn's prompt tokens under `plugins` (whose `reply_prefix` it sets for a forced
    /// call); takes the turn's input and tools.
    async fn turn_prompt(&self, turn: &mut Turn, plugins: &mut Selection) -> Result<Vec<u32>, ApiError> {
        let messages = match std::mem::take(&mut turn.input) {
            Input::Tokens(tokens) => return Ok(tokens),
            Input::Messages(messages) => messages,
        };
        let kwargs = turn.template_kwargs.take().map(Value::Object);
        let tools = turn.tool_choice.tools(turn.tools.take());
        self.tool_chat_prompt(messages, tools, &turn.tool_choice, kwargs, plugins).await
    }

    /// Tokenizes `text` off the async runtime's threads (a prompt may be megabytes).
    pub async fn encode(&self, text: String, special: bool) -> Result<Vec<u32>, ApiError> {
        let engine = self.engine.clone();
        tokio::task::spawn_blocking(move || engine.tokenizer.encode(&text, special).map_err(ApiError::internal))
            .await
            .map_err(ApiError::internal)?
    }

    fn template_takes_tools(&self) -> bool {
        takes_tools(&self.engine)
    }

    /// Runs `call` on a short-lived instance of the tool adapter, off the async runtime. A
    /// fault is the adapter's (a 500 naming it; with `fallback`, the prompt is built without
    /// its part, as for an adapter without that export), but a built-in adapter failing on
    /// the request's own tools is the request's 400.
    async fn on_adapter<T: Send + 'static>(
        &self,
        adapter: &Selected,
        call: impl FnOnce(&mut Instance) -> anyhow::Result<Option<T>> + Send + 'static,
    ) -> Result<Option<T>, ApiError> {
        let Some(registry) = self.plugins.clone() else { return Ok(None) };
        let (selected, fallback) = (adapter.clone(), adapter.fallback);
        let result = tokio::task::spawn_blocking(move || {
            call(&mut crate::plugins::adapters::prompt_instance(&registry, &selected)?)
        })
        .await
        .map_err(ApiError::internal)?;
        match result {
            Ok(value) => Ok(value),
            Err(e) => match e.chain().find_map(|c| c.downcast_ref::<PluginRefused>()) {
                Some(refused) => Err(ApiError::invalid("tools", super::error::readable(&refused.0))),
                None if fallback => {
                    tracing::warn!("tool adapter {} left out of this prompt: {e:#}", adapter.plugin.name());
                    Ok(None)
                }
                None => Err(super::reply::plugin_fault(format!("{e:#}"))),
            },
        }
    }

    /// For templates that ignore tools: each assistant turn's earlier calls written into its
    /// text in the tool adapter's own format (`tool_render_calls`), where it has one.
    async fn write_calls(&self, adapter: Option<&Selected>, mut messages: Vec<Value>) -> Result<Vec<Value>, ApiError> {
        let Some(adapter) = adapter.filter(|_| !self.template_takes_tools()) else { return Ok(messages) };
        let turns: Vec<(usize, String)> = messages
            .iter()
            .enumerate()
            .filter(|(_, m)| m["role"] == "assistant")
            .filter_map(|(i, m)| Some((i, Value::Array(call_objects(m.get("tool_calls")?.as_array()?)).to_string())))
            .collect();
        if turns.is_empty() {
            return Ok(messages);
        }
        let written = self
            .on_adapter(adapter, move |instance| {
                let written: anyhow::Result<Vec<_>> =
                    turns.into_iter().map(|(i, calls)| Ok((i, instance.tool_render_calls(&calls)?))).collect();
                written.map(Some)
            })
            .await?
            .unwrap_or_default();
        for (i, text) in written {
            if let Some(text) = text {
                messages[i].as_object_mut().map(|m| m.remove("tool_calls"));
                append_calls(&mut messages[i], &text);
            }
        }
        Ok(messages)
    }

    /// For templates that ignore `tools`: the tool adapter's own description of them
    /// (`tool_render`), when it has one.
    async fn render_tools(
        &self,
        adapter: Option<&Selected>,
        tools: Option<&Vec<Value>>,
    ) -> Result<Option<String>, ApiError> {
        let (Some(adapter), Some(tools)) = (adapter, tools) else { return Ok(None) };
        if self.template_takes_tools() || tools.is_empty() {
            return Ok(None);
        }
        let tools = Value::Array(tools.clone()).to_string();
        self.on_adapter(adapter, move |i| i.tool_render(&tools)).await
    }

    /// The opening of a call that `choice` forces, in the tool adapter's format (`tool_force`),
    /// and the adapter's grammar for the rest of it (`tool_grammar`); `None` when nothing is
    /// forced or the adapter cannot force calls (then `tool_choice` is only a hint). A
    /// required call among one tool is a call to that tool.
    async fn force_tool(
        &self,
        adapter: Option<&Selected>,
        choice: &ToolChoice,
        tools: Option<&Vec<Value>>,
    ) -> Result<Option<(String, Option<String>)>, ApiError> {
        let name = match choice {
            ToolChoice::Required => match tools.map(Vec::as_slice) {
                Some([only]) => openai::tool_name(only).unwrap_or_default().to_string(),
                _ => String::new(),
            },
            ToolChoice::Named(name) => name.clone(),
            ToolChoice::Auto | ToolChoice::None => return Ok(None),
        };
        let Some(adapter) = adapter else { return Ok(None) };
        let tools: Vec<Value> = tools.cloned().unwrap_or_default().into_iter().map(closed_tool).collect();
        let request = json!({"name": name, "tools": tools}).to_string();
        self.on_adapter(adapter, move |i| {
            let Some(opener) = i.tool_force(&name)? else { return Ok(None) };
            Ok(Some((opener, i.tool_grammar(&request)?)))
        })
        .await
    }

    /// The tool adapter's trigger and lazy grammar, for calls the model starts on its own
    /// when they are held to their tools' schemas: every call with `constrain_tool_calls`,
    /// else when a tool is `strict: true`. `None` otherwise, or when the adapter has none.
    async fn lazy_tool(
        &self,
        adapter: Option<&Selected>,
        choice: &ToolChoice,
        tools: Option<&Vec<Value>>,
    ) -> Result<Option<(String, String)>, ApiError> {
        let (Some(adapter), Some(tools)) = (adapter, tools.filter(|t| !t.is_empty())) else { return Ok(None) };
        let strict = tools.iter().any(|t| function_of(t).get("strict").and_then(Value::as_bool) == Some(true));
        if *choice == ToolChoice::None || !(self.constrain_tool_calls || strict) {
            return Ok(None);
        }
        let tools: Vec<Value> = tools.iter().cloned().map(closed_tool).collect();
        let request = json!({"name": "", "tools": tools, "lazy": true}).to_string();
        self.on_adapter(adapter, move |i| {
            let Some(trigger) = i.tool_trigger()? else { return Ok(None) };
            Ok(i.tool_grammar(&request)?.map(|grammar| (trigger, grammar)))
        })
        .await
    }

    /// The prompt for chat `messages` with `tools` under `choice`: the tools described (by
    /// the template, or by the adapter when the template ignores them) and a forced call's
    /// opener at the start of the reply, which goes into `plugins` for the engine too.
    async fn tool_chat_prompt(
        &self,
        messages: Vec<Value>,
        tools: Option<Vec<Value>>,
        choice: &ToolChoice,
        kwargs: Option<Value>,
        plugins: &mut Selection,
    ) -> Result<Vec<u32>, ApiError> {
        let rendered = self.render_tools(plugins.tool.as_ref(), tools.as_ref()).await?;
        let forced = self.force_tool(plugins.tool.as_ref(), choice, tools.as_ref()).await?;
        if forced.is_none() {
            plugins.call_grammar = self.lazy_tool(plugins.tool.as_ref(), choice, tools.as_ref()).await?;
        }
        (plugins.reply_prefix, plugins.reply_grammar) = forced.map_or((None, None), |(o, g)| (Some(o), g));
        let messages = self.write_calls(plugins.tool.as_ref(), messages).await?;
        // Rendering and tokenizing a long prompt takes a while: off the async runtime's
        // threads, so other requests (and /health) are not held up.
        let (engine, prefix) = (self.engine.clone(), plugins.reply_prefix.clone());
        let (tail, tokens) = tokio::task::spawn_blocking(move || {
            let text = chat_text(&engine, messages, tools, kwargs.as_ref(), rendered, prefix.as_deref())?;
            let tail: String =
                text.chars().rev().take(PROMPT_TAIL_CHARS).collect::<Vec<_>>().into_iter().rev().collect();
            Ok::<_, ApiError>((tail, engine.tokenizer.encode(&text, false).map_err(ApiError::internal)?))
        })
        .await
        .map_err(ApiError::internal)??;
        if let Some(parser) = plugins.reasoning.as_mut() {
            // Where the prompt leaves the reply: a template may open the thinking itself
            // (or close it, with thinking off), so the output starts inside or after it.
            parser.params = with_param(Some(std::mem::take(&mut parser.params)), "prompt_tail", json!(tail));
        }
        Ok(tokens)
    }

    /// Refuses requests whose prompt plus completion cannot fit; resolves the default max_tokens.
    /// `param`: the request's name for max_tokens (empty: `max_tokens`).
    /// A prompt too long by itself is named by `prompt_param` (empty: `messages`), else the
    /// error names `param` (empty: `max_tokens`). The message is the one the API's own
    /// service writes ([`overflow_message`]), which clients parse to compact and retry.
    pub(super) fn admit(
        &self,
        prompt: usize,
        requested: Option<usize>,
        param: &str,
        prompt_param: &str,
        api: Api,
    ) -> Result<usize, ApiError> {
        let param = if param.is_empty() { "max_tokens" } else { param };
        let prompt_param = if prompt_param.is_empty() { "messages" } else { prompt_param };
        let fit = self.max_sequence_tokens;
        let too_long = |max: usize| {
            let mut message = overflow_message(api, prompt, max, fit);
            if self.context_tokens > fit && api != Api::Messages {
                message.push_str(&format!(
                    " (Here the limit is the {fit} tokens that fit in this server's memory budget; the model's context length is {}.)",
                    self.context_tokens
                ));
            }
            ApiError::invalid(if prompt >= fit { prompt_param } else { param }, message)
                .with_code("context_length_exceeded")
        };
        match requested {
            Some(max) if prompt + max > fit => Err(too_long(max)),
            Some(max) => Ok(max),
            None if prompt >= fit => Err(too_long(1)),
            None => Ok(self.default_max_tokens.min(fit - prompt)),
        }
    }

    /// A request's selected plugins as the engine's hooks (`None`: it selects none).
    pub(super) fn hooks(&self, selection: Selection) -> Option<Arc<dyn RequestHooks>> {
        PluginHooks::of(self.plugins.clone(), selection)
    }

    /// Resolves the `plugins` extension field to loaded plugins. A request with `tools` gets
    /// a tool adapter (the field's `tool`, else the server's), with the tools as its params;
    /// a `chat` request gets a reasoning parser (the field's `reasoning`, else the server's).
    pub(super) fn plugins(
        &self,
        field: Option<crate::plugins::request::PluginsField>,
        tools: Option<&Vec<Value>>,
        chat: bool,
    ) -> Result<Selection, ApiError> {
        let field = field.or_else(|| self.default_plugins.clone()).unwrap_or_default();
        let tool = field.tool.or_else(|| {
            let name = self.tool_adapter.clone()?;
            tools.filter(|t| !t.is_empty())?;
            Some(crate::plugins::request::PluginRef { name, config: None, params: None, fallback: true })
        });
        let reasoning = match field.reasoning {
            Some(r) if r.name == "none" => None,
            Some(_) if !chat => {
                let why = "`plugins.reasoning` applies to chat replies; a completion is the model's text as written";
                return Err(ApiError::invalid("plugins", why));
            }
            Some(r) => Some(r),
            None => self.reasoning_parser.clone().filter(|_| chat),
        };
        if field.sampler.is_none()
            && field.stop.is_empty()
            && tool.is_none()
            && reasoning.is_none()
            && field.constraint.is_none()
        {
            return Ok(Selection::default());
        }
        let registry =
            self.plugins.as_ref().ok_or_else(|| ApiError::invalid("plugins", "this server runs without plugins"))?;
        // What the client sends a plugin is bounded; the tools a tool adapter gets are
        // bounded by `openai::check_tools` (they are not the client's params).
        let sized = |r: &crate::plugins::request::PluginRef| {
            for (what, v) in [("config", &r.config), ("params", &r.params)] {
                let size = v.as_ref().map_or(0, |v| v.to_string().len());
                if size > MAX_PLUGIN_JSON {
                    let why = format!("plugin {}'s {what} is {size} bytes of JSON; at most {MAX_PLUGIN_JSON}", r.name);
                    return Err(ApiError::invalid("plugins", why));
                }
            }
            Ok(())
        };
        let select = |kind: Kind, r: crate::plugins::request::PluginRef| {
            registry.select(kind, &r.name, r.config, r.params, r.fallback).map_err(|e| {
                match e.downcast_ref::<Quarantined>() {
                    Some(q) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, q.message.clone())
                        .with_code("plugin_quarantined")
                        .with_retry_after(q.retry_after.as_secs_f64().ceil() as u64),
                    None => ApiError::invalid("plugins", format!("{e:#}")),
                }
            })
        };
        let pick = |kind: Kind, r: crate::plugins::request::PluginRef| {
            sized(&r)?;
            select(kind, r)
        };
        let tool = tool
            .map(|mut r| {
                sized(&r)?;
                r.params = Some(with_param(r.params.take(), "tools", Value::Array(tools.cloned().unwrap_or_default())));
                select(Kind::Tool, r)
            })
            .transpose()?;
        Ok(Selection {
            sampler: field.sampler.map(|r| pick(Kind::Sampler, r)).transpose()?,
            stops: field.stop.into_iter().map(|r| pick(Kind::Stop, r)).collect::<Result<_, _>>()?,
            tool,
            reasoning: reasoning.map(|r| pick(Kind::Reasoning, r)).transpose()?,
            constraint: field.constraint.map(|r| pick(Kind::Constraint, r)).transpose()?,
            reply_prefix: None,
            reply_grammar: None,
            call_grammar: None,
            one_tool_call: false,
        })
    }

    /// Resolves the `speculative` extension field over the server's defaults.
    pub(super) fn speculative(&self, field: Option<Value>) -> Result<SpecConfig, ApiError> {
        openai::speculative(field, &self.speculative, self.engine.has_draft)
            .map_err(|m| ApiError::invalid("speculative", m))
    }

    /// Checks sampling parameters against the model (token ids, top-k within the vocabulary).
    pub(super) fn check_sampling(&self, params: &crate::engine::SamplingParams) -> Result<(), ApiError> {
        params.validate(self.engine.info.vocab_size).map_err(|e| ApiError::bad_request(e.to_string()))
    }

    pub(super) fn submit(&self, job: JobRequest) -> Result<UnboundedReceiver<Event>, ApiError> {
        self.engine.submit(job).map_err(|e| match e {
            SubmitError::QueueFull(n) => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("the server is busy ({n} requests queued); retry shortly"),
            )
            .with_code("queue_full"),
            SubmitError::Stopped => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped"),
        })
    }
}

/// An OpenAI tool's function object (the tool itself when it is flat).
fn function_of(tool: &Value) -> &Value {
    tool.get("function").unwrap_or(tool)
}

/// A tool as its calls are held to it: its `parameters`' objects that name properties closed
/// to others unless they say otherwise (`structured::closed`; every object under `strict:
/// true`, `structured::strict`), as OpenAI's strict mode has them and vLLM's xgrammar backend
/// does by default: a key the tool does not take is of no use to it, and a small model under
/// an open object adds keys until `max_tokens`. Free-form arguments (`{"type": "object"}`)
/// stay free.
fn closed_tool(mut tool: Value) -> Value {
    let function = if tool.get("function").is_some() { &mut tool["function"] } else { &mut tool };
    let strict = function.get("strict").and_then(Value::as_bool) == Some(true);
    if let Some(p) = function.get_mut("parameters") {
        *p = if strict { crate::structured::strict(p.take()) } else { crate::structured::closed(p.take()) };
    }
    tool
}

/// For templates that ignore `tools`: describe them in the system message, with the
/// adapter's `rendered` text or in the Hermes `<tool_call>` convention.
/// Renders chat messages (and tools) through the model's template, as text. A template
/// that ignores `tools` gets them described in the system message: `rendered` (the tool
/// adapter's text) or the Hermes convention, in which the assistant's earlier calls not
/// yet written (`write_calls`) are then written into its turns (the template would drop
/// them). System messages after the first stay where they are when the template takes
/// them, else they join the first. `reply_prefix` (a forced tool call's opening) follows
/// the template's start of the assistant's turn. An assistant turn's `reasoning_content` is
/// also given as `thinking`, the key GPT-OSS's template reads it from.
fn chat_text(
    engine: &Engine,
    mut messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    kwargs: Option<&Value>,
    rendered: Option<String>,
    reply_prefix: Option<&str>,
) -> Result<String, ApiError> {
    let tokenizer = &engine.tokenizer;
    for m in messages.iter_mut().filter(|m| m["role"] == "assistant" && m.get("thinking").is_none()) {
        if let Some(r) = m.get("reasoning_content").cloned() {
            m["thinking"] = r;
        }
    }
    let template_takes_tools = takes_tools(engine);
    if !template_takes_tools && rendered.is_none() {
        write_hermes_calls(&mut messages);
    }
    let tools = tools.filter(|t| !t.is_empty());
    if let (Some(tools), false) = (&tools, template_takes_tools) {
        inject_tools(&mut messages, tools, rendered);
    }
    let tools_value = tools.filter(|_| template_takes_tools).map(Value::Array);
    let render = |messages: &[Value]| {
        tokenizer.apply_chat_template(&Value::Array(messages.to_vec()), tools_value.as_ref(), true, kwargs)
    };
    let mut text = match render(&messages) {
        Ok(text) => text,
        Err(first) => match merge_system(&messages) {
            Some(merged) => render(&merged),
            None => Err(first),
        }
        .map_err(|e| ApiError::bad_request(format!("{e}")))?,
    };
    text.push_str(reply_prefix.unwrap_or_default());
    Ok(text)
}

/// Whether the model's chat template renders `tools` itself.
fn takes_tools(engine: &Engine) -> bool {
    engine.tokenizer.chat_template().is_some_and(|t| t.contains("tools"))
}

/// The largest `config` or `params` a request may give a plugin.
const MAX_PLUGIN_JSON: usize = 64 << 10;

/// How much of the prompt's end a reasoning parser gets (`prompt_tail`, ABI.md §5.5).
const PROMPT_TAIL_CHARS: usize = 256;

/// Plugin params with `key` set (params that are not an object are replaced).
fn with_param(params: Option<Value>, key: &str, value: Value) -> Value {
    match params {
        Some(Value::Object(mut p)) => {
            p.insert(key.into(), value);
            Value::Object(p)
        }
        _ => json!({ key: value }),
    }
}

fn inject_tools(messages: &mut Vec<Value>, tools: &[Value], rendered: Option<String>) {
    let text = rendered.unwrap_or_else(|| {
        let list: Vec<String> = tools.iter().map(|t| function_of(t).to_string()).collect();
        format!(
            "You can call these tools:\n<tools>\n{}\n</tools>\nTo call one, reply with <tool_call>{{\"name\": <tool name>, \"arguments\": <arguments object>}}</tool_call>.",
            list.join("\n")
        )
    });
    match messages.first_mut() {
        Some(first) if first["role"] == "system" => {
            let existing = first["content"].as_str().unwrap_or("").to_string();
            first["content"] = json!(format!("{existing}\n\n{text}"));
        }
        _ => messages.insert(0, json!({"role": "system", "content": text})),
    }
}

/// The messages with every system message joined into one at the start (for templates that
/// refuse a system message anywhere else); `None` when there is nothing to move.
fn merge_system(messages: &[Value]) -> Option<Vec<Value>> {
    let is_system = |m: &Value| m["role"] == "system";
    if !messages.iter().skip(1).any(is_system) {
        return None;
    }
    let system: Vec<&str> = messages.iter().filter(|m| is_system(m)).filter_map(|m| m["content"].as_str()).collect();
    let mut out = vec![json!({"role": "system", "content": system.join("\n\n")})];
    out.extend(messages.iter().filter(|m| !is_system(m)).cloned());
    Some(out)
}

/// For templates that ignore tools (and so drop an assistant turn's `tool_calls`): the calls
/// written into the turn's text in the Hermes convention the tools were described in, so the
/// model sees what it called before each tool result.
fn write_hermes_calls(messages: &mut [Value]) {
    for m in messages.iter_mut().filter(|m| m["role"] == "assistant") {
        let Some(Value::Array(calls)) = m.as_object_mut().and_then(|o| o.remove("tool_calls")) else { continue };
        let written: Vec<String> =
            call_objects(&calls).iter().map(|call| format!("<tool_call>{call}</tool_call>")).collect();
        append_calls(m, &written.join("\n"));
    }
}

/// Template-message tool calls as `{"name", "arguments"}` objects (arguments an object).
fn call_objects(calls: &[Value]) -> Vec<Value> {
    calls
        .iter()
        .map(|call| {
            let f = function_of(call);
            json!({"name": f.get("name"), "arguments": f.get("arguments").cloned().unwrap_or(json!({}))})
        })
        .collect()
}

/// Appends written calls to an assistant message's text, on a line of their own.
fn append_calls(message: &mut Value, written: &str) {
    let mut text = message["content"].as_str().unwrap_or_default().to_string();
    if !text.is_empty() {
        text.push('\n');
    }
    text.push_str(written);
    message["content"] = json!(text);
}

/// The API a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Api {
    #[default]
    Chat,
    Completions,
    Responses,
    Messages,
}

impl Api {
    /// Its name in the request log.
    pub fn name(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Completions => "completions",
            Api::Responses => "responses",
            Api::Messages => "messages",
        }
    }
}

/// A prompt of `prompt` tokens with `max` to generate does not fit in `fit`: the message each
/// API's own service writes, which harnesses parse to compact or retry (Claude Code reads
/// Anthropic's two forms, numbers included, and retries the second with a lower
/// `max_tokens`; OpenAI clients read the context length from the first sentence; Codex reads
/// the Responses API's `context_length_exceeded` code).
pub(super) fn overflow_message(api: Api, prompt: usize, max: usize, fit: usize) -> String {
    match api {
        // At least one token must be left to generate: a prompt of `fit` tokens is too long.
        Api::Messages if prompt >= fit => format!("prompt is too long: {prompt} tokens > {} maximum", fit.saturating_sub(1)),
        Api::Messages => format!(
            "input length and `max_tokens` exceed context limit: {prompt} + {max} > {fit}, decrease input length or `max_tokens` and try again"
        ),
        Api::Chat => format!(
            "This model's maximum context length is {fit} tokens. However, you requested {} tokens ({prompt} in the messages, {max} in the completion). Please reduce the length of the messages or completion.",
            prompt + max
        ),
        Api::Completions => format!(
            "This model's maximum context length is {fit} tokens, however you requested {} tokens ({prompt} in your prompt; {max} for the completion). Please reduce your prompt; or completion length.",
            prompt + max
        ),
        Api::Responses => format!(
            "Your input exceeds the context window of this model. Please adjust your input and try again. ({prompt} input tokens and {max} max_output_tokens; the window is {fit} tokens: shorten `input` or `instructions`, or lower `max_output_tokens`.)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each API's context-overflow message as its own service writes it (Anthropic's two
    /// forms, OpenAI's chat and legacy completions sentences, the Responses API's), numbers
    /// where the clients read them.
    #[test]
    fn context_overflow_messages_are_each_services_own() {
        assert_eq!(overflow_message(Api::Messages, 9000, 1, 8192), "prompt is too long: 9000 tokens > 8191 maximum");
        assert_eq!(overflow_message(Api::Messages, 8192, 1, 8192), "prompt is too long: 8192 tokens > 8191 maximum");
        assert_eq!(
            overflow_message(Api::Messages, 6000, 4000, 8192),
            "input length and `max_tokens` exceed context limit: 6000 + 4000 > 8192, decrease input length or `max_tokens` and try again"
        );
        assert_eq!(
            overflow_message(Api::Chat, 6000, 4000, 8192),
            "This model's maximum context length is 8192 tokens. However, you requested 10000 tokens (6000 in the messages, 4000 in the completion). Please reduce the length of the messages or completion."
        );
        assert_eq!(
            overflow_message(Api::Completions, 118, 4000, 4097),
            "This model's maximum context length is 4097 tokens, however you requested 4118 tokens (118 in your prompt; 4000 for the completion). Please reduce your prompt; or completion length."
        );
        assert!(overflow_message(Api::Responses, 9000, 100, 8192).starts_with(
            "Your input exceeds the context window of this model. Please adjust your input and try again."
        ));
    }

    #[test]
    fn system_messages_are_merged_only_when_one_follows_the_first() {
        let m = |role: &str, content: &str| json!({"role": role, "content": content});
        assert_eq!(merge_system(&[m("system", "a"), m("user", "u")]), None);
        let merged = merge_system(&[m("system", "a"), m("user", "u"), m("system", "b"), m("assistant", "x")]).unwrap();
        assert_eq!(merged, vec![m("system", "a\n\nb"), m("user", "u"), m("assistant", "x")]);
        let merged = merge_system(&[m("user", "u"), m("system", "b")]).unwrap();
        assert_eq!(merged, vec![m("system", "b"), m("user", "u")]);
    }
}
