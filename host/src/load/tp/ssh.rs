//! Starting a hostfile's other ranks over ssh, as `mlx.launch` does: for each host after the
//! first, `ssh -o BatchMode=yes NAME 'BINARY' tp-worker --hosts 'JSON' --rank R ...`, NAME
//! the host's "ssh" entry (else its first address) and BINARY this binary's own path, which
//! every host must have. `HOST_SSH` replaces `ssh` (with options, split at spaces: a key, a
//! port, a user). The workers' errors come out on this process's stderr.

use super::hosts::Hostfile;
use anyhow::{Context, Result};
use std::process::{Child, Command, Stdio};

/// Starts ranks 1.. of `h`; returns each rank's ssh process.
pub fn launch(h: &Hostfile, port: u16) -> Result<Vec<(usize, Child)>> {
    let exe = std::env::current_exe().context("finding the host binary to start the ranks with")?;
    let ssh = std::env::var("HOST_SSH").unwrap_or_else(|_| "ssh".into());
    let mut ssh = ssh.split_whitespace();
    let program = ssh.next().context("HOST_SSH is empty")?.to_string();
    let options: Vec<String> = ssh.map(String::from).collect();
    let json = h.to_json();
    let mut children = Vec::new();
    for (rank, host) in h.hosts.iter().enumerate().skip(1) {
        let name = host.ssh.clone().unwrap_or_else(|| host.ips[0].to_string());
        let remote = [
            quote(&exe.to_string_lossy()),
            "tp-worker".into(),
            "--hosts".into(),
            quote(&json),
            "--rank".into(),
            rank.to_string(),
            "--starting-port".into(),
            port.to_string(),
        ]
        .join(" ");
        let child = Command::new(&program)
            .args(&options)
            .args(["-o", "BatchMode=yes", &name, &remote])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting rank {rank} on {} with `{program}`", host.describe()))?;
        children.push((rank, child));
    }
    Ok(children)
}

/// `s` as one word of a POSIX shell command line (the remote side of ssh runs one).
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn quoting_survives_the_remote_shell() {
        let word = r#"{"envs": ["A=it's"], "x": "$HOME `id` \"q\""}"#;
        let out = std::process::Command::new("sh").args(["-c", &format!("printf %s {}", super::quote(word))]).output();
        assert_eq!(String::from_utf8(out.unwrap().stdout).unwrap(), word);
    }
}
