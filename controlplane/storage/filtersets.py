import django_filters

from controlplane.filters import FilterSet
from controlplane.storage.models import Volume, VolumeKind


class VolumeFilterSet(FilterSet):
    kind = django_filters.ChoiceFilter(choices=VolumeKind.choices)
    checkpoints = django_filters.BooleanFilter(help_text="True: only the checkpoint volume")

    class Meta:
        model = Volume
        fields = ["kind", "checkpoints"]
