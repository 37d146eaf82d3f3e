"""`[kv_tiers]` -> a TierManager (or None): the stores, their write policies and transfer
models. Called once by the engine at start-up."""

from __future__ import annotations

from tokenloom.actors.kv.tiers.calibration import TransferModel
from tokenloom.actors.kv.tiers.manager import TierManager, WritePolicy
from tokenloom.actors.kv.tiers.record import KVLayout
from tokenloom.config.schema import ConfigError, KVTiersConfig
from tokenloom.startup_log import startup_log

MB = 1e6


def build_tiers(cfg: KVTiersConfig, layout: KVLayout, block_size: int, *,
                prefix_caching: bool, speculative_method: str) -> TierManager | None:
    if not cfg.enabled:
        return None
    if not prefix_caching:
        raise ConfigError("kv_tiers.enabled needs cache.enable_prefix_caching: the tiers are "
                          "keyed by the prefix cache's block hashes", key="kv_tiers.enabled")
    if speculative_method == "draft":
        raise ConfigError("kv_tiers.enabled cannot be combined with speculative.method "
                          "\"draft\": the draft model's KV is not tiered, so a restored prefix "
                          "would have none", key="kv_tiers.enabled")
    stores, models, policies = [], {}, {}
    if cfg.host_bytes:
        from tokenloom.actors.kv.tiers.store import HostStore
        if cfg.host_bytes < layout.block_bytes:
            raise ConfigError(f"kv_tiers.host_bytes must be 0 (off) or >= one KV block "
                              f"({layout.block_bytes} bytes), got {cfg.host_bytes}",
                              key="kv_tiers.host_bytes")
        stores.append(HostStore(layout, cfg.host_bytes))
        models["host"] = TransferModel(0.0, cfg.host_prior_mb_s * MB)
        policies["host"] = WritePolicy(cfg.host_write, cfg.host_store_threshold)
    if cfg.disk_path:
        from tokenloom.actors.kv.tiers.disk import DiskStore
        try:
            stores.append(DiskStore(layout, cfg.disk_path, cfg.disk_bytes, fsync=cfg.disk_fsync))
        except (OSError, ValueError) as e:
            raise ConfigError(f"kv_tiers.disk_path {cfg.disk_path!r} / disk_bytes: {e}",
                              key="kv_tiers.disk_path") from None
        models["disk"] = TransferModel(cfg.disk_prior_latency_ms / 1e3, cfg.disk_prior_mb_s * MB)
        policies["disk"] = WritePolicy(cfg.disk_write, cfg.disk_store_threshold)
    if cfg.remote_url:
        from tokenloom.actors.kv.tiers.remote import RemoteStore
        shaping = None
        if cfg.remote_shaping:
            shaping = (cfg.remote_shaping[0] / 1e3, cfg.remote_shaping[1] * MB)
        stores.append(RemoteStore(layout, cfg.remote_url, timeout_s=cfg.remote_timeout_ms / 1e3,
                                  ttl_s=cfg.remote_ttl_s or None,
                                  retry_after_s=cfg.remote_retry_after_s, shaping=shaping))
        models["remote"] = TransferModel(cfg.remote_prior_latency_ms / 1e3,
                                         cfg.remote_prior_mb_s * MB)
        policies["remote"] = WritePolicy(cfg.remote_write, cfg.remote_store_threshold)
    if cfg.peer_path:
        from tokenloom.actors.kv.tiers.handoff import HandoffStore
        try:
            stores.append(HandoffStore(layout, cfg.peer_path, cfg.peer_bytes))
        except (OSError, ValueError) as e:
            raise ConfigError(f"kv_tiers.peer_path {cfg.peer_path!r} / peer_bytes: {e}",
                              key="kv_tiers.peer_path") from None
        models["peer"] = TransferModel(cfg.peer_prior_latency_ms / 1e3, cfg.peer_prior_mb_s * MB)
        policies["peer"] = WritePolicy(cfg.peer_write, 0)
    manager = TierManager(layout, stores, policies, models, planner_mode=cfg.planner,
                          block_size=block_size,
                          max_queued_write_bytes=cfg.max_queued_write_bytes)
    desc = ", ".join(f"{s.name} ({policies[s.name].mode})" for s in stores)
    startup_log.info(f"KV tiers: {desc}; planner {cfg.planner}; block {layout.block_bytes} "
                     f"bytes, layout {layout.tag}",
                     tiers=[s.name for s in stores], planner=cfg.planner)
    return manager
