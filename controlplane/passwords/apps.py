from django.apps import AppConfig


class PasswordsConfig(AppConfig):
    name = "controlplane.passwords"
    label = "passwords"
