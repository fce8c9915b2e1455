"""Passwords: Django's standard validators (similar to the account, shorter than 12 characters,
common, all digits) wherever a password is set, and the demo's passwords pass them."""

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.management import CommandError, call_command
from django.test import Client

from controlplane.demo import seed_demo

pytestmark = pytest.mark.django_db

STRONG = "correct-horse-battery-staple-7"

WEAK = [
    ("short-1a", "too short. It must contain at least 12 characters"),
    ("password1234", "too common"),
    ("314159265358979", "entirely numeric"),
    ("dana.mueller-lab", "too similar to the username"),
]


@pytest.fixture
def admin_client(cluster_admin):
    client = Client()
    client.force_login(cluster_admin)
    return client


@pytest.mark.parametrize("password, why", WEAK, ids=[w[1].split(".")[0] for w in WEAK])
def test_the_admin_refuses_a_weak_password_for_a_new_account_and_says_why(
    admin_client, password, why
):
    response = admin_client.post(
        "/admin/auth/user/add/",
        {
            "username": "dana.mueller-lab",
            "password1": password,
            "password2": password,
            "usable_password": "true",
        },
    )
    assert response.status_code == 200
    assert why in response.content.decode()
    assert not get_user_model().objects.filter(username="dana.mueller-lab").exists()


def test_the_admin_accepts_a_strong_password(admin_client):
    response = admin_client.post(
        "/admin/auth/user/add/",
        {
            "username": "dana.mueller-lab",
            "password1": STRONG,
            "password2": STRONG,
            "usable_password": "true",
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    user = get_user_model().objects.get(username="dana.mueller-lab")
    assert user.check_password(STRONG)


@pytest.mark.parametrize("password, why", WEAK, ids=[w[1].split(".")[0] for w in WEAK])
def test_the_admin_refuses_a_weak_password_change(admin_client, make_user, password, why):
    dana = make_user("dana.mueller-lab")
    response = admin_client.post(
        f"/admin/auth/user/{dana.pk}/password/",
        {"password1": password, "password2": password, "usable_password": "true"},
    )
    assert response.status_code == 200
    assert why in response.content.decode()
    dana.refresh_from_db()
    assert dana.check_password("pw-for-tests-1")


@pytest.mark.parametrize("password, why", WEAK, ids=[w[1].split(".")[0] for w in WEAK])
def test_changepassword_refuses_a_weak_password(make_user, monkeypatch, password, why):
    from django.contrib.auth.management.commands import changepassword

    make_user("dana.mueller-lab")
    monkeypatch.setattr(changepassword.getpass, "getpass", lambda prompt="": password)
    with pytest.raises(CommandError, match="after 3 attempts"):
        call_command("changepassword", "dana.mueller-lab")
    assert (
        get_user_model().objects.get(username="dana.mueller-lab").check_password("pw-for-tests-1")
    )


def test_the_demo_accounts_passwords_pass_the_validators_and_sign_in():
    created = seed_demo()
    assert set(created) == {
        "admin",
        "vision-admin",
        "vision-researcher",
        "nlp-admin",
        "nlp-researcher",
    }
    User = get_user_model()
    for username, password in created.items():
        validate_password(password, User.objects.get(username=username))
        client = Client()
        response = client.post("/login/", {"username": username, "password": password})
        assert response.status_code == 302, username


@pytest.mark.parametrize("password, why", WEAK, ids=[w[1].split(".")[0] for w in WEAK])
def test_a_scripted_createsuperuser_refuses_a_weak_password(monkeypatch, password, why):
    monkeypatch.setenv("DJANGO_SUPERUSER_PASSWORD", password)
    with pytest.raises(CommandError, match=why.split(".")[0]):
        call_command(
            "createsuperuser",
            interactive=False,
            username="dana.mueller-lab",
            email="dana@example.org",
            verbosity=0,
        )
    assert not get_user_model().objects.filter(username="dana.mueller-lab").exists()


def test_a_scripted_createsuperuser_takes_a_strong_password(monkeypatch):
    monkeypatch.setenv("DJANGO_SUPERUSER_PASSWORD", STRONG)
    call_command(
        "createsuperuser",
        interactive=False,
        username="dana.mueller-lab",
        email="dana@example.org",
        verbosity=0,
    )
    assert get_user_model().objects.get(username="dana.mueller-lab").check_password(STRONG)
