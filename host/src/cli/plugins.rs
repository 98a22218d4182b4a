//! `host plugins ...`: validate a plugin as the server loads it, or list what a folder holds.

use crate::plugins::abi_v1::{self, Kind};
use crate::plugins::runtime;
use crate::plugins::{new, PluginRegistry};
use anyhow::{Context, Result};
use serde_json::Value;
use std::path::PathBuf;

/// `host plugins ...`: offline validation and listing.
#[derive(Debug, clap::Subcommand)]
pub enum PluginsCommand {
    /// Validate a plugin the way the server loads it: manifest, imports, exports,
    /// compilation, its settings file (NAME.toml beside it), instantiation under the memory
    /// cap and deadline, then host_init with a config and host_begin with params.
    Check {
        file: PathBuf,
        /// The config (JSON) for host_init, as a request's `plugins` entry gives it.
        /// Default: the settings file's `config`, else `{}`.
        #[arg(long)]
        config: Option<String>,
        /// The params (JSON) for host_begin. Default: the settings file's `params`, else `{}`.
        #[arg(long)]
        params: Option<String>,
    },
    /// Show the built-in plugins and what a plugins folder holds (and why any file is refused).
    List { dir: PathBuf },
    /// Assemble a hand-written WebAssembly text plugin (.wat) into a .wasm file, keeping its
    /// `(@custom "host.plugin" ...)` manifest (which wabt's wat2wasm drops).
    BuildWat { input: PathBuf, output: PathBuf },
    /// Write a buildable plugin skeleton (source, manifest, build.sh that ends with `host
    /// plugins check`) into a new folder.
    New {
        /// The plugin's name (its manifest's): [a-z0-9][a-z0-9_-]*.
        name: String,
        /// sampler, stop, tool, reasoning or scheduler (C, Zig, AssemblyScript and WAT:
        /// sampler or stop).
        #[arg(long, value_parser = new::parse_kind)]
        kind: Kind,
        #[arg(long, value_enum)]
        lang: new::Lang,
        /// Where to write it. Default: ./NAME.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Set a module's `host.plugin` manifest (from a JSON file), replacing any it has: for
    /// toolchains that cannot emit custom sections (clang, Zig, AssemblyScript, wat2wasm).
    AddManifest {
        wasm: PathBuf,
        /// A JSON file with the manifest (ABI.md §2).
        manifest: PathBuf,
        /// Where to write the result. Default: over WASM.
        #[arg(long, short)]
        output: Option<PathBuf>,
    },
}

fn json_arg(flag: &str, text: Option<String>) -> Result<Option<Value>> {
    text.map(|t| serde_json::from_str(&t).with_context(|| format!("--{flag} is not valid JSON: {t}"))).transpose()
}

pub fn run_command(command: PluginsCommand) -> Result<()> {
    let registry = if matches!(command, PluginsCommand::List { .. }) {
        PluginRegistry::with_builtins()?
    } else {
        PluginRegistry::new()?
    };
    match command {
        PluginsCommand::Check { file, config, params } => {
            let (config, params) = (json_arg("config", config)?, json_arg("params", params)?);
            let plugin = registry.load_file(&file)?;
            let m = &plugin.manifest;
            let kinds: Vec<String> = m.kinds.iter().map(Kind::to_string).collect();
            println!(
                "ok: {} {} (ABI v{}), kinds: {}, sha256 {}",
                m.name,
                m.version,
                m.abi,
                kinds.join(", "),
                plugin.sha256
            );
            let s = &plugin.settings;
            println!(
                "limits: deadline {} ms of CPU time per call, memory {} MiB, quarantine {} s",
                s.deadline_ms, s.memory_mib, s.quarantine_secs
            );
            let given = config.is_some() || s.config.is_some();
            let config = config.or_else(|| s.config.clone()).unwrap_or_else(|| serde_json::json!({}));
            let mut instance = match registry.runtime().instantiate(&plugin, &config) {
                Ok(instance) => instance,
                Err(e) if !given && e.downcast_ref::<runtime::PluginRefused>().is_some() => {
                    println!("note: {e:#}; requests must give it a config: check one with --config JSON");
                    return Ok(());
                }
                Err(e) => return Err(e),
            };
            println!("host_init: accepted {config}");
            let params = params.or_else(|| s.params.clone()).unwrap_or_else(|| serde_json::json!({}));
            instance.begin(&params, 0)?;
            println!("host_begin: accepted {params}");
            Ok(())
        }
        PluginsCommand::BuildWat { input, output } => {
            let wasm = wat::parse_file(&input).map_err(|e| anyhow::anyhow!("{}: {e}", input.display()))?;
            std::fs::write(&output, wasm).with_context(|| format!("writing {}", output.display()))?;
            Ok(())
        }
        PluginsCommand::New { name, kind, lang, dir } => {
            let dir = dir.unwrap_or_else(|| PathBuf::from(&name));
            let written = new::write(&name, kind, lang, &dir)?;
            println!("wrote {}: {}", dir.display(), written.join(", "));
            println!(
                "next: {}/build.sh (it builds {name}.wasm and runs host plugins check), then copy {name}.wasm into the server's plugins folder",
                dir.display()
            );
            Ok(())
        }
        PluginsCommand::AddManifest { wasm, manifest, output } => {
            let module = std::fs::read(&wasm).with_context(|| format!("reading {}", wasm.display()))?;
            let json = std::fs::read_to_string(&manifest).with_context(|| format!("reading {}", manifest.display()))?;
            let out = abi_v1::with_manifest(&module, &json).with_context(|| manifest.display().to_string())?;
            let output = output.unwrap_or(wasm);
            std::fs::write(&output, out).with_context(|| format!("writing {}", output.display()))?;
            Ok(())
        }
        PluginsCommand::List { dir } => {
            registry.load_dir(&dir)?;
            for s in registry.status() {
                let kinds: Vec<String> = s.kinds.iter().map(Kind::to_string).collect();
                match &s.error {
                    Some(e) if s.state == "refused" => println!("{:<24} refused: {e} ({})", s.name, s.source),
                    _ => println!("{:<24} {:<10} {:<16} {}", s.name, s.version, kinds.join(","), s.source),
                }
            }
            Ok(())
        }
    }
}
