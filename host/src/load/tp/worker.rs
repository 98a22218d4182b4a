//! `host tp-worker`: one rank of a tensor-parallel group other than rank 0. Launched by rank 0
//! on its own machine (`--size`, `--control`, `--parent`), or started by hand on a host of a
//! hostfile (`--hostfile FILE --rank R`): it connects to rank 0 (waiting for it to start),
//! is admitted after the handshake, joins the group, loads its shard and runs every step rank
//! 0 sends, mirroring rank 0's caches by id.

use super::hosts::{self, Fingerprint, Hostfile, STARTING_PORT};
use super::link::{self, Hello, Ready, Welcome, HEARTBEAT_TIMEOUT};
use super::{backend, rank_env, share_tokens, write_ring, ToWorker, HANDSHAKE_TIMEOUT, JOIN_TIMEOUT};
use crate::load::{default_model, pull, select_device, DeviceChoice};
use anyhow::{bail, Context, Result};
use mlx::distributed::Group;
use mlx::{Array, Dtype};
use models::cache::CacheOp;
use models::{BatchKvCache, KvCache};
use std::collections::{HashMap, HashSet};
use std::io::ErrorKind;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a worker whose rank 0 closed the connection lets its last step finish before it
/// exits anyway (a step whose collective waits for a rank that is gone never finishes).
const EXIT_GRACE: Duration = Duration::from_secs(5);

/// `host tp-worker`: one rank of a tensor-parallel group.
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    /// This worker's rank: its host's place in the hostfile, counting from 0 (rank 0 is
    /// `host serve --hostfile`).
    #[arg(long)]
    pub rank: usize,
    /// MLX's hostfile, the same file rank 0 reads.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["size", "control", "hosts"])]
    pub hostfile: Option<PathBuf>,
    /// The hostfile's text itself (how rank 0's `--ssh-launch` passes it).
    #[arg(long, value_name = "JSON", conflicts_with_all = ["size", "control"])]
    pub hosts: Option<String>,
    /// The port the ranks listen on from: the same as rank 0's (default 32323).
    #[arg(long)]
    pub starting_port: Option<u16>,
    /// The model's files on this host (default: what rank 0 serves, by the same path or hub
    /// name). Checked against rank 0's before the group forms.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Default: rank 0's.
    #[arg(long, value_enum)]
    pub device: Option<DeviceChoice>,
    /// Launched by rank 0: the group's size.
    #[arg(long, hide = true)]
    pub size: Option<usize>,
    /// Launched by rank 0: its control address.
    #[arg(long, hide = true)]
    pub control: Option<String>,
    /// Launched by rank 0: its process id (default: this process's parent when it starts).
    #[arg(long, hide = true)]
    pub parent: Option<u32>,
}

/// Runs a worker rank until rank 0 goes away.
pub fn worker(args: WorkerArgs) -> Result<()> {
    let rank = args.rank;
    let hostfile = match (&args.hostfile, &args.hosts) {
        (Some(path), _) => Some(Hostfile::read(path)?),
        (None, Some(text)) => Some(Hostfile::parse(text, Path::new("--hosts")).context("--hosts")?),
        (None, None) => None,
    };
    let (size, control, hosts) = match hostfile {
        Some(h) => {
            let n = h.hosts.len();
            if rank == 0 || rank >= n {
                bail!(
                    "--rank {rank}: the hostfile lists {n} hosts, so workers are ranks 1 to {} (rank 0 is `host serve --hostfile` on {})",
                    n - 1,
                    h.hosts[0].describe()
                );
            }
            h.apply_envs();
            let ports = h.ports(args.starting_port.unwrap_or(STARTING_PORT))?;
            rank_env(None, rank, n, &write_ring(&ports.ring)?, &ports.nccl.to_string());
            (n, ports.control.to_string(), Some(h))
        }
        None => {
            let size = args.size.context("tp-worker needs --hostfile FILE (the ranks' hosts, as rank 0's)")?;
            (size, args.control.clone().context("tp-worker needs --hostfile FILE")?, None)
        }
    };
    // Launched by rank 0: until admitted, rank 0's end is seen by its process going away.
    let admitted =
        hosts.is_none().then(|| exit_with_parent(rank, args.parent.unwrap_or_else(std::os::unix::process::parent_id)));
    let binary = if hosts.is_some() { hosts::binary_hash()? } else { String::new() };
    let stream = connect(rank, &control)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut s = &stream;
    let hello = Hello { rank, size, binary, version: env!("CARGO_PKG_VERSION").to_string() };
    link::send(&mut s, &hello).with_context(|| format!("greeting rank 0 at {control}"))?;
    let welcome: Welcome = link::receive(&mut s)
        .with_context(|| format!("waiting for rank 0 at {control} to answer"))?
        .with_context(|| format!("rank 0 at {control} closed the connection before answering"))?;
    if let Some(why) = welcome.refused {
        bail!("rank 0 refused this worker: {why}");
    }
    let device = match args.device {
        Some(d) => d,
        None => clap::ValueEnum::from_str(&welcome.device, true)
            .map_err(|e| anyhow::anyhow!("rank 0's device {:?}: {e}", welcome.device))?,
    };
    let model = match (&args.model, &welcome.model) {
        (Some(m), _) => pull::resolve_model_arg(m)?,
        (None, Some(m)) => pull::resolve_model_arg(Path::new(m))
            .with_context(|| format!("rank 0 serves {m}; pass --model PATH to name this host's copy"))?,
        (None, None) => default_model::ensure()?,
    };
    let refused = match (&welcome.fingerprint, Fingerprint::of(&model)) {
        (Some(theirs), Ok(mine)) => theirs.difference(&mine, &format!("rank {rank}")).map(|d| {
            format!(
                "its model files ({}) are not rank 0's: {d}; give every rank a copy of the same model",
                model.display()
            )
        }),
        (_, Err(e)) => Some(format!("reading its model {}: {e:#}", model.display())),
        (None, Ok(_)) => None,
    };
    link::send(&mut s, &Ready { refused: refused.clone() })?;
    if let Some(why) = refused {
        bail!("{why}");
    }
    // From here both sides send heartbeats, and the orders come through a reader thread that
    // ends this process if rank 0 falls silent.
    if let Some(flag) = &admitted {
        flag.store(true, Ordering::SeqCst);
    }
    let heartbeats = Arc::new(Mutex::new(stream.try_clone()?));
    link::send_heartbeats(&heartbeats);
    let orders = read_orders(rank, stream, control.clone())?;
    match orders.recv() {
        Ok(ToWorker::Go) => {}
        _ => bail!("rank 0 at {control} closed the connection before the group formed (its error is in its log)"),
    }
    let device = select_device(device)?;
    let group: Group = mlx::distributed::init(backend(device, hosts.as_ref()))
        .with_context(|| format!("rank {rank} joining the tensor-parallel group"))?;
    if group.rank != rank || group.size != size {
        bail!("joined as rank {} of {}, expected {rank} of {size}", group.rank, group.size);
    }
    // Rank 0 admitted this worker for a group of `size` ranks: its layout's.
    let layout = welcome.layout;
    let loaded = models::load_with(&model, &layout.options(rank))
        .with_context(|| format!("rank {rank} loading {}", model.display()))?;
    // The first stage's shards are the highest ranks: the ids come to the highest from rank
    // 0 (its neighbour in the ring), and each passes them on to the next below.
    let inputs = match layout.pipeline() {
        false => Inputs::Shared,
        true if rank >= size - layout.shards => Inputs::Passed {
            from: if rank + 1 == size { 0 } else { rank + 1 },
            to: (rank > size - layout.shards).then(|| rank - 1),
        },
        true => Inputs::ShapeOnly,
    };
    run(rank, loaded.model.as_ref(), inputs, orders)?;
    // The last forward may still be running: exiting under it races the BLAS library's exit
    // handler (see `Generation`'s `Drop`).
    mlx::synchronize()?;
    Ok(())
}

/// Connects to rank 0's control address, waiting for rank 0 to start (up to the join
/// timeout).
fn connect(rank: usize, control: &str) -> Result<TcpStream> {
    let deadline = Instant::now() + JOIN_TIMEOUT;
    let mut said = false;
    loop {
        match TcpStream::connect(control) {
            Ok(stream) => return Ok(stream),
            Err(e) if Instant::now() > deadline => {
                bail!("rank {rank}: rank 0 did not answer at {control} within {JOIN_TIMEOUT:?} ({e}); start `host serve --hostfile` on rank 0's host")
            }
            Err(e) => {
                if !said {
                    eprintln!("host tp-worker rank {rank}: waiting for rank 0 at {control} ({e})");
                    said = true;
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        }
    }
}

/// Reads rank 0's orders on a thread of its own: each goes to the returned channel, and the
/// channel closes when rank 0 closes the connection. The thread ends this process when rank 0
/// falls silent (no heartbeat within `HEARTBEAT_TIMEOUT`: it stalled, or the link dropped)
/// or when a step is still running `EXIT_GRACE` after rank 0 left.
fn read_orders(rank: usize, stream: TcpStream, control: String) -> Result<Receiver<ToWorker>> {
    stream.set_read_timeout(Some(HEARTBEAT_TIMEOUT))?;
    let (tx, rx) = channel();
    std::thread::Builder::new().name("tp-orders".into()).spawn(move || {
        let mut s = &stream;
        let why = loop {
            let order = link::receive::<ToWorker>(&mut s);
            let order = match order {
                Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted) => Ok(None),
                other => other,
            };
            match order {
                Ok(Some(order)) => {
                    if tx.send(order).is_err() {
                        return;
                    }
                }
                Ok(None) => {
                    drop(tx);
                    std::thread::sleep(EXIT_GRACE);
                    break "rank 0 closed the connection and the step under way did not finish".to_string();
                }
                Err(e) if link::timed_out(&e) => {
                    break format!(
                    "nothing from rank 0 at {control} for {} s (it stalled, its host went down or the link dropped)",
                    HEARTBEAT_TIMEOUT.as_secs()
                )
                }
                Err(e) => break format!("lost rank 0 at {control}: {e}"),
            }
        };
        eprintln!("host tp-worker rank {rank}: {why}; exiting");
        std::process::exit(1);
    })?;
    Ok(rx)
}

/// Where a worker's step gets its input ids.
#[derive(Clone, Copy)]
enum Inputs {
    /// Tensor parallel: every rank embeds them; rank 0 all-reduces them (`share_tokens`).
    Shared,
    /// The first stage of a pipeline: rank 0 sends them to the stage's highest rank, and a
    /// rank passes them on to the next below in its stage (`to`).
    Passed { from: usize, to: Option<usize> },
    /// A later stage of a pipeline: only their shape matters (it receives hidden states).
    ShapeOnly,
}

/// Runs rank 0's steps on this rank's shard or stage until rank 0 closes the connection.
///
/// Rank 0 names its caches per layer (`made`, the steps' cache lists). A tensor-parallel
/// shard has as many layers as rank 0; a pipeline stage has at most as many (rank 0's stage
/// is the longest), so this rank's layer i mirrors rank 0's layer-i caches, and the caches of
/// rank 0's layers past this rank's count — and every copy, batch and row made of them — are
/// `beyond`: their operations are skipped.
fn run(rank: usize, model: &dyn models::CausalLm, inputs: Inputs, orders: Receiver<ToWorker>) -> Result<()> {
    let mut caches: HashMap<u64, KvCache> = HashMap::new();
    let fresh = model.make_cache();
    let mut batches: HashMap<u64, BatchKvCache> = HashMap::new();
    let mut beyond: HashSet<u64> = HashSet::new();
    let missing = |what: &str, id: u64| anyhow::anyhow!("rank {rank}: {what} {id} is unknown here");
    while let Ok(order) = orders.recv() {
        let ToWorker::Step(step) = order else { bail!("rank {rank}: a second go-ahead from rank 0") };
        for (id, layer) in step.made {
            match fresh.get(layer) {
                Some(like) => {
                    caches.insert(id, like.empty_like());
                }
                None => {
                    beyond.insert(id);
                }
            }
        }
        for op in step.ops {
            if beyond_stage(&op, &mut beyond) {
                continue;
            }
            match op {
                // A copy of a cache this rank never saw (a draft model's, which runs on rank 0
                // only) has nothing to copy.
                CacheOp::Clone { from, to } => {
                    if let Some(copy) = caches.get(&from).cloned() {
                        caches.insert(to, copy);
                    }
                }
                CacheOp::Drop(id) => {
                    caches.remove(&id);
                    batches.remove(&id);
                }
                CacheOp::BatchPush { batch, cache, offset } => {
                    let c = caches.get_mut(&cache).ok_or_else(|| missing("cache", cache))?;
                    c.trim(c.offset().saturating_sub(offset));
                    batches.entry(batch).or_default().push(c)?;
                }
                CacheOp::BatchRemove { batch, row } => {
                    batches.get_mut(&batch).ok_or_else(|| missing("batch cache", batch))?.remove(row)?
                }
                CacheOp::BatchExtract { batch, row, to } => {
                    let row = batches.get(&batch).ok_or_else(|| missing("batch cache", batch))?.extract(row)?;
                    caches.insert(to, row);
                }
                CacheOp::BatchTrim { batch, added, kept } => {
                    batches.get_mut(&batch).ok_or_else(|| missing("batch cache", batch))?.trim_rows(added, &kept)?
                }
            }
        }
        let shape: Vec<usize> = step.shape.iter().map(|&d| d as usize).collect();
        let tokens = match inputs {
            Inputs::Shared => share_tokens(&Array::zeros(&shape, Dtype::Float32)?)?,
            Inputs::Passed { from, to } => {
                let ids = mlx::distributed::recv(&shape, Dtype::Int32, from)?;
                match to {
                    Some(to) => mlx::distributed::send(&ids, to)?,
                    None => ids,
                }
            }
            Inputs::ShapeOnly => Array::zeros(&shape, Dtype::Int32)?,
        };
        let own = fresh.len();
        if !step.batch.is_empty() {
            let ids = &step.batch[..own.min(step.batch.len())];
            let mut layers: Vec<BatchKvCache> = ids.iter().map(|id| batches.remove(id).unwrap_or_default()).collect();
            let h = model.forward_hidden_batch(&tokens, &mut layers)?;
            mlx::async_eval(&[&h])?;
            for (&id, b) in ids.iter().zip(layers) {
                batches.insert(id, b);
            }
            continue;
        }
        let mut layers = Vec::with_capacity(own);
        for (i, &(id, offset)) in step.caches.iter().take(own).enumerate() {
            // A new cache is the layer's own (bounded where the layer slides), as on rank 0.
            let mut c =
                caches.remove(&id).unwrap_or_else(|| fresh.get(i).map_or_else(KvCache::default, KvCache::empty_like));
            if c.offset() < offset {
                bail!("rank {rank}: cache {id} holds {} positions, rank 0 expects {offset}", c.offset());
            }
            c.trim(c.offset() - offset);
            layers.push(c);
        }
        let h = model.forward_hidden(&tokens, &mut layers)?;
        mlx::async_eval(&[&h])?;
        for (&(id, _), c) in step.caches.iter().take(own).zip(layers) {
            caches.insert(id, c);
        }
    }
    Ok(())
}

/// Whether `op` is on caches beyond this stage's layers (`beyond`), marking what it makes of
/// them beyond too; a dropped cache leaves `beyond`.
fn beyond_stage(op: &CacheOp, beyond: &mut HashSet<u64>) -> bool {
    match op {
        CacheOp::Clone { from, to } | CacheOp::BatchExtract { batch: from, to, .. } if beyond.contains(from) => {
            beyond.insert(*to);
            true
        }
        CacheOp::BatchPush { batch, cache, .. } if beyond.contains(cache) => {
            beyond.insert(*batch);
            true
        }
        CacheOp::BatchRemove { batch, .. } | CacheOp::BatchTrim { batch, .. } => beyond.contains(batch),
        CacheOp::Drop(id) => beyond.remove(id),
        _ => false,
    }
}

/// Ends this worker if rank 0 (`parent`, given by rank 0 itself: it may be gone before this
/// process first looks) stops being its parent before the worker is admitted: a rank 0 that
/// died while the group was forming left its workers waiting for it (seen in CI: an orphaned
/// rank kept the test's stderr pipe open and the test waited on it). Set the returned flag
/// once admitted: from then on the heartbeats tell.
fn exit_with_parent(rank: usize, parent: u32) -> Arc<AtomicBool> {
    let joined = Arc::new(AtomicBool::new(false));
    {
        let joined = joined.clone();
        let _ = std::thread::Builder::new().name("tp-parent".into()).spawn(move || {
            while !joined.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(200));
                if std::os::unix::process::parent_id() != parent && !joined.load(Ordering::SeqCst) {
                    eprintln!("host tp-worker rank {rank}: rank 0 (process {parent}) is gone; exiting");
                    std::process::exit(1);
                }
            }
        });
    }
    joined
}
