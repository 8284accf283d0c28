"""crossbar settings, read from the environment (and `.env` when present).

Every variable is documented in `.env.example`.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from routing.core.fairness import DEFAULT_STARVATION_BOUND, Priority
from routing.core.forwarding import trusted_networks
from routing.core.model_placement import DEFAULT_IDLE_UNLOAD

BASE_DIR = Path(__file__).resolve().parent.parent


class _Env(environ.Env):
    """django-environ's reader, with a bad value's error naming its variable: a cast's own
    ValueError says only the value (manage.py prints the message alone, not a traceback)."""

    def get_value(
        self,
        var: str,
        cast: object = None,
        default: object = environ.Env.NOTSET,
        parse_default: bool = False,
    ) -> object:
        try:
            return super().get_value(var, cast=cast, default=default, parse_default=parse_default)
        except ValueError as error:
            raw = self.ENVIRON.get(var, "")
            what = "a whole number" if cast is int else "a number" if cast is float else None
            why = f"it is not {what}" if what else str(error)
            raise ImproperlyConfigured(f"{var}={raw!r} is not valid: {why}") from None

    def fraction(self, var: str, default: float) -> float:
        """A share from 0 to 1."""
        value = self.float(var, default=default)
        if not 0 <= value <= 1:
            raise ImproperlyConfigured(f"{var}={value:g} is not valid: it is a share, from 0 to 1")
        return value

    def headroom(self, var: str, default: str) -> dict[Priority, int]:
        """Slots per class, as `interactive=1,standard=0` (classes left out: none)."""
        raw = self.str(var, default=default)
        headroom: dict[Priority, int] = {}
        for part in filter(None, (item.strip() for item in raw.split(","))):
            name, _, slots = part.partition("=")
            try:
                headroom[Priority(name.strip())] = int(slots)
            except ValueError:
                raise ImproperlyConfigured(
                    f"{var}={raw!r} is not valid: write class=slots, separated by commas "
                    f"(classes: interactive, standard, batch; slots: a whole number)"
                ) from None
            if headroom[Priority(name.strip())] < 0:
                raise ImproperlyConfigured(f"{var}={raw!r} is not valid: slots are 0 or more")
        return headroom


env = _Env()
if (BASE_DIR / ".env").is_file():
    env.read_env(BASE_DIR / ".env", parse_comments=True)

VAR_DIR = Path(env.str("CROSSBAR_VAR_DIR", default="") or BASE_DIR / "var")
VAR_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = env.bool("DEBUG", default=False)


def _secret_key() -> str:
    """The configured key, else one generated once into var/ and reused on every start."""
    configured = env.str("SECRET_KEY", default="")
    if configured:
        return configured
    path = VAR_DIR / "secret_key"
    if not path.is_file():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    # daphne first: its runserver replaces Django's WSGI one, so streams are not buffered.
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "hosts",
    "routing",
    "accounting",
    "crossbar_site",  # the site-wide commands: crossbar_serve, crossbar_setup
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "crossbar_site.urls"
ASGI_APPLICATION = "crossbar_site.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'crossbar.sqlite3'}"),
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # WAL lets the admin read while the recorder writes; IMMEDIATE takes the write lock at
    # BEGIN so two writers queue on the busy timeout instead of failing mid-transaction.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "transaction_mode": "IMMEDIATE",
            "timeout": 20,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    )
    # The test database is a file, not memory: end-to-end tests run the gateway as a real
    # server in another process, which must see the rows the test writes. One file per test
    # run, so two runs side by side do not destroy each other's database.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test_crossbar_{os.getpid()}.sqlite3")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
# One zone and one format for every time shown, in the admin and on the dashboard: the site's
# zone (an IANA name such as Europe/Berlin; UTC by default), as 2025-12-01 14:03:07.
TIME_ZONE = env.str("CROSSBAR_TIME_ZONE", default="UTC")
FORMAT_MODULE_PATH = ["crossbar_site.formats"]
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"

# The dashboard's notices between browsers: in memory for one gateway process, Redis when
# several replicas serve dashboards.
REDIS_URL = env.str("CROSSBAR_REDIS_URL", default="")
# channels-redis waits for a dashboard's messages in a blocking read (BZPOPMIN) of 5 s, on
# redis-py's connections, whose default read timeout (since redis-py 8) is 5 s too: the read
# timed out as Redis answered, and each open dashboard's socket closed with a traceback
# (1011). The read's timeout is set past the blocking read's, so a silent Redis is still seen.
_CHANNEL_REDIS = {"socket_timeout": 15.0, "socket_connect_timeout": 5.0}
CHANNEL_LAYERS = {
    "default": (
        {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [{"address": REDIS_URL, **_CHANNEL_REDIS}]},
        }
        if REDIS_URL
        else {"BACKEND": "channels.layers.InMemoryChannelLayer"}
    )
}

# The gateway's own knobs. Seconds unless the name says otherwise.
CROSSBAR = {
    "CONNECT_TIMEOUT": env.float("CROSSBAR_CONNECT_TIMEOUT", default=3.0),
    "HEADERS_TIMEOUT": env.float("CROSSBAR_HEADERS_TIMEOUT", default=600.0),
    "STREAM_IDLE_TIMEOUT": env.float("CROSSBAR_STREAM_IDLE_TIMEOUT", default=120.0),
    # How long a client's request head may take to arrive whole (crossbar_site/heads.py).
    "HEAD_TIMEOUT": env.float("CROSSBAR_HEAD_TIMEOUT", default=5.0),
    "HEALTH_INTERVAL": env.float("CROSSBAR_HEALTH_INTERVAL", default=5.0),
    "HEALTH_TIMEOUT": env.float("CROSSBAR_HEALTH_TIMEOUT", default=2.0),
    "CONFIG_POLL": env.float("CROSSBAR_CONFIG_POLL", default=2.0),
    "KEEPALIVE": env.float("CROSSBAR_KEEPALIVE", default=10.0),
    # At SIGTERM, how long requests in flight may take to finish (`manage.py crossbar_serve`).
    "SHUTDOWN_GRACE": env.float("CROSSBAR_SHUTDOWN_GRACE", default=30.0),
    # Proxy requests need a client key when this is set or any enabled key exists.
    "REQUIRE_KEY": env.bool("CROSSBAR_REQUIRE_KEY", default=False),
    # Reverse proxies whose X-Forwarded-For / Forwarded the gateway extends (IPs or CIDRs);
    # from any other peer a client's forwarding headers are dropped (routing/core/forwarding.py).
    "TRUSTED_PROXIES": trusted_networks(env.list("CROSSBAR_TRUSTED_PROXIES", default=[])),
    # /metrics answers 401 without `Authorization: Bearer <token>` when this is set.
    "METRICS_TOKEN": env.str("CROSSBAR_METRICS_TOKEN", default=""),
    # The prefix index's size, in (host, block) entries of about 150 bytes: 100,000 are ~15 MB
    # and hold some 6 million prompt tokens over the fleet (routing/core/prefixes.py).
    "PREFIX_INDEX_ENTRIES": env.int("CROSSBAR_PREFIX_INDEX_ENTRIES", default=100_000),
    # How much more load (requests in flight and queued, conversations leased) than the
    # best-ranked host a host holding more of a prompt's opening may carry and still be tried
    # first (routing/core/affinity.py).
    "PREFIX_MARGIN": env.int("CROSSBAR_PREFIX_MARGIN", default=1),
    # Whether a conversation's requests name the llama-server slot it keeps there (`id_slot`,
    # docs/architecture.md "A slot of its own"); off: every host chooses its own slots.
    "NAME_SLOTS": env.bool("CROSSBAR_NAME_SLOTS", default=True),
    # The --slot-prompt-similarity the hosts' llama-servers run with (llama-server's default:
    # 0.1), from which crossbar tells when a request for an empty slot is better left to the
    # host (routing/core/named_slots.py `chooses_the_empty_slot`; docs/config.md).
    "SLOT_PROMPT_SIMILARITY": env.fraction("CROSSBAR_SLOT_PROMPT_SIMILARITY", default=0.1),
    # Slots of each (host, model) pair that a lower class may not take while a request of
    # the class could come: an enabled client key has that class (docs/operating.md;
    # capped at a pair's parallel - 1). The one exception to "a free slot never idles while
    # anyone waits". In-process state only: with CROSSBAR_REDIS_URL lines are first come.
    "HEADROOM": env.headroom("CROSSBAR_HEADROOM", default="interactive=1"),
    # A request that has waited this long in a host's line goes before every class.
    "STARVATION_BOUND": env.float("CROSSBAR_STARVATION_BOUND", default=DEFAULT_STARVATION_BOUND),
    # Fleet model placement (routing/models_actor): seconds a model loaded on a router-mode
    # host that loads none on demand may stay unused before crossbar unloads it (0: never),
    # and seconds a load crossbar started may take before it counts as failed.
    "MODEL_IDLE_UNLOAD": env.float("CROSSBAR_MODEL_IDLE_UNLOAD", default=DEFAULT_IDLE_UNLOAD),
    "MODEL_LOAD_TIMEOUT": env.float("CROSSBAR_MODEL_LOAD_TIMEOUT", default=600.0),
    # With CROSSBAR_REDIS_URL: how long a process's slots outlive it (routing/shared/state.py).
    "REDIS_HOLD_TTL": env.float("CROSSBAR_REDIS_HOLD_TTL", default=5.0),
    # Set: slots, queues, leases and client counts are shared by every process through Redis.
    "REDIS_URL": REDIS_URL,
}

# The proxy accepts request bodies up to 16 MiB (long conversations, images); Django enforces
# the limit while reading, and the proxy answers 413 past it.
DATA_UPLOAD_MAX_MEMORY_SIZE = 16 * 1024 * 1024

_WORKER = f"worker {os.environ['CROSSBAR_WORKER']} " if os.environ.get("CROSSBAR_WORKER") else ""
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # A worker of CROSSBAR_WORKERS (crossbar_site/workers.py) names itself on each line.
    "formatters": {"plain": {"format": f"%(asctime)s {_WORKER}%(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("CROSSBAR_LOG_LEVEL", default="INFO")},
    "loggers": {
        # One line per request: the proxy's own, or the site's access line (crossbar_site/asgi.py).
        "daphne": {"level": "WARNING"},
        "uvicorn": {"level": "WARNING"},
        "django.server": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},  # a line per upstream request and health poll
    },
}
