"""Where a fleet of router-mode hosts serves its models: the layouts a multi-model run is
judged under (`twin.run.run_models`).

- `static`: an operator's best fixed assignment. Each host holds `models_max` models, loaded
  before the run and never swapped, autoload off; crossbar is told each host's models only,
  so a request for a model goes only to the hosts holding it. The models are dealt out in
  order, host by host, so each is on `hosts * models_max // models` hosts or one more (the
  first models, which the workloads make the most asked for or the slowest, get the extra).
- `cold`: `static`'s assignment started with nothing loaded, each host loading its own models
  when first asked: the operator's best layout paying the same cold start as `fleet`.
- `blind`: `static` dealt from the least asked-for model up, loaded before the run: a fixed
  layout made without knowing the mix.
- `autoload`: what a fleet of router-mode hosts does on its own today. Every host is
  configured with every model, nothing is loaded at the start, and each host loads what its
  requests name (llama-server's default), unloading its least recently used idle model.
- `fleet`: fleet placement. Every host is configured with every model, nothing is loaded at
  the start, autoload is off; an actor (`twin.fleet`) loads and unloads models on the hosts
  as `routing.core.model_placement.decide` says, from what the gateway knows of the demand.
- `warm`: fleet placement started from `static`'s models, loaded before the run: a gateway
  (re)started in front of boxes already serving. Beside `fleet` it splits what the policy
  costs from what starting with nothing loaded costs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["LAYOUTS", "Layout", "autoload", "blind", "cold", "fleet", "static", "warm"]


@dataclass(frozen=True, slots=True)
class Layout:
    """Per host, the models crossbar is told it serves (`serves`) and those loaded before the
    run (`loaded`), by the workload's names for them; whether its hosts load on demand;
    whether fleet placement's actor places the models (`placed`), unloading a model idle for
    `idle_unload` seconds (None: `model_placement`'s default)."""

    name: str
    serves: Mapping[str, tuple[str, ...]]
    loaded: Mapping[str, tuple[str, ...]]
    autoload: bool
    placed: bool = False
    idle_unload: float | None = None


def static(hosts: Sequence[str], models: Sequence[str], models_max: int) -> Layout:
    """Each host's `models_max` models dealt out in turn, loaded, never swapped."""
    per_host = min(models_max, len(models))
    held = {
        host: tuple(models[(number * per_host + k) % len(models)] for k in range(per_host))
        for number, host in enumerate(hosts)
    }
    return Layout("static", held, held, autoload=False)


def blind(hosts: Sequence[str], models: Sequence[str], models_max: int) -> Layout:
    """`static` dealt from the least asked-for model up: an operator's fixed layout made without
    knowing the mix (the extra copies go to the models asked for least), loaded, never
    swapped."""
    held = static(hosts, list(reversed(models)), models_max).serves
    return Layout("blind", held, held, autoload=False)


def cold(hosts: Sequence[str], models: Sequence[str], models_max: int) -> Layout:
    """`static`'s assignment with nothing loaded: each host loads its own models when first
    asked (autoload on, told only those), and never swaps."""
    held = static(hosts, models, models_max).serves
    return Layout("cold", held, {}, autoload=True)


def autoload(hosts: Sequence[str], models: Sequence[str], models_max: int) -> Layout:
    """Every model on every host, none loaded: each host loads what is asked of it."""
    return Layout("autoload", {host: tuple(models) for host in hosts}, {}, autoload=True)


def fleet(hosts: Sequence[str], models: Sequence[str], models_max: int) -> Layout:
    """Every model on every host, none loaded, autoload off: fleet placement loads them."""
    every = {host: tuple(models) for host in hosts}
    return Layout("fleet", every, {}, autoload=False, placed=True)


def warm(hosts: Sequence[str], models: Sequence[str], models_max: int) -> Layout:
    """Every model on every host, `static`'s loaded, autoload off: fleet placement goes on
    from there."""
    loaded = static(hosts, models, models_max).loaded
    every = {host: tuple(models) for host in hosts}
    return Layout("warm", every, loaded, autoload=False, placed=True)


LAYOUTS: dict[str, Callable[[Sequence[str], Sequence[str], int], Layout]] = {
    "static": static,
    "cold": cold,
    "blind": blind,
    "autoload": autoload,
    "fleet": fleet,
    "warm": warm,
}
