//! Where the ranks run and what they run: MLX's hostfile (as `mlx.launch` reads it), the
//! addresses and ports the ranks derive from it, and the identity of a rank's binary and
//! model files, which rank 0 checks before the group forms.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

/// The port the ranks listen on from (the first rank's first address; one more per rank and
/// address after it), as `mlx.launch --starting-port`.
pub const STARTING_PORT: u16 = 32323;

/// A hostfile in MLX's format: a list of hosts, or an object with `hosts` (and optionally
/// `backend` and `envs`), each host `{"ssh": "name", "ips": ["address", ...]}`. Host i runs
/// rank i; rank 0 is `host serve`.
#[derive(Debug, Clone)]
pub struct Hostfile {
    pub path: PathBuf,
    pub hosts: Vec<Host>,
    /// The distributed backend the file names (`ring`, `nccl`), if any.
    pub backend: Option<String>,
    /// `KEY=VALUE` settings every rank's environment gets.
    pub envs: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Host {
    /// The name `ssh` reaches it by (informational: the host does not log in anywhere).
    pub ssh: Option<String>,
    /// The addresses the ranks talk over; the ring backend listens on each.
    pub ips: Vec<IpAddr>,
}

impl Host {
    /// How messages name the host: its ssh name and first address.
    pub fn describe(&self) -> String {
        let ip = self.ips.first().map(IpAddr::to_string).unwrap_or_default();
        match &self.ssh {
            Some(name) if name != &ip => format!("{name} ({ip})"),
            _ => ip,
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum FileForm {
    List(Vec<HostEntry>),
    Object {
        hosts: Vec<HostEntry>,
        #[serde(default)]
        backend: Option<String>,
        #[serde(default)]
        envs: Vec<String>,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HostEntry {
    #[serde(default)]
    ssh: Option<String>,
    #[serde(default)]
    ips: Vec<String>,
    /// JACCL's RDMA devices: read so MLX's files load, not used.
    #[serde(default)]
    #[allow(dead_code)]
    rdma: Option<serde_json::Value>,
}

impl Hostfile {
    pub fn read(path: &Path) -> Result<Hostfile> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading the hostfile {}", path.display()))?;
        Self::parse(&text, path).with_context(|| format!("the hostfile {}", path.display()))
    }

    pub fn parse(text: &str, path: &Path) -> Result<Hostfile> {
        const FORM: &str = r#"expected MLX's hostfile form: [{"ssh": "mac1", "ips": ["192.168.1.10"]}, {"ssh": "mac2", "ips": ["192.168.1.11"]}]"#;
        let form: FileForm = serde_json::from_str(text).map_err(|e| anyhow::anyhow!("{e}; {FORM}"))?;
        let (entries, backend, envs) = match form {
            FileForm::List(hosts) => (hosts, None, Vec::new()),
            FileForm::Object { hosts, backend, envs } => (hosts, backend, envs),
        };
        if entries.len() < 2 {
            bail!("it lists {} host(s); a model split over hosts needs at least 2 ({FORM})", entries.len());
        }
        let mut hosts = Vec::with_capacity(entries.len());
        for (rank, entry) in entries.into_iter().enumerate() {
            if entry.ips.is_empty() {
                bail!(
                    "host {rank} ({}) has no \"ips\": the ranks talk over IP addresses, so list the address each host is reached at",
                    entry.ssh.as_deref().unwrap_or("unnamed")
                );
            }
            let ips = entry
                .ips
                .iter()
                .map(|ip| ip.parse::<IpAddr>().map_err(|_| anyhow::anyhow!("host {rank}: {ip:?} is not an IP address")))
                .collect::<Result<Vec<_>>>()?;
            hosts.push(Host { ssh: entry.ssh, ips });
        }
        let envs = envs
            .iter()
            .map(|e| match e.split_once('=') {
                Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
                _ => bail!("\"envs\" holds {e:?}; each entry is KEY=VALUE"),
            })
            .collect::<Result<_>>()?;
        if let Some(b) = backend.as_deref().filter(|b| !["ring", "nccl", ""].contains(b)) {
            bail!(
                "backend {b:?} is not one the host runs over; use \"ring\" (TCP, any device) or \"nccl\" (NVIDIA GPUs)"
            );
        }
        Ok(Hostfile { path: path.to_path_buf(), hosts, backend: backend.filter(|b| !b.is_empty()), envs })
    }

    /// The file in MLX's object form, for a rank started elsewhere (`tp-worker --hosts`).
    pub fn to_json(&self) -> String {
        let hosts: Vec<serde_json::Value> = self
            .hosts
            .iter()
            .map(|h| serde_json::json!({"ssh": h.ssh, "ips": h.ips.iter().map(IpAddr::to_string).collect::<Vec<_>>()}))
            .collect();
        let envs: Vec<String> = self.envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        serde_json::json!({"backend": self.backend.clone().unwrap_or_default(), "envs": envs, "hosts": hosts})
            .to_string()
    }

    /// Where the ranks listen from `starting_port` (what every rank derives alike from the
    /// same file and port); refused when the ports would run past 65535.
    pub fn ports(&self, starting_port: u16) -> Result<Ports> {
        let addresses: usize = self.hosts.iter().map(|h| h.ips.len()).sum();
        // The ring's ports, then rank 0's control port and NCCL's.
        if starting_port as usize + addresses + 2 > 1 << 16 {
            bail!(
                "--starting-port {starting_port}: the {} ranks need {} ports from it, past 65535; choose a lower one",
                self.hosts.len(),
                addresses + 2
            );
        }
        let mut port = starting_port;
        let mut ring = Vec::new();
        for host in &self.hosts {
            let mut node = Vec::new();
            for ip in &host.ips {
                node.push(SocketAddr::new(*ip, port).to_string());
                port += 1;
            }
            ring.push(node);
        }
        let rank0 = self.hosts[0].ips[0];
        Ok(Ports { ring, control: SocketAddr::new(rank0, port), nccl: SocketAddr::new(rank0, port + 1) })
    }

    /// Sets the file's `envs` in this process's environment (every rank's, before MLX starts).
    pub fn apply_envs(&self) {
        for (k, v) in &self.envs {
            std::env::set_var(k, v);
        }
    }
}

/// The addresses a hostfile's ranks use.
#[derive(Debug, PartialEq)]
pub struct Ports {
    /// The ring backend's own hostfile: each rank's listening `ip:port`s, ports from the
    /// starting port up by one per rank and address (what `mlx.launch` writes).
    pub ring: Vec<Vec<String>>,
    /// Where rank 0 takes the workers' control connections: its first address, on the port
    /// after the ring's.
    pub control: SocketAddr,
    /// NCCL's rendezvous: the port after that.
    pub nccl: SocketAddr,
}

/// The sha256 of the running binary: every rank must run the same build, since the ranks'
/// forwards and cache operations must match op for op.
pub fn binary_hash() -> Result<String> {
    crate::load::pull::sha256_file(&std::env::current_exe().context("finding the host binary")?)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What identifies a model's files without reading all their bytes: `config.json` whole,
/// and each weights file's size and header (a safetensors file's JSON header, which names
/// every tensor, its type, shape and offsets; a GGUF file's first MiB, its metadata and
/// tensor table). Two hosts' copies of one model have equal fingerprints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// (file, size in bytes, sha256 of what identifies it), sorted by file.
    pub files: Vec<(String, u64, String)>,
}

/// Files a model folder's fingerprint covers.
fn counts(name: &str) -> bool {
    name == "config.json" || name.ends_with(".safetensors") || name.ends_with(".gguf")
}

impl Fingerprint {
    pub fn of(model: &Path) -> Result<Fingerprint> {
        let mut files = Vec::new();
        if model.is_dir() {
            let entries = std::fs::read_dir(model).with_context(|| format!("listing {}", model.display()))?;
            for entry in entries {
                let path = entry?.path();
                let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                if counts(&name) {
                    files.push((name, Self::size(&path)?, Self::identify(&path)?));
                }
            }
        } else {
            // A lone GGUF file: its name may differ between hosts, its bytes may not.
            files.push(("the GGUF file".to_string(), Self::size(model)?, Self::identify(model)?));
        }
        files.sort();
        Ok(Fingerprint { files })
    }

    fn size(path: &Path) -> Result<u64> {
        Ok(std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?.len())
    }

    fn identify(path: &Path) -> Result<String> {
        let mut file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
        let name = path.to_string_lossy();
        let mut head = Vec::new();
        if name.ends_with(".safetensors") {
            let mut len = [0u8; 8];
            file.read_exact(&mut len)
                .with_context(|| format!("{}: shorter than a safetensors header", path.display()))?;
            // The header's length is what the file says, capped: a corrupt length must not
            // make this read gigabytes.
            let n = u64::from_le_bytes(len).min(100 << 20);
            head.extend_from_slice(&len);
            file.take(n).read_to_end(&mut head)?;
        } else if name.ends_with(".json") {
            file.read_to_end(&mut head)?;
        } else {
            file.take(1 << 20).read_to_end(&mut head)?;
        }
        Ok(hex(&Sha256::digest(&head)))
    }

    /// What differs between this rank's files (`self`) and `other`'s, in words; `None` when
    /// they are the same.
    pub fn difference(&self, other: &Fingerprint, other_name: &str) -> Option<String> {
        if self == other {
            return None;
        }
        let mut diffs = Vec::new();
        for (name, size, hash) in &self.files {
            match other.files.iter().find(|(n, _, _)| n == name) {
                None => diffs.push(format!("{name} is missing on {other_name}")),
                Some((_, s, _)) if s != size => {
                    diffs.push(format!("{name} is {size} bytes on rank 0 but {s} on {other_name}"))
                }
                Some((_, _, h)) if h != hash => diffs.push(format!("{name} differs in content on {other_name}")),
                Some(_) => {}
            }
        }
        for (name, _, _) in &other.files {
            if !self.files.iter().any(|(n, _, _)| n == name) {
                diffs.push(format!("{name} is on {other_name} but not on rank 0"));
            }
        }
        Some(diffs.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostfiles_in_both_of_mlx_s_forms_give_mlx_launch_s_ring_ports() {
        let list = r#"[{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2", "10.0.1.2"]}]"#;
        let file = Hostfile::parse(list, Path::new("h.json")).unwrap();
        assert_eq!(file.hosts.len(), 2);
        assert_eq!(file.hosts[1].describe(), "mac2 (10.0.0.2)");
        let ports = file.ports(32323).unwrap();
        assert_eq!(ports.ring, vec![vec!["10.0.0.1:32323"], vec!["10.0.0.2:32324", "10.0.1.2:32325"]]);
        assert_eq!(ports.control.to_string(), "10.0.0.1:32326");
        assert_eq!(ports.nccl.to_string(), "10.0.0.1:32327");
        assert_eq!(file.ports(65531).unwrap().nccl.port(), 65535);
        let err = file.ports(65532).unwrap_err().to_string();
        assert!(err.contains("need 5 ports from it, past 65535"), "{err}");
        let object = r#"{"backend": "ring", "envs": ["MLX_RING_VERBOSE=1"], "hosts": [{"ssh": "a", "ips": ["::1"]}, {"ips": ["10.0.0.2"], "rdma": [null]}]}"#;
        let file = Hostfile::parse(object, Path::new("h.json")).unwrap();
        assert_eq!(file.backend.as_deref(), Some("ring"));
        assert_eq!(file.envs, vec![("MLX_RING_VERBOSE".to_string(), "1".to_string())]);
        assert_eq!(file.ports(40000).unwrap().ring[0], vec!["[::1]:40000"]);
        let again = Hostfile::parse(&file.to_json(), Path::new("again")).unwrap();
        assert_eq!((again.hosts, again.backend, again.envs), (file.hosts, file.backend, file.envs));
    }

    #[test]
    fn a_bad_hostfile_says_what_is_wrong() {
        let err = |text: &str| format!("{:#}", Hostfile::parse(text, Path::new("h.json")).unwrap_err());
        assert!(err(r#"[{"ssh": "a", "ips": ["10.0.0.1"]}]"#).contains("at least 2"));
        assert!(err(r#"[{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b"}]"#).contains("host 1 (b) has no \"ips\""));
        assert!(
            err(r#"[{"ips": ["10.0.0.1"]}, {"ips": ["mac2.local"]}]"#).contains("\"mac2.local\" is not an IP address")
        );
        assert!(err("{not json").contains("expected MLX's hostfile form"));
        assert!(
            err(r#"{"backend": "mpi", "hosts": [{"ips": ["10.0.0.1"]}, {"ips": ["10.0.0.2"]}]}"#).contains("\"mpi\"")
        );
        assert!(err(r#"{"envs": ["NOEQUALS"], "hosts": [{"ips": ["10.0.0.1"]}, {"ips": ["10.0.0.2"]}]}"#)
            .contains("KEY=VALUE"));
    }

    #[test]
    fn fingerprints_name_the_file_that_differs() {
        let dir = std::env::temp_dir().join(format!("host-fingerprint-{}", std::process::id()));
        let (a, b) = (dir.join("a"), dir.join("b"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for d in [&a, &b] {
            std::fs::create_dir(d).unwrap();
            std::fs::write(d.join("config.json"), "{\"hidden_size\": 8}").unwrap();
            // A safetensors file: 8-byte header length, the header, then the data.
            let header = br#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
            let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(header);
            bytes.extend_from_slice(&[0u8; 8]);
            std::fs::write(d.join("model.safetensors"), bytes).unwrap();
            std::fs::write(d.join("README.md"), "not counted").unwrap();
        }
        std::fs::write(b.join("README.md"), "another readme").unwrap();
        let (fa, fb) = (Fingerprint::of(&a).unwrap(), Fingerprint::of(&b).unwrap());
        assert_eq!(fa.difference(&fb, "rank 1"), None);
        std::fs::write(b.join("config.json"), "{\"hidden_size\": 16}").unwrap();
        let fb = Fingerprint::of(&b).unwrap();
        assert_eq!(fa.difference(&fb, "rank 1").unwrap(), "config.json is 18 bytes on rank 0 but 19 on rank 1");
        std::fs::write(b.join("config.json"), "{\"hidden_size\": 9}").unwrap();
        std::fs::remove_file(b.join("model.safetensors")).unwrap();
        let diff = fa.difference(&Fingerprint::of(&b).unwrap(), "rank 1").unwrap();
        assert_eq!(diff, "config.json differs in content on rank 1; model.safetensors is missing on rank 1");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
