//! The control connection between rank 0 and a worker: length-prefixed JSON frames (a frame
//! of length 0 is a heartbeat), the handshake's messages, and the heartbeats both ways, so a
//! rank that dies, stalls or loses its link ends the group within seconds, naming it,
//! instead of leaving the others waiting in a collective.

use super::hosts::Fingerprint;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often each side says it is alive.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(500);
/// Silence after which the other side counts as gone (a dropped link sends no FIN): well
/// past any scheduling delay of a busy machine, within seconds for a user.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest frame either side accepts (a step's JSON is a few KB).
const MAX_FRAME: usize = 64 << 20;

/// A worker's first message.
#[derive(Debug, Serialize, Deserialize)]
pub struct Hello {
    pub rank: usize,
    pub size: usize,
    /// The sha256 of the worker's binary (`hosts::binary_hash`).
    pub binary: String,
    pub version: String,
}

/// Rank 0's answer: refused (why), or what to load and the files it must match.
#[derive(Debug, Serialize, Deserialize)]
pub struct Welcome {
    pub refused: Option<String>,
    /// The model as rank 0 was given it (a path or a hub name); `None`: the default model.
    pub model: Option<String>,
    /// Rank 0's `--device`, for a worker not told one.
    pub device: String,
    pub fingerprint: Option<Fingerprint>,
    /// How the ranks split the model (pipeline stages of tensor-parallel shards).
    pub layout: super::Layout,
}

/// The worker's answer: its model files match rank 0's, or how they differ.
#[derive(Debug, Serialize, Deserialize)]
pub struct Ready {
    pub refused: Option<String>,
}

pub fn send<T: Serialize>(stream: &mut impl Write, value: &T) -> io::Result<()> {
    send_bytes(stream, &serde_json::to_vec(value).map_err(io::Error::other)?)
}

pub fn send_bytes(stream: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    stream.write_all(&frame)
}

/// The next message, past any heartbeats; `None` when the other side closed the connection
/// between frames.
pub fn receive<T: DeserializeOwned>(stream: &mut impl Read) -> io::Result<Option<T>> {
    loop {
        let mut len = [0u8; 4];
        match stream.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let len = u32::from_le_bytes(len) as usize;
        if len == 0 {
            continue;
        }
        if len > MAX_FRAME {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a {len}-byte frame (not a host rank?)")));
        }
        let mut body = vec![0u8; len];
        stream.read_exact(&mut body)?;
        return serde_json::from_slice(&body).map(Some).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e));
    }
}

/// Whether an I/O error is a read timing out.
pub fn timed_out(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Sends heartbeats on `stream` (shared with whoever else writes frames on it) while its
/// owner holds it and writes succeed: dropping the owner's `Arc` closes the connection.
pub fn send_heartbeats(stream: &Arc<Mutex<TcpStream>>) {
    let stream = Arc::downgrade(stream);
    let _ = std::thread::Builder::new().name("tp-heartbeat".into()).spawn(move || {
        while let Some(stream) = stream.upgrade() {
            if stream.lock().map_or(true, |mut s| s.write_all(&0u32.to_le_bytes()).is_err()) {
                return;
            }
            drop(stream);
            std::thread::sleep(HEARTBEAT_EVERY);
        }
    });
}

/// Rank 0's end of a worker's connection once it is admitted.
pub struct Link {
    pub rank: usize,
    /// The worker's host, as messages name it.
    pub host: String,
    writer: Arc<Mutex<TcpStream>>,
}

impl Link {
    /// Starts rank 0's heartbeats to the worker and a thread that stops this process, naming
    /// the rank and host, when the worker's stop (it exited, stalled, or the link dropped),
    /// unless `closing` says rank 0 let it go.
    pub fn start(rank: usize, host: String, stream: TcpStream, closing: &'static AtomicBool) -> io::Result<Link> {
        let mut reader = stream.try_clone()?;
        reader.set_read_timeout(Some(HEARTBEAT_TIMEOUT))?;
        let writer = Arc::new(Mutex::new(stream));
        send_heartbeats(&writer);
        let who = format!("tensor-parallel rank {rank} on {host}");
        std::thread::Builder::new().name(format!("tp-watch-{rank}")).spawn(move || {
            let why = loop {
                match receive::<serde_json::Value>(&mut reader) {
                    Ok(Some(_)) => continue,
                    Ok(None) => break "exited or closed its connection".to_string(),
                    Err(e) if timed_out(&e) => {
                        break format!(
                            "sent nothing for {} s (its process stalled, its host went down or the link dropped)",
                            HEARTBEAT_TIMEOUT.as_secs()
                        )
                    }
                    Err(e) => break format!("exited or lost its connection ({e})"),
                }
            };
            if !closing.load(Ordering::SeqCst) {
                eprintln!(
                    "host: {who} {why}; the model is split across all ranks, so this server stops. Restart every rank to recover."
                );
                std::process::exit(1);
            }
        })?;
        Ok(Link { rank, host, writer })
    }

    pub fn send_bytes(&self, body: &[u8]) -> io::Result<()> {
        let mut stream = self.writer.lock().map_err(|_| io::Error::other("a poisoned control connection"))?;
        send_bytes(&mut *stream, body)
    }
}

impl Drop for Link {
    /// Closes the connection (the watch thread's copy too): the worker's end, once rank 0
    /// has let it go.
    fn drop(&mut self) {
        if let Ok(s) = self.writer.lock() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_past_heartbeats_and_refuse_absurd_lengths() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&0u32.to_le_bytes());
        send(&mut wire, &Ready { refused: Some("config.json differs".into()) }).unwrap();
        wire.extend_from_slice(&0u32.to_le_bytes());
        let mut r = &wire[..];
        let ready: Ready = receive(&mut r).unwrap().unwrap();
        assert_eq!(ready.refused.as_deref(), Some("config.json differs"));
        assert!(receive::<Ready>(&mut r).unwrap().is_none(), "heartbeats then the end");
        let huge = (u32::MAX).to_le_bytes();
        let err = receive::<Ready>(&mut &huge[..]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    /// The heartbeat and watch threads hold the connection too: dropping the link must still
    /// close it, so the worker ends with the model that drove it.
    #[test]
    fn dropping_a_link_closes_the_connection_its_threads_share() {
        static LET_GO: AtomicBool = AtomicBool::new(true);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut worker = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        worker.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let link = Link::start(1, "test".into(), listener.accept().unwrap().0, &LET_GO).unwrap();
        link.send_bytes(br#"{"step": 1}"#).unwrap();
        drop(link);
        let first: serde_json::Value = receive(&mut worker).unwrap().unwrap();
        assert_eq!(first["step"], 1);
        assert!(receive::<serde_json::Value>(&mut worker).unwrap().is_none(), "the connection ends");
    }
}
