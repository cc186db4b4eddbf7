//! The KV cache manager: per-request block tables over one shared pool, for full-attention
//! and sliding-window groups, with prefix caching.
//!
//! Rules (positions are token indices; `bs` is a group's block size; `w` a window):
//!
//! * **Block keys.** Block `i` of a group holds tokens `[i*bs, (i+1)*bs)`. Its key names the
//!   whole prefix `tokens[0..(i+1)*bs)` plus the request's extra keys: the cache salt (in
//!   block 0's key, so it reaches every later block through the chain) and the LoRA name
//!   (in every block's key). Keys are interned exactly (no hash collisions): equal keys
//!   mean equal prefixes.
//! * **Caching.** Once `allocate_slots` has given a request slots for tokens up to `end`,
//!   every block of its table lying wholly below `min(end, known tokens)` is registered in
//!   the cache under its key (a block is registered once; the first copy of a prefix stays
//!   the cached one).
//! * **Hits.** `get_computed_blocks` returns the largest `L <= num_tokens - 1`, a multiple of
//!   the alignment (the block size with one group, the lcm of the block sizes with several),
//!   such that every group serves `L`: a full-attention group needs the cached blocks
//!   `0..L/bs`; a sliding-window group needs the `max(1, ceil((w-1)/bs))` cached blocks
//!   ending at `L` (the rest of its hit table is null). It changes nothing.
//!   Example: one group, `bs = 4`, `w = 6`, 13 tokens whose blocks 0..2 are cached: the cap
//!   is 12, the window group needs `ceil(5/4) = 2` blocks ending at 12 (blocks 1 and 2), so
//!   the hit is 12 tokens with table `[0, b1, b2]`.
//! * **Allocation.** `allocate_slots(n, n_hit, hit, lookahead)` makes the table of every
//!   group cover `max(start + n, min(start + n + lookahead, max_model_len))` tokens,
//!   `start = computed + n_hit` (lookahead slots never reach past `max_model_len`). First, sliding
//!   window blocks wholly before `start - w + 1` are released (replaced by the null block
//!   0): no query from `start` on reads them. Then, if the new blocks plus the free blocks
//!   the hit would take out of the free queue exceed the free blocks, it returns `None`
//!   and changes nothing else; otherwise it adopts the hit (one more ref per hit block)
//!   and takes new blocks from the front of the free queue.
//! * **Freeing.** `free` releases every block of the request, each group's table from its
//!   last block to its first, so the tail of a prefix is evicted before its head.
//! * `reset_prefix_cache` fails while any block is held; otherwise it drops every cache
//!   registration.

use std::collections::HashMap;

use crate::pool::{BlockPool, CacheEntry};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Attention {
    Full,
    SlidingWindow { window: usize },
}

#[derive(Clone, Debug)]
pub struct Group {
    pub block_size: usize,
    pub attention: Attention,
}

#[derive(Clone, Debug)]
pub struct Layout {
    pub num_blocks: usize,
    pub max_model_len: usize,
    pub enable_caching: bool,
    pub groups: Vec<Group>,
}

/// A failure the protocol reports as an error message (the call changed nothing).
#[derive(Debug)]
pub struct CallError(pub String);

fn fail<T>(message: String) -> Result<T, CallError> {
    Err(CallError(message))
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hit {
    pub num_tokens: usize,
    pub block_ids: Vec<Vec<usize>>,
}

struct Request {
    tokens: Vec<i64>,
    salt: Option<String>,
    lora: Option<String>,
    num_computed: usize,
    tables: Vec<Vec<usize>>,
    /// Keys of the request's full blocks, per group (extended as tokens become known).
    keys: Vec<Vec<u64>>,
    /// Blocks of each group already offered to the cache.
    num_offered: Vec<usize>,
    last_hit: Option<Hit>,
}

impl Request {
    fn holds_blocks(&self) -> bool {
        self.tables.iter().any(|t| !t.is_empty())
    }
}

type KeyParts = (u64, Vec<i64>, Option<String>, Option<String>);

pub struct Manager {
    layout: Layout,
    pool: BlockPool,
    requests: HashMap<String, Request>,
    interner: HashMap<KeyParts, u64>,
    alignment: usize,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl Manager {
    pub fn new(layout: Layout) -> Result<Manager, CallError> {
        if layout.groups.is_empty() {
            return fail("the layout has no KV cache group".into());
        }
        if layout.num_blocks < 2 {
            return fail(format!(
                "num_blocks must be >= 2, got {}",
                layout.num_blocks
            ));
        }
        let mut alignment = 1;
        for (gid, g) in layout.groups.iter().enumerate() {
            if g.block_size == 0 {
                return fail(format!("group {gid}: block_size must be >= 1"));
            }
            if let Attention::SlidingWindow { window: 0 } = g.attention {
                return fail(format!("group {gid}: sliding_window must be >= 1"));
            }
            alignment = alignment / gcd(alignment, g.block_size) * g.block_size;
        }
        if layout.groups.len() == 1 {
            alignment = layout.groups[0].block_size;
        }
        Ok(Manager {
            pool: BlockPool::new(layout.num_blocks),
            layout,
            requests: HashMap::new(),
            interner: HashMap::new(),
            alignment,
        })
    }

    fn request(&self, request_id: &str) -> Result<&Request, CallError> {
        match self.requests.get(request_id) {
            Some(r) => Ok(r),
            None => fail(format!("unknown request {request_id:?}")),
        }
    }

    pub fn add_request(
        &mut self,
        request_id: &str,
        tokens: Vec<i64>,
        salt: Option<String>,
        lora: Option<String>,
    ) -> Result<(), CallError> {
        if self.requests.contains_key(request_id) {
            return fail(format!("request {request_id:?} added twice"));
        }
        if tokens.is_empty() {
            return fail(format!("request {request_id:?} has an empty prompt"));
        }
        let n = self.layout.groups.len();
        self.requests.insert(
            request_id.to_string(),
            Request {
                tokens,
                salt,
                lora,
                num_computed: 0,
                tables: vec![Vec::new(); n],
                keys: vec![Vec::new(); n],
                num_offered: vec![0; n],
                last_hit: None,
            },
        );
        Ok(())
    }

    pub fn append_output_tokens(
        &mut self,
        request_id: &str,
        tokens: &[i64],
    ) -> Result<(), CallError> {
        self.request(request_id)?;
        self.requests
            .get_mut(request_id)
            .unwrap()
            .tokens
            .extend_from_slice(tokens);
        Ok(())
    }

    pub fn set_num_computed_tokens(&mut self, request_id: &str, n: usize) -> Result<(), CallError> {
        let req = self.request(request_id)?;
        if n > req.tokens.len() {
            return fail(format!(
                "request {request_id:?}: {n} computed tokens but it has only {}",
                req.tokens.len()
            ));
        }
        let req = self.requests.get_mut(request_id).unwrap();
        req.num_computed = n;
        if n == 0 {
            // preempted: it recomputes from scratch, offering its blocks to the cache again
            req.num_offered.iter_mut().for_each(|c| *c = 0);
        }
        Ok(())
    }

    /// Key of every full block of `group` for the request's known tokens, interning new ones.
    fn extend_keys(&mut self, request_id: &str, group: usize) {
        let bs = self.layout.groups[group].block_size;
        let req = self.requests.get_mut(request_id).unwrap();
        let full = req.tokens.len() / bs;
        while req.keys[group].len() < full {
            let i = req.keys[group].len();
            let parent = if i == 0 { 0 } else { req.keys[group][i - 1] };
            let salt = if i == 0 { req.salt.clone() } else { None };
            let parts = (
                parent,
                req.tokens[i * bs..(i + 1) * bs].to_vec(),
                salt,
                req.lora.clone(),
            );
            let next_id = self.interner.len() as u64 + 1;
            let key = *self.interner.entry(parts).or_insert(next_id);
            req.keys[group].push(key);
        }
    }

    /// The hit table of `group` for a hit of `length` tokens, or None if it cannot serve it.
    fn serve(&self, req: &Request, group: usize, length: usize) -> Option<Vec<usize>> {
        let g = &self.layout.groups[group];
        let end = length / g.block_size;
        let first = match g.attention {
            Attention::Full => 0,
            Attention::SlidingWindow { window } => {
                end.saturating_sub(cdiv(window - 1, g.block_size).max(1))
            }
        };
        let mut table = vec![0; end];
        for (i, slot) in table.iter_mut().enumerate().skip(first) {
            *slot = self.pool.lookup(group, req.keys[group][i])?;
        }
        Some(table)
    }

    pub fn get_computed_blocks(&mut self, request_id: &str) -> Result<Hit, CallError> {
        self.request(request_id)?;
        let groups = self.layout.groups.len();
        let mut hit = Hit {
            num_tokens: 0,
            block_ids: vec![Vec::new(); groups],
        };
        if self.layout.enable_caching {
            for g in 0..groups {
                self.extend_keys(request_id, g);
            }
            let req = &self.requests[request_id];
            let cap = req.tokens.len() - 1;
            let mut length = cap / self.alignment * self.alignment;
            while length > 0 {
                let tables: Option<Vec<Vec<usize>>> =
                    (0..groups).map(|g| self.serve(req, g, length)).collect();
                if let Some(block_ids) = tables {
                    hit = Hit {
                        num_tokens: length,
                        block_ids,
                    };
                    break;
                }
                length -= self.alignment;
            }
        }
        self.requests.get_mut(request_id).unwrap().last_hit = Some(hit.clone());
        Ok(hit)
    }

    /// Release the sliding-window blocks no query from `start` on reads.
    fn drop_out_of_window(&mut self, request_id: &str, start: usize) {
        let req = self.requests.get_mut(request_id).unwrap();
        for (gid, g) in self.layout.groups.iter().enumerate() {
            let Attention::SlidingWindow { window } = g.attention else {
                continue;
            };
            let dead = (start + 1).saturating_sub(window) / g.block_size;
            for slot in req.tables[gid].iter_mut().take(dead) {
                if *slot != 0 {
                    self.pool.release(*slot);
                    *slot = 0;
                }
            }
        }
    }

    pub fn allocate_slots(
        &mut self,
        request_id: &str,
        num_new_tokens: usize,
        num_new_computed_tokens: usize,
        hit: Option<Hit>,
        num_lookahead_tokens: usize,
    ) -> Result<Option<Vec<Vec<usize>>>, CallError> {
        let req = self.request(request_id)?;
        if let Some(h) = &hit {
            if req.holds_blocks() {
                return fail(format!(
                    "request {request_id:?} got a hit but already holds blocks"
                ));
            }
            if req.last_hit.as_ref() != Some(h) {
                return fail(format!(
                    "request {request_id:?}: the hit is not the one get_computed_blocks returned last"
                ));
            }
            if h.num_tokens != num_new_computed_tokens {
                return fail(format!(
                    "request {request_id:?}: num_new_computed_tokens {num_new_computed_tokens} != hit of {} tokens",
                    h.num_tokens
                ));
            }
            for (gid, table) in h.block_ids.iter().enumerate() {
                for (i, &b) in table.iter().enumerate() {
                    let want = req.keys[gid].get(i).copied();
                    if b != 0
                        && self.pool.entry(b).map(|e| (e.group, e.key)) != want.map(|k| (gid, k))
                    {
                        return fail(format!(
                            "request {request_id:?}: hit block {b} (group {gid}) was evicted since the lookup"
                        ));
                    }
                }
            }
        }
        let start = req.num_computed + num_new_computed_tokens;
        let main = start + num_new_tokens;
        let total = main.max((main + num_lookahead_tokens).min(self.layout.max_model_len));
        if hit.is_none() {
            self.drop_out_of_window(request_id, start);
        }
        let req = &self.requests[request_id];
        let tables: Vec<&Vec<usize>> = match &hit {
            Some(h) => h.block_ids.iter().collect(),
            None => req.tables.iter().collect(),
        };
        let mut needed = 0;
        for (gid, g) in self.layout.groups.iter().enumerate() {
            needed += cdiv(total, g.block_size).saturating_sub(tables[gid].len());
        }
        if let Some(h) = &hit {
            needed += h
                .block_ids
                .iter()
                .flatten()
                .filter(|&&b| b != 0 && self.pool.ref_count(b) == 0)
                .count();
        }
        if needed > self.pool.num_free() {
            return Ok(None);
        }
        if let Some(h) = hit {
            for &b in h.block_ids.iter().flatten().filter(|&&b| b != 0) {
                self.pool.acquire(b);
            }
            let req = self.requests.get_mut(request_id).unwrap();
            for (gid, table) in h.block_ids.into_iter().enumerate() {
                req.num_offered[gid] = table.len();
                req.tables[gid] = table;
            }
            self.drop_out_of_window(request_id, start);
        }
        let mut new_ids = Vec::with_capacity(self.layout.groups.len());
        for gid in 0..self.layout.groups.len() {
            let want = cdiv(total, self.layout.groups[gid].block_size);
            let mut fresh = Vec::new();
            while self.requests[request_id].tables[gid].len() < want {
                let b = self.pool.allocate().expect("capacity was checked");
                self.requests.get_mut(request_id).unwrap().tables[gid].push(b);
                fresh.push(b);
            }
            new_ids.push(fresh);
        }
        if self.layout.enable_caching {
            self.offer_to_cache(request_id, start + num_new_tokens);
        }
        self.requests.get_mut(request_id).unwrap().last_hit = None;
        Ok(Some(new_ids))
    }

    /// Register the request's full blocks below `end` (and its known tokens) in the cache.
    fn offer_to_cache(&mut self, request_id: &str, end: usize) {
        for gid in 0..self.layout.groups.len() {
            self.extend_keys(request_id, gid);
            let bs = self.layout.groups[gid].block_size;
            let req = &self.requests[request_id];
            let full = (end.min(req.tokens.len()) / bs).min(req.tables[gid].len());
            let from = req.num_offered[gid];
            let entries: Vec<(usize, CacheEntry)> = (from..full)
                .filter(|&i| req.tables[gid][i] != 0)
                .map(|i| {
                    let entry = CacheEntry {
                        group: gid,
                        key: req.keys[gid][i],
                        num_tokens: (i + 1) * bs,
                    };
                    (req.tables[gid][i], entry)
                })
                .collect();
            for (b, entry) in entries {
                self.pool.cache(b, entry);
            }
            let req = self.requests.get_mut(request_id).unwrap();
            req.num_offered[gid] = req.num_offered[gid].max(full);
        }
    }

    pub fn free(&mut self, request_id: &str) -> Result<(), CallError> {
        self.request(request_id)?;
        let req = self.requests.get_mut(request_id).unwrap();
        for table in req.tables.iter_mut() {
            for &b in table.iter().rev() {
                if b != 0 {
                    self.pool.release(b);
                }
            }
            table.clear();
        }
        req.last_hit = None;
        Ok(())
    }

    pub fn remove_request(&mut self, request_id: &str) -> Result<(), CallError> {
        if let Some(req) = self.requests.get(request_id) {
            if req.holds_blocks() {
                return fail(format!(
                    "remove_request({request_id:?}) while it holds blocks"
                ));
            }
        }
        self.requests.remove(request_id);
        Ok(())
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.pool.any_held() {
            return false;
        }
        self.pool.clear_cache();
        true
    }

    pub fn get_block_ids(&self, request_id: &str) -> Result<Vec<Vec<usize>>, CallError> {
        Ok(self.request(request_id)?.tables.clone())
    }

    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    pub fn ref_counts(&self) -> Vec<(usize, u32)> {
        (1..self.pool.num_blocks())
            .map(|b| (b, self.pool.ref_count(b)))
            .collect()
    }

    pub fn free_queue(&self) -> Vec<usize> {
        self.pool.free_queue()
    }

    pub fn cached_blocks(&self) -> Vec<(usize, CacheEntry)> {
        self.pool.cached_blocks()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_group(bs: usize, attention: Attention, num_blocks: usize) -> Manager {
        Manager::new(Layout {
            num_blocks,
            max_model_len: 64,
            enable_caching: true,
            groups: vec![Group {
                block_size: bs,
                attention,
            }],
        })
        .unwrap()
    }

    /// Prefill a request fully and free it, leaving its full blocks cached.
    fn prefill_and_free(m: &mut Manager, id: &str, tokens: Vec<i64>) {
        let n = tokens.len();
        m.add_request(id, tokens, None, None).unwrap();
        let hit = m.get_computed_blocks(id).unwrap();
        let l = hit.num_tokens;
        m.allocate_slots(id, n - l, l, Some(hit), 0)
            .unwrap()
            .unwrap();
        m.set_num_computed_tokens(id, n).unwrap();
        m.free(id).unwrap();
    }

    #[test]
    fn full_attention_hit_stops_before_the_last_token() {
        let mut m = one_group(4, Attention::Full, 10);
        prefill_and_free(&mut m, "a", (0..12).collect());
        m.add_request("b", (0..12).collect(), None, None).unwrap();
        let hit = m.get_computed_blocks("b").unwrap();
        assert_eq!(hit.num_tokens, 8); // cap 11 -> 8
        assert_eq!(hit.block_ids, vec![vec![1, 2]]);
    }

    #[test]
    fn sliding_window_worked_example() {
        // the module docstring's example: bs 4, w 6, 13 tokens, blocks 0..2 cached
        let mut m = one_group(4, Attention::SlidingWindow { window: 6 }, 10);
        prefill_and_free(&mut m, "a", (0..13).collect());
        m.add_request("b", (0..13).collect(), None, None).unwrap();
        let hit = m.get_computed_blocks("b").unwrap();
        assert_eq!(hit.num_tokens, 12);
        assert_eq!(hit.block_ids[0][0], 0);
        assert!(hit.block_ids[0][1] != 0 && hit.block_ids[0][2] != 0);
    }

    #[test]
    fn salt_separates_prefixes() {
        let mut m = one_group(2, Attention::Full, 10);
        prefill_and_free(&mut m, "a", vec![1, 2, 3, 4, 5]);
        m.add_request("b", vec![1, 2, 3, 4, 5], Some("s".into()), None)
            .unwrap();
        assert_eq!(m.get_computed_blocks("b").unwrap().num_tokens, 0);
    }

    #[test]
    fn failed_allocation_changes_nothing() {
        let mut m = one_group(2, Attention::Full, 4); // 3 usable blocks
        m.add_request("a", vec![1; 8], None, None).unwrap();
        let hit = m.get_computed_blocks("a").unwrap();
        let before = (m.free_queue(), m.ref_counts());
        assert_eq!(m.allocate_slots("a", 8, 0, Some(hit), 0).unwrap(), None);
        assert_eq!((m.free_queue(), m.ref_counts()), before);
        assert_eq!(m.get_block_ids("a").unwrap(), vec![Vec::<usize>::new()]);
    }

    #[test]
    fn window_blocks_are_released_as_the_window_moves() {
        let mut m = one_group(2, Attention::SlidingWindow { window: 2 }, 10);
        m.add_request("a", (0..8).collect(), None, None).unwrap();
        let hit = m.get_computed_blocks("a").unwrap();
        m.allocate_slots("a", 6, 0, Some(hit), 0).unwrap().unwrap();
        m.set_num_computed_tokens("a", 6).unwrap();
        // from 6 the query sees [5, 6]: blocks 0 and 1 (tokens 0..4) are dead
        m.allocate_slots("a", 2, 0, None, 0).unwrap().unwrap();
        let table = &m.get_block_ids("a").unwrap()[0];
        assert_eq!(&table[..2], &[0, 0]);
        assert!(table[2] != 0 && table[3] != 0);
    }

    #[test]
    fn lookahead_stops_at_max_model_len() {
        // bs 1, max_model_len 64 (one_group): 60 + 2 tokens + 8 lookahead -> 64 slots
        let mut m = one_group(1, Attention::Full, 80);
        m.add_request("a", (0..62).collect(), None, None).unwrap();
        let hit = m.get_computed_blocks("a").unwrap();
        m.allocate_slots("a", 60, 0, Some(hit), 0).unwrap().unwrap();
        m.set_num_computed_tokens("a", 60).unwrap();
        let new = m.allocate_slots("a", 2, 0, None, 8).unwrap().unwrap();
        assert_eq!(new[0].len(), 4);
    }

    #[test]
    fn reset_fails_while_held() {
        let mut m = one_group(2, Attention::Full, 10);
        m.add_request("a", vec![1, 2, 3], None, None).unwrap();
        let hit = m.get_computed_blocks("a").unwrap();
        m.allocate_slots("a", 3, 0, Some(hit), 0).unwrap().unwrap();
        assert!(!m.reset_prefix_cache());
        m.free("a").unwrap();
        assert!(m.reset_prefix_cache());
        assert!(m.cached_blocks().is_empty());
    }
}
