"""Django's createsuperuser, with the password of a scripted run validated too."""

import os

from django.contrib.auth.management.commands import createsuperuser
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import CommandError


class Command(createsuperuser.Command):
    def handle(self, *args, **options):
        password = os.environ.get("DJANGO_SUPERUSER_PASSWORD")
        if not options["interactive"] and password:
            fields = {
                name: options.get(name) or os.environ.get(f"DJANGO_SUPERUSER_{name.upper()}")
                for name in (self.UserModel.USERNAME_FIELD, *self.UserModel.REQUIRED_FIELDS)
            }
            try:
                # The same check the interactive prompt makes, against the same account fields.
                validate_password(password, self.UserModel(**fields))
            except ValidationError as exc:
                raise CommandError(
                    "DJANGO_SUPERUSER_PASSWORD refused: " + " ".join(exc.messages)
                ) from None
        return super().handle(*args, **options)
