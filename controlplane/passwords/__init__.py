"""Password rules where Django leaves a gap: `createsuperuser --noinput` takes
DJANGO_SUPERUSER_PASSWORD without AUTH_PASSWORD_VALIDATORS; here it is checked like a typed one.

Listed before django.contrib.auth in INSTALLED_APPS, since the first app with a command wins."""
