"""Environment parsing with JAX's meanings, and Device.from_env."""

from __future__ import annotations

import pytest

from jaxmem.errors import ConfigError
from jaxmem.runtime.config import config_from_env
from jaxmem.runtime.device import Device
from jaxmem.units import GiB


def test_defaults_match_jax():
    config = config_from_env({})
    assert (config.allocator, config.preallocate, config.mem_fraction) == ("bfc", True, 0.75)


@pytest.mark.parametrize("value,expected", [
    ("false", False), ("False", False), ("0", False),
    ("true", True), ("1", True), ("", True), ("FALSE", True), ("no", True), ("off", True),
])
def test_only_false_False_0_turn_preallocation_off(value, expected):
    assert config_from_env({"XLA_PYTHON_CLIENT_PREALLOCATE": value}).preallocate is expected


@pytest.mark.parametrize("name", ["XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"])
def test_mem_fraction_from_either_name(name):
    assert config_from_env({name: ".5"}).mem_fraction == 0.5


def test_both_fraction_names_is_an_error():
    with pytest.raises(ConfigError, match="deprecated"):
        config_from_env({"XLA_CLIENT_MEM_FRACTION": ".5", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".6"})


@pytest.mark.parametrize("value", ["0", "-0.1", "0.0", "nan", "abc", "inf"])
def test_bad_fractions_are_errors(value):
    with pytest.raises(ConfigError, match="XLA_CLIENT_MEM_FRACTION"):
        config_from_env({"XLA_CLIENT_MEM_FRACTION": value})


def test_fraction_above_one_needs_unified_memory():
    with pytest.raises(ConfigError, match="TF_FORCE_UNIFIED_MEMORY"):
        config_from_env({"XLA_CLIENT_MEM_FRACTION": "1.5"})
    config = config_from_env({"XLA_CLIENT_MEM_FRACTION": "1.5", "TF_FORCE_UNIFIED_MEMORY": "1"})
    assert config.mem_fraction == 1.5 and config.unified_memory
    assert config_from_env({"XLA_CLIENT_MEM_FRACTION": "1"}).mem_fraction == 1.0


@pytest.mark.parametrize("value,expected", [("default", "bfc"), ("bfc", "bfc"), ("platform", "platform"),
                                            ("BFC", "bfc"), ("Platform", "platform")])
def test_allocator_names(value, expected):
    assert config_from_env({"XLA_PYTHON_CLIENT_ALLOCATOR": value}).allocator == expected


def test_cuda_async_is_refused_by_name():
    with pytest.raises(ConfigError, match="cuda_async.*not modelled"):
        config_from_env({"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"})


def test_unknown_allocator_is_refused():
    with pytest.raises(ConfigError, match='got "jemalloc"'):
        config_from_env({"XLA_PYTHON_CLIENT_ALLOCATOR": "jemalloc"})


def test_device_from_env(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    device = Device.from_env("16GiB")
    stats = device.memory_stats()
    assert stats["bytes_limit"] == 8 * GiB and stats["pool_bytes"] == 0 and not device.preallocate
    device.allocate(100)
    assert device.memory_stats()["pool_bytes"] == 2 << 20


def test_device_from_env_platform_and_preallocated():
    device = Device.from_env("h100-80gb", environ={"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})
    assert device.allocator.name == "platform" and device.memory_stats()["pool_bytes"] == 0
    device = Device.from_env("16GiB", environ={})
    assert device.memory_stats()["pool_bytes"] == 12 * GiB


def test_device_from_env_refuses_conflict():
    with pytest.raises(ConfigError, match="deprecated"):
        Device.from_env("16GiB", environ={"XLA_CLIENT_MEM_FRACTION": ".5", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"})
