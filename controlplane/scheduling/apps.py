from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "controlplane.scheduling"
    label = "scheduling"
