"""The web UI's forms. They render fields; the rules they enforce are the API's own.

- The job form parses its text inputs into the JSON types the API takes and then calls
  `controlplane.jobs.validation.validate_submission`, so both refuse the same input with the same
  words.
- The admin forms (`ActionForm`) read their inputs into typed values, check them with the rules
  the REST API's serializers call (`controlplane.tenancy.rules`, `controlplane.cluster.rules`),
  show a refusal at the field it names, and save through the app's actions: one copy of
  "limit >= guaranteed", and every change audited.
"""

from __future__ import annotations

import json
import shlex
from abc import ABCMeta, abstractmethod

from django import forms
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.forms.forms import DeclarativeFieldsMetaclass
from django.http import Http404

from controlplane.cluster import actions as cluster_actions
from controlplane.cluster import rules as cluster_rules
from controlplane.jobs import arrays, validation
from controlplane.jobs.models import JobState, PriorityClass
from controlplane.queries import (
    DEFAULT_JOB_SORT,
    JOB_SORTS,
    JobFilter,
    known_gpu_types,
    node_runtimes,
)
from controlplane.tenancy import actions as tenancy_actions
from controlplane.tenancy import rules as tenancy_rules
from controlplane.tenancy.models import (
    Budget,
    BudgetAction,
    BudgetKind,
    BudgetPeriod,
    Quota,
    Role,
    Tenant,
    TokenRequestRefused,
    token_grant,
)
from controlplane.validators import problems_in_query_dict, refuse_unstorable_text

# --- the job list's filters --------------------------------------------------------------------


class JobFilterForm(forms.Form):
    """The job list's query string. A value it cannot use is an error on the page (400), not a
    filter silently dropped, nor text that reaches the database."""

    state = forms.ChoiceField(
        required=False,
        choices=[("", "Any"), ("active", "Active"), ("finished", "Finished")]
        + [(s, s) for s in JobState.values],
    )
    name = forms.CharField(required=False, max_length=200, validators=[refuse_unstorable_text])
    user = forms.CharField(required=False, max_length=150, validators=[refuse_unstorable_text])
    tenant = forms.SlugField(required=False, max_length=50)
    sort = forms.ChoiceField(required=False, choices=[(s, s) for s in JOB_SORTS])

    def job_filter(self) -> JobFilter:
        """The filter to apply: the valid values, with those in error left out."""
        self.is_valid()  # cleaned_data keeps the fields that passed
        data = self.cleaned_data
        return JobFilter(
            state=data.get("state", ""),
            user=data.get("user", ""),
            name=data.get("name", ""),
            tenant=data.get("tenant", ""),
            sort=data.get("sort") or DEFAULT_JOB_SORT,
        )


# --- job submission ---------------------------------------------------------------------------

NUMBER = forms.NumberInput


class JobSubmitForm(forms.Form):
    tenant = forms.CharField(widget=forms.Select, help_text="The team whose quota the job uses.")
    name = forms.CharField(
        required=False,
        max_length=validation.MAX_NAME_CHARS + 1,  # let the shared rule say "at most 200"
        help_text="Leave empty to name the job after its image.",
    )
    image = forms.CharField(
        required=False,
        help_text="registry/name:tag, e.g. registry.local/team/train:1",
        widget=forms.TextInput(attrs={"spellcheck": "false", "autocomplete": "off"}),
    )
    command = forms.CharField(
        required=False,
        help_text='As in a shell: python train.py --epochs 3 (or a JSON list: ["python", "train.py"]).',
        widget=forms.TextInput(attrs={"spellcheck": "false", "autocomplete": "off"}),
    )
    env = forms.CharField(
        required=False,
        label="Environment",
        help_text="One KEY=value per line.",
        widget=forms.Textarea(attrs={"rows": 3, "spellcheck": "false"}),
    )
    gpus = forms.CharField(
        label="GPUs",
        initial=validation.DEFAULTS["gpus"],
        widget=NUMBER(attrs={"min": 0, "step": 1}),
        required=False,
    )
    gpu_type = forms.CharField(
        label="GPU type",
        required=False,
        widget=forms.Select,
        help_text="Any type: the first that fits.",
    )
    cpus = forms.CharField(
        label="CPUs",
        initial=validation.DEFAULTS["cpus"],
        widget=NUMBER(attrs={"min": 0, "step": "any"}),
        required=False,
    )
    memory_mib = forms.CharField(
        label="Memory (MiB)",
        initial=validation.DEFAULTS["memory_mib"],
        widget=NUMBER(attrs={"min": 1, "step": 1}),
        required=False,
    )
    priority = forms.CharField(
        initial=validation.DEFAULTS["priority"],
        widget=forms.Select(choices=PriorityClass.choices),
        required=False,
    )
    preemptible = forms.BooleanField(
        required=False,
        initial=validation.DEFAULTS["preemptible"],
        help_text="May run on borrowed GPUs beyond the guarantee, and be preempted there.",
    )
    restartable = forms.BooleanField(
        required=False,
        initial=validation.DEFAULTS["restartable"],
        help_text="Checkpoints: may be requeued after preemption or a lost node.",
    )
    max_runtime_s = forms.CharField(
        label="Max runtime (s)",
        initial=validation.DEFAULTS["max_runtime_s"],
        widget=NUMBER(attrs={"min": 1, "step": 1}),
        required=False,
        help_text="Stopped after this long. 86400 s = 1 day.",
    )
    estimated_duration_s = forms.CharField(
        label="Estimated duration (s)",
        widget=NUMBER(attrs={"min": 1, "step": 1}),
        required=False,
        help_text="Optional; helps short jobs start sooner (backfill).",
    )
    mounts = forms.CharField(
        required=False,
        label="Volumes",
        help_text="One volume:/path per line; add :ro for read-only, e.g. datasets:/data:ro.",
        widget=forms.Textarea(attrs={"rows": 2, "spellcheck": "false"}),
    )
    stop_signal = forms.CharField(
        label="Stop signal",
        initial=validation.DEFAULTS["stop_signal"],
        widget=forms.Select(choices=[(s, s) for s in validation.STOP_SIGNALS]),
        required=False,
        help_text="Sent before any stop (preemption, cancel, drain); SIGKILL follows the grace.",
    )
    preemption_grace_s = forms.CharField(
        label="Grace (s)",
        widget=NUMBER(attrs={"min": 0, "step": 1}),
        required=False,
        help_text="Seconds to save and exit after the stop signal. Empty: the cluster default.",
    )
    checkpoint_interval_s = forms.CharField(
        label="Checkpoints every (s)",
        widget=NUMBER(attrs={"min": 1, "step": 1}),
        required=False,
        help_text="Optional: how often the job checkpoints (what a preemption would lose).",
    )
    array = forms.CharField(
        label="Array",
        required=False,
        help_text="Optional: submit a sweep, one task per index: a count (100 = 0-99) or "
        "indexes (0-99, 1,3,5-9, 0-99:2). Each task finds its index in GPUCP_ARRAY_INDEX; "
        "{{array_index}} and {{array_size}} in the command or env become its own.",
        widget=forms.TextInput(attrs={"spellcheck": "false", "autocomplete": "off"}),
    )
    max_parallel = forms.CharField(
        label="Max parallel tasks",
        widget=NUMBER(attrs={"min": 1, "step": 1}),
        required=False,
        help_text="With an array: at most this many tasks run at once. Empty: no limit.",
    )

    depends_on = forms.CharField(
        required=False,
        label="Start after",
        help_text="One per line: job 12 (once it succeeded), job 12 failed, job 12 finished "
        "(either way), or array 5 with the same words (every task).",
        widget=forms.Textarea(attrs={"rows": 2, "spellcheck": "false"}),
    )

    def __init__(self, *args, user, tenants, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.user = user
        self.tenants = list(tenants)
        self.fields["tenant"].widget.choices = [
            (t.slug, f"{t.name} ({t.slug})") for t in self.tenants
        ]
        if len(self.tenants) == 1:
            self.fields["tenant"].initial = self.tenants[0].slug
        self.fields["gpu_type"].widget.choices = [("", "Any type")] + [
            (t, t) for t in known_gpu_types()
        ]
        if node_runtimes() == {"process"}:
            # The embedded mode (and any cluster of process-runtime nodes) runs the command on
            # the node's host: a newcomer looking for "the image that works here" learns there
            # is none to find.
            self.fields["image"].help_text = (
                "This cluster's nodes run the command directly on their hosts (the process "
                "runtime): the image is recorded but not pulled, so any name works, e.g. "
                "localhost/busybox:latest."
            )
        self.submission: validation.Submission | None = None
        # With an array: (spec, indexes, max_parallel), as jobs.arrays.submit_array takes them.
        self.array_request: tuple[str, list[int], int | None] | None = None
        self.mount_lines: list[int] = []
        self.dependency_lines: list[int] = []

    def selected_tenant(self):
        slug = (self.data.get("tenant") if self.is_bound else None) or self.initial.get(
            "tenant", self.fields["tenant"].initial
        )
        return next(
            (t for t in self.tenants if t.slug == slug), self.tenants[0] if self.tenants else None
        )

    def api_payload(self) -> tuple[dict, dict[str, str]]:
        """The JSON body this form stands for, and the inputs that could not be read at all."""
        raw = self.data if self.is_bound else {}
        problems: dict[str, str] = {}
        body: dict = {}

        def text(name: str) -> str:
            if self.is_bound:
                return (raw.get(name) or "").strip()
            value = self.initial.get(name, self.fields[name].initial)
            return "" if value is None else str(value)

        body["tenant"] = text("tenant")
        body["name"] = text("name")
        body["image"] = text("image")
        body["command"], problem = parse_command(text("command"))
        if problem:
            problems["command"] = problem
        body["env"], problem = parse_env(raw.get("env", "") if self.is_bound else text("env"))
        if problem:
            problems["env"] = problem
        for name in ("gpus", "memory_mib", "max_runtime_s"):
            body[name] = parse_number(text(name))
        body["cpus"] = parse_number(text("cpus"))
        body["gpu_type"] = text("gpu_type")
        body["priority"] = text("priority") or validation.DEFAULTS["priority"]
        for name in ("preemptible", "restartable"):
            if self.is_bound:
                body[name] = self.fields[name].widget.value_from_datadict(raw, self.files, name)
            else:
                body[name] = bool(self.initial.get(name, self.fields[name].initial))
        estimate = text("estimated_duration_s")
        body["estimated_duration_s"] = parse_number(estimate) if estimate else None
        # The job contract's fields only when given: the API's defaults are the same, and the
        # "copy as curl" body stays as short as what was asked.
        mounts, self.mount_lines, problem = parse_mounts(
            raw.get("mounts", "") if self.is_bound else text("mounts")
        )
        if problem:
            problems["mounts"] = problem
        if mounts:
            body["mounts"] = mounts
        signal = text("stop_signal")
        if signal and signal != validation.DEFAULTS["stop_signal"]:
            body["stop_signal"] = signal
        for name in ("preemption_grace_s", "checkpoint_interval_s"):
            value = text(name)
            if value:
                body[name] = parse_number(value)
        depends_on, self.dependency_lines, problem = parse_dependencies(
            raw.get("depends_on", "") if self.is_bound else text("depends_on")
        )
        if problem:
            problems["depends_on"] = problem
        if depends_on:
            body["depends_on"] = depends_on
        # An array goes to /api/v1/arrays/ with these two fields more.
        if text("array"):
            body["array"] = text("array")
            if text("max_parallel"):
                body["max_parallel"] = parse_number(text("max_parallel"))
        return body, problems

    def _field_of(self, name: str) -> tuple[str | None, str]:
        """The form field an error of the shared rules belongs on, and words to prefix it with:
        a mount's (mounts[1].path) goes on the volumes box, naming its line."""
        if name.startswith("mounts["):
            index = int(name[len("mounts[") : name.index("]")])
            line = self.mount_lines[index] if index < len(self.mount_lines) else index + 1
            return "mounts", f"Line {line}: "
        if name.startswith("depends_on["):
            index = int(name[len("depends_on[") : name.index("]")])
            lines = self.dependency_lines
            return "depends_on", f"Line {lines[index] if index < len(lines) else index + 1}: "
        return (name if name in self.fields else None), ""

    def clean(self):
        # Text the database cannot hold never reaches the tenant look-up or the shared rules.
        unstorable = problems_in_query_dict(self.data)
        for name, messages in unstorable.items():
            self.add_error(name if name in self.fields else None, messages)
        if unstorable:
            return self.cleaned_data
        body, problems = self.api_payload()
        for name, message in problems.items():
            self.add_error(name, message)
        if problems:
            return self.cleaned_data
        sweep = {k: body.pop(k) for k in ("array", "max_parallel") if k in body}
        try:
            self.submission = validation.validate_submission(self.user, body)
            if sweep:
                self.array_request = self._array(sweep, self.submission)
        except ValidationError as exc:
            for name, messages in exc.message_dict.items():
                field, prefix = self._field_of(name)
                self.add_error(field, [prefix + m for m in messages])
        except (Http404, PermissionDenied):
            # Another tenant's slug typed into the page: the same words as for a made-up one.
            self.add_error("tenant", "Choose one of your tenants.")
        return self.cleaned_data

    @staticmethod
    def _array(sweep: dict, submission: validation.Submission):
        """The array's spec, indexes and max_parallel, by the API's rules (jobs.arrays)."""
        spec, indexes = arrays.parse_spec(sweep["array"], limit=arrays.limit_for(submission.tenant))
        max_parallel = arrays.parse_max_parallel(sweep.get("max_parallel"), len(indexes))
        arrays.check_templates(submission.fields, indexes)
        return spec, indexes, max_parallel


def parse_command(text: str) -> tuple[list, str]:
    """A shell-like line (or a JSON list) into argv; the shared rules judge the result."""
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return [], f"Not a JSON list: {exc.msg} at character {exc.pos + 1}."
        return value, ""
    try:
        return shlex.split(text), ""
    except ValueError as exc:
        return [], f"Cannot split into words: {exc} (close every quote)."


def parse_env(text: str) -> tuple[dict, str]:
    env: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if "=" not in stripped:
            return env, f'Line {number} ("{stripped[:40]}") has no "=": write KEY=value.'
        key, _, value = stripped.partition("=")
        key = key.strip()
        if key in env:
            return env, f"{key} is set twice (lines before {number})."
        env[key] = value
    return env, ""


def parse_mounts(text: str) -> tuple[list[dict], list[int], str]:
    """ "volume:/path[:ro|:rw]" lines into the API's mounts, with each mount's line number;
    the shared rules judge the names and paths."""
    mounts: list[dict] = []
    lines: list[int] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        parts = stripped.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
            return (
                mounts,
                lines,
                (f'Line {number} ("{stripped[:40]}"): write volume:/path, or volume:/path:ro.'),
            )
        mount: dict = {"volume": parts[0].strip(), "path": parts[1].strip()}
        if len(parts) == 3:
            mount["read_only"] = parts[2] == "ro"
        mounts.append(mount)
        lines.append(number)
    return mounts, lines, ""


def parse_dependencies(text: str) -> tuple[list[dict], list[int], str]:
    """ "job 12 [succeeded|failed|finished]" or "array 5 ..." lines into the API's depends_on,
    with each item's line number; the shared rules judge the ids (a number the form cannot
    read is passed on as written, for them to name)."""
    items: list[dict] = []
    lines: list[int] = []
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "after":  # "after job 12 succeeded" reads as well
            words = words[1:]
        if len(words) not in (2, 3) or words[0] not in ("job", "array"):
            shown = line.strip()[:40]
            return items, lines, f'Line {number} ("{shown}"): write job 12, or job 12 failed.'
        item: dict = {words[0]: words[1]}
        if len(words) == 3:
            item["condition"] = words[2]
        items.append(item)
        lines.append(number)
    return items, lines, ""


def parse_number(text: str):
    """ "3" -> 3, "1.5" -> 1.5; anything else is passed on for the shared rule to name."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


# --- admin forms that save through actions ------------------------------------------------------

# The REST API's words for input it cannot read, so a form and the API say the same.
NOT_A_NUMBER = {"invalid": "A valid number is required."}
GIB = 2**30
NOT_AN_INTEGER = {"invalid": "A valid integer is required."}


def number_field(**kwargs) -> forms.FloatField:
    kwargs.setdefault("widget", NUMBER(attrs={"step": "any", "min": 0}))
    return forms.FloatField(error_messages=NOT_A_NUMBER, **kwargs)


def integer_field(**kwargs) -> forms.IntegerField:
    kwargs.setdefault("widget", NUMBER(attrs={"min": 0, "step": 1}))
    return forms.IntegerField(error_messages=NOT_AN_INTEGER, **kwargs)


def choice_field(name: str, choices, **kwargs) -> forms.ChoiceField:
    words = f'"%(value)s" is not a {name}; use one of {", ".join(choices.values)}.'
    return forms.ChoiceField(
        choices=choices.choices, error_messages={"invalid_choice": words}, **kwargs
    )


class _ActionFormType(DeclarativeFieldsMetaclass, ABCMeta):
    """Django's form metaclass with abstract methods: a form without `write` cannot be made."""


class ActionForm(forms.Form, metaclass=_ActionFormType):
    """A form for one object: typed fields, the shared rule in `check`, the action in `write`.

    `fixed_after_create` fields show but cannot change once the object exists, as in the API.
    Subclasses set `model` so a field's initial value is the model's default (which lives there
    only).
    """

    model: type | None = None
    fixed_after_create: tuple[str, ...] = ()

    def __init__(self, data=None, *, instance=None, actor=None, tenant=None, **kwargs):
        self.instance = instance
        self.actor = actor
        self.tenant = tenant
        initial = kwargs.pop("initial", {}) or {}
        if instance is not None:
            initial = {n: getattr(instance, n, None) for n in self.base_fields} | initial
        super().__init__(data, initial=initial, **kwargs)
        for name, field in self.fields.items():
            if instance is None and self.model is not None and name not in self.initial:
                default = tenancy_rules.default(self.model, name)
                if default is not None and default != "":
                    field.initial = default
        if instance is not None:
            for name in self.fixed_after_create:
                if name in self.fields:
                    self.fields[name].disabled = True
                    self.fields[name].help_text = "Fixed once created."
        self.saved = None

    def values(self) -> dict:
        """The typed values this form sets (fixed fields left out once the object exists)."""
        return {
            name: self.cleaned_data[name]
            for name, field in self.fields.items()
            if not field.disabled and name in self.cleaned_data
        }

    def _clean_fields(self):
        # Text the database cannot hold never reaches a field's look-up (a username) or a rule.
        unstorable = problems_in_query_dict(self.data)
        if not unstorable:
            return super()._clean_fields()
        by_key = {self.add_prefix(name): name for name in self.fields}
        for key, messages in unstorable.items():
            self.add_error(by_key.get(key), messages)

    def clean(self):
        if self.errors:
            return self.cleaned_data
        try:
            self.check(self.values())
        except ValidationError as exc:
            for name, messages in exc.message_dict.items():
                target = name if name in self.fields and not self.fields[name].disabled else None
                self.add_error(target, messages)
        return self.cleaned_data

    def check(self, values: dict) -> None:
        """The shared rule; raises ValidationError naming the fields at fault."""

    @abstractmethod
    def write(self, values: dict):
        """Create or change the object through its app's action; returns it."""

    def save(self):
        self.saved = self.write(self.values())
        return self.saved


class TenantForm(ActionForm):
    model = Tenant
    slug = forms.SlugField(
        max_length=63, help_text="Short name used in URLs and the API, e.g. vision."
    )
    name = forms.CharField(max_length=200)
    weight = number_field(help_text="Fair-share weight: 2 gets twice the borrowed capacity of 1.")
    active = forms.BooleanField(required=False, help_text="An inactive tenant takes no new jobs.")
    checkpoint_limit_gib = number_field(
        label="Checkpoint storage limit (GiB)",
        required=False,
        help_text="What its jobs' checkpoint directories may hold together; past it, new "
        "attempts may read their checkpoints but not write. Empty: no limit.",
    )
    max_array_size = integer_field(
        label="Largest job array",
        min_value=1,
        required=False,
        help_text="The most tasks one job array of the tenant may have. Empty: unchanged "
        "(1000 for a new tenant).",
    )

    def __init__(self, *args, instance=None, **kwargs):
        limit = getattr(instance, "checkpoint_limit_bytes", None)
        initial = {"checkpoint_limit_gib": None if limit is None else limit / GIB}
        kwargs["initial"] = initial | (kwargs.get("initial") or {})
        super().__init__(*args, instance=instance, **kwargs)

    def values(self) -> dict:
        values = super().values()
        if values.get("max_array_size") is None:
            values.pop("max_array_size", None)
        if "checkpoint_limit_gib" in values:
            gib = values.pop("checkpoint_limit_gib")
            values["checkpoint_limit_bytes"] = None if gib is None else round(gib * GIB)
        return values

    def check(self, values):
        try:
            tenancy_rules.check_tenant(values, self.instance)
        except ValidationError as exc:
            errors = exc.message_dict
            if "checkpoint_limit_bytes" in errors:
                # The form asks in GiB: say it in GiB, at its own field.
                errors.pop("checkpoint_limit_bytes")
                most = tenancy_rules.MAX_CHECKPOINT_LIMIT_BYTES // GIB
                errors["checkpoint_limit_gib"] = [f"Between 0 and {most} GiB, or empty."]
            raise ValidationError(errors) from None

    def write(self, values):
        if self.instance is None:
            return tenancy_actions.create_tenant(actor=self.actor, **values)
        return tenancy_actions.update_tenant(self.instance, actor=self.actor, **values)


class QuotaForm(ActionForm):
    model = Quota
    fixed_after_create = ("gpu_type",)
    gpu_type = forms.CharField(
        label="GPU type",
        required=False,
        max_length=64,
        help_text="A GPU model (e.g. H100-SXM-80GB), or empty for a cap over all types.",
    )
    guaranteed_gpus = integer_field(
        label="Guaranteed GPUs", help_text="Never preempted while the tenant stays within it."
    )
    limit_gpus = integer_field(
        label="Limit (GPUs)", help_text="How far it may borrow idle GPUs; at least the guarantee."
    )
    max_running_jobs = integer_field(
        label="Max running jobs", required=False, help_text="Empty: no cap."
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["gpu_type"].widget.attrs["list"] = "gpu-types"
        self.gpu_type_options = known_gpu_types()

    def check(self, values):
        tenancy_rules.check_quota(self.tenant, values, self.instance)

    def write(self, values):
        if self.instance is None:
            return tenancy_actions.create_quota(self.tenant, actor=self.actor, **values)
        return tenancy_actions.update_quota(self.instance, actor=self.actor, **values)


class BudgetForm(ActionForm):
    model = Budget
    fixed_after_create = ("kind",)
    kind = choice_field("kind", BudgetKind)
    period = choice_field("period", BudgetPeriod, initial=BudgetPeriod.MONTH)
    amount = number_field(help_text="kWh or GPU-hours per period, by kind.")
    action = choice_field(
        "action", BudgetAction, help_text="What the scheduler does once it is spent."
    )
    warn_at_fraction = number_field(
        label="Warn at (fraction)",
        widget=NUMBER(attrs={"step": "0.05", "min": 0, "max": 1}),
        help_text="0.8 warns at 80 % used.",
    )

    def check(self, values):
        tenancy_rules.check_budget(self.tenant, values, self.instance)

    def write(self, values):
        if self.instance is None:
            return tenancy_actions.create_budget(self.tenant, actor=self.actor, **values)
        return tenancy_actions.update_budget(self.instance, actor=self.actor, **values)


class MembershipForm(ActionForm):
    """A cluster admin's direct add (tenant admins invite instead), or a member's new role."""

    fixed_after_create = ("user",)
    user = forms.CharField(
        label="Username", max_length=150, widget=forms.TextInput(attrs={"autocomplete": "off"})
    )
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)

    def __init__(self, *args, instance=None, **kwargs):
        super().__init__(*args, instance=instance, **kwargs)
        if instance is not None:
            self.initial["user"] = instance.user.username

    def clean_user(self):
        username = self.cleaned_data["user"]
        user = get_user_model().objects.filter(is_active=True, username=username).first()
        if user is None:
            # The API's words for an unknown username.
            raise ValidationError(f"Object with username={username} does not exist.")
        return user

    def check(self, values):
        if self.instance is None:
            tenancy_rules.check_new_membership(self.tenant, values["user"])

    def write(self, values):
        if self.instance is None:
            return tenancy_actions.add_member(
                self.tenant, values["user"], values["role"], actor=self.actor
            )
        return tenancy_actions.change_membership_role(
            self.instance, values["role"], actor=self.actor
        )


class ApiTokenForm(ActionForm):
    """A token for the signed-in person (a session: no parent token limits it)."""

    name = forms.CharField(max_length=100, help_text="What it is for, e.g. laptop or CI.")
    expires_at = forms.DateTimeField(
        label="Expires at (UTC, optional)",
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
        help_text="Empty: the longest allowed (API_TOKEN_MAX_LIFETIME_DAYS). Revoke it when done.",
    )

    def check(self, values):
        try:
            token_grant(expires_at=values.get("expires_at"))
        except TokenRequestRefused as exc:
            raise ValidationError(exc.errors) from None

    def write(self, values):
        token, raw = tenancy_actions.issue_token(
            self.actor, values["name"], expires_at=values.get("expires_at")
        )
        token.raw_token = raw
        return token


class PoolForm(ActionForm):
    """A pool's power budget (its name is its agents' join target: not changed here)."""

    power_budget_w = number_field(
        label="Power budget (W)",
        required=False,
        help_text="Most watts the pool's GPUs may draw together. Empty: no budget.",
    )

    def check(self, values):
        cluster_rules.check_pool(values, self.instance)

    def write(self, values):
        return cluster_actions.set_pool_power_budget(
            self.instance, values["power_budget_w"], actor=self.actor
        )
