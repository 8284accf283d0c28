"""Whether a host would serve a request for a model it lists (`routing.live_fleet.not_loaded`):
the model loaded there, or the host loads models on demand, by its own word (a router's
/props) before the operator's setting. A load under way serves nothing yet."""

from __future__ import annotations

import pytest

from hosts.describe import Described, ModelState
from hosts.health import HostHealth, HostState
from routing.config.shape import HostConfig, ModelConfig
from routing.live_fleet import not_loaded


def host(setting: bool | None = None) -> HostConfig:
    model = ModelConfig(name="a", upstream_name="", parallel=1, queue_max=4, aliases=("alias",))
    return HostConfig(name="gpu1", url="http://gpu1", weight=1.0, enabled=True, draining=False,
                      api_key="", models={"a": model}, loads_on_demand=setting)  # fmt: skip


def health(state: ModelState | None, autoload: bool | None = None) -> HostHealth:
    """A router listing "a" in `state` (None: not listed), saying `autoload` of itself."""
    models = {"a": state} if state is not None else {}
    described = Described(router=True, autoload=autoload, models=models)
    return HostHealth(state=HostState.UP, loaded=described.loaded, described=described)


def answers(config: HostConfig, model: str, said: HostHealth) -> bool:
    return not_loaded(config, model, said) == ""


def test_a_model_loaded_is_served_by_a_host_that_loads_none_on_demand():
    assert answers(host(False), "a", health(ModelState.LOADED, autoload=False))


@pytest.mark.parametrize(
    ("state", "why"),
    [
        (ModelState.LOADING, "loading"),  # its instance answers 503 "Loading model" until loaded
        (ModelState.UNLOADED, "unloaded"),
        (ModelState.FAILED, "unloaded"),
        (None, "unloaded"),
    ],
)
def test_a_model_not_loaded_is_served_only_by_a_host_that_loads_on_demand(state, why):
    assert answers(host(), "a", health(state, autoload=True))
    assert not_loaded(host(), "a", health(state, autoload=False)) == why


def test_the_hosts_own_word_wins_over_the_operators_setting():
    assert answers(host(False), "a", health(ModelState.UNLOADED, autoload=True))
    assert not answers(host(True), "a", health(ModelState.UNLOADED, autoload=False))


@pytest.mark.parametrize(("setting", "served"), [(None, True), (True, True), (False, False)])
def test_a_host_that_does_not_say_is_taken_at_the_operators_word(setting, served):
    assert answers(host(setting), "a", health(ModelState.UNLOADED)) is served


def test_a_model_loaded_under_its_alias_is_loaded():
    loaded = Described(router=True, autoload=False, models={"alias": ModelState.LOADED})
    said = HostHealth(state=HostState.UP, loaded=loaded.loaded, described=loaded)

    assert answers(host(False), "a", said)


def test_a_host_that_has_not_said_which_models_it_has_is_taken_to_have_them():
    assert answers(host(False), "a", HostHealth())
