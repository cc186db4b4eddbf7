//! The block pool: ref counts, the free queue (least recently freed first) and the prefix
//! cache, shared by every KV cache group.
//!
//! Rules:
//! * block 0 is the null block: never handed out, never counted, never freed;
//! * a block is free exactly when its ref count is 0; every free block sits once in the
//!   free queue, which is a doubly linked list over block ids (O(1) removal when a cached
//!   free block is reused by a prefix hit);
//! * `allocate` takes the block at the front of the queue; if that block is registered in
//!   the prefix cache, its registration is dropped first (eviction);
//! * `release` puts a block whose ref count drops to 0 at the back of the queue, still
//!   cached: it can be hit again until it is evicted.
//!
//! Example with 4 blocks (ids 1..=3 usable): the queue starts `[1, 2, 3]`; `allocate()`
//! gives 1 (queue `[2, 3]`); `release(1)` gives `[2, 3, 1]`; a hit on block 3 calls
//! `acquire(3)`, leaving `[2, 1]`.

use std::collections::HashMap;

const NONE: usize = usize::MAX;

/// What a cached block holds: the prefix (`key`) of group `group`, ending at `num_tokens`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheEntry {
    pub group: usize,
    pub key: u64,
    pub num_tokens: usize,
}

pub struct BlockPool {
    ref_count: Vec<u32>,
    prev: Vec<usize>,
    next: Vec<usize>,
    head: usize,
    tail: usize,
    num_free: usize,
    entry: Vec<Option<CacheEntry>>,
    cache: HashMap<(usize, u64), usize>,
}

impl BlockPool {
    /// A pool of `num_blocks` ids, `0` (null) included; every other block free, in id order.
    pub fn new(num_blocks: usize) -> BlockPool {
        let mut pool = BlockPool {
            ref_count: vec![0; num_blocks],
            prev: vec![NONE; num_blocks],
            next: vec![NONE; num_blocks],
            head: NONE,
            tail: NONE,
            num_free: 0,
            entry: vec![None; num_blocks],
            cache: HashMap::new(),
        };
        for block in 1..num_blocks {
            pool.push_back(block);
        }
        pool
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_count.len()
    }

    pub fn num_free(&self) -> usize {
        self.num_free
    }

    pub fn ref_count(&self, block: usize) -> u32 {
        self.ref_count[block]
    }

    fn push_back(&mut self, block: usize) {
        self.prev[block] = self.tail;
        self.next[block] = NONE;
        if self.tail == NONE {
            self.head = block;
        } else {
            self.next[self.tail] = block;
        }
        self.tail = block;
        self.num_free += 1;
    }

    fn unlink(&mut self, block: usize) {
        let (p, n) = (self.prev[block], self.next[block]);
        if p == NONE {
            self.head = n;
        } else {
            self.next[p] = n;
        }
        if n == NONE {
            self.tail = p;
        } else {
            self.prev[n] = p;
        }
        self.prev[block] = NONE;
        self.next[block] = NONE;
        self.num_free -= 1;
    }

    /// The front free block, evicted from the prefix cache, with ref count 1; `None` when
    /// no block is free.
    pub fn allocate(&mut self) -> Option<usize> {
        let block = self.head;
        if block == NONE {
            return None;
        }
        self.unlink(block);
        self.uncache(block);
        self.ref_count[block] = 1;
        Some(block)
    }

    /// One more holder of `block` (a prefix hit); a free block leaves the queue.
    pub fn acquire(&mut self, block: usize) {
        assert!(block != 0, "the null block is never acquired");
        if self.ref_count[block] == 0 {
            self.unlink(block);
        }
        self.ref_count[block] += 1;
    }

    /// One holder fewer; at 0 the block goes to the back of the free queue, still cached.
    pub fn release(&mut self, block: usize) {
        assert!(
            block != 0 && self.ref_count[block] > 0,
            "release of a block nobody holds"
        );
        self.ref_count[block] -= 1;
        if self.ref_count[block] == 0 {
            self.push_back(block);
        }
    }

    /// Register `block` as holding `entry`, unless another block already holds that prefix
    /// (the first one stays the cached copy).
    pub fn cache(&mut self, block: usize, entry: CacheEntry) {
        if self.entry[block].is_some() || self.cache.contains_key(&(entry.group, entry.key)) {
            return;
        }
        self.cache.insert((entry.group, entry.key), block);
        self.entry[block] = Some(entry);
    }

    fn uncache(&mut self, block: usize) {
        if let Some(e) = self.entry[block].take() {
            self.cache.remove(&(e.group, e.key));
        }
    }

    /// The cached block holding prefix `key` of `group`, if any.
    pub fn lookup(&self, group: usize, key: u64) -> Option<usize> {
        self.cache.get(&(group, key)).copied()
    }

    pub fn entry(&self, block: usize) -> Option<CacheEntry> {
        self.entry[block]
    }

    /// Drop every cache registration (the caller checks that no block is held).
    pub fn clear_cache(&mut self) {
        self.cache.clear();
        for e in self.entry.iter_mut() {
            *e = None;
        }
    }

    /// True when some block has a ref count above 0.
    pub fn any_held(&self) -> bool {
        self.num_free + 1 < self.num_blocks()
    }

    /// Free block ids from the front (next to allocate) to the back.
    pub fn free_queue(&self) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut b = self.head;
        while b != NONE {
            out.push(b);
            b = self.next[b];
        }
        out
    }

    /// Every cached block: `(block, entry)`, in block order.
    pub fn cached_blocks(&self) -> Vec<(usize, CacheEntry)> {
        (1..self.num_blocks())
            .filter_map(|b| self.entry[b].map(|e| (b, e)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worked_example() {
        let mut pool = BlockPool::new(4);
        assert_eq!(pool.free_queue(), vec![1, 2, 3]);
        assert_eq!(pool.allocate(), Some(1));
        assert_eq!(pool.free_queue(), vec![2, 3]);
        pool.release(1);
        assert_eq!(pool.free_queue(), vec![2, 3, 1]);
        pool.acquire(3);
        assert_eq!(pool.free_queue(), vec![2, 1]);
        assert_eq!(pool.num_free(), 2);
        assert!(pool.any_held());
    }

    #[test]
    fn allocation_evicts() {
        let mut pool = BlockPool::new(2);
        let b = pool.allocate().unwrap();
        pool.cache(
            b,
            CacheEntry {
                group: 0,
                key: 7,
                num_tokens: 4,
            },
        );
        pool.release(b);
        assert_eq!(pool.lookup(0, 7), Some(b));
        assert_eq!(pool.allocate(), Some(b));
        assert_eq!(pool.lookup(0, 7), None);
        assert_eq!(pool.allocate(), None);
    }
}
