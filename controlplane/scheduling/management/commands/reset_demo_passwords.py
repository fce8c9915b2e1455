"""`manage.py reset_demo_passwords`: new passwords for the embedded demo's accounts, printed once."""

from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Give the demo accounts (admin, <tenant>-admin, <tenant>-researcher) new passwords."

    def handle(self, *args, **options):
        from controlplane.demo import reset_demo_passwords

        reset = reset_demo_passwords()
        if not reset:
            raise CommandError("There are no demo accounts here: `make run` creates them.")
        self.stdout.write("Demo accounts (new passwords, shown once; kept only as hashes):")
        for username, password in reset.items():
            self.stdout.write(f"  {username:20s} {password}")
