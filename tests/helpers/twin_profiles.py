"""A small host profile for the fleet twin's tests (bench/twin): one model, two slots, fast
enough that a test's runs take virtual seconds."""

from __future__ import annotations

from twin.shapes import HostProfile, ModelProfile

MODEL = ModelProfile(
    "chat", size_gb=5.0, load_s=4.0, prefill_tps=2000.0, decode_tps=(50.0, 45.0),
    restore_tps=100_000.0, kv_bytes_per_token=1024 * 1024,
)  # fmt: skip
PROFILE = HostProfile("test", slots=2, cache_ram_mib=50_000, memory_gb=48.0, models_max=1,
                      models={"chat": MODEL})  # fmt: skip
