"""`manage.py seed_demo_history`: a generated past week of finished jobs on the nodes there are."""

from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = (
        "Write a generated past of finished jobs for the demo tenants on the registered nodes "
        "(what `make run` does on its first start), so what-if, usage and charts have history. "
        "Once: a second run writes nothing."
    )

    def add_arguments(self, parser):
        parser.add_argument("--days", type=float, default=7.0, help="how far back (default 7)")
        parser.add_argument("--seed", type=int, default=1, help="the generator's seed")

    def handle(self, *args, days: float, seed: int, **options):
        from controlplane.demo import history_seeded, seed_history

        if not 0 < days <= 90:
            raise CommandError("--days must be more than 0 and at most 90")
        if history_seeded():
            self.stdout.write("The demo history is there already; nothing written.")
            return
        jobs = seed_history(days=days, seed=seed)
        if not jobs:
            raise CommandError(
                "Nothing to seed: it needs registered nodes with GPUs and the demo tenants "
                "(vision, nlp) with their researchers (manage.py embedded makes both)."
            )
        self.stdout.write(f"Seeded {jobs} finished jobs over the past {days:g} days.")
