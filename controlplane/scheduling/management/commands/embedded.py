"""`make run`: the whole system on one machine (SQLite, in-process loop, simulated agents)."""

import os

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Migrate, seed a demo, and serve the control plane with its scheduling loop and simulated agents."

    def add_arguments(self, parser):
        parser.add_argument("--addr", default="127.0.0.1:8000")
        parser.add_argument("--agents", type=int, default=3, help="simulated GPU nodes to start")

    def handle(self, *args, addr: str, agents: int, **options):
        (settings.BASE_DIR / "var").mkdir(exist_ok=True)
        call_command("migrate", interactive=False, verbosity=0)
        from controlplane.demo import seed_demo

        created = seed_demo()
        self.stdout.write(
            self.style.SUCCESS(
                f"Control plane on http://{addr}/  (API docs: http://{addr}/api/docs/)"
            )
        )
        if created:
            self.stdout.write("Demo accounts (passwords shown once; kept only as hashes):")
            for username, password in created.items():
                self.stdout.write(f"  {username:20s} {password}")
        else:
            self.stdout.write(
                "Demo accounts exist already (admin, vision-researcher, nlp-researcher, ...)."
            )
        os.environ.setdefault("SCHEDULER_EMBEDDED", "1")
        call_command("runserver", addr, use_reloader=False)
