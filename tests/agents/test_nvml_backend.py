"""The NVML backend, with only the pynvml module boundary replaced (there is no GPU here).

The fake board below answers in NVML's own units (milliwatts, millijoules, bytes) and fails
with pynvml's own NVMLError codes, so what is tested is the backend's conversion and mapping.
"""

from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml
import pytest

from agents.gpu import (
    GpuError,
    GpuInvalidArgument,
    GpuNoPermission,
    make_backend,
)
from agents.gpu.nvml import NvmlBackend, decode_throttle_reasons
from agents.gpu.simulated import SimulatedBackend

MIB = 1024 * 1024


@dataclass
class Board:
    uuid: str
    name: str = "NVIDIA H200"
    memory_total_b: int = 143771 * MIB
    memory_used_b: int = 1024 * MIB
    min_mw: int = 200_000
    max_mw: int = 700_000
    default_mw: int = 700_000
    limit_mw: int = 700_000
    power_mw: int = 123_456
    energy_mj: int = 987_654_321
    utilization_pct: int = 42
    temperature_c: int = 37
    sm_clock_mhz: int = 1980
    reasons: int = 0x4 | 0x1
    ecc_uncorrected: int = 0
    # pynvml function name -> NVML error code it fails with on this board
    fails: dict = field(default_factory=dict)
    writes: list = field(default_factory=list)


class FakeNvml:
    """The pynvml calls the backend makes, over a list of boards."""

    def __init__(self, monkeypatch, boards):
        self.boards = boards
        self.events: list = []
        self.init_error = None

        def on(name, fn):
            def call(*args):
                handle = args[0] if args else None
                if isinstance(handle, Board) and name in handle.fails:
                    raise pynvml.NVMLError(handle.fails[name])
                return fn(*args)

            monkeypatch.setattr(pynvml, name, call)

        def init():
            if self.init_error is not None:
                raise pynvml.NVMLError(self.init_error)

        def set_limit(board, limit_mw):
            if not board.min_mw <= limit_mw <= board.max_mw:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            board.writes.append(limit_mw)
            board.limit_mw = limit_mw

        def wait(_event_set, _timeout_ms):
            if not self.events:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            return self.events.pop(0)

        on("nvmlInit", init)
        on("nvmlShutdown", lambda: None)
        on("nvmlDeviceGetCount", lambda: len(self.boards))
        on("nvmlDeviceGetHandleByIndex", lambda i: self.boards[i])
        on("nvmlDeviceGetUUID", lambda b: b.uuid)
        on("nvmlDeviceGetName", lambda b: b.name)
        on(
            "nvmlDeviceGetMemoryInfo",
            lambda b: SimpleNamespace(total=b.memory_total_b, used=b.memory_used_b),
        )
        on("nvmlDeviceGetPowerManagementLimitConstraints", lambda b: [b.min_mw, b.max_mw])
        on("nvmlDeviceGetPowerManagementDefaultLimit", lambda b: b.default_mw)
        on("nvmlDeviceGetPowerManagementLimit", lambda b: b.limit_mw)
        on("nvmlDeviceGetEnforcedPowerLimit", lambda b: b.limit_mw)
        on("nvmlDeviceSetPowerManagementLimit", set_limit)
        on("nvmlDeviceGetUtilizationRates", lambda b: SimpleNamespace(gpu=b.utilization_pct))
        on("nvmlDeviceGetPowerUsage", lambda b: b.power_mw)
        on("nvmlDeviceGetTotalEnergyConsumption", lambda b: b.energy_mj)
        on("nvmlDeviceGetTemperature", lambda b, sensor: b.temperature_c)
        on("nvmlDeviceGetClockInfo", lambda b, clock: b.sm_clock_mhz)
        on("nvmlDeviceGetCurrentClocksEventReasons", lambda b: b.reasons)
        on("nvmlDeviceGetCurrentClocksThrottleReasons", lambda b: b.reasons)
        on("nvmlDeviceGetTotalEccErrors", lambda b, kind, counter: b.ecc_uncorrected)
        on("nvmlEventSetCreate", lambda: "event-set")
        on("nvmlDeviceRegisterEvents", lambda b, kinds, event_set: None)
        on("nvmlEventSetWait", wait)
        on("nvmlEventSetFree", lambda event_set: None)


@pytest.fixture
def boards():
    return [Board(uuid="GPU-aaaa"), Board(uuid="GPU-bbbb", name="NVIDIA H100 80GB HBM3")]


@pytest.fixture
def nvml(monkeypatch, boards):
    return FakeNvml(monkeypatch, boards)


def test_the_inventory_is_in_watts_and_mib_not_milliwatts_and_bytes(nvml):
    gpus = NvmlBackend().inventory()
    assert [(g.index, g.uuid, g.model) for g in gpus] == [
        (0, "GPU-aaaa", "NVIDIA H200"),
        (1, "GPU-bbbb", "NVIDIA H100 80GB HBM3"),
    ]
    assert gpus[0].memory_mib == 143771
    assert (gpus[0].power_min_w, gpus[0].power_max_w, gpus[0].power_default_w) == (
        200.0,
        700.0,
        700.0,
    )


def test_telemetry_turns_milliwatts_and_millijoules_into_watts_and_joules(nvml, boards):
    boards[0].reasons = 0x4 | 0x40
    reading = NvmlBackend().telemetry()[0]
    assert reading.healthy
    assert reading.power_draw_w == 123.456
    assert reading.power_cap_w == 700.0
    assert reading.energy_j == 987_654.321
    assert reading.memory_used_mib == 1024.0
    assert reading.utilization_pct == 42.0
    assert reading.temperature_c == 37.0
    assert reading.sm_clock_mhz == 1980.0
    assert reading.throttle_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    assert reading.ecc_errors == 0


def test_throttle_reason_bits_are_decoded_to_names():
    assert decode_throttle_reasons(0) == ()
    assert decode_throttle_reasons(0x1 | 0x4 | 0x8) == ("gpu_idle", "sw_power_cap", "hw_slowdown")
    assert decode_throttle_reasons(0x10000) == ("unknown_0x10000",)


def test_a_reading_the_board_does_not_support_is_none_never_zero(nvml, boards):
    boards[0].fails = {
        "nvmlDeviceGetTotalEnergyConsumption": pynvml.NVML_ERROR_NOT_SUPPORTED,
        "nvmlDeviceGetTotalEccErrors": pynvml.NVML_ERROR_NOT_SUPPORTED,
        "nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_NOT_SUPPORTED,
        "nvmlDeviceGetCurrentClocksEventReasons": pynvml.NVML_ERROR_NOT_SUPPORTED,
    }
    backend = NvmlBackend()
    reading = backend.telemetry()[0]
    assert reading.healthy
    assert reading.energy_j is None
    assert reading.ecc_errors is None
    assert reading.power_draw_w is None
    assert reading.throttle_reasons is None
    wire = reading.to_wire()
    assert wire["energy_j"] is None and wire["power_draw_w"] is None
    assert backend.energy_j("GPU-aaaa") is None
    assert reading.power_cap_w == 700.0


def test_an_older_driver_without_clock_event_reasons_falls_back_to_throttle_reasons(nvml, boards):
    boards[0].fails = {
        "nvmlDeviceGetCurrentClocksEventReasons": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    }
    boards[0].reasons = 0x20
    assert NvmlBackend().telemetry()[0].throttle_reasons == ("sw_thermal_slowdown",)


def test_a_lost_gpu_is_reported_unhealthy_and_the_others_still_read(nvml, boards):
    backend = NvmlBackend()
    boards[0].fails = {"nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_GPU_IS_LOST}
    lost, fine = backend.telemetry()
    assert lost.uuid == "GPU-aaaa"
    assert lost.healthy is False
    assert lost.power_draw_w is None and lost.energy_j is None
    assert "lost" in lost.message
    assert fine.healthy is True and fine.power_draw_w == 123.456


def test_a_critical_xid_marks_the_gpu_unhealthy(nvml, boards):
    backend = NvmlBackend()
    nvml.events.append(SimpleNamespace(device=boards[1], eventData=79))
    nvml.events.append(SimpleNamespace(device=boards[0], eventData=31))  # app error: not fatal
    first, second = backend.telemetry()
    assert first.healthy is True and first.xid_errors == (31,)
    assert second.healthy is False and second.xid_errors == (79,)
    assert "XID 79" in second.message
    # It stays unhealthy: a GPU that fell off the bus needs a reset, not another heartbeat.
    assert backend.telemetry()[1].healthy is False


def test_set_power_limit_writes_milliwatts_only_when_the_limit_changes(nvml, boards):
    backend = NvmlBackend()
    assert backend.set_power_limit("GPU-aaaa", 700.0) == 700.0
    assert boards[0].writes == []
    assert backend.set_power_limit("GPU-aaaa", 450.5) == 450.5
    assert boards[0].writes == [450_500]
    assert backend.set_power_limit("GPU-aaaa", 450.5) == 450.5
    assert boards[0].writes == [450_500]
    assert backend.enforced_power_limit_w("GPU-aaaa") == 450.5


def test_set_power_limit_reports_the_limit_the_board_enforces_afterwards(nvml, boards, monkeypatch):
    backend = NvmlBackend()

    def clamp_to_step(board, limit_mw):
        board.writes.append(limit_mw)
        board.limit_mw = limit_mw // 5000 * 5000  # some boards round to their own step

    monkeypatch.setattr(pynvml, "nvmlDeviceSetPowerManagementLimit", clamp_to_step)
    assert backend.set_power_limit("GPU-aaaa", 333.3) == 330.0


def test_a_dry_run_validates_against_the_constraints_and_writes_nothing(nvml, boards):
    backend = NvmlBackend()
    assert backend.set_power_limit("GPU-aaaa", 300.0, dry_run=True) == 700.0
    with pytest.raises(GpuInvalidArgument, match="outside 200.0..700.0 W"):
        backend.set_power_limit("GPU-aaaa", 150.0, dry_run=True)
    assert boards[0].writes == []
    assert boards[0].limit_mw == 700_000


def test_a_cap_outside_the_constraints_is_the_same_error_type_as_on_the_simulated_gpu(nvml):
    backend = NvmlBackend()
    with pytest.raises(GpuInvalidArgument):
        backend.set_power_limit("GPU-aaaa", 800.0)
    simulated = SimulatedBackend.from_spec("simulated:H100-SXM-80GB:1", node_name="n")
    with pytest.raises(GpuInvalidArgument):
        simulated.set_power_limit(simulated.inventory()[0].uuid, 800.0)


def test_no_permission_to_set_a_limit_is_a_typed_error(nvml, boards):
    boards[0].fails = {"nvmlDeviceSetPowerManagementLimit": pynvml.NVML_ERROR_NO_PERMISSION}
    backend = NvmlBackend()
    with pytest.raises(GpuNoPermission, match="Insufficient Permissions"):
        backend.set_power_limit("GPU-aaaa", 300.0)
    assert boards[0].limit_mw == 700_000


def test_nvml_refusing_a_value_is_an_invalid_argument(nvml, boards):
    # The constraints said yes, the driver said no (it knows limits NVML does not report).
    boards[0].fails = {"nvmlDeviceSetPowerManagementLimit": pynvml.NVML_ERROR_INVALID_ARGUMENT}
    with pytest.raises(GpuInvalidArgument):
        NvmlBackend().set_power_limit("GPU-aaaa", 300.0)


def test_a_board_without_settable_limits_reports_its_fixed_limit_as_its_range(nvml, boards):
    boards[1].fails = {
        "nvmlDeviceGetPowerManagementLimitConstraints": pynvml.NVML_ERROR_NOT_SUPPORTED
    }
    boards[1].default_mw = 250_000
    gpu = NvmlBackend().inventory()[1]
    assert (gpu.power_min_w, gpu.power_max_w, gpu.power_default_w) == (250.0, 250.0, 250.0)


def test_auto_uses_nvml_when_nvml_init_works(nvml):
    backend = make_backend("auto", node_name="n")
    assert backend.kind == "nvml" and backend.real_devices
    assert [g.uuid for g in backend.inventory()] == ["GPU-aaaa", "GPU-bbbb"]


def test_auto_falls_back_to_simulated_gpus_when_nvml_init_fails(nvml):
    nvml.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(GpuError, match="NVML unavailable"):
        make_backend("nvml", node_name="n")
    backend = make_backend("auto", node_name="n")
    assert backend.kind == "simulated" and not backend.real_devices
    assert len(backend.inventory()) == 8


def test_on_this_machine_without_a_gpu_auto_is_simulated():
    # No patching at all: the real nvmlInit() fails here, as on any host without the driver.
    backend = make_backend("auto", node_name="no-gpu-host")
    if backend.kind == "nvml":
        pytest.skip("this machine has an NVIDIA driver: auto rightly chose NVML")
    assert backend.kind == "simulated"
