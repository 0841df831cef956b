"""A fake NVML (the few pynvml functions `runtime/energy.py` and `runtime/clocks.py` call): energy counters that
advance as a test says, clock locks recorded, and a permission error where a test asks for one. No GPU is touched."""


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    NO_PERMISSION = 4
    NOT_SUPPORTED = 3

    def __init__(self, gpus: int = 2, permission: bool = True, energy_supported: bool = True):
        self.energy_mj = [1_000_000 * (i + 1) for i in range(gpus)]
        self.locked: dict[int, tuple[int, int]] = {}
        self.calls: list[tuple] = []
        self.permission = permission
        self.energy_supported = energy_supported

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.energy_mj):
            raise NVMLError(2)
        return index

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        if not self.energy_supported:
            raise NVMLError(self.NOT_SUPPORTED)
        return self.energy_mj[handle]

    def nvmlDeviceSetGpuLockedClocks(self, handle: int, low: int, high: int) -> None:
        self.calls.append(("lock", handle, low, high))
        if not self.permission:
            raise NVMLError(self.NO_PERMISSION)
        self.locked[handle] = (low, high)

    def nvmlDeviceResetGpuLockedClocks(self, handle: int) -> None:
        self.calls.append(("reset", handle))
        self.locked.pop(handle, None)
