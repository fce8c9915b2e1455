# One image for every process of the control plane (web, worker, beat) and for the node agent.
# Build: docker-compose build   (or: docker build -t gpucp .)
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=controlplane.settings

WORKDIR /app
RUN groupadd --system gpucp && useradd --system --gid gpucp --home-dir /app gpucp

# Dependencies first, from the pinned list, so a code change does not reinstall them.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); \
print('\n'.join(d['project']['dependencies']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt

COPY manage.py ./
COPY controlplane ./controlplane
COPY scheduler ./scheduler
COPY agents ./agents
COPY frontend ./frontend
# DEBUG=0: production serves hashed, compressed files (WhiteNoise), whose manifest this writes.
RUN pip install --no-deps . \
 && DEBUG=0 python manage.py collectstatic --noinput --verbosity 0 \
 && mkdir -p /app/var /var/lib/celery \
 && chown -R gpucp:gpucp /app/var /var/lib/celery

# The control-plane processes need no privileges; the agent service runs as root (see
# docker-compose.yml) because it drives the host's container engine and NVML.
USER gpucp
EXPOSE 8000
CMD ["gunicorn", "controlplane.wsgi:application", "--bind", "0.0.0.0:8000", \
     "--worker-class", "gthread", "--workers", "4", "--threads", "32", \
     "--worker-connections", "4000", "--backlog", "4096", "--keep-alive", "75", \
     "--logger-class", "controlplane.gunicorn_logging.Logger"]
