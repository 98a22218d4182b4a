//! Reuse of KV caches across requests: a byte-capped LRU of (token sequence, cache) pairs.
//! A new request continues from the entry sharing the longest token prefix with its prompt,
//! so a multi-turn chat prefills only the new turn.
//!
//! Sharing is safe because MLX arrays are immutable: a cache taken from here and extended
//! writes new buffers (the first write copies), and the stored entry is unchanged.

use models::KvCache;

struct Entry {
    tokens: Vec<u32>,
    cache: Vec<KvCache>,
    bytes: usize,
    last_used: u64,
}

/// What `take` found.
pub struct Reuse {
    pub cache: Vec<KvCache>,
    /// Leading prompt tokens already in `cache`.
    pub reused: usize,
}

pub struct PromptCache {
    entries: Vec<Entry>,
    capacity_bytes: usize,
    clock: u64,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PromptCache {
    pub fn new(capacity_bytes: usize) -> PromptCache {
        PromptCache { entries: Vec::new(), capacity_bytes, clock: 0 }
    }

    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The cache of the entry with the longest common prefix with `prompt`, trimmed to that
    /// prefix; at least one prompt token is always left to compute (the last position's
    /// logits are needed). `None` when no entry shares a prefix.
    pub fn take(&mut self, prompt: &[u32]) -> Option<Reuse> {
        self.clock += 1;
        let (best, len) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, common_prefix(&e.tokens, prompt)))
            .max_by_key(|&(_, n)| n)?;
        let reused = len.min(prompt.len().saturating_sub(1));
        if reused == 0 {
            return None;
        }
        let entry = &mut self.entries[best];
        entry.last_used = self.clock;
        let mut cache = entry.cache.clone();
        for c in cache.iter_mut() {
            c.trim(c.offset() - reused);
        }
        Some(Reuse { cache, reused })
    }

    /// Stores the cache of `tokens` (the cache holds exactly `tokens.len()` positions),
    /// replacing entries it extends, then evicts least recently used entries over capacity.
    pub fn insert(&mut self, tokens: Vec<u32>, cache: Vec<KvCache>) {
        if tokens.is_empty() || self.capacity_bytes == 0 {
            return;
        }
        self.clock += 1;
        let bytes: usize = cache.iter().map(KvCache::nbytes).sum();
        if bytes > self.capacity_bytes {
            return;
        }
        // An entry that is a prefix of the new one is subsumed by it.
        self.entries.retain(|e| !(e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens)));
        self.entries.push(Entry { tokens, cache, bytes, last_used: self.clock });
        while self.bytes() > self.capacity_bytes {
            let oldest = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i);
            match oldest {
                Some(i) => {
                    self.entries.swap_remove(i);
                }
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx::Array;

    fn cache_of(model: &dyn models::CausalLm, tokens: &[u32]) -> Vec<KvCache> {
        let mut cache = model.make_cache();
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let out = model.forward(&Array::from_i32(&ids, &[1, ids.len()]).unwrap(), &mut cache).unwrap();
        out.eval().unwrap();
        cache
    }

    #[test]
    fn the_longest_prefix_is_reused_and_one_token_is_always_left() {
        let model = models::testing::model("llama", 1).unwrap();
        let mut pc = PromptCache::new(1 << 30);
        pc.insert(vec![1, 2, 3, 4], cache_of(model.as_ref(), &[1, 2, 3, 4]));
        pc.insert(vec![1, 2, 9], cache_of(model.as_ref(), &[1, 2, 9]));
        let r = pc.take(&[1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!((r.reused, r.cache[0].offset()), (4, 4));
        let r = pc.take(&[1, 2, 9]).unwrap();
        assert_eq!(r.reused, 2, "the whole prompt matches: its last token is recomputed");
        assert!(pc.take(&[7, 8]).is_none());
        // Taking and trimming did not change the stored entry.
        assert_eq!(pc.take(&[1, 2, 3, 4, 5]).unwrap().reused, 4);
    }

    #[test]
    fn a_continued_cache_gives_the_same_logits_as_a_fresh_one() {
        let model = models::testing::model("qwen2", 2).unwrap();
        let mut pc = PromptCache::new(1 << 30);
        pc.insert(vec![5, 6, 7], cache_of(model.as_ref(), &[5, 6, 7]));
        let mut r = pc.take(&[5, 6, 8, 9]).unwrap();
        assert_eq!(r.reused, 2);
        let cont = model.forward(&Array::from_i32(&[8, 9], &[1, 2]).unwrap(), &mut r.cache).unwrap();
        let fresh = model.forward(&Array::from_i32(&[5, 6, 8, 9], &[1, 4]).unwrap(), &mut model.make_cache()).unwrap();
        let (a, b) = (
            cont.slice_axis(1, 1, 2).unwrap().to_vec_f32().unwrap(),
            fresh.slice_axis(1, 3, 4).unwrap().to_vec_f32().unwrap(),
        );
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(d < 1e-4, "{d}");
    }

    #[test]
    fn entries_are_evicted_least_recently_used_first_within_the_byte_cap() {
        let model = models::testing::model("llama", 3).unwrap();
        let one = cache_of(model.as_ref(), &[1, 2]);
        let bytes: usize = one.iter().map(KvCache::nbytes).sum();
        let mut pc = PromptCache::new(bytes * 2);
        pc.insert(vec![1, 2], one);
        pc.insert(vec![3, 4], cache_of(model.as_ref(), &[3, 4]));
        assert!(pc.take(&[1, 2, 5]).is_some(), "touch [1, 2]");
        pc.insert(vec![5, 6], cache_of(model.as_ref(), &[5, 6]));
        assert_eq!(pc.len(), 2);
        assert!(pc.take(&[3, 4, 0]).is_none(), "[3, 4] was least recently used");
        assert!(pc.take(&[1, 2, 0]).is_some());
        assert!(pc.bytes() <= bytes * 2);
        // Extending an entry replaces it.
        pc.insert(vec![5, 6, 7], cache_of(model.as_ref(), &[5, 6, 7]));
        assert_eq!(pc.len(), 2);
    }
}
