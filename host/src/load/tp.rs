//! Tensor parallelism over MLX's distributed API (`mlx::distributed`): `--tensor-parallel N`
//! runs one process per rank. This process is rank 0: it launches ranks 1..N as
//! `host tp-worker` children, joins the group with them (the `ring` backend over loopback
//! TCP on CPUs, `nccl` on NVIDIA GPUs), loads its shard of the model and drives the others:
//! before each forward it sends every worker the step (its shape, the caches it continues and
//! where each stands, and the cache copies and frees since the last step), so each rank runs
//! the same forward on its shard and the all-reduces inside pair up. The input tokens travel
//! on the device, not the socket: every forward starts with an all-reduce of them (rank 0's
//! ids, zeros elsewhere), so rank 0 never reads a sampled token back before the next step is
//! sent and decoding stays pipelined on every rank.
//!
//! Every rank evaluates the final hidden states of every forward (with `async_eval`): that is
//! what makes the collectives match whatever else rank 0 evaluates later. A worker that dies
//! brings rank 0 down with a message naming it (a monitor thread), and workers exit when rank
//! 0's control connection closes (or, before they have joined, when rank 0 is gone).

use super::{select_device, DeviceChoice};
use anyhow::{bail, Context, Result};
use mlx::distributed::Group;
use mlx::{Array, Device, Dtype};
use models::cache::CacheOp;
use models::{BatchKvCache, CausalLm, KvCache, Loaded};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long rank 0 waits for every worker to join.
const JOIN_TIMEOUT: Duration = Duration::from_secs(300);

/// Set when rank 0 lets its workers go (its model is dropped): from then on a worker exiting
/// is the expected end, not a failure.
static CLOSING: AtomicBool = AtomicBool::new(false);

/// One forward step, as rank 0 sends it to the workers.
#[derive(Debug, Serialize, Deserialize)]
struct Step {
    /// Cache operations since the last step, in order: copies, frees, batch rows joining,
    /// leaving and copied out, and batch rollbacks.
    ops: Vec<CacheOp>,
    /// A batch forward (one token per row): each layer's batch cache id; `caches` is empty.
    #[serde(default)]
    batch: Vec<u64>,
    /// Per layer: the cache id and the positions it holds before this step (a smaller offset
    /// than the worker's means rank 0 trimmed it).
    caches: Vec<(u64, usize)>,
    /// The input tokens' shape (the ids themselves come by [`share_tokens`]).
    shape: Vec<i32>,
}

/// The MLX backend for a device.
fn backend(device: Device) -> &'static str {
    if device == Device::Gpu {
        "nccl"
    } else {
        "ring"
    }
}

/// Free loopback ports, one per rank (bound, then released for MLX to listen on), below the
/// kernel's ephemeral range: a port from that range (what binding port 0 gives) can be
/// taken, between its release and MLX's bind, as the source port of one of the connections
/// the ranks are opening to each other; rank 0 then failed to join with `Couldn't bind
/// socket (error: 98)` (seen once in CI). Where the range leaves no room below it, port 0.
fn free_ports(n: usize) -> Result<Vec<u16>> {
    let ephemeral_low = ephemeral_low().unwrap_or(32768);
    let mut listeners = Vec::with_capacity(n);
    if ephemeral_low > LOWEST + 1000 {
        // Start somewhere different per process, so concurrent launches rarely meet.
        let span = u32::from(ephemeral_low - LOWEST);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let start = std::process::id().wrapping_mul(7919) ^ nanos;
        let ports = (0..span).map(|i| LOWEST + ((start % span + i) % span) as u16);
        listeners.extend(ports.filter_map(|p| TcpListener::bind(("127.0.0.1", p)).ok()).take(n));
    }
    while listeners.len() < n {
        listeners.push(TcpListener::bind("127.0.0.1:0")?);
    }
    Ok(listeners.iter().map(|l| l.local_addr().map(|a| a.port())).collect::<std::io::Result<_>>()?)
}

/// The lowest port the kernel hands out for outgoing connections (Linux).
fn ephemeral_low() -> Option<u16> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    range.split_whitespace().next()?.parse().ok()
}

/// The lowest port `free_ports` picks.
const LOWEST: u16 = 10000;

/// Sets the environment MLX's backends read for this rank: the ring backend's `MLX_RANK` and
/// `MLX_HOSTFILE`, and NCCL's rank, world size and rendezvous address.
fn rank_env(command: Option<&mut Command>, rank: usize, size: usize, hostfile: &Path, nccl: &str) {
    let vars = [
        ("MLX_RANK", rank.to_string()),
        ("MLX_HOSTFILE", hostfile.display().to_string()),
        ("MLX_WORLD_SIZE", size.to_string()),
        ("NCCL_HOST_IP", nccl.split(':').next().unwrap_or("127.0.0.1").to_string()),
        ("NCCL_PORT", nccl.split(':').nth(1).unwrap_or("0").to_string()),
    ];
    match command {
        Some(c) => {
            c.envs(vars);
            // NCCL: one GPU per rank (the rank-th of those visible to rank 0), and NVLink
            // multicast off as the shared machines require. HOST_TP_PIN_GPUS=off leaves every
            // GPU visible to every rank (for a libmlx that picks the device by rank itself).
            c.env("NCCL_NVLS_ENABLE", "0");
            if std::env::var("HOST_TP_PIN_GPUS").as_deref() != Ok("off") {
                let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok().filter(|v| !v.is_empty());
                let gpu = match visible {
                    Some(list) => list.split(',').nth(rank).unwrap_or("").to_string(),
                    None => rank.to_string(),
                };
                c.env("CUDA_VISIBLE_DEVICES", gpu);
            }
        }
        None => vars.into_iter().for_each(|(k, v)| std::env::set_var(k, v)),
    }
}

/// Loads `path` split over `n` ranks: launches the workers, joins the group and returns
/// rank 0's model, which drives them.
pub fn load(path: &Path, n: usize, device: DeviceChoice) -> Result<Loaded> {
    if n < 2 {
        bail!("--tensor-parallel needs at least 2 ranks (1 is plain serving)");
    }
    models::check_tensor_parallel(path, n).with_context(|| format!("splitting {}", path.display()))?;
    let run = std::env::temp_dir().join(format!("host-tp-{}", std::process::id()));
    std::fs::create_dir_all(&run).with_context(|| format!("creating {}", run.display()))?;
    let ports = free_ports(n + 1)?;
    let hosts: Vec<Vec<String>> = ports[..n].iter().map(|p| vec![format!("127.0.0.1:{p}")]).collect();
    let hostfile = run.join("hostfile.json");
    std::fs::write(&hostfile, serde_json::to_string(&hosts)?)?;
    let nccl = format!("127.0.0.1:{}", ports[n]);
    let control = TcpListener::bind("127.0.0.1:0").context("binding the tensor-parallel control port")?;
    let exe = std::env::current_exe().context("finding the host binary to launch workers")?;
    let mut children = Vec::new();
    for rank in 1..n {
        let mut command = Command::new(&exe);
        command
            .args(["tp-worker", "--rank", &rank.to_string(), "--size", &n.to_string()])
            .arg("--model")
            .arg(path)
            .args(["--device", device.as_str(), "--control", &control.local_addr()?.to_string()])
            .args(["--parent", &std::process::id().to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        rank_env(Some(&mut command), rank, n, &hostfile, &nccl);
        children.push((rank, command.spawn().with_context(|| format!("launching tensor-parallel rank {rank}"))?));
    }
    watch(children);
    rank_env(None, 0, n, &hostfile, &nccl);
    let device = select_device(device)?;
    let group = mlx::distributed::init(backend(device))
        .with_context(|| format!("joining the {}-rank tensor-parallel group ({})", n, backend(device)))?;
    if group.size != n || group.rank != 0 {
        bail!("the tensor-parallel group has rank {} of {}, expected 0 of {n}", group.rank, group.size);
    }
    let mut streams = accept(&control, n - 1)?;
    streams.sort_by_key(|(rank, _)| *rank);
    let options = models::LoadOptions { tensor_parallel: Some(group), ..Default::default() };
    let loaded = models::load_with(path, &options).with_context(|| format!("loading model from {}", path.display()))?;
    models::cache::mirror();
    if loaded.info.vocab_size > 1 << 24 {
        bail!(
            "tensor parallelism shares token ids as float32, exact below 2^24; this model's vocabulary has {} tokens",
            loaded.info.vocab_size
        );
    }
    let model = TpModel { inner: loaded.model, workers: RefCell::new(streams.into_iter().map(|(_, s)| s).collect()) };
    tracing::info!(ranks = n, backend = backend(device), "tensor parallel");
    Ok(Loaded { model: Box::new(model), ..loaded })
}

/// Stops this process with a clear message if a worker exits.
fn watch(mut children: Vec<(usize, Child)>) {
    std::thread::Builder::new()
        .name("tp-monitor".into())
        .spawn(move || loop {
            if CLOSING.load(Ordering::SeqCst) {
                return;
            }
            for (rank, child) in children.iter_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    if CLOSING.load(Ordering::SeqCst) {
                        return;
                    }
                    eprintln!(
                        "host: tensor-parallel rank {rank} exited ({status}); the model is split across all ranks, so this server stops. Its error is above; restart to recover."
                    );
                    std::process::exit(1);
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        })
        .expect("spawning the tensor-parallel monitor");
}

/// Ends this worker if rank 0 (`parent`, given by rank 0 itself: it may be gone before this
/// process first looks) stops being its parent before the worker has joined: a rank 0 that
/// died while the group was forming left its workers waiting for peers forever (seen in CI:
/// an orphaned rank kept the test's stderr pipe open and the test waited on it). Set the
/// returned flag once joined: from then on the closed control connection ends the worker,
/// after its last step (exiting under a running step can hang the exit, see `Generation`).
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

/// The workers' control connections, each introduced by its rank.
fn accept(listener: &TcpListener, count: usize) -> Result<Vec<(usize, TcpStream)>> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + JOIN_TIMEOUT;
    let mut out = Vec::new();
    while out.len() < count {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream.set_nonblocking(false)?;
                stream.set_nodelay(true)?;
                let mut rank = [0u8; 4];
                stream.read_exact(&mut rank).context("reading a worker's rank")?;
                out.push((u32::from_le_bytes(rank) as usize, stream));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    bail!("only {} of {count} tensor-parallel workers connected within {JOIN_TIMEOUT:?}", out.len());
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(out)
}

fn send(stream: &mut TcpStream, step: &Step) -> std::io::Result<()> {
    let body = serde_json::to_vec(step).expect("a step serializes");
    stream.write_all(&(body.len() as u32).to_le_bytes())?;
    stream.write_all(&body)
}

fn receive(stream: &mut impl Read) -> Result<Option<Step>> {
    let mut len = [0u8; 4];
    match stream.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    stream.read_exact(&mut body)?;
    Ok(Some(serde_json::from_slice(&body)?))
}

/// The step's input ids on every rank, lazily: the sum over ranks of `local`, which is the ids
/// on rank 0 and zeros on the others. In float32 (exact for ids below 2^24), which every
/// backend reduces.
fn share_tokens(local: &Array) -> models::Result<Array> {
    Ok(mlx::distributed::all_sum(&local.astype(Dtype::Float32)?)?.astype(Dtype::Int32)?)
}

/// Rank 0's model: its shard, plus the workers it sends each step to.
struct TpModel {
    inner: Box<dyn CausalLm>,
    workers: RefCell<Vec<TcpStream>>,
}

impl Drop for TpModel {
    fn drop(&mut self) {
        // Before the control connections close (fields drop after this), so the monitor
        // does not take the workers' orderly exit for a failure.
        CLOSING.store(true, Ordering::SeqCst);
    }
}

impl TpModel {
    /// Sends the workers the next forward: the cache operations logged since the last one,
    /// and the caches (or batch caches) it runs over.
    fn send_step(&self, tokens: &Array, caches: Vec<(u64, usize)>, batch: Vec<u64>) -> models::Result<()> {
        let ops = models::cache::take_ops();
        let step = Step { ops, batch, caches, shape: tokens.shape().iter().map(|&d| d as i32).collect() };
        for (i, worker) in self.workers.borrow_mut().iter_mut().enumerate() {
            send(worker, &step)
                .map_err(|e| models::Error::Invalid(format!("tensor-parallel rank {} is unreachable: {e}", i + 1)))?;
        }
        Ok(())
    }
}

impl CausalLm for TpModel {
    fn forward(&self, tokens: &Array, cache: &mut [KvCache]) -> models::Result<Array> {
        let h = self.forward_hidden(tokens, cache)?;
        self.inner.head(&h)
    }

    fn forward_hidden(&self, tokens: &Array, cache: &mut [KvCache]) -> models::Result<Array> {
        self.send_step(tokens, cache.iter().map(|c| (c.id(), c.offset())).collect(), Vec::new())?;
        let h = self.inner.forward_hidden(&share_tokens(tokens)?, cache)?;
        mlx::async_eval(&[&h])?;
        Ok(h)
    }

    fn forward_hidden_batch(&self, tokens: &Array, cache: &mut [BatchKvCache]) -> models::Result<Array> {
        self.send_step(tokens, Vec::new(), cache.iter().map(BatchKvCache::id).collect())?;
        let h = self.inner.forward_hidden_batch(&share_tokens(tokens)?, cache)?;
        mlx::async_eval(&[&h])?;
        Ok(h)
    }

    fn batches(&self) -> bool {
        self.inner.batches()
    }

    fn head(&self, hidden: &Array) -> models::Result<Array> {
        self.inner.head(hidden)
    }

    fn make_cache(&self) -> Vec<KvCache> {
        self.inner.make_cache()
    }

    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    fn takes_cache_forks(&self) -> bool {
        false
    }
}

/// `host tp-worker`: one rank of a tensor-parallel group, launched by rank 0.
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    #[arg(long)]
    pub rank: usize,
    #[arg(long)]
    pub size: usize,
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long, value_enum, default_value = "auto")]
    pub device: DeviceChoice,
    /// Rank 0's control address.
    #[arg(long)]
    pub control: String,
    /// Rank 0's process id (default: this process's parent when it starts).
    #[arg(long)]
    pub parent: Option<u32>,
}

/// Runs a worker rank until rank 0 goes away.
pub fn worker(args: WorkerArgs) -> Result<()> {
    let parent = args.parent.unwrap_or_else(std::os::unix::process::parent_id);
    let joined = exit_with_parent(args.rank, parent);
    let device = select_device(args.device)?;
    let group: Group = mlx::distributed::init(backend(device))
        .with_context(|| format!("rank {} joining the tensor-parallel group", args.rank))?;
    if group.rank != args.rank || group.size != args.size {
        bail!("joined as rank {} of {}, expected {} of {}", group.rank, group.size, args.rank, args.size);
    }
    let mut control =
        TcpStream::connect(&args.control).with_context(|| format!("connecting to rank 0 at {}", args.control))?;
    control.set_nodelay(true)?;
    control.write_all(&(args.rank as u32).to_le_bytes())?;
    let options = models::LoadOptions { tensor_parallel: Some(group), ..Default::default() };
    let loaded = models::load_with(&args.model, &options)
        .with_context(|| format!("rank {} loading {}", args.rank, args.model.display()))?;
    let model = loaded.model;
    joined.store(true, Ordering::SeqCst);
    let mut reader = BufReader::new(control);
    let mut caches: HashMap<u64, KvCache> = HashMap::new();
    let fresh = model.make_cache();
    let mut batches: HashMap<u64, BatchKvCache> = HashMap::new();
    let missing = |what: &str, id: u64| anyhow::anyhow!("rank {}: {what} {id} is unknown here", args.rank);
    while let Some(step) = receive(&mut reader)? {
        for op in step.ops {
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
        let tokens = share_tokens(&Array::zeros(&shape, Dtype::Float32)?)?;
        if !step.batch.is_empty() {
            let mut layers: Vec<BatchKvCache> =
                step.batch.iter().map(|id| batches.remove(id).unwrap_or_default()).collect();
            let h = model.forward_hidden_batch(&tokens, &mut layers)?;
            mlx::async_eval(&[&h])?;
            for (&id, b) in step.batch.iter().zip(layers) {
                batches.insert(id, b);
            }
            continue;
        }
        let mut layers = Vec::with_capacity(step.caches.len());
        for (i, &(id, offset)) in step.caches.iter().enumerate() {
            // A new cache is the layer's own (bounded where the layer slides), as on rank 0.
            let mut c =
                caches.remove(&id).unwrap_or_else(|| fresh.get(i).map_or_else(KvCache::default, KvCache::empty_like));
            if c.offset() < offset {
                bail!("rank {}: cache {id} holds {} positions, rank 0 expects {offset}", args.rank, c.offset());
            }
            c.trim(c.offset() - offset);
            layers.push(c);
        }
        let h = model.forward_hidden(&tokens, &mut layers)?;
        mlx::async_eval(&[&h])?;
        for (&(id, _), c) in step.caches.iter().zip(layers) {
            caches.insert(id, c);
        }
    }
    // The last forward may still be running: exiting under it races the BLAS library's exit
    // handler (see `Generation`'s `Drop`).
    mlx::synchronize()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_ports_are_free_distinct_and_below_the_ephemeral_range() {
        let ports = free_ports(4).unwrap();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 4, "{ports:?}");
        if let Some(low) = ephemeral_low().filter(|&low| low > LOWEST + 1000) {
            assert!(ports.iter().all(|&p| (LOWEST..low).contains(&p)), "{ports:?} (ephemeral from {low})");
        }
        // Released, so a rank can bind them.
        for p in ports {
            TcpListener::bind(("127.0.0.1", p)).unwrap();
        }
    }
}
