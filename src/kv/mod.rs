//! The paged KV cache's bookkeeping: a pool of fixed-size blocks and, per request, a block table
//! from logical to physical blocks. Pure data: nothing here touches device memory, so it imports
//! nothing from backends or models and its tests run in milliseconds.

mod block_pool;
mod manager;

pub use block_pool::{BlockId, BlockPool, FreeKind, NULL_BLOCK};
pub use manager::{BlockHash, CachedPrefix, KvCacheManager, KvUsage, PrefixCacheStats};
