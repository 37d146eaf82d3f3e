"""Config schema and layered loading: defaults → file → env → overrides → validation."""

import pathlib
import tomllib

import msgspec
import pytest

from tokenloom.config.load import DEFAULT_TOML, config_to_dict, env_overrides, load_config
from tokenloom.config.schema import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    resolve_cache_dir,
)


def test_defaults_load_and_match_the_structs():
    assert load_config(env=None) == EngineConfig()


def test_default_toml_lists_every_key_with_its_default():
    assert tomllib.loads(DEFAULT_TOML.read_text()) == config_to_dict(EngineConfig())


def test_config_to_dict_round_trips():
    cfg = EngineConfig(cache=CacheConfig(block_size=32), scheduler=SchedulerConfig(max_num_seqs=3))
    assert load_config(overrides=config_to_dict(cfg), env=None) == cfg


def test_file_is_deep_merged_over_defaults(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[scheduler]\nmax_num_seqs = 8\n[model]\ndtype = "float32"\n')
    cfg = load_config(path, env=None)
    assert cfg.scheduler.max_num_seqs == 8
    assert cfg.scheduler.max_num_batched_tokens == 2048  # untouched sibling keeps its default
    assert cfg.model.dtype == "float32"
    assert cfg.cache == CacheConfig()


def test_env_overrides_file_and_parses_scalars(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[scheduler]\nmax_num_seqs = 8\n")
    env = {
        "TOKENLOOM_SCHEDULER__MAX_NUM_SEQS": "16",
        "TOKENLOOM_CACHE__GPU_MEMORY_UTILIZATION": "0.5",
        "TOKENLOOM_MODEL__DTYPE": "bfloat16",  # not TOML → taken as a string
        "TOKENLOOM_MODEL__MODEL": "123",  # string-typed key keeps the raw string
        "TOKENLOOM_LOG_LEVEL": "debug",  # no "__": not config, ignored
        "HOME": "/root",
    }
    cfg = load_config(path, env=env)
    assert cfg.scheduler.max_num_seqs == 16
    assert cfg.cache.gpu_memory_utilization == 0.5
    assert cfg.model.dtype == "bfloat16"
    assert cfg.model.model == "123"


def test_env_is_read_from_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_SCHEDULER__MAX_DECODE_SKIP", "7")
    assert load_config().scheduler.max_decode_skip == 7


def test_env_overrides_ignores_other_variables():
    assert env_overrides({"PATH": "/bin", "TOKENLOOM_X": "1"}) == {}


def test_overrides_win_over_env_dotted_and_nested():
    env = {"TOKENLOOM_SCHEDULER__MAX_NUM_SEQS": "16"}
    cfg = load_config(
        overrides={"scheduler.max_num_seqs": 4, "cache": {"block_size": 64}}, env=env
    )
    assert cfg.scheduler.max_num_seqs == 4
    assert cfg.cache.block_size == 64


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("scheduler.max_num_seqs", 0, ">= 1 and <= 4096"),
        ("scheduler.max_num_seqs", 5000, ">= 1 and <= 4096"),
        ("scheduler.max_num_batched_tokens", 8, ">= 16 and <= 1000000"),
        ("scheduler.max_decode_skip", 0, ">= 1 and <= 1000"),
        ("scheduler.max_waiting", 0, ">= 1"),
        ("scheduler.preemption_mode", "evict", "one of 'auto', 'recompute', 'swap'"),
        ("scheduler.chunking", "dynamic", "one of 'slo', 'static'"),
        ("scheduler.kv_watermark", 0.9, ">= 0.0 and <= 0.5"),
        ("scheduler.min_prefill_chunk", -1, ">= 0 and <= 1000000"),
        ("cache.block_size", 24, "one of 8, 16, 32, 64, 128"),
        ("cache.kv_cache_memory_bytes", 1000, ">= 1048576"),
        ("cache.gpu_memory_utilization", 0.0, "> 0.0 and < 1.0"),
        ("cache.gpu_memory_utilization", 1.0, "> 0.0 and < 1.0"),
        ("cache.num_blocks", -1, ">= 0"),
        ("model.dtype", "int8", "one of 'auto', 'bfloat16', 'float16', 'float32'"),
        ("model.device", "tpu", "auto, cpu, cuda or cuda:N"),
        ("model.max_model_len", -1, ">= 0"),
        ("model.seed", -1, ">= 0"),
        ("model.num_threads", 1025, ">= 0 and <= 1024"),
        ("model.model", "", "at least 1 character"),
        ("scheduler.max_num_seqs", "8x", "an integer >= 1 and <= 4096"),
        ("scheduler.max_num_seqs", 8.0, "an integer"),
        ("cache.block_size", True, "one of 8, 16"),
    ],
)
def test_bad_value_message_names_dotted_key_and_range(key, value, allowed):
    with pytest.raises(ConfigError) as info:
        load_config(overrides={key: value}, env=None)
    message = str(info.value)
    assert message.startswith(f"config error: {key} must be ")
    assert allowed in message
    assert f"got {value!r}" in message
    assert info.value.key == key


def test_example_message_is_exact():
    expected = r"^config error: scheduler\.max_num_seqs must be >= 1 and <= 4096, got 0$"
    with pytest.raises(ConfigError, match=expected):
        load_config(overrides={"scheduler.max_num_seqs": 0}, env=None)


def test_bad_env_value_names_dotted_key():
    with pytest.raises(ConfigError, match=r"cache\.block_size must be one of"):
        load_config(env={"TOKENLOOM_CACHE__BLOCK_SIZE": "17"})


def test_unknown_key_lists_allowed_keys(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[cache]\nblok_size = 16\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env=None)
    assert str(info.value) == (
        "config error: unknown key cache.blok_size (allowed: block_size, "
        "kv_cache_memory_bytes, gpu_memory_utilization, num_blocks, enable_prefix_caching, "
        "hybrid_kv, "
        "swap_space_bytes, kv_dtype, k_dtype, v_dtype, kv_rotation, force_kv_dtype, "
        "kv_check_fraction, "
        "kv_check_max_kl, kv_check_max_error, kv_promote_layers)"
    )


def test_unknown_section_lists_allowed_sections():
    allowed = (r"unknown section sched \(allowed: model, cache, scheduler, server, graphs, admin, "
               r"speculative, kv_events, kv_tiers, workers, record, lora, kv_transfer\)")
    with pytest.raises(ConfigError, match=allowed):
        load_config(env={"TOKENLOOM_SCHED__MAX_NUM_SEQS": "8"})


def test_section_must_be_a_table():
    with pytest.raises(ConfigError, match=r"^config error: model must be a table, got 'x'$"):
        load_config(overrides={"model": "x"}, env=None)


def test_unreadable_or_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml", env=None)
    bad = tmp_path / "bad.toml"
    bad.write_text("[cache\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad, env=None)


def test_cross_field_rule_names_both_keys():
    overrides = {"scheduler.max_num_seqs": 100, "scheduler.max_num_batched_tokens": 64}
    for make in (
        lambda: load_config(overrides=overrides, env=None),
        lambda: SchedulerConfig(max_num_seqs=100, max_num_batched_tokens=64),
    ):
        with pytest.raises(ConfigError) as info:
            make()
        assert "scheduler.max_num_batched_tokens" in str(info.value)
        assert "scheduler.max_num_seqs" in str(info.value)


def test_direct_construction_validates():
    assert EngineConfig(cache=CacheConfig(block_size=32)).cache.block_size == 32
    with pytest.raises(ConfigError, match=r"cache\.block_size must be one of 8, 16, 32, 64, 128"):
        CacheConfig(block_size=33)
    with pytest.raises(ConfigError, match=r"scheduler\.max_num_seqs must be >= 1 and <= 4096"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match=r"model\.num_threads must be an integer"):
        ModelConfig(num_threads="4")
    with pytest.raises(ConfigError, match=r"cache must be a CacheConfig"):
        EngineConfig(cache={"block_size": 32})


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_structs_are_frozen_and_reject_unknown_fields():
    cfg = EngineConfig()
    with pytest.raises(AttributeError):
        cfg.scheduler.max_num_seqs = 8
    with pytest.raises(AttributeError):
        cfg.cache = CacheConfig()
    with pytest.raises(TypeError):
        CacheConfig(blok_size=16)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"blok_size": 16}, CacheConfig)


def test_resolve_cache_dir():
    home = pathlib.Path("~").expanduser()
    assert resolve_cache_dir(ModelConfig(), env={}) == home / ".cache" / "tokenloom"
    assert resolve_cache_dir(ModelConfig(), env={"XDG_CACHE_HOME": ""}) == (
        home / ".cache" / "tokenloom"
    )
    assert resolve_cache_dir(EngineConfig(), env={"XDG_CACHE_HOME": "/x"}) == pathlib.Path(
        "/x/tokenloom"
    )
    cfg = ModelConfig(cache_dir="~/weights")
    assert resolve_cache_dir(cfg, env={"XDG_CACHE_HOME": "/x"}) == home / "weights"


def test_config_package_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, tokenloom.config.load; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
