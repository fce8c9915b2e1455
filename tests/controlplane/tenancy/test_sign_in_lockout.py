"""Signing in: after LOGIN_FAILURE_LIMIT wrong passwords for a username from one address, that
username is refused from that address, right password or not, until the cool-off has passed;
the web sign-in form and the Django admin's alike. Through the real HTTP stack (test client)."""

import time

import pytest
from axes.models import AccessAttempt
from django.conf import settings as django_settings
from django.test import Client

PASSWORD = "pw-for-tests-1"  # the make_user fixture's
ATTACKER = "203.0.113.10"
ELSEWHERE = "198.51.100.4"

pytestmark = pytest.mark.django_db


def sign_in(client: Client, username: str, password: str, *, ip: str = ATTACKER, url="/login/"):
    return client.post(url, {"username": username, "password": password}, REMOTE_ADDR=ip)


def signed_in(client: Client) -> bool:
    return client.get("/api/v1/tenants/").status_code == 200


def test_sixty_wrong_passwords_then_the_right_one_is_refused(alice):
    client = Client()
    answers = [sign_in(client, "alice", f"guess-{i}") for i in range(60)]
    limit = django_settings.AXES_FAILURE_LIMIT
    assert limit < 60
    # Until the limit: the ordinary answer to a wrong password.
    assert {r.status_code for r in answers[: limit - 1]} == {200}
    assert "correct username and password" in answers[0].content.decode()
    # From then on: locked out, with how long, and the right password does not help.
    assert {r.status_code for r in answers[limit:]} == {429}
    right = sign_in(client, "alice", PASSWORD)
    assert right.status_code == 429
    page = right.content.decode()
    assert "Too many failed sign-ins for this username from your address" in page
    assert "15 minutes" in page
    assert int(right["Retry-After"]) == 900
    assert not signed_in(client)


def test_a_few_wrong_passwords_then_the_right_one_signs_in_and_starts_the_count_afresh(alice):
    client = Client()
    limit = django_settings.AXES_FAILURE_LIMIT
    for i in range(limit - 1):
        assert sign_in(client, "alice", f"guess-{i}").status_code == 200
    assert sign_in(client, "alice", PASSWORD).status_code == 302
    assert signed_in(client)
    client.logout()
    # The success cleared the failures: the same number of mistakes again is still not a lockout.
    for i in range(limit - 1):
        sign_in(client, "alice", f"again-{i}")
    assert sign_in(client, "alice", PASSWORD).status_code == 302


def lock_out(username: str, ip: str = ATTACKER) -> None:
    client = Client()
    for i in range(django_settings.AXES_FAILURE_LIMIT):
        sign_in(client, username, f"guess-{i}", ip=ip)
    assert sign_in(client, username, "one-more", ip=ip).status_code == 429


def test_the_lockout_is_of_the_username_from_that_address_only(alice, bob):
    lock_out("alice")
    # The victim, signing in from elsewhere, is not locked out by the attacker.
    victim = Client()
    assert sign_in(victim, "alice", PASSWORD, ip=ELSEWHERE).status_code == 302
    assert signed_in(victim)
    # Another person at the attacker's address (an office behind one NAT) is not either.
    colleague = Client()
    assert sign_in(colleague, "bob", PASSWORD, ip=ATTACKER).status_code == 302


def test_an_unknown_username_locks_out_the_same_way(db):
    lock_out("nobody-here")


def test_the_right_password_works_again_after_the_cool_off(alice, settings):
    settings.AXES_COOLOFF_TIME = 1 / 3600  # one second, in axes' hours
    lock_out("alice")
    client = Client()
    assert sign_in(client, "alice", PASSWORD).status_code == 429
    time.sleep(1.2)
    assert sign_in(client, "alice", PASSWORD).status_code == 302
    assert signed_in(client)


def test_with_the_default_cool_off_the_lockout_ends_fifteen_minutes_after_the_last_try(alice):
    from datetime import timedelta

    lock_out("alice")
    client = Client()
    assert sign_in(client, "alice", PASSWORD).status_code == 429
    # Fifteen minutes pass (the attempts' clock moved back rather than the test waiting).
    for attempt in AccessAttempt.objects.all():
        attempt.attempt_time -= timedelta(minutes=15, seconds=1)
        attempt.save(update_fields=["attempt_time"])
    assert sign_in(client, "alice", PASSWORD).status_code == 302


def test_the_django_admin_sign_in_is_locked_out_too(cluster_admin):
    client = Client()
    url = "/admin/login/?next=/admin/"
    for i in range(django_settings.AXES_FAILURE_LIMIT):
        sign_in(client, "root-admin", f"guess-{i}", url=url)
    refused = sign_in(client, "root-admin", PASSWORD, url=url)
    assert refused.status_code == 429
    assert "Too many failed sign-ins" in refused.content.decode()
    assert client.get("/admin/").status_code == 302  # still sent to sign in
    # And the web form refuses the same pair: it is one lockout, not one per form.
    assert sign_in(client, "root-admin", PASSWORD).status_code == 429


def test_a_cluster_admin_can_lift_a_lockout(alice, cluster_admin):
    from django.core.management import call_command

    lock_out("alice")
    call_command("axes_reset_username", "alice")
    assert sign_in(Client(), "alice", PASSWORD).status_code == 302
