"""python manage.py whatif: replay a period of the cluster's own history under a changed config.

Prints the Markdown report (simulated vs what really happened); with --out, writes report.md
and its plots there. See the package controlplane.scheduling.whatif for what each figure means.
"""

from __future__ import annotations

import sys

from django.core.management.base import BaseCommand, CommandError

from controlplane.scheduling.whatif.params import WhatIfError, build_params
from controlplane.scheduling.whatif.replay import run_whatif
from controlplane.scheduling.whatif.report import report_of, summary_json, write_folder
from scheduler.simulator.policies import PRESETS


class Command(BaseCommand):
    help = (
        "Replay the finished jobs of a period through the production scheduler under changed "
        "quotas, weights, power budgets or policy, and compare with what really happened."
    )

    def add_arguments(self, parser):
        parser.add_argument("--since", help="first submit time (YYYY-MM-DD or ISO); 30 days back")
        parser.add_argument("--until", help="end of the period, exclusive; default now")
        parser.add_argument(
            "--policy", default="ours", help=f"policy preset: {', '.join(PRESETS)} (ours)"
        )
        parser.add_argument(
            "--weight", action="append", default=[], metavar="TENANT=WEIGHT", help="repeatable"
        )
        parser.add_argument(
            "--quota",
            action="append",
            default=[],
            metavar="TENANT:GPU_TYPE=GUARANTEED:LIMIT",
            help="repeatable; GPU_TYPE 'any' caps all types together",
        )
        parser.add_argument(
            "--power-budget",
            action="append",
            default=[],
            metavar="POOL=WATTS",
            help="repeatable; POOL=none removes the pool's budget",
        )
        parser.add_argument(
            "--cycle-s", type=float, help="scheduling tick of the replay (default: production's)"
        )
        parser.add_argument("--out", help="folder for report.md and the plots")
        parser.add_argument("--no-plots", action="store_true", help="with --out: no PNG plots")

    def handle(self, *args, **options):
        try:
            params = build_params(
                since=options["since"],
                until=options["until"],
                policy=options["policy"],
                weights=options["weight"],
                quotas=options["quota"],
                power_budgets=options["power_budget"],
                cycle_s=options["cycle_s"],
            )
            outcome = run_whatif(params, progress=self._progress_bar())
        except WhatIfError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(report_of(params, summary_json(outcome)).markdown())
        if options["out"]:
            path = write_folder(outcome, options["out"], plots=not options["no_plots"])
            self.stderr.write(f"wrote {path}")

    def _progress_bar(self):
        if not sys.stderr.isatty():
            return None

        def show(fraction: float) -> None:
            sys.stderr.write(f"\rreplaying: {100 * fraction:5.1f} %")
            if fraction >= 1.0:
                sys.stderr.write("\n")
            sys.stderr.flush()

        return show
