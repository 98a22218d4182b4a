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
    /// logits are needed). `None` when no entry shares a prefix. An entry is trimmed to the
    /// longest part of the prefix it can roll back to exactly (`models::reach`): a
    /// sliding-window layer that dropped the positions its window needs does not reach
    /// back, and a recurrent layer reaches only its offset and its checkpoints.
    pub fn take(&mut self, prompt: &[u32]) -> Option<Reuse> {
        self.clock += 1;
        let (best, reused) = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let shared = common_prefix(&e.tokens, prompt).min(prompt.len().saturating_sub(1));
                Some((i, models::reach(&e.cache, shared)?))
            })
            .max_by_key(|&(_, n)| n)?;
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
        // An entry that is a prefix of the new one is subsumed by it, if the new one can be
        // trimmed back to it (a recurrent layer only to its checkpoints).
        self.entries.retain(|e| {
            let n = e.tokens.len();
            !(n <= tokens.len() && tokens.starts_with(&e.tokens) && models::reach(&cache, n) == Some(n))
        });
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

    /// An entry of a model with a sliding layer (window 8, slack 4 beyond it) that dropped
    /// its oldest positions (it holds 189..300) serves prompts sharing the prefixes it can
    /// roll back to, not shorter ones; what it serves continues with a fresh forward's logits.
    #[test]
    fn a_sliding_window_entry_serves_only_the_prefixes_it_can_roll_back_to() {
        let model = models::testing::model("gemma3_text", 4).unwrap();
        let tokens: Vec<u32> = (0..300).map(|i| (i * 7 + 3) % 100).collect();
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let mut cache: Vec<KvCache> = model.make_cache().into_iter().map(|c| c.with_slack(4)).collect();
        for chunk in ids.chunks(100) {
            model.forward(&Array::from_i32(chunk, &[1, chunk.len()]).unwrap(), &mut cache).unwrap();
        }
        assert_eq!((cache[0].start(), cache[0].trimmable()), (189, 300 - 189 - 7));
        let mut pc = PromptCache::new(1 << 30);
        pc.insert(tokens.clone(), cache);
        let diverging = |at: usize| -> Vec<u32> { tokens[..at].iter().copied().chain([101, 102]).collect() };
        assert!(pc.take(&diverging(150)).is_none(), "the window before position 150 is gone");
        assert!(pc.take(&diverging(195)).is_none(), "position 195's window starts at 188");
        let mut r = pc.take(&diverging(196)).unwrap();
        assert_eq!(r.reused, 196);
        let cont = model.forward(&Array::from_i32(&[101, 102], &[1, 2]).unwrap(), &mut r.cache).unwrap();
        let all: Vec<i32> = diverging(196).iter().map(|&t| t as i32).collect();
        let fresh = model.forward(&Array::from_i32(&all, &[1, 198]).unwrap(), &mut model.make_cache()).unwrap();
        let (a, b) = (
            cont.slice_axis(1, 1, 2).unwrap().to_vec_f32().unwrap(),
            fresh.slice_axis(1, 197, 198).unwrap().to_vec_f32().unwrap(),
        );
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(d < 1e-4, "{d}");
    }
    /// Qwen3.5's recurrent layers reach back only to their checkpoints: an entry of 30
    /// tokens checkpointed at 12 and 20 serves a prompt parting at 25 from 20 and one
    /// parting at 15 from 12 (and one parting at 8 not at all), and what it serves continues
    /// with a fresh forward's logits. Inserting it beside the entry of its first 20 tokens
    /// replaces that one (it reaches it), not the entry of its first 16 (it does not).
    #[test]
    fn a_recurrent_entry_serves_prefixes_from_its_checkpoints() {
        let model = models::testing::model("qwen3_5", 6).unwrap();
        let model = model.as_ref();
        let tokens: Vec<u32> = (0..30).map(|i| (i * 11 + 5) % 100).collect();
        let mut cache = model.make_cache();
        for piece in [&tokens[..12], &tokens[12..20], &tokens[20..]] {
            let ids: Vec<i32> = piece.iter().map(|&t| t as i32).collect();
            model.forward(&Array::from_i32(&ids, &[1, ids.len()]).unwrap(), &mut cache).unwrap();
            if cache[0].offset() < 30 {
                cache.iter_mut().for_each(KvCache::checkpoint);
            }
        }
        assert_eq!(cache[0].checkpoints(), vec![12, 20]);
        let mut pc = PromptCache::new(1 << 30);
        pc.insert(tokens[..20].to_vec(), cache_of(model, &tokens[..20]));
        pc.insert(tokens[..16].to_vec(), cache_of(model, &tokens[..16]));
        pc.insert(tokens.clone(), cache);
        assert_eq!(pc.len(), 2, "the 20-token entry is reached by the new one; the 16-token one is not");
        let parting = |at: usize| -> Vec<u32> { tokens[..at].iter().copied().chain([101, 102]).collect() };
        assert!(pc.take(&parting(8)).is_none());
        assert_eq!(pc.take(&parting(15)).unwrap().reused, 12);
        assert_eq!(pc.take(&parting(17)).unwrap().reused, 16, "the 16-token entry, whole");
        let mut r = pc.take(&parting(25)).unwrap();
        assert_eq!(r.reused, 20);
        let rest: Vec<i32> = parting(25)[20..].iter().map(|&t| t as i32).collect();
        let cont = model.forward(&Array::from_i32(&rest, &[1, rest.len()]).unwrap(), &mut r.cache).unwrap();
        let all: Vec<i32> = parting(25).iter().map(|&t| t as i32).collect();
        let fresh = model.forward(&Array::from_i32(&all, &[1, all.len()]).unwrap(), &mut model.make_cache()).unwrap();
        let last = |a: &Array| a.slice_axis(1, a.dim(1) as i32 - 1, a.dim(1) as i32).unwrap().to_vec_f32().unwrap();
        let d = last(&cont).iter().zip(&last(&fresh)).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(d < 1e-4, "{d}");
    }
}
