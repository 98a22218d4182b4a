//! Tensor parallelism over MLX's distributed API (`mlx::distributed`): one process per rank.
//! This process is rank 0. With `--tensor-parallel N` alone it launches ranks 1..N on this
//! machine as `host tp-worker` children; with a hostfile (`hosts.rs`, MLX's format) the ranks
//! run on the hosts it lists, each started there as `host tp-worker --hostfile FILE --rank R`.
//! Each worker connects to rank 0's control port and is admitted after a handshake
//! (`link.rs`: the same binary, the same model files, else a refusal naming the difference);
//! then all join the group (the `ring` backend over TCP, `nccl` on NVIDIA GPUs), load their
//! shards, and rank 0 drives the others: before each forward it sends every worker the step
//! (its shape, the caches it continues and where each stands, and the cache copies and frees
//! since the last step), so each rank runs the same forward on its shard and the all-reduces
//! inside pair up. The input tokens travel on the device, not the socket: every forward
//! starts with an all-reduce of them (rank 0's ids, zeros elsewhere), so rank 0 never reads a
//! sampled token back before the next step is sent and decoding stays pipelined on every rank.
//!
//! Every rank evaluates the final hidden states of every forward (with `async_eval`): that is
//! what makes the collectives match whatever else rank 0 evaluates later. Heartbeats run both
//! ways on the control connections: a worker that dies, stalls or loses its link brings rank 0
//! down with a message naming its rank and host, and a worker exits when rank 0 does.

mod hosts;
mod link;
mod ssh;
mod worker;

pub use hosts::Hostfile;
pub use worker::{worker, WorkerArgs};

use super::{select_device, DeviceChoice};
use anyhow::{bail, Context, Result};
use hosts::{Fingerprint, STARTING_PORT};
use link::{Hello, Link, Ready, Welcome};
use mlx::{Array, Device, Dtype};
use models::cache::CacheOp;
use models::{BatchKvCache, CausalLm, KvCache, Loaded};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How a model is split over processes, and where they run.
#[derive(Debug, Clone, Default)]
pub struct Split {
    /// Tensor-parallel shards (0 or 1: none); with pipeline stages, the shards of each stage.
    /// With a hostfile alone (neither count), its host count.
    pub tensor_parallel: usize,
    /// Pipeline stages (0 or 1: none), each of `tensor_parallel` ranks.
    pub pipeline_parallel: usize,
    /// MLX's hostfile naming each rank's host: rank 0 is this process, the others are
    /// `host tp-worker --hostfile FILE --rank R`, started on their hosts. Without one, the
    /// ranks run on this machine and this process launches them.
    pub hostfile: Option<PathBuf>,
    /// The first port the ranks listen on with a hostfile (default 32323, as `mlx.launch`).
    pub starting_port: Option<u16>,
    /// Start the hostfile's other ranks over ssh (`ssh.rs`) rather than wait for them.
    pub ssh_launch: bool,
}

impl Split {
    /// Whether the model is split at all.
    pub fn is_split(&self) -> bool {
        self.tensor_parallel > 1 || self.pipeline_parallel > 1 || self.hostfile.is_some() || self.ssh_launch
    }

    /// The split this asks for over `hosts` (a hostfile's, if any): with a hostfile, as many
    /// ranks as it lists hosts (the flags' product must then equal it; neither flag: tensor
    /// parallel over them all).
    fn shape(&self, hosts: Option<&Hostfile>) -> Result<Layout> {
        let (shards, stages) = (self.tensor_parallel.max(1), self.pipeline_parallel.max(1));
        let asked = Layout { stages, shards };
        let flags = match (shards > 1, stages > 1) {
            (true, true) => format!("--tensor-parallel {shards} x --pipeline-parallel {stages}"),
            (false, true) => format!("--pipeline-parallel {stages}"),
            _ => format!("--tensor-parallel {shards}"),
        };
        match hosts {
            Some(h) if asked.ranks() > 1 && asked.ranks() != h.hosts.len() => bail!(
                "{flags} makes {} ranks but the hostfile {} lists {} hosts (one rank each); make them agree",
                asked.ranks(),
                h.path.display(),
                h.hosts.len()
            ),
            Some(_) if asked.ranks() > 1 => Ok(asked),
            Some(h) => Ok(Layout { stages: 1, shards: h.hosts.len() }),
            None if self.ssh_launch => bail!("--ssh-launch needs --hostfile FILE (the hosts to start the ranks on)"),
            None if asked.ranks() < 2 => bail!("{flags} needs at least 2 ranks (1 is plain serving)"),
            None => Ok(asked),
        }
    }
}

/// How the ranks split a model: `stages` pipeline stages (contiguous layer ranges, the last on
/// rank 0), each of `shards` tensor-parallel shards. Rank `r` is shard `r % shards` of stage
/// `r / shards`: a stage's shards are neighbours in the ring, where their all-reduces run,
/// and neighbouring stages meet at neighbouring ranks, where their activations pass (MLX's
/// ring backend sends only to neighbours and cannot split its group).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    pub stages: usize,
    pub shards: usize,
}

impl Layout {
    fn ranks(&self) -> usize {
        self.stages * self.shards
    }

    fn pipeline(&self) -> bool {
        self.stages > 1
    }

    /// What `rank` loads: its shard of its stage.
    fn options(&self, rank: usize) -> models::LoadOptions {
        let group = |rank, size| (size > 1).then_some(mlx::distributed::Group { rank, size });
        models::LoadOptions {
            tensor_parallel: group(rank % self.shards, self.shards),
            pipeline: group(rank / self.shards, self.stages),
            ..Default::default()
        }
    }

    /// Refuses a pipeline over `backend` if it cannot pass activations: MLX's NCCL backend
    /// has no send and receive.
    fn check_backend(&self, backend: &str) -> Result<()> {
        if self.pipeline() && backend == "nccl" {
            bail!(
                "--pipeline-parallel passes each stage's activations with MLX's send and receive, which its NCCL \
                 backend (NVIDIA GPUs) does not have; split the model with --tensor-parallel alone there"
            );
        }
        Ok(())
    }

    /// The split's name in logs.
    fn describe(&self) -> String {
        match (self.stages > 1, self.shards > 1) {
            (true, true) => {
                format!("pipeline parallel ({} stages) x tensor parallel ({} shards)", self.stages, self.shards)
            }
            (true, false) => "pipeline parallel".into(),
            _ => "tensor parallel".into(),
        }
    }
}

/// How long rank 0 waits for every worker to join.
const JOIN_TIMEOUT: Duration = Duration::from_secs(300);

/// Set when rank 0 lets its workers go (its model is dropped): from then on a worker exiting
/// is the expected end, not a failure.
static CLOSING: AtomicBool = AtomicBool::new(false);

/// One forward step, as rank 0 sends it to the workers.
#[derive(Debug, Serialize, Deserialize)]
struct Step {
    /// Caches rank 0 made since the last step (`make_cache`), each with its layer: a cache
    /// may join a batch before any forward ran over it (a one-token prompt's).
    #[serde(default)]
    made: Vec<(u64, usize)>,
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

/// What rank 0 sends a worker after admitting it: the go-ahead to join the group once every
/// rank is admitted, then the steps.
#[derive(Debug, Serialize, Deserialize)]
enum ToWorker {
    Go,
    Step(Step),
}

/// The MLX backend: the hostfile's if it names one, else NCCL for NVIDIA GPUs and the ring
/// (TCP) for everything else (CPUs, and Apple GPUs, whose memory the CPU shares).
fn backend(device: Device, hosts: Option<&Hostfile>) -> &'static str {
    match hosts.and_then(|h| h.backend.as_deref()) {
        Some("nccl") => "nccl",
        Some(_) => "ring",
        None if device == Device::Gpu && !cfg!(target_os = "macos") => "nccl",
        None => "ring",
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

/// What every rank must share with rank 0, and what a worker is told to load.
struct Identity {
    /// The binary's sha256 (empty for local ranks, which rank 0 launches from its own).
    binary: String,
    fingerprint: Fingerprint,
    /// The model as given (`None`: the default model).
    model: Option<String>,
    device: DeviceChoice,
    layout: Layout,
}

/// Loads `path` (named `model` on the command line, `None` for the default model) split as
/// `split` says: admits the workers, joins the group and returns rank 0's model, which
/// drives them.
pub fn load(model: Option<&Path>, path: &Path, split: &Split, device: DeviceChoice) -> Result<Loaded> {
    let hosts = split.hostfile.as_deref().map(Hostfile::read).transpose()?;
    let layout = split.shape(hosts.as_ref())?;
    let n = layout.ranks();
    let check = || -> models::Result<()> {
        if layout.pipeline() {
            models::check_pipeline(path, layout.stages)?;
        }
        if layout.shards > 1 {
            models::check_tensor_parallel(path, layout.shards)?;
        }
        Ok(())
    };
    check().with_context(|| format!("splitting {}", path.display()))?;
    let backend = backend(select_device(device)?, hosts.as_ref());
    layout.check_backend(backend)?;
    let me = Identity {
        // Local ranks run the binary this process launches them from.
        binary: if hosts.is_some() { hosts::binary_hash()? } else { String::new() },
        fingerprint: Fingerprint::of(path)?,
        model: model.map(|m| m.to_string_lossy().into_owned()),
        device,
        layout,
    };
    let (control, nccl, ring_file) = match &hosts {
        Some(h) => listen_for_hosts(h, split)?,
        None => launch_local(n, path, device)?,
    };
    let links = admit(&control, n, &me, hosts.as_ref())?;
    for link in &links {
        link.send_bytes(&serde_json::to_vec(&ToWorker::Go)?)
            .with_context(|| format!("tensor-parallel rank {} on {} went away", link.rank, link.host))?;
    }
    rank_env(None, 0, n, &ring_file, &nccl);
    let group = mlx::distributed::init(backend)
        .with_context(|| format!("joining the {n}-rank tensor-parallel group ({backend})"))?;
    if group.size != n || group.rank != 0 {
        bail!("the tensor-parallel group has rank {} of {}, expected 0 of {n}", group.rank, group.size);
    }
    let loaded = models::load_with(path, &layout.options(0))
        .with_context(|| format!("loading model from {}", path.display()))?;
    models::cache::mirror();
    if !layout.pipeline() && loaded.info.vocab_size > 1 << 24 {
        bail!(
            "tensor parallelism shares token ids as float32, exact below 2^24; this model's vocabulary has {} tokens",
            loaded.info.vocab_size
        );
    }
    let model = TpModel { inner: loaded.model, workers: links, made: RefCell::default(), layout };
    let split = layout.describe();
    match &hosts {
        Some(h) => tracing::info!(ranks = n, backend, hostfile = %h.path.display(), "{split} over hosts"),
        None => tracing::info!(ranks = n, backend, "{split}"),
    }
    Ok(Loaded { model: Box::new(model), ..loaded })
}

/// Rank 0 of a hostfile's group: the ring's file written from the hostfile, rank 0's control
/// port bound on its first address (the other ranks started over ssh if asked); returns the
/// control listener, NCCL's rendezvous address and the ring's file.
fn listen_for_hosts(h: &Hostfile, split: &Split) -> Result<(TcpListener, String, PathBuf)> {
    h.apply_envs();
    let port = split.starting_port.unwrap_or(STARTING_PORT);
    let ports = h.ports(port)?;
    let ring_file = write_ring(&ports.ring)?;
    let control = TcpListener::bind(ports.control).map_err(|e| {
        anyhow::anyhow!(
            "rank 0 takes its workers' connections at {} (the hostfile's first host, {}), and binding it failed: {e}. \
             Run `host serve --hostfile` on that host (the hostfile's first host is rank 0), or free the port \
             (--starting-port moves every rank's ports)",
            ports.control,
            h.hosts[0].describe()
        )
    })?;
    if split.ssh_launch {
        watch(ssh::launch(h, port)?);
    }
    Ok((control, ports.nccl.to_string(), ring_file))
}

/// Writes the ring backend's hostfile (each rank's `ip:port`s) into this process's run folder
/// and returns its path, for `MLX_HOSTFILE`.
fn write_ring(ring: &[Vec<String>]) -> Result<PathBuf> {
    let run = std::env::temp_dir().join(format!("host-tp-{}", std::process::id()));
    std::fs::create_dir_all(&run).with_context(|| format!("creating {}", run.display()))?;
    let file = run.join("hostfile.json");
    std::fs::write(&file, serde_json::to_string(ring)?).with_context(|| format!("writing {}", file.display()))?;
    Ok(file)
}

/// Rank 0 of a group on this machine: loopback ports for the ring, and ranks 1..n launched as
/// `host tp-worker` children (watched); returns the control listener, NCCL's rendezvous and
/// the ring's file.
fn launch_local(n: usize, path: &Path, device: DeviceChoice) -> Result<(TcpListener, String, PathBuf)> {
    let ports = free_ports(n + 1)?;
    let ring: Vec<Vec<String>> = ports[..n].iter().map(|p| vec![format!("127.0.0.1:{p}")]).collect();
    let ring_file = write_ring(&ring)?;
    let control = TcpListener::bind("127.0.0.1:0").context("binding the tensor-parallel control port")?;
    let nccl = format!("127.0.0.1:{}", ports[n]);
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
        rank_env(Some(&mut command), rank, n, &ring_file, &nccl);
        children.push((rank, command.spawn().with_context(|| format!("launching tensor-parallel rank {rank}"))?));
    }
    watch(children);
    Ok((control, nccl, ring_file))
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

/// How long rank 0 waits for one worker's handshake messages.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);

/// Admits the workers of an `n`-rank group as they connect to `listener`, each after its
/// handshake; refuses (and fails) on a worker of another group size, rank, binary or model.
fn admit(listener: &TcpListener, n: usize, me: &Identity, hosts: Option<&Hostfile>) -> Result<Vec<Link>> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + JOIN_TIMEOUT;
    let mut links: Vec<Link> = Vec::new();
    let host_of = |rank: usize| match hosts {
        Some(h) => h.hosts.get(rank).map_or_else(|| "an unknown host".into(), |h| h.describe()),
        None => "this machine".to_string(),
    };
    while links.len() < n - 1 {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    let missing: Vec<String> = (1..n)
                        .filter(|r| !links.iter().any(|l| l.rank == *r))
                        .map(|r| format!("rank {r} ({})", host_of(r)))
                        .collect();
                    let how = match hosts {
                        Some(h) => format!(
                            "start `host tp-worker --hostfile {} --rank R` on each (this host, the hostfile's first, is rank 0)",
                            h.path.display()
                        ),
                        None => "their errors are above".to_string(),
                    };
                    bail!("{} did not join within {JOIN_TIMEOUT:?}: {how}", missing.join(", "));
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        let mut s = &stream;
        let Some(hello) = link::receive::<Hello>(&mut s).context("reading a worker's hello")? else {
            continue; // Not a worker, or one that gave up: wait for the others.
        };
        let (rank, host) = (hello.rank, host_of(hello.rank));
        let refused = if hello.size != n {
            Some(format!("rank {rank} on {host} was started for {} ranks, but the group has {n}", hello.size))
        } else if rank == 0 || rank >= n {
            Some(format!("a worker on {host} says it is rank {rank}; workers are ranks 1 to {}", n - 1))
        } else if links.iter().any(|l| l.rank == rank) {
            Some(format!("two workers say they are rank {rank}"))
        } else if hosts.is_some() && hello.binary != me.binary {
            Some(format!(
                "rank {rank} on {host} runs another build of host ({} {}, sha256 {}…; this one {} {}…): every rank must run the same binary",
                hello.version,
                "there",
                &hello.binary[..hello.binary.len().min(12)],
                env!("CARGO_PKG_VERSION"),
                &me.binary[..12],
            ))
        } else {
            None
        };
        let welcome = Welcome {
            refused: refused.clone(),
            model: me.model.clone(),
            device: me.device.as_str().to_string(),
            fingerprint: Some(me.fingerprint.clone()),
            layout: me.layout,
        };
        link::send(&mut s, &welcome).with_context(|| format!("answering rank {rank} on {host}"))?;
        if let Some(why) = refused {
            bail!("{why}");
        }
        let ready = link::receive::<Ready>(&mut s)
            .with_context(|| format!("waiting for rank {rank} on {host} to check its model"))?
            .with_context(|| {
                format!(
                    "rank {rank} on {host} closed its connection while checking its model (its error is in its log)"
                )
            })?;
        if let Some(why) = ready.refused {
            bail!("tensor-parallel rank {rank} on {host}: {why}");
        }
        stream.set_read_timeout(None)?;
        links.push(Link::start(rank, host, stream, &CLOSING)?);
    }
    links.sort_by_key(|l| l.rank);
    Ok(links)
}

/// The step's input ids on every rank, lazily: the sum over ranks of `local`, which is the ids
/// on rank 0 and zeros on the others. In float32 (exact for ids below 2^24), which every
/// backend reduces.
fn share_tokens(local: &Array) -> models::Result<Array> {
    Ok(mlx::distributed::all_sum(&local.astype(Dtype::Float32)?)?.astype(Dtype::Int32)?)
}

/// Rank 0's model: its shard or stage, plus the workers it sends each step to.
struct TpModel {
    inner: Box<dyn CausalLm>,
    workers: Vec<Link>,
    /// Caches made since the last step.
    made: RefCell<Vec<(u64, usize)>>,
    layout: Layout,
}

impl Drop for TpModel {
    fn drop(&mut self) {
        // Before the control connections close (fields drop after this), so the monitor
        // does not take the workers' orderly exit for a failure.
        CLOSING.store(true, Ordering::SeqCst);
    }
}

impl TpModel {
    /// The step's ids to the ranks that embed them: all of them under tensor parallelism
    /// (`share_tokens`), the first stage of a pipeline (from its highest rank, rank 0's
    /// neighbour in the ring, on down its shards) otherwise, sent before the forward that
    /// waits on the stage above.
    fn tokens_out(&self, tokens: &Array) -> models::Result<Array> {
        match self.layout.pipeline() {
            false => share_tokens(tokens),
            true => {
                let last = self.layout.ranks() - 1;
                let sent = mlx::distributed::send(&tokens.astype(Dtype::Int32)?, last)?;
                mlx::async_eval(&[&sent])?;
                Ok(tokens.clone())
            }
        }
    }

    /// Sends the workers the next forward: the cache operations logged since the last one,
    /// and the caches (or batch caches) it runs over.
    fn send_step(&self, tokens: &Array, caches: Vec<(u64, usize)>, batch: Vec<u64>) -> models::Result<()> {
        let ops = models::cache::take_ops();
        let made = std::mem::take(&mut *self.made.borrow_mut());
        let step = Step { made, ops, batch, caches, shape: tokens.shape().iter().map(|&d| d as i32).collect() };
        let body = serde_json::to_vec(&ToWorker::Step(step)).expect("a step serializes");
        for link in &self.workers {
            link.send_bytes(&body).map_err(|e| {
                models::Error::Invalid(format!(
                    "tensor-parallel rank {} on {} is unreachable: {e}",
                    link.rank, link.host
                ))
            })?;
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
        let h = self.inner.forward_hidden(&self.tokens_out(tokens)?, cache)?;
        mlx::async_eval(&[&h])?;
        Ok(h)
    }

    fn forward_hidden_batch(&self, tokens: &Array, cache: &mut [BatchKvCache]) -> models::Result<Array> {
        self.send_step(tokens, Vec::new(), cache.iter().map(BatchKvCache::id).collect())?;
        let h = self.inner.forward_hidden_batch(&self.tokens_out(tokens)?, cache)?;
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
        let caches = self.inner.make_cache();
        self.made.borrow_mut().extend(caches.iter().enumerate().map(|(layer, c)| (c.id(), layer)));
        caches
    }

    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    fn takes_cache_forks(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_takes_its_rank_count_from_the_flags_or_the_hostfile_and_refuses_what_disagrees() {
        let two = Hostfile::parse(r#"[{"ips": ["10.0.0.1"]}, {"ips": ["10.0.0.2"]}]"#, Path::new("h.json")).unwrap();
        let split = |tp: usize, pp: usize, ssh: bool| Split {
            tensor_parallel: tp,
            pipeline_parallel: pp,
            ssh_launch: ssh,
            ..Default::default()
        };
        let layout = |stages, shards| Layout { stages, shards };
        assert_eq!(split(3, 1, false).shape(None).unwrap(), layout(1, 3));
        assert_eq!(split(1, 4, false).shape(None).unwrap(), layout(4, 1));
        assert_eq!(split(2, 3, false).shape(None).unwrap(), layout(3, 2));
        assert_eq!(split(1, 1, false).shape(Some(&two)).unwrap(), layout(1, 2));
        assert_eq!(split(1, 2, false).shape(Some(&two)).unwrap(), layout(2, 1));
        let err = |s: Split, hosts: Option<&Hostfile>| s.shape(hosts).unwrap_err().to_string();
        assert!(err(split(3, 1, false), Some(&two))
            .contains("--tensor-parallel 3 makes 3 ranks but the hostfile h.json lists 2 hosts"));
        assert!(err(split(2, 2, false), Some(&two))
            .contains("--tensor-parallel 2 x --pipeline-parallel 2 makes 4 ranks but the hostfile h.json lists 2"));
        assert!(err(split(1, 1, true), None).contains("--ssh-launch needs --hostfile"));
        assert!(err(split(1, 1, false), None).contains("needs at least 2 ranks"));
    }

    #[test]
    fn a_pipeline_over_nccl_is_refused_for_want_of_send_and_receive() {
        let pipeline = Layout { stages: 2, shards: 1 };
        assert!(pipeline.check_backend("ring").is_ok());
        let err = pipeline.check_backend("nccl").unwrap_err().to_string();
        assert!(err.contains("NCCL") && err.contains("--tensor-parallel alone"), "{err}");
        assert!(Layout { stages: 1, shards: 2 }.check_backend("nccl").is_ok());
    }

    #[test]
    fn a_rank_loads_its_shard_of_its_stage() {
        let options = |l: Layout, rank| {
            let o = l.options(rank);
            (o.pipeline.map(|g| (g.rank, g.size)), o.tensor_parallel.map(|g| (g.rank, g.size)))
        };
        let both = Layout { stages: 2, shards: 2 };
        assert_eq!(options(both, 0), (Some((0, 2)), Some((0, 2))));
        assert_eq!(options(both, 1), (Some((0, 2)), Some((1, 2))));
        assert_eq!(options(both, 3), (Some((1, 2)), Some((1, 2))));
        assert_eq!(options(Layout { stages: 3, shards: 1 }, 2), (Some((2, 3)), None));
        assert_eq!(options(Layout { stages: 1, shards: 3 }, 2), (None, Some((2, 3))));
    }

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
