//! `host launch <pi|opencode|codex|claude> [SERVE_ARGS] [-- HARNESS_ARGS]`: runs an agent
//! harness against `host serve`. Reuses a server already answering on the address (the
//! `--url`, else 127.0.0.1 on `--port` or 8080), else starts one with SERVE_ARGS and stops it
//! when the harness exits. The harness's configuration points every model role it uses at
//! the served model and is given through flags and environment variables, or files under
//! `$XDG_CONFIG_HOME/host/launch/` (`~/.config/host/launch/`): the user's own configuration
//! is never written. `--print-config` shows it instead of running the harness.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Harness {
    /// pi (`@mariozechner/pi-coding-agent`): OpenAI chat completions.
    Pi,
    /// opencode (`opencode-ai`): OpenAI chat completions.
    Opencode,
    /// Codex CLI (`@openai/codex`): the Responses API.
    Codex,
    /// Claude Code (`@anthropic-ai/claude-code`): Anthropic Messages.
    Claude,
}

impl Harness {
    fn program(self) -> &'static str {
        match self {
            Harness::Pi => "pi",
            Harness::Opencode => "opencode",
            Harness::Codex => "codex",
            Harness::Claude => "claude",
        }
    }

    fn npm_package(self) -> &'static str {
        match self {
            Harness::Pi => "@mariozechner/pi-coding-agent",
            Harness::Opencode => "opencode-ai",
            Harness::Codex => "@openai/codex",
            Harness::Claude => "@anthropic-ai/claude-code",
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The harness to run.
    #[arg(value_enum)]
    pub harness: Harness,
    /// Use the server at this URL (e.g. http://127.0.0.1:8080) instead of finding or
    /// starting one.
    #[arg(long)]
    pub url: Option<String>,
    /// Print the configuration the harness would get (flags, environment, files) and exit.
    #[arg(long)]
    pub print_config: bool,
    /// `host serve` arguments for a server started here (e.g. `--model PATH --port 0`).
    #[arg(allow_hyphen_values = true)]
    pub serve_args: Vec<String>,
    /// After `--`: the harness's own arguments.
    #[arg(last = true)]
    pub harness_args: Vec<String>,
}

impl Args {
    /// The serve arguments and the harness arguments. (Once the serve arguments have begun,
    /// clap keeps a `--` among them rather than ending them there.)
    pub fn split(&self) -> (Vec<String>, Vec<String>) {
        match self.serve_args.iter().position(|a| a == "--") {
            Some(i) => {
                let mut harness = self.serve_args[i + 1..].to_vec();
                harness.extend(self.harness_args.iter().cloned());
                (self.serve_args[..i].to_vec(), harness)
            }
            None => (self.serve_args.clone(), self.harness_args.clone()),
        }
    }
}

/// What the harness gets: extra leading arguments, environment variables, files written.
#[derive(Debug, Default, PartialEq)]
pub struct Launch {
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub files: Vec<(PathBuf, String)>,
}

/// The most output a launched harness asks for per turn, from the served context length:
/// a quarter of it, between 256 and 8,192 tokens (harnesses otherwise ask for their cloud
/// models' 16k-128k, which a local model's context cannot hold beside the prompt).
pub fn output_tokens(context: usize) -> usize {
    (context / 4).clamp(256, 8192)
}

/// The room a launched harness keeps free of conversation in a served window of `context`
/// tokens: a turn's output and an eighth of the window for the tool results that come
/// before the harness looks again (pi looks when its run ends, opencode after each step,
/// both at the last reply's token count). It compacts (summarises the conversation) once
/// the prompt would grow past `context` less this, before the server would refuse it.
pub fn reserve_tokens(context: usize) -> usize {
    output_tokens(context) + context / 8
}

/// The configuration for `harness` against the server at `url` serving `model` with
/// `context` tokens of prompt + output (`None`: unknown, the harness's defaults stand).
pub fn configure(
    harness: Harness,
    url: &str,
    model: &str,
    context: Option<usize>,
    api_key: &str,
    dir: &Path,
) -> Launch {
    let url = url.trim_end_matches('/');
    let output = context.map(output_tokens);
    let reserve = context.map(reserve_tokens);
    let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    };
    match harness {
        // Every role (main loop, sub-agents, the "haiku" background calls) is the served model.
        Harness::Claude => Launch {
            env: env(&[
                ("ANTHROPIC_BASE_URL", url),
                ("ANTHROPIC_AUTH_TOKEN", api_key),
                ("ANTHROPIC_MODEL", model),
                ("ANTHROPIC_DEFAULT_OPUS_MODEL", model),
                ("ANTHROPIC_DEFAULT_SONNET_MODEL", model),
                ("ANTHROPIC_DEFAULT_HAIKU_MODEL", model),
                ("ANTHROPIC_SMALL_FAST_MODEL", model),
                ("CLAUDE_CODE_SUBAGENT_MODEL", model),
                ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
            ])
            .into_iter()
            .chain(output.map(|n| ("CLAUDE_CODE_MAX_OUTPUT_TOKENS".to_string(), n.to_string())))
            // The served window, which Claude Code otherwise takes for 1M on a model it does
            // not know. It compacts once its count passes the window less its output (at most
            // 20,000) less 13,000 tokens, and only while its fixed prompt (instructions and
            // tools) is under that; else it waits for the server's "prompt is too long".
            .chain(context.map(|n| ("CLAUDE_CODE_MAX_CONTEXT_TOKENS".to_string(), n.to_string())))
            .collect(),
            ..Launch::default()
        },
        // `-c` overrides (TOML values) leave ~/.codex/config.toml as it is.
        Harness::Codex => {
            let mut args = vec![];
            for (key, value) in [
                ("model_provider", json!("host")),
                ("model", json!(model)),
                ("model_providers.host.name", json!("host")),
                ("model_providers.host.base_url", json!(format!("{url}/v1"))),
                ("model_providers.host.wire_api", json!("responses")),
                ("model_providers.host.env_key", json!("HOST_LAUNCH_API_KEY")),
            ] {
                args.push("-c".to_string());
                args.push(format!("{key}={value}"));
            }
            if let (Some(context), Some(output), Some(reserve)) = (context, output, reserve) {
                args.extend(["-c".into(), format!("model_context_window={context}")]);
                args.extend(["-c".into(), format!("model_auto_compact_token_limit={}", context - reserve)]);
                // Read by the pinned Codex; newer ones say it is ignored.
                args.extend(["-c".into(), format!("model_max_output_tokens={output}")]);
            }
            Launch { args, env: env(&[("HOST_LAUNCH_API_KEY", api_key)]), ..Launch::default() }
        }
        // OPENCODE_CONFIG is merged over the user's own configuration.
        Harness::Opencode => {
            let path = dir.join("opencode.json");
            let mut config = json!({
                "$schema": "https://opencode.ai/config.json",
                "provider": {"host": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "host",
                    "options": {"baseURL": format!("{url}/v1"), "apiKey": api_key},
                    "models": {model: opencode_model(model, context, output)},
                }},
                "model": format!("host/{model}"),
                "small_model": format!("host/{model}"),
            });
            if let (Some(context), Some(reserve)) = (context, reserve) {
                // It compacts once a turn leaves less than `reserved` of the model's `input`,
                // keeping the newest messages up to `preserve_recent_tokens` (by default a
                // quarter of what it may use: past the point it compacts at again when its
                // own prompt is large, as opencode's ~7,500 tokens are in a 16,384 window).
                config["compaction"] =
                    json!({"auto": true, "reserved": reserve, "preserve_recent_tokens": context / 16});
            }
            Launch {
                env: env(&[("OPENCODE_CONFIG", &path.to_string_lossy())]),
                files: vec![(path, serde_json::to_string_pretty(&config).unwrap())],
                ..Launch::default()
            }
        }
        // pi reads providers from its agent folder only: it gets one of its own.
        Harness::Pi => {
            let agent = dir.join("pi-agent");
            let models = json!({"providers": {"host": {
                "baseUrl": format!("{url}/v1"),
                "api": "openai-completions",
                "apiKey": api_key,
                "compat": {"supportsDeveloperRole": false, "supportsReasoningEffort": false},
                "models": [pi_model(model, context, output)],
            }}});
            let mut files = vec![(agent.join("models.json"), serde_json::to_string_pretty(&models).unwrap())];
            if let (Some(context), Some(reserve)) = (context, reserve) {
                // pi's defaults (16,384 reserved, 20,000 kept) assume a cloud model's window.
                let settings =
                    json!({"compaction": {"enabled": true, "reserveTokens": reserve, "keepRecentTokens": context / 4}});
                files.push((agent.join("settings.json"), serde_json::to_string_pretty(&settings).unwrap()));
            }
            Launch {
                args: vec!["--provider".into(), "host".into(), "--model".into(), model.into()],
                env: env(&[("PI_CODING_AGENT_DIR", &agent.to_string_lossy())]),
                files,
            }
        }
    }
}

/// opencode's entry for the served model, with its limits when known. `input` is the whole
/// window: opencode (1.18) compacts once a turn's tokens reach `input` less its
/// `compaction.reserved`, and without `input` ignores `reserved` (it then compacts at
/// `context` less `output`, leaving no room for the next tool result: the next request
/// overflows and opencode ends on the server's refusal).
fn opencode_model(model: &str, context: Option<usize>, output: Option<usize>) -> Value {
    let mut m = json!({"name": model, "tool_call": true});
    if let (Some(context), Some(output)) = (context, output) {
        m["limit"] = json!({"context": context, "input": context, "output": output});
    }
    m
}

/// pi's entry for the served model, with its limits when known.
fn pi_model(model: &str, context: Option<usize>, output: Option<usize>) -> Value {
    let mut m = json!({"id": model});
    if let (Some(context), Some(output)) = (context, output) {
        m["contextWindow"] = json!(context);
        m["maxTokens"] = json!(output);
    }
    m
}

/// `GET path` on `http://host:port` with the standard library; the body, for a 200.
fn http_get(url: &str, path: &str) -> Result<String> {
    let authority = url.trim_end_matches('/').strip_prefix("http://").context("only http:// URLs are supported")?;
    let mut stream = std::net::TcpStream::connect(authority).with_context(|| format!("connecting to {url}"))?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").context("a malformed HTTP response")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("{url}{path} answered {}", head.lines().next().unwrap_or(""));
    }
    Ok(body.to_string())
}

/// The served model's id and context length (`max_model_len`), if a host server answers
/// at `url`.
fn served_model(url: &str) -> Option<(String, Option<usize>)> {
    let health: Value = serde_json::from_str(&http_get(url, "/health").ok()?).ok()?;
    let model = health.get("model")?.as_str()?.to_string();
    let models: Option<Value> = http_get(url, "/v1/models").ok().and_then(|b| serde_json::from_str(&b).ok());
    let context = models.as_ref().and_then(|m| m.pointer("/data/0/max_model_len")).and_then(Value::as_u64);
    Some((model, context.map(|c| c as usize)))
}

/// A `host serve` started for the harness; stopped when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM first (the server's graceful shutdown), SIGKILL if that cannot be sent.
        if !Command::new("kill").arg(self.0.id().to_string()).status().is_ok_and(|s| s.success()) {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// Where a server started by `host launch` writes its log.
fn server_log() -> PathBuf {
    std::env::temp_dir().join(format!("host-launch-{}.log", std::process::id()))
}

/// Starts `host serve SERVE_ARGS`; returns it once it says where it listens.
fn start_server(serve_args: &[String]) -> Result<(Server, String)> {
    let exe = std::env::current_exe().context("finding the host binary")?;
    let mut child = Command::new(exe)
        .arg("serve")
        .args(serve_args)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting host serve")?;
    let stderr = child.stderr.take().unwrap();
    let server = Server(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // The server's log goes to a file: on our stderr it would mix with the harness's
        // screen. Only the address line (or an error) is looked for here.
        let log = server_log();
        let mut file = std::fs::File::create(&log).ok();
        let mut sent = false;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(f) = file.as_mut() {
                let _ = writeln!(f, "{line}");
            }
            if !sent {
                if let Some(url) = line.split(" on ").last().filter(|u| u.starts_with("http://")) {
                    let _ = tx.send(Ok(url.trim().to_string()));
                    sent = true;
                } else if line.starts_with("error:") {
                    let _ = tx.send(Err(line.clone()));
                    sent = true;
                }
            }
        }
        if !sent {
            let _ = tx.send(Err(format!("host serve exited before serving; its log: {}", log.display())));
        }
    });
    match rx.recv_timeout(std::time::Duration::from_secs(600)) {
        Ok(Ok(url)) => Ok((server, url)),
        Ok(Err(e)) => bail!("host serve did not start: {e}"),
        Err(_) => bail!("host serve did not start within 600 s"),
    }
}

/// The program on PATH, if any.
fn find_program(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(name)).find(|p| p.is_file())
}

fn config_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("host").join("launch")
}

pub fn run(args: Args) -> Result<()> {
    let (serve_args, harness_args) = args.split();
    let (serve_args, harness_args) = (&serve_args, &harness_args);
    let program = args.harness.program();
    let binary = find_program(program);
    if binary.is_none() && !args.print_config {
        bail!(
            "{program} is not installed (not on PATH); install it with `npm install -g {}@latest`",
            args.harness.npm_package()
        );
    }
    let port = serve_args.iter().position(|a| a == "--port").and_then(|i| serve_args.get(i + 1)).cloned();
    let guess = args.url.clone().unwrap_or_else(|| format!("http://127.0.0.1:{}", port.as_deref().unwrap_or("8080")));
    let api_key = std::env::var("HOST_API_KEY").unwrap_or_else(|_| "host-local".into());
    let (_server, url, (model, context)) = match served_model(&guess) {
        Some(served) => {
            eprintln!("host launch: using the server at {guess} ({})", served.0);
            (None, guess, served)
        }
        None if args.url.is_some() => bail!("no host server answers at {guess}"),
        None => {
            eprintln!("host launch: starting host serve {}", serve_args.join(" "));
            let (server, url) = start_server(serve_args)?;
            let served = served_model(&url).with_context(|| format!("the server at {url} did not answer /health"))?;
            eprintln!("host launch: serving {} on {url} (its log: {})", served.0, server_log().display());
            (Some(server), url, served)
        }
    };
    let launch = configure(args.harness, &url, &model, context, &api_key, &config_dir());
    for (path, text) in &launch.files {
        std::fs::create_dir_all(path.parent().unwrap()).with_context(|| format!("creating {}", path.display()))?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    if args.print_config {
        for (k, v) in &launch.env {
            println!("export {k}={}", shell_quote(v));
        }
        let command: Vec<String> = launch.args.iter().chain(harness_args).map(|a| shell_quote(a)).collect();
        println!("{program} {}", command.join(" "));
        for (path, text) in &launch.files {
            println!("\n# {}\n{text}", path.display());
        }
        return Ok(());
    }
    let status = Command::new(binary.unwrap())
        .args(&launch.args)
        .args(harness_args)
        .envs(launch.env.iter().map(|(k, v)| (k, v)))
        .status()
        .with_context(|| format!("running {program}"))?;
    drop(_server);
    std::process::exit(status.code().unwrap_or(1));
}

fn shell_quote(s: &str) -> String {
    if s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:=@".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_arguments_and_harness_arguments_are_split_at_the_double_dash() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let parse = |line: &[&str]| <Cli as clap::Parser>::try_parse_from(line).map(|c| c.args);
        let a =
            parse(&["launch", "--print-config", "codex", "--model", "m", "--port", "0", "--", "exec", "--json", "hi"])
                .unwrap();
        assert_eq!((a.harness, a.print_config), (Harness::Codex, true));
        assert_eq!(
            a.split(),
            (
                vec!["--model".into(), "m".into(), "--port".into(), "0".into()],
                vec!["exec".into(), "--json".into(), "hi".into()]
            )
        );
        let a = parse(&["launch", "pi", "--", "-p", "--no-session", "hello"]).unwrap();
        assert_eq!(a.split(), (vec![], vec!["-p".into(), "--no-session".into(), "hello".into()]));
        assert!(parse(&["launch", "vim"]).is_err());
    }

    #[test]
    fn each_harness_points_every_model_role_at_the_served_model() {
        let dir = Path::new("/cfg");
        let claude = configure(Harness::Claude, "http://h:1/", "m", Some(8192), "k", dir);
        let env: std::collections::HashMap<_, _> = claude.env.iter().cloned().collect();
        assert_eq!(env["ANTHROPIC_BASE_URL"], "http://h:1");
        for role in [
            "ANTHROPIC_MODEL",
            "ANTHROPIC_DEFAULT_OPUS_MODEL",
            "ANTHROPIC_DEFAULT_SONNET_MODEL",
            "ANTHROPIC_DEFAULT_HAIKU_MODEL",
            "ANTHROPIC_SMALL_FAST_MODEL",
        ] {
            assert_eq!(env[role], "m", "{role}");
        }
        let codex = configure(Harness::Codex, "http://h:1", "m", Some(8192), "k", dir);
        assert!(
            codex.args.contains(&"model_providers.host.base_url=\"http://h:1/v1\"".to_string()),
            "{:?}",
            codex.args
        );
        assert!(codex.args.contains(&"model_providers.host.wire_api=\"responses\"".to_string()));
        assert!(codex.files.is_empty(), "codex gets flags only");
        let opencode = configure(Harness::Opencode, "http://h:1", "m", Some(8192), "k", dir);
        let (path, text) = &opencode.files[0];
        assert!(path.starts_with(dir));
        let config: Value = serde_json::from_str(text).unwrap();
        assert_eq!(config["model"], "host/m");
        assert_eq!(config["provider"]["host"]["options"]["baseURL"], "http://h:1/v1");
        let pi = configure(Harness::Pi, "http://h:1", "m", Some(8192), "k", dir);
        assert_eq!(pi.args, ["--provider", "host", "--model", "m"]);
        assert!(pi.files[0].0.starts_with(dir));
        // The served context (8,192) and a quarter of it as the output per turn, so the
        // harness does not ask for its cloud model's 16k-128k.
        assert_eq!(env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"], "2048");
        assert!(codex.args.contains(&"model_context_window=8192".to_string()), "{:?}", codex.args);
        assert!(codex.args.contains(&"model_max_output_tokens=2048".to_string()));
        assert_eq!(
            config["provider"]["host"]["models"]["m"]["limit"],
            json!({"context": 8192, "input": 8192, "output": 2048})
        );
        let models: Value = serde_json::from_str(&pi.files[0].1).unwrap();
        assert_eq!(
            models["providers"]["host"]["models"][0],
            json!({"id": "m", "contextWindow": 8192, "maxTokens": 2048})
        );
        assert!(configure(Harness::Pi, "http://h:1", "m", None, "k", dir).files[0].1.contains("\"id\": \"m\"\n"));
        // Where each compacts: the window less a turn's output and an eighth of it
        // (8,192 - 2,048 - 1,024 = 5,120 tokens of conversation).
        assert_eq!(reserve_tokens(8192), 3072);
        assert_eq!(env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"], "8192");
        assert!(codex.args.contains(&"model_auto_compact_token_limit=5120".to_string()), "{:?}", codex.args);
        assert_eq!(config["compaction"], json!({"auto": true, "reserved": 3072, "preserve_recent_tokens": 512}));
        let (path, settings) = &pi.files[1];
        assert!(path.ends_with("pi-agent/settings.json"));
        let settings: Value = serde_json::from_str(settings).unwrap();
        assert_eq!(settings["compaction"], json!({"enabled": true, "reserveTokens": 3072, "keepRecentTokens": 2048}));
        // An unknown window leaves each harness its own defaults.
        let unknown = configure(Harness::Claude, "http://h:1", "m", None, "k", dir);
        assert!(!unknown.env.iter().any(|(k, _)| k == "CLAUDE_CODE_MAX_CONTEXT_TOKENS"));
        assert_eq!(configure(Harness::Pi, "http://h:1", "m", None, "k", dir).files.len(), 1);
        assert_eq!((output_tokens(1000), output_tokens(1 << 20)), (256, 8192));
    }
}
