"""One settings file, driven by the environment.

Defaults are safe for the embedded mode (SQLite, a throwaway secret; DEBUG only when asked
for, so that a newcomer's mistyped URL gets the product's 404 page, not Django's list of every
URL pattern, and an error no traceback). Production sets
GPUCP_ENV=production, which makes a missing SECRET_KEY or DATABASE_URL a hard error instead
of a silent fallback.
"""

import os
from pathlib import Path

import dj_database_url
from csp.constants import NONE, SELF, UNSAFE_INLINE
from django.core.exceptions import ImproperlyConfigured

from agents.logcontext import check_format as check_log_format

BASE_DIR = Path(__file__).resolve().parent.parent


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if value in (None, "") else float(value)


PRODUCTION = os.environ.get("GPUCP_ENV", "embedded") == "production"


def required(name: str, embedded_default: str) -> str:
    value = os.environ.get(name)
    if value:
        return value
    if PRODUCTION:
        raise ImproperlyConfigured(f"{name} must be set when GPUCP_ENV=production")
    return embedded_default


SECRET_KEY = required("SECRET_KEY", "embedded-mode-insecure-secret-key-do-not-use-in-production")
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = [
    h for h in os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost,testserver").split(",") if h
]
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o]

# Transport security (docs/deployment.md). Production is served over HTTPS by a TLS proxy in
# front of gunicorn: cookies never travel in clear text, browsers remember to use HTTPS (HSTS),
# and a request that reached the app over plain HTTP is redirected. Each can be turned off by
# its variable, which `manage.py check --deploy` then reports.
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", PRODUCTION)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", PRODUCTION)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", PRODUCTION)
SECURE_HSTS_SECONDS = int(
    os.environ.get("SECURE_HSTS_SECONDS", 365 * 24 * 3600 if PRODUCTION else 0)
)
# A domain whose subdomains still serve plain HTTP must not include them (nor preload).
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", PRODUCTION)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", PRODUCTION)


def proxy_ssl_header(value: str) -> tuple[str, str] | None:
    """The header in Django's form: 'X-Forwarded-Proto: https' -> ('HTTP_X_FORWARDED_PROTO',
    'https'); a name alone expects "https"; empty means no proxy is trusted."""
    if not value.strip():
        return None
    name, _, expected = value.partition(":")
    return "HTTP_" + name.strip().upper().replace("-", "_"), expected.strip() or "https"


# Which request header says the client spoke HTTPS to the TLS proxy. Only safe when that proxy
# always sets (or strips) it: a client reaching gunicorn directly could otherwise claim HTTPS.
# Hence no default: the operator names the header their proxy sets.
SECURE_PROXY_SSL_HEADER = proxy_ssl_header(os.environ.get("SECURE_PROXY_SSL_HEADER", ""))

# Content-Security-Policy, in every mode. Pages load only this site's own files: no inline
# <script> or <style>, no eval (htmx runs with allowEval off, see frontend/base.html) and no CDN
# (Swagger UI comes from drf_spectacular_sidecar). Inline style *attributes* stay allowed: the
# usage and budget bars are sized by them, and a style attribute cannot run script.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF],
        "style-src": [SELF],
        "style-src-attr": [UNSAFE_INLINE],
        "img-src": [SELF, "data:"],
        "connect-src": [SELF],
        "object-src": [NONE],
        "base-uri": [NONE],
        "form-action": [SELF],
        "frame-ancestors": [NONE],
    }
}

INSTALLED_APPS = [
    "django.contrib.admin",
    # Before django.contrib.auth, whose createsuperuser it replaces (validates scripted passwords).
    "controlplane.passwords",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    # Swagger UI's files served by us, not a CDN: the Content-Security-Policy allows only 'self'.
    "drf_spectacular_sidecar",
    "csp",
    "django_htmx",
    "axes",
    "controlplane.audit",
    "controlplane.tenancy",
    "controlplane.cluster",
    "controlplane.storage",
    "controlplane.jobs",
    "controlplane.scheduling",
    "controlplane.accounting",
    "frontend",
]

MIDDLEWARE = [
    # First: its time covers the whole stack, and it counts what other middleware answers too.
    "controlplane.http_metrics.RequestMetricsMiddleware",
    # A view that fails because PostgreSQL cannot answer is a 503 with Retry-After, not a 500.
    "controlplane.unavailable.DatabaseUnavailableMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # In every mode, so the tests and `make run` exercise the policy production serves.
    # django-csp's, with the header of a plain response built once.
    "controlplane.content_security.CSPMiddleware",
    # gunicorn serves no files: WhiteNoise answers /static/ from STATIC_ROOT (collectstatic).
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # Django's, with the message storage made only for a request that uses it (not the API's).
    "controlplane.lazy_messages.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # The web UI's pages refuse NUL in any parameter with a 400 page (the API has its own check).
    "frontend.middleware.UnstorableTextMiddleware",
    # Last: turns a sign-in refused for too many failures into the sign-in page saying so.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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
    "default": dj_database_url.parse(
        required("DATABASE_URL", f"sqlite:///{BASE_DIR / 'var' / 'embedded.sqlite3'}"),
        conn_max_age=int(os.environ.get("DB_CONN_MAX_AGE", "60")),
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The embedded mode runs web, scheduling loop and agent API in one process with threads;
    # a generous busy timeout turns SQLite's writer lock into a short wait, not an error.
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 20
    # A transaction that reads, then writes, would fail at once (not wait) if another thread
    # wrote in between; taking the writer lock at BEGIN makes it wait its turn instead.
    DATABASES["default"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE"
    DATABASES["default"]["CONN_MAX_AGE"] = 0
else:
    # A database host that vanished must turn into an error in seconds, not the kernel's TCP
    # timeout: heartbeats then take their degraded path and nodes keep their leases.
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("connect_timeout", 5)
    if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        # Django's backend, whose health check (on at every request) reads what the server
        # sent on the idle connection instead of a SELECT 1: a connection PostgreSQL closed
        # when it restarted is replaced, not used to fail a request (controlplane/postgresql).
        DATABASES["default"]["ENGINE"] = "controlplane.postgresql"
        DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
    # Parameters sent apart from the statement (server-side binding), so that psycopg prepares a
    # statement a connection has run 5 times and PostgreSQL plans it once, not on every run:
    # planning the heartbeat's and the cycle's joins cost PostgreSQL more CPU than running them
    # (bench_throughput with pg_stat_statements.track_planning: 12.4 s planning, 10.4 s
    # executing). DB_PREPARED_STATEMENTS=0 turns it off, for a pooler in transaction mode that
    # cannot keep prepared statements (PgBouncer before 1.21, or without max_prepared_statements).
    # bulk.server_cursor reads DB_PREPARED_STATEMENTS too: with 0, nothing is prepared at all.
    DB_PREPARED_STATEMENTS = os.environ.get("DB_PREPARED_STATEMENTS", "1") != "0"
    if DB_PREPARED_STATEMENTS:
        DATABASES["default"]["OPTIONS"]["server_side_binding"] = True
        # Django turns psycopg's preparing off unless told (poolers again); 5 is psycopg's own.
        DATABASES["default"]["OPTIONS"]["prepare_threshold"] = 5
    # DB_POOL_MAX_SIZE > 0: a pool of at most that many connections per process, shared by its
    # threads, instead of one persistent connection per thread. A web process's threads mostly
    # hold agents' watches (long polls of up to 30 s); with the pool a watch gives its
    # connection back while it waits, so PostgreSQL's max_connections bounds the requests
    # being answered, not the agents connected. Set it for the web processes (gunicorn forks
    # its workers before any connection is made); a forking Celery worker keeps the default.
    DB_POOL_MAX_SIZE = int(os.environ.get("DB_POOL_MAX_SIZE") or 0)
    if DB_POOL_MAX_SIZE < 0:
        raise ImproperlyConfigured("DB_POOL_MAX_SIZE must be 0 (no pool) or more.")
    if DB_POOL_MAX_SIZE:
        DATABASES["default"]["OPTIONS"]["pool"] = {
            "min_size": min(2, DB_POOL_MAX_SIZE),
            "max_size": DB_POOL_MAX_SIZE,
            # A request that finds no connection to be had (all busy, or the database down:
            # the pool cannot tell) waits this long, then fails as if the connection had been
            # refused (a heartbeat is answered degraded, its lease renewed in Redis; the
            # agent API skips the database for a moment after: agent_api.PooledDatabaseDown).
            "timeout": float(os.environ.get("DB_POOL_TIMEOUT_S") or 2),
            # Connections above min_size that sat unused this long are closed.
            "max_idle": 300.0,
            # The pool's attempts to replace a connection back off exponentially while the
            # database is down (1, 2, 4... s); bounded thus, the next request after an outage
            # starts a fresh attempt instead of waiting out a backoff grown during it.
            "reconnect_timeout": 2.0,
        }
        # Pooled connections go back to the pool at the end of every request (Django refuses
        # persistent connections with a pool), and each is checked (an empty query) when it
        # is taken, so one broken by a PostgreSQL restart is replaced instead of failing a
        # request.
        DATABASES["default"]["CONN_MAX_AGE"] = 0
        DATABASES["default"]["CONN_HEALTH_CHECKS"] = True

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- sign-in, passwords, API tokens and request rates -------------------------------------------
# Wherever a password is set (admin, createsuperuser, changepassword, the demo): Django's standard
# validators, 12 characters at least.
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {
        "NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
        "OPTIONS": {"min_length": 12},
    },
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Sign-in lockout (django-axes) for the web sign-in form and the Django admin's: after
# LOGIN_FAILURE_LIMIT wrong passwords for one username from one address, that pair is refused,
# right password or not, until LOGIN_COOLOFF_S pass without another try. By username *and*
# address: locking a username everywhere would let anyone lock a victim out from afar, and
# locking an address would lock out a whole office behind one NAT. Failures are rows in the
# database (AxesDatabaseHandler), so every web process sees them; a success clears them.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = int(os.environ.get("LOGIN_FAILURE_LIMIT", "10"))
AXES_COOLOFF_TIME = env_float("LOGIN_COOLOFF_S", 900.0) / 3600  # axes reads a float as hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_CLIENT_IP_CALLABLE = "controlplane.tenancy.throttling.client_ip"
AXES_LOCKOUT_CALLABLE = "frontend.signin.locked_out"
# Behind a reverse proxy, how many proxies append to X-Forwarded-For: the client's address for
# lockouts and rates is the one the outermost of them saw. 0: REMOTE_ADDR (no proxy trusted).
NUM_PROXIES = int(os.environ.get("NUM_PROXIES", "0"))

# No API token lives longer than this (days), whoever issues it and however; lowering it also
# shortens tokens issued before. Join tokens have their own, shorter cap (30 days).
API_TOKEN_MAX_LIFETIME_DAYS = int(os.environ.get("API_TOKEN_MAX_LIFETIME_DAYS", "90"))
# How long a tenant admin's invitation may be accepted.
INVITATION_TTL_DAYS = int(os.environ.get("INVITATION_TTL_DAYS", "14"))

# Every Redis key of this deployment begins with this (controlplane/redis_client.py). Deployments
# that share one Redis database have node ids, node names and usernames in common, so their
# prefixes must differ. Empty: "gpucp:" and the name of the PostgreSQL database.
REDIS_KEY_PREFIX = os.environ.get("REDIS_KEY_PREFIX", "")

# The user API's request rates (controlplane/tenancy/throttling.py): per person, per address for
# anonymous requests, and failed bearer-token checks per address. Counted in this cache: Redis when
# there is one, so all web processes share the counts.
API_THROTTLE_RATES = {
    "user": os.environ.get("API_THROTTLE_USER_RATE", "1800/minute"),
    "anon": os.environ.get("API_THROTTLE_ANON_RATE", "120/minute"),
    "bearer_failure": os.environ.get("API_THROTTLE_BEARER_FAILURE_RATE", "30/minute"),
}
if os.environ.get("REDIS_URL"):
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": os.environ["REDIS_URL"],
            # A person of the same name in another deployment on this Redis counts on their own.
            "KEY_PREFIX": REDIS_KEY_PREFIX or f"gpucp:{DATABASES['default']['NAME']}",
            # A Redis that stopped answering costs a request half a second, not the socket's
            # default wait: the rate limits then let requests through (throttling.py).
            "OPTIONS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
        }
    }
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(os.environ.get("STATIC_ROOT", BASE_DIR / "var" / "static"))
# WhiteNoise scans STATIC_ROOT at start and warns on every request when it is missing; before
# the first collectstatic an empty folder is the honest state.
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    # Hashed, compressed names (cached for good by browsers) need collectstatic first, which the
    # image runs; the embedded mode and the tests serve the files as they are in the apps.
    "staticfiles": {
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
        if PRODUCTION
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}
# Outside production WhiteNoise serves the apps' files where they are (no collectstatic), and
# picks up edits, DEBUG or not: it then looks every request's path up in the static folders.
# WHITENOISE_AUTOREFRESH=0 reads them once at start, as production does (the throughput
# benchmark, which measures the production path's cost per request).
WHITENOISE_USE_FINDERS = not PRODUCTION
WHITENOISE_AUTOREFRESH = env_bool("WHITENOISE_AUTOREFRESH", not PRODUCTION)
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "controlplane.tenancy.auth.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # Every body is checked once, here: no text PostgreSQL cannot store, no number past 64 bits,
    # no NaN, no JSON deeper than 64 levels; a 400 naming the field (controlplane/parsers.py).
    "DEFAULT_PARSER_CLASSES": [
        "controlplane.parsers.JSONParser",
        "controlplane.parsers.FormParser",
        "controlplane.parsers.MultiPartParser",
    ],
    # limit 1 to 1000, offset a whole number: anything else is a 400 naming it.
    "DEFAULT_PAGINATION_CLASS": "controlplane.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "controlplane.filters.OrderingFilter",
    ],
    "DEFAULT_SCHEMA_CLASS": "controlplane.schema.ControlPlaneAutoSchema",
    "EXCEPTION_HANDLER": "controlplane.api.exception_handler",
    "DEFAULT_THROTTLE_CLASSES": [
        "controlplane.tenancy.throttling.AnonThrottle",
        "controlplane.tenancy.throttling.UserThrottle",
    ],
    "DEFAULT_THROTTLE_RATES": API_THROTTLE_RATES,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "GPU control plane API",
    "DESCRIPTION": "Tenants, quotas, budgets, nodes, GPUs and jobs of a multi-tenant GPU cluster.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # Served from our own static files (drf_spectacular_sidecar): the CSP allows no CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # Several models have a field named "state" with different choices; name each set.
    "ENUM_NAME_OVERRIDES": {
        "JobStateEnum": "controlplane.jobs.models.JobState",
        "AttemptStateEnum": "controlplane.jobs.models.AttemptState",
        "NodeStateEnum": "controlplane.cluster.models.NodeState",
        "RoleEnum": "controlplane.tenancy.models.Role",
    },
}

REDIS_URL = os.environ.get("REDIS_URL", "")
CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_QUEUE", "gpucp")
# Celery's Django fixup closes every database connection before and after each task unless
# this is set (it then closes them every 2 x this many tasks): each scheduling cycle paid for a
# new PostgreSQL backend, and planned every statement again since no prepared statement
# outlived a cycle. controlplane.celery closes them as Django closes a request's instead
# (broken, or past CONN_MAX_AGE) and checks a kept one before a task uses it.
CELERY_DB_REUSE_MAX = 1_000_000

# Scheduling loop (controlplane/wakeups.py). The periodic tick is a floor: submits, cancels and
# job ends request an extra cycle, at once when no requested cycle is running, else
# SCHEDULER_DEBOUNCE_S after the running one started, shared by every request until it starts.
# A requested cycle that has not started SCHEDULER_REQUEST_GRACE_S after it was due is taken
# for lost (its worker died with it): the next request queues another.
SCHEDULER_CYCLE_INTERVAL_S = env_float("SCHEDULER_CYCLE_INTERVAL_S", 5.0)
SCHEDULER_DEBOUNCE_S = env_float("SCHEDULER_DEBOUNCE_S", 0.5)
SCHEDULER_REQUEST_GRACE_S = env_float("SCHEDULER_REQUEST_GRACE_S", 2 * SCHEDULER_CYCLE_INTERVAL_S)
if SCHEDULER_DEBOUNCE_S < 0 or SCHEDULER_REQUEST_GRACE_S <= 0:
    raise ImproperlyConfigured("SCHEDULER_DEBOUNCE_S must be >= 0, SCHEDULER_REQUEST_GRACE_S > 0")
SCHEDULER_EMBEDDED = env_bool("SCHEDULER_EMBEDDED", False)
# Overrides of the policy's switches (scheduler.model.Config), by field name.
SCHEDULER_POLICY: dict[str, object] = {}
if "SCHEDULER_MIN_RUNTIME_S" in os.environ:
    # Attempts younger than this are never preempted (no thrashing); the core's default is 60 s.
    SCHEDULER_POLICY["min_runtime_s"] = env_float("SCHEDULER_MIN_RUNTIME_S", 60.0)
if os.environ.get("SCHEDULER_MAX_PREEMPTIONS", ""):
    # A job preempted this many times is not preempted again and then runs only within its
    # tenant's guarantee (docs/job-contract.md); unset: the core's default (5), "none": no bound.
    _max_preemptions: int | None = None
    if os.environ["SCHEDULER_MAX_PREEMPTIONS"].strip().lower() != "none":
        try:
            _max_preemptions = int(os.environ["SCHEDULER_MAX_PREEMPTIONS"])
        except ValueError:
            raise ImproperlyConfigured(
                "SCHEDULER_MAX_PREEMPTIONS must be a whole number, or none for no bound"
            ) from None
        if _max_preemptions < 0:
            raise ImproperlyConfigured("SCHEDULER_MAX_PREEMPTIONS must be 0 or more")
    SCHEDULER_POLICY["max_preemptions"] = _max_preemptions

# Node liveness (docs/agent-protocol.md, "Leases"). A node silent for
# NODE_NOT_READY_AFTER_INTERVALS heartbeat intervals gets no new work. Each answered heartbeat
# renews the node's lease of NODE_LEASE_S; an agent that cannot renew it stops its own attempts
# before it runs out, and the control plane declares them lost only NODE_LEASE_MARGIN_S after
# that, counting silence only while it could itself hear (its own outages never count).
AGENT_HEARTBEAT_INTERVAL_S = env_float("AGENT_HEARTBEAT_INTERVAL_S", 10.0)
NODE_NOT_READY_AFTER_INTERVALS = 3
NODE_LEASE_S = env_float("NODE_LEASE_S", 120.0)
NODE_LEASE_MARGIN_S = env_float("NODE_LEASE_MARGIN_S", 10.0)
# How long before its lease runs out a node's fence has killed every attempt (told to agents).
NODE_FENCE_MARGIN_S = env_float("NODE_FENCE_MARGIN_S", max(1.0, 0.05 * NODE_LEASE_S))
# A sweep that did not run for this long means the control plane was not listening: every node
# then gets a whole lease again. Likewise when no node at all was heard for this long.
LIVENESS_SWEEP_GAP_S = env_float(
    "LIVENESS_SWEEP_GAP_S", max(3 * AGENT_HEARTBEAT_INTERVAL_S, NODE_LEASE_S / 4)
)
LIVENESS_DEAF_AFTER_S = NODE_NOT_READY_AFTER_INTERVALS * AGENT_HEARTBEAT_INTERVAL_S
# A web process answers heartbeats from its cache only while the liveness it buffers reaches
# the database within this (else it writes each one in the request): the lease margin covers it.
LIVENESS_BACKLOG_MAX_S = env_float("LIVENESS_BACKLOG_MAX_S", min(3.0, NODE_LEASE_MARGIN_S / 2))
if NODE_LEASE_S < 4 * AGENT_HEARTBEAT_INTERVAL_S:
    # A lease of a few heartbeats would fence healthy nodes on one slow answer.
    raise ImproperlyConfigured("NODE_LEASE_S must be at least 4 heartbeat intervals")
if (
    NODE_LEASE_MARGIN_S + NODE_FENCE_MARGIN_S
    < AGENT_HEARTBEAT_INTERVAL_S + LIVENESS_BACKLOG_MAX_S + 1
):
    # The timing argument of docs/agent-protocol.md ("Leases"): the last renewal a node was
    # answered may be a heartbeat interval plus a batch newer than the last one recorded (a web
    # process killed before its batch), and the hosts' clocks may differ by a second.
    raise ImproperlyConfigured(
        "NODE_LEASE_MARGIN_S + NODE_FENCE_MARGIN_S must be at least one heartbeat interval "
        "+ LIVENESS_BACKLOG_MAX_S + 1 s"
    )
# Preemption notice: a job stopped for any reason (preempted, drained, cancelled, over its
# runtime) gets its signal, then this many seconds, then SIGKILL. A job may ask for 0 up to the
# maximum. The node's fence starts the grace that long before the lease runs out, so a grace
# longer than the lease's slack would stop healthy jobs whenever one heartbeat is late.
_GRACE_ROOM_S = max(0.0, NODE_LEASE_S - NODE_FENCE_MARGIN_S - LIVENESS_DEAF_AFTER_S)
PREEMPTION_GRACE_MAX_S = env_float("PREEMPTION_GRACE_MAX_S", min(60.0, _GRACE_ROOM_S))
# The fence signals a quiet node's jobs their grace before the lease runs out, so a job's grace
# is taken from the control-plane outage its node rides out: the default keeps at least three
# quarters of the lease (84 s of 120 s with the defaults) for that, whatever the lease is.
PREEMPTION_GRACE_DEFAULT_S = env_float(
    "PREEMPTION_GRACE_DEFAULT_S", min(30.0, PREEMPTION_GRACE_MAX_S, NODE_LEASE_S / 4)
)
if not 0 <= PREEMPTION_GRACE_DEFAULT_S <= PREEMPTION_GRACE_MAX_S:
    raise ImproperlyConfigured("PREEMPTION_GRACE_DEFAULT_S must be between 0 and the maximum")
if PREEMPTION_GRACE_MAX_S > _GRACE_ROOM_S:
    raise ImproperlyConfigured(
        "PREEMPTION_GRACE_MAX_S must leave the lease room for three missed heartbeats: at most "
        "NODE_LEASE_S - NODE_FENCE_MARGIN_S - 3 heartbeat intervals (raise NODE_LEASE_S)"
    )
# How work lost to a preemption is counted: GPU-seconds since the victim's last checkpoint plus
# this restart cost (loading the image, the data and the checkpoint again).
PREEMPTION_RESTART_COST_S = env_float("PREEMPTION_RESTART_COST_S", 60.0)
SCHEDULER_POLICY["restart_cost_s"] = PREEMPTION_RESTART_COST_S

# While the database cannot be reached, a web process still renews the leases of node tokens
# it checked against the database within this long (recorded in Redis for the sweep).
DEGRADED_TOKEN_TRUST_S = env_float("DEGRADED_TOKEN_TRUST_S", 3600.0)

# The largest job array any tenant may be allowed (Tenant.max_array_size, set by cluster admins,
# is at most this): one array is one request and one transaction.
MAX_ARRAY_SIZE_CEILING = int(env_float("MAX_ARRAY_SIZE_CEILING", 10000))

# How long an Idempotency-Key of a job submit replays its job; expired keys are deleted hourly.
IDEMPOTENCY_KEY_TTL_S = env_float("IDEMPOTENCY_KEY_TTL_S", 24 * 3600.0)

# How long the audit trail keeps a row (who changed which quota, budget, pool, node, membership
# or token); 0 keeps every row for good. Pruned hourly.
AUDIT_RETENTION_DAYS = env_float("AUDIT_RETENTION_DAYS", 365.0)
if AUDIT_RETENTION_DAYS < 0:
    raise ImproperlyConfigured("AUDIT_RETENTION_DAYS must be 0 (keep all) or more")

# How long the scheduling loop's record of its cycles is kept (the overview's charts over time,
# what each cycle decided): a row every few seconds, pruned hourly.
SCHEDULER_CYCLE_RETENTION_DAYS = env_float("SCHEDULER_CYCLE_RETENTION_DAYS", 7.0)
if SCHEDULER_CYCLE_RETENTION_DAYS <= 0:
    raise ImproperlyConfigured("SCHEDULER_CYCLE_RETENTION_DAYS must be more than 0")

CELERY_BEAT_SCHEDULE = {
    "scheduling-cycle": {
        "task": "controlplane.scheduling.tasks.run_cycle",
        "schedule": SCHEDULER_CYCLE_INTERVAL_S,
        # A tick still queued when the next one is due is redundant: drop it, so a worker that
        # was down or slow does not replay a backlog of cycles.
        "options": {"expires": SCHEDULER_CYCLE_INTERVAL_S},
    },
    "budget-warnings": {
        "task": "controlplane.accounting.tasks.check_budgets_task",
        "schedule": 60.0,
    },
    "node-liveness": {
        "task": "controlplane.cluster.tasks.sweep_node_liveness",
        "schedule": AGENT_HEARTBEAT_INTERVAL_S,
    },
    "submit-key-expiry": {
        "task": "controlplane.jobs.tasks.delete_expired_submit_keys",
        "schedule": 3600.0,
    },
    "audit-retention": {
        "task": "controlplane.audit.tasks.prune_audit_trail",
        "schedule": 3600.0,
    },
    "cycle-retention": {
        "task": "controlplane.scheduling.tasks.prune_scheduling_cycles",
        "schedule": 3600.0,
    },
}

# How every process of the control plane (web, Celery worker and beat, manage.py) writes its log
# to stderr: "plain" text lines, or "json", one object per line for a log pipeline
# (docs/deployment.md, "Logs"). Either way a line about one job, attempt, node or tenant carries
# their ids; agents.logcontext, shared with the node agent, binds and formats them.
try:
    LOG_FORMAT = check_log_format(os.environ.get("LOG_FORMAT") or "plain")
except ValueError as exc:
    raise ImproperlyConfigured(str(exc)) from None

LOGGING: dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        # A line without ids reads as it always did; one with ids ends with them, [job=12 ...].
        "plain": {
            "()": "agents.logcontext.PlainFormatter",
            "fmt": "%(asctime)s %(levelname)s %(name)s: %(message)s",
        },
        "json": {"()": "agents.logcontext.JsonFormatter"},
    },
    "filters": {
        "log_context": {"()": "agents.logcontext.ContextFilter"},
        "client_errors_without_traceback": {
            "()": "controlplane.log_filters.ClientErrorsWithoutTraceback"
        },
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": LOG_FORMAT,
            "filters": ["log_context"],
        }
    },
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        # Django's own default config gives "django" a console handler of its own; it also
        # propagated here, so every warning (each 403) was printed twice. One handler, ours.
        "django": {"handlers": ["console"], "level": "INFO", "propagate": False},
        "django.request": {"filters": ["client_errors_without_traceback"]},
    },
}
if LOG_FORMAT == "json":
    # runserver's access lines (the embedded mode) have a handler and format of their own in
    # Django's defaults: in JSON they go through ours, so that every line parses.
    LOGGING["loggers"]["django.server"] = {
        "handlers": ["console"],
        "level": "INFO",
        "propagate": False,
    }

# Bearer token a Prometheus scraper presents at /metrics (admins' sessions work without it).
METRICS_TOKEN = os.environ.get("METRICS_TOKEN", "")
