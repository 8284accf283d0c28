from django.apps import AppConfig
from django.core import checks


class RoutingConfig(AppConfig):
    name = "routing"
    verbose_name = "Routing"

    def ready(self) -> None:
        from routing import signals  # noqa: F401  (connects the live-reload receivers)
        from routing.checks import check_configuration

        checks.register(check_configuration, "crossbar", checks.Tags.database)

        from hosts import live, routes_left
        from routing.config.validation import config_from_db, routes_left_without
        from routing.ops.live import live_host_states

        live.provide(live_host_states)
        routes_left.provide(lambda names: routes_left_without(*config_from_db(), names))
