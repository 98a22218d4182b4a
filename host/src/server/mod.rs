//! `host serve`: the OpenAI- and Anthropic-compatible HTTP server (axum + tokio) in front
//! of the engine thread. Only this module knows the HTTP wire shapes.

pub mod anthropic;
mod chat;
mod completions;
pub mod error;
pub mod guard;
mod messages;
pub mod metrics;
pub mod openai;
mod reply;
pub mod responses;
pub mod routes;
pub mod state;
mod store;
mod tokens;
pub mod turn;
mod ui;

use crate::config::{ServeArgs, ServeConfig};
use crate::engine::handle::{Engine, EngineConfig};
use crate::plugins::abi_v1::Kind;
use crate::plugins::adapters::PluginScheduler;
use crate::plugins::PluginRegistry;
use anyhow::{Context, Result};
use state::AppState;
use std::sync::Arc;

/// The memory budget: configured, else 80% of GPU memory, else 60% of system RAM.
fn memory_budget(config: &ServeConfig, engine: &Engine) -> u64 {
    if let Some(b) = config.memory_budget {
        return b;
    }
    if let Some(gpu) = engine.device.memory_size().filter(|_| engine.device == mlx::Device::Gpu) {
        return gpu as u64 / 10 * 8;
    }
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(8 << 30);
    total / 10 * 6
}

/// Builds the shared state from a loaded engine.
pub fn state(config: &ServeConfig, engine: Arc<Engine>, plugins: Option<Arc<PluginRegistry>>) -> Arc<AppState> {
    // A hub name is the model's id as given (`org/name`); a path's is its file or folder name.
    let model_id = config.model.as_deref().and_then(crate::load::hub::hub_repo).unwrap_or_else(|| {
        engine.info.source.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
    });
    let config = &config.for_model(&model_id);
    let tool_adapter = match config.tool_adapter.as_deref() {
        Some("none" | "off") => None,
        Some(name) => Some(name.to_string()),
        None => plugins.as_ref().map(|_| detect_tool_adapter(engine.tokenizer.chat_template()).to_string()),
    };
    let reasoning_parser = match config.reasoning_parser.as_deref() {
        Some("none" | "off") => None,
        Some(name) => {
            Some(crate::plugins::request::PluginRef { name: name.into(), config: None, params: None, fallback: false })
        }
        None => plugins.as_ref().and_then(|_| detect_reasoning_parser(engine.tokenizer.chat_template())),
    };
    let budget = memory_budget(config, &engine);
    let free = budget.saturating_sub(engine.baseline_memory as u64);
    let per_token = engine.info.kv_bytes_per_token.max(1) as u64;
    let memory_tokens = (free / per_token) as usize;
    let trained = engine.info.max_position_embeddings;
    let context_tokens = match (config.context_length, trained) {
        (Some(n), Some(t)) if n > t => {
            tracing::warn!(
                context_length = n,
                trained = t,
                "context_length is past the model's own; its output degrades there"
            );
            n
        }
        (Some(n), _) | (None, Some(n)) => n,
        (None, None) => memory_tokens,
    };
    let max_sequence_tokens = memory_tokens.min(context_tokens);
    tracing::info!(budget, memory_tokens, context_tokens, max_sequence_tokens, model = model_id, "memory budget");
    engine.set_kv_budget_tokens(memory_tokens);
    let speculative = config.spec().unwrap_or_default();
    let (engine_tokenizer, engine_vocab, engine_eos) =
        (engine.tokenizer.clone(), engine.info.vocab_size, engine.info.eos_token_ids.clone());
    let engine_source = engine.info.source.clone();
    Arc::new(AppState {
        engine,
        metrics: Default::default(),
        model_id,
        api_key: config.api_key.clone(),
        default_max_tokens: config.default_max_tokens,
        max_body_bytes: config.max_body_bytes,
        max_sequence_tokens,
        context_tokens,
        created: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        plugins,
        default_plugins: config.default_plugins.clone(),
        speculative,
        tool_adapter,
        reasoning_parser,
        guard: guard::Policy::new(&config.allowed_hosts, &config.cors_origins),
        body_timeout: std::time::Duration::from_secs(config.body_timeout_secs.max(1)),
        responses: Default::default(),
        grammars: Arc::new(crate::structured::Grammars::new(engine_tokenizer, engine_vocab, engine_eos)),
        constrain_tool_calls: config.constrain_tool_calls,
        ui: config.ui,
        memory_budget: budget,
        quantization: ui::quantization(&engine_source),
        plugin_feed: Default::default(),
    })
}

/// The tool-call adapter that fits a chat template, by the markers its tool-call syntax
/// uses. Templates that ignore tools get Hermes (the host describes the tools in that
/// convention), except Gemma's, whose adapter renders its own instructions.
pub fn detect_tool_adapter(template: Option<&str>) -> &'static str {
    let t = template.unwrap_or("");
    if t.contains("<|channel|>") {
        "harmony"
    } else if t.contains("<|tool_call>") {
        "gemma4"
    } else if t.contains("<function=") && t.contains("<parameter=") {
        "qwen3-coder"
    } else if t.contains("<function name=") && t.contains("<param name=") {
        "minicpm5"
    } else if t.contains("<tool_call>") {
        "hermes"
    } else if t.contains("[TOOL_CALLS]") {
        "mistral"
    } else if t.contains("<|python_tag|>") || t.contains("ipython") {
        "llama3-json"
    } else if t.contains("tool_code") || t.contains("<start_of_turn>") {
        "gemma"
    } else {
        "hermes"
    }
}

/// The reasoning parser that fits a chat template, by its thinking markers: the built-in
/// `think` (`<think>`...`</think>`, or by config Gemma 4's `<|channel>thought`...`<channel|>`
/// or Mistral's `[THINK]`...`[/THINK]`), or
/// `harmony-channels` for OpenAI's harmony (GPT-OSS: `<|channel|>analysis`); `None` for
/// templates without them. Runs with `fallback` on: if it faults, the text passes
/// through as content.
pub fn detect_reasoning_parser(template: Option<&str>) -> Option<crate::plugins::request::PluginRef> {
    let t = template.unwrap_or("");
    if t.contains("<|channel|>") {
        return Some(crate::plugins::request::PluginRef {
            name: "harmony-channels".into(),
            config: None,
            params: None,
            fallback: true,
        });
    }
    let config = if t.contains("<think>") {
        None
    } else if t.contains("<|channel>") {
        // Gemma 4: `<|channel>thought\n...<channel|>` (special tokens, kept as text).
        Some(serde_json::json!({"open": "<|channel>thought", "close": "<channel|>"}))
    } else if t.contains("[THINK]") {
        Some(serde_json::json!({"open": "[THINK]", "close": "[/THINK]"}))
    } else {
        return None;
    };
    Some(crate::plugins::request::PluginRef { name: "think".into(), config, params: None, fallback: true })
}

pub fn run(args: ServeArgs) -> Result<()> {
    let config = ServeConfig::resolve(&args)?;
    config.spec()?;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("HOST_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let started = std::time::Instant::now();
    let registry = PluginRegistry::with_builtins()?;
    tracing::info!(
        builtins = registry.names().len(),
        ms = started.elapsed().as_millis() as u64,
        "built-in plugins ready"
    );
    let _reload = match &config.plugins {
        Some(dir) => {
            let n = registry.load_dir(dir)?;
            tracing::info!(loaded = n, dir = %dir.display(), "plugins (hot reload on)");
            Some(crate::plugins::reload::watch(registry.clone(), dir)?)
        }
        None => None,
    };
    check_named_plugins(&config, &registry)?;
    let engine = Arc::new(Engine::start(EngineConfig {
        model: config.model.clone(),
        device: config.device,
        queue_limit: config.queue_limit,
        prompt_cache_bytes: config.prompt_cache_bytes as usize,
        prefill_step_size: 2048,
        max_batch: config.max_batch,
        step_token_budget: config.step_token_budget,
        draft_model: config.draft_model.clone(),
        policy: Some(PluginScheduler::maker(
            registry.clone(),
            config.scheduler.clone(),
            config.scheduler_config.clone().unwrap_or_else(|| serde_json::json!({})),
        )),
        split: config.split(),
        warm_up: config.warm_up,
    })?);
    let state = state(&config, engine.clone(), Some(registry));
    serve_until_stopped(config, state, engine)
}

/// Every plugin the configuration names (the scheduler, default plugins, tool adapters and
/// reasoning parsers, server-wide and per model) must be loaded and of the right kind.
fn check_named_plugins(config: &ServeConfig, registry: &PluginRegistry) -> Result<()> {
    let mut named: Vec<(&str, Kind, &String)> = vec![("scheduler", Kind::Scheduler, &config.scheduler)];
    let defaults =
        config.default_plugins.iter().chain(config.models.values().filter_map(|m| m.default_plugins.as_ref()));
    for d in defaults {
        named.extend(d.sampler.iter().map(|r| ("default_plugins.sampler", Kind::Sampler, &r.name)));
        named.extend(d.stop.iter().map(|r| ("default_plugins.stop", Kind::Stop, &r.name)));
        named.extend(d.tool.iter().map(|r| ("default_plugins.tool", Kind::Tool, &r.name)));
        named.extend(
            d.reasoning
                .iter()
                .filter(|r| r.name != "none")
                .map(|r| ("default_plugins.reasoning", Kind::Reasoning, &r.name)),
        );
        named.extend(d.constraint.iter().map(|r| ("default_plugins.constraint", Kind::Constraint, &r.name)));
    }
    let adapters = config.tool_adapter.iter().chain(config.models.values().filter_map(|m| m.tool_adapter.as_ref()));
    named.extend(adapters.filter(|n| !matches!(n.as_str(), "none" | "off")).map(|n| ("tool_adapter", Kind::Tool, n)));
    let parsers =
        config.reasoning_parser.iter().chain(config.models.values().filter_map(|m| m.reasoning_parser.as_ref()));
    named.extend(
        parsers.filter(|n| !matches!(n.as_str(), "none" | "off")).map(|n| ("reasoning_parser", Kind::Reasoning, n)),
    );
    for (key, kind, name) in named {
        match registry.get(name) {
            None => {
                anyhow::bail!("plugin {name:?} (from {key}) is not loaded; loaded: {}", registry.names().join(", "))
            }
            Some(p) if !p.manifest.has(kind) => {
                anyhow::bail!("plugin {name:?} (from {key}) is not a {kind} plugin (it is: {:?})", p.manifest.kinds)
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Serves on the configured address until SIGTERM or Ctrl-C, then shuts down: in-flight
/// requests get the grace period, and the engine thread is stopped before the process exits.
fn serve_until_stopped(config: ServeConfig, state: state::Shared, engine: Arc<Engine>) -> Result<()> {
    let stopping = engine.clone();
    let finished = engine.clone();
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")?;
    runtime.block_on(async move {
        let addr = std::net::SocketAddr::new(config.host, config.port);
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr()?;
        if !config.host.is_loopback() && config.api_key.is_none() {
            tracing::warn!(
                host = %config.host,
                "listening beyond this machine without an API key: anyone who can reach the port can use the server; set --api-key"
            );
        }
        // The handlers are in place before anyone is told the address: a SIGTERM right after
        // it (a test's, a supervisor's) shuts down gracefully instead of killing the process.
        let stop_signal = shutdown_signal()?;
        // The address line last: clients (and tests) act on it at once.
        if engine.device == mlx::Device::Cpu {
            eprintln!("host: CPU BLAS: {}", crate::load::device::linked_blas());
        }
        if state.ui {
            eprintln!("host: web page (chat and plugin console) at http://{local}/");
        }
        eprintln!("host: serving {} ({}) on http://{local}", state.model_id, engine.device);
        let grace = std::time::Duration::from_secs(config.shutdown_grace_secs);
        let limits = Limits {
            header_timeout: std::time::Duration::from_secs(config.header_timeout_secs.max(1)),
            max_connections: config.max_connections.max(1),
        };
        serve(listener, routes::app(state), limits, async move {
                stop_signal.await;
                eprintln!("host: shutting down; in-flight requests get {}s to finish", grace.as_secs());
                tokio::spawn(async move {
                    tokio::time::sleep(grace).await;
                    eprintln!("host: grace period over; stopping the requests still running");
                    // The engine thread must be out of MLX before the process exits.
                    let stopped =
                        tokio::task::spawn_blocking(move || stopping.stop_now(std::time::Duration::from_secs(10)))
                            .await
                            .unwrap_or(false);
                    if !stopped {
                        eprintln!("host: the engine did not stop within 10 s; exiting anyway");
                        mlx::exit_without_teardown(0);
                    }
                    // Time for the stopped requests' errors to reach their clients, after
                    // which the server ends by itself; if a connection lingers, exit.
                    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                    eprintln!("host: exiting");
                    std::process::exit(0);
                });
            })
            .await;
        // Every connection has closed, but a request whose client left may still be running
        // (a long prefill): stop the engine thread before `main` returns, so no MLX or BLAS
        // work is in flight when the process exits (OpenBLAS's exit handler joins its
        // threads and hung for good on one a running prefill held).
        let stopped = tokio::task::spawn_blocking(move || finished.stop_now(std::time::Duration::from_secs(30)))
            .await
            .unwrap_or(false);
        if !stopped {
            eprintln!("host: the engine did not stop within 30 s; exiting anyway");
            mlx::exit_without_teardown(0);
        }
        eprintln!("host: stopped");
        Ok(())
    })
}

/// What a connection may take: how long its request headers may take to arrive, and how
/// many connections may be open at once.
struct Limits {
    header_timeout: std::time::Duration,
    max_connections: usize,
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets the open connections
/// finish (each ends after its in-flight request). A connection past `max_connections` is
/// closed on arrival; one whose request headers do not arrive within `header_timeout` is
/// closed (hyper's HTTP/1 header timeout).
async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()>,
) {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    let open = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut refused = 0u64;
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: wait, then go on.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            refused += 1;
            if refused.is_power_of_two() {
                tracing::warn!(%peer, refused, max = limits.max_connections, "too many open connections; closing new ones");
            }
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            let _ = connection.await;
            drop(permit);
        });
    }
    // New connections are refused from here on (they used to wait in the backlog, never
    // answered, until the process exited).
    drop(listener);
    graceful.shutdown().await;
}

/// SIGTERM or Ctrl-C (SIGINT), their handlers installed now (tokio's `ctrl_c()` installs
/// its own only when first polled); the future ends at the first of them.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => {},
                _ = int.recv() => {},
            }
        })
    }
    #[cfg(not(unix))]
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}
