//! Reload: re-read and validate the config file, then swap the live snapshot atomically.
//! An invalid file changes nothing: the old config keeps serving.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::clock::SharedClock;
use crate::config::Config;
use crate::limiter::Limiter;
use crate::metrics::Metrics;
use crate::snapshot::Snapshot;

pub struct Reloader {
    pub path: PathBuf,
    pub live: Arc<ArcSwap<Snapshot>>,
    pub limiter: Arc<Limiter>,
    pub metrics: Arc<Metrics>,
    pub clock: SharedClock,
    /// Serializes reloads: SIGHUP and POST /reload may race.
    lock: Mutex<()>,
}

impl Reloader {
    pub fn new(
        path: PathBuf,
        live: Arc<ArcSwap<Snapshot>>,
        limiter: Arc<Limiter>,
        metrics: Arc<Metrics>,
        clock: SharedClock,
    ) -> Self {
        Self {
            path,
            live,
            limiter,
            metrics,
            clock,
            lock: Mutex::new(()),
        }
    }

    /// Reloads; returns the new generation, or every problem found.
    pub fn reload(&self) -> Result<u64, String> {
        let _one_at_a_time = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let result = self.try_reload();
        self.metrics.config_reload(result.is_ok());
        match &result {
            Ok(generation) => tracing::info!(config_generation = generation, "config reloaded"),
            Err(e) => {
                tracing::error!(error = %e, "config reload failed; the previous config keeps serving")
            }
        }
        result
    }

    fn try_reload(&self) -> Result<u64, String> {
        let config = Config::load(&self.path).map_err(|e| e.to_string())?;
        let current = self.live.load_full();
        let old = &current.config;
        if config.server.listen != old.server.listen
            || config.server.admin_listen != old.server.admin_listen
            || config.server.threads != old.server.threads
        {
            tracing::warn!("server.listen, server.admin_listen and server.threads take effect only after a restart");
        }
        if config.redis.url != old.redis.url || config.redis.key_prefix != old.redis.key_prefix {
            tracing::warn!(
                "redis.url and redis.key_prefix changes take effect only after a restart"
            );
        }
        self.limiter.store.set_budget(config.redis.timeout);
        self.limiter.breaker.reconfigure(config.breaker);
        let generation = current.generation + 1;
        let snapshot = Snapshot::build(
            config,
            generation,
            &self.metrics,
            &self.clock,
            Some(&current),
        )
        .map_err(|e| format!("cannot build upstream pools: {e}"))?;
        self.live.store(Arc::new(snapshot));
        self.metrics.config_generation.set(generation as i64);
        Ok(generation)
    }
}
