from django.apps import AppConfig
from django.core import checks


class RoutingConfig(AppConfig):
    name = "routing"
    verbose_name = "Routing"

    def ready(self) -> None:
        from routing import signals  # noqa: F401  (connects the live-reload receivers)
        from routing.checks import check_configuration

        checks.register(check_configuration, "crossbar")

        from hosts import live
        from routing.ops.live import live_host_states

        live.provide(live_host_states)
