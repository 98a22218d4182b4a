//! KV cache bytes of one sequence as its context grows, with the model's own caches (sliding
//! layers bounded to their window plus `models::SLACK`) and with caches that keep every
//! position. Prints one JSON line per context length; `bench/kv_memory.py` runs it next to
//! mlx-lm and prints the table.
//!
//! `cargo run -p models --example kv_memory -- MODEL TOKENS...` (MODEL: a folder or GGUF file).

use models::{CausalLm, KvCache};
use std::path::PathBuf;

const CHUNK: usize = 512;

/// Bytes each context length in `lengths` (ascending) leaves in `cache`, prefilling
/// pseudo-random tokens in chunks of `CHUNK`.
fn bytes_at(model: &dyn CausalLm, mut cache: Vec<KvCache>, lengths: &[usize]) -> models::Result<Vec<usize>> {
    let vocab = model.vocab_size();
    let mut out = Vec::new();
    let mut done = 0;
    for &n in lengths {
        while done < n {
            let len = CHUNK.min(n - done);
            let ids: Vec<i32> = (done..done + len).map(|i| ((i * 7919 + 13) % vocab) as i32).collect();
            let hidden = model.forward_hidden(&mlx::Array::from_i32(&ids, &[1, len])?, &mut cache)?;
            let mut state: Vec<&mlx::Array> = cache.iter().flat_map(KvCache::state).collect();
            state.push(&hidden);
            mlx::eval(&state)?;
            done += len;
        }
        out.push(cache.iter().map(KvCache::nbytes).sum());
    }
    Ok(out)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().ok_or("usage: kv_memory MODEL TOKENS...")?);
    let mut lengths: Vec<usize> = args.map(|a| a.parse()).collect::<Result<_, _>>()?;
    lengths.sort_unstable();
    let loaded = models::load(&path)?;
    let model = loaded.model.as_ref();
    let own = bytes_at(model, model.make_cache(), &lengths)?;
    let every: Vec<KvCache> = (0..model.make_cache().len()).map(|_| KvCache::default()).collect();
    let full = bytes_at(model, every, &lengths)?;
    for ((n, own), full) in lengths.iter().zip(own).zip(full) {
        println!("{}", serde_json::json!({"tokens": n, "host": own, "host_full": full}));
    }
    Ok(())
}
