"""The jobs endpoint: submit, list, detail, cancel, logs. Every write goes through jobs.actions.

A submit may carry an `Idempotency-Key` header (draft-ietf-httpapi-idempotency-key-header, as
Stripe does it): a retry with the same key gets the first job back, with `Idempotent-Replayed:
true`, never a second job; the same key with another body is a 422.

A submit's body may also be a JSON list of up to MAX_BATCH_JOBS job bodies: all of them are
created, in one transaction, or none. The answer is the list of jobs, in the order given; a
refusal names each item at fault by its index, `{"1": {"gpus": ["..."]}}`, and what is wrong
with the list as a whole under `non_field_errors`. A key then stands for the whole list: a
retry with it gets the same jobs back. Each job of a list counts as one request against the
user's rate.
"""

import base64
import contextlib
import hashlib
import json
import re
import threading
import time
from collections.abc import Mapping
from types import SimpleNamespace

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import Prefetch
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    PolymorphicProxySerializer,
    extend_schema,
    extend_schema_view,
)
from rest_framework import exceptions, mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.response import Response

from controlplane.jobs import actions, validation
from controlplane.jobs.api.not_found import UnknownTargetsAreNotFound
from controlplane.jobs.api.serializers import (
    JobDetailSerializer,
    JobLogsQuerySerializer,
    JobLogsSerializer,
    JobSerializer,
    JobSubmitSerializer,
    job_detail,
    submitted_job_detail,
)
from controlplane.jobs.filtersets import JobFilterSet
from controlplane.jobs.logs import (
    MAX_LOG_ANSWER_BYTES,
    complete_utf8_prefix,
    display_text,
    read_log_bytes,
    read_log_from,
)
from controlplane.jobs.models import (
    ACTIVE_ATTEMPT_STATES,
    Allocation,
    AttemptMember,
    Job,
    JobAttempt,
    JobEvent,
    SubmitKey,
)
from controlplane.permissions import (
    Conflict,
    Need,
    ScopedCreateMixin,
    ScopedViewSet,
    TenantScope,
    request_body,
)
from controlplane.tenancy import reads as tenancy_reads
from controlplane.tenancy.models import Membership, Role, Tenant
from controlplane.validators import NON_FIELD


def _memberships_with_tenants(user) -> list[Membership]:
    return tenancy_reads.memberships_with_tenants(user)


class ConflictSerializer(serializers.Serializer):
    detail = serializers.CharField()


# The most jobs one submit may carry: enough to make a sweep one request, few enough that its
# transaction and its answer (about 2 KiB a job) stay short.
MAX_BATCH_JOBS = 1000
# A refusal of a list names at most this many items: enough to fix them, and it stays small.
MAX_ITEMS_SHOWN = 50

IDEMPOTENCY_KEY = "Idempotency-Key"
REPLAYED = "Idempotent-Replayed"
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]{1,255}")


class IdempotencyKeyReused(exceptions.APIException):
    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_detail = "This Idempotency-Key was used with a different request body."
    default_code = "idempotency_key_reused"


def idempotency_key(request) -> str | None:
    """The request's Idempotency-Key, None without one; a 400 naming the header if malformed.

    The draft sends the key as a structured-field string ("..."), Stripe's clients send it
    bare: both name the same key.
    """
    raw = request.headers.get(IDEMPOTENCY_KEY)
    if raw is None:
        return None
    key = raw.strip()
    if len(key) >= 2 and key[0] == key[-1] == '"':
        key = re.sub(r'\\(["\\])', r"\1", key[1:-1])
    if not _PRINTABLE_ASCII.fullmatch(key):
        raise serializers.ValidationError(
            {IDEMPOTENCY_KEY: ["Must be 1 to 255 printable ASCII characters, e.g. a UUID."]}
        )
    return key


def request_sha256(body: Mapping | list) -> str:
    """The fingerprint of a request body: SHA-256 of its JSON with sorted keys, no spaces."""
    canonical = json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _chosen_attempt(job: Job, attempts: list[JobAttempt], wanted: int | None) -> JobAttempt | None:
    if wanted is None:
        return attempts[-1] if attempts else None
    chosen = next((a for a in attempts if a.number == wanted), None)
    if chosen is None:
        raise serializers.ValidationError({"attempt": [f"Job {job.pk} has no attempt {wanted}."]})
    return chosen


def _header_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


class AcceptHeaderOnly(DefaultContentNegotiation):
    """Chooses the answer's type by the Accept header alone. A `?format=` would be one more
    query parameter the API does not declare (and an unknown value a 404, not a 400)."""

    # The only setting the base class reads; None turns the query override off.
    settings = SimpleNamespace(URL_FORMAT_OVERRIDE=None)  # type: ignore[assignment]


class PlainTextRenderer(BaseRenderer):
    """text/plain: a log's text as it is; anything else (an error) as JSON text."""

    media_type = "text/plain"
    format = "txt"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if isinstance(data, str):
            return data.encode("utf-8", "surrogatepass")
        return json.dumps(data, ensure_ascii=False).encode()


# A follower's answer waits at most this long for new output, then answers what it has (often
# nothing) and the client asks again: short enough that no proxy times it out.
LOG_FOLLOW_WAIT_S = 15.0
# How often a waiting follower looks for new output: about the delay it adds to a line, far
# below an agent's shipping interval (its heartbeat).
LOG_FOLLOW_POLL_S = 0.25
# Followers of one web process that wait at once, each holding a thread and a database
# connection: the threads left over after the agents' watches (AGENT_WATCH_MAX_PER_PROCESS)
# also answer heartbeats and pages, so followers past this answer at once and their clients
# ask again a second later (gpucp does), which costs a request, not a thread.
LOG_FOLLOWERS_MAX_PER_PROCESS = 4
LOG_HEADER_PREFIX = "X-Log-"
_followers = threading.BoundedSemaphore(LOG_FOLLOWERS_MAX_PER_PROCESS)


@contextlib.contextmanager
def _follower_slot(follow: bool):
    """True inside when this answer may wait for output (a slot was free), else False."""
    if not follow or not _followers.acquire(blocking=False):
        yield False
        return
    try:
        yield True
    finally:
        _followers.release()


@extend_schema_view(
    create=extend_schema(
        request=PolymorphicProxySerializer(
            component_name="JobSubmitOneOrMany",
            serializers=[
                JobSubmitSerializer,
                JobSubmitSerializer(many=True),
            ],
            resource_type_field_name=None,
            many=False,
        ),
        parameters=[
            OpenApiParameter(
                IDEMPOTENCY_KEY,
                str,
                OpenApiParameter.HEADER,
                description=(
                    "A key of your choice (1-255 printable ASCII characters, e.g. a UUID) that "
                    "makes the submit safe to retry: a submit with a key you used in the last "
                    "24 hours (IDEMPOTENCY_KEY_TTL_S) creates nothing and answers the job the "
                    "first one created, with Idempotent-Replayed: true. Keys are per user. With "
                    "a list, the key stands for the whole list and replays all its jobs."
                ),
            ),
            OpenApiParameter(
                REPLAYED,
                str,
                OpenApiParameter.HEADER,
                response=[201],
                enum=["true"],
                description="Present when the answer is the job an earlier submit with the "
                "same Idempotency-Key created.",
            ),
        ],
        responses={
            201: PolymorphicProxySerializer(
                component_name="JobCreatedOneOrMany",
                serializers=[JobDetailSerializer, JobDetailSerializer(many=True)],
                resource_type_field_name=None,
                many=False,
            ),
            422: OpenApiResponse(
                OpenApiTypes.OBJECT,
                description="The Idempotency-Key was used before with a different body",
            ),
        },
        description=(
            "Submit a job. It is stored PENDING; 400 names every field at fault. With an "
            "Idempotency-Key header, retrying is safe: the same key never creates a second job. "
            f"The body may be a list of up to {MAX_BATCH_JOBS} jobs instead: all are created or "
            "none, the answer lists them in the order given, and a 400 names each item at fault "
            'by its index (0 first), e.g. {"1": {"gpus": ["..."]}}; what is wrong with the list '
            "as a whole is under non_field_errors. Each job of a list counts as one request "
            "against the rate limit."
        ),
    ),
)
class JobViewSet(
    UnknownTargetsAreNotFound,
    ScopedCreateMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    ScopedViewSet,
):
    """Jobs of the tenants you belong to."""

    queryset = Job.objects.select_related("tenant", "submitted_by").prefetch_related("dependencies")
    serializer_class = JobSerializer
    filterset_class = JobFilterSet
    ordering_fields = ["submitted_at", "id", "state", "name", "started_at", "finished_at"]
    scope = TenantScope("tenant")
    read_need = Need(Role.VIEWER)
    write_need = Need(Role.MEMBER)
    # A member cancels their own jobs; a tenant admin any job of the tenant.
    action_needs = {"cancel": Need(Role.MEMBER, own=True), "logs": Need(Role.VIEWER)}
    owner_field = "submitted_by"

    def filter_queryset(self, queryset):
        if self.action == "logs":
            # Its query parameters are the output's (offset, tail, follow), not the list's
            # filters; building the filter form cost a follower's every call a sixth of it.
            return queryset
        return super().filter_queryset(queryset)

    def get_queryset(self):
        queryset = super().get_queryset()
        if self.action == "logs":
            # A follower asks every half second: the job's dependencies are not in the answer.
            return queryset.prefetch_related(None)
        return self._with_detail(queryset) if self.action == "retrieve" else queryset

    @staticmethod
    def _with_detail(queryset):
        allocations = Allocation.objects.select_related("gpu__node").order_by("gpu__index")
        attempts = JobAttempt.objects.select_related("node").prefetch_related(
            Prefetch("allocations", queryset=allocations),
            Prefetch("members", queryset=AttemptMember.objects.select_related("node")),
        )
        return queryset.prefetch_related(
            Prefetch("attempts", queryset=attempts),
            Prefetch("events", queryset=JobEvent.objects.select_related("actor")),
        )

    def get_serializer_class(self):
        if self.action == "create":
            return JobSubmitSerializer
        if self.action in ("retrieve", "cancel"):
            return JobDetailSerializer
        return JobSerializer

    def tenant_for_create(self):
        self._tenant = self._submit_tenant(request_body(self.request).get("tenant"))
        return self._tenant

    def _submit_tenant(self, slug) -> Tenant:
        if not hasattr(self, "_member_tenants"):
            # The user's roles and their tenants in one query, instead of one for each.
            memberships = _memberships_with_tenants(self.request.user)
            self._tenant_roles = {m.tenant_id: m.role for m in memberships}
            self._member_tenants = {m.tenant_id: m.tenant for m in memberships}
        return validation.resolve_submit_tenant(
            self.request.user, slug, self.tenant_roles(), self._member_tenants
        )

    def get_serializer_context(self):
        context = super().get_serializer_context()
        context["tenant"] = getattr(self, "_tenant", None)
        return context

    def throttle_weight(self, request) -> int:
        """How many requests this one counts as against the rate: a list, one per job (one
        that is empty or too long does no work: it is refused at once, and counts one)."""
        if self.action == "create" and isinstance(request.data, list):
            if 1 <= len(request.data) <= MAX_BATCH_JOBS:
                return len(request.data)
        return 1

    def create(self, request, *args, **kwargs):
        if isinstance(request.data, list):
            return self._create_many(request, request.data)
        key = idempotency_key(request)
        if key is None:
            return super().create(request, *args, **kwargs)
        fingerprint = request_sha256(request_body(request))
        # Before any validation: a retry gets its job back even if the same body would be
        # refused now (a quota lowered, a node removed since).
        earlier = SubmitKey.objects.live().filter(user=request.user, key=key).first()
        if earlier is None:
            tenant = self.tenant_for_create()
            serializer = self.get_serializer(data=request.data)
            serializer.is_valid(raise_exception=True)
            earlier, submitted = actions.submit_job_once(
                tenant=tenant,
                user=request.user,
                key=key,
                request_sha256=fingerprint,
                **serializer.validated_data,
            )
            if submitted is not None:
                return Response(self._created(submitted), status=status.HTTP_201_CREATED)
        return self._replay(earlier, fingerprint)

    def _create_many(self, request, items: list) -> Response:
        key = idempotency_key(request)
        fingerprint = request_sha256(items)
        if key is not None:
            earlier = SubmitKey.objects.live().filter(user=request.user, key=key).first()
            if earlier is not None:
                return self._replay(earlier, fingerprint, size=len(items))
        submissions = self._valid_submissions(items)
        if key is None:
            jobs = actions.submit_jobs(user=request.user, submissions=submissions)
        else:
            row, jobs = actions.submit_jobs_once(
                user=request.user, key=key, request_sha256=fingerprint, submissions=submissions
            )
            if not jobs:
                return self._replay(row, fingerprint, size=len(items))
        return Response([self._created(job) for job in jobs], status=status.HTTP_201_CREATED)

    def _valid_submissions(self, items: list) -> list[tuple[Tenant, dict]]:
        """[(tenant, cleaned fields)] for the items, or the answer that refuses them all.

        As for one job, tenants first: another tenant's slug in any item is a 404 and a role too
        low a 403 (naming the item) before any field is looked at.
        """
        if not items:
            raise serializers.ValidationError({NON_FIELD: ["Send at least one job."]})
        if len(items) > MAX_BATCH_JOBS:
            raise serializers.ValidationError(
                {
                    NON_FIELD: [
                        f"At most {MAX_BATCH_JOBS} jobs per request; this list has "
                        f"{len(items)}. Send the rest in another."
                    ]
                }
            )
        errors: dict[int, dict[str, list[str]]] = {}
        tenants: dict[object, Tenant] = {}
        chosen: list[Tenant | None] = []
        for i, item in enumerate(items):
            if not isinstance(item, Mapping):
                errors[i] = {NON_FIELD: ["Must be a JSON object with the job's fields as keys."]}
                chosen.append(None)
                continue
            slug = item.get("tenant")
            try:
                if not isinstance(slug, str | None):
                    raise DjangoValidationError({"tenant": ["Give the tenant's slug."]})
                if slug not in tenants:
                    tenants[slug] = self._submit_tenant(slug)
                chosen.append(tenants[slug])
            except DjangoValidationError as exc:
                errors[i] = exc.message_dict
                chosen.append(None)
            except Http404 as exc:
                raise exceptions.NotFound(f"Item {i}: {exc}") from None
            except DjangoPermissionDenied as exc:
                raise exceptions.PermissionDenied(f"Item {i}: {exc}") from None
        valid = [
            (i, item, t)
            for i, (item, t) in enumerate(zip(items, chosen, strict=True))
            if t is not None
        ]
        try:
            cleaned = validation.clean_submissions([(item, t) for _, item, t in valid])
        except validation.InvalidItems as exc:
            for j, found in exc.errors.items():
                errors.setdefault(valid[j][0], {}).update(found)
            cleaned = []
        if errors:
            raise serializers.ValidationError(
                {str(i): errors[i] for i in sorted(errors)[:MAX_ITEMS_SHOWN]}
            )
        return [(t, fields) for (_, _, t), fields in zip(valid, cleaned, strict=True)]

    def _replay(self, earlier: SubmitKey, fingerprint: str, size: int | None = None) -> Response:
        if earlier.request_sha256 != fingerprint:
            raise IdempotencyKeyReused(
                {
                    IDEMPOTENCY_KEY: [
                        "This key was used with a different request body. Send that body again "
                        "to get its job, or use a new key for a new job."
                    ]
                }
            )
        gone = exceptions.NotFound(
            "The job this Idempotency-Key created is not visible to you any more."
        )
        if size is None:
            try:
                data = self._detail(earlier.job_id)
            except Job.DoesNotExist:
                # Submitted to a tenant the user has left since: not theirs to see any more.
                raise gone from None
        else:
            batch = actions.batch_jobs(earlier.job, size)
            ids = [job.pk for job in batch or ()]
            visible = {
                job.pk: job for job in self._with_detail(self.get_queryset()).filter(pk__in=ids)
            }
            if not ids or len(visible) != len(ids):
                raise gone
            data = [self._shown(visible[pk]) for pk in ids]
        return Response(data, status=status.HTTP_201_CREATED, headers={REPLAYED: "true"})

    def perform_create(self, serializer, **extra):
        return actions.submit_one(
            tenant=extra["tenant"], user=self.request.user, **serializer.validated_data
        )

    def created_representation(self, serializer, instance):
        return self._created(instance)

    @staticmethod
    def _created(submitted: actions.Submitted) -> dict:
        # From the objects just written: what a GET of the job would answer, without the reads.
        return submitted_job_detail(submitted)

    def _detail(self, pk):
        return self._shown(self._with_detail(self.get_queryset()).get(pk=pk))

    @staticmethod
    def _shown(job: Job) -> dict:
        return job_detail(job)

    @extend_schema(
        request=None,
        responses={
            200: JobDetailSerializer,
            409: OpenApiResponse(ConflictSerializer, description="The job already finished"),
        },
    )
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        """Cancel a job. A running attempt is told to stop; its GPUs free when the agent confirms."""
        job = self.get_object()
        if job.is_finished:
            raise Conflict(
                f"Job {job.pk} already finished ({job.state}); there is nothing to cancel."
            )
        try:
            actions.cancel_job(job, actor=request.user)
        except (actions.IllegalTransition, actions.ConcurrentUpdate):
            job.refresh_from_db(fields=["state"])
            raise Conflict(
                f"Job {job.pk} changed while cancelling and is now {job.state}; nothing was cancelled."
            ) from None
        return Response(self._detail(job.pk))

    @extend_schema(
        # The type is chosen by the Accept header alone (AcceptHeaderOnly): no ?format=.
        parameters=[JobLogsQuerySerializer, OpenApiParameter("format", exclude=True)],
        responses={
            (200, "application/json"): JobLogsSerializer,
            (200, "text/plain"): OpenApiResponse(
                OpenApiTypes.STR,
                description=(
                    "With Accept: text/plain, the text alone; the other fields are headers: "
                    f"{LOG_HEADER_PREFIX}Attempt, -Offset, -Next-Offset, -Size-Bytes, "
                    "-Attempt-Finished, -Finished."
                ),
            ),
        },
    )
    @action(
        detail=True,
        methods=["get"],
        renderer_classes=[JSONRenderer, PlainTextRenderer],
        content_negotiation_class=AcceptHeaderOnly,
    )
    def logs(self, request, pk=None):
        """The output of one attempt (the latest by default): whole, its last `tail` lines, or
        what came after byte `offset`, waiting for more with `follow` (how `gpucp logs -f`
        streams a running job)."""
        job = self.get_object()
        query = JobLogsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        wanted = query.validated_data.get("attempt")
        tail = query.validated_data.get("tail")
        start = query.validated_data.get("offset")
        follow = query.validated_data["follow"]
        # Each member of a job over several nodes has its own output (rank 0 by default).
        rank = query.validated_data["rank"]
        if follow and start is None:
            start = 0
        with _follower_slot(follow) as waiting:
            deadline = time.monotonic() + LOG_FOLLOW_WAIT_S
            while True:
                job.refresh_from_db(fields=["state"])
                attempts = list(job.attempts.select_related("node").order_by("number"))
                chosen = _chosen_attempt(job, attempts, wanted)
                members = (
                    {m.rank: m.node.name for m in chosen.members.select_related("node")}
                    if chosen is not None
                    else {}
                )
                if chosen is not None and members and rank not in members:
                    raise serializers.ValidationError(
                        {"rank": [f"Attempt {chosen.number} has no member of rank {rank}."]}
                    )
                if chosen is None:
                    raw, size_bytes, truncated, next_offset = b"", 0, False, start or 0
                elif start is None:
                    raw, size_bytes, truncated = read_log_bytes(chosen, tail, rank)
                    next_offset = size_bytes
                else:
                    raw, next_offset, size_bytes = read_log_from(
                        chosen, start, MAX_LOG_ANSWER_BYTES, rank
                    )
                    truncated = False
                    if chosen.state in ACTIVE_ATTEMPT_STATES:
                        # The rest of a character cut at the end comes with the next read.
                        complete = complete_utf8_prefix(raw)
                        next_offset -= len(raw) - len(complete)
                        raw = complete
                attempt_finished = chosen is not None and chosen.state not in ACTIVE_ATTEMPT_STATES
                finished = (
                    job.is_finished
                    and (chosen is None or (chosen is attempts[-1] and attempt_finished))
                    and next_offset >= size_bytes
                )
                # Only a running attempt's output is waited for: before the first attempt the
                # wait could be as long as the queue, so the client polls instead.
                waiting_for_more = chosen is not None and not raw and not attempt_finished
                if not (waiting and waiting_for_more and time.monotonic() < deadline):
                    break
                time.sleep(LOG_FOLLOW_POLL_S)
        answer = {
            "job": job.pk,
            "attempt": chosen.number if chosen else None,
            "attempts": [a.number for a in attempts],
            "node": members.get(rank, chosen.node.name) if chosen else None,
            "rank": rank,
            "ranks": sorted(members),
            "tail": tail,
            "size_bytes": size_bytes,
            "truncated": truncated,
            "text": display_text(raw),
            "offset": next_offset - len(raw),
            "next_offset": next_offset,
            "attempt_finished": attempt_finished,
            "finished": finished,
        }
        if query.validated_data["encoding"] == "base64":
            # The text is for reading; a program that printed "\x00" literally reads the same
            # there as one that wrote a NUL. These are the bytes themselves.
            answer["data_b64"] = base64.b64encode(raw).decode("ascii")
        if isinstance(request.accepted_renderer, PlainTextRenderer):
            headers = {
                f"{LOG_HEADER_PREFIX}{name.replace('_', '-').title()}": _header_value(answer[name])
                for name in (
                    "attempt",
                    "offset",
                    "next_offset",
                    "size_bytes",
                    "attempt_finished",
                    "finished",
                )
            }
            return Response(answer["text"], headers=headers)
        return Response(answer)
