//! Issue 44: models by their hub names, downloaded with `host pull` (the `hf-hub` client)
//! from a local HTTP server that answers the hub's own URLs (`HF_ENDPOINT`): the file list
//! (`/api/models/ORG/NAME/revision/REV`) and each file (`/ORG/NAME/resolve/REV/FILE`, with
//! `Range`, `x-repo-commit`, `etag`/`x-linked-etag` as the hub sends them). The real hub is
//! not reachable from these machines; this server stands in for it. The model is a tiny one
//! the test writes (no fixtures).

use super::common::{OutputWithin, HANG};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// What the server holds and what it saw.
#[derive(Default)]
struct Hub {
    /// repo -> file -> (bytes, etag as sent: a sha256 for weights, else a git-like sha1).
    repos: HashMap<String, HashMap<String, (Vec<u8>, String)>>,
    /// Cut the next full download of this file halfway (once).
    cut: Option<String>,
    /// (file, first byte asked for) of each body request.
    ranges: Vec<(String, u64)>,
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn respond(stream: &mut TcpStream, status: &str, headers: &[(String, String)], body: &[u8]) {
    let mut head = format!("HTTP/1.1 {status}\r\nconnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(body);
}

fn serve(hub: Arc<Mutex<Hub>>, mut stream: TcpStream) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut request = String::new();
    if reader.read_line(&mut request).is_err() {
        return;
    }
    let mut range = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("range: bytes=") {
            let (from, to) = v.trim().split_once('-').unwrap_or((v.trim(), ""));
            range = Some((from.parse::<u64>().unwrap_or(0), to.parse::<u64>().ok()));
        }
    }
    let path = request.split_whitespace().nth(1).unwrap_or("/").to_string();
    let mut hub = hub.lock().unwrap();
    let json = |v: serde_json::Value| (vec![("content-type".into(), "application/json".into())], v.to_string());
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let (repo, revision) = rest.split_once("/revision/").unwrap_or((rest, "main"));
        match hub.repos.get(repo).filter(|_| revision == "main" || revision == COMMIT) {
            Some(files) => {
                let mut names: Vec<&String> = files.keys().collect();
                names.sort();
                let siblings: Vec<serde_json::Value> = names
                    .iter()
                    .map(|n| serde_json::json!({"rfilename": n}))
                    .chain([serde_json::json!({"rfilename": "README.md"})])
                    .collect();
                let (headers, body) = json(serde_json::json!({"id": repo, "sha": COMMIT, "siblings": siblings}));
                respond(&mut stream, "200 OK", &headers, body.as_bytes());
            }
            None => respond(&mut stream, "404 Not Found", &[], b"{\"error\": \"Repository not found\"}"),
        }
        return;
    }
    // /ORG/NAME/resolve/REV/FILE
    let parts: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    let found = match parts.as_slice() {
        [org, name, "resolve", _rev, file] => {
            hub.repos.get(&format!("{org}/{name}")).and_then(|r| r.get(*file)).cloned().map(|f| (file.to_string(), f))
        }
        _ => None,
    };
    let Some((file, (bytes, etag))) = found else {
        respond(&mut stream, "404 Not Found", &[], b"Entry not found");
        return;
    };
    let size = bytes.len() as u64;
    let (from, to) = range.unwrap_or((0, None));
    let to = to.unwrap_or(size - 1).min(size - 1);
    let body = &bytes[from as usize..=to as usize];
    let mut headers = vec![
        ("x-repo-commit".to_string(), COMMIT.to_string()),
        ("content-range".to_string(), format!("bytes {from}-{to}/{size}")),
        ("content-length".to_string(), body.len().to_string()),
        ("accept-ranges".to_string(), "bytes".to_string()),
    ];
    if etag.len() == 64 {
        headers.push(("x-linked-etag".into(), format!("\"{etag}\"")));
        headers.push(("x-linked-size".into(), size.to_string()));
    }
    headers.push(("etag".into(), format!("\"{etag}\"")));
    let probe = range == Some((0, Some(0)));
    if !probe {
        hub.ranges.push((file.clone(), from));
    }
    if !probe && from == 0 && hub.cut.as_deref() == Some(file.as_str()) {
        // A connection that drops halfway: the headers promise the whole body.
        hub.cut = None;
        respond(&mut stream, "206 Partial Content", &headers, &body[..body.len() / 2]);
        let _ = stream.shutdown(std::net::Shutdown::Both);
        return;
    }
    respond(&mut stream, "206 Partial Content", &headers, body);
}

/// A hub on 127.0.0.1 holding `repos`; returns its endpoint and state.
fn start(hub: Hub) -> (String, Arc<Mutex<Hub>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let hub = Arc::new(Mutex::new(hub));
    let shared = hub.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let hub = shared.clone();
            std::thread::spawn(move || serve(hub, stream));
        }
    });
    (endpoint, hub)
}

/// The files of a tiny model folder, as the hub would list them.
fn repo_files(dir: &Path, corrupt: bool) -> HashMap<String, (Vec<u8>, String)> {
    let mut files = HashMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let mut bytes = std::fs::read(&path).unwrap();
        let etag = if name.ends_with(".safetensors") {
            let etag = sha256(&bytes);
            if corrupt {
                let n = bytes.len();
                bytes[n / 2] ^= 0xff;
            }
            etag
        } else {
            sha256(&bytes)[..40].to_string()
        };
        files.insert(name, (bytes, etag));
    }
    files
}

fn host(endpoint: &str, cache: &Path, args: &[&str], offline: bool) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_host"));
    cmd.args(args).env("HF_ENDPOINT", endpoint).env("HF_HUB_CACHE", cache).env_remove("HF_TOKEN");
    if offline {
        cmd.env("HF_HUB_OFFLINE", "1");
    } else {
        cmd.env_remove("HF_HUB_OFFLINE");
    }
    cmd.output_within(HANG)
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// `host pull` fetches a model into the hub's cache layout, showing progress; a download cut
/// halfway resumes from where it stopped; the model then serves offline by its name. A bad
/// name, a missing model, a missing revision and a corrupt file each get their own error; a
/// name the cache lacks under HF_HUB_OFFLINE says how to fetch it.
#[test]
fn host_pull_fetches_resumes_and_the_model_then_runs_offline_by_its_name() {
    let dir = std::env::temp_dir().join(format!("host-hub-model-{}", std::process::id()));
    models::testing::write_model(&dir, "llama", 3).unwrap();
    let cache = std::env::temp_dir().join(format!("host-hub-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let mut hub = Hub::default();
    hub.repos.insert("org/tiny".into(), repo_files(&dir, false));
    hub.repos.insert("org/corrupt".into(), repo_files(&dir, true));
    hub.cut = Some("model.safetensors".into());
    let (endpoint, hub) = start(hub);
    let pull = |name: &str| host(&endpoint, &cache, &["pull", name], false);

    // Cut halfway: the pull fails, and the next one resumes at the bytes the first kept.
    let first = pull("org/tiny");
    assert!(!first.status.success(), "the cut download should fail: {}", text(&first));
    assert!(!text(&first).contains("resuming"), "a fresh download is not a resumed one: {}", text(&first));
    assert!(text(&first).contains("model.safetensors"), "{}", text(&first));
    let second = pull("org/tiny");
    assert!(second.status.success(), "{}", text(&second));
    let log = text(&second);
    assert!(log.contains("resuming at") && log.contains("MB ("), "progress and the resume are shown: {log}");
    let resumed: Vec<u64> =
        hub.lock().unwrap().ranges.iter().filter(|(f, _)| f == "model.safetensors").map(|&(_, from)| from).collect();
    assert_eq!(resumed.len(), 2);
    assert!(resumed[0] == 0 && resumed[1] > 0, "the second download asked for the rest only: {resumed:?}");
    let snapshot = cache.join(format!("models--org--tiny/snapshots/{COMMIT}"));
    assert_eq!(String::from_utf8_lossy(&second.stdout).trim(), snapshot.to_string_lossy());
    assert_eq!(std::fs::read_to_string(cache.join("models--org--tiny/refs/main")).unwrap().trim(), COMMIT);
    let weights = std::fs::read(snapshot.join("model.safetensors")).unwrap();
    assert_eq!(weights, std::fs::read(dir.join("model.safetensors")).unwrap());
    assert!(!snapshot.join("README.md").exists(), "only what a model folder needs");
    // Pulled again: nothing is downloaded.
    let before = hub.lock().unwrap().ranges.len();
    assert!(pull("org/tiny").status.success());
    assert_eq!(hub.lock().unwrap().ranges.len(), before);

    // Offline, by its name: the cache serves it.
    let run = host(
        &endpoint,
        &cache,
        &["generate", "--model", "org/tiny", "--device", "cpu", "--prompt", "hi", "--max-tokens", "3", "--json"],
        true,
    );
    assert!(run.status.success(), "{}", text(&run));
    // Offline, a name the cache lacks: which one, and how to fetch it.
    let absent =
        host(&endpoint, &cache, &["generate", "--model", "org/absent", "--device", "cpu", "--prompt", "hi"], true);
    let msg = text(&absent);
    assert!(!absent.status.success() && msg.contains("org/absent") && msg.contains("host pull org/absent"), "{msg}");
    assert!(msg.contains("HF_HUB_OFFLINE"), "{msg}");

    // Each mistake its own error.
    let bad = text(&pull("org/bad name"));
    assert!(bad.contains("not a model name"), "{bad}");
    let missing = text(&pull("org/missing"));
    assert!(missing.contains("no model org/missing") && missing.contains("404"), "{missing}");
    let revision = text(&pull("org/tiny@nope"));
    assert!(revision.contains("\"nope\""), "{revision}");
    let corrupt = pull("org/corrupt");
    let msg = text(&corrupt);
    assert!(!corrupt.status.success() && msg.contains("arrived corrupt") && msg.contains("model.safetensors"), "{msg}");
    assert!(!cache.join(format!("models--org--corrupt/snapshots/{COMMIT}/model.safetensors")).exists());

    // Not offline, a model the cache lacks is fetched when first named.
    let fetched = host(
        &endpoint,
        &cache.join("other"),
        &["generate", "--model", "org/tiny", "--device", "cpu", "--prompt", "hi", "--max-tokens", "2", "--json"],
        false,
    );
    assert!(fetched.status.success(), "{}", text(&fetched));
    assert!(text(&fetched).contains("downloading it"), "{}", text(&fetched));
    let _ = std::fs::remove_dir_all(&cache);
    let _ = std::fs::remove_dir_all(&dir);
}
