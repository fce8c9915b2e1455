from django.apps import AppConfig


class StorageConfig(AppConfig):
    name = "controlplane.storage"
    label = "storage"
