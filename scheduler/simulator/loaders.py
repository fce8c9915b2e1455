"""Trace loaders: Philly, Alibaba openb, and a path that holds either.

Every row is either loaded or rejected with a :class:`TraceError` naming the file, the line and
the field; rows a format says to leave out (Alibaba tasks without a GPU, tasks that never ran)
are counted in the trace's notes, never dropped in silence.
"""

from __future__ import annotations

import csv
from collections import Counter, defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from scheduler.model import ANY_GPU_TYPE
from scheduler.native import ROOT
from scheduler.simulator.trace import Trace, TraceJob, TraceNode, TraceTenant

# Beside the project's root; the data is read from there, never copied. (The root of the
# sources, not of this file: compiled, it lives in the build's directory.)
DEFAULT_DATA_DIR = ROOT.parent / "shared" / "data"
PHILLY_GPUS_PER_NODE = 8
# Philly ran P100 and P40 boards; the power model knows the P100, so every Philly GPU is one.
PHILLY_GPU_TYPE = "P100-PCIE-16GB"


class TraceError(ValueError):
    """A trace file that cannot be read as its format says: where, and what is wrong."""

    def __init__(self, path: Path | str, line: int, field: str, message: str):
        self.path = Path(path)
        self.line = line
        self.field = field
        super().__init__(f"{self.path.name} line {line}, field {field!r}: {message}")


def _rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV file with a header; the header must have ``required``."""
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise TraceError(path, 0, "(file)", f"cannot be opened: {exc.strerror}") from exc
    with handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise TraceError(path, 1, "(header)", "the file is empty")
        header = [h.strip() for h in header]
        for name in required:
            if name not in header:
                raise TraceError(path, 1, name, f"column missing from the header {header}")
        index = {name: header.index(name) for name in header}
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # a blank line (often the last) is not a job
            if len(row) != len(header):
                raise TraceError(
                    path,
                    reader.line_num,
                    header[min(len(row), len(header) - 1)],
                    f"{len(row)} values for {len(header)} columns",
                )
            yield reader.line_num, {name: row[i] for name, i in index.items()}


def _number(path: Path, line: int, field: str, text: str, *, minimum: float = 0.0) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(path, line, field, f"expected a number, got {text!r}") from None
    if not value >= minimum or value == float("inf"):
        raise TraceError(path, line, field, f"expected a number >= {minimum:g}, got {text!r}")
    return value


def _whole(path: Path, line: int, field: str, text: str, *, minimum: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceError(path, line, field, f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise TraceError(path, line, field, f"expected a whole number >= {minimum}, got {text!r}")
    return value


def _timestamp(path: Path, line: int, field: str, text: str) -> float:
    # fromisoformat would also take a bare date or an offset; the format has exactly one shape.
    if len(text) != 19 or text[10] != " ":
        raise TraceError(path, line, field, f"expected 'YYYY-MM-DD HH:MM:SS', got {text!r}")
    try:
        return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()
    except ValueError:
        raise TraceError(
            path, line, field, f"expected 'YYYY-MM-DD HH:MM:SS', got {text!r}"
        ) from None


def load_philly(
    jobs_csv: Path | str | None = None,
    vc_nodes_csv: Path | str | None = None,
    *,
    vcs_without_nodes: str = "drop",
    gpu_type: str = PHILLY_GPU_TYPE,
    max_rows: int | None = None,
) -> Trace:
    """The Philly job table, each virtual cluster a tenant guaranteed its nodes' GPUs.

    Jobs of a VC that has no row in the node file are dropped (``vcs_without_nodes="drop"``, as
    the published simulators of ANCHORS.md did: 15 jobs of 4 VCs) or given to a tenant with no
    guarantee of its own that can only borrow (``"borrow"``); either way the trace's notes say
    how many. ``max_rows`` reads only the first rows of the job file (a slice for tests).
    """
    if vcs_without_nodes not in ("drop", "borrow"):
        raise ValueError(f"vcs_without_nodes must be 'drop' or 'borrow', not {vcs_without_nodes!r}")
    jobs_path = Path(jobs_csv) if jobs_csv else DEFAULT_DATA_DIR / "philly" / "philly-jobs.csv"
    nodes_path = Path(vc_nodes_csv) if vc_nodes_csv else jobs_path.parent / "philly-vc-nodes.csv"

    vc_nodes: dict[str, int] = {}
    for line, row in _rows(nodes_path, ("vc", "node num")):
        vc = row["vc"].strip()
        if not vc:
            raise TraceError(nodes_path, line, "vc", "empty virtual cluster name")
        if vc in vc_nodes:
            raise TraceError(nodes_path, line, "vc", f"virtual cluster {vc!r} listed twice")
        vc_nodes[vc] = _whole(nodes_path, line, "node num", row["node num"], minimum=1)

    jobs: list[TraceJob] = []
    orphans: Counter[str] = Counter()
    for line, row in _rows(jobs_path, ("timestamp", "duration", "num_gpus", "cluster")):
        if max_rows is not None and line - 1 > max_rows:
            break
        submit_s = _timestamp(jobs_path, line, "timestamp", row["timestamp"])
        duration_s = _number(jobs_path, line, "duration", row["duration"])
        gpus = _whole(jobs_path, line, "num_gpus", row["num_gpus"], minimum=1)
        vc = row["cluster"].strip()
        if not vc:
            raise TraceError(jobs_path, line, "cluster", "empty virtual cluster name")
        if vc not in vc_nodes:
            orphans[vc] += 1
            if vcs_without_nodes == "drop":
                continue
        # Philly has no user id and no job name: the VC stands in for both.
        jobs.append(
            TraceJob(
                job_id=line - 1,
                tenant=vc,
                submit_s=submit_s,
                duration_s=duration_s,
                gpus=gpus,
                user=vc,
            )
        )
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))

    nodes = []
    for vc, count in vc_nodes.items():
        for k in range(count):
            nodes.append(TraceNode(f"{vc}-n{k:02d}", PHILLY_GPUS_PER_NODE, gpu_type, owner=vc))
    tenants = [TraceTenant(vc, count * PHILLY_GPUS_PER_NODE) for vc, count in vc_nodes.items()]
    notes = [
        f"{len(vc_nodes)} VCs, {len(nodes)} nodes of {PHILLY_GPUS_PER_NODE} GPUs "
        f"({len(nodes) * PHILLY_GPUS_PER_NODE:,} GPUs, modelled as {gpu_type}); "
        f"each VC is a tenant guaranteed its nodes' GPUs"
    ]
    if orphans:
        listed = ", ".join(f"{vc} ({n})" for vc, n in sorted(orphans.items()))
        what = (
            "dropped, as in ANCHORS.md"
            if vcs_without_nodes == "drop"
            else "kept as tenants with no guarantee (they only borrow)"
        )
        notes.append(
            f"{sum(orphans.values())} jobs of {len(orphans)} VCs without nodes {what}: {listed}"
        )
        if vcs_without_nodes == "borrow":
            tenants.extend(TraceTenant(vc, 0) for vc in sorted(orphans))
    return Trace("philly", tuple(jobs), tuple(nodes), tuple(tenants), tuple(notes))


# qos of an Alibaba task -> (priority, preemptible); a larger priority is served first.
ALIBABA_QOS = {
    "LS": (200, False),  # latency-sensitive services
    "Guaranteed": (200, False),
    "Burstable": (150, True),
    "BE": (100, True),  # best effort
}


def load_alibaba(
    pods_csv: Path | str | None = None,
    nodes_csv: Path | str | None = None,
) -> Trace:
    """The Alibaba openb trace: heterogeneous GPU types, GPU sharing, no tenant field.

    - Tenants: the trace has no team, so each ``qos`` class (LS, BE, Burstable, Guaranteed) is a
      tenant with a priority of its own; the cluster's GPUs are guaranteed to the classes in
      proportion to the GPU time each asks for.
    - Fractional GPUs (``gpu_milli`` < 1000): rounded up to one whole GPU each (the contract
      allocates whole GPUs), counted in the notes.
    - Tasks with ``num_gpu`` 0 use no GPU and are skipped; tasks never scheduled in the trace
      (``scheduled_time`` empty) have no run time and are skipped; both counted in the notes.
    - ``gpu_spec``: one type is a constraint; several alternatives ("V100M16|V100M32") become
      "any type", since a job asks for one type in the contract (counted in the notes).
    - Duration: ``deletion_time - scheduled_time``; submit: ``creation_time``.
    """
    data = DEFAULT_DATA_DIR / "alibaba-openb"
    pods_path = Path(pods_csv) if pods_csv else data / "openb_pod_list_default.csv"
    nodes_path = Path(nodes_csv) if nodes_csv else pods_path.parent / "openb_node_list_gpu_node.csv"

    nodes = []
    seen_nodes: set[str] = set()
    for line, row in _rows(nodes_path, ("sn", "cpu_milli", "memory_mib", "gpu", "model")):
        name = row["sn"].strip()
        if not name or name in seen_nodes:
            raise TraceError(nodes_path, line, "sn", f"empty or repeated node name {name!r}")
        seen_nodes.add(name)
        gpus = _whole(nodes_path, line, "gpu", row["gpu"], minimum=0)
        model = row["model"].strip()
        if gpus and not model:
            raise TraceError(nodes_path, line, "model", "a node with GPUs needs a GPU model")
        if gpus:
            nodes.append(
                TraceNode(
                    name,
                    gpus,
                    model,
                    cpus=_number(nodes_path, line, "cpu_milli", row["cpu_milli"]) / 1000.0,
                    memory_mib=_whole(nodes_path, line, "memory_mib", row["memory_mib"]),
                )
            )
    gpu_types = {n.gpu_type for n in nodes}

    required = (
        "name",
        "cpu_milli",
        "memory_mib",
        "num_gpu",
        "gpu_milli",
        "gpu_spec",
        "qos",
        "creation_time",
        "deletion_time",
        "scheduled_time",
    )
    jobs: list[TraceJob] = []
    skipped_no_gpu = skipped_never_ran = fractional = any_of_several = 0
    gpu_seconds_by_qos: defaultdict[str, float] = defaultdict(float)
    for line, row in _rows(pods_path, required):
        num_gpu = _whole(pods_path, line, "num_gpu", row["num_gpu"])
        gpu_milli = _whole(pods_path, line, "gpu_milli", row["gpu_milli"])
        qos = row["qos"].strip()
        if qos not in ALIBABA_QOS:
            raise TraceError(pods_path, line, "qos", f"expected one of {sorted(ALIBABA_QOS)}")
        created_s = _number(pods_path, line, "creation_time", row["creation_time"])
        deleted_s = _number(pods_path, line, "deletion_time", row["deletion_time"])
        if num_gpu == 0:
            skipped_no_gpu += 1
            continue
        if not row["scheduled_time"].strip():
            skipped_never_ran += 1
            continue
        scheduled_s = _number(pods_path, line, "scheduled_time", row["scheduled_time"])
        if deleted_s < scheduled_s:
            raise TraceError(
                pods_path, line, "deletion_time", f"{deleted_s:g} is before scheduled_time"
            )
        if gpu_milli > 1000 or (gpu_milli == 0):
            raise TraceError(pods_path, line, "gpu_milli", f"expected 1..1000, got {gpu_milli}")
        if gpu_milli < 1000:
            fractional += 1
        spec = [s for s in row["gpu_spec"].strip().split("|") if s]
        gpu_type = ANY_GPU_TYPE
        if len(set(spec)) == 1:
            gpu_type = spec[0]
            if gpu_type not in gpu_types:
                raise TraceError(pods_path, line, "gpu_spec", f"no node has GPU type {gpu_type!r}")
        elif spec:
            any_of_several += 1
        priority, preemptible = ALIBABA_QOS[qos]
        duration_s = deleted_s - scheduled_s
        gpu_seconds_by_qos[qos] += duration_s * num_gpu
        jobs.append(
            TraceJob(
                job_id=line - 1,
                tenant=qos,
                submit_s=created_s,
                duration_s=duration_s,
                gpus=num_gpu,
                user=qos,
                name=row["name"].strip(),
                gpu_type=gpu_type,
                priority=priority,
                preemptible=preemptible,
                cpus=_number(pods_path, line, "cpu_milli", row["cpu_milli"]) / 1000.0,
                memory_mib=_whole(pods_path, line, "memory_mib", row["memory_mib"]),
            )
        )
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))

    total_gpus = sum(n.gpus for n in nodes)
    total_demand = sum(gpu_seconds_by_qos.values()) or 1.0
    tenants = tuple(
        TraceTenant(qos, int(total_gpus * gpu_seconds_by_qos[qos] / total_demand))
        for qos in sorted(gpu_seconds_by_qos)
    )
    notes = (
        f"{len(nodes):,} nodes, {total_gpus:,} GPUs of types {', '.join(sorted(gpu_types))}",
        "tenants are the qos classes (no team in the trace), guaranteed GPUs in proportion to "
        "their GPU time: " + ", ".join(f"{t.name} {t.guaranteed_gpus}" for t in tenants),
        f"{fractional:,} fractional-GPU tasks (gpu_milli < 1000) rounded up to one whole GPU",
        f"{skipped_no_gpu:,} tasks with num_gpu 0 skipped (no GPU)",
        f"{skipped_never_ran:,} tasks never scheduled in the trace skipped (no run time)",
        f"{any_of_several:,} tasks allowed several GPU types: treated as any type",
    )
    return Trace(f"alibaba:{pods_path.name}", tuple(jobs), tuple(nodes), tenants, notes)


def load_trace(
    spec: str,
    *,
    seed: int = 0,
    vc_nodes: Path | str | None = None,
    node_list: Path | str | None = None,
) -> Trace:
    """A trace by name (``philly``, ``alibaba``, ``synthetic``) or by path (file or folder).

    ``vc_nodes``: the nodes per virtual cluster of a Philly-format jobs file (the CLI's
    ``--vc-nodes``), by default ``philly-vc-nodes.csv`` beside it; ``node_list``: the node list
    of an openb pod list (``--node-list``), by default ``openb_node_list_gpu_node.csv`` beside
    it. A companion that is neither given nor found beside the trace is an error that says
    which option gives it.
    """
    from scheduler.simulator.trace import synthetic_trace

    if spec == "synthetic":
        if vc_nodes is not None or node_list is not None:
            raise TraceError(spec, 0, "(options)", "the synthetic trace takes no node file")
        return synthetic_trace(seed)
    if spec == "philly":
        jobs_path = DEFAULT_DATA_DIR / "philly" / "philly-jobs.csv"
    elif spec in ("alibaba", "alibaba-openb"):
        jobs_path = DEFAULT_DATA_DIR / "alibaba-openb" / "openb_pod_list_default.csv"
    else:
        jobs_path = Path(spec)
        if jobs_path.is_dir():
            for name in ("philly-jobs.csv", "openb_pod_list_default.csv"):
                if (jobs_path / name).exists():
                    jobs_path = jobs_path / name
                    break
            else:
                raise TraceError(
                    jobs_path, 0, "(file)", "folder holds neither a Philly nor an openb trace"
                )
    if not jobs_path.exists():
        raise TraceError(
            jobs_path, 0, "(file)", "no such file (use philly, alibaba, synthetic or a path)"
        )
    with jobs_path.open(encoding="utf-8") as handle:
        header = handle.readline()
    if "num_gpus" in header and "cluster" in header:
        if node_list is not None:
            raise TraceError(
                jobs_path, 1, "(header)", "a Philly trace: --node-list is for openb, use --vc-nodes"
            )
        nodes = _companion(jobs_path, vc_nodes, "philly-vc-nodes.csv", "--vc-nodes")
        return load_philly(jobs_path, nodes)
    elif "gpu_milli" in header:
        if vc_nodes is not None:
            raise TraceError(
                jobs_path,
                1,
                "(header)",
                "an openb trace: --vc-nodes is for Philly, use --node-list",
            )
        nodes = _companion(jobs_path, node_list, "openb_node_list_gpu_node.csv", "--node-list")
        return load_alibaba(jobs_path, nodes)
    raise TraceError(jobs_path, 1, "(header)", "neither the Philly nor the openb pod-list columns")


def _companion(trace_path: Path, given: Path | str | None, default_name: str, option: str) -> Path:
    """The node file of a trace: the one given, else the one of the usual name beside it."""
    path = Path(given) if given is not None else trace_path.parent / default_name
    if not path.is_file():
        where = f"{path}" if given is not None else f"no {default_name} beside {trace_path.name}"
        raise TraceError(
            path,
            0,
            option,
            f"the node file of {trace_path.name} is missing ({where}); give it with {option} FILE",
        )
    return path
