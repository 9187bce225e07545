//! A process that fills the block cache and is killed mid-fill by the crash tests.
//!
//! `fill-child CACHE_DIR SOURCE_URL KEY BLOCK_SIZE` reads KEY sequentially through a block
//! cache in CACHE_DIR, over and over, printing `filling` once the first read is served. The
//! source is built from its URL as the daemon builds it: S3 settings come from `AWS_*`.

use std::io::Write;
use std::sync::Arc;

use anyhow::Context;
use larder_config::IoEngineKind;
use larder_engine as engine;
use larder_origin::Origin;
use larder_origin::environment::Environment;
use larder_read_path::{Cache, OpenObject, Reader};
use larder_stats::Stats;
use larder_store::BlockStore;
use larder_tests::fixture::test_config;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, dir, url, key, block_size] = args.as_slice() else {
        anyhow::bail!("usage: fill-child CACHE_DIR SOURCE_URL KEY BLOCK_SIZE");
    };
    let block_size: u64 = block_size.parse().context("BLOCK_SIZE")?;
    let config = test_config(dir.as_ref(), block_size, IoEngineKind::Uring, url);
    let stats = Arc::new(Stats::default());
    let origin = Arc::new(Origin::from_config(
        &config.sources[0],
        &config.origin,
        stats.origin.clone(),
        &Environment::process(),
    )?);
    let engine = engine::build(config.cache.io_engine, config.cache.io_queue_depth)?;
    let store = Arc::new(BlockStore::open(&config.cache, engine, stats.store.clone()).await?);
    let cache = Cache::new(store, &config.origin, config.cache.memory_limit, &stats, None);
    let object = OpenObject::new(origin.clone(), origin.head(key).await?);
    let mut announced = false;
    loop {
        let reader = Reader::new(cache.clone(), object.clone());
        let mut offset = 0;
        while offset < object.version().size {
            let bytes = reader.read(offset, 1 << 20).await?;
            offset += bytes.len() as u64;
            if !announced {
                println!("filling");
                std::io::stdout().flush()?;
                announced = true;
            }
        }
    }
}
