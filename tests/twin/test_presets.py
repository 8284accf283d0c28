"""The twin's host presets (bench/twin/presets.py): figures a simulation can rely on."""

from __future__ import annotations

import pytest
from twin.presets import PRESETS, UnknownPreset, preset
from twin.shapes import ModelProfile

MODELS = {
    f"{host.name}/{name}": model for host in PRESETS.values() for name, model in host.models.items()
}
models = pytest.mark.parametrize("model", MODELS.values(), ids=MODELS.keys())
hosts = pytest.mark.parametrize("name", PRESETS)


@models
def test_each_stream_decodes_no_faster_as_more_streams_decode_together(model: ModelProfile) -> None:
    rates = model.decode_tps
    assert rates and all(fewer >= more for fewer, more in zip(rates, rates[1:], strict=False))


@models
def test_more_streams_decoding_together_make_no_fewer_tokens_in_all(model: ModelProfile) -> None:
    totals = [n * rate for n, rate in enumerate(model.decode_tps, start=1)]
    assert all(fewer <= more for fewer, more in zip(totals, totals[1:], strict=False))


@models
def test_every_model_has_a_size_a_load_time_and_rates_above_zero(model: ModelProfile) -> None:
    figures = (model.size_gb, model.load_s, model.prefill_tps, model.restore_tps)
    assert min(figures) > 0 and model.kv_bytes_per_token > 0 and min(model.decode_tps) > 0


@hosts
def test_every_preset_and_each_of_its_models_names_where_its_figures_come_from(name: str) -> None:
    host = PRESETS[name]
    assert host.source.strip()
    assert all(model.source.strip() for model in host.models.values())


@hosts
def test_the_largest_models_a_host_may_hold_at_once_fit_its_memory(name: str) -> None:
    host = PRESETS[name]
    sizes = sorted((model.size_gb for model in host.models.values()), reverse=True)
    assert host.models and host.slots >= 1 and host.models_max >= 1
    assert sum(sizes[: host.models_max]) <= host.memory_gb


@hosts
def test_a_preset_is_found_by_its_name_and_its_models_by_theirs(name: str) -> None:
    host = preset(name)
    assert host is PRESETS[name] and host.name == name
    assert all(key == model.name for key, model in host.models.items())


def test_an_unknown_preset_is_a_key_error_that_names_every_preset() -> None:
    with pytest.raises(KeyError) as raised:
        preset("nope")
    assert isinstance(raised.value, UnknownPreset)
    assert str(raised.value) == (
        "no host preset 'nope'; the presets: gpu-70b, gpu-8b, gpu-mixed, tiny"
    )
